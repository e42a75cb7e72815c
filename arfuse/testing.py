"""An emulated tensor-parallel group on one GPU, for tests and benchmarks.

    with LocalGroup(4, max_tokens=256, hidden=4096, dtype=torch.bfloat16) as group:
        outs = group.run(lambda rank, comm: arfuse.moe_finalize_allreduce_rmsnorm(comm, ...))

N communicators whose buffers all live on one GPU, each rank with its own CUDA stream. Kernels
launched for a communicator of such a group size their grids so that all N ranks' blocks are
co-resident (the Lamport waits need every peer running). A rank whose peers never launch gives
up after timeout_s instead of hanging.
"""

from __future__ import annotations

import torch

from . import _lib
from .comm import Communicator


class LocalGroup:
    def __init__(self, world_size: int, *, max_tokens: int, hidden: int, dtype: torch.dtype,
                 device=None, oneshot_max_tokens: int | None = None, timeout_s: float = 10.0):
        _lib.require()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self.world_size = world_size
        handles: list[int] = []
        try:
            for rank in range(world_size):
                handles.append(torch.ops.arfuse.comm_create(
                    rank, world_size, hidden, dtype, max_tokens,
                    -1 if oneshot_max_tokens is None else oneshot_max_tokens, world_size,
                    self.device, timeout_s))
            for h in handles:
                torch.ops.arfuse.comm_set_local_peers(h, handles)
        except BaseException:
            for h in handles:
                torch.ops.arfuse.comm_destroy(h)
            raise
        self.comms = [Communicator._from_handle(h) for h in handles]
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world_size)]

    def run(self, fn):
        """Calls fn(rank, comm) for every rank, each on its own stream, concurrently on the GPU;
        returns the results in rank order once the current stream has waited for every rank."""
        current = torch.cuda.current_stream(self.device)
        results = []
        try:
            for rank, (comm, stream) in enumerate(zip(self.comms, self.streams)):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    results.append(fn(rank, comm))
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
