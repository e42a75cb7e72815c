#!/usr/bin/env bash
# Issue 22's one-set re-measure of the final kernel, with the libraries built here (2 cores, no
# GPU) and carried, in at most three device calls of under 600 s each:
#   here:   lab/scripts/remeasure.sh pack        builds (if missing) and packs into build/remeasure/:
#             libs.tar.xz  arfuse/_lib, build/ci/lib, build/ci/out, out           (~15 MB)
#             snap.tar.xz  .snap/base: the tree of BASE_REF (default cab67f4, the kernel measured
#                          as one set on the H200), its library built: the baseline
#                          of the A/B in c3                                          (~10 MB)
#   device: lab/scripts/remeasure.sh c1 $OUT    suite + memcheck + racecheck + misuse under memcheck,
#                                           FP8 output kinds, vLLM today          -> OUT/c1.tgz
#           lab/scripts/remeasure.sh c2 $OUT    the twelve tables, then --tune        -> OUT/c2.tgz, tune.tgz
#           lab/scripts/remeasure.sh c3 $OUT    the rest of --tune, then the A/B of this tree against
#                                           .snap/base, two-shot forced, T = 16 ... 8192
#           lab/scripts/remeasure.sh c4 $OUT    the latency ladder, world size 1 (issue 21's runs), fp16,
#                                           the dense and the plain layout, then the rest of --tune
#                                                                                 -> OUT/c4.tgz
#   carry ["build/remeasure"]. A call unpacks the archives once per warm machine; the --tune set
#   (lab/scripts/gpu-session.sh BENCH_TUNE=1 RESUME=1 in /tmp/tune) goes on where the last call on the
#   same warm machine stopped. The libraries are of the working tree, the snapshot of BASE_REF.
#   (a6de6df's run: c1 240 s, c2 407 s with all twelve --tune runs, H100; cab67f4's: c3 212 s
#   with TUNE_DL=1 LADDER=1, c1 234 s, c2 325 s, H200; lab/perf/h100-a6de6df, h200-cab67f4.)
# Knobs: DL (the call's deadline in seconds, default 555), TUNE_DL (c3: the tune's share, 330),
#        NO_TUNE=1 (c2: the tables only),
#        BASE_REF (pack), AB_TOKENS (c3), ARFUSE_COMMIT (the commit the results name; default git
#        rev-parse, where the copy has .git).
set -uo pipefail
cd "$(dirname "$0")/../.."
cmd=${1:?usage: lab/scripts/remeasure.sh pack | c1 OUT | c2 OUT | c3 OUT}
dir=build/remeasure

if [ "$cmd" = pack ]; then
  set -e
  mkdir -p $dir
  make lib                                    # incremental: only what changed is compiled
  make lib MATRIX=ci GENDIR=build/ci/out BUILD=build/ci/obj LIBDIR=build/ci/lib
  # the snapshot is BASE_REF's tree and library: rebuilt when BASE_REF names another commit
  key=$(git rev-parse --verify "${BASE_REF:-cab67f4}^{commit}")
  if [ "$(cat .snap/base/.remeasure-key 2>/dev/null)" != "$key" ] ||
     [ ! -f .snap/base/build/ab/lib/libarfuse_ops.so ]; then
    rm -rf .snap/base && mkdir -p .snap/base && git archive "$key" | tar x -C .snap/base
    (cd .snap/base && go run ./gen --out build/ab/out && mkdir -p build && cp ../../build/nvcc.path build/ &&
      make lib GENDIR=build/ab/out BUILD=build/ab/obj LIBDIR=build/ab/lib SKIP_GEN=1 JOBS=2 \
        PYTHON="$PWD/../../.venv/bin/python")
    echo "$key" >.snap/base/.remeasure-key
  fi
  tar cf - arfuse/_lib build/ci/lib build/ci/out out | xz -1 -T2 >$dir/libs.tar.xz
  tar cf - --exclude=.snap/base/build/ab/obj --exclude=.snap/base/.cuda --exclude=.snap/base/docs \
    .snap/base | xz -1 -T2 >$dir/snap.tar.xz
  ls -la $dir
  exit 0
fi

OUT=${2:?usage: lab/scripts/remeasure.sh $cmd OUT}
export ARFUSE_COMMIT=${ARFUSE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
if [ ! -f /tmp/remeasure.unpacked ] || [ ! -f arfuse/_lib/libarfuse_ops.so ]; then
  for f in $dir/libs.tar.xz $dir/snap.tar.xz; do
    [ -f $f ] && xz -dc $f | tar xf - && echo "unpacked $f at $(el) s"
  done
  touch /tmp/remeasure.unpacked
fi
# this tree's A/B build is the default library (kernel_ab.sh looks in build/ab/)
mkdir -p build/ab && ln -sfn ../../arfuse/_lib build/ab/lib && ln -sfn ../../out build/ab/out
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

tune() {  # $1: deadline in seconds from the call's start
  PREBUILT=1 SKIP_CHECK=1 BENCH_TUNE=1 RESUME=1 BENCH_DIR=/tmp/tune DEADLINE_S=$(( $1 - $(el) )) \
    lab/scripts/gpu-session.sh "$OUT/tune" 2>&1 | grep -E '^tune-|deadline|gpu-session'
}

case $cmd in
  c1)
    rm -rf /tmp/c1 && mkdir -p /tmp/c1
    MISUSE=1 PREBUILT=1 BENCH_VLLM_TODAY=1 DEADLINE_S=$(( ${DL:-555} - $(el) )) \
      lab/scripts/gpu-session.sh /tmp/c1 2>&1 | tee /tmp/c1/session.log
    tar czf "$OUT/c1.tgz" -C /tmp c1 ;;
  c2)
    rm -rf /tmp/c2 && mkdir -p /tmp/c2
    PREBUILT=1 SKIP_CHECK=1 BENCH_QUANT="" BENCH_ARGS="--tokens 1,2,4,8,16,32,64,256,1024,8192" \
      DEADLINE_S=$(( ${DL:-555} - 15 - $(el) )) lab/scripts/gpu-session.sh /tmp/c2 2>&1 | tee /tmp/c2/session.log
    tar czf "$OUT/c2.tgz" -C /tmp c2
    [ -n "${NO_TUNE:-}" ] || tune ${DL:-555} ;;
  c3)
    tune ${TUNE_DL:-330}
    AB_PREBUILT=1 AB_IMPL=arfuse_twoshot AB_TOKENS=${AB_TOKENS:-16,32,64,128,256,512,1024,8192} ROUNDS=1 \
      DEADLINE_S=$(( ${DL:-555} - $(el) )) \
      AB_CONFIGS="qwen3-30b-a3b 2;gpt-oss-120b 8;qwen3-30b-a3b 8;qwen3-235b-a22b 2;gpt-oss-120b 2;qwen3-235b-a22b 8;deepseek-v3 8;gpt-oss-120b 4;qwen3-30b-a3b 4;qwen3-235b-a22b 4;deepseek-v3 4;deepseek-v3 2" \
      lab/scripts/kernel_ab.sh "$OUT" .snap/base 2>&1 | tail -n 100 ;;
  c4)  # the ladder, world size 1, the other dtypes and layouts, then the rest of --tune
    rm -rf /tmp/c4 && mkdir -p /tmp/c4
    toks="--tokens 1,2,4,8,16,32,64,256,1024,8192"
    PREBUILT=1 SKIP_CHECK=1 BENCH_QUANT="" BENCH_LADDER=1 BENCH_LOCAL=1 BENCH_DIR=/tmp/c4/bench-a \
      DEADLINE_S=$(( ${DL:-555} - 170 - $(el) )) lab/scripts/gpu-session.sh /tmp/c4/a 2>&1 | tee /tmp/c4/a.log
    for spec in "fp16:deepseek-v3:8:--dtype fp16" "dense:deepseek-v3:8:--layout dense" \
                "plain:qwen3-235b-a22b:4:--layout plain" "plain-gptoss:gpt-oss-120b:2:--layout plain"; do
      IFS=: read -r name m n args <<<"$spec"
      PREBUILT=1 SKIP_CHECK=1 BENCH_QUANT="" BENCH_MODELS=$m BENCH_WORLDS=$n BENCH_ARGS="$toks $args" \
        BENCH_DIR=/tmp/c4/bench-$name DEADLINE_S=$(( ${DL:-555} - 40 - $(el) )) \
        lab/scripts/gpu-session.sh /tmp/c4/$name 2>&1 | tee /tmp/c4/$name.log
    done
    tar czf "$OUT/c4.tgz" -C /tmp c4
    tune ${DL:-555} ;;
  *) echo "lab/scripts/remeasure.sh: unknown command '$cmd' (pack, c1, c2, c3, c4)"; exit 2 ;;
esac
