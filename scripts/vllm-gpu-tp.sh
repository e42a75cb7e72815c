#!/usr/bin/env bash
# vLLM's MoE decoder layers at tensor parallelism N as N real processes sharing one GPU, on the GPU
# machine (tests/vllm/tp_probe.py says what each rank does and what differs from a deployment):
# vLLM's real model classes sharded by vLLM for TP N, the arfuse plugin loaded by vLLM's plugin
# loader from the installed wheel, compiled by VllmBackend with arfuse's pass and the rows switch,
# one token count captured in a CUDA graph and replayed, every output element compared with vLLM's
# unfused forward of the same model on the same inputs.
#
#   scripts/vllm-gpu-tp.sh OUTDIR          after scripts/vllm-gpu-unpack.sh; dist/ carried
#
# Knobs: RUNS (CASE:HIDDEN:N ..., default "qwen3-moe:2048:2 deepseek-v3:7168:2 deepseek-v3-fp8:7168:2 qwen3-moe-fp8:2048:2 qwen3-moe:2048:4"),
# MPS=1 runs the processes under scripts/mps.sh (default time-sliced: see tp_probe.py),
# DEADLINE_S (560). OUTDIR: one folder per run with each rank's tp-R.json and the log; summary.txt.
# Exit status 0 when every run passed on every rank.
set -uo pipefail
out=${1:?usage: scripts/vllm-gpu-tp.sh OUTDIR}
cd "$(dirname "$0")/.."
root=$PWD
mkdir -p "$out"; out=$(cd "$out" && pwd)
start=$(date +%s); deadline=${DEADLINE_S:-560}
left() { echo $(( deadline - ($(date +%s) - start) )); }
site=${VLLM_SITE:-/tmp/vllm-site}
arfuse_site=/tmp/arfuse-site
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 ARFUSE_VLLM=1
[ -d "$site/vllm" ] || { echo "no vLLM in $site (scripts/vllm-gpu-unpack.sh first)"; exit 2; }
if [ ! -d "$arfuse_site/arfuse" ]; then
  whl=$(ls dist/arfuse-*.whl 2>/dev/null | head -n 1)
  [ -n "$whl" ] || { echo "no dist/arfuse-*.whl: build it with make and carry dist"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$arfuse_site" "$whl" || exit 2
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
wrap=(); [ "${MPS:-0}" = 1 ] && wrap=("$root/scripts/mps.sh")
rc_all=0
for run in ${RUNS:-qwen3-moe:2048:2 deepseek-v3:7168:2 deepseek-v3-fp8:7168:2 qwen3-moe-fp8:2048:2 qwen3-moe:2048:4}; do
  IFS=: read -r case hidden n <<<"$run"
  name=$case-h$hidden-tp$n; dir=$out/$name; mkdir -p "$dir"
  t=$(left); [ "$t" -gt 60 ] || { echo "$name: not run (deadline)" | tee -a "$out/summary.txt"; rc_all=1; continue; }
  t0=$(date +%s)
  # from a folder of its own: the checkout's arfuse (no library) must not shadow the wheel's
  (cd "$dir" && CASE=$case HIDDEN=$hidden OUT=$dir PYTHONPATH=$arfuse_site:$site "${wrap[@]}" \
    timeout "$t" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
    "$root/tests/vllm/tp_probe.py" >"$dir/log.txt" 2>&1)
  rc=$?
  echo "$name: rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
  grep -h "PASSED\|FAILED" "$dir/log.txt" | cut -c1-1500
  [ $rc -eq 0 ] || { rc_all=1; grep -E "Error|error|Traceback" "$dir/log.txt" | grep -v "^WARNING" | tail -n 15; }
done
echo "vllm-gpu-tp: $(( $(date +%s) - start )) s, exit $rc_all"
exit $rc_all
