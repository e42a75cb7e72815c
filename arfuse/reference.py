"""Reference implementations in PyTorch: the definition the kernels are tested against.

`finalize` and `allreduce_add_rmsnorm` take an accumulation dtype: float64 for the test
reference, float32 for the CPU implementation of the op (world size 1) and the benchmark's
PyTorch composition. The op's definition (see arfuse.moe_finalize_allreduce_rmsnorm): each
rank's partial is computed in float and rounded once to the activation dtype for transport;
partials are summed in rank order; residual_out = sum + residual, rounded to the activation
dtype; norm_out is the RMSNorm of that rounded residual_out (as vLLM's fused_add_rms_norm).
"""

from __future__ import annotations

import torch

from ._vocab import DYNAMIC_KINDS, OUTPUT_ROWS, QUANT_GROUP, dynamic_kind


def finalize(expert_out, *, num_tokens, permuted_idx=None, expert_weights=None, shared_out=None,
             routed_scaling=1.0, acc=torch.float32):
    """routed_scaling * sum_k w[t, k] * row(t, k) + shared[t] in `acc` ([T, H], not rounded)."""
    T = num_tokens
    if permuted_idx is not None:
        idx = permuted_idx.long()
        K = idx.shape[1]
        P = expert_out.shape[0]
        bad = ((idx < -1) | (idx >= P)).any(dim=1)  # the kernel makes such tokens NaN
        present = (idx >= 0) & (idx < P)
        if P == 0:  # no rows on this rank (every index -1, or out of range): nothing to gather
            rows = torch.zeros(T, K, expert_out.shape[-1], dtype=acc, device=expert_out.device)
        else:
            rows = expert_out.to(acc)[idx.clamp(0, P - 1)]  # [T, K, H]
        # Absent rows contribute exactly nothing (a NaN or Inf in them must not leak in).
        rows = torch.where(present.unsqueeze(-1), rows, torch.zeros((), dtype=acc, device=rows.device))
    elif expert_out.dim() == 3:
        rows = expert_out.to(acc)
        K = rows.shape[1]
        present = torch.ones(T, K, dtype=torch.bool, device=expert_out.device)
        bad = torch.zeros(T, dtype=torch.bool, device=expert_out.device)
    else:
        rows = expert_out.to(acc).unsqueeze(1)
        K = 1
        present = torch.ones(T, 1, dtype=torch.bool, device=expert_out.device)
        bad = torch.zeros(T, dtype=torch.bool, device=expert_out.device)
    if expert_weights is not None:
        w = expert_weights.to(acc)
    else:
        w = torch.ones(T, K, dtype=acc, device=expert_out.device)
    # Absent experts contribute exactly nothing (not 0 * row, which would turn Inf rows into NaN).
    w = torch.where(present, w, torch.zeros((), dtype=acc, device=w.device))
    out = (w.unsqueeze(-1) * rows).sum(dim=1) * routed_scaling
    if shared_out is not None:
        out = out + shared_out.to(acc)
    if bad.any():
        out[bad] = float("nan")
    return out


def rmsnorm(x, gamma, eps, weight_bias, acc=torch.float32):
    """x * rsqrt(mean(x^2) + eps) * (gamma + weight_bias) in `acc`."""
    x = x.to(acc)
    inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * inv * (gamma.to(acc) + weight_bias)


def quantize_fp8_static(norm, scale):
    """FP8-e4m3 saturate(norm / scale) (vLLM's static per-tensor semantics, x * (1 / scale))."""
    inv = 1.0 / scale.to(torch.float32)
    y = norm.to(torch.float32) * inv
    y = torch.where(torch.isnan(y), y, y.clamp(-448.0, 448.0))
    return y.to(torch.float8_e4m3fn)


# ---- FP8-e4m3 with dynamic scales (OutKind kFP8Token / kFP8Group128) -----------------------------
# y is the float32 RMSNorm output (norm_out before rounding to the activation dtype). Every rule
# is evaluated in float64; the kernel evaluates the same rules in float32 (true division
# y / scale). NaN propagates through amax: a NaN anywhere in a token (group) makes its amax, its
# scale and all of its codes NaN.

FP8_MAX = 448.0                      # largest finite float8_e4m3fn
FP8_TOKEN_MIN_SCALE = 1.0 / (448.0 * 512.0)
FP8_GROUP_MIN_AMAX = 1e-10
FP8_GROUP = QUANT_GROUP


def float32_range(y):
    """y (float64) with the values float32 cannot hold made +-Inf, as the kernel's float32 y
    overflows (a huge gamma element): the dynamic FP8 rules apply to y as float32 defines it."""
    y = y.double()
    limit = (2.0 - 2.0 ** -24) * 2.0 ** 127  # the smallest magnitude that rounds to Inf
    inf = torch.full_like(y, float("inf"))
    return torch.where(y.abs() >= limit, torch.copysign(inf, y), y)


def saturate_e4m3(x):
    """FP8-e4m3 codes of x: clamped to +-448, rounded to nearest even, NaN stays NaN."""
    x = x.double()
    x = torch.where(torch.isnan(x), x, x.clamp(-FP8_MAX, FP8_MAX))
    # Through float32, as torch converts a double to e4m3 anyway (c10::Float8_e4m3fn converts
    # from float): a double within 2^-24 of an e4m3 tie may round one code differently.
    return x.to(torch.float32).to(torch.float8_e4m3fn)


def _amax(x, dim):
    """max |x| over dim, NaN-propagating (torch.amax propagates NaN; an empty dim gives 0)."""
    return x.abs().amax(dim=dim)


def fp8_token_scales(y, scale_ub=None):
    """Per-token scales (vLLM's dynamic_per_token_scaled_fp8_quant), float64 [T]:
    amax_t = max_j |y[t, j]|; amax_t = min(amax_t, ub) when scale_ub is given;
    scale_t = max(amax_t / 448, 1 / (448 * 512)). NaN-propagating throughout."""
    y = y.double()
    amax = _amax(y, -1)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.double().reshape(()).to(amax.device))
    floor = torch.tensor(FP8_TOKEN_MIN_SCALE, dtype=torch.float64, device=y.device)
    return torch.maximum(amax / FP8_MAX, floor)


def ue8m0(scales):
    """Each scale rounded up to a power of two, 2^ceil(log2(s)), exactly (frexp, no log2);
    NaN, Inf and 0 unchanged."""
    s = scales.double()
    m, e = torch.frexp(s)
    up = torch.ldexp(torch.ones_like(s), (e - (m == 0.5).to(e.dtype)).to(torch.float64))
    return torch.where(torch.isfinite(s) & (s > 0), up, s)


def fp8_group_scales(y, group_size=FP8_GROUP, ue8m0_scales=False):
    """Per-token-group scales (vLLM's per_token_group_quant_fp8), float64 [T, H / group_size]:
    scale = max(amax, 1e-10) / 448 over each group of group_size consecutive elements of a
    row; ue8m0_scales: rounded up to a power of two. NaN-propagating."""
    y = y.double()
    T, H = y.shape
    if H % group_size != 0:
        raise ValueError(f"hidden {H} is not a multiple of group_size {group_size}")
    amax = _amax(y.reshape(T, H // group_size, group_size), -1)
    floor = torch.tensor(FP8_GROUP_MIN_AMAX, dtype=torch.float64, device=y.device)
    s = torch.maximum(amax, floor) / FP8_MAX
    return ue8m0(s) if ue8m0_scales else s


def quantize_fp8_scaled(y, scales):
    """saturate_e4m3(y / scale) in float64, scales [T] (per token) or [T, G] (per group of
    H / G consecutive elements)."""
    y = y.double()
    T, H = y.shape
    s = scales.double()
    if s.dim() == 1:
        return saturate_e4m3(y / s.reshape(T, 1))
    G = s.shape[1]
    q = y.reshape(T, G, H // G) / s.reshape(T, G, 1)
    return saturate_e4m3(q.reshape(T, H))


# ---- the reference quantizer of each output kind (one per arfuse/_vocab.py OUTPUT_ROWS row) ------
# quantize(kind, y, ...) -> (norm_out, scales): y is the float32 RMSNorm output. norm returns y
# itself (the caller rounds it to the activation dtype); the FP8 kinds return their codes, and the
# dynamic ones the scales they computed (float64, or rounded to scale_dtype first and used so
# rounded, as the kernel's float32 scales are), else None.

def _norm(y, **_):
    return y, None


def _fp8_static(y, *, fp8_scale, **_):
    return quantize_fp8_static(y, fp8_scale), None


def _fp8_token(y, *, scale_ub=None, scale_dtype=torch.float64, **_):
    s = fp8_token_scales(y, scale_ub).to(scale_dtype)
    return quantize_fp8_scaled(y, s), s


def _fp8_group128(y, *, ue8m0_scales=False, scale_dtype=torch.float64, **_):
    s = fp8_group_scales(y, OUTPUT_ROWS["fp8_group128"]["group"], ue8m0_scales).to(scale_dtype)
    return quantize_fp8_scaled(y, s), s


QUANTIZERS = {"norm": _norm, "fp8_static": _fp8_static, "fp8_token": _fp8_token,
              "fp8_group128": _fp8_group128}


def quantize(kind, y, *, fp8_scale=None, scale_ub=None, ue8m0_scales=False,
             scale_dtype=torch.float64):
    """The reference output of output kind `kind` for y: (norm_out, scales or None), by the
    kind's row (QUANTIZERS). fp8_scale: the input scale of the static kind; scale_ub and
    ue8m0_scales: the dynamic kinds' options their rows take."""
    if kind not in QUANTIZERS:
        raise ValueError(f"output kind {kind!r}: want one of {list(QUANTIZERS)}")
    return QUANTIZERS[kind](y, fp8_scale=fp8_scale, scale_ub=scale_ub, ue8m0_scales=ue8m0_scales,
                            scale_dtype=scale_dtype)


def quantize_fp8_dynamic(y, group_size=0, scale_ub=None, ue8m0_scales=False):
    """The dynamic FP8 outputs of y: (codes float8_e4m3fn [T, H], scales float64 [T] for
    group_size 0 (per token, optional scale_ub) or [T, H / 128] for group_size 128 (row-major;
    ue8m0_scales: powers of two)): the quantizer of the kind fused_fp8_dynamic serves for
    group_size."""
    kind = dynamic_kind(group_size)
    if kind is None:
        raise ValueError(f"group_size {group_size}: want one of "
                         f"{[OUTPUT_ROWS[k]['group'] for k in DYNAMIC_KINDS]}")
    return quantize(kind, y, scale_ub=scale_ub, ue8m0_scales=ue8m0_scales)


def allreduce_add_rmsnorm(partials, residual, gamma, eps, weight_bias, dtype, acc=torch.float32):
    """Rank-ordered sum of the (already rounded) partials, + residual, RMSNorm.

    Returns (norm_out, residual_out): residual_out rounded to `dtype`, norm_out in `acc` computed
    from the rounded residual_out (round it to the output dtype yourself)."""
    total = partials[0].to(acc)
    for p in partials[1:]:
        total = total + p.to(acc)
    if residual is not None:  # None: no residual add (vLLM's first layer)
        total = total + residual.to(acc)
    residual_out = total.to(dtype)
    return rmsnorm(residual_out, gamma, eps, weight_bias, acc), residual_out


def fused_reference(rank_inputs, residual, gamma, eps, *, weight_bias=0.0, routed_scaling=1.0,
                    acc=torch.float64):
    """The whole op for N ranks. rank_inputs: one dict per rank with expert_out, permuted_idx,
    expert_weights, shared_out. Returns (norm_out in acc, residual_out in the activation dtype)."""
    first = rank_inputs[0]
    dtype = first["expert_out"].dtype
    idx = first.get("permuted_idx")
    T = idx.shape[0] if idx is not None else first["expert_out"].shape[0]
    partials = []
    for inp in rank_inputs:
        p = finalize(inp["expert_out"], num_tokens=T, permuted_idx=inp.get("permuted_idx"),
                     expert_weights=inp.get("expert_weights"), shared_out=inp.get("shared_out"),
                     routed_scaling=routed_scaling, acc=acc)
        partials.append(p.to(dtype))  # rounded once for transport
    return allreduce_add_rmsnorm(partials, residual, gamma, eps, weight_bias, dtype, acc)
