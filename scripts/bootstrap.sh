#!/usr/bin/env bash
# Creates the project's Python environment in .venv (idempotent): the pinned requirements.txt.
# Usage: scripts/bootstrap.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_progress.sh
venv=${1:-.venv}
stamp="$venv/.requirements.sha"
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: the Python environment $venv ($(python3 --version)) from requirements.txt: torch 2.11.0 and the CUDA 13 libraries it brings (about 3 GB of downloads, 4.8 GB installed; 1-2 min)"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip
pip_progress bootstrap "$venv" "$venv/bin/python" --no-cache-dir -r requirements.txt
echo "$want" >"$stamp"
echo "bootstrap: $venv ready ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
