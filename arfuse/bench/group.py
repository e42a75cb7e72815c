"""The benchmark's run setup: the ranks this process drives (emulated on one GPU or one per process under
torchrun), their communicators, the health of those communicators, and their teardown.

Two execution modes share everything built on ``Setup``:

* emulated (``--emulate``): ``arfuse.testing.LocalGroup`` puts N communicators on one GPU;
  ``Setup.per_rank(fn)`` is ``group.run(fn)``, so the N ranks' kernels run concurrently, each on its
  own stream forked from (and joined back into) the current stream -- during graph capture the
  current stream is the capture stream, so one graph holds all N ranks' calls.
* torchrun: one process per GPU with an ``arfuse.Communicator``; ``per_rank(fn)`` calls fn for
  this process's rank on the current stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _vocab
from .flashinfer import FlashInfer

TORCH_DTYPES = _vocab.DTYPES

@dataclass
class Setup:
    args: object
    dtype: torch.dtype
    elem: int
    weight_dtype: torch.dtype
    device: torch.device
    emulated: bool
    world_size: int
    rank: int                 # this process's rank (0 when emulated)
    ranks: list               # ranks whose calls this process issues
    gamma: torch.Tensor
    gamma_plus: torch.Tensor  # float32 gamma + weight_bias, for the PyTorch composition
    group: object = None      # LocalGroup (emulated)
    comm: object = None       # Communicator (torchrun)
    pg: object = None         # arfuse._tools.ranks.ProcessRanks (torchrun): the process groups
    ar: object = None         # the arfuse module
    fi: object = None         # FlashInfer wrapper (torchrun, when importable)
    notes: list = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def per_rank(self, fn):
        """fn(rank, comm) for every rank this process drives; results in rank order."""
        if self.emulated:
            return self.group.run(fn)
        return [fn(self.rank, self.comm)]

    def barrier(self):
        torch.cuda.synchronize(self.device)
        if not self.emulated:
            self.pg.barrier()

    def max_over_ranks(self, values: list) -> list:
        """Element-wise maximum over ranks (CPU gloo collective, usable after a CUDA error)."""
        if self.emulated:
            return list(values)
        return self.pg.max_over(values)


def make_setup(args) -> Setup:
    import arfuse as ar

    dtype = TORCH_DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    # --weights-dtype none: no weights (the rows are already weighted); weight_dtype unused
    weight_dtype = dtype if args.weights_dtype == "act" else torch.float32
    max_tokens = max(args.tokens)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    if args.emulate:
        from arfuse.testing import LocalGroup
        device = torch.device("cuda", torch.cuda.current_device())
        group = LocalGroup(args.world_size, max_tokens=max_tokens, hidden=args.hidden,
                           dtype=dtype, device=device, timeout_s=args.comm_timeout)
        group.__enter__()
        rank, ranks, comm, pranks = 0, list(range(args.world_size)), None, None
    else:
        from arfuse._tools.ranks import ProcessRanks
        shared = getattr(args, "shared_gpu", False)
        pranks = ProcessRanks(device=args.device if shared else "cuda",
                              backend="gloo" if shared else "nccl")
        rank, device = pranks.rank, pranks.device
        comm = ar.Communicator(None, max_tokens=max_tokens, hidden=args.hidden, dtype=dtype,
                               device=device, timeout_s=args.comm_timeout)
        group, ranks = None, [rank]

    g = torch.Generator(device=device)
    g.manual_seed(args.seed)
    gamma = (1.0 + 0.1 * torch.randn(args.hidden, generator=g, device=device)).to(dtype)
    setup = Setup(args=args, dtype=dtype, elem=elem, weight_dtype=weight_dtype, device=device,
                  emulated=bool(args.emulate), world_size=args.world_size, rank=rank,
                  ranks=ranks, gamma=gamma,
                  gamma_plus=gamma.float() + float(args.weight_bias), group=group, comm=comm,
                  pg=pranks, ar=ar)
    if not setup.emulated and any(i.startswith("flashinfer") for i in args.impls):
        try:
            setup.fi = FlashInfer(setup, max_tokens)
        except Exception as e:  # not installed, or a version this wrapper does not know
            setup.notes.append(f"FlashInfer not benchmarked: {type(e).__name__}: {e}")
    return setup


def local_comms_broken(setup: Setup) -> bool:
    """Whether a communicator of this process reports that a call gave up waiting for a peer."""
    if setup.emulated:
        return any(setup.group.status())
    return setup.comm.status() != 0


def comms_broken(setup: Setup) -> bool:
    """local_comms_broken on any rank (a collective under torchrun)."""
    return setup.max_over_ranks([1.0 if local_comms_broken(setup) else 0.0])[0] > 0


def check_comms(setup: Setup, stage: str) -> None:
    if comms_broken(setup):
        raise RuntimeError(f"a call timed out during {stage} (a rank waited "
                           f"{setup.args.comm_timeout:g} s for a peer); not timed")


def heal(setup: Setup) -> bool:
    """After a failure: if a communicator reports a peer timeout (it refuses every later call),
    replace the group's communicators with fresh ones (collectively under torchrun). Returns
    whether it did."""
    if not comms_broken(setup):
        return False
    a = setup.args
    torch.cuda.synchronize(setup.device)
    if setup.emulated:
        from arfuse.testing import LocalGroup
        setup.group.close()
        setup.group = LocalGroup(a.world_size, max_tokens=max(a.tokens), hidden=a.hidden,
                                 dtype=setup.dtype, device=setup.device,
                                 timeout_s=a.comm_timeout)
    else:
        setup.comm.close()
        setup.comm = setup.ar.Communicator(None, max_tokens=max(a.tokens), hidden=a.hidden,
                                           dtype=setup.dtype, device=setup.device,
                                           timeout_s=a.comm_timeout)
    return True


def close_setup(setup: Setup) -> None:
    try:
        torch.cuda.synchronize(setup.device)
    except Exception:
        pass
    if setup.group is not None:
        setup.group.__exit__(None, None, None)
    if setup.comm is not None:
        close = getattr(setup.comm, "close", None)
        if close:
            close()
    if setup.fi is not None:
        setup.fi.close()
    if setup.pg is not None:
        setup.pg.close(barrier=True)


def oneshot_threshold(setup: Setup):
    """T <= this runs one-shot under auto: the communicator's own limit (its card's dispatch row,
    capped by its one-shot capacity), else the library's threshold for the current device, capped
    by the largest T asked for."""
    comm = setup.comm if setup.comm is not None else (
        setup.group.comms[0] if setup.group is not None else None)
    if setup.world_size > 1 and comm is not None and hasattr(comm, "auto_oneshot_max_tokens"):
        thr = int(comm.auto_oneshot_max_tokens)
    else:
        fn = getattr(setup.ar, "oneshot_threshold", None)
        if fn is None:
            return None
        thr = int(fn(setup.dtype, setup.args.hidden, setup.world_size))
    return min(thr, max(setup.args.tokens))
