"""CPU implementation of the ops for a communicator of world size 1 (the all-reduce is the
identity). It lets graphs that call arfuse run on the CPU (graph-rewrite tests, the vLLM pass
tests) with the op's exact definition; it is not a fast path. Validation is the C++ op's own
(torch.ops.arfuse.validate), run first: CPU and CUDA reject the same inputs with the same message,
and the token count is the one that validation inferred (the C++ code is the one place that reads
the input layout)."""

from __future__ import annotations

import torch

from . import _vocab, reference

_lib = None


def _check_comm(comm: int) -> None:
    info = torch.ops.arfuse.comm_info(comm)
    if info[1] != 1 or info[7] != -1:
        raise ValueError("arfuse: comm: CPU tensors need a CPU communicator of world size 1 "
                         "(arfuse.comm.cpu_communicator); this one is rank "
                         f"{info[0]} of {info[1]} on {'cuda:%d' % info[7] if info[7] >= 0 else 'cpu'}")


def _norm_and_residual(T, expert_out, permuted_idx, expert_weights, shared_out, residual, gamma,
                       eps, weight_bias, routed_scaling):
    """The op at world size 1 for T tokens: the partial rounded once to the activation dtype,
    then residual + RMSNorm. Returns (norm as the kernel's float32 y, residual_out)."""
    dtype = expert_out.dtype
    partial = reference.finalize(expert_out, num_tokens=T, permuted_idx=permuted_idx,
                                 expert_weights=expert_weights, shared_out=shared_out,
                                 routed_scaling=routed_scaling).to(dtype)
    return reference.allreduce_add_rmsnorm([partial], residual, gamma, eps, weight_bias, dtype)


def _compute(T, expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
             weight_bias, routed_scaling, fp8_scale):
    norm, residual_out = _norm_and_residual(T, expert_out, permuted_idx, expert_weights, shared_out,
                                            residual, gamma, eps, weight_bias, routed_scaling)
    # fused: the kind with an input scale when fp8_scale is given, else norm (as the C++ op picks).
    kind = _vocab.STATIC_KIND if fp8_scale is not None else "norm"
    out, _ = reference.quantize(kind, norm, fp8_scale=fp8_scale)
    if _vocab.OUTPUT_DTYPES[kind] is None:
        out = out.to(expert_out.dtype)
    return out, residual_out


def fused_cpu(expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
              weight_bias, routed_scaling, fp8_scale, comm, algorithm):
    _check_comm(comm)
    T = torch.ops.arfuse.validate(expert_out, permuted_idx, expert_weights, shared_out, residual,
                                  gamma, eps, weight_bias, fp8_scale, comm, algorithm)[0]
    return _compute(T, expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
                    weight_bias, routed_scaling, fp8_scale)


def fused_fp8_dynamic_cpu(expert_out, permuted_idx, expert_weights, shared_out, residual, gamma,
                          eps, weight_bias, routed_scaling, group_size, scale_ub, col_major_scales,
                          ue8m0, comm, algorithm):
    _check_comm(comm)
    T = torch.ops.arfuse.validate_fp8_dynamic(expert_out, permuted_idx, expert_weights, shared_out,
                                              residual, gamma, eps, weight_bias, group_size,
                                              scale_ub, col_major_scales, ue8m0, comm, algorithm)[0]
    norm, residual_out = _norm_and_residual(T, expert_out, permuted_idx, expert_weights, shared_out,
                                            residual, gamma, eps, weight_bias, routed_scaling)
    # norm is the float32 y of the kernel. The scale rules are evaluated in float64 and rounded
    # once to float32 (amax / 448 so rounded is the kernel's float32 division); the codes are
    # y / scale with that float32 scale, as the kernel divides.
    q, scales = reference.quantize(_vocab.dynamic_kind(group_size), norm, scale_ub=scale_ub,
                                   ue8m0_scales=ue8m0, scale_dtype=torch.float32)
    if col_major_scales:  # [T, G] with strides (1, T), as the CUDA op returns it
        scales = torch.empty((scales.shape[1], scales.shape[0]), dtype=torch.float32).t().copy_(scales)
    return q, residual_out, scales


def fused_inplace_cpu(input, residual, shared_out, gamma, eps, weight_bias, routed_scaling, comm,
                      algorithm):
    _check_comm(comm)
    # The CUDA op's own in-place validation (layout, and no written buffer sharing memory with
    # another argument), before anything is written.
    T = torch.ops.arfuse.validate_inplace(input, residual, shared_out, gamma, eps, weight_bias,
                                          comm, algorithm)[0]
    norm, residual_out = _compute(T, input, None, None, shared_out, residual, gamma, eps,
                                  weight_bias, routed_scaling, None)
    input.copy_(norm)
    residual.copy_(residual_out)


def moe_finalize_cpu(expert_out, permuted_idx, expert_weights, shared_out, routed_scaling,
                     num_tokens):
    torch.ops.arfuse.validate_finalize(expert_out, permuted_idx, expert_weights, shared_out,
                                       num_tokens)
    return reference.finalize(expert_out, num_tokens=num_tokens, permuted_idx=permuted_idx,
                              expert_weights=expert_weights, shared_out=shared_out,
                              routed_scaling=routed_scaling).to(expert_out.dtype)


def register() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("arfuse", "IMPL")
    _lib.impl("fused", fused_cpu, "CPU")
    _lib.impl("fused_inplace", fused_inplace_cpu, "CPU")
    _lib.impl("fused_fp8_dynamic", fused_fp8_dynamic_cpu, "CPU")
    _lib.impl("moe_finalize", moe_finalize_cpu, "CPU")
