#!/usr/bin/env bash
# arfuse inside vLLM on the GPU machine, end to end (issue 21): for each model of
# scripts/e2e-models, one vLLM engine per mode, one after the other in this call --
#   vllm    arfuse installed, ARFUSE_VLLM unset (the plugin does nothing)
#   arfuse  ARFUSE_VLLM=1
#   plain   arfuse not importable (vLLM as released; PLAIN=1, for the first model only)
#   arfuse-pdl  ARFUSE_VLLM=1 ARFUSE_VLLM_PDL=1 (with MODES="arfuse arfuse-pdl")
# -- then scripts/vllm_e2e.py compare. Needs vLLM unpacked by scripts/vllm-gpu-unpack.sh (in
# VLLM_SITE, default /tmp/vllm-site) and the arfuse wheel (dist/arfuse-*.whl, built here with
# `make`: carry dist).
#
#   scripts/vllm-gpu-e2e.sh OUTDIR MODEL...      (MODEL: a folder name under scripts/e2e-models)
#
# Knobs: MODES (the runs after `vllm`, default "arfuse"; also arfuse-pdl), DEADLINE_S (default
# 570: no engine starts after it, a running one is cut at it),
# REPS (latency repetitions, default 7), CAPTURE_SIZES (CUDA-graph sizes; default vLLM's list),
# ATTN (attention backend; default vLLM's choice: FLASH_ATTN with FA3, FLASH_ATTN_MLA), PLAIN=1.
set -uo pipefail
out=${1:?usage: scripts/vllm-gpu-e2e.sh OUTDIR MODEL...}; shift
# OUTDIR gets gpu.txt, one <model>.md per model and e2e.tgz (every run's JSON and log: the
# device tool brings back at most 8 files); the runs write into a work folder.
work=${E2E_WORK:-/tmp/e2e-work}
mkdir -p "$out" "$work"
start=$(date +%s)
deadline=${DEADLINE_S:-570}
left() { echo $(( deadline - ($(date +%s) - start) )); }
site=${VLLM_SITE:-/tmp/vllm-site}
arfuse_site=/tmp/arfuse-site
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
[ -d "$site/vllm" ] || { echo "no vLLM in $site (scripts/vllm-gpu-unpack.sh first)"; exit 2; }
if [ ! -d "$arfuse_site/arfuse" ]; then
  whl=$(ls dist/arfuse-*.whl 2>/dev/null | head -n 1)
  [ -n "$whl" ] || { echo "no dist/arfuse-*.whl: build it with make and carry dist"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$arfuse_site" "$whl" || exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "commit ${ARFUSE_COMMIT:-?}" | tee -a "$out/gpu.txt"

engine() {  # model, mode, then the PYTHONPATH
  local model=$1 mode=$2 path=$3 t attn
  t=$(left); [ "$t" -gt 60 ] || { echo "deadline: $model $mode not run"; return 1; }
  attn=${ATTN:-}
  local extra=()
  [ -n "${CAPTURE_SIZES:-}" ] && extra+=(--capture-sizes "$CAPTURE_SIZES")
  PYTHONPATH=$path timeout "$t" python3 scripts/vllm_e2e.py engine --model "scripts/e2e-models/$model" \
    --mode "$mode" --out "$work/$model-$mode.json" --reps "${REPS:-7}" --attention-backend "$attn" \
    "${extra[@]}" >"$work/$model-$mode.log" 2>&1
  local rc=$?
  echo "$model $mode: rc=$rc at $(( $(date +%s) - start )) s: $(tail -n 1 "$work/$model-$mode.log" | cut -c1-400)"
  [ $rc -eq 0 ] || grep -E "Error|error|Traceback" "$work/$model-$mode.log" | tail -n 12
  return $rc
}

first=1
rc_all=0
for model in "$@"; do
  engine "$model" vllm "$arfuse_site:$site" || continue
  runs=("$work/$model-vllm.json")
  for mode in ${MODES:-arfuse}; do
    engine "$model" "$mode" "$arfuse_site:$site"
    runs+=("$work/$model-$mode.json")
  done
  if [ -n "${PLAIN:-}" ] && [ $first -eq 1 ]; then
    engine "$model" plain "$site" && runs+=("$work/$model-plain.json")
  fi
  first=0
  existing=(); for r in "${runs[@]}"; do [ -f "$r" ] && existing+=("$r"); done
  # compare exits 1 (one line each, on stderr) where an arfuse run fused nothing or has vLLM's bits
  PYTHONPATH=$site python3 scripts/vllm_e2e.py compare "${existing[@]}" --md "$out/$model.md" \
    > "$work/$model-compare.txt" 2>&1 || rc_all=1
  head -n 60 "$work/$model-compare.txt"
  # after every model: a call cut off still returns what ran
  tar czf "$out/e2e.tgz" -C "$work" $(cd "$work" && ls *.log *.json 2>/dev/null) 2>/dev/null
done
tar czf "$out/e2e.tgz" -C "$work" $(cd "$work" && ls *.log *.json 2>/dev/null) 2>/dev/null
echo "vllm-gpu-e2e: $(( $(date +%s) - start )) s"
exit $rc_all
