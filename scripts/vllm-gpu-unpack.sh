#!/usr/bin/env bash
# Runs ON the GPU machine. Puts together the chunks made by scripts/vllm-gpu-pack.sh, one or more
# per device call: each call carries .vllm-gpu/manifest.txt and some .vllm-gpu/part-NN; this keeps
# them in $STORE (/tmp stays while the machine is warm) and, once every part the manifest names is
# there and its sha256 matches, extracts the site dir into $SITE. Prints "complete" or
# "have K of N parts". Then: PYTHONPATH=$SITE python3 ...
set -euo pipefail
cd "$(dirname "$0")/.."
STORE=${STORE:-/tmp/vllm-gpu}
SITE=${SITE:-/tmp/vllm-site}
mkdir -p "$STORE"
[ -f .vllm-gpu/manifest.txt ] && cp .vllm-gpu/manifest.txt "$STORE/manifest.txt"
man=$STORE/manifest.txt
[ -f "$man" ] || { echo "vllm-gpu-unpack: no manifest (carry .vllm-gpu/manifest.txt)" >&2; exit 2; }
whole=$(awk '$1=="whole"{print $2}' "$man")
if [ -f "$SITE/.vllm-gpu-whole" ] && [ "$(cat "$SITE/.vllm-gpu-whole")" = "$whole" ]; then
  echo "complete (already extracted in $SITE)"; exit 0
fi
for p in .vllm-gpu/part-*; do [ -f "$p" ] && cp "$p" "$STORE/"; done
n=0; k=0
while read -r tag name sum size; do  # count the parts that are there and intact
  [ "$tag" = part ] || continue
  n=$((n + 1))
  [ -f "$STORE/$name" ] && [ "$(sha256sum <"$STORE/$name" | cut -d' ' -f1)" = "$sum" ] && k=$((k + 1))
done <"$man"
if [ "$k" -lt "$n" ]; then echo "have $k of $n parts"; exit 0; fi
parts=$(awk '$1=="part"{print d"/"$2}' d="$STORE" "$man")
[ "$(cat $parts | sha256sum | cut -d' ' -f1)" = "$whole" ] || { echo "vllm-gpu-unpack: whole sha256 mismatch" >&2; exit 1; }
rm -rf "$SITE"; mkdir -p "$SITE"
if command -v xz >/dev/null; then cat $parts | xz -dc | tar -x -C "$SITE"
else cat $parts | python3 -c 'import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1])' "$SITE"
fi
echo "$whole" >"$SITE/.vllm-gpu-whole"
rm -f $parts  # the extracted tree is what stays; frees /tmp
echo "complete ($SITE, $(du -sh "$SITE" | cut -f1))"
