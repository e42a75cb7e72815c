#!/usr/bin/env bash
# A/B of a kernel change in one call on the GPU machine: this tree (new) and an older one (OLD,
# a git archive under .snap/, ignored) built from variants/ab.yaml side by side, then
# python -m arfuse.bench of each on the four configurations of issue 16's table, old and new
# alternating, ROUNDS rounds (default 2); then, with LADDER=1, this tree's latency ladder.
# Prepare here (no Go on the GPU machine):
#   go run ./gen --matrix ab --out build/ab/out          (in this tree and in OLD)
#   scripts/kernel_ab.sh $OUT .snap/base     carry [".snap/base", "build/ab/out"]
# Knobs: AB_TOKENS (default 1,2,4,8,16,64,1024,8192), ROUNDS, LADDER=1, LADDER_TOKENS,
# DEADLINE_S (default 560). Results: OUT/ab.tgz (CSVs, markdown, logs of both trees), gpu.txt.
set -uo pipefail
out=${1:?usage: scripts/kernel_ab.sh OUTDIR OLDTREE}
old=$(cd "${2:?usage: scripts/kernel_ab.sh OUTDIR OLDTREE}" && pwd)
new=$PWD
mkdir -p "$out"
start=$(date +%s)
deadline=${DEADLINE_S:-560}
left() { echo $(( deadline - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "new ${ARFUSE_COMMIT:-?} old ${OLD_COMMIT:-?}" | tee -a "$out/gpu.txt"
build() { (cd "$1" && make lib GENDIR=build/ab/out BUILD=build/ab/obj LIBDIR=build/ab/lib \
             PYTHON=python3 NVCC=${NVCC:-nvcc} SKIP_GEN=1 JOBS=8) >"$out/build-$2.log" 2>&1; }
build "$old" old & b_old=$!
build "$new" new & b_new=$!
wait $b_old || { echo "old build failed"; tail -n 30 "$out/build-old.log"; exit 1; }
wait $b_new || { echo "new build failed"; tail -n 30 "$out/build-new.log"; exit 1; }
echo "built at $(( $(date +%s) - start )) s"
as() { local tree=$1; shift
       (cd "$tree" && ARFUSE_LIBRARY=$tree/build/ab/lib/libarfuse_ops.so \
          ARFUSE_MANIFEST=$tree/build/ab/out/manifest.json PYTHONPATH=$tree "$@"); }
ab=$new/build/kab; rm -rf "$ab"; mkdir -p "$ab"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for spec in "deepseek-v3 8" "qwen3-235b-a22b 4" "qwen3-30b-a3b 2" "gpt-oss-120b 4"; do
    set -- $spec
    for who in old new; do
      t=$(left); [ "$t" -gt 20 ] || { echo "deadline"; break 3; }
      tree=$old; [ $who = new ] && tree=$new
      as "$tree" timeout "$t" python3 -m arfuse.bench --emulate --model "$1" --world-size "$2" \
        --dtype bf16 --layout permuted --replays 50 --no-plot --impls arfuse \
        --tokens "${AB_TOKENS:-1,2,4,8,16,64,1024,8192}" --out "$ab/$who" --name "$1-w$2-r$round" \
        >"$ab/$who-$1-w$2-r$round.log" 2>&1
      echo "$who $1 w$2 r$round: rc=$? $(grep -E '^\| 1 \|' "$ab/$who/$1-w$2-r$round.md" 2>/dev/null | cut -c1-60)"
    done
  done
  tar czf "$out/ab.tgz" -C "$new/build" kab
done
if [ -n "${LADDER:-}" ]; then
  for spec in "deepseek-v3 8" "qwen3-235b-a22b 4" "qwen3-30b-a3b 2" "gpt-oss-120b 4"; do
    set -- $spec
    t=$(left); [ "$t" -gt 20 ] || { echo "deadline: ladder $1"; break; }
    as "$new" timeout "$t" python3 -m arfuse.bench.ladder --model "$1" --world-size "$2" \
      --tokens "${LADDER_TOKENS:-1,2,4,8,16}" --replays 50 --out "$ab/ladder" >"$ab/ladder-$1-w$2.log" 2>&1
    echo "ladder $1 w$2: rc=$? at $(( $(date +%s) - start )) s"
    tar czf "$out/ab.tgz" -C "$new/build" kab
  done
fi
python3 - "$ab" <<'PY' | tee "$out/summary.txt"
import csv, glob, os, statistics, sys
ab = sys.argv[1]
med = {}
for who in ("old", "new"):
    for f in glob.glob(os.path.join(ab, who, "*.csv")):
        cfg = os.path.basename(f).rsplit("-r", 1)[0]
        for r in csv.DictReader(open(f)):
            if r["impl"] == "arfuse" and r["median_us"]:
                med.setdefault((cfg, int(r["tokens"]), who), []).append(float(r["median_us"]))
for cfg in sorted({k[0] for k in med}):
    for T in sorted({k[1] for k in med if k[0] == cfg}):
        o, n = med.get((cfg, T, "old")), med.get((cfg, T, "new"))
        if o and n:
            mo, mn = statistics.median(o), statistics.median(n)
            print(f"{cfg:22s} T={T:5d} old {mo:9.2f} new {mn:9.2f} new/old {mn / mo:.3f}")
PY
echo "kernel_ab: $(( $(date +%s) - start )) s"
