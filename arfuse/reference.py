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
        rows = expert_out.to(acc)[idx.clamp(0, max(P - 1, 0))]  # [T, K, H]
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
