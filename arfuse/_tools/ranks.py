"""This process's place in a tensor-parallel group of processes, for the tools run under torchrun
(``arfuse.bench``, ``arfuse.check``): the device of LOCAL_RANK, the default process group (created
from torchrun's environment, or a group of one in memory when the process was started alone), and
a gloo group of its own for control messages -- CPU collectives that still work after a CUDA error.
"""

from __future__ import annotations

import datetime as _dt
import os


class RanksError(ValueError):
    """The process group cannot be set up as asked (the message says why)."""


def torchrun_world() -> int | None:
    """WORLD_SIZE when started by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


class ProcessRanks:
    """device: "cuda", "cpu" or "auto" (CUDA when visible); backend: "nccl", "gloo" or "auto"
    (NCCL on CUDA, gloo on the CPU). An existing default process group is used as it is (and
    left open by close())."""

    def __init__(self, *, device: str = "auto", backend: str = "auto",
                 timeout_s: float = 600.0):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        world = torchrun_world()
        self.under_torchrun = world is not None
        self.launched_world = world or 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise RanksError("--device cuda: no CUDA device is visible")
            if self.local_rank >= torch.cuda.device_count():
                raise RanksError(f"LOCAL_RANK {self.local_rank} but only "
                                 f"{torch.cuda.device_count()} CUDA devices are visible")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        if backend == "auto":
            backend = "nccl" if self.is_cuda else "gloo"
        if backend == "nccl" and not self.is_cuda:
            raise RanksError("--backend nccl needs CUDA devices")

        timeout = _dt.timedelta(seconds=timeout_s)
        self.owns_pg = False
        if dist.is_initialized():
            backend = dist.get_backend()
        elif self.under_torchrun:
            kw = {"device_id": self.device} if backend == "nccl" else {}
            try:
                dist.init_process_group(backend, timeout=timeout, **kw)
            except TypeError:  # a torch without device_id
                dist.init_process_group(backend, timeout=timeout)
            self.owns_pg = True
        else:  # one process, world size 1: a store in memory, no port
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
            self.owns_pg = True
        self.backend = backend
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gloo = (dist.group.WORLD if backend == "gloo"
                     else dist.new_group(backend="gloo", timeout=timeout))

    # ---- collectives over the gloo group ------------------------------------------------------
    def gather_obj(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def broadcast_obj(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.gloo)
        return box[0]

    def max_over(self, values: list) -> list:
        """Element-wise maximum over ranks (floats)."""
        if self.world == 1 or not values:
            return list(values)
        t = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.gloo)
        return t.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier(group=self.gloo)

    def close(self, *, barrier: bool = False) -> None:
        """Destroys the default process group if this object created it (after a last barrier
        when asked)."""
        if not self.owns_pg:
            return
        try:
            if barrier:
                self.barrier()
        finally:
            try:
                self.dist.destroy_process_group()
            except Exception:
                pass
            self.owns_pg = False
