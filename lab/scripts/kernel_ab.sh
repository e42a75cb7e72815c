#!/usr/bin/env bash
# A/B of kernel changes in one call on the GPU machine: this tree (new) and older ones (OLD...,
# git archives under .snap/, ignored; labelled by their folder names; the first is the
# baseline) built from variants/ab.yaml side by side, then python -m arfuse.bench of each on the
# four configurations of issue 16's table, the trees alternating, ROUNDS rounds (default 2);
# then, with LADDER=1, this tree's latency ladder.
# Prepare here (no Go on the GPU machine), one command:
#   lab/scripts/kernel_ab.sh prepare NAME=REF|NAME=.+DEFINE ...
#     builds this tree's build/ab (out and lib) and, per argument, .snap/NAME (.snap is emptied
#     first, so that only these trees travel): the tree of git
#     REF, or (.+DEFINE) a copy of this working tree compiled with -DDEFINE (a kernel knob such
#     as ARFUSE_TWOSHOT_PIPE_DEPTH=2), each from this tree's variants/ab.yaml (the same
#     instances in every tree) with its library built (no build on the GPU machine), and prints
#     the size of what a call carries (at most 64 MiB). Then, on the GPU machine:
#   AB_PREBUILT=1 lab/scripts/kernel_ab.sh $OUT .snap/base [.snap/s1 ...]   carry [".snap", "build/ab"]
# Knobs: AB_TOKENS (default 1,2,4,8,16,64,1024,8192), AB_CONFIGS ("model N;model N;...", default
# the four above), AB_IMPL (default arfuse, the dispatch's choice; arfuse_oneshot / arfuse_twoshot
# force one algorithm), ROUNDS, LADDER=1, LADDER_TOKENS,
# DEADLINE_S (default 560), AB_PREBUILT=1 (every tree's build/ab/lib was built before, here or
# on this machine: no build), AB_NAME (default ab: OUT/AB_NAME.tgz, OUT/AB_NAME-summary.txt, so
# that one call can run several A/Bs). Results: OUT/ab.tgz (CSVs, markdown, logs of both trees),
# gpu.txt, OUT/ab-summary.txt.
set -uo pipefail
if [ "${1:-}" = prepare ]; then
  set -e
  shift
  [ $# -ge 1 ] || { echo "usage: lab/scripts/kernel_ab.sh prepare NAME=REF|NAME=.+DEFINE ..."; exit 2; }
  root=$PWD
  py=${PYTHON:-$root/.venv/bin/python}
  abl() {  # $1: tree, $2: extra nvcc flags; the log in /tmp/kernel_ab-prepare-NAME.log
    local log=/tmp/kernel_ab-prepare-$(basename "$(cd "$1" && pwd)").log
    (cd "$1" && go run ./gen --matrix ab --out build/ab/out &&
      make lib GENDIR=build/ab/out BUILD=build/ab/obj LIBDIR=build/ab/lib SKIP_GEN=1 JOBS=2 \
        PYTHON="$py" NVCC_EXTRA="$2") >"$log" 2>&1 || { tail -n 30 "$log"; echo "prepare: $1 failed"; exit 1; }
    tail -n 1 "$log"
  }
  for spec in "$@"; do  # every argument checked before anything is removed or built
    name=${spec%%=*} src=${spec#*=}
    case $name in ''|*/*|.*) echo "prepare: bad NAME in '$spec' (a folder name under .snap)"; exit 2 ;; esac
    [ "$name" != "$spec" ] || { echo "prepare: '$spec' is not NAME=REF or NAME=.+DEFINE"; exit 2; }
    case $src in
      .|.+?*) ;;
      *) git rev-parse -q --verify "$src^{commit}" >/dev/null ||
           { echo "prepare: '$src' (in '$spec') is not a commit"; exit 2; } ;;
    esac
  done
  rm -rf .snap  # only the trees named here travel
  make toolchain >/dev/null  # build/nvcc.path
  abl "$root" ""
  for spec in "$@"; do
    name=${spec%%=*} src=${spec#*=}
    dst=.snap/$name; rm -rf "$dst"; mkdir -p "$dst/build"
    defs=""
    if [ "${src%%+*}" = . ]; then  # this working tree, tracked and untracked files git keeps
      git ls-files -co --exclude-standard -z | tar cf - --null -T - | tar xf - -C "$dst"
      [ "$src" = . ] || defs="-D${src#.+}"
    else
      git archive "$(git rev-parse --verify "$src^{commit}")" | tar xf - -C "$dst"
    fi
    rm -rf "$dst/docs"
    cp variants/ab.yaml "$dst/variants/ab.yaml"
    cp build/nvcc.path "$dst/build/"
    echo "$spec: $(abl "$dst" "$defs")"
    rm -rf "$dst/build/ab/obj" "$dst/.cuda"
  done
  rm -rf build/ab/obj
  du -sch .snap build/ab | tail -n 1 | sed 's/total/carried by [".snap", "build\/ab"] (limit 64 MiB)/'
  exit 0
fi
out=${1:?usage: lab/scripts/kernel_ab.sh OUTDIR OLDTREE...}
shift
[ $# -ge 1 ] || { echo "usage: lab/scripts/kernel_ab.sh OUTDIR OLDTREE..."; exit 2; }
new=$PWD
trees=(); labels=()
for t in "$@"; do trees+=("$(cd "$t" && pwd)"); labels+=("$(basename "$t")"); done
trees+=("$new"); labels+=(new)
mkdir -p "$out"
start=$(date +%s)
deadline=${DEADLINE_S:-560}
left() { echo $(( deadline - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "new ${ARFUSE_COMMIT:-?}; trees ${labels[*]}" | tee -a "$out/gpu.txt"
jobs=$(( $(nproc) / ${#trees[@]} )); [ $jobs -ge 1 ] || jobs=1
build() { (cd "$1" && make lib GENDIR=build/ab/out BUILD=build/ab/obj LIBDIR=build/ab/lib \
             PYTHON=python3 NVCC=${NVCC:-nvcc} SKIP_GEN=1 JOBS=$jobs) >"$out/build-$2.log" 2>&1; }
name=${AB_NAME:-ab}
if [ -z "${AB_PREBUILT:-}" ]; then
  pids=()
  for i in "${!trees[@]}"; do build "${trees[$i]}" "${labels[$i]}" & pids+=($!); done
  for i in "${!trees[@]}"; do
    wait "${pids[$i]}" || { echo "${labels[$i]} build failed"; tail -n 30 "$out/build-${labels[$i]}.log"; exit 1; }
  done
  echo "built at $(( $(date +%s) - start )) s"
else
  for i in "${!trees[@]}"; do
    [ -f "${trees[$i]}/build/ab/lib/libarfuse_ops.so" ] || { echo "AB_PREBUILT: ${labels[$i]} has no build/ab/lib/libarfuse_ops.so"; exit 1; }
  done
fi
as() { local tree=$1; shift
       (cd "$tree" && ARFUSE_LIBRARY=$tree/build/ab/lib/libarfuse_ops.so \
          ARFUSE_MANIFEST=$tree/build/ab/out/manifest.json PYTHONPATH=$tree "$@"); }
ab=$new/build/k$name; rm -rf "$ab"; mkdir -p "$ab"
for round in $(seq 1 "${ROUNDS:-2}"); do
  IFS=';' read -r -a specs <<< "${AB_CONFIGS:-deepseek-v3 8;qwen3-235b-a22b 4;qwen3-30b-a3b 2;gpt-oss-120b 4}"
  for spec in "${specs[@]}"; do
    set -- $spec
    for i in "${!trees[@]}"; do
      who=${labels[$i]} tree=${trees[$i]}
      t=$(left); [ "$t" -gt 20 ] || { echo "deadline"; break 3; }
      as "$tree" timeout "$t" python3 -m arfuse.bench --emulate --model "$1" --world-size "$2" \
        --dtype bf16 --layout permuted --replays 50 --no-plot --impls "${AB_IMPL:-arfuse}" \
        --tokens "${AB_TOKENS:-1,2,4,8,16,64,1024,8192}" --out "$ab/$who" --name "$1-w$2-r$round" \
        >"$ab/$who-$1-w$2-r$round.log" 2>&1
      echo "$who $1 w$2 r$round: rc=$? at $(( $(date +%s) - start )) s $(grep -E '^\| 1 \|' "$ab/$who/$1-w$2-r$round.md" 2>/dev/null | cut -c1-60)"
    done
  done
  tar czf "$out/$name.tgz" -C "$new/build" "k$name"
done
if [ -n "${LADDER:-}" ]; then
  for spec in "deepseek-v3 8" "qwen3-235b-a22b 4" "qwen3-30b-a3b 2" "gpt-oss-120b 4"; do
    set -- $spec
    t=$(left); [ "$t" -gt 20 ] || { echo "deadline: ladder $1"; break; }
    as "$new" timeout "$t" python3 -m arfuse.bench.ladder --model "$1" --world-size "$2" \
      --tokens "${LADDER_TOKENS:-1,2,4,8,16}" --replays 50 --out "$ab/ladder" >"$ab/ladder-$1-w$2.log" 2>&1
    echo "ladder $1 w$2: rc=$? at $(( $(date +%s) - start )) s"
    tar czf "$out/$name.tgz" -C "$new/build" "k$name"
  done
fi
python3 - "$ab" "${AB_IMPL:-arfuse}" "${labels[@]}" <<'PY' | tee "$out/$name-summary.txt"
import csv, glob, os, statistics, sys
ab, impl, labels = sys.argv[1], sys.argv[2], sys.argv[3:]
med = {}
for who in labels:
    for f in glob.glob(os.path.join(ab, who, "*.csv")):
        cfg = os.path.basename(f).rsplit("-r", 1)[0]
        for r in csv.DictReader(open(f)):
            if r["impl"] == impl and r["median_us"]:
                med.setdefault((cfg, int(r["tokens"]), who), []).append(float(r["median_us"]))
print(f"{'config':22s} {'T':>5s} " + " ".join(f"{w:>9s}" for w in labels) + "  (x/" + labels[0] + ")")
for cfg in sorted({k[0] for k in med}):
    for T in sorted({k[1] for k in med if k[0] == cfg}):
        m = [statistics.median(med[(cfg, T, w)]) if (cfg, T, w) in med else None for w in labels]
        if m[0] is None:
            continue
        cells = " ".join(f"{x:9.2f}" if x else f"{'-':>9s}" for x in m)
        ratios = " ".join(f"{x / m[0]:.3f}" if x else "-" for x in m[1:])
        print(f"{cfg:22s} {T:5d} {cells}  {ratios}")
PY
echo "kernel_ab: $(( $(date +%s) - start )) s"
