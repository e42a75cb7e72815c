#!/usr/bin/env bash
# One call on the GPU machine that does what a session needs there, within its 10-minute limit:
#   1. the CI-matrix build and the GPU suite (scripts/gpu-check.sh), then compute-sanitizer
#      memcheck and racecheck on the world-4 case;
#   2. the default-matrix build (the models' specialised instances) and the emulated benchmark for
#      the models of docs/performance.md at N = 2, 4, 8, until BENCH_BUDGET_S runs out.
# Prepare here (Go is not on the GPU machine): go run ./gen --matrix ci --out build/ci/out and
# go run ./gen --out out, then run with carry ["build/ci/out", "out"]:
#   scripts/gpu-session.sh $OUT
# Results under OUTDIR (the device tool returns at most 8 files): gpu.txt, build.log, pytest.log,
# validation.json, sanitizer-memcheck.log, sanitizer-racecheck.log and bench.tgz (one
# bench-<model>-w<N>/ folder per benchmark run: CSV, markdown, PNG, JSON, log; build-default.log).
# Knobs (environment): SKIP_CHECK=1 (no suite, no sanitizer), BENCH_TUNE=1 (one-shot and two-shot
# only, a tuning row per run: tune-<model>-w<N>/), BENCH_MODELS, BENCH_WORLDS, BENCH_BUDGET_S,
# GPU_CHECK_ALLOWANCE_S, BENCH_ARGS (more arguments for python -m arfuse.bench).
set -uo pipefail
out=${1:?usage: scripts/gpu-session.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32

if [ -z "${SKIP_CHECK:-}" ]; then   # SKIP_CHECK=1: only the default build and the benchmark
  scripts/gpu-check.sh "$out" 2>&1 | tail -n 15
  export ARFUSE_LIBRARY=$PWD/build/ci/lib/libarfuse_ops.so ARFUSE_MANIFEST=$PWD/build/ci/out/manifest.json
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_case.py \
      >"$out/sanitizer-$tool.log" 2>&1
    echo "sanitizer $tool: rc=$? $(tail -n 1 "$out/sanitizer-$tool.log")"
  done
fi

bench=build/bench; rm -rf "$bench"; mkdir -p "$bench"
make lib GENDIR=out SKIP_GEN=1 PYTHON=python3 NVCC=${NVCC:-nvcc} JOBS=$(nproc) >"$bench/build-default.log" 2>&1 \
  || { echo "default build failed"; tail -n 30 "$bench/build-default.log"; exit 1; }
export ARFUSE_LIBRARY=$PWD/arfuse/_lib/libarfuse_ops.so ARFUSE_MANIFEST=$PWD/out/manifest.json
budget=${BENCH_BUDGET_S:-300}
kind=bench; extra=()   # BENCH_TUNE=1: one-shot and two-shot only, and the tuning row of each run
if [ -n "${BENCH_TUNE:-}" ]; then kind=tune; extra=(--tune); fi
for model in ${BENCH_MODELS:-deepseek-v3 qwen3-235b-a22b qwen3-30b-a3b gpt-oss-120b}; do
  for n in ${BENCH_WORLDS:-8 4 2}; do
    left=$(( budget - ($(date +%s) - start) + ${GPU_CHECK_ALLOWANCE_S:-240} ))
    [ "$left" -gt 20 ] || { echo "bench budget spent before $model w$n"; break 2; }
    timeout "$left" python3 -m arfuse.bench --emulate --model "$model" --world-size "$n" \
      --dtype bf16 --layout permuted --replays 50 --out "$bench/$kind-$model-w$n" "${extra[@]}" \
      ${BENCH_ARGS:-} >"$bench/$kind-$model-w$n.log" 2>&1
    echo "$kind $model w$n: rc=$? $(tail -n 1 "$bench/$kind-$model-w$n.log")"
    tar czf "$out/bench.tgz" -C build bench   # after every run: a call cut off at its limit still returns what ran
  done
done
tar czf "$out/bench.tgz" -C build bench
echo "gpu-session: $(( $(date +%s) - start )) s"
