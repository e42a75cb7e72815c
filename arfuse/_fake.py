"""Fake (Meta) implementations of the ops, for torch.compile and meta tensors.

Written in Python with torch.library.register_fake so that the token count stays symbolic under
dynamic shapes (vLLM compiles one graph for a range of token counts). They check what is fixed at
trace time — ranks of tensors, dtypes, the hidden size against the communicator — with
torch._check, and leave the rest (device placement, capacity) to the real op, which validates
everything before it launches.
"""

from __future__ import annotations

import torch

from . import _vocab

_registered = False


def _comm_dtype_hidden(comm: int):
    info = torch.ops.arfuse.comm_info(comm)
    return _vocab.TORCH_DTYPES[info[3]], info[2]


def _shape(expert_out, permuted_idx, residual):
    if residual is not None:
        torch._check(residual.dim() == 2, lambda: f"arfuse: residual: want [T, H], got {residual.shape}")
        return residual.shape[0], residual.shape[1]
    if permuted_idx is not None:
        return permuted_idx.shape[0], expert_out.shape[-1]
    return expert_out.shape[0], expert_out.shape[-1]


def _check_input(expert_out, permuted_idx, residual, comm):
    """The checks both fused ops' fakes share; returns (activation dtype, T, H)."""
    dtype, hidden = _comm_dtype_hidden(comm)
    T, H = _shape(expert_out, permuted_idx, residual)
    torch._check(expert_out.dtype == dtype,
                 lambda: f"arfuse: expert_out: dtype {expert_out.dtype} does not match the communicator's {dtype}")
    torch._check(expert_out.dim() in (2, 3), lambda: f"arfuse: expert_out: want 2 or 3 dims, got {expert_out.dim()}")
    torch._check(H == hidden, lambda: f"arfuse: hidden size {H} does not match the communicator's {hidden}")
    return dtype, T, H


def fused_fake(expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
               weight_bias, routed_scaling, fp8_scale, comm, algorithm):
    dtype, T, H = _check_input(expert_out, permuted_idx, residual, comm)
    # fused: the kind with an input scale when fp8_scale is given, else norm (activation dtype).
    out_dtype = _vocab.OUTPUT_DTYPES[_vocab.STATIC_KIND] if fp8_scale is not None else dtype
    return (expert_out.new_empty((T, H), dtype=out_dtype), expert_out.new_empty((T, H), dtype=dtype))


def fused_fp8_dynamic_fake(expert_out, permuted_idx, expert_weights, shared_out, residual, gamma,
                           eps, weight_bias, routed_scaling, group_size, scale_ub,
                           col_major_scales, ue8m0, comm, algorithm):
    dtype, T, H = _check_input(expert_out, permuted_idx, residual, comm)
    kind = _vocab.dynamic_kind(group_size)
    torch._check(kind is not None,
                 lambda: f"arfuse: group_size: {group_size} is not supported (want "
                         f"{' or '.join(str(_vocab.OUTPUT_ROWS[k]['group']) for k in _vocab.DYNAMIC_KINDS)})")
    row = _vocab.OUTPUT_ROWS[kind]
    q = expert_out.new_empty((T, H), dtype=_vocab.OUTPUT_DTYPES[kind] or dtype)
    residual_out = expert_out.new_empty((T, H), dtype=dtype)
    # The scales by the kind's rule: one per token, or one per group of row["group"] elements.
    if row["scales"] == "token":
        scales = expert_out.new_empty((T,), dtype=torch.float32)
    else:
        g = row["group"]
        torch._check(H % g == 0,
                     lambda: f"arfuse: hidden: {H} is not a multiple of group_size={g}")
        G = H // g
        if col_major_scales:
            scales = expert_out.new_empty((G, T), dtype=torch.float32).t()  # strides (1, T)
        else:
            scales = expert_out.new_empty((T, G), dtype=torch.float32)
    return q, residual_out, scales


def fused_inplace_fake(input, residual, shared_out, gamma, eps, weight_bias, routed_scaling, comm,
                       algorithm):
    dtype, hidden = _comm_dtype_hidden(comm)
    torch._check(input.dim() == 2, lambda: "arfuse: input: in-place needs the plain layout [T, H]")
    torch._check(input.dtype == dtype and residual.dtype == dtype,
                 lambda: f"arfuse: input/residual: dtype must be the communicator's {dtype}")
    torch._check(input.shape[-1] == hidden,
                 lambda: f"arfuse: hidden size {input.shape[-1]} does not match the communicator's {hidden}")
    return None


def moe_finalize_fake(expert_out, permuted_idx, expert_weights, shared_out, routed_scaling,
                      num_tokens):
    return expert_out.new_empty((num_tokens, expert_out.shape[-1]))


def register() -> None:
    global _registered
    if _registered:
        return
    torch.library.register_fake("arfuse::fused", fused_fake)
    torch.library.register_fake("arfuse::fused_inplace", fused_inplace_fake)
    torch.library.register_fake("arfuse::fused_fp8_dynamic", fused_fp8_dynamic_fake)
    torch.library.register_fake("arfuse::moe_finalize", moe_finalize_fake)
    _registered = True
