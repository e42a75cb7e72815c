"""The arfuse fusion pass for vLLM's post-grad pass manager.

Written against vLLM 0.26.0 (see scripts/install-vllm.sh for why that version). There the
all-reduce fusion runs before vLLM's IR lowering, so the graph it sees holds

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
  fused_add_rms_norm by one arfuse.fused call with the scaling and the shared add folded in.

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
    """

    def __init__(
        self,
        config: VllmConfig,
        communicator: Any | None = None,
        *,
        algorithm: str | None = None,
    ) -> None:
        super().__init__(config)
        self.pass_name = "arfuse_allreduce_fusion_pass"
        self.patterns = PatternMatcherPass(pass_name=self.pass_name)
        self.specs: list[PatternSpec] = []
        self.disabled = True
        self.reason = ""
        self.algorithm = algorithm or _settings.from_env().algorithm
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
        self._register_patterns()
        self.dump_patterns(config, self.patterns)  # only with vLLM's debug dump path set
        self.disabled = False
        logger.debug(
            "arfuse: %d patterns for hidden=%d dtype=%s world_size=%d max_tokens=%d",
            len(self.specs),
            self.hidden,
            self.model_dtype,
            self.world_size,
            self.max_tokens,
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
            self.matched_count = 0
            return
        self.matched_count = self.patterns.apply(graph)
        VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count
        logger.debug("arfuse: replaced %d patterns", self.matched_count)

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
