#!/usr/bin/env bash
# Issue 7 on a node of several GPUs (one process per GPU under torchrun), in one command:
#   scripts/multigpu.sh OUTDIR
# Prepare here (Go is not on the GPU machine): go run ./gen --out out and
# go run ./gen --matrix ci --out build/ci/out; carry ["out", "build/ci/out"] (and ".whl" with the
# FlashInfer wheels, if any). See docs/multigpu.md.
#   1. builds the default matrix (arfuse/_lib, from out/) and the CI matrix (build/ci/lib, from
#      build/ci/out) side by side: make lib SKIP_GEN=1 ..., as lab/scripts/gpu-session.sh does;
#   2. installs carried wheels (.whl/*.whl: flashinfer-python and what it lacks) into /tmp/site;
#   3. check: torchrun --nproc-per-node N -m arfuse.check for each N, against the default
#      build, then the CI build (its fp32 and FP8-static instances);
#   4. tune: torchrun --nproc-per-node N -m arfuse.bench --model M --tune (dispatch thresholds);
#   5. bench: torchrun --nproc-per-node N -m arfuse.bench --model M (arfuse, unfused, NCCL +
#      PyTorch, FlashInfer pattern 7 and finalize + pattern 1 when FlashInfer imports).
# N = 2, 4, 8, those the node has GPUs for (nvidia-smi -L). NVLink multicast stays off: the
# script exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
# Results (the device tool returns at most 8 files): OUTDIR/summary.txt (one line per run, and
# what did not run), OUTDIR/env.txt (GPUs, topology, torch, FlashInfer, commit) and
# OUTDIR/multigpu.tgz (multigpu/: build logs, every run's log and output folder, tuning-rows.txt),
# re-packed after every run so that a call cut off still returns what ran.
# Knobs (environment):
#   PHASES      default "check tune bench"          WORLDS   default "2 4 8" (capped by the GPUs)
#   MODELS      default "deepseek-v3 qwen3-235b-a22b gpt-oss-120b"
#   CHECK_LIBS  builds arfuse.check runs against, default "default ci"
#   CHECK_ARGS, BENCH_ARGS   more arguments for every arfuse.check / bench (and tune) run
#   ONLY_RUNS   run only these run names (summary.txt lists those a deadline left out)
#   DEADLINE_S  seconds from the start after which no run starts and a running one is cut (540)
#   ARFUSE_COMMIT  the commit of the copied tree (it has no .git there)
#   NGPUS       the GPU count instead of nvidia-smi's; DRY_RUN=1 prints the plan, runs nothing
#   PYTHON (python3), NVCC (nvcc)
# Exit status: 0 every run passed, 1 a run failed or its build is missing, 4 some not run (deadline).
set -uo pipefail
out=${1:?usage: scripts/multigpu.sh OUTDIR}
cd "$(dirname "$0")/.."
dry=${DRY_RUN:-}
[ -n "$dry" ] || { mkdir -p "$out" && out=$(cd "$out" && pwd); } || exit 1
start=$(date +%s)
deadline=${DEADLINE_S:-540}
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export ARFUSE_COMMIT=${ARFUSE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
left() { echo $(( deadline - ($(date +%s) - start) )); }

ngpus=${NGPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
worlds=()
for n in ${WORLDS:-2 4 8}; do [ "$n" -le "$ngpus" ] && worlds+=("$n"); done
if [ ${#worlds[@]} -eq 0 ]; then
  echo "multigpu: $ngpus GPU(s) here: no world size of '${WORLDS:-2 4 8}' fits (needs >= 2 GPUs)"
  exit 3
fi
phases=" ${PHASES:-check tune bench} "
models=${MODELS:-deepseek-v3 qwen3-235b-a22b gpt-oss-120b}
res=build/multigpu
summary=$out/summary.txt
notrun=()

failed=0
lib_path() { case $1 in default) echo "$PWD/arfuse/_lib/libarfuse_ops.so" ;; ci) echo "$PWD/build/ci/lib/libarfuse_ops.so" ;; esac; }
man_path() { case $1 in default) echo "$PWD/out/manifest.json" ;; ci) echo "$PWD/build/ci/out/manifest.json" ;; esac; }

verdict() {  # the telling last line of a log: arfuse.check's verdict, a tuning row, an arfuse error
  local v
  v=$(grep -E '^(PASSED|FAILED) arfuse|^arfuse[.:_a-z]*: |^ *- \{dtype|^wrote ' "$1" | tail -n 1)
  [ -n "$v" ] || v=$(grep -v -E '^\s*$|^=+$' "$1" | tail -n 1)
  echo "$v" | cut -c1-240
}

pack() { [ -n "$dry" ] || tar czf "$out/multigpu.tgz" -C build multigpu; }

one_run() {  # name, build, N, module, arguments...
  local name=$1 lib=$2 n=$3 mod=$4; shift 4
  if [ -n "${ONLY_RUNS:-}" ] && [[ " $ONLY_RUNS " != *" $name "* ]]; then return 0; fi
  local cmd=(env "ARFUSE_LIBRARY=$(lib_path "$lib")" "ARFUSE_MANIFEST=$(man_path "$lib")" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m "$mod" "$@")
  if [ -n "$dry" ]; then echo "run $name: ${cmd[*]}"; return 0; fi
  local t; t=$(left)
  if [ "$t" -lt 30 ]; then notrun+=("$name"); echo "$name: not run (deadline)" | tee -a "$summary"; return 0; fi
  if [ ! -f "$(lib_path "$lib")" ]; then
    failed=$((failed + 1)); echo "$name: not run (no $lib build)" | tee -a "$summary"; return 0
  fi
  local t0; t0=$(date +%s)
  timeout -k 15 "$t" "${cmd[@]}" >"$res/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || failed=$((failed + 1))
  echo "$name: rc=$rc $(( $(date +%s) - t0 )) s: $(verdict "$res/$name.log")" | tee -a "$summary"
  pack
}

if [ -n "$dry" ]; then
  echo "multigpu: dry run, $ngpus GPUs, worlds ${worlds[*]}, phases${phases% }"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort | sed 's/^/env: /'
else
  rm -rf "$res"; mkdir -p "$res"
  {
    echo "date $(date -u +%FT%TZ)"; echo "commit $ARFUSE_COMMIT"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv,noheader
    nvidia-smi topo -m
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count())'
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
  } >"$out/env.txt" 2>&1
  echo "multigpu: $ngpus GPUs, worlds ${worlds[*]}, phases${phases% }, commit $ARFUSE_COMMIT" | tee "$summary"
fi

# ---- 1. carried wheels (FlashInfer) -----------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
  if [ -n "$dry" ]; then echo "install: $(ls .whl/*.whl | tr '\n' ' ')"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >"$res/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
      || echo "wheels: install failed (see wheels.log)" | tee -a "$summary"
  fi
fi
[ -n "$dry" ] || "$PY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' >>"$out/env.txt" 2>&1 \
  || echo "flashinfer: not importable; the benchmark notes it and times the rest" | tee -a "$summary"

# ---- 2. builds (default beside CI: the nvcc work of both overlaps) ---------------------------
build() {  # name, make arguments...
  local name=$1; shift
  local cmd=(make lib "$@" PYTHON="$PY" NVCC="${NVCC:-nvcc}" SKIP_GEN=1 JOBS="$(nproc)")
  if [ -n "$dry" ]; then echo "build $name: ${cmd[*]}"; return 0; fi
  "${cmd[@]}" >"$res/build-$name.log" 2>&1
  local rc=$?
  echo "build $name: rc=$rc at $(( $(date +%s) - start )) s: $(tail -n 1 "$res/build-$name.log")" | tee -a "$summary"
  return $rc
}
if [ -d out ] || [ -n "$dry" ]; then build default GENDIR=out & bpid=$!; [ -n "$dry" ] || sleep 3; else
  echo "build default: no out/ (go run ./gen --out out here, carry out)" | tee -a "$summary"; bpid=; fi
if [ -d build/ci/out ] || [ -n "$dry" ]; then build ci MATRIX=ci GENDIR=build/ci/out BUILD=build/ci/obj LIBDIR=build/ci/lib; else
  echo "build ci: no build/ci/out (go run ./gen --matrix ci --out build/ci/out here, carry it)" | tee -a "$summary"; fi
[ -z "$bpid" ] || wait "$bpid"
pack

# ---- 3. correctness, one process per GPU ------------------------------------------------------
if [[ $phases == *" check "* ]]; then
  for n in "${worlds[@]}"; do
    for lib in ${CHECK_LIBS:-default ci}; do
      one_run "check-$lib-w$n" "$lib" "$n" arfuse.check --out "$res/check-$lib-w$n" ${CHECK_ARGS:-}
    done
  done
fi

# ---- 4. dispatch thresholds, 5. the benchmark -------------------------------------------------
for kind in tune bench; do
  [[ $phases == *" $kind "* ]] || continue
  extra=(); [ $kind = tune ] && extra=(--tune)
  for m in $models; do
    for n in "${worlds[@]}"; do
      one_run "$kind-$m-w$n" default "$n" arfuse.bench --model "$m" --dtype bf16 --layout permuted \
        "${extra[@]}" --out "$res/$kind-$m-w$n" ${BENCH_ARGS:-}
    done
  done
done

if [ -z "$dry" ]; then
  grep -h '^  - {dtype' "$res"/tune-*/*.yaml >"$res/tuning-rows.txt" 2>/dev/null
  pack
  if [ ${#notrun[@]} -gt 0 ]; then
    echo "not run (deadline): ${notrun[*]}" | tee -a "$summary"
    echo "resume: ONLY_RUNS='${notrun[*]}' scripts/multigpu.sh OUTDIR" | tee -a "$summary"
  fi
  echo "multigpu: $(( $(date +%s) - start )) s, $failed run(s) failed or not built" | tee -a "$summary"
fi
# 0: every run passed; 1: a run failed (or its build is missing); 4: none failed, some not run.
[ "$failed" -eq 0 ] || exit 1
[ ${#notrun[@]} -eq 0 ] || exit 4
