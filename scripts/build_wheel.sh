#!/usr/bin/env bash
# The arfuse wheel from this checkout's package sources and one built library:
#
#   scripts/build_wheel.sh PYTHON LIBRARY MANIFEST DISTDIR
#
# What `make` (the default matrix, arfuse/_lib) and `make test` (the CI matrix, build/ci/lib)
# both run, so that CI installs a wheel made exactly as users' is. The package is staged in
# build/wheel-stage/ (a copy of arfuse/ without caches or an old _lib, the top-level modules,
# pyproject.toml, setup.py, README.md) with LIBRARY, MANIFEST and variants/models.yaml in its
# arfuse/_lib/, and `pip wheel` runs there: setuptools discovers the packages itself
# (pyproject.toml), and no egg-info or build folder is left in the checkout.
# Prints the wheel's path last. tests/test_wheel.py compares its members with the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: scripts/build_wheel.sh PYTHON LIBRARY MANIFEST DISTDIR}
lib=${2:?LIBRARY}; manifest=${3:?MANIFEST}; dist=${4:?DISTDIR}
for f in "$lib" "$manifest" variants/models.yaml; do
  [ -f "$f" ] || { echo "build_wheel: $f does not exist (build the library first: make lib)" >&2; exit 2; }
done
stage=build/wheel-stage/$(echo "$dist" | tr '/' '_')
rm -rf "$stage" && mkdir -p "$stage"
tar --exclude=__pycache__ --exclude='*.pyc' --exclude=arfuse/_lib -cf - \
  arfuse arfuse_vllm_*.py pyproject.toml setup.py README.md | tar -xf - -C "$stage"
mkdir -p "$stage/arfuse/_lib"
cp "$lib" "$stage/arfuse/_lib/libarfuse_ops.so"
cp "$manifest" "$stage/arfuse/_lib/manifest.json"
cp variants/models.yaml "$stage/arfuse/_lib/models.yaml"
rm -rf "$dist" && mkdir -p "$dist"
"$py" -m pip wheel -q --no-build-isolation --no-deps -w "$dist" "$stage" >&2
ls "$dist"/arfuse-*.whl
