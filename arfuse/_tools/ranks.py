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


def parse_device(text: str) -> str:
    """argparse type of the tools' --device: auto, cuda, cpu or cuda:K."""
    t = text.strip().lower()
    if t in ("auto", "cuda", "cpu"):
        return t
    if t.startswith("cuda:") and t[5:].isdigit():
        return t
    raise ValueError(f"--device {text!r}: want auto, cuda (cuda:LOCAL_RANK), cuda:K (every rank "
                     "on GPU K: ranks sharing one GPU) or cpu")


class ProcessRanks:
    """device: "cuda" (cuda:LOCAL_RANK), "cuda:K" (every rank of this host on GPU K: ranks sharing
    one GPU, a test mode; docs/multigpu.md), "cpu" or "auto" (CUDA when visible); backend:
    "nccl", "gloo" or "auto" (NCCL on CUDA with one rank per GPU, gloo otherwise: NCCL refuses
    two ranks on one GPU). An existing default process group is used as it is (and left open by
    close())."""

    def __init__(self, *, device: str = "auto", backend: str = "auto",
                 timeout_s: float = 600.0):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        world = torchrun_world()
        self.under_torchrun = world is not None
        self.launched_world = world or 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))

        try:
            device = parse_device(device)
        except ValueError as e:
            raise RanksError(str(e)) from None
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.shared_device = device.startswith("cuda:")
        if device.startswith("cuda"):
            index = int(device[5:]) if self.shared_device else self.local_rank
            if not torch.cuda.is_available():
                raise RanksError(f"--device {device}: no CUDA device is visible")
            if index >= torch.cuda.device_count():
                what = f"--device {device}" if self.shared_device else f"LOCAL_RANK {index}"
                raise RanksError(f"{what} but only {torch.cuda.device_count()} CUDA devices are "
                                 "visible")
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        else:
            self.device = torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        if backend == "auto":
            backend = "nccl" if self.is_cuda and not self.shared_device else "gloo"
        if backend == "nccl" and not self.is_cuda:
            raise RanksError("--backend nccl needs CUDA devices")
        if backend == "nccl" and self.shared_device and (world or 1) > 1:
            raise RanksError(f"--backend nccl with --device {device}: NCCL refuses two ranks on "
                             "one GPU; use --backend gloo (arfuse exchanges only its buffers' "
                             "handles through the group)")

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
