"""vLLM's FP8 quantization of the norm output, folded into the arfuse call that produces the
norm (a second step of the fusion pass, run on the calls the patterns made: one rule for every
pattern instead of an FP8 twin of each).

One small class per quant form vLLM puts in the graph (QUANT_FOLDS): the static per-tensor
quant in its native and custom-op forms (the call keeps its op and takes the scale as fp8_scale),
and the dynamic per-token-group-128 quant of FP8-block models (the call becomes
arfuse.fused_fp8_dynamic, which also returns the scales). Each says what it matches
(`match(norm)`) and how the call takes it in (`fold(...)`); fold_fp8_quants runs them."""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .patterns import AUTO_FUNCTIONALIZED, val

logger = logging.getLogger("vllm.arfuse")

_STATIC_FP8_QUANT = "_C::static_scaled_fp8_quant"
_GROUP_FP8_QUANT = "_C::per_token_group_fp8_quant"
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)  # 448
# arfuse.fused(expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
#              weight_bias, routed_scaling, fp8_scale, comm, algorithm)
_FP8_SCALE_ARG = 9
# The group quant arfuse computes: groups of 128, scale = max(amax, 1e-10) / 448.
_GROUP_EPS = 1e-10
_GROUP = 128


def _call(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _dtype(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _same(a: Any, b: Any) -> bool:
    """Two sizes (ints, SymInts or graph nodes holding one) known to be equal."""
    a, b = (val(x) if isinstance(x, fx.Node) else x for x in (a, b))
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return False
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _custom_quant(norm: fx.Node, op_name: str) -> tuple[fx.Node, dict[str, Any]] | None:
    """The auto_functionalized(_v2) node of vLLM's custom quant op `op_name` when it is the only
    user of norm, which it reads as `input`; with its kwargs."""
    af = _only_user(norm)
    if af is None or af.op != "call_function" or af.target not in AUTO_FUNCTIONALIZED:
        return None
    op = af.args[0] if af.args else None
    if not isinstance(op, torch._ops.OpOverload) or op._schema.name != op_name:
        return None
    if af.kwargs.get("input") is not norm:
        return None
    return af, dict(af.kwargs)


def _fresh(buf: Any, user: fx.Node, dtype: torch.dtype) -> bool:
    """buf is a new aten.empty of `dtype` that only `user` reads."""
    return (_call(buf, torch.ops.aten.empty.memory_format) and list(buf.users) == [user]
            and _dtype(buf) == dtype)


@dataclasses.dataclass
class Found:
    """A quant of a call's norm output: the nodes it consists of (erased once folded), its
    outputs (`q`: the codes; `scales`: the group quant's scales, else None) and what the call
    needs to take it in (`scale`: a static quant's scale node; `col_major`: the group quant's
    scale layout)."""

    nodes: list[fx.Node]
    q: fx.Node
    scales: fx.Node | None = None
    scale: Any = None
    col_major: bool = False


class QuantFold:
    """One form of FP8 quantization of the norm output. `kind`: the arfuse output kind it folds
    into (the fusion pass runs a fold only where arfuse has kernels of that kind)."""

    kind = ""

    def match(self, norm: fx.Node) -> Found | None:
        raise NotImplementedError

    def fold(self, graph: fx.Graph, call: fx.Node, norm: fx.Node, found: Found,
             order: dict[fx.Node, int]) -> bool:
        raise NotImplementedError


# ---- static per-tensor (kFp8StaticTensorSym): arfuse.fused with fp8_scale ------------------------
#
# Semantics. vLLM: q = e4m3(clamp(n * (1 / scale), -448, 448)) with n the norm output rounded
# to the activation dtype (QuantFP8.forward_native; its CUDA kernel also multiplies by the
# float32 reciprocal and saturates to +-448). arfuse: the same with n the float32 norm, before
# any rounding (FP8-e4m3 saturate(y * (1 / scale)), round to nearest even). Both multiply by
# the reciprocal and saturate alike; the one difference is vLLM's rounding of n to the
# activation dtype (vllm_ir.rms_norm rounds the normalized value, and with a bf16/fp16 weight
# its product too: relative <= 2^-8 each for bf16, 2^-11 for fp16), far below an e4m3 step
# (relative 2^-4 to 2^-3, 2^-9 absolute for subnormals). So a code differs from vLLM's by at
# most one e4m3 step (one unit in the last place), and only where n lies next to a rounding
# boundary of e4m3: about 2.5% of the codes in tests/vllm/test_fusion_fp8.py (bf16), which
# holds them to one step. For float32 activations the codes are the same.


class _StaticQuant(QuantFold):
    kind = "fp8_static"

    def fold(self, graph, call, norm, found, order):
        if not _static_scale_ok(found.scale, call, order):
            return False
        call.update_arg(_FP8_SCALE_ARG, found.scale)
        found.q.replace_all_uses_with(norm)
        for key in ("val", "tensor_meta"):
            if key in found.q.meta:
                norm.meta[key] = found.q.meta[key]
        old = call.meta.get("val")
        if isinstance(old, (tuple, list)) and len(old) == 2 and "val" in found.q.meta:
            call.meta["val"] = (found.q.meta["val"], old[1])
        _erase(graph, found.nodes, order)
        return True


class NativeStaticQuant(_StaticQuant):
    """vLLM's QuantFP8.forward_native for a static per-tensor scale (the default: vLLM disables
    its custom ops under Inductor), as it reaches the post-grad graph:

        convert_element_type(norm, float32)      (absent when norm is float32 already)
        mul(., reciprocal(scale))
        clamp_min(., -448) -> clamp_max(., 448)  (or one clamp(., -448, 448))
        convert_element_type(., float8_e4m3fn)

    Matched when that chain is the only use of norm (each step used by the next alone)."""

    def match(self, norm):
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
        return Found(chain, u, scale=scale)


class CustomStaticQuant(_StaticQuant):
    """vLLM's static per-tensor quant kernel (custom op quant_fp8 enabled,
    QuantFP8.forward_cuda -> vllm._custom_ops.scaled_fp8_quant), functionalized:

        auto_functionalized(_C.static_scaled_fp8_quant, result=empty(..., float8_e4m3fn),
                            input=norm, scale=scale, group_shape=[-1, -1] or None)[1]

    (auto_functionalized_v2: the result buffer in _all_bases)."""

    def match(self, norm):
        found = _custom_quant(norm, _STATIC_FP8_QUANT)
        if found is None:
            return None
        af, kw = found
        if "scale" not in kw:
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
        if not _fresh(buf, af, _FP8):
            return None
        out = _only_user(af)
        if not (_call(out, operator.getitem) and out.args[1] == 1):
            return None
        return Found([af, buf, out], out, scale=kw["scale"])


def _static_scale_ok(scale: Any, call: fx.Node, order: dict[fx.Node, int]) -> bool:
    """A per-tensor scale arfuse takes: a graph input or constant (placeholder / get_attr) that
    exists before the call, float32 with one element."""
    if not isinstance(scale, fx.Node) or scale.op not in ("placeholder", "get_attr"):
        return False
    if order.get(scale, len(order)) > order[call]:
        return False
    v = val(scale)
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.numel() == 1


# ---- dynamic per-token-group-128 (kFp8Dynamic128Sym): arfuse.fused_fp8_dynamic -------------------


class Group128Quant(QuantFold):
    """vLLM's dynamic per-token-group quant with groups of 128 (the input quant of FP8-block
    linear layers, e.g. DeepSeek-V3's fused_qkv_a_proj after input_layernorm). vLLM turns its
    quant_fp8 custom op on for every model with block weights (VllmConfig: "+quant_fp8"), so
    QuantFP8.forward_cuda -> fp8_utils.per_token_group_quant_fp8 puts the CUDA kernel in the
    graph (for a contiguous input, which the norm output is), functionalized:

        q_buf = empty([T, H], float8_e4m3fn)
        s_buf = empty([T, H/128], float32)                  row-major scales, or
        s_buf = permute(empty([H/128, T], float32), [-1, -2])   column_major_scales (strides (1, T))
        af = auto_functionalized(_C.per_token_group_fp8_quant, input=norm, output_q=q_buf,
                                 output_s=s_buf, group_size=128, eps=1e-10, fp8_min=-448.0,
                                 fp8_max=448.0, scale_ue8m0=False, dummy_is_scale_transposed=.,
                                 dummy_is_tma_aligned=False)
        q = af[1]; scales = af[2]

    Folded: the call becomes one arfuse.fused_fp8_dynamic(group_size=128, col_major_scales as
    s_buf's layout, ue8m0 False) whose outputs (q, residual_out, scales) take the places of q,
    the call's residual output and scales; the scales keep vLLM's layout (arfuse writes the
    column-major one itself: no copy, no view).

    Semantics. vLLM's kernel (csrc/quantization/w8a8/fp8/per_token_group_quant.cu): amax over
    the group starting from eps (fmaxf), y_s = amax / 448 in float32, q = e4m3(clamp(x / y_s,
    -448, 448)) with a true division. arfuse's fp8_group128: scale = max(amax, 1e-10f) / 448.0f,
    q = saturate(y / scale), true division: the same formula, eps and rounding, and the same
    layouts. The difference is the input, as for the static fold: arfuse quantizes the float32
    norm y, vLLM the norm output rounded to the activation dtype (rms_norm rounds the normalized
    value and, with a weight of the activation dtype, its product: relative <= 2^-8 each for
    bf16, 2^-11 for fp16). vLLM's amax is taken over the rounded values, so a scale differs from
    vLLM's by those roundings (relative <= 2^-7 + 2^-16 for bf16; 0.7% seen), and a code, whose
    value x / scale moves by at most about 2^-6 relative while e4m3 steps are 2^-4 to 2^-3
    apart (2^-9 absolute for subnormals), by at most one e4m3 step. tests/vllm/test_fusion_fp8_group.py holds both bounds for every
    element, and checks that the fused outputs equal vLLM's formula applied to the float32 norm
    bit for bit. (NaN: arfuse propagates a NaN of a group into its scale and codes; vLLM's fmaxf
    skips it.)

    Not folded (the quant stays after the fused call, a separate kernel as before): scale_ue8m0
    (DeepGEMM's power-of-two scales: vLLM's kernel rounds with exp2f(ceilf(log2f(s))), whose
    float log2 arfuse's exact power-of-two rounding is not shown to match in every release),
    TMA-aligned scales (strides (1, T rounded up to 4)), the packed UE8M0 op
    (_C.per_token_group_fp8_quant_packed, Blackwell DeepGEMM), the Triton fallback (a
    non-contiguous input) and QuantFP8's native group quant (custom op quant_fp8 turned off:
    its scale is clamp(amax / 448, min=1 / (448 * 512)), not max(amax, 1e-10) / 448), another
    eps or group size, auto_functionalized_v2 (vLLM keeps v1 for its passes)."""

    kind = "fp8_group128"

    def match(self, norm):
        found = _custom_quant(norm, _GROUP_FP8_QUANT)
        if found is None:
            return None
        af, kw = found
        why = self._refusal(af, kw, norm)
        if why:
            logger.debug("arfuse: per-token-group FP8 quant %s stays separate: %s", af, why)
            return None
        q_buf, s_buf = kw["output_q"], kw["output_s"]
        nodes = [af, q_buf, s_buf]
        col_major = _call(s_buf, torch.ops.aten.permute.default)
        if col_major:
            nodes.append(s_buf.args[0])
        outs = {u.args[1]: u for u in af.users}
        if 1 not in outs:
            return None  # the codes unread: nothing to fold into
        return Found(nodes + list(outs.values()), outs.get(1), scales=outs.get(2),
                     col_major=col_major)

    def _refusal(self, af: fx.Node, kw: dict[str, Any], norm: fx.Node) -> str:
        """Why this quant is not the one arfuse computes ("" when it is)."""
        if af.target is not auto_functionalized:
            return "auto_functionalized_v2"
        if kw.get("group_size") != _GROUP:
            return f"group_size {kw.get('group_size')}"
        if kw.get("eps") != _GROUP_EPS:
            return f"eps {kw.get('eps')}"
        if kw.get("fp8_min") != -_FP8_MAX or kw.get("fp8_max") != _FP8_MAX:
            return f"fp8 range {kw.get('fp8_min')}, {kw.get('fp8_max')}"
        if kw.get("scale_ue8m0") is not False:
            return "UE8M0 (power-of-two) scales"
        if kw.get("dummy_is_tma_aligned") is not False:
            return "TMA-aligned scales"
        n = val(norm)
        if not isinstance(n, torch.Tensor) or n.dim() != 2 or n.shape[-1] % _GROUP:
            return "the norm output is not [T, H] with H a multiple of 128"
        T, G = n.shape[0], n.shape[-1] // _GROUP
        q_buf = kw.get("output_q")
        if not _fresh(q_buf, af, _FP8):
            return "the codes' buffer is not a new float8_e4m3fn tensor of its own"
        s_buf = kw.get("output_s")
        if _call(s_buf, torch.ops.aten.permute.default):
            base = s_buf.args[0]
            if list(s_buf.args[1]) not in ([-1, -2], [1, 0]) or list(s_buf.users) != [af]:
                return "scales: a permute other than the transpose"
            if not _fresh(base, s_buf, torch.float32):
                return "scales: not a new float32 tensor of its own"
            shape, want = val(s_buf).shape, (1, T)
        elif _fresh(s_buf, af, torch.float32):
            shape, want = val(s_buf).shape, (G, 1)
        else:
            return "scales: not a new float32 tensor of its own"
        stride = val(s_buf).stride()
        if not (len(shape) == 2 and _same(shape[0], T) and _same(shape[1], G)
                and _same(stride[0], want[0]) and _same(stride[1], want[1])):
            return f"scales: layout {tuple(shape)} / {tuple(stride)} is not [T, H/128] row- or " \
                   "column-major"
        if any(not (_call(u, operator.getitem) and u.args[1] in (1, 2)) for u in af.users):
            return "an output read other than the codes and the scales"
        return ""

    def fold(self, graph, call, norm, found, order):
        residual = next(
            (u for u in call.users if _call(u, operator.getitem) and u.args[1] == 1), None
        )
        a = call.args
        args = (*a[:_FP8_SCALE_ARG], _GROUP, None, found.col_major, False, *a[_FP8_SCALE_ARG + 1:])
        with graph.inserting_before(call):
            new = graph.call_function(torch.ops.arfuse.fused_fp8_dynamic.default, args)
            outs = [graph.call_function(operator.getitem, (new, i)) for i in range(3)]
        old = call.meta.get("val")
        q_val = val(found.q) if found.q is not None else None
        s_val = val(found.scales) if found.scales is not None else None
        if isinstance(old, (tuple, list)) and len(old) == 2 and q_val is not None \
                and s_val is not None:
            new.meta["val"] = (q_val, old[1], s_val)
            for o, v in zip(outs, new.meta["val"]):
                o.meta["val"] = v
        for src, dst in ((found.q, outs[0]), (residual, outs[1]), (found.scales, outs[2])):
            if src is not None:
                src.replace_all_uses_with(dst)
                for key in ("val", "tensor_meta"):
                    if key in src.meta:
                        dst.meta[key] = src.meta[key]
        _erase(graph, found.nodes + [norm] + ([residual] if residual else []) + [call], order)
        for o in outs:
            if not o.users:
                graph.erase_node(o)
        return True


def _erase(graph: fx.Graph, nodes: list[fx.Node], order: dict[fx.Node, int]) -> None:
    """Erases the nodes left without users, the last first (a shared reciprocal(scale) stays
    for its other users)."""
    for node in sorted(set(nodes), key=lambda n: order.get(n, -1), reverse=True):
        if not node.users:
            graph.erase_node(node)


QUANT_FOLDS: tuple[QuantFold, ...] = (NativeStaticQuant(), CustomStaticQuant(), Group128Quant())


def fold_fp8_quants(graph: fx.Graph, kinds: tuple[str, ...] = ("fp8_static", "fp8_group128")
                    ) -> dict[str, int]:
    """Folds vLLM's FP8 quantization of an arfuse.fused call's norm output into the call, for
    the quant forms of QUANT_FOLDS whose kind is in `kinds`. Returns how many calls took a quant
    in, per kind.

    Matched: a quant in one of the forms vLLM 0.26.0 ... 0.34.0 put in the graph before their own
    fusion passes, applied to the call's norm output and to nothing else (the norm output has no
    other user), with what arfuse computes (each class says what that is). Not matched (the quant
    stays a separate op): other quants (dynamic per-tensor / per-token, other groups), a static
    scale computed in the graph, a quant of anything but the norm output, a norm output also read
    in the activation dtype. vLLM's fused rms_norm + quant ops (_C.rms_norm_static_fp8_quant,
    _C.rms_norm_per_block_quant, ...) are never in the graph here: RMSNormQuantFusionPass, which
    makes them, runs after this pass."""
    fused = torch.ops.arfuse.fused.default
    order = {n: i for i, n in enumerate(graph.nodes)}
    folds = [f for f in QUANT_FOLDS if f.kind in kinds]
    counts = dict.fromkeys(kinds, 0)
    for call in [n for n in graph.nodes if _call(n, fused)]:
        if len(call.args) <= _FP8_SCALE_ARG or call.args[_FP8_SCALE_ARG] is not None:
            continue
        norm = next(
            (u for u in call.users if _call(u, operator.getitem) and u.args[1] == 0), None
        )
        if norm is None:
            continue
        for fold in folds:
            found = fold.match(norm)
            if found is not None and fold.fold(graph, call, norm, found, order):
                counts[fold.kind] += 1
                break
    return counts


def fold_static_fp8_quant(graph: fx.Graph) -> int:
    """fold_fp8_quants for the static per-tensor quant alone; returns how many calls took one."""
    return fold_fp8_quants(graph, ("fp8_static",))["fp8_static"]
