#!/usr/bin/env bash
# The stable-ABI port's GPU check, in one call on the GPU machine (no Go there):
#   1. this tree: the CI-matrix build and the GPU suite (scripts/gpu-check.sh), then
#      compute-sanitizer memcheck and racecheck; an older tree (OLD) is built beside them;
#   2. eager per-call host time (lab/scripts/host_overhead.py), old and new alternating, 3 rounds;
#   3. graph replay: python -m arfuse.bench of each tree on the same problems, old and new
#      alternating, each with its own package and library.
# Prepare here: go run ./gen --matrix ci --out build/ci/out in both trees; OLD is a copy of the
# older tree (git archive) with its build/ci/out, under .snap/ (ignored), carried with the call:
#   lab/scripts/stable_ab.sh $OUT .snap/old        carry [".snap/old", "build/ci/out"]
# Knobs: SKIP_CHECK=1 (no suite, no sanitizer), SKIP_BENCH=1 (no graph-replay benchmark).
# Results under OUTDIR: gpu.txt, build.log, pytest.log, validation.json, sanitizer-*.log (the
# misuse tests under memcheck too),
# host.jsonl, ab.tgz (the benchmark CSVs of both trees and their logs).
set -uo pipefail
out=${1:?usage: lab/scripts/stable_ab.sh OUTDIR OLDTREE}
old=$(cd "${2:?usage: lab/scripts/stable_ab.sh OUTDIR OLDTREE}" && pwd)
new=$PWD
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
stamp() { echo "$1 at $(( $(date +%s) - start )) s"; }

(cd "$old" && make lib MATRIX=ci GENDIR=build/ci/out BUILD=build/ci/obj LIBDIR=build/ci/lib PYTHON=python3 \
   NVCC=${NVCC:-nvcc} SKIP_GEN=1 JOBS=8) >"$out/build-old.log" 2>&1 &
old_build=$!

if [ -z "${SKIP_CHECK:-}" ]; then
  scripts/gpu-check.sh "$out" 2>&1 | tail -n 12
  ARFUSE_LIBRARY=$new/build/ci/lib/libarfuse_ops.so ARFUSE_MANIFEST=$new/build/ci/out/manifest.json \
    MISUSE=1 lab/scripts/gpu-sanitize.sh "$out" 150
  stamp "check done"
else
  make lib MATRIX=ci GENDIR=build/ci/out BUILD=build/ci/obj LIBDIR=build/ci/lib PYTHON=python3 \
    NVCC=${NVCC:-nvcc} SKIP_GEN=1 JOBS=8 >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 1; }
fi
wait $old_build || { echo "old build failed"; tail -n 30 "$out/build-old.log"; exit 1; }
stamp "old build done"

as_old() { (cd "$old" && ARFUSE_LIBRARY=$old/build/ci/lib/libarfuse_ops.so \
             ARFUSE_MANIFEST=$old/build/ci/out/manifest.json PYTHONPATH=$old "$@"); }
as_new() { (cd "$new" && ARFUSE_LIBRARY=$new/build/ci/lib/libarfuse_ops.so \
             ARFUSE_MANIFEST=$new/build/ci/out/manifest.json PYTHONPATH=$new "$@"); }

# Pinned to one core each, alternating, so that both see the same machine.
for round in 1 2 3 4 5; do
  as_old taskset -c 3 python3 "$new/lab/scripts/host_overhead.py" --label old >>"$out/host.jsonl" 2>>"$out/host.err"
  as_new taskset -c 3 python3 "$new/lab/scripts/host_overhead.py" --label new >>"$out/host.jsonl" 2>>"$out/host.err"
done
stamp "host overhead done"
python3 - "$out/host.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for layout in ("plain", "dense", "permuted"):
    m = {lab: statistics.median(r["median_us"] for r in rows if r["label"] == lab and r["layout"] == layout)
         for lab in ("old", "new")}
    print(f"host {layout:9s} old {m['old']:6.2f} us  new {m['new']:6.2f} us  new/old {m['new'] / m['old']:.3f}")
PY

if [ -z "${SKIP_BENCH:-}" ]; then
ab=build/ab; rm -rf "$ab"; mkdir -p "$ab"
bench() {  # tree label, then bench arguments
  local who=$1 name=$2; shift 2
  "as_$who" timeout 150 python3 -m arfuse.bench --emulate --dtype bf16 --replays 50 --no-plot \
    --impls arfuse,arfuse_oneshot,arfuse_twoshot --out "$new/$ab/$who" --name "$name" "$@" \
    >"$ab/$who-$name.log" 2>&1
  echo "bench $who $name: rc=$? $(tail -n 1 "$ab/$who-$name.log")"
}
for spec in "deepseek-v3 8" "qwen3-30b-a3b 2"; do
  set -- $spec
  for round in 1 2; do
    for who in old new; do
      bench $who "$1-w$2-r$round" --model "$1" --world-size "$2" --tokens 1,16,256,4096
    done
  done
  tar czf "$out/ab.tgz" -C build ab
done
fi
stamp "stable_ab done"
# The device tool returns at most 8 files: the logs travel as one archive.
(cd "$out" && tar czf logs.tgz --ignore-failed-read ./*.log ./*.json ./*.jsonl ./host.err 2>/dev/null &&
  rm -f ./*.log ./*.json ./*.jsonl ./host.err)
