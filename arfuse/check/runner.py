"""One rank of ``arfuse.check``: its process groups, device and communicators (by hidden size and
dtype), and the collectives the cases use to agree (broadcast, gather, all-reduce of verdicts)."""

from __future__ import annotations

import os

from .._tools.ranks import ProcessRanks, RanksError, torchrun_world
from .cli import DistCheckError


class Runner:
    """One rank's state: process groups, device, communicators by (hidden, dtype)."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.args = args
        self.torch, self.dist = torch, dist
        self.fake = args.fake_op
        self.comms: dict = {}
        world = torchrun_world() or 1
        # On the CPU (a test path: small tensors, often several processes on a few cores) one
        # thread per process: OpenMP threads oversubscribing a loaded machine made a quick run
        # 20x slower. Restored by close().
        self.threads = torch.get_num_threads()
        want_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        if want_cpu and world > 1 and not self.fake:
            raise DistCheckError(
                f"world size {world} on the CPU: the CPU implementation serves world size 1 only "
                "(every rank of a real run needs its own GPU)")
        if want_cpu and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        try:
            self.ranks = ProcessRanks(device=args.device, backend=args.backend,
                                      timeout_s=args.pg_timeout_s)
        except RanksError as e:
            torch.set_num_threads(self.threads)
            raise DistCheckError(str(e)) from None
        r = self.ranks
        self.local_rank, self.device, self.is_cuda = r.local_rank, r.device, r.is_cuda
        self.backend, self.rank, self.world, self.gloo = r.backend, r.rank, r.world, r.gloo

    # ---- collectives -------------------------------------------------------------------------
    def gather_obj(self, obj) -> list:
        return self.ranks.gather_obj(obj)

    def broadcast_obj(self, obj):
        return self.ranks.broadcast_obj(obj)

    def gather_tensor(self, t):
        """Every rank's copy of `t` (same shape and dtype on every rank), in rank order, as raw
        bytes compared on this rank (GPU tensors gathered over NCCL, CPU ones over gloo)."""
        torch = self.torch
        from .._checks import bits

        if self.world == 1:
            return [t]
        b = bits(t).reshape(-1)
        if b.numel() == 0:
            return [t] * self.world
        if self.backend == "nccl":
            out = torch.empty(self.world * b.numel(), dtype=torch.uint8, device=b.device)
            self.dist.all_gather_into_tensor(out, b)
            parts = out.view(self.world, -1)
        else:
            bc = b.cpu()
            parts = [torch.empty_like(bc) for _ in range(self.world)]
            self.dist.all_gather(parts, bc, group=self.gloo)
        return [p.view(t.dtype).reshape(t.shape) for p in parts]

    def before_launch(self) -> None:
        """Ranks sharing one GPU (``--device cuda:K``): a barrier between each rank's set-up of a
        call and its launch. Under MPS the ranks' processes share one GPU context, and an
        implicitly synchronising call on one rank (a cudaMalloc as torch's cache grows, a lazily
        loaded kernel) waits for every kernel on the GPU -- a peer's kernel spinning for this
        rank's rows included -- so it would stall both until the timeout. With the barrier every
        rank's allocations are done before any rank's kernel waits. Not done with a GPU per rank:
        there the check keeps testing ranks that arrive at a call at different times."""
        if self.ranks.shared_device and self.world > 1 and not self.fake:
            self.ranks.barrier()

    def sync(self):
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)

    # ---- communicators -----------------------------------------------------------------------
    def comm_for(self, hidden: int, dtype):
        """The communicator of (hidden, dtype), created on first use (collectively: every rank
        meets the same cases in the same order)."""
        if self.fake:
            return None
        key = (hidden, dtype)
        if key not in self.comms:
            import arfuse

            self.comms[key] = arfuse.Communicator(
                None, max_tokens=self.args.max_tokens, hidden=hidden, dtype=dtype,
                device=self.device, timeout_s=self.args.timeout_s)
        return self.comms[key]

    def drop_comm(self, hidden: int, dtype) -> None:
        comm = self.comms.pop((hidden, dtype), None)
        if comm is not None:
            try:
                # No barrier: every caller comes after a gather of all ranks that followed each
                # rank's device sync, so no peer kernel is still writing into this buffer; and a
                # rank whose sync failed must not leave its peers waiting at a barrier.
                comm.close(wait_for_peers=False)
            except Exception:  # a broken device: nothing more to free
                pass

    def close(self) -> None:
        for key in list(self.comms):
            self.drop_comm(*key)
        self.ranks.close()
        self.torch.set_num_threads(self.threads)

    # ---- support -----------------------------------------------------------------------------
    def missing_instance(self, case, algorithms) -> str | None:
        """Why the build cannot serve the case (None when it can)."""
        if self.fake:
            return None
        import arfuse
        from .._vocab import DTYPE_NAME_OF, algorithms_for

        output = "fp8_static" if case.fp8 else "norm"
        algos = list(algorithms_for(case.world)) if "auto" in algorithms else algorithms
        for a in algos:
            try:
                name = arfuse.instance_for(case.dtype, case.hidden, case.world, a, output)
            except Exception as e:  # a size no instance can serve
                return f"not served: {_err(e)}"
            if name is None:
                return (f"not in this build: {DTYPE_NAME_OF[case.dtype]} hidden {case.hidden} "
                        f"world {case.world} {a} {output}")
        return None

def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]
