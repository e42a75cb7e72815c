#!/usr/bin/env bash
# Installs vLLM 0.26.0 for the vLLM integration tests (tests/vllm) into a Python environment,
# with every dependency pinned by requirements-vllm.txt (idempotent: a stamp in the environment
# skips the work when the pins have not changed).
#
# Why 0.26.0: the newest vLLM release whose wheel pins torch==2.11.0, the torch arfuse is built
# against and the GPU machine has (see the head of requirements-vllm.txt). The wheel is the CUDA
# build; on a machine without a GPU driver its kernels do not load, which the tests work around
# (tests/vllm/vllm_harness.py says how), while `import vllm` and its compiler passes work.
#
# Usage: scripts/install-vllm.sh [PYTHON]      (default .venv/bin/python)
# Takes about 3 minutes on the 2-core CI machine (most of it downloading; ~6 GB on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
lock=requirements-vllm.txt
version=0.26.0

want=$(sha256sum "$lock" | cut -d' ' -f1)
prefix=$("$python" -c 'import sys; print(sys.prefix)')
stamp="$prefix/.arfuse-vllm-requirements.sha"
have=$("$python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
if [ "$have" = "$version" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

torch=$("$python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo none)
case "$torch" in
  none | 2.11.0 | 2.11.0+*) ;;
  *) echo "install-vllm: $python has torch $torch; vLLM $version needs torch 2.11.0" >&2; exit 2 ;;
esac

"$python" -m pip install -q -c "$lock" "vllm==$version"
echo "$want" >"$stamp"
"$python" -c 'import importlib.metadata as m; print("install-vllm: vllm", m.version("vllm"), "torch", m.version("torch"), "numpy", m.version("numpy"))'
