"""Input generation and checking shared by the GPU suites (not a test module).

Every case draws fresh random inputs (the seed is printed on failure), poisons the outputs before
the run (NaN bit patterns: an element the kernel does not write fails the check), computes a
float64 reference of the op's definition (arfuse.reference.fused_reference) and checks every
element: NaN positions equal, infinities equal, ‖out − ref‖/‖ref‖ over the finite elements within
the dtype's tolerance, and all ranks' outputs bitwise identical.
"""

from __future__ import annotations

import dataclasses
import random

import torch

import arfuse
from arfuse import _checks, reference
# The inputs, poisoning, tolerances (‖out − ref‖ / ‖ref‖ per activation dtype, issue 3) and
# element checks are the package's (arfuse/_checks.py), shared with torchrun -m arfuse.check.
from arfuse._checks import (DTYPES, TOL, _plant_specials, _rand, bits, check_fp8,  # noqa: F401
                            check_tensor, fp8_ulp_distance, make_inputs, poison_like, rel_err)
from arfuse._vocab import QUANT_GROUP, QUANT_GROUP_SIZES


@dataclasses.dataclass
class Case(_checks.Case):
    """The package's case (arfuse/_checks.py) plus the dynamic FP8 outputs (fused_fp8_dynamic):
    quant "fp8_token" or "fp8_group128"; scale_ub: the per-token upper bound (a float32
    one-element tensor is made of it); scale_col: column-major group scales; ue8m0: power-of-two
    group scales."""
    quant: str | None = None
    scale_ub: float | None = None
    scale_col: bool = False
    ue8m0: bool = False

    def __str__(self) -> str:
        s = super().__str__()
        if self.quant:
            s += f"-{self.quant}"
        if self.scale_ub is not None:
            s += f"-ub{self.scale_ub}"
        if self.scale_col:
            s += "-col"
        if self.ue8m0:
            s += "-ue8m0"
        return s

    @property
    def group_size(self) -> int:
        return QUANT_GROUP_SIZES.get(self.quant, 0)

    def scale_shape(self) -> tuple:
        return (self.tokens,) if self.quant == "fp8_token" else (self.tokens, self.hidden // QUANT_GROUP)


def run_case(group, case: Case, seed: int, fp8_scale=None):
    """Runs the op on every rank of an emulated group. Returns per-rank (norm_out, residual_out)
    and the inputs. Outputs are poisoned: their memory is filled with NaN patterns just before
    the op allocates them (asserted to be the same memory), or, in place, before the call."""
    device = group.device
    ranks, residual, gamma = make_inputs(case, device, seed)
    T, H = case.tokens, case.hidden
    out_dtype = torch.float8_e4m3fn if case.fp8 or case.quant else case.dtype
    scale = fp8_scale
    qkw = {}
    if case.quant:
        qkw = dict(quant=case.quant, scale_layout="col" if case.scale_col else "row",
                   scale_ue8m0=case.ue8m0)
        if case.scale_ub is not None:
            qkw["scale_ub"] = torch.tensor([case.scale_ub], dtype=torch.float32, device=device)

    def fn(rank, comm):
        inp = ranks[rank]
        if case.inplace:
            x = inp["expert_out"].clone()
            res = residual.clone()
            return arfuse.moe_finalize_allreduce_rmsnorm(
                comm, x, res, gamma, case.eps, shared_out=inp.get("shared_out"),
                routed_scaling=case.routed_scaling, weight_bias=case.weight_bias, inplace=True,
                algorithm=case.algorithm)
        # Poison exactly the blocks the op is about to allocate (same sizes, same order, same
        # stream): norm_out (q), residual_out and, for the dynamic FP8 kinds, the scales.
        poisoned = [poison_like((T, H), out_dtype, device), poison_like((T, H), case.dtype, device)]
        if case.quant:
            poisoned.append(poison_like(case.scale_shape(), torch.float32, device))
        ptrs = [t.data_ptr() for t in poisoned]
        del poisoned
        out = arfuse.moe_finalize_allreduce_rmsnorm(
            comm, inp["expert_out"], residual, gamma, case.eps,
            permuted_idx=inp.get("permuted_idx"), expert_weights=inp.get("expert_weights"),
            shared_out=inp.get("shared_out"), routed_scaling=case.routed_scaling,
            weight_bias=case.weight_bias, algorithm=case.algorithm, fp8_scale=scale, **qkw)
        if T > 0:
            assert sorted(o.data_ptr() for o in out) == sorted(ptrs), "poisoning missed the outputs"
        return out

    with _checks.gc_held():  # no collection between a rank's poisoning and its op (gc_held)
        outs = group.run(fn)
    torch.cuda.synchronize(device)
    return outs, (ranks, residual, gamma)


def check_case(case: Case, outs, inputs, fp8_scale=None) -> dict:
    """All checks for one case; returns the worst errors (for docs/validation.md). The bf16 /
    fp16 / fp32 / static-FP8 outputs are checked by the package's rule (arfuse._checks: bitwise
    across ranks, then rank 0 against the float64 reference), the dynamic FP8 kinds below."""
    if case.quant:
        return check_dynamic_case(case, outs, inputs)
    return _checks.check_case(case, outs, inputs, fp8_scale)


def new_seed() -> int:
    return random.SystemRandom().randrange(1 << 31)


# ---- FP8 with dynamic scales (fp8_token, fp8_group128) --------------------------------------------
# Scales are compared with the float64 reference's relative to it. The kernel computes y, amax and
# amax / 448 in float32: y = fl(fl(r * inv) * fl(gamma + bias)) with inv = rsqrtf(fl(fl(ss / H) +
# eps)) and ss the float32 sum of squares. With u = 2^-24: 3u (gamma + bias, two products) + u
# (ss / H, + eps, halved by the square root) + 4u (rsqrtf: 2 ulp) + u (amax / 448) + d * u / 2,
# where d is the longest chain of float32 additions in ss (vectors per thread * elements per
# vector + 5 shuffle steps + warps + cluster CTAs; at most 37 for the shapes tested here). So
# |scale - ref| / ref <= 9u + 18.5u = 27.5u (about 14 * 2^-23); the bound used is 16 * 2^-23. A
# missing or extra element in an amax moves a scale by far more.
SCALE_RTOL = 16 * 2.0 ** -23


def scales_logical(scales: torch.Tensor) -> torch.Tensor:
    """[T] or [T, G] float32 scales by (t, g), whatever their memory layout."""
    return scales.double().clone()


def check_fp8_dynamic(q: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, *, group_size: int,
                      scale_ub=None, ue8m0: bool = False, what: str = "") -> dict:
    """Checks FP8 codes and scales against the float64 rules of arfuse.reference applied to y
    (the float64 RMSNorm of the op's own residual_out). Scales: NaN and Inf where the reference
    has them, else within SCALE_RTOL; with ue8m0 the scale must be the power of two the rule
    gives for the raw scale or, where the raw scale lies within SCALE_RTOL of a power of two,
    the power of two on either side (the float32 raw scale may round across it), and the codes
    are then checked against that scale. Codes: NaN exactly where the reference's are NaN, every
    other code within one unit in the last place. Returns the worst errors."""
    T, H = y.shape
    y = y.double()
    if group_size == 0:
        s_raw = reference.fp8_token_scales(y, scale_ub)
        assert scales.shape == (T,), f"{what}: scales shape {tuple(scales.shape)} != {(T,)}"
    else:
        s_raw = reference.fp8_group_scales(y, group_size, False)
        assert scales.shape == (T, H // group_size), \
            f"{what}: scales shape {tuple(scales.shape)} != {(T, H // group_size)}"
    assert scales.dtype == torch.float32, f"{what}: scales dtype {scales.dtype}"
    s_k = scales_logical(scales).to(y.device)
    s_ref = reference.ue8m0(s_raw) if ue8m0 else s_raw
    nan_k, nan_r = torch.isnan(s_k), torch.isnan(s_ref)
    if not torch.equal(nan_k, nan_r):
        bad = (nan_k != nan_r).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: scale NaN positions differ from the reference at {bad}")
    inf_r = torch.isinf(s_ref)
    if not torch.equal(torch.isinf(s_k), inf_r) or not torch.equal(s_k[inf_r], s_ref[inf_r]):
        raise AssertionError(f"{what}: scale infinities differ from the reference")
    fin = torch.isfinite(s_ref)
    s_use = s_ref
    if ue8m0:
        lo = reference.ue8m0(s_raw * (1 - SCALE_RTOL))
        hi = reference.ue8m0(s_raw * (1 + SCALE_RTOL))
        ok = (s_k == lo) | (s_k == hi) | ~fin
        if not bool(ok.all()):
            i = (~ok).nonzero()[0].tolist()
            raise AssertionError(f"{what}: UE8M0 scale at {i} is {float(s_k[tuple(i)])!r}, the "
                                 f"rule gives {float(s_ref[tuple(i)])!r} (raw {float(s_raw[tuple(i)])!r})")
        s_use = torch.where(fin, s_k, s_ref)
        rel = torch.where(fin, (s_k - s_use).abs() / s_use, torch.zeros_like(s_k))
    else:
        rel = torch.where(fin, (s_k - s_ref).abs() / s_ref.abs().clamp_min(1e-300),
                          torch.zeros_like(s_k))
        if bool((rel > SCALE_RTOL).any()):
            i = (rel > SCALE_RTOL).nonzero()[0].tolist()
            raise AssertionError(
                f"{what}: scale at {i} is {float(s_k[tuple(i)])!r}, the reference's "
                f"{float(s_ref[tuple(i)])!r} (relative error {float(rel[tuple(i)]):.3e} > "
                f"{SCALE_RTOL:.3e})")
    worst_scale = float(rel.max()) if rel.numel() else 0.0
    q_ref = reference.quantize_fp8_scaled(y, s_use).to(q.device)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, H), f"{what}: q {q.dtype} {tuple(q.shape)}"
    nan_o = torch.isnan(q.float())
    nan_q = torch.isnan(q_ref.float())
    if not torch.equal(nan_o, nan_q):
        bad = (nan_o != nan_q).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: FP8 NaN positions differ from the reference at {bad} "
                             f"({int((nan_o != nan_q).sum())} codes)")
    d = fp8_ulp_distance(q[~nan_q], q_ref[~nan_q])
    worst = int(d.max()) if d.numel() else 0
    if worst > 1:
        i = (fp8_ulp_distance(q, q_ref).masked_fill(nan_q, 0) > 1).nonzero()[0].tolist()
        raise AssertionError(f"{what}: FP8 code at {i} is {float(q[tuple(i)].float())!r}, the "
                             f"reference's {float(q_ref[tuple(i)].float())!r} ({worst} ulp > 1)")
    return {"norm_out": float(worst), "scales": worst_scale}


def check_dynamic_case(case: Case, outs, inputs) -> dict:
    """All checks of one dynamic-FP8 case: outputs bitwise identical on every rank, scale layout,
    residual_out against the float64 reference within the dtype's tolerance, codes and scales
    against the float64 rules applied to the float64 RMSNorm of the op's own residual_out (the
    residual_out rounding is checked separately; a residual element one rounding away from the
    reference's would move its token's scale by far more than float32 rounding)."""
    ranks, residual, gamma = inputs
    _, res_ref = reference.fused_reference(ranks, residual, gamma, case.eps,
                                           weight_bias=case.weight_bias,
                                           routed_scaling=case.routed_scaling, acc=torch.float64)
    q0, r0, s0 = outs[0]
    T, H = case.tokens, case.hidden
    for rank, (q, r, sc) in enumerate(outs):
        assert q.dtype == torch.float8_e4m3fn and r.dtype == case.dtype and sc.dtype == torch.float32
        assert torch.equal(bits(q), bits(q0)), f"{case}: q of rank {rank} differs bitwise from rank 0"
        assert torch.equal(bits(r), bits(r0)), f"{case}: residual_out of rank {rank} differs bitwise from rank 0"
        assert torch.equal(bits(sc), bits(s0)), f"{case}: scales of rank {rank} differ bitwise from rank 0"
    assert tuple(s0.shape) == case.scale_shape(), f"{case}: scales shape {tuple(s0.shape)}"
    if case.quant == "fp8_group128" and case.scale_col:
        want = (1, max(T, 1))  # a [G, T] tensor transposed (T = 0: strides (1, 1))
        assert s0.stride() == want, f"{case}: column-major scales want strides {want}, got {s0.stride()}"
    elif T > 0:
        assert s0.is_contiguous(), f"{case}: row-major scales must be contiguous, strides {s0.stride()}"
    res_err = check_tensor(r0, res_ref, TOL[case.dtype], f"{case}: residual_out")
    y = reference.float32_range(reference.rmsnorm(r0, gamma, case.eps, case.weight_bias,
                                                  acc=torch.float64))
    ub = None
    if case.scale_ub is not None:
        ub = torch.tensor([case.scale_ub], dtype=torch.float32)
    errs = check_fp8_dynamic(q0, s0, y, group_size=case.group_size, scale_ub=ub,
                             ue8m0=case.ue8m0, what=str(case))
    return {"residual_out": res_err, **errs}
