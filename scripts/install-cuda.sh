#!/usr/bin/env bash
# Installs CUDA's compiler and headers from the Python package registry into a project-local
# folder (default .cuda), for machines without a suitable nvcc. The CUDA major version matches
# the torch the build uses (torch 2.11.0 from PyPI is built against CUDA 13.0).
# Usage: scripts/install-cuda.sh [PYTHON] [DEST]; prints the nvcc path on success.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_progress.sh
python=${1:-.venv/bin/python}
dest=${2:-.cuda}
cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")')
case "$cuda" in
  13.0*) pins="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85"; sub=cu13 ;;
  *) echo "install-cuda: torch is built for CUDA '$cuda'; this script knows CUDA 13.0 only" >&2; exit 2 ;;
esac
nvcc="$dest/nvidia/$sub/bin/nvcc"
if [ -x "$nvcc" ] && [ "$(cat "$dest/.pins" 2>/dev/null)" = "$pins" ]; then
  echo "$nvcc"; exit 0
fi
rm -rf "$dest"
# One pip call for all packages: they share the nvidia/cu13 folder, which --target would replace.
# Progress goes to standard error: standard output is the nvcc path alone (make reads it).
echo "install-cuda: CUDA $cuda's compiler and headers into $dest (5 packages from PyPI, about 0.3 GB)" >&2
pip_progress install-cuda "$dest" "$python" --no-cache-dir --no-deps --target "$dest" $pins >&2
echo "$pins" >"$dest/.pins"
"$nvcc" --version >&2
echo "$nvcc"
