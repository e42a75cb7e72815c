"""The arfuse fusion pass for vLLM's post-grad pass manager.

Written against vLLM 0.26.0 and run under 0.34.0 too (tests/vllm, both lanes); what it uses of
vLLM is listed in arfuse/vllm/contract.py and checked for every release 0.26.0 ... 0.34.0. There
the all-reduce fusion runs before vLLM's IR lowering, so the graph it sees holds

    torch.ops.vllm.all_reduce.default(x, group_name)
    torch.ops.vllm_ir.rms_norm.default(x, weight, eps[, variance_size])
    torch.ops.vllm_ir.fused_add_rms_norm.default(x, residual, weight, eps[, variance_size])

(vllm/compilation/passes/fusion/allreduce_rms_fusion.py matches the same ops; GemmaRMSNorm passes
`weight.float() + 1.0` as the weight). This pass replaces, for eps 1e-5 and 1e-6 and for
weight_bias 0 and 1 (Gemma):

* all_reduce -> fused_add_rms_norm (with the residual output, and without it at the end of the
  graph) and all_reduce -> rms_norm (first layer: the embedding's all-reduce, no residual add) by
  one torch.ops.arfuse.fused call on the plain [T, H] input;
* the MoE tail as vLLM's MoERunner.forward leaves it (fused * routed_scaling + shared, with
  fused/shared the outputs of torch.ops.vllm.moe_forward_shared or moe_forward) -> all_reduce ->
  fused_add_rms_norm by one arfuse.fused call with the scaling and the shared add folded in;
* any of these followed by vLLM's static per-tensor FP8 quantization of the norm output
  (kFp8StaticTensorSym, the input quantization of an FP8 linear layer with a static activation
  scale) by one arfuse.fused call with FP8 output (fp8_scale = the quant's scale); see
  fold_static_fp8_quant for the forms matched and the rounding difference.

vLLM 0.26.0 never hands the unfinalized MoE output (permuted rows + index map + weights) to the
graph: the finalize runs inside the opaque moe_forward ops, and UnfinalizedMoEOutput does not exist
in that release. So there is no graph pattern for arfuse's permuted layout here; the eager call in
arfuse.vllm.eager takes that form instead.

The pass touches a graph only for compile ranges whose largest token count fits the communicator
(`is_applicable_for_range`), and only when the communicator serves the model's hidden size, dtype
and tensor-parallel world size; otherwise it leaves the graph as it is. Its uuid() covers that
configuration, so Inductor's cache keys change with it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._inductor.pattern_matcher as pm
from torch import fx
from torch._higher_order_ops.auto_functionalize import (
    auto_functionalized,
    auto_functionalized_v2,
)
from torch._inductor.pattern_matcher import Match, PatternMatcherPass

import vllm.distributed.parallel_state  # noqa: F401  (registers torch.ops.vllm.all_reduce)
import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir.*)
from vllm.compilation.passes.inductor_pass import InductorPass, enable_fake_mode
from vllm.compilation.passes.vllm_inductor_pass import (
    VllmInductorPass,
    VllmPatternMatcherPass,
)
from vllm.config import VllmConfig
from vllm.config.utils import Range
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group

from . import settings as _settings

# Under "vllm" so that vLLM's logging configuration (format, level) applies.
logger = logging.getLogger("vllm.arfuse")

EPSILONS = (1e-5, 1e-6)
# Gemma-style (x * (1 + w)) first: its weight is `w.float() + 1.0`, which the plain pattern would
# otherwise take as an fp32 gamma (correct, but it would leave the add unfused).
WEIGHT_BIASES = (1.0, 0.0)

# Example token count for tracing the patterns (the Meta implementation of arfuse.fused checks
# it against the communicator's capacity, so it is clipped to max_tokens).
_EXAMPLE_TOKENS = 4
# Stands for routed_scaling_factor while tracing (scalar_workaround): any value that no other
# constant of the patterns takes.
_EXAMPLE_SCALE = 0.8125

_ALL_REDUCE = "vllm::all_reduce"
_RMS_NORM = "vllm_ir::rms_norm"
_FUSED_ADD_RMS_NORM = "vllm_ir::fused_add_rms_norm"
_MOE_FORWARD = "vllm::moe_forward"
_MOE_FORWARD_SHARED = "vllm::moe_forward_shared"
_AUTO_FUNCTIONALIZED = (auto_functionalized, auto_functionalized_v2)
_STATIC_FP8_QUANT = "_C::static_scaled_fp8_quant"
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)  # 448
# arfuse.fused(expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
#              weight_bias, routed_scaling, fp8_scale, comm, algorithm)
_FP8_SCALE_ARG = 9


def _op_name(node: Any) -> str:
    target = getattr(node, "target", None)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return ""


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _moe_output_index(node: Any) -> tuple[fx.Node, int] | None:
    """(MoE op node, 0 for the shared-expert output / 1 for the routed output) when `node` is an
    output of vLLM's MoE custom ops, else None.

    moe_forward_shared returns (shared_out, fused_out). moe_forward declares that it mutates
    hidden_states, so the functionalized graph calls it through auto_functionalized(_v2), whose
    item 0 is the op's result.
    """
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is not operator.getitem:
        return None
    src, idx = node.args
    if not isinstance(src, fx.Node):
        return None
    if _op_name(src) == _MOE_FORWARD_SHARED:
        return src, int(idx)
    if src.target in _AUTO_FUNCTIONALIZED and src.args and idx == 0:
        op = src.args[0]
        if isinstance(op, torch._ops.OpOverload) and op._schema.name == _MOE_FORWARD:
            return src, 1
    return None


@dataclasses.dataclass(frozen=True)
class PatternSpec:
    """One registered pattern: what it matches, for the record and the uuid."""

    kind: str  # "add_rms_norm", "rms_norm", "moe_scaled_shared", ...
    eps: float
    weight_bias: float
    outputs: str  # "all" or "first"


class ArfuseAllReduceFusionPass(VllmPatternMatcherPass):
    """Replaces vLLM's all-reduce + RMSNorm (+ MoE tail) subgraphs by torch.ops.arfuse.fused.

    Args:
        config: the VllmConfig the pass manager is configured with.
        communicator: an open arfuse.Communicator for vLLM's tensor-parallel group. None: take the
            one the plugin keeps for this config (arfuse.vllm.plugin.get_communicator), creating it
            if needed.
        algorithm: "auto", "oneshot" or "twoshot" (None: $ARFUSE_VLLM_ALGORITHM, default auto).
        fp8: fold vLLM's static per-tensor FP8 quant of the norm output into the fused call
            (None: $ARFUSE_VLLM_FP8, default on). Only where arfuse has fp8_static kernels for
            the model's (dtype, hidden, world size) and every algorithm `algorithm` may use.

    After a call, `matched_count` is the number of chains replaced by an arfuse.fused call and
    `fp8_count` how many of those also took the FP8 quant in.
    """

    def __init__(
        self,
        config: VllmConfig,
        communicator: Any | None = None,
        *,
        algorithm: str | None = None,
        fp8: bool | None = None,
    ) -> None:
        super().__init__(config)
        self.pass_name = "arfuse_allreduce_fusion_pass"
        self.patterns = PatternMatcherPass(pass_name=self.pass_name)
        self.specs: list[PatternSpec] = []
        self.disabled = True
        self.reason = ""
        env = _settings.from_env()
        self.algorithm = algorithm or env.algorithm
        self.fp8 = False
        self.fp8_count = 0
        if self.algorithm not in _settings.ALGORITHMS:
            raise ValueError(
                f"algorithm={self.algorithm!r}: want one of {sorted(_settings.ALGORITHMS)}"
            )
        self.hidden: int | None = None
        self.world_size = get_tensor_model_parallel_world_size()
        self.group_name = get_tp_group().unique_name
        self.handle: int | None = None
        self.max_tokens = 0
        self._warned_symbolic = False

        if config.model_config is None:
            self._disable("vLLM has no model config")
            return
        self.hidden = config.model_config.get_hidden_size()
        if communicator is None:
            from .plugin import get_communicator

            communicator = get_communicator(config)
            if communicator is None:
                self._disable("no arfuse communicator for this configuration")
                return
        mismatch = _communicator_mismatch(
            communicator, self.world_size, self.hidden, self.model_dtype
        )
        if mismatch:
            self._disable(mismatch)
            return
        self.communicator = communicator
        self.handle = int(communicator.handle)
        self.max_tokens = int(communicator.max_tokens)
        if env.fp8 if fp8 is None else fp8:
            from .plugin import fp8_supported

            self.fp8 = fp8_supported(self.model_dtype, self.hidden, self.world_size, self.algorithm)
            if not self.fp8:
                logger.info(
                    "arfuse: no fp8_static kernel for dtype=%s hidden=%d world_size=%d "
                    "algorithm=%s; static FP8 quantization stays a separate op",
                    self.model_dtype, self.hidden, self.world_size, self.algorithm,
                )
        self._register_patterns()
        self.dump_patterns(config, self.patterns)  # only with vLLM's debug dump path set
        self.disabled = False
        logger.debug(
            "arfuse: %d patterns for hidden=%d dtype=%s world_size=%d max_tokens=%d fp8=%s",
            len(self.specs),
            self.hidden,
            self.model_dtype,
            self.world_size,
            self.max_tokens,
            self.fp8,
        )

    def _disable(self, reason: str) -> None:
        self.disabled = True
        self.reason = reason
        logger.info("arfuse: fusion pass disabled: %s", reason)

    # ---- what vLLM's pass manager calls -----------------------------------------------------

    def is_applicable_for_range(self, compile_range: Range) -> bool:
        return not self.disabled and compile_range.end <= self.max_tokens

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        if self.disabled:
            self.matched_count = self.fp8_count = 0
            return
        self.matched_count = self.patterns.apply(graph)
        # Second step, on the calls just made: a static FP8 quant of a call's norm output goes
        # into the call (one rule for every pattern above, instead of an FP8 twin of each).
        self.fp8_count = fold_static_fp8_quant(graph) if self.fp8 else 0
        VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count
        if self.fp8_count:
            VllmPatternMatcherPass.match_table[f"{self.pass_name}.static_fp8"] += self.fp8_count
        logger.debug(
            "arfuse: replaced %d patterns, %d with the static FP8 quant folded in",
            self.matched_count,
            self.fp8_count,
        )

    def uuid(self) -> str:
        state = {
            "source": InductorPass.hash_source(type(self), _settings.Settings),
            "module": _settings.source_hash(),
            "arfuse": _arfuse_version(),
            "disabled": self.disabled,
            "hidden": self.hidden,
            "dtype": str(self.model_dtype),
            "world_size": self.world_size,
            "group": self.group_name,
            "max_tokens": self.max_tokens,
            # The handle is an int baked into the graph: a graph compiled for one handle must
            # not be reused for another.
            "handle": self.handle,
            "algorithm": self.algorithm,
            "fp8": self.fp8,
            "patterns": [dataclasses.astuple(s) for s in self.specs],
        }
        return InductorPass.hash_dict(state)

    # ---- patterns -----------------------------------------------------------------------------

    @enable_fake_mode
    def _register_patterns(self) -> None:
        for eps in EPSILONS:
            for wb in WEIGHT_BIASES:
                self._register_for(eps, wb)

    def _register_for(self, eps: float, wb: float) -> None:
        """All patterns for one (eps, weight_bias); the pattern functions close over both (their
        parameters are the pattern's inputs, so they take nothing else)."""
        ar = torch.ops.vllm.all_reduce.default
        rms = torch.ops.vllm_ir.rms_norm.default
        add_rms = torch.ops.vllm_ir.fused_add_rms_norm.default
        fused = torch.ops.arfuse.fused.default
        group = self.group_name
        handle = self.handle
        algo = _settings.ALGORITHMS[self.algorithm]
        t = max(1, min(_EXAMPLE_TOKENS, self.max_tokens))
        h = self.hidden
        dtype = self.model_dtype
        device = self.device or "cpu"

        def act() -> torch.Tensor:
            return torch.empty(t, h, dtype=dtype, device=device)

        def gamma() -> torch.Tensor:
            return torch.empty(h, dtype=dtype, device=device)

        def norm_weight(w: torch.Tensor) -> torch.Tensor:
            # What the norm receives as its weight: GemmaRMSNorm passes `weight.float() + 1.0`,
            # RMSNorm its weight as is. arfuse takes the raw weight and weight_bias instead.
            return w.float() + 1.0 if wb else w

        def call(x, residual, w, shared=None, scale=1.0):
            return fused(x, None, None, shared, residual, w, eps, wb, scale, None, handle, algo)

        # -- MoE tails, registered before the plain patterns: they share the all-reduce node --
        # MoERunner.forward: `fused *= rsf` (when rsf != 1), then `shared + fused`, then the
        # all-reduce; the next layer's input_layernorm is a fused_add_rms_norm.
        def moe_scaled_shared(shared, routed, residual, w, scale):
            y = ar(shared + routed * scale, group)
            return add_rms(y, residual, norm_weight(w), eps)

        def moe_scaled_shared_r(shared, routed, residual, w, scale):
            return call(routed, residual, w, shared, scale)

        # fp16 with shared experts: MoERunner scales the shared output by 1/rsf instead.
        def moe_shared_scaled(shared, routed, residual, w, scale):
            y = ar(shared * scale + routed, group)
            return add_rms(y, residual, norm_weight(w), eps)

        def moe_shared_scaled_r(shared, routed, residual, w, scale):
            return call(shared, residual, w, routed, scale)

        def moe_shared(shared, routed, residual, w):
            y = ar(shared + routed, group)
            return add_rms(y, residual, norm_weight(w), eps)

        def moe_shared_r(shared, routed, residual, w):
            return call(routed, residual, w, shared)

        def moe_scaled(routed, residual, w, scale):
            y = ar(routed * scale, group)
            return add_rms(y, residual, norm_weight(w), eps)

        def moe_scaled_r(routed, residual, w, scale):
            return call(routed, residual, w, None, scale)

        scaled = {"scale": _EXAMPLE_SCALE}
        for kind, pattern, replacement, n_act, workaround in (
            ("moe_scaled_shared", moe_scaled_shared, moe_scaled_shared_r, 3, scaled),
            ("moe_shared_scaled", moe_shared_scaled, moe_shared_scaled_r, 3, scaled),
            ("moe_shared", moe_shared, moe_shared_r, 3, None),
            ("moe_scaled", moe_scaled, moe_scaled_r, 2, scaled),
        ):
            inputs: list[Any] = [act() for _ in range(n_act)] + [gamma()]
            if workaround:
                inputs.append(_EXAMPLE_SCALE)
            self._register_both(
                kind, eps, wb, pattern, replacement, inputs, self._moe_check(kind), workaround
            )

        # -- all_reduce -> fused_add_rms_norm (attention output, dense MLP output) --
        def add_rms_p(residual, x, w):
            return add_rms(ar(x, group), residual, norm_weight(w), eps)

        def add_rms_r(residual, x, w):
            return call(x, residual, w)

        self._register_both(
            "add_rms_norm", eps, wb, add_rms_p, add_rms_r, [act(), act(), gamma()],
            self._norm_check, None,
        )

        # -- all_reduce -> rms_norm (first layer: the embedding's all-reduce output is also the
        # residual). arfuse.fused always adds a residual, so it gets zeros.
        def rms_p(x, w):
            y = ar(x, group)
            return rms(y, norm_weight(w), eps), y

        def rms_r(x, w):
            out = call(x, torch.zeros_like(x), w)
            return out[0], out[1]

        # Only the two-output form: the all-reduce node is inside the pattern, so it is there to
        # match even when nothing else reads it (its getitem is then dead and cleaned up).
        self._register_both(
            "rms_norm", eps, wb, rms_p, rms_r, [act(), gamma()], self._norm_check, None,
            first_only=False,
        )

    def _register_both(
        self,
        kind: str,
        eps: float,
        wb: float,
        pattern: Callable[..., Any],
        replacement: Callable[..., Any],
        inputs: Sequence[Any],
        check: Callable[[Match], bool],
        scalar_workaround: dict[str, float] | None,
        *,
        first_only: bool = True,
    ) -> None:
        """Registers the pattern with both outputs, then (first_only) with the first only.

        The second form is the end of the graph, where the residual output (or, for the first
        layer, the all-reduce output) has no user and so no node to match.
        """

        def first(fn: Callable[..., Any]) -> Callable[..., Any]:
            # Same parameter names as fn (functools.wraps): register_replacement reads them.
            @functools.wraps(fn)
            def wrapper(*args: Any) -> Any:
                return fn(*args)[0]

            return wrapper

        forms = [("all", pattern, replacement)]
        if first_only:
            forms.append(("first", first(pattern), first(replacement)))
        for outputs, p, r in forms:
            pm.register_replacement(
                p,
                r,
                list(inputs),
                pm.fwd_only,
                self.patterns,
                extra_check=check,
                scalar_workaround=scalar_workaround,
            )
            self.specs.append(PatternSpec(kind, eps, wb, outputs))

    # ---- checks on a match --------------------------------------------------------------------

    def _fits(self, x: Any) -> bool:
        """The activation is [T, hidden] in the communicator's dtype."""
        v = _val(x)
        return (
            isinstance(v, torch.Tensor)
            and v.dim() == 2
            and v.dtype == self.model_dtype
            and v.shape[-1] == self.hidden
        )

    def _norm_ok(self, match: Match) -> bool:
        """The norm has no variance_size override and a gamma arfuse takes."""
        for node in match.nodes:
            name = _op_name(node)
            if name == _RMS_NORM:
                weight_idx = 1
            elif name == _FUSED_ADD_RMS_NORM:
                weight_idx = 2
            else:
                continue
            variance_idx = weight_idx + 2
            if len(node.args) > variance_idx and node.args[variance_idx] is not None:
                return False
            if node.kwargs.get("variance_size") is not None:
                return False
            w = _val(node.args[weight_idx])
            if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, self.model_dtype):
                return False
        return True

    def _norm_check(self, match: Match) -> bool:
        """Activations [T, hidden] in the model dtype, gamma [hidden], a norm arfuse computes,
        and a token count the op can be traced with (see symbolic_tokens_supported)."""
        for name, value in match.kwargs.items():
            if not isinstance(value, fx.Node):
                continue
            if name == "w":
                v = _val(value)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != (self.hidden,):
                    return False
            elif not self._fits(value):
                return False
            elif isinstance(_val(value).shape[0], torch.SymInt) and not self._symbolic_ok():
                self._warn_symbolic()
                return False
        return self._norm_ok(match)

    def _symbolic_ok(self) -> bool:
        return symbolic_tokens_supported(self.handle, self.hidden, self.model_dtype)

    def _warn_symbolic(self) -> None:
        if not self._warned_symbolic:
            self._warned_symbolic = True
            logger.warning(
                "arfuse: torch.ops.arfuse.fused does not trace with a symbolic token count "
                "(its fake implementation specializes it), so graphs compiled for a token range "
                "stay unfused; graphs for fixed sizes (compile_sizes) are fused"
            )

    def _moe_check(self, kind: str) -> Callable[[Match], bool]:
        def check(match: Match) -> bool:
            if not self._norm_check(match):
                return False
            routed = _moe_output_index(match.kwargs.get("routed"))
            if routed is None or routed[1] != 1:
                return False
            if kind == "moe_scaled":
                # No shared experts: the routed output of moe_forward.
                return True
            shared = _moe_output_index(match.kwargs.get("shared"))
            return shared is not None and shared[0] is routed[0] and shared[1] == 0

        return check


# ---- static FP8 quantization after the norm ------------------------------------------------------


def _call(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _dtype(node: Any) -> torch.dtype | None:
    v = _val(node)
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
    if af is None or af.op != "call_function" or af.target not in _AUTO_FUNCTIONALIZED:
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
    v = _val(scale)
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


@functools.lru_cache(maxsize=None)
def symbolic_tokens_supported(handle: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether tracing torch.ops.arfuse.fused keeps a symbolic token count symbolic.

    vLLM compiles one graph per compile range with the token count T as a symbol. A fake (Meta)
    implementation that reads T as a plain integer specializes the symbol to the example value,
    and the graph compiled for the whole range would then be valid for that one size only. So
    the pass replaces patterns with a symbolic T only when this probe says the op traces
    symbolically; with a concrete T (vLLM's compile_sizes) it always can.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import make_fx

    def probe(x, residual, gamma):
        return torch.ops.arfuse.fused.default(
            x, None, None, None, residual, gamma, 1e-6, 0.0, 1.0, None, handle, 0
        )

    try:
        # The pass runs inside vLLM's compilation, under its fake mode (static shapes): trace the
        # probe outside it, with a shape environment of its own.
        with unset_fake_temporarily():
            gm = make_fx(probe, tracing_mode="symbolic")(
                torch.empty(3, hidden, dtype=dtype),
                torch.empty(3, hidden, dtype=dtype),
                torch.empty(hidden, dtype=dtype),
            )
        node = next(n for n in gm.graph.nodes if n.target is torch.ops.arfuse.fused.default)
        t = node.meta["val"][0].shape[0]
        return isinstance(t, torch.SymInt) and bool(t.node.expr.free_symbols)
    except Exception as e:  # any failure to trace symbolically counts as "no"
        logger.debug("arfuse: symbolic trace probe failed: %s", e)
        return False


def _communicator_mismatch(comm: Any, world_size: int, hidden: int, dtype: Any) -> str:
    """Why `comm` cannot serve this model ("" when it can)."""
    if int(comm.world_size) != world_size:
        return f"communicator world_size {comm.world_size} != tensor-parallel size {world_size}"
    if int(comm.hidden) != hidden:
        return f"communicator hidden {comm.hidden} != model hidden size {hidden}"
    if dtype is not None and comm.dtype != dtype:
        return f"communicator dtype {comm.dtype} != model dtype {dtype}"
    return ""


def _arfuse_version() -> str:
    import arfuse

    return str(getattr(arfuse, "__version__", "unknown"))
