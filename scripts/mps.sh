#!/usr/bin/env bash
# Runs a command under CUDA MPS (several processes on one GPU running concurrently), and always
# stops the MPS control daemon again, on failure and on a signal too:
#
#   scripts/mps.sh CMD [ARG...]        exit status: CMD's; 2 when MPS cannot be started
#
# The daemon gets private pipe and log folders (a temporary folder, removed after), so it never
# meets another user's daemon; CMD inherits CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY and
# so becomes an MPS client. No SM limit is set (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE stays as given):
# arfuse's communicators size their grids for the ranks sharing the GPU (ranks_per_device).
# NO_MPS=1 runs CMD without MPS (time-sliced: the processes' kernels take turns on the GPU, so a
# kernel spinning on a peer's flag holds its time slice while the peer cannot run; expect
# timeouts there, docs/multigpu.md). The log of the daemon is printed when it fails to start.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: scripts/mps.sh CMD [ARG...]" >&2; exit 2; }
if [ -n "${NO_MPS:-}" ]; then echo "mps: NO_MPS set: running time-sliced, without MPS"; "$@"; exit $?; fi
ctl=$(command -v nvidia-cuda-mps-control || true)
[ -n "$ctl" ] || [ ! -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] || ctl=/usr/local/nvidia/bin/nvidia-cuda-mps-control
[ -n "$ctl" ] || { echo "mps: nvidia-cuda-mps-control not found (NO_MPS=1 runs time-sliced)" >&2; exit 2; }
dir=$(mktemp -d /tmp/arfuse-mps.XXXXXX)
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
stop() {
  echo quit | "$ctl" >/dev/null 2>&1
  for _ in $(seq 1 20); do pgrep -f "nvidia-cuda-mps-(control|server)" >/dev/null || break; sleep 0.5; done
  pkill -f "nvidia-cuda-mps-server" 2>/dev/null; pkill -f "nvidia-cuda-mps-control -d" 2>/dev/null
  rm -rf "$dir"
}
if ! "$ctl" -d; then cat "$CUDA_MPS_LOG_DIRECTORY"/* 2>/dev/null; rm -rf "$dir"; exit 2; fi
trap stop EXIT
trap 'exit 130' INT TERM
echo "mps: control daemon started ($ctl, pipe $CUDA_MPS_PIPE_DIRECTORY)"
"$@"
rc=$?
echo "mps: $1 exited $rc; stopping the daemon"
exit $rc
