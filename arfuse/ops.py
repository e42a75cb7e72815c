"""The Python face of the torch ops registered by libarfuse_ops.so.

All validation happens once, in the C++ op (csrc/host/validate.cpp), before anything is launched:
a wrong dtype, shape, device, a non-contiguous input, too many tokens for the communicator or a
hidden size no kernel serves raise one error naming the argument and the rule: ValueError (or
TypeError for a wrong dtype or type) from these functions; the library itself raises a
RuntimeError naming the kind first, which `_lib.reraise` turns into that kind.
"""

from __future__ import annotations

import torch

from . import _lib, _vocab
from ._vocab import QUANT_KINDS
from .comm import Communicator

_ALGORITHMS = _vocab.ALGORITHMS
_DTYPES = _vocab.DTYPES


def _algorithm(algorithm) -> int:
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"arfuse: algorithm: {algorithm!r} is not one of {sorted(_ALGORITHMS)}")
    return _ALGORITHMS[algorithm]


def _handle(comm) -> int:
    if isinstance(comm, Communicator):
        return comm.handle
    if isinstance(comm, int):
        return comm
    raise TypeError(f"arfuse: comm: want an arfuse.Communicator, got {type(comm).__name__}")


# QUANT_KINDS (from _vocab): the quantized output kinds of moe_finalize_allreduce_rmsnorm(quant=...).
_QUANTS = QUANT_KINDS
_SCALE_LAYOUTS = ("row", "col")
_OUTPUTS = _vocab.OUTPUTS


def _only_for(kinds) -> str:
    return " or ".join(f"quant={k!r}" for k in kinds)


def _scales_adjective(kinds) -> str:
    """What the scales of the first of these kinds are called: "per-token" or "per-group"."""
    return {"token": "per-token", "group": "per-group"}.get(
        _vocab.OUTPUT_ROWS[kinds[0]]["scales"] if kinds else "", "no")


def _quant_kind(quant, fp8_scale, scale_ub, scale_layout, scale_ue8m0):
    """The output kind asked for (None: norm), with every argument checked against its row
    (_vocab.OUTPUT_ROWS): no branch per kind."""
    static = _vocab.STATIC_KIND
    if quant is None and fp8_scale is not None:
        quant = static  # fp8_scale alone means static per-tensor FP8, as before
    if quant is not None and quant not in _QUANTS:
        raise ValueError(f"arfuse: quant: {quant!r} is not one of {list(_QUANTS)} (or None)")
    if quant == static and fp8_scale is None:
        raise ValueError(f"arfuse: fp8_scale: quant={static!r} needs a float32 one-element scale")
    if quant in _vocab.DYNAMIC_KINDS and fp8_scale is not None:
        raise ValueError(f"arfuse: fp8_scale: only for quant={static!r}; quant={quant!r} "
                         "computes its scales in the kernel")
    bounded, layouts = _vocab.kinds_with("bounded"), _vocab.kinds_with("layouts")
    if scale_ub is not None and quant not in bounded:
        raise ValueError(f"arfuse: scale_ub: an upper bound of {_scales_adjective(bounded)} scales, "
                         f"only for {_only_for(bounded)} (got quant={quant!r})")
    if scale_layout not in _SCALE_LAYOUTS:
        raise ValueError(f"arfuse: scale_layout: {scale_layout!r} is not one of {list(_SCALE_LAYOUTS)}")
    if scale_layout != "row" and quant not in layouts:
        raise ValueError(f"arfuse: scale_layout: {scale_layout!r} is only for {_only_for(layouts)} "
                         f"(got quant={quant!r})")
    if scale_ue8m0 and quant not in layouts:
        raise ValueError(f"arfuse: scale_ue8m0: power-of-two scales are only for "
                         f"{_only_for(layouts)} (got quant={quant!r})")
    return quant


def moe_finalize_allreduce_rmsnorm(comm, expert_out, residual, gamma, eps, *, permuted_idx=None,
                                   expert_weights=None, shared_out=None, routed_scaling=1.0,
                                   weight_bias=0.0, inplace=False, algorithm="auto",
                                   fp8_scale=None, quant=None, scale_ub=None, scale_layout="row",
                                   scale_ue8m0=False):
    """MoE finalize + shared add + all-reduce + residual + RMSNorm, fused. Returns
    (norm_out, residual_out), both [T, H]; with a dynamic FP8 quant, (q, residual_out, scales).

    partial[t] = routed_scaling * sum_k w[t, k] * row(t, k) + shared_out[t]   (float32, rounded
    once to the activation dtype for transport); sum[t] = partials summed in rank order;
    residual_out[t] = sum[t] + residual[t]; y[t] = residual_out[t] *
    rsqrt(mean(residual_out[t]^2) + eps) * (gamma + weight_bias) in float32; norm_out = y
    rounded to the activation dtype.

    residual: [T, H], or None for no residual add (residual_out is then the all-reduced sum).
    expert_out: [T, H] (plain, already reduced), [T, K, H] (dense) or [P, H] rows addressed by
    permuted_idx [T, K] int32 (-1: expert not on this rank). expert_weights [T, K]: float32 or
    the activation dtype (None: 1). inplace (plain layout only): norm_out is written into
    expert_out and residual_out into residual, as vLLM's fused_add_rms_norm does.
    algorithm: "auto" (by token count), "oneshot" or "twoshot"; a communicator of world size 1
    has no all-reduce and runs "local" (what "auto" picks there): finalize + shared add +
    residual + RMSNorm in one kernel, no workspace, nothing exchanged.

    FP8-e4m3 outputs (residual_out stays in the activation dtype). saturate(x) rounds x to the
    nearest e4m3 value (ties to even), clamped to +-448; NaN stays NaN. amax is max |y| over the
    token (group), NaN-propagating: a NaN in it makes its scale and all its codes NaN.

    - quant="fp8_static" (or fp8_scale alone): fp8_scale is a float32 one-element tensor;
      norm_out = saturate(y * (1 / scale)) (vLLM's static per-tensor FP8).
    - quant="fp8_token": one scale per token (vLLM's dynamic per-token FP8):
      amax_t = min(amax_t, scale_ub) when scale_ub (float32, one element, same device) is given;
      scale_t = max(amax_t / 448, 1 / (448 * 512)); q = saturate(y / scale_t).
      scales: float32 [T].
    - quant="fp8_group128": one scale per group of 128 consecutive elements of a token (vLLM's
      per_token_group_quant_fp8, group size 128; H must be a multiple of 128):
      scale = max(amax, 1e-10) / 448, with scale_ue8m0=True rounded up to a power of two
      (2^ceil(log2 scale)); q = saturate(y / scale). scales: float32 [T, H / 128], row-major
      (scale_layout="row") or column-major (scale_layout="col": strides (1, T), the layout
      block-FP8 GEMMs read).
    The scale rules are evaluated in float32 on y, with a true division y / scale.
    """
    _lib.require()
    handle = _handle(comm)
    algo = _algorithm(algorithm)
    kind = _quant_kind(quant, fp8_scale, scale_ub, scale_layout, scale_ue8m0)
    if inplace:
        if permuted_idx is not None or expert_weights is not None or expert_out.dim() != 2:
            raise ValueError("arfuse: inplace: needs the plain layout (expert_out [T, H], no "
                             "permuted_idx, no expert_weights)")
        if kind is not None:
            raise ValueError("arfuse: inplace: the FP8 output cannot be written into the input")
        if residual is None:
            raise ValueError("arfuse: residual: inplace=True writes residual_out into residual, "
                             "so it needs one (pass residual, or inplace=False)")
        try:
            torch.ops.arfuse.fused_inplace(expert_out, residual, shared_out, gamma, float(eps),
                                           float(weight_bias), float(routed_scaling), handle, algo)
        except RuntimeError as e:
            _lib.reraise(e)
        return expert_out, residual
    try:
        if kind in _vocab.DYNAMIC_KINDS:  # the kernel writes the scales; the row's group picks it
            return torch.ops.arfuse.fused_fp8_dynamic(
                expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, float(eps),
                float(weight_bias), float(routed_scaling), _vocab.OUTPUT_ROWS[kind]["group"],
                scale_ub, scale_layout == "col", bool(scale_ue8m0), handle, algo)
        return torch.ops.arfuse.fused(expert_out, permuted_idx, expert_weights, shared_out,
                                      residual, gamma, float(eps), float(weight_bias),
                                      float(routed_scaling), fp8_scale, handle, algo)
    except RuntimeError as e:
        _lib.reraise(e)


def moe_finalize(expert_out, *, num_tokens, permuted_idx=None, expert_weights=None,
                 shared_out=None, routed_scaling=1.0):
    """The standalone finalize kernel: routed_scaling * sum_k w * row + shared, [T, H], float32
    accumulation and one rounding. The first kernel of the unfused pipeline."""
    _lib.require()
    try:
        return torch.ops.arfuse.moe_finalize(expert_out, permuted_idx, expert_weights, shared_out,
                                             float(routed_scaling), int(num_tokens))
    except RuntimeError as e:
        _lib.reraise(e)


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"arfuse: dtype: {dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def instance_for(dtype, hidden: int, world_size: int, algorithm: str = "oneshot",
                 output: str = "norm", num_tokens: int | None = None) -> str | None:
    """Name of the kernel instance that serves this combination (specialised or generic), or None.
    output: "norm", "fp8_static", "fp8_token" or "fp8_group128". num_tokens: the instance a call
    of that many tokens runs (a token split, variants/tuning.yaml min_blocks_splits or
    buffered_splits, serves the smaller token counts with its twin); None: the one that serves every token count."""
    _lib.require()
    algo = _algorithm(algorithm)
    if algo == 0:
        raise ValueError("arfuse: algorithm: instance_for wants 'oneshot', 'twoshot' or 'local'")
    if output not in _OUTPUTS:
        raise ValueError(f"arfuse: output: {output!r} is not one of {list(_OUTPUTS)}")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                   or num_tokens < 0):
        raise ValueError(f"arfuse: num_tokens: {num_tokens!r} is not a token count (want an "
                         "int >= 0, or None)")
    try:
        name = torch.ops.arfuse.instance_for(_dtype(dtype), hidden, world_size, algo,
                                             _OUTPUTS[output],
                                             -1 if num_tokens is None else num_tokens)
    except RuntimeError as e:
        _lib.reraise(e)
    return name or None


def supported(dtype, hidden: int, world_size: int) -> bool:
    """Whether some kernel instance serves (dtype, hidden, world_size) with the norm output
    (world size 1: the local algorithm's)."""
    return any(instance_for(dtype, hidden, world_size, a)
               for a in _vocab.algorithms_for(world_size))


def oneshot_threshold(dtype, hidden: int, world_size: int, card: str | None = None) -> int:
    """auto dispatch uses one-shot for T <= this on the card named ``card``: the row measured on
    that card (variants/tuning.yaml card_thresholds), else the default table's row, else the
    default rule. ``card`` is the device name CUDA reports (torch.cuda.get_device_name());
    None: the current CUDA device's (which initialises CUDA in this process, as any
    torch.cuda.get_device_name() does: pass the name before a fork), or the default table where
    there is no CUDA device. A communicator's own limit is Communicator.auto_oneshot_max_tokens."""
    _lib.require()
    if card is None:
        card = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    if not isinstance(card, str):
        raise TypeError(f"card: want a device name (str) or None, got {type(card).__name__}")
    try:
        return torch.ops.arfuse.oneshot_threshold(_dtype(dtype), hidden, world_size, card)
    except RuntimeError as e:
        _lib.reraise(e)


def supported_variants() -> list[str]:
    """Every kernel instance compiled into the library."""
    _lib.require()
    return list(torch.ops.arfuse.supported_variants())
