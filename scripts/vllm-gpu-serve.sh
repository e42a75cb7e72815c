#!/usr/bin/env bash
# `vllm serve` with the arfuse plugin, on the GPU machine: vLLM's OpenAI-compatible server started
# twice for one model of scripts/e2e-models (load_format dummy: vLLM's own seeded dummy weights,
# the same in both starts; no tokenizer: prompts and answers as token ids), once with
# ARFUSE_VLLM=1 and once without, one greedy completion request over loopback to each. Writes
# OUTDIR/serve-<mode>.log (the server's log) and serve-<mode>.json (the response), and prints the
# plugin's log lines and whether the two answers' tokens match.
#
#   scripts/vllm-gpu-serve.sh OUTDIR [MODEL]        (MODEL default qwen3-30b-a3b)
#
# Needs vLLM in VLLM_SITE (scripts/vllm-gpu-unpack.sh) and, beside what an offline run needs, the
# server's own packages (SERVE_WHEELS, scripts/vllm-gpu-pack.sh lists them) in /tmp/serve-site, and
# the arfuse wheel installed in /tmp/arfuse-site (scripts/vllm-gpu-e2e.sh installs it).
set -uo pipefail
out=${1:?usage: scripts/vllm-gpu-serve.sh OUTDIR [MODEL]}; model=${2:-qwen3-30b-a3b}
site=${VLLM_SITE:-/tmp/vllm-site}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_USE_FLASHINFER_SAMPLER=0
path=/tmp/arfuse-site:/tmp/serve-site:$site
port=${PORT:-8123}
prompt='[1000,2000,3000,4000,5000,6000,7000,8000,9000,10000,11000,12000,13000,14000,15000,16000]'

serve_once() {  # mode: arfuse | vllm
  local mode=$1 pid t0 ready=0
  if [ "$mode" = arfuse ]; then export ARFUSE_VLLM=1; else unset ARFUSE_VLLM; fi
  t0=$(date +%s)
  PYTHONPATH=$path setsid python3 -m vllm.entrypoints.cli.main serve "scripts/e2e-models/$model" \
    --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 \
    --max-num-batched-tokens 2048 --gpu-memory-utilization 0.85 --port "$port" --seed 0 \
    --generation-config vllm >"$out/serve-$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 ${SERVE_WAIT_S:-240}); do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
         >/dev/null 2>&1; then ready=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  echo "serve $mode: ready=$ready after $(( $(date +%s) - t0 )) s"
  if [ $ready -eq 1 ]; then
    python3 - "$port" "scripts/e2e-models/$model" "$prompt" >"$out/serve-$mode.json" <<'EOF'
import json, sys, urllib.request
port, model, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "return_token_ids": True, "logprobs": 1, "return_tokens_as_token_ids": True}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                             data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
try:
    print(urllib.request.urlopen(req, timeout=120).read().decode())
except urllib.error.HTTPError as e:
    print(json.dumps({"http_error": e.code, "body": e.read().decode()[:2000]}))
EOF
    echo "serve $mode: $(head -c 600 "$out/serve-$mode.json")"
  else
    tail -n 30 "$out/serve-$mode.log"
  fi
  kill -INT -- -$pid 2>/dev/null; sleep 5; kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null
  grep -E "arfuse" "$out/serve-$mode.log" | cut -c1-300 | head -n 12
}

serve_once arfuse
serve_once vllm
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def tokens(mode):
    try:
        c = json.loads((out / f"serve-{mode}.json").read_text())["choices"][0]
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    return c.get("token_ids"), c.get("text")
a, b = tokens("arfuse"), tokens("vllm")
print("arfuse tokens:", a[0]); print("vllm tokens:  ", b[0])
if a[0] is not None and b[0] is not None:
    n = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), min(len(a[0]), len(b[0])))
    print(f"tokens equal for the first {n} of {len(a[0])}; identical: {a[0] == b[0]}")
EOF
