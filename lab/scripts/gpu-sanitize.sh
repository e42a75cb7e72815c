#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on lab/scripts/sanitize_case.py (the world-4 case), and with
# MISUSE=1 memcheck on tests/test_gpu_misuse.py too (issue 14: nothing may touch freed memory).
# Usage (on the GPU machine, with ARFUSE_LIBRARY / ARFUSE_MANIFEST set to the build to check):
#   lab/scripts/gpu-sanitize.sh OUTDIR [seconds per tool, default 120]
# Writes OUTDIR/sanitizer-{memcheck,racecheck[,misuse]}.log; prints one line per tool.
set -uo pipefail
out=${1:?usage: lab/scripts/gpu-sanitize.sh OUTDIR [SECONDS]}
limit=${2:-120}
for tool in memcheck racecheck; do
  timeout "$limit" compute-sanitizer --tool $tool --error-exitcode 9 python3 lab/scripts/sanitize_case.py \
    >"$out/sanitizer-$tool.log" 2>&1
  echo "sanitizer $tool: rc=$? $(tail -n 1 "$out/sanitizer-$tool.log")"
done
if [ -n "${MISUSE:-}" ]; then
  timeout $(( limit * 2 )) compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/test_gpu_misuse.py >"$out/sanitizer-misuse.log" 2>&1
  echo "sanitizer memcheck on test_gpu_misuse.py: rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' "$out/sanitizer-misuse.log" | tr '\n' ' ')"
fi
