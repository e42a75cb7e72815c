#!/usr/bin/env bash
# One wheel, several torch releases: installs the wheel (no dependencies) beside each given
# Python's own torch and runs the CPU tests against the installed package and its packaged
# library (not the checkout's), from outside the checkout.
# Usage: scripts/wheel_check.sh WHEEL PYTHON [PYTHON...]
# Each PYTHON needs torch, numpy, PyYAML and pytest. Prints one line per Python: torch version,
# pytest summary. Exit status 1 if any run failed.
set -uo pipefail
wheel=$(readlink -f "${1:?usage: scripts/wheel_check.sh WHEEL PYTHON...}"); shift
repo=$(cd "$(dirname "$0")/.." && pwd)
rc=0
for py in "$@"; do
  site=$(mktemp -d); run=$(mktemp -d)
  "$py" -m pip install -q --no-deps --no-cache-dir --target "$site" "$wheel" || { rc=1; continue; }
  torch=$("$py" -c 'import torch; print(torch.__version__)')
  summary=$(cd "$run" && env -u ARFUSE_LIBRARY -u ARFUSE_MANIFEST ARFUSE_TEST_INSTALLED=1 ARFUSE_TEST_SITE="$site" \
              PYTHONPATH="$site" "$py" -m pytest -q -p no:cacheprovider --rootdir "$repo" \
              "$repo/tests" --ignore="$repo/tests/vllm" 2>&1 | tail -n 1)
  echo "$(basename "$wheel") under torch $torch ($py): $summary"
  case "$summary" in *failed*|*error*|"") rc=1 ;; esac
  rm -rf "$site" "$run"
done
exit $rc
