#!/usr/bin/env bash
# Packs vLLM 0.26.0 for an offline LLM() run on the GPU machine (Python 3.12, torch 2.11.0+cu130,
# no network), in chunks that each fit in one device call next to the working tree:
#   .vllm-gpu/part-00, part-01, ...  (<= $CHUNK_MIB MiB each) + .vllm-gpu/manifest.txt
# The chunks are one tar.xz of a --target style site dir: vllm (less the members in DROP) and the
# distributions in CARRY, at the versions pinned in requirements-vllm.txt, as cp312/abi3 wheels.
# scripts/vllm-gpu-unpack.sh collects them there and extracts the tree into /tmp/vllm-site.
#
# CARRY: what `import`s of an offline run (LLM, engine core, GPU worker and model runner, the
# Qwen3-MoE / DeepSeek-V3 / Mixtral modules, fused MoE, attention backends, compilation) need
# that the GPU machine's image (.library/device/KINDS.md, "Python packages already there") lacks;
# found by importing them under Python 3.12 in an environment holding only that image's packages.
# depyf/astor/dill are not imported by a plain run; they serve compilation_config.debug_dump_path.
# typing_extensions is on the image, but at a version not recorded; pydantic 2.14.4 needs >=4.16.
#
# Idempotent: downloads are kept in $WORK; the pack is rebuilt only when the wheels, the lock or
# this script change. Usage: scripts/vllm-gpu-pack.sh   (env: WORK, CHUNK_MIB, PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
WORK=${WORK:-/tmp/vllm-gpu-pack}
CHUNK_MIB=${CHUNK_MIB:-46}
PY=${PYTHON:-python3}
LOCK=requirements-vllm.txt
OUT=.vllm-gpu

CARRY="vllm cbor2 msgspec pyzmq pybase64 cachetools openai openai-harmony httpx2 sniffio
  llguidance xgrammar apache-tvm-ffi fastapi starlette partial-json-parser
  pydantic pydantic_core typing-inspection annotated-types depyf astor dill typing_extensions"

# The OpenAI-compatible server's own imports (vllm/entrypoints/openai/api_server.py and what it
# pulls in), found by reading them: uvicorn, prometheus-fastapi-instrumentator, python-multipart
# (FastAPI's form parsing, which the transcription routes need at import), sse-starlette.
SERVE="uvicorn prometheus-fastapi-instrumentator python-multipart sse-starlette"

# vLLM's Requires-Dist that are neither carried nor on the image: no import of an offline run needs
# them (server/API, tracing, other grammars, other kernels, weight loaders, media); optional ones
# vLLM guards (setproctitle, blake3 for multimodal hashing) fall back when absent.
NOT_CARRIED="anthropic blake3 compressed-tensors fastsafetensors flashinfer-python humming-kernels
  ijson jsonschema lark lm-format-enforcer mcp mistral-common model-hosting-container-standards
  nvidia-cudnn-frontend nvidia-cutlass-dsl nvtx opentelemetry-api opentelemetry-exporter-otlp
  opentelemetry-sdk opentelemetry-semantic-conventions-ai outlines-core
  prometheus-fastapi-instrumentator pynvvideocodec python-json-logger quack-kernels setproctitle
  tilelang tokenspeed-mla torchcodec watchfiles"

# vllm members left out: path (relative to the site dir) | why. FA3 (_vllm_fa3_C, 146 MiB) stays:
# vllm/vllm_flash_attn/__init__.py raises ImportError without FA2 or FA3, and every model imports
# it (layers/attention/__init__ -> mm_encoder_attention -> v1/attention/backends/fa_utils); MLA
# prefill on SM90 has only the FLASH_ATTN backend (v1/attention/backends/mla/prefill/selector.py).
DROP="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so|FA2: on SM90 fa_utils.get_flash_attn_version picks FA3; FA2 only for ALiBi/pre-Hopper (290 MiB)
vllm/vllm-rs|Rust frontend binary: only 'vllm serve' with VLLM_USE_RUST_FRONTEND=1 (envs.py, entrypoints/cli/serve.py)
vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so|DeepGEMM for Python 3.10
vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so|DeepGEMM for Python 3.11
vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so|DeepGEMM for Python 3.13
vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so|DeepGEMM for Python 3.14
vllm/third_party/fmha_sm100|CUTLASS headers for the SM100 (Blackwell) MiniMax-M3 indexer
bin|console scripts with this machine's interpreter in their shebang"

# the GPU machine's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39); pip matches each N exactly
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1; do PLAT="$PLAT --platform ${p}_x86_64"; done

norm() { tr 'A-Z_.' 'a-z--' <<<"$1"; }
pin() {  # NAME -> NAME==VERSION from the lock (names compared normalized)
  local want; want=$(norm "$1")
  while IFS= read -r line; do
    [[ $line =~ ^([A-Za-z0-9_.-]+)==([^[:space:];#]+) ]] || continue
    [ "$(norm "${BASH_REMATCH[1]}")" = "$want" ] && { echo "$1==${BASH_REMATCH[2]}"; return; }
  done <"$LOCK"
  echo "vllm-gpu-pack: $LOCK pins no $1" >&2; exit 2
}

mkdir -p "$WORK/wheels" "$OUT"
specs=(); for d in $CARRY; do specs+=("$(pin "$d")"); done

# 1. wheels (pip skips files already there)
"$PY" -m pip download -q --no-deps $PLAT -d "$WORK/wheels" "${specs[@]}"
wheels=()
for s in "${specs[@]}"; do  # file names carry the normalized name and the version
  f=""
  for w in "$WORK/wheels"/*.whl; do
    b=${w##*/}; IFS=- read -r n v _ <<<"$b"
    [ "$(norm "$n")" = "$(norm "${s%%==*}")" ] && [ "$v" = "${s#*==}" ] && { f=$w; break; }
  done
  [ -n "$f" ] || { echo "vllm-gpu-pack: no wheel for $s" >&2; exit 2; }
  wheels+=("$f")
done

key=$( { sha256sum "${wheels[@]}" | cut -d' ' -f1; cat "$0" "$LOCK"; } | sha256sum | cut -d' ' -f1)
if [ -f "$OUT/manifest.txt" ] && grep -qx "key $key" "$OUT/manifest.txt" &&
   (cd "$OUT" && awk '$1=="part"{print $3"  "$2}' manifest.txt | sha256sum -c --quiet -); then
  echo "vllm-gpu-pack: $OUT is up to date"; exit 0
fi

# 2. the site dir, as pip install --target makes it for Python 3.12
t0=$(date +%s)
rm -rf "$WORK/site"
"$PY" -m pip install -q --no-deps --no-compile --no-index --target "$WORK/site" $PLAT "${wheels[@]}"
while IFS='|' read -r path why; do rm -rf "${WORK:?}/site/$path"; done <<<"$DROP"

# 3. tar.xz (reproducible member order and owners), split into chunks
tar -C "$WORK/site" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . |
  xz -9e -T2 >"$WORK/vllm-site.tar.xz"
rm -f "$OUT"/part-*
split -b "${CHUNK_MIB}M" -d -a 2 "$WORK/vllm-site.tar.xz" "$OUT/part-"
t1=$(date +%s)

# 4. manifest: read by vllm-gpu-unpack.sh (lines "part NAME SHA256 BYTES" and "whole SHA256 BYTES")
{
  echo "# vLLM 0.26.0 site dir for the GPU machine; made by scripts/vllm-gpu-pack.sh in $((t1 - t0)) s"
  echo "key $key"
  echo "whole $(sha256sum <"$WORK/vllm-site.tar.xz" | cut -d' ' -f1) $(stat -c %s "$WORK/vllm-site.tar.xz")"
  echo "unpacked_bytes $(du -sb "$WORK/site" | cut -f1)"
  echo "parts $(ls "$OUT" | grep -c '^part-')"
  for p in "$OUT"/part-*; do echo "part ${p##*/} $(sha256sum <"$p" | cut -d' ' -f1) $(stat -c %s "$p")"; done
  for w in "${wheels[@]}"; do
    b=${w##*/}; kind=compiled; [[ $b == *-none-any.whl ]] && kind=pure
    echo "dist $(cut -d- -f1 <<<"$b")==$(cut -d- -f2 <<<"$b") $kind ${b}"
  done
  while IFS='|' read -r path why; do echo "dropped $path | $why"; done <<<"$DROP"
  echo "not_carried" $NOT_CARRIED
} >"$OUT/manifest.txt"
cat "$OUT/manifest.txt" | grep -E '^(#|whole|unpacked|parts|part )'

# 5. what `vllm serve` needs beyond an offline run (scripts/vllm-gpu-serve.sh): pure-Python wheels,
# carried as they are in $OUT/serve (under 1 MiB together) and installed there into /tmp/serve-site
mkdir -p "$OUT/serve"
serve=(); for d in $SERVE; do serve+=("$(pin "$d")"); done
"$PY" -m pip download -q --no-deps $PLAT -d "$OUT/serve" "${serve[@]}"
echo "serve wheels: $(ls "$OUT/serve" | tr '\n' ' ')"
