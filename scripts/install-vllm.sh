#!/usr/bin/env bash
# Installs a pinned vLLM for the vLLM integration tests (tests/vllm) into a Python environment,
# every package pinned by a lock file (idempotent: a stamp in the environment skips the work when
# the lock and this script have not changed).
#
#   lane A: scripts/install-vllm.sh .venv/bin/python                  (requirements-vllm.txt)
#           vLLM 0.26.0 into the project's environment, whose torch 2.11.0 is the one arfuse builds
#           against and the GPU machine has.
#   lane B: scripts/install-vllm.sh ENV/bin/python requirements-vllm-0.34.txt
#           vLLM 0.34.0 with torch 2.14.0. ENV is created (with $BASE_PYTHON, default python3.11,
#           the lock's interpreter) when ENV/bin/python does not exist yet; torch comes from the lock.
#
# The version of vLLM and of torch are the lock's `vllm==` and `torch==` lines. An environment
# that already has another torch is refused (exit 2): the project's .venv must keep torch 2.11.
#
# The wheels are the CUDA builds; on a machine without a GPU driver vLLM's kernels do not load,
# which the tests work around (tests/vllm/vllm_harness.py says how), while `import vllm` and its
# compiler passes work.
#
# What is installed: the lock's packages with --no-deps (the lock is vLLM's whole resolved
# dependency set), less SKIPPED below -- GPU-kernel libraries and media packages that vLLM lists as
# requirements but that neither `import vllm` nor the compiler passes the tests use load (checked
# for 0.26.0 and 0.34.0 by running tests/vllm without them; docs/vllm.md). A package of the lock
# that the tests do need and that SKIPPED names would show up as an ImportError in tests/vllm,
# never as a silent pass.
#
# Disk: the CI machines sometimes have only a few GB free. If pip fails for lack of space (errno
# 28), vLLM is removed again and the reason written to <prefix>/.arfuse-vllm-skipped; tests/vllm
# then skip with that reason (pytest -ra prints it). Any other failure is an error.
#
# Usage: scripts/install-vllm.sh [PYTHON [LOCK]]   (defaults .venv/bin/python requirements-vllm.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_progress.sh
python=${1:-.venv/bin/python}
lock=${2:-requirements-vllm.txt}
SKIPPED="flashinfer-python humming-kernels nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base
  nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13
  tokenspeed-triton tokenspeed-mla tilelang quack-kernels cuda-tile opencv-python-headless
  pynvvideocodec torchaudio torchvision torchcodec nvidia-cuda-nvcc nvidia-cuda-nvdisasm"

pin() { sed -n -E "s/^$1==([^ ;#]+).*/\1/p" "$lock" | head -n 1; }
version=$(pin vllm)
torch_pin=$(pin torch)
[ -n "$version" ] && [ -n "$torch_pin" ] || { echo "install-vllm: $lock pins no vllm== or no torch==" >&2; exit 2; }

if [ ! -x "$python" ]; then
  case "$python" in
    */bin/python)
      venv=${python%/bin/python}
      "${BASE_PYTHON:-python3.11}" -m venv "$venv"
      "$python" -m pip install -q --no-cache-dir --upgrade pip==26.3 ;;
    *) echo "install-vllm: $python does not exist" >&2; exit 2 ;;
  esac
fi

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
  none | "$torch_pin" | "$torch_pin"+*) ;;
  *) echo "install-vllm: $python has torch $torch; vLLM $version ($lock) needs torch $torch_pin" >&2; exit 2 ;;
esac

list=$(mktemp); log=$(mktemp)
trap 'rm -f "$list" "$log"' EXIT
pattern="^($(echo $SKIPPED | sed 's/ /|/g'))=="
grep -v -E '^\s*(#|$)' "$lock" | grep -v -i -E "$pattern" >"$list"

# The large wheels (torch, triton, CUDA libraries: about 3.4 GB downloaded) one at a time, then the
# rest in one call: pip holds every wheel of a call on disk until it has installed them all, so
# one call for the whole lock peaked about 3 GB above what the environment keeps.
big=$(grep -E '^(nvidia-|torch==|triton==)' "$list" || true)
rest=$(mktemp); trap 'rm -f "$list" "$log" "$rest"' EXIT
grep -v -E '^(nvidia-|torch==|triton==)' "$list" >"$rest" || true
n=$(echo "$big" | grep -c . || true)
echo "install-vllm: vLLM $version + torch $torch_pin ($lock): $n large packages one by one, then $(grep -c . "$rest") more" >&2
install() {  # LABEL, then pip install arguments
  local label=$1
  shift
  if ! pip_progress "$label" "$prefix" "$python" --no-cache-dir --no-deps "$@" >&2 2>"$log"; then
    cat "$log" >&2
    if grep -q -E 'No space left on device|Errno 28' "$log"; then
      "$python" -m pip uninstall -q -y vllm >/dev/null 2>&1 || true
      free=$(df -Pm "$prefix" | awk 'NR == 2 {print $4}')
      echo "vLLM $version not installed: no space left on device (${free} MB free on $prefix's file system after the attempt; the install needs about 2.5 GB, 8 GB with torch)" >"$skipped_note"
      echo "install-vllm: $(cat "$skipped_note"); tests/vllm will be skipped" >&2
      exit 0
    fi
    exit 1
  fi
}
i=0
for req in $big; do
  i=$((i + 1)); echo "install-vllm: [$i/$n] $req" >&2
  install "install-vllm [$i/$n]" "$req"
done
echo "install-vllm: the other $(grep -c . "$rest") packages (vllm among them), one pip call" >&2
install "install-vllm [rest]" -r "$rest"
echo "$want" >"$stamp"
"$python" -c 'import importlib.metadata as m; print("install-vllm: vllm", m.version("vllm"), "torch", m.version("torch"), "numpy", m.version("numpy"))'
