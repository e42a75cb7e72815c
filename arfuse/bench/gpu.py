"""GPU side of ``python -m arfuse.bench``: inputs, the implementations, the correctness guard and
CUDA-graph timing. Imported only when a run starts (it imports torch and arfuse).

Two execution modes share everything below ``Setup``:

* emulated (``--emulate``): ``arfuse.testing.LocalGroup`` puts N communicators on one GPU;
  ``Setup.per_rank(fn)`` is ``group.run(fn)``, so the N ranks' kernels run concurrently, each on its
  own stream forked from (and joined back into) the current stream -- during graph capture the
  current stream is the capture stream, so one graph holds all N ranks' calls.
* torchrun: one process per GPU with an ``arfuse.Communicator``; ``per_rank(fn)`` calls fn for
  this process's rank on the current stream.
"""

from __future__ import annotations

import gc
import inspect
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import _vocab
from . import byte_counts as BB
from . import report as BR

TORCH_DTYPES = _vocab.DTYPES
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-5}


class Skip(Exception):
    """An implementation that cannot run in this configuration (the message says why)."""


# ============================================================================ setup

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
        pranks = ProcessRanks(device="cuda", backend="nccl")
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
    """T <= this runs one-shot under auto: the library's threshold, capped by the communicator's
    one-shot capacity (max_tokens here)."""
    fn = getattr(setup.ar, "oneshot_threshold", None)
    if fn is None:
        return None
    thr = int(fn(setup.dtype, setup.args.hidden, setup.world_size))
    return min(thr, max(setup.args.tokens))


# ============================================================================ inputs

@dataclass
class RankInputs:
    expert_out: torch.Tensor          # [P, H] permuted, [T, K, H] dense, [T, H] plain
    residual: torch.Tensor            # [T, H], identical on every rank (replicated)
    idx: torch.Tensor | None = None   # [T, K] int32 (permuted), -1 = expert absent
    weights: torch.Tensor | None = None  # [T, K] positive, rows sum to 1, identical on all ranks
    shared: torch.Tensor | None = None   # [T, H] this rank's shared-expert partial
    valid_rows: object = 0            # int, or a device scalar (permuted)
    fi: dict | None = None            # FlashInfer views (pattern 7): rows, idx, weights


def make_sets(setup: Setup, T: int, n_sets: int) -> list:
    """n_sets input sets; sets[s][rank] -> RankInputs. Random, never zeros. Replicated tensors
    (residual, weights) hold the same values on every rank, in separate memory per rank."""
    a = setup.args
    H, K, dev, dt = a.hidden, a.topk, setup.device, setup.dtype
    g = torch.Generator(device=dev)
    sets = []
    for s in range(n_sets):
        g.manual_seed(a.seed * 1_000_003 + T * 7919 + s)  # same on every rank
        residual = torch.randn(T, H, generator=g, device=dev, dtype=dt)
        weights = None
        if a.layout != "plain" and a.weights_dtype != "none":
            weights = torch.softmax(torch.randn(T, K, generator=g, device=dev), dim=-1)
            weights = weights.to(setup.weight_dtype)
        per = {}
        for r in setup.ranks:
            g.manual_seed(a.seed * 1_000_003 + T * 7919 + s + 104_729 * (r + 1))
            inp = RankInputs(expert_out=None, residual=residual.clone(),
                             weights=None if weights is None else weights.clone())
            if a.layout == "plain":
                inp.expert_out = torch.randn(T, H, generator=g, device=dev, dtype=dt)
                inp.valid_rows = T
            elif a.layout == "dense":
                inp.expert_out = torch.randn(T, K, H, generator=g, device=dev, dtype=dt)
                inp.valid_rows = T * K
            else:
                inp.expert_out = torch.randn(T * K, H, generator=g, device=dev, dtype=dt)
                idx = torch.randperm(T * K, generator=g, device=dev).to(torch.int32)
                absent = torch.rand(T * K, generator=g, device=dev) < a.absent_frac
                idx.masked_fill_(absent, -1)
                inp.idx = idx.view(T, K)
                inp.valid_rows = T * K - absent.sum()  # a device scalar until mean_valid_rows
            if a.shared:
                inp.shared = 0.5 * torch.randn(T, H, generator=g, device=dev, dtype=dt)
            per[r] = inp
        sets.append(per)
    return sets


def add_flashinfer_views(setup: Setup, sets: list) -> None:
    """FlashInfer's pattern 7 takes [P, H] rows, int32 [T, K] indices and weights in the
    activation dtype, and no routed_scaling (its unified API passes none): the weights carry
    routed_scaling, and -1 indices are redirected to row 0 with weight 0 (its fused kernel is not
    documented to skip -1)."""
    sc = float(setup.args.routed_scaling)
    for per in sets:
        for inp in per.values():
            if setup.args.layout == "permuted":
                valid = inp.idx >= 0
                inp.fi = {"rows": inp.expert_out, "idx": inp.idx.clamp(min=0),
                          "weights": (inp.weights.float() * sc * valid).to(setup.dtype)}
            elif setup.args.layout == "dense":
                T, K, H = inp.expert_out.shape
                w = (torch.ones(T, K, device=setup.device) if inp.weights is None
                     else inp.weights.float())
                inp.fi = {"rows": inp.expert_out.view(T * K, H),
                          "idx": torch.arange(T * K, device=setup.device,
                                              dtype=torch.int32).view(T, K),
                          "weights": (w * sc).to(setup.dtype)}


def mean_valid_rows(sets: list) -> int:
    """Mean over sets and ranks of the rows with an index >= 0 (one device sync)."""
    v = [inp.valid_rows for per in sets for inp in per.values()]
    if any(torch.is_tensor(x) for x in v):
        t = torch.stack([x if torch.is_tensor(x) else torch.tensor(x, device=v[0].device)
                         for x in v]).double()
        return int(round(t.mean().item()))
    return int(round(sum(v) / len(v)))


# ============================================================================ references

def reference(setup: Setup, per: dict):
    """(norm_out, residual_out) in float32 by arfuse.reference, the op's definition: each rank's
    partial in float32, rounded once to the activation dtype, summed in rank order, + residual,
    rounded, RMSNorm of the rounded residual_out. The same for every rank (replicated residual)."""
    from arfuse import reference as ref

    a = setup.args
    partials = []
    for r in setup.ranks:
        inp = per[r]
        p = ref.finalize(inp.expert_out, num_tokens=inp.residual.shape[0], permuted_idx=inp.idx,
                         expert_weights=inp.weights, shared_out=inp.shared,
                         routed_scaling=float(a.routed_scaling), acc=torch.float32)
        partials.append(p.to(setup.dtype))
        del p
    if not setup.emulated:  # every rank's partial, in rank order
        mine = partials[0]
        allp = torch.empty((setup.world_size,) + tuple(mine.shape), dtype=mine.dtype,
                           device=mine.device)
        dist.all_gather_into_tensor(allp, mine)
        partials = list(allp.unbind(0))
    residual = per[setup.ranks[0]].residual
    norm, resid_out = ref.allreduce_add_rmsnorm(partials, residual, setup.gamma,
                                                float(a.eps), float(a.weight_bias), setup.dtype,
                                                acc=torch.float32)
    return norm.float(), resid_out.float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; inf for non-finite outputs."""
    o = out.float()
    if not torch.isfinite(o).all():
        return math.inf
    den = ref.abs().max().item()
    return (o - ref).abs().max().item() / max(den, 1e-30)


# ============================================================================ implementations

def torch_partial(setup: Setup, inp: RankInputs, out=None) -> torch.Tensor:
    """The PyTorch composition's finalize: gather the rows, weighted sum in float32 (bmm),
    routed_scaling, shared add, one rounding to the activation dtype (as the op defines it)."""
    a = setup.args
    x = inp.expert_out
    sc = float(a.routed_scaling)
    if a.layout == "plain":
        y = x
    else:
        if a.layout == "permuted":
            T, K = inp.idx.shape
            rows = x.index_select(0, inp.idx.clamp(min=0).view(-1)).view(T, K, -1)
            w = inp.weights.float() * (inp.idx >= 0)
        else:
            rows, w = x, (None if inp.weights is None else inp.weights.float())
        if w is None:  # rows already router-weighted
            y = rows.float().sum(1)
        else:
            y = torch.bmm(w.unsqueeze(1), rows.float()).squeeze(1)  # [T, H] float32
    if out is None:
        out = torch.empty_like(inp.residual)
    if inp.shared is not None:
        return torch.add(inp.shared, y, alpha=sc, out=out)
    return torch.mul(y, sc, out=out)


def torch_norm(setup: Setup, acc: torch.Tensor, residual: torch.Tensor):
    """residual add + RMSNorm on a private float32 accumulator: residual_out rounded to the
    activation dtype, norm_out computed from the rounded residual_out (the op's definition)."""
    resid_out = acc.add_(residual).to(setup.dtype)
    x = resid_out.float()
    var = x.pow(2).mean(-1, keepdim=True)
    norm = (x * torch.rsqrt(var + float(setup.args.eps))).mul_(setup.gamma_plus).to(setup.dtype)
    return norm, resid_out


class Impl:
    """enqueue(seq): issue len(seq) consecutive calls (all local ranks), call c on input set
    seq[c]; once(s): one call on set s, returning [(norm_out, residual_out)] per local rank."""
    algorithm = None  # what it dispatches to, for the byte count

    def __init__(self, setup: Setup, sets: list):
        self.setup, self.sets = setup, sets


class PerRank(Impl):
    def call(self, rank, comm, inp):
        raise NotImplementedError

    def enqueue(self, seq):
        sets = self.sets

        def fn(rank, comm):
            for s in seq:
                self.call(rank, comm, sets[s][rank])
        self.setup.per_rank(fn)

    def once(self, s):
        return self.setup.per_rank(lambda rank, comm: self.call(rank, comm, self.sets[s][rank]))


class TwoPhase(Impl):
    """An emulated implementation whose call is two group.run phases (_call(s) issues one call)."""

    def _call(self, s):
        raise NotImplementedError

    def enqueue(self, seq):
        for s in seq:
            self._call(s)

    def once(self, s):
        return self._call(s)


class ArfuseFused(PerRank):
    def __init__(self, setup, sets, algorithm):
        super().__init__(setup, sets)
        self.algo = algorithm

    def call(self, rank, comm, inp):
        a = self.setup.args
        kw = {}
        if inp.idx is not None:
            kw["permuted_idx"] = inp.idx
        return self.setup.ar.moe_finalize_allreduce_rmsnorm(
            comm, inp.expert_out, inp.residual, self.setup.gamma, float(a.eps),
            expert_weights=inp.weights, shared_out=inp.shared,
            routed_scaling=float(a.routed_scaling), weight_bias=float(a.weight_bias),
            algorithm=self.algo, **kw)


QUANT_IMPLS = ("arfuse_q", "arfuse_sepq")
# FP8-e4m3 keeps 3 mantissa bits: each element within 2^-4 relative of its value; the check
# compares the dequantized output with the float32 reference norm-wise.
QUANT_TOLERANCE = 0.06


class _QuantBase:
    """--quant KIND: shared by the fused and the separate-kernel implementations."""

    STATIC_SCALE = 1.0 / 64  # RMSNorm outputs of the bench's inputs stay well inside 448/64

    def _init_quant(self, setup):
        from . import quant as BQ
        self.BQ, self.kind = BQ, setup.args.quant
        self.static = torch.full((1,), self.STATIC_SCALE, dtype=torch.float32,
                                 device=setup.device)

    def _op(self, comm, inp, fused: bool):
        a, st = self.setup.args, self.setup
        kw = {}
        if inp.idx is not None:
            kw["permuted_idx"] = inp.idx
        if fused:
            if self.kind == "fp8_static":
                kw["fp8_scale"] = self.static
            else:
                kw["quant"] = self.kind
        return st.ar.moe_finalize_allreduce_rmsnorm(
            comm, inp.expert_out, inp.residual, st.gamma, float(a.eps),
            expert_weights=inp.weights, shared_out=inp.shared,
            routed_scaling=float(a.routed_scaling), weight_bias=float(a.weight_bias),
            algorithm="auto", **kw)

    def _dequant(self, outs):
        return [(self.BQ.dequantize(q, self.kind, sc, self.static), r) for q, r, sc in outs]


class ArfuseQuant(_QuantBase, PerRank):
    """arfuse_q: one arfuse call writing the FP8 output (and its scales) itself. once() returns
    the dequantized output for the check."""

    def __init__(self, setup, sets):
        PerRank.__init__(self, setup, sets)
        self._init_quant(setup)

    def call(self, rank, comm, inp):
        res = self._op(comm, inp, fused=True)
        if self.kind == "fp8_static":
            q, r = res
            return q, r, None
        return res

    def once(self, s):
        return self._dequant(super().once(s))


class ArfuseSepQuant(_QuantBase, TwoPhase):
    """arfuse_sepq: arfuse with the activation-dtype output, then one Triton quantization kernel
    on it (arfuse/bench/quant.py). Two group.run phases when emulated: LocalGroup defers the
    fused launches until every rank's fn has returned, so a quantization kernel issued in the same
    fn would be queued before the kernel that writes its input."""

    def __init__(self, setup, sets):
        TwoPhase.__init__(self, setup, sets)
        self._init_quant(setup)
        self.BQ._build()  # no triton: a Skip before timing, not mid-graph
        self.ys = {}

    def _call(self, s):
        per, st, ys = self.sets[s], self.setup, self.ys

        def phase1(rank, comm):
            ys[rank] = self._op(comm, per[rank], fused=False)

        def phase2(rank, comm):  # y was made on this rank's stream
            y, r = ys[rank]
            q, scales = self.BQ.quantize(y, self.kind, self.static)
            return q, r, scales

        st.per_rank(phase1)
        return st.per_rank(phase2)

    def once(self, s):
        return self._dequant(self._call(s))


def arfuse_finalize(setup: Setup, inp: RankInputs) -> torch.Tensor:
    a = setup.args
    kw = {}
    if inp.idx is not None:
        kw["permuted_idx"] = inp.idx
    return setup.ar.moe_finalize(inp.expert_out, num_tokens=inp.residual.shape[0],
                                 expert_weights=inp.weights, shared_out=inp.shared,
                                 routed_scaling=float(a.routed_scaling), **kw)


class Unfused(PerRank):
    """Standalone finalize kernel, then the op on the reduced [T, H] input (plain layout, auto):
    the all-reduce + residual + RMSNorm kernel."""

    def call(self, rank, comm, inp):
        y = arfuse_finalize(self.setup, inp)
        return self.setup.ar.moe_finalize_allreduce_rmsnorm(
            comm, y, inp.residual, self.setup.gamma, float(self.setup.args.eps),
            weight_bias=float(self.setup.args.weight_bias), algorithm="auto")


class UnfusedEmulated(TwoPhase):
    """The unfused pipeline on an emulated group, in two group.run phases per call: every rank's
    finalize, then every rank's op. Issued as one stream per rank, a rank's finalize kernel could
    wait behind peers' op kernels that spin on it (the co-residency cap of the op's grid counts
    only the op's kernels); the phases rule that out. The join between them is the only extra
    cost, and the torch composition pays the same one."""

    def __init__(self, setup, sets):
        super().__init__(setup, sets)
        self.ys = {}

    def _call(self, s):
        per, st, ys = self.sets[s], self.setup, self.ys

        def phase1(rank, comm):
            ys[rank] = arfuse_finalize(st, per[rank])

        def phase2(rank, comm):  # y was made on this rank's stream: no cross-stream use
            return st.ar.moe_finalize_allreduce_rmsnorm(
                comm, ys[rank], per[rank].residual, st.gamma, float(st.args.eps),
                weight_bias=float(st.args.weight_bias), algorithm="auto")

        st.per_rank(phase1)
        return st.per_rank(phase2)


class TorchEmulated(TwoPhase):
    """Per rank: finalize in torch; then (after all ranks' partials exist) every rank sums the N
    partials in float32, adds the residual and applies RMSNorm -- the work an all-reduce leaves
    each rank with. Two group.run phases per call (the join between them is the all-reduce)."""

    def __init__(self, setup, sets):
        super().__init__(setup, sets)
        T, H = sets[0][setup.ranks[0]].residual.shape
        self.parts = {r: torch.empty(T, H, device=setup.device, dtype=setup.dtype)
                      for r in setup.ranks}

    def _call(self, s):
        per, parts, st = self.sets[s], self.parts, self.setup

        def phase1(rank, comm):
            torch_partial(st, per[rank], out=parts[rank])

        def phase2(rank, comm):
            acc = parts[st.ranks[0]].to(torch.float32, copy=True)
            for r in st.ranks[1:]:
                acc.add_(parts[r])
            return torch_norm(st, acc, per[rank].residual)

        st.per_rank(phase1)
        return st.per_rank(phase2)


class TorchDistributed(PerRank):
    """torch finalize, dist.all_reduce (NCCL) in the activation dtype, torch residual + RMSNorm."""

    def call(self, rank, comm, inp):
        p = torch_partial(self.setup, inp)
        dist.all_reduce(p)
        return torch_norm(self.setup, p.to(torch.float32, copy=True), inp.residual)


class _VllmTodayBase:
    """What vLLM runs on Hopper after its Triton experts wrote the router-weighted [T, K, H]
    rows (docs/vllm.md "The finalize"; vLLM's TritonExperts.apply + TopKWeightAndReduceNoOP +
    the model's forward): ``moe_sum`` -- the sum over K into a [T, H] buffer, float32
    accumulation, one rounding (torch.sum, which is what vLLM's ``moe_sum`` calls for K > 4;
    its own kernel for K <= 4 does the same arithmetic) --, the copy of that buffer into the
    layer's output, then ``shared + rsf * y`` (one elementwise kernel, as Inductor fuses the
    multiply and the add; only the multiply without a shared expert; nothing when rsf is 1 and
    there is none), then the all-reduce + residual + RMSNorm. The last step is arfuse's plain-
    layout kernel (vLLM uses FlashInfer's AR+RMSNorm or its custom all-reduce +
    fused_add_rms_norm on Hopper; neither runs in this process): see docs/performance.md for
    how the two compare."""

    def _finalize(self, inp):
        a = self.setup.args
        rows = inp.expert_out
        y = torch.sum(rows, dim=1)                 # moe_sum: [T, H], fp32 accumulation
        out = torch.empty_like(y)
        out.copy_(y)                               # TopKWeightAndReduceNoOP: into the output
        sc = float(a.routed_scaling)
        if inp.shared is not None:
            return torch.add(inp.shared, out, alpha=sc)
        if sc != 1.0:
            return torch.mul(out, sc)
        return out

    def _allreduce_norm(self, comm, y, inp):
        st = self.setup
        return st.ar.moe_finalize_allreduce_rmsnorm(
            comm, y, inp.residual, st.gamma, float(st.args.eps),
            weight_bias=float(st.args.weight_bias), algorithm="auto")


class VllmTodayEmulated(_VllmTodayBase, TwoPhase):
    """Two group.run phases (every rank's finalize kernels, then every rank's all-reduce), as
    UnfusedEmulated and for the same reason."""

    def __init__(self, setup, sets):
        TwoPhase.__init__(self, setup, sets)
        self.ys = {}

    def _call(self, s):
        per, st, ys = self.sets[s], self.setup, self.ys

        def phase1(rank, comm):
            ys[rank] = self._finalize(per[rank])

        def phase2(rank, comm):
            return self._allreduce_norm(comm, ys[rank], per[rank])

        st.per_rank(phase1)
        return st.per_rank(phase2)


class VllmToday(_VllmTodayBase, PerRank):
    def call(self, rank, comm, inp):
        return self._allreduce_norm(comm, self._finalize(inp), inp)


class FlashInfer:
    """Thin wrapper over FlashInfer's TRT-LLM all-reduce fusion (unified API when present,
    the older trtllm_* functions otherwise)."""

    def __init__(self, setup: Setup, max_tokens: int):
        import flashinfer
        import flashinfer.comm as fc
        self.version = getattr(flashinfer, "__version__", "?")
        self.fc, self.setup = fc, setup
        self.P = fc.AllReduceFusionPattern
        self.ws = self.ws_tensor = self.ipc = None
        dt, H, N, r = setup.dtype, setup.args.hidden, setup.world_size, setup.rank
        if hasattr(fc, "allreduce_fusion") and hasattr(fc, "create_allreduce_fusion_workspace"):
            self.kind = "unified"
            self.ws = fc.create_allreduce_fusion_workspace(
                backend="trtllm", world_size=N, rank=r, max_token_num=max_tokens,
                hidden_dim=H, dtype=dt)
        else:
            self.kind = "legacy"
            res = fc.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                r, N, max_tokens, H, use_fp32_lamport=(dt == torch.float32),
                group=dist.group.WORLD)
            self.ipc, self.ws_tensor = res[0], res[1]

    def close(self):
        try:
            if self.ws is not None:
                self.ws.destroy()
            elif self.ipc is not None:
                fn = getattr(self.fc, "trtllm_destroy_ipc_workspace_for_all_reduce_fusion", None)
                if fn:
                    fn(self.ipc, dist.group.WORLD)
        except Exception:
            pass

    def pattern1(self, x, residual, gamma, eps, norm_out, resid_out, use_oneshot):
        T, H = x.shape
        if self.kind == "unified":
            self.fc.allreduce_fusion(
                input=x, workspace=self.ws, pattern=self.P.kARResidualRMSNorm,
                launch_with_pdl=False, residual_out=resid_out, norm_out=norm_out,
                residual_in=residual, rms_gamma=gamma, rms_eps=eps, use_oneshot=use_oneshot,
                fp32_acc=True)
        else:
            self.fc.trtllm_allreduce_fusion(
                allreduce_in=x, world_size=self.setup.world_size, world_rank=self.setup.rank,
                token_num=T, hidden_dim=H, workspace_ptrs=self.ws_tensor,
                launch_with_pdl=False, use_oneshot=use_oneshot,
                trigger_completion_at_end=True, fp32_acc=True,
                pattern_code=self.P.kARResidualRMSNorm, allreduce_out=None,
                residual_in=residual, residual_out=resid_out, norm_out=norm_out,
                quant_out=None, scale_out=None, rms_gamma=gamma, rms_eps=eps,
                scale_factor=None, layout_code=None)

    def pattern7(self, fi, shared, residual, gamma, eps, norm_out, resid_out):
        if self.kind == "unified":
            self.fc.allreduce_fusion(
                input=fi["rows"], workspace=self.ws, pattern=self.P.kMoEFinalizeARResidualRMSNorm,
                launch_with_pdl=False, residual_out=resid_out, norm_out=norm_out,
                residual_in=residual, rms_gamma=gamma, rms_eps=eps,
                expanded_idx_to_permuted_idx=fi["idx"], expert_scale_factor=fi["weights"],
                shared_expert_output=shared)
        else:
            kw = dict(allreduce_in=fi["rows"], residual_in=residual, norm_weight=gamma,
                      expanded_idx_to_permuted_idx=fi["idx"], norm_out=norm_out,
                      residual_out=resid_out, launch_with_pdl=False,
                      world_rank=self.setup.rank, world_size=self.setup.world_size, eps=eps,
                      shared_expert_output=shared, expert_scale_factor=fi["weights"])
            fn = self.fc.trtllm_moe_finalize_allreduce_fusion
            params = inspect.signature(fn).parameters
            kw["workspace_ptrs" if "workspace_ptrs" in params else "workspace"] = self.ws_tensor
            if "quant_out" in params:
                kw.update(quant_out=None, scale_out=None)
            if "routed_scaling_factor" in params:
                kw["routed_scaling_factor"] = None
            fn(**kw)


class FlashInferP7(PerRank):
    algorithm = "oneshot"

    def call(self, rank, comm, inp):
        norm, res = torch.empty_like(inp.residual), torch.empty_like(inp.residual)
        self.setup.fi.pattern7(inp.fi, inp.shared, inp.residual, self.setup.gamma,
                               float(self.setup.args.eps), norm, res)
        return norm, res


class FlashInferP1(PerRank):
    """arfuse.moe_finalize, then FlashInfer pattern 1 (all-reduce + residual + RMSNorm), with
    the same one-shot/two-shot choice as arfuse's auto dispatch (one-shot when T <= N, which its
    two-shot does not serve)."""

    def __init__(self, setup, sets, algorithm):
        super().__init__(setup, sets)
        self.algorithm = algorithm

    def call(self, rank, comm, inp):
        y = arfuse_finalize(self.setup, inp)
        norm, res = torch.empty_like(inp.residual), torch.empty_like(inp.residual)
        self.setup.fi.pattern1(y, inp.residual, self.setup.gamma, float(self.setup.args.eps),
                               norm, res, use_oneshot=(self.algorithm == "oneshot"))
        return norm, res


def build_impl(name: str, setup: Setup, sets: list, T: int, thr) -> Impl:
    a = setup.args
    if name == "arfuse":
        impl = ArfuseFused(setup, sets, "auto")
        impl.algorithm = BB.resolve_algorithm("auto", T, thr) if thr is not None else None
    elif name in ("arfuse_oneshot", "arfuse_twoshot"):
        algo = name.split("_")[1]
        impl = ArfuseFused(setup, sets, algo)
        impl.algorithm = algo
    elif name == "unfused":
        impl = UnfusedEmulated(setup, sets) if setup.emulated else Unfused(setup, sets)
        impl.algorithm = BB.resolve_algorithm("auto", T, thr) if thr is not None else None
    elif name in ("arfuse_q", "arfuse_sepq"):
        if not a.quant:
            raise Skip("needs --quant")
        try:
            impl = ArfuseQuant(setup, sets) if name == "arfuse_q" else ArfuseSepQuant(setup, sets)
        except ImportError as e:
            raise Skip(f"no separate quantization kernel: {e}") from None
        impl.algorithm = BB.resolve_algorithm("auto", T, thr) if thr is not None else None
    elif name == "vllm_today":
        if a.layout != "dense" or a.weights_dtype != "none":
            raise Skip("needs --layout dense --weights-dtype none (vLLM's weighted rows)")
        impl = VllmTodayEmulated(setup, sets) if setup.emulated else VllmToday(setup, sets)
        impl.algorithm = BB.resolve_algorithm("auto", T, thr) if thr is not None else None
    elif name == "torch":
        impl = TorchEmulated(setup, sets) if setup.emulated else TorchDistributed(setup, sets)
    elif name in ("flashinfer_p7", "flashinfer_p1"):
        if setup.emulated:
            raise Skip("FlashInfer runs only under torchrun (one GPU per rank)")
        if setup.fi is None:
            raise Skip("FlashInfer not available")
        if name == "flashinfer_p7":
            if a.layout == "plain":
                raise Skip("pattern 7 needs expert rows (permuted or dense layout)")
            impl = FlashInferP7(setup, sets)
        else:
            algo = BB.resolve_algorithm("auto", T, thr if thr is not None else 0)
            if T <= setup.world_size:
                algo = "oneshot"
            impl = FlashInferP1(setup, sets, algo)
    else:
        raise Skip(f"unknown implementation {name!r}")
    return impl


# ============================================================================ timing

def copy_bandwidth(device, mb: int, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s: (bytes read + bytes written) / median time."""
    n = int(mb) << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        dst.copy_(src)
        e.record()
    torch.cuda.synchronize(device)
    t = BR.percentile([s.elapsed_time(e) for s, e in ev], 50) * 1e-3
    del src, dst
    return 2 * n / t / 1e9


def check_local(setup: Setup, impl: Impl, ref) -> float:
    """Largest relative error over this process's ranks and both outputs of one call."""
    outs = impl.once(0)
    torch.cuda.synchronize(setup.device)
    check_comms(setup, "the correctness check")
    ref_norm, ref_res = ref
    err = 0.0
    for norm, res in outs:
        err = max(err, rel_err(norm, ref_norm), rel_err(res, ref_res))
    return err


def time_impl(setup: Setup, impl: Impl, n_sets: int, G: int) -> tuple[list, str]:
    """This process's replay times in ms (one per timed replay) and the timing mode used.

    Graph mode: warm up eagerly, capture ceil(n_sets / G) graphs of G consecutive calls (graph g
    uses sets g*G .. g*G+G-1, modulo n_sets, so consecutive calls touch different data and the
    graphs together walk all sets), replay each once, then time the replays of
    ``byte_counts.replay_plan`` (at least ``replays``, at least one per graph: the timed replays
    read the whole rotation) round-robin, each between two CUDA events. The caller takes the
    maximum over ranks of each replay (torchrun) and divides by G for the per-call time."""
    a = setup.args
    n_graphs, n_timed = BB.replay_plan(n_sets, G, a.replays)
    seqs = [[(g * G + c) % n_sets for c in range(G)] for g in range(n_graphs)]

    # Warm-up: one call, then the graph's call sequence; a call that timed out (a peer never
    # arrived) breaks the communicator, and the run must not go on queueing calls that will each
    # wait the full timeout.
    impl.enqueue(seqs[0][:1])
    setup.barrier()
    check_comms(setup, "warm-up call")
    for _ in range(max(1, a.warmup)):
        impl.enqueue(seqs[0])
    setup.barrier()
    check_comms(setup, f"warm-up ({G} consecutive calls)")

    mode = a.timing
    graphs = []
    if mode == "graph":
        stream = torch.cuda.Stream(device=setup.device)
        stream.wait_stream(torch.cuda.current_stream(setup.device))
        pool = None
        with torch.cuda.stream(stream):
            for seq in seqs:
                g = torch.cuda.CUDAGraph()
                if pool is None:
                    g.capture_begin(capture_error_mode="thread_local")
                else:
                    g.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    impl.enqueue(seq)
                finally:
                    g.capture_end()
                if pool is None:
                    pool = g.pool()
                graphs.append(g)
        torch.cuda.current_stream(setup.device).wait_stream(stream)
        for g in graphs:  # first launch uploads the graph
            g.replay()

        def step(i):
            graphs[i % n_graphs].replay()
    else:
        def step(i):
            impl.enqueue(seqs[i % n_graphs])

    setup.barrier()
    check_comms(setup, "graph capture and first replays")

    # At most two replays in flight: the GPU never idles, and a call that times out stops the
    # loop instead of every later call waiting the full timeout (graph replays skip the host's
    # broken-communicator check). status() reads host-mapped memory: no sync.
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n_timed)]
    stopped = False
    for i, (s, e) in enumerate(ev):
        if i >= 2:
            ev[i - 2][1].synchronize()
            if local_comms_broken(setup):
                stopped = True
                break
        s.record()
        step(i)
        e.record()
    torch.cuda.synchronize(setup.device)
    if stopped or setup.max_over_ranks([1.0 if local_comms_broken(setup) else 0.0])[0]:
        raise RuntimeError(f"a call timed out during the timed replays (a rank waited "
                           f"{a.comm_timeout:g} s for a peer); not timed")
    ms = [s.elapsed_time(e) for s, e in ev]
    graphs.clear()  # frees the graphs and their memory pool
    return ms, mode


# ============================================================================ the run

class Progress:
    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total, self.i, self.bar = enabled, total, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def step(self, desc: str, result: str = ""):
        self.i += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(desc)
            if result:
                self.bar.set_postfix_str(result)
            self.bar.update(1)
        else:
            print(f"[{self.i}/{self.total}] {desc} {result}", file=sys.stderr, flush=True)

    def write(self, msg: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _cuda_alive(device) -> bool:
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def run(args, on_token_done=None, factories=None) -> dict:
    """Time every implementation at every token count. Returns a dict: rows, copy_gbps,
    oneshot_max_tokens, notes, checks, failed_check, aborted, is_main, l2_bytes, card,
    flashinfer, flashinfer_api. ``factories``: more implementations, name -> f(setup, sets, T)
    returning an Impl (arfuse.bench.ladder's rungs); an Impl whose ``check`` is False computes
    nothing checkable and is timed without the correctness guard."""
    setup = make_setup(args)
    try:
        return _run(setup, on_token_done, factories or {})
    finally:
        close_setup(setup)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


def _run(setup: Setup, on_token_done=None, factories=None) -> dict:
    a = setup.args
    notes = setup.notes
    copy_gbps = copy_bandwidth(setup.device, a.copy_mb)
    thr = oneshot_threshold(setup)
    if thr is None:
        notes.append("arfuse.oneshot_threshold missing: auto/unfused bytes not counted")
    props = torch.cuda.get_device_properties(setup.device)
    l2 = int(a.l2_mb * (1 << 20)) if a.l2_mb else int(getattr(props, "L2_cache_size", 0) or
                                                       60 * (1 << 20))
    tol = TOLERANCE[a.dtype]
    impls = list(a.impls)
    fi_asked = [i for i in impls if i.startswith("flashinfer")]
    if fi_asked and (setup.emulated or setup.fi is None):
        impls = [i for i in impls if i not in fi_asked]
        if setup.emulated:
            notes.append("FlashInfer not benchmarked: it needs torchrun (one GPU per rank)")
        # else make_setup already said why
    if "flashinfer_p7" in impls and a.layout == "plain":
        impls.remove("flashinfer_p7")
        notes.append("FlashInfer pattern 7 not benchmarked: it needs expert rows "
                     "(permuted or dense layout)")
    rows, checks, failed, aborted = [], [], [], None
    prog = Progress(len(a.tokens) * len(impls), setup.is_main)
    if setup.is_main:
        mode = (f"emulated, {setup.world_size} ranks on one GPU" if setup.emulated
                else f"torchrun, {setup.world_size} GPUs")
        prog.write(f"arfuse.bench: {torch.cuda.get_device_name(setup.device)}, {mode}; "
                   f"copy bandwidth {copy_gbps:,.0f} GB/s; L2 {l2 >> 20} MiB; "
                   f"one-shot for T <= {thr}")
    kw_bytes = dict(weight_elem=(0 if a.weights_dtype == "none" else
                                 torch.empty((), dtype=setup.weight_dtype).element_size()),
                    shared=a.shared)
    try:
        for T in a.tokens:
            set_bytes = BB.input_set_bytes(a.layout, T, a.hidden, a.topk, setup.elem,
                                           **kw_bytes) * len(setup.ranks)
            n_sets = BB.num_input_sets(set_bytes, l2, max_sets=a.max_sets)
            G = BB.graph_calls_for(T, a.graph_calls)
            sets = ref = None
            try:
                sets = make_sets(setup, T, n_sets)
                if setup.fi is not None:
                    add_flashinfer_views(setup, sets)
                valid = mean_valid_rows(sets)
                ref = reference(setup, sets[0])
                local_msg = None
            except torch.cuda.OutOfMemoryError as e:  # this T does not fit: say so, go on
                local_msg = _first_line(e)
            if setup.max_over_ranks([1.0 if local_msg else 0.0])[0]:
                for name in impls:
                    rows.append(BR.new_row(name, T, input_sets=n_sets, note="inputs or "
                                           "reference: " + (local_msg or "failed on another rank")))
                    prog.step(f"T={T} {name}", "OOM")
                del sets, ref
                gc.collect()
                torch.cuda.empty_cache()
                continue
            for name in impls:
                row = BR.new_row(name, T, replays=a.replays, graph_calls=G, input_sets=n_sets)
                result, impl = "", None
                try:
                    impl = (factories[name](setup, sets, T) if name in (factories or {})
                            else build_impl(name, setup, sets, T, thr))
                except Skip as e:  # deterministic: the same on every rank
                    row["note"], result = str(e), "skip"
                if impl is not None:
                    row["algorithm"] = impl.algorithm or ("auto" if name == "arfuse" else None)
                    row["bytes_per_rank"] = BB.impl_bytes(
                        name, a.layout, T, a.hidden, a.topk, setup.world_size, setup.elem,
                        oneshot_max_tokens=thr, algorithm=impl.algorithm, valid_rows=valid,
                        quant=(a.quant if name in QUANT_IMPLS else None),
                        **({"scaled": float(a.routed_scaling) != 1.0} if name == "vllm_today"
                           else {}), **kw_bytes)
                    # guard rail: one call against the float32 reference (collective status)
                    local_msg = None
                    try:
                        err = check_local(setup, impl, ref) if getattr(impl, "check", True) \
                            else 0.0
                    except Exception as e:
                        err, local_msg = math.inf, _first_line(e)
                    fail, err = setup.max_over_ranks([1.0 if local_msg else 0.0, err])
                    if fail:
                        row["note"] = "failed: " + (local_msg or "on another rank")
                        result = "FAILED"
                    else:
                        row["max_rel_err"] = err
                        tol_i = QUANT_TOLERANCE if name in QUANT_IMPLS else tol
                        checks.append({"impl": name, "tokens": T, "max_rel_err": err,
                                       "tol": tol_i})
                        if not err <= tol_i:
                            row["note"] = (f"wrong result: max rel err {err:.3g} > {tol_i:g} "
                                           "vs the float32 reference; not timed")
                            failed.append({"impl": name, "tokens": T, "max_rel_err": err})
                            result = "WRONG"
                    if not result:
                        local_msg, mode = None, a.timing
                        try:
                            ms, mode = time_impl(setup, impl, n_sets, G)
                        except Exception as e:
                            ms, local_msg = [0.0] * a.replays, _first_line(e)
                        agg = setup.max_over_ranks([1.0 if local_msg else 0.0] + list(ms))
                        if agg[0]:
                            row["note"] = "timing failed: " + (local_msg or "on another rank")
                            result = "FAILED"
                        else:
                            row.update(BR.summarize([t * 1e3 / G for t in agg[1:]]))
                            row["replays"] = row.pop("n")  # at least --replays (time_impl)
                            row["timing"] = mode
                            result = f"{row['median_us']:.2f} us"
                rows.append(row)
                del impl
                prog.step(f"T={T} {name}", result)
                if result in ("FAILED", "WRONG"):
                    if not _cuda_alive(setup.device):
                        aborted = f"CUDA context lost at T={T} {name} ({row['note']}); run stopped"
                        break
                    try:
                        if heal(setup):
                            prog.write(f"T={T} {name}: a call timed out; communicators recreated")
                    except Exception as e:
                        aborted = f"could not recreate the communicators: {_first_line(e)}"
                        break
            del sets, ref
            gc.collect()
            torch.cuda.empty_cache()
            if on_token_done is not None and setup.is_main:
                on_token_done(rows)
            if aborted:
                break
    finally:
        prog.close()
    if aborted:
        notes.append(aborted)
    return {"rows": rows, "copy_gbps": copy_gbps, "oneshot_max_tokens": thr, "notes": notes,
            "checks": checks, "failed_check": failed, "aborted": aborted,
            "is_main": setup.is_main, "l2_bytes": l2,
            "card": torch.cuda.get_device_name(setup.device),
            "flashinfer": getattr(setup.fi, "version", None),
            "flashinfer_api": getattr(setup.fi, "kind", None)}
