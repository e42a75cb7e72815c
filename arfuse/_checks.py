"""Case inputs and result checks of the correctness suites, as a package module.

The GPU suites (tests/fused_cases.py, tests/test_gpu_fused.py) and the multi-process check
(arfuse.check) draw and check cases the same way; this module holds the generic parts so that
the package does not import from tests/; tests/fused_cases.py imports these (Case, make_inputs,
poison_like, bits, rel_err, check_tensor, the FP8 check and the tolerances) and adds the dynamic
FP8 cases. Checks raise AssertionError explicitly rather than `assert`, so that `python -O` cannot
drop one.

Every case draws fresh random inputs from a seed (the same seed gives the same inputs on the same
device type), poisons the outputs before the run (NaN bit patterns: an element the kernel does not
write fails the check), computes a float64 reference of the op's definition
(arfuse.reference.fused_reference) and checks every element: NaN positions equal, infinities equal,
‖out − ref‖/‖ref‖ over the finite elements within the dtype's tolerance, and all ranks' outputs
bitwise identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch

from . import reference
from ._vocab import DTYPE_NAME_OF, DTYPES  # noqa: F401 (DTYPES: the suites' name -> dtype)

# ‖out − ref‖ / ‖ref‖ bounds per activation dtype (issue 3).
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}

# The input forms and options both suites sweep (tests/test_gpu_fused.py, arfuse.check):
# layout, K, weights, shared, routed_scaling, weight_bias, gamma_f32, absent
OPTION_CASES = [
    ("plain", 1, None, True, 1.0, 0.0, False, 0.0),
    ("plain", 1, None, False, 2.5, 1.0, True, 0.0),
    ("dense", 1, "f32", False, 1.0, 0.0, False, 0.0),
    ("dense", 2, "act", True, 1.0, 1.0, False, 0.0),
    ("dense", 4, None, True, 2.5, 0.0, True, 0.0),
    ("dense", 8, "f32", False, 1.0, 0.0, False, 0.0),
    ("dense", 10, "act", True, 2.5, 1.0, True, 0.0),
    ("permuted", 1, "f32", True, 1.0, 0.0, False, 0.5),
    ("permuted", 2, None, False, 1.0, 1.0, False, 0.0),
    ("permuted", 4, "act", True, 2.5, 0.0, True, 0.3),
    ("permuted", 8, "f32", True, 2.5, 1.0, False, 0.6),
    ("permuted", 10, "act", False, 1.0, 0.0, True, 0.2),
    ("permuted", 8, "f32", True, 1.0, 0.0, False, 1.0),  # no expert of any token on any rank
]


def _require(cond, msg) -> None:
    if not cond:
        raise AssertionError(msg() if callable(msg) else msg)


@dataclasses.dataclass
class Case:
    world: int
    hidden: int
    dtype: torch.dtype
    tokens: int
    layout: str = "dense"  # plain | dense | permuted
    topk: int = 8
    weights: str | None = "f32"  # None | "f32" | "act"
    shared: bool = True
    routed_scaling: float = 1.0
    weight_bias: float = 0.0
    gamma_f32: bool = False
    absent: float = 0.0  # permuted: fraction of (t, k) with index -1
    specials: bool = False  # -0.0, subnormals, NaN, Inf in the inputs
    eps: float = 1e-6
    algorithm: str = "auto"
    fp8: bool = False
    inplace: bool = False

    def __str__(self) -> str:
        d = DTYPE_NAME_OF[self.dtype]
        s = (f"N{self.world}-H{self.hidden}-{d}-T{self.tokens}-{self.layout}-K{self.topk}-"
             f"w{self.weights}-sh{int(self.shared)}-rs{self.routed_scaling}-wb{self.weight_bias}-"
             f"{self.algorithm}")
        if self.gamma_f32:
            s += "-g32"
        if self.absent:
            s += f"-abs{self.absent}"
        if self.specials:
            s += "-specials"
        if self.fp8:
            s += "-fp8"
        if self.inplace:
            s += "-inplace"
        return s


def _rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def make_inputs(case: Case, device, seed: int):
    """Per-rank inputs (expert_out, permuted_idx, expert_weights, shared_out) of every rank and the
    replicated residual and gamma, all random values drawn from `seed`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    T, H, K, dt = case.tokens, case.hidden, case.topk, case.dtype
    ranks = []
    for _ in range(case.world):
        inp = {}
        if case.layout == "plain":
            inp["expert_out"] = _rand((T, H), dt, device, gen)
        elif case.layout == "dense":
            inp["expert_out"] = _rand((T, K, H), dt, device, gen)
        else:
            P = T * K + 3  # a few padding rows nobody points at
            inp["expert_out"] = _rand((P, H), dt, device, gen)
            perm = torch.randperm(T * K, generator=gen, device=device).to(torch.int32)
            idx = perm.reshape(T, K) if T > 0 else torch.empty(0, K, dtype=torch.int32, device=device)
            if case.absent > 0 and T > 0:
                drop = torch.rand((T, K), generator=gen, device=device) < case.absent
                idx = torch.where(drop, torch.full_like(idx, -1), idx)
            inp["permuted_idx"] = idx.contiguous()
        if case.layout != "plain" and case.weights is not None:
            w = torch.rand((T, K), generator=gen, device=device) + 0.05
            w = w / w.sum(dim=1, keepdim=True) if T > 0 else w
            inp["expert_weights"] = w if case.weights == "f32" else w.to(dt)
        if case.shared:
            inp["shared_out"] = _rand((T, H), dt, device, gen, 0.5)
        ranks.append(inp)
    residual = _rand((T, H), dt, device, gen, 2.0)
    gamma = (torch.rand((H,), generator=gen, device=device) + 0.5)
    gamma = gamma if case.gamma_f32 else gamma.to(dt)
    if case.specials and T >= 3:
        _plant_specials(case, ranks, residual)
    return ranks, residual, gamma


def _plant_specials(case: Case, ranks, residual):
    """-0.0 everywhere in token 0's residual and rank 0's rows; subnormals in token 1; a NaN in one
    element of token 1 on the last rank; +Inf in token 2 on rank 0 (its row becomes Inf/NaN)."""
    dt = case.dtype
    tiny = torch.finfo(dt).smallest_normal / 4  # a subnormal of the activation dtype
    residual[0] = -0.0
    H = case.hidden
    e0 = ranks[0]["expert_out"]
    eL = ranks[-1]["expert_out"]
    if case.layout == "permuted":
        # Point tokens 0..2 at the padding rows that no other (t, k) uses.
        P = e0.shape[0]
        ranks[0]["permuted_idx"][0, 0] = P - 3
        e0[P - 3] = -0.0
        ranks[-1]["permuted_idx"][1, 0] = P - 1
        eL[P - 1, 5 % H] = float("nan")
        eL[P - 1, 7 % H] = tiny
        ranks[0]["permuted_idx"][2, 0] = P - 2
        e0[P - 2, 3 % H] = float("inf")
    elif case.layout == "dense":
        e0[0] = -0.0
        eL[1, 0, 5 % H] = float("nan")
        eL[1, 0, 7 % H] = tiny
        e0[2, 0, 3 % H] = float("inf")
    else:
        e0[0] = -0.0
        eL[1, 5 % H] = float("nan")
        eL[1, 7 % H] = tiny
        e0[2, 3 % H] = float("inf")
    if "shared_out" in ranks[0]:
        ranks[0]["shared_out"][0] = -0.0
        ranks[0]["shared_out"][1, 9 % H] = tiny


@contextlib.contextmanager
def gc_held():
    """Python's cyclic garbage collector held off between poisoning the blocks an op is about to
    allocate and the op's allocations. A collection in between (the op's Python wrapper makes
    objects, which can trigger one) may free a CUDA tensor of an earlier cycle beside the freed
    poison blocks; the caching allocator merges them and hands the op other blocks ("poisoning
    missed the outputs", seen once in 621 GPU tests). Garbage is only deferred, not kept."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def poison_like(shape, dtype, device):
    """A tensor of NaN bit patterns (0xFF bytes: NaN in every float format, 0xFF = NaN in e4m3fn)."""
    *lead, last = shape
    t = torch.empty((*lead, last * dtype.itemsize), dtype=torch.uint8, device=device).fill_(0xFF)
    return t.view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bitwise comparisons (NaN == NaN, -0.0 != +0.0)."""
    return t.contiguous().view(torch.uint8)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖/‖ref‖ over elements where ref is finite (after NaN/Inf positions matched)."""
    o, r = out.double(), ref.double()
    fin = torch.isfinite(r)
    if not fin.any():
        return 0.0
    num = torch.linalg.vector_norm((o - r)[fin])
    den = torch.linalg.vector_norm(r[fin])
    if den == 0:
        return float(num)
    return float(num / den)


def check_tensor(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> float:
    """NaN positions equal, infinities equal, relative error over the finite elements <= tol.
    Returns the relative error; raises AssertionError naming `what` otherwise."""
    o, r = out.double(), ref.double()
    _require(o.shape == r.shape, lambda: f"{what}: shape {tuple(o.shape)} != {tuple(r.shape)}")
    nan_o, nan_r = torch.isnan(o), torch.isnan(r)
    if not torch.equal(nan_o, nan_r):
        bad = (nan_o != nan_r).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: NaN positions differ from the reference at {bad} "
                             f"({int((nan_o != nan_r).sum())} elements)")
    inf_r = torch.isinf(r)
    if not torch.equal(torch.isinf(o), inf_r) or not torch.equal(o[inf_r], r[inf_r]):
        raise AssertionError(f"{what}: infinities differ from the reference")
    err = rel_err(o, r)
    _require(err <= tol, lambda: f"{what}: relative error {err:.3e} > {tol:.0e}")
    return err


@dataclasses.dataclass(frozen=True)
class Fp8StaticRule:
    """The static-FP8 norm_out reference: the float64 RMSNorm of the op's *own* residual_out,
    quantised by vLLM's static rule. Not the float64 pipeline's codes: every rank's partial is
    rounded to the activation dtype for transport, and a partial whose float32 value lies on the
    other side of a rounding tie than its float64 value moves its element by one ulp of the
    partial; where that element is near zero its FP8 code moves by many ulp (up to 15 in a
    float32-vs-float64 simulation of the suite's cases on the CPU, 2026-12-05). That rounding is
    residual_out's, checked on its own against the float64 reference; from residual_out on, the
    kernel's float32 RMSNorm and scaling are within one FP8 ulp of float64 (as the dynamic kinds,
    tests/fused_cases.check_dynamic_case)."""
    gamma: torch.Tensor
    eps: float
    weight_bias: float
    scale: torch.Tensor

    def codes(self, residual_out: torch.Tensor) -> torch.Tensor:
        y = reference.rmsnorm(residual_out, self.gamma.to(residual_out.device), self.eps,
                              self.weight_bias, acc=torch.float64)
        return reference.quantize_fp8_static(y, self.scale.to(residual_out.device))


def reference_for(case: Case, inputs, fp8_scale=None, *, residual=True):
    """(norm_out, residual_out) of the op's definition in float64; for an FP8 case norm_out's
    reference is an Fp8StaticRule, applied to the op's own residual_out by
    check_against_reference. residual=False: the op called without a residual."""
    ranks, res, gamma = inputs
    norm, out = reference.fused_reference(ranks, res if residual else None, gamma, case.eps,
                                          weight_bias=case.weight_bias,
                                          routed_scaling=case.routed_scaling, acc=torch.float64)
    if case.fp8:
        return Fp8StaticRule(gamma, case.eps, case.weight_bias, fp8_scale), out
    return norm, out


def check_against_reference(case: Case, out, ref) -> dict:
    """One rank's (norm_out, residual_out) against the reference pair; the relative errors."""
    n, r = out
    norm_ref, res_ref = ref
    want = torch.float8_e4m3fn if case.fp8 else case.dtype
    _require(n.dtype == want, lambda: f"{case}: norm_out dtype {n.dtype}, want {want}")
    _require(r.dtype == case.dtype, lambda: f"{case}: residual_out dtype {r.dtype}, want {case.dtype}")
    tol = TOL[case.dtype]
    res_err = check_tensor(r, res_ref, tol, f"{case}: residual_out")
    if case.fp8:
        norm_err = check_fp8(n, norm_ref.codes(r), f"{case}: norm_out")
    else:
        norm_err = check_tensor(n, norm_ref, tol, f"{case}: norm_out")
    return {"residual_out": res_err, "norm_out": norm_err}


def check_bitwise_equal(case: Case, outs) -> None:
    """Every rank's (norm_out, residual_out) bit for bit the same as rank 0's."""
    n0, r0 = outs[0]
    for rank, (n, r) in enumerate(outs):
        if not torch.equal(bits(n), bits(n0)):
            raise AssertionError(f"{case}: norm_out of rank {rank} differs bitwise from rank 0 "
                                 f"({_count_diff(n, n0)} elements)")
        if not torch.equal(bits(r), bits(r0)):
            raise AssertionError(f"{case}: residual_out of rank {rank} differs bitwise from rank 0 "
                                 f"({_count_diff(r, r0)} elements)")


def _count_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape:
        return -1
    ea = a.element_size()
    ba, bb = bits(a).reshape(-1, ea), bits(b).reshape(-1, ea)
    return int((ba != bb).any(dim=1).sum())


def check_case(case: Case, outs, inputs, fp8_scale=None) -> dict:
    """All checks for one case with every rank's outputs at hand (as tests/fused_cases.check_case):
    bitwise equal across ranks, then rank 0's against the reference. Returns the worst errors."""
    check_bitwise_equal(case, outs)
    return check_against_reference(case, outs[0], reference_for(case, inputs, fp8_scale))


def fp8_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two e4m3fn tensors (ordered by code)."""
    def ordered(x):
        u = x.view(torch.uint8).to(torch.int32)
        mag = u & 0x7F
        return torch.where(u & 0x80 != 0, -mag, mag)
    return (ordered(a) - ordered(b)).abs()


def check_fp8(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    nan_o = torch.isnan(out.float())
    nan_r = torch.isnan(ref.float())
    _require(torch.equal(nan_o, nan_r), lambda: f"{what}: NaN positions differ")
    d = fp8_ulp_distance(out, ref).masked_fill(nan_r, 0)
    worst = int(d.max()) if d.numel() else 0
    if worst > 1:
        i = tuple((d == worst).nonzero()[0].tolist())
        raise AssertionError(f"{what}: FP8 code {worst} ulp from the reference's (want <= 1) at "
                             f"{list(i)}: {float(out[i].float())!r} vs "
                             f"{float(ref[i].float())!r} ({int((d > 1).sum())} elements > 1 ulp)")
    return float(worst)
