#!/usr/bin/env bash
# One call on the GPU machine that does what a session needs there, within its 10-minute limit:
#   1. the CI-matrix build and the GPU suite (scripts/gpu-check.sh), then compute-sanitizer
#      memcheck and racecheck on the world-4 case; the default-matrix build runs beside them;
#   2. the emulated benchmark of the FP8 output kinds (--quant) on one model, then of the models of
#      docs/performance.md at N = 8, 4, 2, until the deadline.
# Prepare here (Go is not on the GPU machine): go run ./gen --matrix ci --out build/ci/out and
# go run ./gen --out out, then run with carry ["build/ci/out", "out"]:
#   lab/scripts/gpu-session.sh $OUT
# Results under OUTDIR (the device tool returns at most 8 files): gpu.txt, build.log, pytest.log,
# validation.json, sanitizer-memcheck.log, sanitizer-racecheck.log and bench.tgz (one
# <kind>-<model>-w<N>/ folder per benchmark run: CSV, markdown, PNG, JSON; its log; build-default.log).
# Knobs (environment):
#   SKIP_CHECK=1      no suite, no sanitizer            SANITIZE=0   suite without the sanitizer
#   BENCH_TUNE=1      one-shot and two-shot only, a tuning row per run (tune-<model>-w<N>/)
#   BENCH_MODELS, BENCH_WORLDS   what to benchmark (default: the four models, N = 8 4 2)
#   BENCH_QUANT       FP8 kinds for --quant runs (default: fp8_static fp8_token fp8_group128; "" none)
#   BENCH_QUANT_MODEL, BENCH_QUANT_WORLD   where they run (default: deepseek-v3, 8)
#   BENCH_VLLM_TODAY=1  instead of the models: issue 13's "vLLM today" runs (--layout dense
#                     --weights-dtype none: vLLM's router-weighted rows; arfuse fused vs vLLM's
#                     moe_sum + copy + scale/shared + AR/norm) for the four models below at their N
#   BENCH_LADDER=1    first: issue 16's latency ladder (python -m arfuse.bench.ladder) for the four
#                     configurations of its table, T = LADDER_TOKENS (default 1,2,4,8,16)
#   BENCH_LOCAL=1     instead of the models: issue 21's world-size-1 runs (--world-size 1, the
#                     local algorithm) for the single-GPU models, on vLLM's router-weighted dense
#                     rows (arfuse vs arfuse's separate kernels vs "vLLM today" vs vLLM's own
#                     kernels where vLLM is importable: PYTHONPATH), and one permuted run
#   BENCH_ARGS        more arguments for every python -m arfuse.bench
#   PREBUILT=1        use the carried arfuse/_lib and build/ci/lib instead of building them here
#   DEADLINE_S        seconds from the start after which no run starts and a running one is cut
#                     (default 540)
#   BENCH_DIR         where the runs' folders go (default build/bench, emptied first)
#   RESUME=1          keep BENCH_DIR and skip the runs that finished there before (NAME.done): a
#                     set longer than one call goes on in the next call on the same warm machine
set -uo pipefail
out=${1:?usage: lab/scripts/gpu-session.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
deadline=${DEADLINE_S:-540}
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
left() { echo $(( deadline - ($(date +%s) - start) )); }

bench=${BENCH_DIR:-build/bench}; [ -n "${RESUME:-}" ] || rm -rf "$bench"; mkdir -p "$bench"
pack_bench() { tar czf "$out/bench.tgz" -C "$(dirname "$bench")" "$(basename "$bench")"; }
# The default build beside the CI build and the suite: the nvcc work of both overlaps.
# PREBUILT=1: the libraries (arfuse/_lib, build/ci/lib) were built elsewhere and carried.
if [ -n "${PREBUILT:-}" ] && [ -f arfuse/_lib/libarfuse_ops.so ]; then
  echo "PREBUILT: arfuse/_lib/libarfuse_ops.so as carried" >"$bench/build-default.log"; true &
else
  make lib GENDIR=out SKIP_GEN=1 PYTHON=python3 NVCC=${NVCC:-nvcc} JOBS=$(nproc) >"$bench/build-default.log" 2>&1 &
fi
default_build=$!

if [ -z "${SKIP_CHECK:-}" ]; then
  scripts/gpu-check.sh "$out" 2>&1 | tail -n 15
  if [ "${SANITIZE:-1}" != 0 ]; then
    ARFUSE_LIBRARY=$PWD/build/ci/lib/libarfuse_ops.so ARFUSE_MANIFEST=$PWD/build/ci/out/manifest.json \
      lab/scripts/gpu-sanitize.sh "$out" 120
  fi
  echo "check done at $(( $(date +%s) - start )) s"
fi

wait $default_build || { echo "default build failed"; tail -n 30 "$bench/build-default.log"; exit 1; }
echo "default build done at $(( $(date +%s) - start )) s"
export ARFUSE_LIBRARY=$PWD/arfuse/_lib/libarfuse_ops.so ARFUSE_MANIFEST=$PWD/out/manifest.json

one_run() {  # name, then python -m arfuse.bench arguments
  local name=$1; shift
  if [ -n "${RESUME:-}" ] && [ -f "$bench/$name.done" ]; then echo "$name: done before"; return 0; fi
  local t; t=$(left)
  [ "$t" -gt 15 ] || { echo "deadline: $name not run"; return 1; }
  timeout "$t" python3 -m arfuse.bench --emulate --dtype bf16 --layout permuted --replays 50 \
    --out "$bench/$name" "$@" ${BENCH_ARGS:-} >"$bench/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc at $(( $(date +%s) - start )) s: $(tail -n 1 "$bench/$name.log")"
  [ $rc = 0 ] && touch "$bench/$name.done"
  pack_bench   # after every run: a call cut off still returns what ran
}

if [ -n "${BENCH_LADDER:-}" ]; then
  for run in "deepseek-v3 8" "qwen3-235b-a22b 4" "qwen3-30b-a3b 2" "gpt-oss-120b 4"; do
    set -- $run
    t=$(left); [ "$t" -gt 15 ] || { echo "deadline: ladder $1 not run"; break; }
    timeout "$t" python3 -m arfuse.bench.ladder --model "$1" --world-size "$2" \
      --tokens "${LADDER_TOKENS:-1,2,4,8,16}" --out "$bench/ladder" >"$bench/ladder-$1-w$2.log" 2>&1
    echo "ladder $1 w$2: rc=$? at $(( $(date +%s) - start )) s"
    pack_bench
  done
fi

kind=bench; extra=()
if [ -n "${BENCH_TUNE:-}" ]; then kind=tune; extra=(--tune); BENCH_QUANT=""; fi
# The FP8 output kinds first (three short runs), then the models.
for q in ${BENCH_QUANT-fp8_static fp8_token fp8_group128}; do
  m=${BENCH_QUANT_MODEL:-deepseek-v3}; n=${BENCH_QUANT_WORLD:-8}
  one_run "quant-$q-$m-w$n" --model "$m" --world-size "$n" --quant "$q" \
    --impls arfuse,arfuse_q,arfuse_sepq || break
done
# Issue 13: the models whose finalize the plugin hands to arfuse (vLLM's TritonExperts rows), each
# at the TP size it is served with on H200s and with its own tail (DeepSeek-V3: shared expert,
# routed_scaling_factor 2.5; Qwen3-MoE and Mixtral: neither).
vllm_today_runs=(
  "deepseek-v3 8 --routed-scaling 2.5"
  "qwen3-235b-a22b 4 --no-shared"
  "qwen3-30b-a3b 2 --no-shared"
  "mixtral-8x7b 2 --no-shared"
)
if [ -n "${BENCH_VLLM_TODAY:-}" ]; then
  for run in "${vllm_today_runs[@]}"; do
    set -- $run
    model=$1 n=$2; shift 2
    one_run "vllm-today-$model-w$n" --model "$model" --world-size "$n" --layout dense \
      --weights-dtype none --impls arfuse,unfused,vllm_today "$@" || break
  done
  BENCH_MODELS=""
fi
# Issue 21: world size 1 (one GPU, no all-reduce), each model with its own tail (DeepSeek-V3:
# shared expert and routed scale 2.5; the others neither).
local_runs=(
  "qwen3-30b-a3b --no-shared"
  "gpt-oss-20b --no-shared"
  "mixtral-8x7b --no-shared"
  "llama-4-scout"
  "deepseek-v3 --routed-scaling 2.5"
)
if [ -n "${BENCH_LOCAL:-}" ]; then
  for run in "${local_runs[@]}"; do
    set -- $run
    model=$1; shift
    one_run "local-$model-w1" --model "$model" --world-size 1 --layout dense \
      --weights-dtype none --impls arfuse,unfused,vllm_today,vllm_ops "$@" || break
  done
  one_run "local-permuted-qwen3-30b-a3b-w1" --model qwen3-30b-a3b --world-size 1 \
    --impls arfuse,unfused,torch
  BENCH_MODELS=""
fi
for model in ${BENCH_MODELS-deepseek-v3 qwen3-235b-a22b qwen3-30b-a3b gpt-oss-120b}; do
  for n in ${BENCH_WORLDS:-8 4 2}; do
    one_run "$kind-$model-w$n" --model "$model" --world-size "$n" "${extra[@]}" || break 2
  done
done
pack_bench
echo "gpu-session: $(( $(date +%s) - start )) s"
