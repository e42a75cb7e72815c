#!/usr/bin/env bash
# Installs vLLM 0.26.0 for the vLLM integration tests (tests/vllm) into a Python environment,
# every package pinned by requirements-vllm.txt (idempotent: a stamp in the environment skips the
# work when the pins and this script have not changed).
#
# Why 0.26.0: the newest vLLM release whose wheel pins torch==2.11.0, the torch arfuse is built
# against and the GPU machine has (see the head of requirements-vllm.txt). The wheel is the CUDA
# build; on a machine without a GPU driver its kernels do not load, which the tests work around
# (tests/vllm/vllm_harness.py says how), while `import vllm` and its compiler passes work.
#
# What is installed: the lock file's packages with --no-deps (the lock is vLLM's whole resolved
# dependency set), less SKIPPED below -- GPU-kernel libraries and media packages that vLLM lists
# as requirements but that neither `import vllm` nor the compiler passes the tests use load. They
# are 1.5 GB of the 3.6 GB vLLM adds to the environment; tests/vllm pass without them (38 passed,
# 2026-12-02). A package of the lock that the tests do need and that SKIPPED names would show up as
# an ImportError in tests/vllm, never as a silent pass.
#
# Disk: the CI machines sometimes have only a few GB free. If pip fails for lack of space (errno
# 28), vLLM is removed again and the reason written to <prefix>/.arfuse-vllm-skipped; tests/vllm
# then skip with that reason (pytest -ra prints it) and the rest of `make test` runs. Any other
# failure is an error.
#
# Usage: scripts/install-vllm.sh [PYTHON]      (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
lock=requirements-vllm.txt
version=0.26.0
SKIPPED="flashinfer-python humming-kernels nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base
  nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13
  tokenspeed-triton tokenspeed-mla tilelang quack-kernels cuda-tile opencv-python-headless
  pynvvideocodec torchaudio torchvision torchcodec nvidia-cuda-nvcc nvidia-cuda-nvdisasm"

want=$(cat "$lock" "$0" | sha256sum | cut -d' ' -f1)
prefix=$("$python" -c 'import sys; print(sys.prefix)')
stamp="$prefix/.arfuse-vllm-requirements.sha"
skipped_note="$prefix/.arfuse-vllm-skipped"
have=$("$python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
if [ "$have" = "$version" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -f "$skipped_note"

torch=$("$python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo none)
case "$torch" in
  2.11.0 | 2.11.0+*) ;;
  *) echo "install-vllm: $python has torch $torch; vLLM $version needs torch 2.11.0" >&2; exit 2 ;;
esac

list=$(mktemp); log=$(mktemp)
trap 'rm -f "$list" "$log"' EXIT
pattern="^($(echo $SKIPPED | sed 's/ /|/g'))=="
grep -v -E '^\s*(#|$)' "$lock" | grep -v -i -E "$pattern" >"$list"
grep -q "^vllm==$version$" "$list" || { echo "install-vllm: $lock does not pin vllm==$version" >&2; exit 2; }

if ! "$python" -m pip install -q --no-cache-dir --no-deps -r "$list" 2>"$log"; then
  cat "$log" >&2
  if grep -q -E 'No space left on device|Errno 28' "$log"; then
    "$python" -m pip uninstall -q -y vllm >/dev/null 2>&1 || true
    free=$(df -Pm "$prefix" | awk 'NR == 2 {print $4}')
    echo "vLLM $version not installed: no space left on device (${free} MB free on $prefix's file system after the attempt; the install needs about 2.5 GB)" >"$skipped_note"
    echo "install-vllm: $(cat "$skipped_note"); tests/vllm will be skipped" >&2
    exit 0
  fi
  exit 1
fi
echo "$want" >"$stamp"
"$python" -c 'import importlib.metadata as m; print("install-vllm: vllm", m.version("vllm"), "torch", m.version("torch"), "numpy", m.version("numpy"))'
