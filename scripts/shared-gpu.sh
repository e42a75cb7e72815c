#!/usr/bin/env bash
# Tensor parallelism > 1 as real processes sharing one GPU (a test mode; docs/multigpu.md): the
# real Communicator over a process group, CUDA IPC handles opened by other processes, kernels
# spinning on other processes' memory. arfuse.check under torchrun with every rank on cuda:0 and
# gloo for the handle exchange, for each N of WORLDS, under MPS (scripts/mps.sh: the daemon is
# always stopped again); then the fault and creation tests (tests/test_gpu_shared.py under MPS),
# the buffer's memory (scripts/comm_memory.py), the benchmark's torchrun mode once (its figures
# labelled "ranks sharing one GPU", not the speed of a TP group), N = 2 --quick time-sliced.
#
#   scripts/shared-gpu.sh OUTDIR
#
# arfuse must be importable (the wheel on PYTHONPATH, or the checkout with its library).
# Knobs: WORLDS ("2 4 8"), CHECK_ARGS (more arfuse.check arguments, e.g. --quick), DEADLINE_S
# (560: nothing starts after it, a running step is cut at it), TIMESLICED=0 / BENCH=0 skip those,
# PYTHON (python3), MEMORY=0 / FAULTS=0 skip the communicator-memory table (scripts/comm_memory.py,
# MEMORY_WORLDS "2 8") and the fault tests (tests/test_gpu_shared.py under MPS). OUTDIR: summary.txt (one line per step), shared-gpu.tgz (reports and logs).
# Exit status 0 when every step ran and passed, 1 otherwise.
set -uo pipefail
out=${1:?usage: scripts/shared-gpu.sh OUTDIR}
cd "$(dirname "$0")/.."
root=$PWD
mkdir -p "$out"; out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/shared-gpu.XXXXXX)
PY=${PYTHON:-python3}
start=$(date +%s); deadline=${DEADLINE_S:-560}
left() { echo $(( deadline - ($(date +%s) - start) )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rc_all=0
summary() { echo "$*" | tee -a "$out/summary.txt"; }
pack() { tar czf "$out/shared-gpu.tgz" -C "$work" . 2>/dev/null; }

check() {  # name, N, then arfuse.check arguments
  local name=$1 n=$2; shift 2
  local t; t=$(left)
  [ "$t" -gt 30 ] || { summary "$name: not run (deadline)"; rc_all=1; return; }
  [ -z "${CAP:-}" ] || [ "$t" -le "$CAP" ] || t=$CAP
  local t0; t0=$(date +%s)
  # from the work folder: `python -m` puts the working directory first on sys.path, and the
  # checkout's arfuse (without its library) must not shadow the one under test
  (cd "$work" && timeout "$t" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m arfuse.check \
    --device cuda:0 --backend gloo --out "$work/$name" --name "$name" "$@" >"$work/$name.log" 2>&1)
  local rc=$?
  local res; res=$("$PY" - "$work/$name/$name.json" <<'PYEOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    print(f"no report ({type(e).__name__})"); sys.exit()
s = r.get("summary", {})
print(f"ok={r.get('ok')} " + " ".join(f"{k}={v}" for k, v in s.items() if not isinstance(v, (list, dict))))
PYEOF
)
  summary "$name: N=$n rc=$rc $(( $(date +%s) - t0 )) s: $res"
  [ $rc -eq 0 ] || { rc_all=1; grep -E "FAIL|gave up|Error" "$work/$name.log" | head -n 8; }
  pack
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
scripts/mps.sh bash -c "$(declare -f left summary pack check); $(declare -p start deadline work out PY); rc_all=0
  for n in ${WORLDS:-2 4 8}; do check check-mps-w\$n \$n ${CHECK_ARGS:-}; done; exit \$rc_all" \
  || rc_all=1
if [ "${FAULTS:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then  # item 3: a peer that stops, under MPS
  t0=$(date +%s)
  (cd "$work" && "$root/scripts/mps.sh" timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider -s \
    "$root/tests/test_gpu_shared.py" >"$work/faults.log" 2>&1)
  rc=$?
  summary "faults (tests/test_gpu_shared.py under MPS): rc=$rc $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || rc_all=1
  grep -E "passed|failed|exit|gave up|CRITICAL" "$work/faults.log" | tail -n 20
fi
if [ "${MEMORY:-1}" = 1 ] && [ "$(left)" -gt 40 ]; then  # item 4: the buffer, measured
  for n in ${MEMORY_WORLDS:-2 8}; do
    (cd "$work" && timeout "$(left)" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
      "$root/scripts/comm_memory.py" --out "$work/memory-w$n.md" >"$work/memory-w$n.log" 2>&1)
    rc=$?
    summary "memory (ranks sharing one GPU, N=$n): rc=$rc"
    [ $rc -eq 0 ] || { rc_all=1; tail -n 5 "$work/memory-w$n.log"; }
    cat "$work/memory-w$n.md" 2>/dev/null
  done
fi
if [ "${BENCH:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  t0=$(date +%s)
  mps=$PWD/scripts/mps.sh
  (cd "$work" && "$mps" timeout "$(left)" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 -m arfuse.bench --model qwen3-30b-a3b --device cuda:0 \
    --tokens 1,16,128,1024 --out "$work/bench" --no-plot >"$work/bench.log" 2>&1)
  rc=$?
  summary "bench (ranks sharing one GPU, N=2, qwen3-30b-a3b): rc=$rc $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || rc_all=1
  cat "$work"/bench/*.md 2>/dev/null | head -n 40
fi
if [ "${TIMESLICED:-1}" = 1 ]; then  # without MPS: the processes' kernels take turns on the GPU
  CAP=90 check check-timesliced-w2 2 --quick --only token_counts --timeout-s 5
fi
pack
echo "shared-gpu: $(( $(date +%s) - start )) s, exit $rc_all"
exit $rc_all
