"""The static FP8 quantization after the norm, folded into the arfuse call that produces the
norm (a second step of the fusion pass, run on the calls the patterns made: one rule for every
pattern instead of an FP8 twin of each)."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from .patterns import AUTO_FUNCTIONALIZED, val

_STATIC_FP8_QUANT = "_C::static_scaled_fp8_quant"
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)  # 448
# arfuse.fused(expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
#              weight_bias, routed_scaling, fp8_scale, comm, algorithm)
_FP8_SCALE_ARG = 9



def _call(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _dtype(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _native_static_quant(norm: fx.Node) -> tuple[Any, fx.Node, list[fx.Node]] | None:
    """vLLM's QuantFP8.forward_native for a static per-tensor scale (the default: vLLM disables
    its custom ops under Inductor), as it reaches the post-grad graph:

        convert_element_type(norm, float32)      (absent when norm is float32 already)
        mul(., reciprocal(scale))
        clamp_min(., -448) -> clamp_max(., 448)  (or one clamp(., -448, 448))
        convert_element_type(., float8_e4m3fn)

    Returns (scale, quantized node, the chain's nodes) when that chain is the only use of norm
    (each step used by the next alone), else None."""
    aten, prims = torch.ops.aten, torch.ops.prims
    chain: list[fx.Node] = []
    x = norm
    u = _only_user(x)
    if _call(u, prims.convert_element_type.default) and u.args[1:] == (torch.float32,):
        chain.append(u)
        x, u = u, _only_user(u)
    elif _dtype(norm) != torch.float32:
        return None
    if not _call(u, aten.mul.Tensor) or len(u.args) != 2 or u.kwargs:
        return None
    a, b = u.args
    recip = b if a is x else a if b is x else None
    if not _call(recip, aten.reciprocal.default) or recip is x:
        return None
    scale = recip.args[0]
    chain += [u, recip]
    x = u
    lo = hi = None
    while True:
        u = _only_user(x)
        if _call(u, aten.clamp.default) and lo is None and hi is None and len(u.args) == 3:
            lo, hi = u.args[1], u.args[2]
        elif _call(u, aten.clamp_min.default) and lo is None and len(u.args) == 2:
            lo = u.args[1]
        elif _call(u, aten.clamp_max.default) and hi is None and len(u.args) == 2:
            hi = u.args[1]
        else:
            break
        chain.append(u)
        x = u
    if lo != -_FP8_MAX or hi != _FP8_MAX:
        return None
    if not (_call(u, prims.convert_element_type.default) and u.args[1:] == (_FP8,)):
        return None
    chain.append(u)
    return scale, u, chain


def _custom_static_quant(norm: fx.Node) -> tuple[Any, fx.Node, list[fx.Node]] | None:
    """vLLM's static per-tensor quant kernel (custom op quant_fp8 enabled, QuantFP8.forward_cuda
    -> vllm._custom_ops.scaled_fp8_quant), functionalized:

        auto_functionalized(_C.static_scaled_fp8_quant, result=empty(..., float8_e4m3fn),
                            input=norm, scale=scale, group_shape=[-1, -1] or None)[1]

    (auto_functionalized_v2: the result buffer in _all_bases). Same return as
    _native_static_quant."""
    af = _only_user(norm)
    if af is None or af.op != "call_function" or af.target not in AUTO_FUNCTIONALIZED:
        return None
    op = af.args[0] if af.args else None
    if not isinstance(op, torch._ops.OpOverload) or op._schema.name != _STATIC_FP8_QUANT:
        return None
    kw = af.kwargs
    if kw.get("input") is not norm or "scale" not in kw:
        return None
    group_shape = kw.get("group_shape")
    if group_shape is not None and list(group_shape) != [-1, -1]:
        return None
    if af.target is auto_functionalized:
        buf = kw.get("result")
    else:
        bases = kw.get("_all_bases") or []
        if kw.get("_result_base_index") != 0 or len(bases) != 1:
            return None
        buf = bases[0]
    if not (_call(buf, torch.ops.aten.empty.memory_format) and len(buf.users) == 1):
        return None
    if _dtype(buf) != _FP8:
        return None
    out = _only_user(af)
    if not (_call(out, operator.getitem) and out.args[1] == 1):
        return None
    return kw["scale"], out, [af, buf, out]


def _static_scale_ok(scale: Any, call: fx.Node, order: dict[fx.Node, int]) -> bool:
    """A per-tensor scale arfuse takes: a graph input or constant (placeholder / get_attr) that
    exists before the call, float32 with one element."""
    if not isinstance(scale, fx.Node) or scale.op not in ("placeholder", "get_attr"):
        return False
    if order.get(scale, len(order)) > order[call]:
        return False
    v = val(scale)
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.numel() == 1


def fold_static_fp8_quant(graph: fx.Graph) -> int:
    """Folds vLLM's static per-tensor FP8 quantization (kFp8StaticTensorSym) of an arfuse.fused
    call's norm output into the call, which then writes the FP8 codes itself (its fp8_scale
    argument). Returns how many calls took a quant in.

    Matched: the quant in either form vLLM 0.26.0 puts in the graph before its own fusion passes
    (_native_static_quant, _custom_static_quant), applied to the call's norm output and to nothing
    else (the norm output has no other user), with the scale a float32 one-element graph input or
    constant. Not matched (the quant stays a separate op): dynamic per-tensor / per-token /
    per-group quants, a scale computed in the graph, a quant of anything but the norm output, a
    norm output also read in the activation dtype. vLLM's fused rms_norm + quant ops
    (_C.rms_norm_static_fp8_quant, _C.fused_add_rms_norm_static_fp8_quant) are never in the graph
    here: RMSNormQuantFusionPass, which makes them, runs after this pass.

    Semantics. vLLM: q = e4m3(clamp(n * (1 / scale), -448, 448)) with n the norm output rounded
    to the activation dtype (QuantFP8.forward_native; its CUDA kernel also multiplies by the
    float32 reciprocal and saturates to +-448). arfuse: the same with n the float32 norm, before
    any rounding (FP8-e4m3 saturate(y * (1 / scale)), round to nearest even). Both multiply by
    the reciprocal and saturate alike; the one difference is vLLM's rounding of n to the
    activation dtype (vllm_ir.rms_norm rounds the normalized value, and with a bf16/fp16 weight
    its product too: relative 2^-9 each for bf16, 2^-11 for fp16), far below an e4m3 step
    (relative 2^-4 to 2^-3, 2^-9 absolute for subnormals). So a code differs from vLLM's by at
    most one e4m3 step (one unit in the last place), and only where n lies next to a rounding
    boundary of e4m3: about 2.5% of the codes in tests/vllm/test_fusion_fp8.py (bf16), which
    holds them to one step. For float32 activations the codes are the same.
    """
    fused = torch.ops.arfuse.fused.default
    order = {n: i for i, n in enumerate(graph.nodes)}
    folded = 0
    for call in [n for n in graph.nodes if _call(n, fused)]:
        if len(call.args) <= _FP8_SCALE_ARG or call.args[_FP8_SCALE_ARG] is not None:
            continue
        norm = next(
            (u for u in call.users if _call(u, operator.getitem) and u.args[1] == 0), None
        )
        if norm is None:
            continue
        found = _native_static_quant(norm) or _custom_static_quant(norm)
        if found is None:
            continue
        scale, out, chain = found
        if not _static_scale_ok(scale, call, order):
            continue
        call.update_arg(_FP8_SCALE_ARG, scale)
        out.replace_all_uses_with(norm)
        for key in ("val", "tensor_meta"):
            if key in out.meta:
                norm.meta[key] = out.meta[key]
        old = call.meta.get("val")
        if isinstance(old, (tuple, list)) and len(old) == 2 and "val" in out.meta:
            call.meta["val"] = (out.meta["val"], old[1])
        for node in sorted(chain, key=order.__getitem__, reverse=True):
            if not node.users:  # a shared reciprocal(scale) stays for its other users
                graph.erase_node(node)
        folded += 1
    return folded
