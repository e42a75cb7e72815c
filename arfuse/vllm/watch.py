"""Stops this process loudly when one of its arfuse communicators reports a broken call.

A fused call whose wait for a peer outlasts ARFUSE_VLLM_TIMEOUT_S gives up: its kernel sets the
communicator's error word (host-mapped: reading it costs no synchronisation) and from then on
every call of that communicator writes NaN (csrc/arfuse/kernel.cuh). Under CUDA graphs nothing
on the host would notice, and vLLM would serve NaN. So, as NCCL's watchdog does with a failed
collective, arfuse stops the process instead of computing on: it logs one CRITICAL line (this
rank, the peer it waited for, the timeout, where it was seen) and exits with status EXIT_CODE.
vLLM's executor sees its worker die and stops the engine; its callers get an error, not NaN.

Two places read the word: after every Worker.execute_model (the step's results were synchronised
to the host before it returns, so a broken step's tokens never leave), and a watcher thread every
POLL_S (a process whose step never returns, or asynchronous scheduling). Imports neither vLLM nor
torch: it only reads `status()` of the communicators it is given.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

logger = logging.getLogger("vllm.arfuse")

EXIT_CODE = 75  # EX_TEMPFAIL: a peer stopped answering
POLL_S = 0.02

_lock = threading.Lock()
_watched: list[Any] = []
_thread: threading.Thread | None = None
_steps = 0


def watch(comm: Any) -> None:
    """Watches `comm` (an arfuse.Communicator with peers) from now on, in this process."""
    global _thread
    with _lock:
        if any(c is comm for c in _watched):
            return
        _watched.append(comm)
        if _thread is None:
            _thread = threading.Thread(target=_poll, name="arfuse-watch", daemon=True)
            _thread.start()


def unwatch(comm: Any) -> None:
    with _lock:
        _watched[:] = [c for c in _watched if c is not comm]


def check(where: str) -> None:
    """Reads every watched communicator's error word; stops the process if one is set."""
    with _lock:
        comms = list(_watched)
    for comm in comms:
        if comm.closed:
            continue
        status = int(comm.status())
        if status:
            _stop(comm, status, where)


def after_step(worker: Any, result: Any, args: Any, kwargs: Any) -> Any:
    """The Worker.execute_model hook: the word, read once per step before its result leaves."""
    global _steps
    _steps += 1
    check(f"after step {_steps} of this worker")
    return result


def _poll() -> None:
    import time

    while True:
        time.sleep(POLL_S)
        try:
            check(f"by the watcher thread, after step {_steps} of this worker")
        except Exception:  # noqa: BLE001  (a communicator closed under us: look again later)
            continue


def _stop(comm: Any, status: int, where: str) -> None:
    logger.critical(
        "arfuse: rank %d of %d: a fused all-reduce gave up waiting for rank %d (timeout %s s, "
        "ARFUSE_VLLM_TIMEOUT_S; seen %s): every later call of this communicator would output "
        "NaN, so this process stops now (exit %d) and vLLM stops the engine",
        comm.rank, comm.world_size, status - 1, getattr(comm, "timeout_s", "?"), where, EXIT_CODE)
    for h in logging.getLogger().handlers + logging.getLogger("vllm").handlers + logger.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_CODE)
