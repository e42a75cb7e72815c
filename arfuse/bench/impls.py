"""The implementations the benchmark times, one class each (arfuse fused, the unfused pipeline, the
PyTorch composition, vLLM today, vLLM's own kernels, FlashInfer), and ``build_impl``, which picks one by
name for a token count."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import byte_counts as BB
from .group import Setup
from .inputs import RankInputs



class Skip(Exception):
    """An implementation that cannot run in this configuration (the message says why)."""

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
    """arfuse's fused op; pdl=True launches it as a programmatic dependent (Communicator.pdl, set
    for its calls only). With --producer every call is preceded on its rank's stream by a producer
    kernel (a copy that writes the residual the call then reads: the upstream kernel of a
    two-kernel graph), each call its own group step, so that the producer -> fused edge is a
    kernel -> kernel edge of that stream; the time is then producer + fused call."""

    def __init__(self, setup, sets, algorithm, pdl=False):
        super().__init__(setup, sets)
        self.algo = algorithm
        self.pdl = pdl
        self.produced = {}  # rank -> the residual the producer writes, reused by every call

    def _produce(self, rank, inp):
        out = self.produced.get(rank)
        if out is None or out.shape != inp.residual.shape:
            out = self.produced[rank] = torch.empty_like(inp.residual)
        return out.copy_(inp.residual)

    def call(self, rank, comm, inp):
        a = self.setup.args
        kw = {}
        if inp.idx is not None:
            kw["permuted_idx"] = inp.idx
        residual = self._produce(rank, inp) if a.producer else inp.residual

        def fused():
            return self.setup.ar.moe_finalize_allreduce_rmsnorm(
                comm, inp.expert_out, residual, self.setup.gamma, float(a.eps),
                expert_weights=inp.weights, shared_out=inp.shared,
                routed_scaling=float(a.routed_scaling), weight_bias=float(a.weight_bias),
                algorithm=self.algo, **kw)
        if not self.pdl:
            return fused()
        comm.pdl = True  # read when the launch is prepared (queued launches keep it)
        try:
            return fused()
        finally:
            comm.pdl = False

    def enqueue(self, seq):
        if not self.setup.args.producer:
            return super().enqueue(seq)
        for s in seq:
            self.once(s)


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

    # The chain rounds to the activation dtype twice before the all-reduce (moe_sum's [T, H]
    # result, then shared + rsf * y), where arfuse rounds once; with DeepSeek-V3's rsf 2.5 the
    # first rounding is scaled 2.5x. Its error against the float32 reference (max |out - ref| /
    # max |ref|, bf16) measured 0.0089 (N = 8) and 0.0098 / 0.012 (world size 1, T = 4096; H100,
    # 2b4c094 / 20d3c26): within twice the dtype's tolerance, which is what the benchmark's
    # correctness guard allows these implementations (a guard against a wrong chain, not a
    # statement about arfuse's accuracy: tests/ check that against float64).
    TOLERANCE_FACTOR = 2

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


class VllmOps(PerRank):
    """The tail vLLM runs at tensor-parallel size 1 after its Triton experts, by vLLM's own
    kernels (needs vLLM importable, its CUDA ops loaded): ``_moe_C.moe_sum`` of the
    router-weighted [T, K, H] rows into a [T, H] buffer, the copy into the layer's output
    (TopKWeightAndReduceNoOP), ``shared + rsf * y`` (one torch elementwise op; only the multiply
    without a shared expert, nothing when rsf is 1 and there is none), then
    ``_C.fused_add_rms_norm`` in place (x becomes norm_out, residual becomes residual_out). Under
    torch.compile vLLM may run the last add and the norm as one Inductor kernel instead; the
    end-to-end run (docs/vllm.md) measures that form."""

    TOLERANCE_FACTOR = _VllmTodayBase.TOLERANCE_FACTOR  # the same two roundings before the norm

    def __init__(self, setup, sets):
        super().__init__(setup, sets)
        try:
            import vllm._custom_ops  # noqa: F401  (loads vllm._C and vllm._moe_C)
            self.moe_sum = torch.ops._moe_C.moe_sum
            self.add_rms = torch.ops._C.fused_add_rms_norm
        except Exception as e:  # no vLLM, or its CUDA kernels do not load
            raise Skip(f"vLLM's kernels not available: {type(e).__name__}: {e}") from None
        self.gamma = setup.gamma.to(setup.dtype)
        # vLLM's kernel writes residual_out into the residual it is given: a copy of each set's,
        # so that the input sets stay as every implementation's check expects them (the check
        # runs first, on a pristine copy).
        self.res = {id(inp): inp.residual.clone() for per in sets for inp in per.values()}

    def call(self, rank, comm, inp):
        a = self.setup.args
        rows = inp.expert_out
        T, _, H = rows.shape
        y = torch.empty((T, H), dtype=rows.dtype, device=rows.device)
        self.moe_sum(rows, y)
        out = torch.empty_like(y)
        out.copy_(y)
        sc = float(a.routed_scaling)
        if inp.shared is not None:
            out = torch.add(inp.shared, out, alpha=sc)
        elif sc != 1.0:
            out = torch.mul(out, sc)
        residual = self.res[id(inp)]
        self.add_rms(out, residual, self.gamma, float(a.eps))
        return out, residual

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
    N = setup.world_size
    if a.producer and name not in ("arfuse", "arfuse_pdl", "arfuse_oneshot", "arfuse_twoshot"):
        raise Skip("--producer times arfuse's own implementations only")
    if name in ("arfuse", "arfuse_pdl"):
        if name == "arfuse_pdl" and setup.device.type != "cuda":
            raise Skip("programmatic dependent launch needs a CUDA device")
        impl = ArfuseFused(setup, sets, "auto", pdl=name == "arfuse_pdl")
        impl.algorithm = (BB.resolve_algorithm("auto", T, thr, N) if thr is not None or N == 1
                          else None)
    elif name in ("arfuse_oneshot", "arfuse_twoshot"):
        if N == 1:
            raise Skip("world size 1 has no all-reduce (arfuse runs the local algorithm)")
        algo = name.split("_")[1]
        impl = ArfuseFused(setup, sets, algo)
        impl.algorithm = algo
    elif name == "unfused":
        # Two phases only where ranks wait for each other (world size 1: nothing to wait for).
        impl = (UnfusedEmulated(setup, sets) if setup.emulated and N > 1
                else Unfused(setup, sets))
        impl.algorithm = (BB.resolve_algorithm("auto", T, thr, N) if thr is not None or N == 1
                          else None)
    elif name in ("arfuse_q", "arfuse_sepq"):
        if not a.quant:
            raise Skip("needs --quant")
        try:
            impl = ArfuseQuant(setup, sets) if name == "arfuse_q" else ArfuseSepQuant(setup, sets)
        except ImportError as e:
            raise Skip(f"no separate quantization kernel: {e}") from None
        impl.algorithm = (BB.resolve_algorithm("auto", T, thr, N) if thr is not None or N == 1
                          else None)
    elif name == "vllm_today":
        if a.layout != "dense" or a.weights_dtype != "none":
            raise Skip("needs --layout dense --weights-dtype none (vLLM's weighted rows)")
        impl = (VllmTodayEmulated(setup, sets) if setup.emulated and N > 1
                else VllmToday(setup, sets))
        impl.algorithm = (BB.resolve_algorithm("auto", T, thr, N) if thr is not None or N == 1
                          else None)
    elif name == "vllm_ops":
        if N != 1:
            raise Skip("vLLM's kernels at world size 1 only (no all-reduce among them)")
        if a.layout != "dense" or a.weights_dtype != "none":
            raise Skip("needs --layout dense --weights-dtype none (vLLM's weighted rows)")
        impl = VllmOps(setup, sets)
        impl.algorithm = "local"
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
