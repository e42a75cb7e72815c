"""The graph patterns of the arfuse fusion pass: one small class per pattern (vLLM's own fusion
passes are written this way), each with what it matches, what replaces it, its example inputs and
the check a match must pass. ArfuseAllReduceFusionPass (arfuse.vllm.fusion) registers every class
of PATTERNS for every (eps, weight_bias), in that order: the MoE tails before the plain patterns,
since they share the all-reduce node.

The graph they see (vLLM 0.26.0 ... 0.34.0, before vLLM's IR lowering) holds

    torch.ops.vllm.all_reduce.default(x, group_name)
    torch.ops.vllm_ir.rms_norm.default(x, weight, eps[, variance_size])
    torch.ops.vllm_ir.fused_add_rms_norm.default(x, residual, weight, eps[, variance_size])

and, for the MoE tails, the outputs of vLLM's opaque MoE ops (moe_forward / moe_forward_shared)
scaled and added as MoERunner.forward does. Every replacement is one torch.ops.arfuse.fused call.
GemmaRMSNorm passes `weight.float() + 1.0` as the norm weight: arfuse takes the raw weight and
weight_bias 1 instead.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
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

EPSILONS = (1e-5, 1e-6)
# Gemma-style (x * (1 + w)) first: its weight is `w.float() + 1.0`, which the plain pattern would
# otherwise take as an fp32 gamma (correct, but it would leave the add unfused).
WEIGHT_BIASES = (1.0, 0.0)

# Example token count for tracing the patterns (the Meta implementation of arfuse.fused checks
# it against the communicator's capacity, so it is clipped to max_tokens).
EXAMPLE_TOKENS = 4
# Stands for routed_scaling_factor while tracing (scalar_workaround): any value that no other
# constant of the patterns takes.
EXAMPLE_SCALE = 0.8125

RMS_NORM = "vllm_ir::rms_norm"
FUSED_ADD_RMS_NORM = "vllm_ir::fused_add_rms_norm"
MOE_FORWARD = "vllm::moe_forward"
MOE_FORWARD_SHARED = "vllm::moe_forward_shared"
# arfuse's MoE op pair (arfuse.vllm.moe_rows): the unfinalized rows [T, K, H].
MOE_ROWS = "arfuse_vllm::moe_forward_rows"
MOE_SHARED_ROWS = "arfuse_vllm::moe_forward_shared_rows"
EXAMPLE_TOP_K = 2
AUTO_FUNCTIONALIZED = (auto_functionalized, auto_functionalized_v2)


def op_name(node: Any) -> str:
    target = getattr(node, "target", None)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return ""


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def moe_output_index(node: Any) -> tuple[fx.Node, int] | None:
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
    if op_name(src) == MOE_FORWARD_SHARED:
        return src, int(idx)
    if src.target in AUTO_FUNCTIONALIZED and src.args and idx == 0:
        op = src.args[0]
        if isinstance(op, torch._ops.OpOverload) and op._schema.name == MOE_FORWARD:
            return src, 1
    return None


def rows_output_index(node: Any) -> tuple[fx.Node, int] | None:
    """(rows op node, 0 for the shared-expert output / 1 for the rows) when `node` is an output
    of arfuse's MoE rows ops (moe_forward_rows returns the rows alone), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if op_name(node) == MOE_ROWS:
        return node, 1
    if node.target is operator.getitem:
        src, idx = node.args
        if isinstance(src, fx.Node) and op_name(src) == MOE_SHARED_ROWS:
            return src, int(idx)
    return None


@dataclasses.dataclass(frozen=True)
class PatternSpec:
    """One registered pattern: what it matches, for the record and the uuid."""

    kind: str  # "add_rms_norm", "rms_norm", "moe_scaled_shared", ...
    eps: float
    weight_bias: float
    outputs: str  # "all" or "first"


@dataclasses.dataclass
class Target:
    """What the replacements call and the example inputs are made of: the communicator and the
    model's activations."""

    group_name: str
    handle: int
    algorithm: int  # the `algorithm` argument of arfuse.fused
    hidden: int
    dtype: torch.dtype
    device: Any
    max_tokens: int
    # Whether vLLM's graph holds its all-reduce (False at tensor parallelism 1: vLLM's
    # GroupCoordinator returns a one-rank group's input, no op is traced).
    all_reduce: bool = True

    def act(self) -> torch.Tensor:
        t = max(1, min(EXAMPLE_TOKENS, self.max_tokens))
        return torch.empty(t, self.hidden, dtype=self.dtype, device=self.device)

    def gamma(self) -> torch.Tensor:
        return torch.empty(self.hidden, dtype=self.dtype, device=self.device)

    def rows(self) -> torch.Tensor:
        t = max(1, min(EXAMPLE_TOKENS, self.max_tokens))
        return torch.empty(t, EXAMPLE_TOP_K, self.hidden, dtype=self.dtype, device=self.device)


class Checks:
    """The checks on a match that every pattern shares: activations [T, hidden] in the model
    dtype, gamma [hidden], a norm arfuse computes, and a token count the op can be traced with.
    `symbolic_ok()` says whether a symbolic T may be fused; `on_symbolic()` is told when not."""

    def __init__(self, hidden: int, dtype: torch.dtype, symbolic_ok: Callable[[], bool],
                 on_symbolic: Callable[[], None]) -> None:
        self.hidden = hidden
        self.dtype = dtype
        self.symbolic_ok = symbolic_ok
        self.on_symbolic = on_symbolic

    def fits(self, x: Any) -> bool:
        """The activation is [T, hidden] in the communicator's dtype."""
        v = val(x)
        return (isinstance(v, torch.Tensor) and v.dim() == 2 and v.dtype == self.dtype
                and v.shape[-1] == self.hidden)

    def norm_ok(self, match: Match) -> bool:
        """The norm has no variance_size override and a gamma arfuse takes."""
        for node in match.nodes:
            name = op_name(node)
            if name == RMS_NORM:
                weight_idx = 1
            elif name == FUSED_ADD_RMS_NORM:
                weight_idx = 2
            else:
                continue
            variance_idx = weight_idx + 2
            if len(node.args) > variance_idx and node.args[variance_idx] is not None:
                return False
            if node.kwargs.get("variance_size") is not None:
                return False
            w = val(node.args[weight_idx])
            if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, self.dtype):
                return False
        return True

    def norm_check(self, match: Match, skip: tuple[str, ...] = ()) -> bool:
        for name, value in match.kwargs.items():
            if not isinstance(value, fx.Node) or name in skip:
                continue
            if name == "w":
                v = val(value)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != (self.hidden,):
                    return False
            elif not self.fits(value):
                return False
            elif isinstance(val(value).shape[0], torch.SymInt) and not self.symbolic_ok():
                self.on_symbolic()
                return False
        return self.norm_ok(match)


class FusionPattern:
    """One pattern: `functions()` returns the pattern and its replacement, plain functions whose
    parameters are the pattern's inputs (the tracer and register_replacement read their names;
    they close over the pattern object), `inputs()` the example inputs in that order,
    `check(match)` what a match must pass.
    `scaled`: the routed scaling factor is a traced Python scalar (scalar_workaround).
    `first_only`: also registered with only its first output used (the end of the graph, where
    the residual output has no user and so no node to match)."""

    kind = ""
    scaled = False
    first_only = True

    def __init__(self, target: Target, checks: Checks, eps: float, weight_bias: float) -> None:
        self.target = target
        self.checks = checks
        self.eps = eps
        self.wb = weight_bias
        self.ar = torch.ops.vllm.all_reduce.default
        self.rms = torch.ops.vllm_ir.rms_norm.default
        self.add_rms = torch.ops.vllm_ir.fused_add_rms_norm.default

    # ---- what the patterns and replacements are made of ----
    def norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """What the norm receives as its weight: GemmaRMSNorm passes `weight.float() + 1.0`,
        RMSNorm its weight as is."""
        return w.float() + 1.0 if self.wb else w

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """vLLM's all-reduce as its graph holds it: torch.ops.vllm.all_reduce for tensor
        parallelism > 1, nothing at 1 (GroupCoordinator.all_reduce returns a one-rank group's
        input)."""
        if not self.target.all_reduce:
            return x
        return self.ar(x, self.target.group_name)

    def add_rms_norm(self, y: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> Any:
        return self.add_rms(y, residual, self.norm_weight(w), self.eps)

    def fused(self, x, residual, w, shared=None, scale=1.0):
        """One arfuse.fused call on x: plain [T, H], or dense rows [T, K, H] (weights already
        applied: expert_weights None); the op reads the layout from x's rank."""
        return torch.ops.arfuse.fused.default(
            x, None, None, shared, residual, w, self.eps, self.wb, scale, None,
            self.target.handle, self.target.algorithm)

    # ---- to be defined by each pattern ----
    def functions(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        raise NotImplementedError

    def inputs(self) -> list[Any]:
        raise NotImplementedError

    def check(self, match: Match) -> bool:
        return self.checks.norm_check(match)

    # ---- registration ----
    def register(self, pm_pass: PatternMatcherPass) -> list[PatternSpec]:
        def first(fn: Callable[..., Any]) -> Callable[..., Any]:
            # Same parameter names as fn (functools.wraps): register_replacement reads them.
            @functools.wraps(fn)
            def wrapper(*args: Any) -> Any:
                return fn(*args)[0]

            return wrapper

        pattern, replacement = self.functions()
        forms = [("all", pattern, replacement)]
        if self.first_only:
            forms.append(("first", first(pattern), first(replacement)))
        specs = []
        workaround = {"scale": EXAMPLE_SCALE} if self.scaled else None
        inputs = self.inputs() + ([EXAMPLE_SCALE] if self.scaled else [])
        for outputs, p, r in forms:
            pm.register_replacement(p, r, list(inputs), pm.fwd_only, pm_pass,
                                    extra_check=self.check, scalar_workaround=workaround)
            specs.append(PatternSpec(self.kind, self.eps, self.wb, outputs))
        return specs


# ---- the MoE tails after vLLM's opaque MoE ops ---------------------------------------------------
# MoERunner.forward: `fused *= rsf` (when rsf != 1), then `shared + fused`, then the all-reduce;
# the next layer's input_layernorm is a fused_add_rms_norm.


class _MoETail(FusionPattern):
    """A tail whose `routed` (and `shared`) inputs must be the outputs of one of vLLM's MoE ops."""

    shared_input = True

    def inputs(self) -> list[Any]:
        n = 3 if self.shared_input else 2
        return [self.target.act() for _ in range(n)] + [self.target.gamma()]

    def check(self, match: Match) -> bool:
        if not self.checks.norm_check(match):
            return False
        routed = moe_output_index(match.kwargs.get("routed"))
        if routed is None or routed[1] != 1:
            return False
        if not self.shared_input:
            return True  # no shared experts: the routed output of moe_forward
        shared = moe_output_index(match.kwargs.get("shared"))
        return shared is not None and shared[0] is routed[0] and shared[1] == 0


class MoEScaledShared(_MoETail):
    """shared + routed * rsf -> all_reduce -> fused_add_rms_norm (DeepSeek-V2/V3)."""

    kind = "moe_scaled_shared"
    scaled = True

    def functions(self):
        all_reduce, add_rms_norm, fused = self.all_reduce, self.add_rms_norm, self.fused

        def pattern(shared, routed, residual, w, scale):
            return add_rms_norm(all_reduce(shared + routed * scale), residual, w)

        def replacement(shared, routed, residual, w, scale):
            return fused(routed, residual, w, shared, scale)

        return pattern, replacement


class MoESharedScaled(_MoETail):
    """shared * (1/rsf) + routed -> ... (fp16 with shared experts: vLLM scales the shared output
    instead, to keep the routed one from overflowing)."""

    kind = "moe_shared_scaled"
    scaled = True

    def functions(self):
        all_reduce, add_rms_norm, fused = self.all_reduce, self.add_rms_norm, self.fused

        def pattern(shared, routed, residual, w, scale):
            return add_rms_norm(all_reduce(shared * scale + routed), residual, w)

        def replacement(shared, routed, residual, w, scale):
            return fused(shared, residual, w, routed, scale)

        return pattern, replacement


class MoEShared(_MoETail):
    """shared + routed -> ... (shared experts, routed scale 1)."""

    kind = "moe_shared"

    def functions(self):
        all_reduce, add_rms_norm, fused = self.all_reduce, self.add_rms_norm, self.fused

        def pattern(shared, routed, residual, w):
            return add_rms_norm(all_reduce(shared + routed), residual, w)

        def replacement(shared, routed, residual, w):
            return fused(routed, residual, w, shared)

        return pattern, replacement


class MoEScaled(_MoETail):
    """routed * rsf -> ... (no shared experts, routed scale != 1)."""

    kind = "moe_scaled"
    scaled = True
    shared_input = False

    def functions(self):
        all_reduce, add_rms_norm, fused = self.all_reduce, self.add_rms_norm, self.fused

        def pattern(routed, residual, w, scale):
            return add_rms_norm(all_reduce(routed * scale), residual, w)

        def replacement(routed, residual, w, scale):
            return fused(routed, residual, w, None, scale)

        return pattern, replacement


# ---- the MoE tails on arfuse's unfinalized rows (arfuse.vllm.moe_rows) ----------------------------
# The switched MoERunner.forward: `rows.sum(dim=1)` stands for vLLM's moe_sum, then the same
# routed scale and shared add, the all-reduce and the next layer's norm. One arfuse call on the
# dense rows [T, K, H] (router weights already in them: expert_weights None) does it all.


class _RowsTail(FusionPattern):
    """rows [T, K, H] -> sum over K -> (* rsf) -> (+ shared) -> all_reduce -> fused_add_rms_norm.
    `tail` is what the switched MoERunner.forward computes from the rows."""

    shared_input = False

    @staticmethod
    def tail(rows: torch.Tensor, shared: torch.Tensor | None, scale: float | None) -> Any:
        routed = rows.sum(dim=1)
        if scale is not None:
            routed = routed * scale
        return routed if shared is None else shared + routed

    def functions(self):
        all_reduce, add_rms_norm, fused, tail = (self.all_reduce, self.add_rms_norm, self.fused,
                                                 self.tail)
        # The parameter lists differ per form (register_replacement reads them): one pair each.
        if self.shared_input and self.scaled:
            def pattern(rows, shared, residual, w, scale):
                return add_rms_norm(all_reduce(tail(rows, shared, scale)), residual, w)

            def replacement(rows, shared, residual, w, scale):
                return fused(rows, residual, w, shared, scale)
        elif self.shared_input:
            def pattern(rows, shared, residual, w):
                return add_rms_norm(all_reduce(tail(rows, shared, None)), residual, w)

            def replacement(rows, shared, residual, w):
                return fused(rows, residual, w, shared)
        elif self.scaled:
            def pattern(rows, residual, w, scale):
                return add_rms_norm(all_reduce(tail(rows, None, scale)), residual, w)

            def replacement(rows, residual, w, scale):
                return fused(rows, residual, w, None, scale)
        else:
            def pattern(rows, residual, w):
                return add_rms_norm(all_reduce(tail(rows, None, None)), residual, w)

            def replacement(rows, residual, w):
                return fused(rows, residual, w)
        return pattern, replacement

    def inputs(self) -> list[Any]:
        t = self.target
        return [t.rows()] + ([t.act()] if self.shared_input else []) + [t.act(), t.gamma()]

    def check(self, match: Match) -> bool:
        if not self.checks.norm_check(match, skip=("rows",)):
            return False
        rows = match.kwargs.get("rows")
        v = val(rows)
        if not (isinstance(v, torch.Tensor) and v.dim() == 3 and v.dtype == self.checks.dtype
                and v.shape[-1] == self.checks.hidden and not isinstance(v.shape[1], torch.SymInt)
                and 1 <= int(v.shape[1]) <= 64):
            return False
        src = rows_output_index(rows)
        if src is None or src[1] != 1:
            return False
        if not self.shared_input:
            return True
        shared = rows_output_index(match.kwargs.get("shared"))
        return shared is not None and shared[0] is src[0] and shared[1] == 0


class RowsScaledShared(_RowsTail):
    """shared + rows.sum(1) * rsf -> all_reduce -> fused_add_rms_norm (DeepSeek-V2/V3)."""

    kind = "rows_scaled_shared"
    scaled = True
    shared_input = True


class RowsShared(_RowsTail):
    """shared + rows.sum(1) -> ... (shared experts, routed scale 1)."""

    kind = "rows_shared"
    shared_input = True


class RowsScaled(_RowsTail):
    """rows.sum(1) * rsf -> ... (routed scale without shared experts)."""

    kind = "rows_scaled"
    scaled = True


class Rows(_RowsTail):
    """rows.sum(1) -> ... (Qwen3-MoE, Mixtral)."""

    kind = "rows"


# Each also with the residual output unused (the last layer). Only before fused_add_rms_norm: in
# vLLM's decoder layers a MoE output always meets the next layer's input_layernorm with a
# residual. The fp16 form vLLM uses with shared experts (shared * (1/rsf) + routed) has no dense
# counterpart in arfuse's op (its scale applies to the rows only): there the sum is Inductor's and
# the all-reduce + norm is fused by AllReduceAddRMSNorm.
ROWS_PATTERNS: tuple[type[_RowsTail], ...] = (RowsScaledShared, RowsShared, RowsScaled, Rows)


# ---- all-reduce + norm -----------------------------------------------------------------------------


class AllReduceAddRMSNorm(FusionPattern):
    """all_reduce -> fused_add_rms_norm (attention output, dense MLP output, a MoE without shared
    experts and with routed scale 1)."""

    kind = "add_rms_norm"

    def functions(self):
        all_reduce, add_rms_norm, fused = self.all_reduce, self.add_rms_norm, self.fused

        def pattern(residual, x, w):
            return add_rms_norm(all_reduce(x), residual, w)

        def replacement(residual, x, w):
            return fused(x, residual, w)

        return pattern, replacement

    def inputs(self) -> list[Any]:
        return [self.target.act(), self.target.act(), self.target.gamma()]


class AllReduceRMSNorm(FusionPattern):
    """all_reduce -> rms_norm, the all-reduce output kept as the residual (the first layer: the
    embedding's all-reduce). arfuse.fused always adds a residual, so it gets zeros. Only the
    two-output form: the all-reduce node is inside the pattern, so it is there to match even when
    nothing else reads it (its getitem is then dead and cleaned up)."""

    kind = "rms_norm"
    first_only = False

    def functions(self):
        all_reduce, fused = self.all_reduce, self.fused

        def pattern(x, w):
            y = all_reduce(x)
            return self.rms(y, self.norm_weight(w), self.eps), y

        def replacement(x, w):
            out = fused(x, torch.zeros_like(x), w)
            return out[0], out[1]

        return pattern, replacement

    def inputs(self) -> list[Any]:
        return [self.target.act(), self.target.gamma()]


def patterns_for(all_reduce: bool) -> tuple[type[FusionPattern], ...]:
    """The patterns the pass registers: all of PATTERNS where vLLM's graph holds its all-reduce
    (tensor parallelism > 1), else (tensor parallelism 1) the MoE tails on the expert rows alone:
    without the all-reduce the others are one vLLM kernel already (fused_add_rms_norm, with at
    most an elementwise add before it that Inductor fuses into its own code)."""
    return PATTERNS if all_reduce else ROWS_PATTERNS


# The order of registration (per eps and weight_bias).
PATTERNS: tuple[type[FusionPattern], ...] = (
    *ROWS_PATTERNS,
    MoEScaledShared,
    MoESharedScaled,
    MoEShared,
    MoEScaled,
    AllReduceAddRMSNorm,
    AllReduceRMSNorm,
)
