#!/usr/bin/env bash
# A/B of kernel plans on the GPU machine: builds every generated tree given (TREE/out, made here
# with go run ./gen --only ... --out TREE/out from a generator whose plan rule was changed) into
# TREE/lib, then benchmarks the two-shot column of each for the models and world sizes given, all
# in the same call so that the trees are compared on one machine state.
#   scripts/twoshot_ab.sh OUTDIR TREE...     (carry the TREE/out folders)
# Environment: AB_MODELS (default: the four models of docs/performance.md), AB_WORLDS (8 2),
# AB_TOKENS (256,1024,8192), AB_IMPLS (arfuse_twoshot). Writes OUTDIR/ab.tgz and prints one line
# per run.
set -uo pipefail
out=${1:?usage: scripts/twoshot_ab.sh OUTDIR TREE...}; shift
mkdir -p "$out/ab"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
start=$(date +%s)
for d in "$@"; do
  make lib MATRIX=ab GENDIR="$d/out" BUILD="$d/obj" LIBDIR="$d/lib" SKIP_GEN=1 PYTHON=python3 \
    NVCC="${NVCC:-nvcc}" JOBS="$(nproc)" >"$out/ab/build-$(basename "$d").log" 2>&1 &
done
wait
echo "built at $(( $(date +%s) - start )) s: $(ls "$@" 2>/dev/null | grep -c lib) libs"
for m in ${AB_MODELS:-gpt-oss-120b qwen3-30b-a3b qwen3-235b-a22b deepseek-v3}; do
  for n in ${AB_WORLDS:-8 2}; do
    for d in "$@"; do
      name=$(basename "$d")-$m-w$n
      ARFUSE_LIBRARY=$PWD/$d/lib/libarfuse_ops.so ARFUSE_MANIFEST=$PWD/$d/out/manifest.json \
        timeout 120 python3 -m arfuse.bench --emulate --model "$m" --world-size "$n" --dtype bf16 \
        --layout permuted --replays 50 --tokens "${AB_TOKENS:-256,1024,8192}" \
        --impls "${AB_IMPLS:-arfuse_twoshot}" --out "$out/ab/$name" >"$out/ab/$name.log" 2>&1
      echo "$name rc=$?: $(grep -hE '^\| [0-9]+ \|' "$out/ab/$name"/*.md 2>/dev/null | awk -F'|' '{printf "T=%s %s %s; ", $2, $3, $(NF-1)}')"
    done
  done
done
tar czf "$out/ab.tgz" -C "$out" ab
echo "twoshot_ab: $(( $(date +%s) - start )) s"
