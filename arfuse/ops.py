"""The Python face of the torch ops registered by libarfuse_ops.so.

All validation happens once, in the C++ op (csrc/ops.cpp), before anything is launched: a wrong
dtype, shape, device, a non-contiguous input, too many tokens for the communicator or a hidden
size no kernel serves raise one error naming the argument and the rule.
"""

from __future__ import annotations

import torch

from . import _lib

_ALGORITHMS = {"auto": 0, "oneshot": 1, "twoshot": 2}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _algorithm(algorithm) -> int:
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"arfuse: algorithm: {algorithm!r} is not one of {sorted(_ALGORITHMS)}")
    return _ALGORITHMS[algorithm]


def _handle(comm) -> int:
    from .comm import Communicator

    if isinstance(comm, Communicator):
        return comm.handle
    if isinstance(comm, int):
        return comm
    raise TypeError(f"arfuse: comm: want an arfuse.Communicator, got {type(comm).__name__}")


def moe_finalize_allreduce_rmsnorm(comm, expert_out, residual, gamma, eps, *, permuted_idx=None,
                                   expert_weights=None, shared_out=None, routed_scaling=1.0,
                                   weight_bias=0.0, inplace=False, algorithm="auto",
                                   fp8_scale=None):
    """MoE finalize + shared add + all-reduce + residual + RMSNorm, fused. Returns
    (norm_out, residual_out), both [T, H].

    partial[t] = routed_scaling * sum_k w[t, k] * row(t, k) + shared_out[t]   (float32, rounded
    once to the activation dtype for transport); sum[t] = partials summed in rank order;
    residual_out[t] = sum[t] + residual[t]; norm_out[t] = residual_out[t] *
    rsqrt(mean(residual_out[t]^2) + eps) * (gamma + weight_bias).

    residual: [T, H], or None for no residual add (residual_out is then the all-reduced sum).
    expert_out: [T, H] (plain, already reduced), [T, K, H] (dense) or [P, H] rows addressed by
    permuted_idx [T, K] int32 (-1: expert not on this rank). expert_weights [T, K]: float32 or
    the activation dtype (None: 1). inplace (plain layout only): norm_out is written into
    expert_out and residual_out into residual, as vLLM's fused_add_rms_norm does.
    algorithm: "auto" (by token count), "oneshot" or "twoshot". fp8_scale: a float32 one-element
    tensor; norm_out is then FP8-e4m3 saturate(norm / scale).
    """
    _lib.require()
    handle = _handle(comm)
    algo = _algorithm(algorithm)
    if inplace:
        if permuted_idx is not None or expert_weights is not None or expert_out.dim() != 2:
            raise ValueError("arfuse: inplace: needs the plain layout (expert_out [T, H], no "
                             "permuted_idx, no expert_weights)")
        if fp8_scale is not None:
            raise ValueError("arfuse: inplace: the FP8 output cannot be written into the input")
        torch.ops.arfuse.fused_inplace(expert_out, residual, shared_out, gamma, float(eps),
                                       float(weight_bias), float(routed_scaling), handle, algo)
        return expert_out, residual
    return torch.ops.arfuse.fused(expert_out, permuted_idx, expert_weights, shared_out, residual,
                                  gamma, float(eps), float(weight_bias), float(routed_scaling),
                                  fp8_scale, handle, algo)


def moe_finalize(expert_out, *, num_tokens, permuted_idx=None, expert_weights=None,
                 shared_out=None, routed_scaling=1.0):
    """The standalone finalize kernel: routed_scaling * sum_k w * row + shared, [T, H], float32
    accumulation and one rounding. The first kernel of the unfused pipeline."""
    _lib.require()
    return torch.ops.arfuse.moe_finalize(expert_out, permuted_idx, expert_weights, shared_out,
                                         float(routed_scaling), int(num_tokens))


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"arfuse: dtype: {dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def instance_for(dtype, hidden: int, world_size: int, algorithm: str = "oneshot",
                 output: str = "norm") -> str | None:
    """Name of the kernel instance that serves this combination (specialised or generic), or None."""
    _lib.require()
    algo = _algorithm(algorithm)
    if algo == 0:
        raise ValueError("arfuse: algorithm: instance_for wants 'oneshot' or 'twoshot'")
    outs = {"norm": 0, "fp8_static": 1}
    if output not in outs:
        raise ValueError(f"arfuse: output: {output!r} is not one of {sorted(outs)}")
    name = torch.ops.arfuse.instance_for(_dtype(dtype), hidden, world_size, algo, outs[output])
    return name or None


def supported(dtype, hidden: int, world_size: int) -> bool:
    """Whether some kernel instance serves (dtype, hidden, world_size) with the norm output."""
    return any(instance_for(dtype, hidden, world_size, a) for a in ("oneshot", "twoshot"))


def oneshot_threshold(dtype, hidden: int, world_size: int) -> int:
    """auto dispatch uses one-shot for T <= this (measured tuning row, else the default rule)."""
    _lib.require()
    return torch.ops.arfuse.oneshot_threshold(_dtype(dtype), hidden, world_size)


def supported_variants() -> list[str]:
    """Every kernel instance compiled into the library."""
    _lib.require()
    return list(torch.ops.arfuse.supported_variants())
