"""The eager call: MoE output + residual + a vLLM norm layer -> (norm_out, residual_out).

For code that runs outside torch.compile (or wants the fused tail explicitly), with vLLM's MoE
output in any of the forms vLLM hands out or will hand out:

* a plain tensor [T, H]: the routed output, already finalized (what vLLM 0.26.0's moe_forward
  returns);
* an UnfinalizedMoEOutput (vLLM's fused_moe/moe_output.py, newer than 0.26.0: gemm2_permuted
  [P, H] unweighted rows, expert_weights [T, K], expanded_idx_to_permuted_idx [T, K] int32 with
  -1 for experts not on this rank), or the same three tensors as a tuple;
* a MoEOutput (routed = either of the above, shared_output, routed_scaling_factor).

The classes are read by their fields, not imported, because vLLM 0.26.0 does not have them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Parts:
    expert_out: torch.Tensor
    permuted_idx: torch.Tensor | None = None
    expert_weights: torch.Tensor | None = None
    shared_out: torch.Tensor | None = None
    routed_scaling: float = 1.0


def _routed(routed: Any) -> _Parts:
    if isinstance(routed, torch.Tensor):
        return _Parts(routed)
    if all(hasattr(routed, f) for f in ("gemm2_permuted", "expert_weights",
                                        "expanded_idx_to_permuted_idx")):
        return _Parts(routed.gemm2_permuted, routed.expanded_idx_to_permuted_idx,
                      routed.expert_weights)
    if isinstance(routed, (tuple, list)) and len(routed) == 3 and all(
        isinstance(t, torch.Tensor) for t in routed
    ):
        gemm2_permuted, expert_weights, idx = routed
        return _Parts(gemm2_permuted, idx, expert_weights)
    raise TypeError(
        "moe_output: want a tensor [T, H], an UnfinalizedMoEOutput (gemm2_permuted, "
        "expert_weights, expanded_idx_to_permuted_idx), those three tensors as a tuple, or a "
        f"MoEOutput; got {type(routed).__name__}"
    )


def unpack_moe_output(
    moe_output: Any,
    *,
    shared_output: torch.Tensor | None = None,
    routed_scaling_factor: float | None = None,
) -> _Parts:
    """The tensors of `moe_output` in arfuse's terms (keyword arguments override its fields)."""
    if hasattr(moe_output, "routed") and not isinstance(moe_output, torch.Tensor):
        parts = _routed(moe_output.routed)
        parts.shared_out = getattr(moe_output, "shared_output", None)
        parts.routed_scaling = float(getattr(moe_output, "routed_scaling_factor", 1.0))
    else:
        parts = _routed(moe_output)
    if shared_output is not None:
        parts.shared_out = shared_output
    if routed_scaling_factor is not None:
        parts.routed_scaling = float(routed_scaling_factor)
    return parts


def norm_parameters(norm_layer: Any, like: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(gamma, eps, weight_bias) of a vLLM RMSNorm or GemmaRMSNorm layer."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    if isinstance(norm_layer, GemmaRMSNorm):
        return norm_layer.weight.data, float(norm_layer.variance_epsilon), 1.0
    if isinstance(norm_layer, RMSNorm):
        if norm_layer.variance_size_override is not None:
            raise ValueError(
                "norm_layer: an RMSNorm with var_hidden_size (a partial variance) is not what "
                "arfuse computes"
            )
        if norm_layer.has_weight:
            gamma = norm_layer.weight.data
        else:
            gamma = torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)
        return gamma, float(norm_layer.variance_epsilon), 0.0
    raise TypeError(
        f"norm_layer: want vLLM's RMSNorm or GemmaRMSNorm, got {type(norm_layer).__name__}"
    )


def _finalize_unfused(parts: _Parts, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The partial sum this rank contributes, computed with PyTorch (arfuse's reference)."""
    from arfuse import reference

    return reference.finalize(
        parts.expert_out,
        num_tokens=num_tokens,
        permuted_idx=parts.permuted_idx,
        expert_weights=parts.expert_weights,
        shared_out=parts.shared_out,
        routed_scaling=parts.routed_scaling,
    ).to(dtype)


def static_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's static per-tensor FP8 quantization (kFp8StaticTensorSym; QuantFP8.forward_native
    and its CUDA kernel alike): e4m3(clamp(x * (1 / scale), -448, 448)), float32 arithmetic."""
    y = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def moe_finalize_allreduce_rms_norm(
    moe_output: Any,
    residual: torch.Tensor,
    norm_layer: Any,
    *,
    shared_output: torch.Tensor | None = None,
    routed_scaling_factor: float | None = None,
    communicator: Any | None = None,
    algorithm: str | None = None,
    fp8_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Finalize the MoE output (top-k weighted sum, routed scaling, shared-expert add), all-reduce
    it over vLLM's tensor-parallel group, add the residual and apply `norm_layer`.

    Returns (norm_out, residual_out) as `norm_layer(x, residual)` would, with x the all-reduced
    MoE output. Uses arfuse's fused kernel when a communicator serves this model (the plugin's,
    or `communicator`); otherwise (tensor parallelism 1, arfuse off or not serving the shape) it
    computes the same thing unfused with PyTorch, vLLM's all-reduce and vLLM's norm op, so the
    call is always usable. Neither `residual` nor the MoE tensors are modified.

    fp8_scale: the static per-tensor input scale of the FP8 linear layer that reads norm_out (a
    float32 one-element tensor); norm_out is then float8_e4m3fn, what vLLM's static FP8 quant
    (static_fp8_quant) makes of it. Fused, arfuse quantizes the float32 norm directly, without
    rounding it to the activation dtype first: codes may differ from the unfused ones by one
    e4m3 step (see arfuse.vllm.fp8_fold.fold_static_fp8_quant). Without fp8_scale kernels for the
    model in arfuse's library the call takes the unfused path.
    """
    from .settings import from_env

    parts = unpack_moe_output(
        moe_output, shared_output=shared_output, routed_scaling_factor=routed_scaling_factor
    )
    gamma, eps, weight_bias = norm_parameters(norm_layer, residual)
    if communicator is None:
        from vllm.config import get_current_vllm_config

        from .communicators import get_communicator

        try:
            vllm_config = get_current_vllm_config()
        except Exception:
            vllm_config = None
        communicator = get_communicator(vllm_config)
    algorithm = algorithm or from_env().algorithm
    if communicator is not None:
        from .communicators import algorithm_for

        algorithm = algorithm_for(int(communicator.world_size), algorithm)
    if communicator is not None and fp8_scale is not None:
        from .communicators import fp8_supported

        if not fp8_supported(
            communicator.dtype, communicator.hidden, communicator.world_size, algorithm
        ):
            communicator = None
    if communicator is not None and residual.shape[0] <= communicator.max_tokens:
        import arfuse

        return arfuse.moe_finalize_allreduce_rmsnorm(
            communicator,
            parts.expert_out,
            residual,
            gamma,
            eps,
            permuted_idx=parts.permuted_idx,
            expert_weights=parts.expert_weights,
            shared_out=parts.shared_out,
            routed_scaling=parts.routed_scaling,
            weight_bias=weight_bias,
            algorithm=algorithm,
            fp8_scale=fp8_scale,
        )

    import vllm.ir.ops
    from vllm.distributed import tensor_model_parallel_all_reduce

    partial = _finalize_unfused(parts, residual.shape[0], residual.dtype)
    reduced = tensor_model_parallel_all_reduce(partial)
    weight = gamma.float() + 1.0 if weight_bias else gamma
    norm_out, residual_out = vllm.ir.ops.fused_add_rms_norm(reduced, residual, weight, eps)
    if fp8_scale is not None:
        norm_out = static_fp8_quant(norm_out, fp8_scale)
    return norm_out, residual_out
