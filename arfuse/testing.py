"""An emulated tensor-parallel group on one GPU, for tests and benchmarks.

    with LocalGroup(4, max_tokens=256, hidden=4096, dtype=torch.bfloat16) as group:
        outs = group.run(lambda rank, comm: arfuse.moe_finalize_allreduce_rmsnorm(comm, ...))

N communicators whose buffers all live on one GPU, each rank with its own CUDA stream. Kernels
launched for a communicator of such a group size their grids so that all N ranks' blocks are
co-resident (the Lamport waits need every peer running). A rank whose peers never launch gives
up after timeout_s instead of hanging.
"""

from __future__ import annotations

import os

import torch

from . import _lib
from .comm import Communicator, _op

# Each rank's stream needs a hardware work queue of its own: two ranks' streams sharing one queue
# serialise, and ranks that wait for each other then wait until the timeout. CUDA has 8 queues
# unless CUDA_DEVICE_MAX_CONNECTIONS says otherwise (at most 32), read when CUDA initialises.
_QUEUES_SET_BY_US = False
if not torch.cuda.is_initialized() and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"
    _QUEUES_SET_BY_US = True


def _hardware_queues() -> int:
    try:
        return int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
    except ValueError:
        return 8


class LocalGroup:
    def __init__(self, world_size: int, *, max_tokens: int, hidden: int, dtype: torch.dtype,
                 device=None, oneshot_max_tokens: int | None = None, timeout_s: float = 10.0,
                 pdl: bool = False):
        _lib.require()
        if world_size * 2 > _hardware_queues():
            raise RuntimeError(
                f"arfuse: LocalGroup({world_size}): CUDA_DEVICE_MAX_CONNECTIONS is "
                f"{_hardware_queues()}; an emulated group needs at least 2 * world_size hardware "
                "queues so that no two ranks' streams share one. Set CUDA_DEVICE_MAX_CONNECTIONS=32 "
                "before CUDA initialises (importing arfuse.testing first does it).")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self.world_size = world_size
        handles: list[int] = []
        try:
            for rank in range(world_size):
                handles.append(_op(
                    "comm_create", rank, world_size, hidden, dtype, max_tokens,
                    -1 if oneshot_max_tokens is None else oneshot_max_tokens, world_size,
                    self.device, timeout_s))
            for h in handles if world_size > 1 else ():  # one rank is its own peer already
                _op("comm_set_local_peers", h, handles)
        except BaseException:
            for h in handles:
                torch.ops.arfuse.comm_destroy(h)
            raise
        self.comms = [Communicator._from_handle(h) for h in handles]
        for c in self.comms if pdl else ():  # programmatic dependent launch (Communicator.pdl)
            c.pdl = True
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world_size)]

    def run(self, fn):
        """Calls fn(rank, comm) for every rank, each on its own stream, concurrently on the GPU;
        returns the results in rank order once the current stream has waited for every rank.

        The fused ops called inside fn are launched after fn has returned for every rank (in
        call order, on the stream they were called on), so fn must not consume their outputs
        itself: return them, or call run() again for a dependent step. Other work fn enqueues
        runs before them on its stream. Tensors the ops use are kept alive until the launch."""
        current = torch.cuda.current_stream(self.device)
        results = []
        launch = False
        # The ranks' kernels wait for each other, so nothing that synchronises implicitly (a
        # device allocation by the caching allocator, a kernel's lazy loading) may come between
        # their launches: the ops only queue them while fn runs, and they are launched back to
        # back afterwards. If fn raises for any rank, nothing is launched.
        # Every rank's stream forks from the current stream before any fn runs and joins it
        # again whatever happens: under CUDA-graph capture a side stream that was never forked
        # (fn raised for an earlier rank) or never joined would invalidate the whole capture.
        for stream in self.streams:
            stream.wait_stream(current)
        torch.ops.arfuse.defer_launches(True)
        try:
            for rank, (comm, stream) in enumerate(zip(self.comms, self.streams)):
                with torch.cuda.stream(stream):
                    results.append(fn(rank, comm))
            launch = True
        finally:
            try:
                torch.ops.arfuse.defer_launches(False)
                torch.ops.arfuse.flush_launches(launch)
            finally:
                for stream in self.streams:
                    current.wait_stream(stream)
        return results

    def status(self) -> list[int]:
        return [c.status() for c in self.comms]

    def close(self) -> None:
        for c in self.comms:
            c.close()

    def __enter__(self) -> "LocalGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
