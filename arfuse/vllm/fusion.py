"""The arfuse fusion pass for vLLM's post-grad pass manager.

Written against vLLM 0.26.0 and run under 0.34.0 too (tests/vllm, both lanes); what it uses of
vLLM is listed in arfuse/vllm/contract/ and checked for every release 0.26.0 ... 0.34.0. There
the all-reduce fusion runs before vLLM's IR lowering, so the graph it sees holds

    torch.ops.vllm.all_reduce.default(x, group_name)
    torch.ops.vllm_ir.rms_norm.default(x, weight, eps[, variance_size])
    torch.ops.vllm_ir.fused_add_rms_norm.default(x, residual, weight, eps[, variance_size])

(vllm/compilation/passes/fusion/allreduce_rms_fusion.py matches the same ops; GemmaRMSNorm passes
`weight.float() + 1.0` as the weight). This pass replaces, for eps 1e-5 and 1e-6 and for
weight_bias 0 and 1 (Gemma), with the patterns of arfuse.vllm.patterns (one class each, listed in
patterns.PATTERNS):

* all_reduce -> fused_add_rms_norm (with the residual output, and without it at the end of the
  graph) and all_reduce -> rms_norm (first layer: the embedding's all-reduce, no residual add) by
  one torch.ops.arfuse.fused call on the plain [T, H] input;
* the MoE tail as vLLM's MoERunner.forward leaves it (fused * routed_scaling + shared, with
  fused/shared the outputs of torch.ops.vllm.moe_forward_shared or moe_forward) -> all_reduce ->
  fused_add_rms_norm by one arfuse.fused call with the scaling and the shared add folded in;
* any of these followed by vLLM's static per-tensor FP8 quantization of the norm output
  (kFp8StaticTensorSym, the input quantization of an FP8 linear layer with a static activation
  scale) by one arfuse.fused call with FP8 output (fp8_scale = the quant's scale), or by vLLM's
  dynamic per-token-group-128 quantization (kFp8Dynamic128Sym, the input quantization of an
  FP8-block linear layer) by one arfuse.fused_fp8_dynamic call (group size 128, the scales in
  vLLM's layout); see arfuse.vllm.fp8_fold for the forms matched and the rounding difference.

vLLM 0.26.0 never hands the unfinalized MoE output (permuted rows + index map + weights) to the
graph: the finalize runs inside the opaque moe_forward ops, and UnfinalizedMoEOutput does not exist
in that release. So there is no graph pattern for arfuse's permuted layout here; the eager call in
arfuse.vllm.eager takes that form instead.

At tensor parallelism 1 vLLM's graph holds no all-reduce (its GroupCoordinator returns the
input of a one-rank group), and vLLM's fused_add_rms_norm already does the residual add and the
norm in one kernel: what is left to fuse is the MoE tail on the expert rows (the Rows* patterns
without the all-reduce: rows -> sum -> (* rsf) -> (+ shared) -> fused_add_rms_norm), replaced by
one arfuse call of the local algorithm (and the FP8 folds after it); every other pattern stays
out (patterns.patterns_for).

The pass touches a graph only for compile ranges whose largest token count fits the communicator
(`is_applicable_for_range`), and only when the communicator serves the model's hidden size, dtype
and tensor-parallel world size; otherwise it leaves the graph as it is. Its uuid() covers that
configuration, so Inductor's cache keys change with it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
from torch import fx
from torch._inductor.pattern_matcher import PatternMatcherPass

from vllm.compilation.passes.inductor_pass import InductorPass, enable_fake_mode
from vllm.compilation.passes.vllm_inductor_pass import (
    VllmInductorPass,
    VllmPatternMatcherPass,
)
from vllm.config import VllmConfig
from vllm.config.utils import Range
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group

from . import communicators as _comms
from . import patterns as _patterns
from . import settings as _settings
from .fp8_fold import fold_fp8_quants
from .patterns import PatternSpec

# Under "vllm" so that vLLM's logging configuration (format, level) applies.
logger = logging.getLogger("vllm.arfuse")

EPSILONS = _patterns.EPSILONS
WEIGHT_BIASES = _patterns.WEIGHT_BIASES


class ArfuseAllReduceFusionPass(VllmPatternMatcherPass):
    """Replaces vLLM's all-reduce + RMSNorm (+ MoE tail) subgraphs by torch.ops.arfuse.fused.

    Args:
        config: the VllmConfig the pass manager is configured with.
        all_reduce: whether the graphs hold vLLM's all-reduce (None: vLLM's tensor-parallel
            group has more than one rank); without it (tensor parallelism 1) only the MoE tails
            on the expert rows are patterns (patterns.patterns_for).
        communicator: an open arfuse.Communicator for vLLM's tensor-parallel group. None: take the
            one kept for this config (arfuse.vllm.communicators.get_communicator), creating it
            if needed.
        algorithm: "auto", "oneshot" or "twoshot" (None: $ARFUSE_VLLM_ALGORITHM, default auto).
        fp8: fold vLLM's FP8 quant of the norm output into the fused call (None:
            $ARFUSE_VLLM_FP8, default on): the static per-tensor quant where arfuse has
            fp8_static kernels for the model's (dtype, hidden, world size) and every algorithm
            `algorithm` may use (`self.fp8`), the per-token-group-128 quant where it has
            fp8_group128 kernels (`self.fp8_group128`).

    After a call, `matched_count` is the number of chains replaced by an arfuse call,
    `fp8_count` how many of those also took an FP8 quant in, `fp8_counts` how many per kind
    ("fp8_static", "fp8_group128").
    """

    def __init__(
        self,
        config: VllmConfig,
        communicator: Any | None = None,
        *,
        algorithm: str | None = None,
        fp8: bool | None = None,
        all_reduce: bool | None = None,
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
        self.fp8_group128 = False
        self.fp8_count = 0
        self.fp8_counts: dict[str, int] = {}
        if self.algorithm not in _settings.ALGORITHMS:
            raise ValueError(
                f"algorithm={self.algorithm!r}: want one of {sorted(_settings.ALGORITHMS)}"
            )
        self.hidden: int | None = None
        self.world_size = get_tensor_model_parallel_world_size()
        # Whether vLLM's graph holds its all-reduce: GroupCoordinator.all_reduce returns a
        # one-rank group's input unchanged, so at tensor parallelism 1 no op is traced.
        tp = get_tp_group()
        self.all_reduce_in_graph = tp.world_size > 1 if all_reduce is None else bool(all_reduce)
        self.group_name = tp.unique_name
        self.handle: int | None = None
        self.max_tokens = 0
        self._warned_symbolic = False

        if config.model_config is None:
            self._disable("vLLM has no model config")
            return
        self.hidden = config.model_config.get_hidden_size()
        if communicator is None:
            communicator = _comms.get_communicator(config)
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
        # A communicator of world size 1 has no all-reduce: the local algorithm, whatever the
        # setting (one-shot or two-shot would be refused by the op).
        self.algorithm = _comms.algorithm_for(int(communicator.world_size), self.algorithm)
        self.handle = int(communicator.handle)
        self.max_tokens = int(communicator.max_tokens)
        if env.fp8 if fp8 is None else fp8:
            self.fp8 = _comms.fp8_supported(self.model_dtype, self.hidden, self.world_size, self.algorithm)
            if not self.fp8:
                logger.info(
                    "arfuse: no fp8_static kernel for dtype=%s hidden=%d world_size=%d "
                    "algorithm=%s; static FP8 quantization stays a separate op",
                    self.model_dtype, self.hidden, self.world_size, self.algorithm,
                )
            self.fp8_group128 = _comms.fp8_supported(
                self.model_dtype, self.hidden, self.world_size, self.algorithm, "fp8_group128"
            )
            if not self.fp8_group128:
                logger.debug(
                    "arfuse: no fp8_group128 kernel for dtype=%s hidden=%d world_size=%d "
                    "algorithm=%s; per-token-group FP8 quantization stays a separate op",
                    self.model_dtype, self.hidden, self.world_size, self.algorithm,
                )
        self._register_patterns()
        self.dump_patterns(config, self.patterns)  # only with vLLM's debug dump path set
        self.disabled = False
        logger.debug(
            "arfuse: %d patterns for hidden=%d dtype=%s world_size=%d max_tokens=%d fp8=%s "
            "fp8_group128=%s",
            len(self.specs),
            self.hidden,
            self.model_dtype,
            self.world_size,
            self.max_tokens,
            self.fp8,
            self.fp8_group128,
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
            self.fp8_counts = {}
            return
        self.matched_count = self.patterns.apply(graph)
        # Second step, on the calls just made: an FP8 quant of a call's norm output goes into
        # the call (one rule for every pattern above, instead of an FP8 twin of each).
        kinds = (("fp8_static",) if self.fp8 else ()) + (
            ("fp8_group128",) if self.fp8_group128 else ())
        self.fp8_counts = fold_fp8_quants(graph, kinds) if kinds else {}
        self.fp8_count = sum(self.fp8_counts.values())
        VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count
        for kind, key in (("fp8_static", "static_fp8"), ("fp8_group128", "group128_fp8")):
            if self.fp8_counts.get(kind):
                VllmPatternMatcherPass.match_table[f"{self.pass_name}.{key}"] += \
                    self.fp8_counts[kind]
        logger.debug(
            "arfuse: replaced %d patterns, with an FP8 quant folded in: %s",
            self.matched_count,
            self.fp8_counts,
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
            "all_reduce_in_graph": self.all_reduce_in_graph,
            "group": self.group_name,
            "max_tokens": self.max_tokens,
            # The handle is an int baked into the graph: a graph compiled for one handle must
            # not be reused for another.
            "handle": self.handle,
            "algorithm": self.algorithm,
            "fp8": self.fp8,
            "fp8_group128": self.fp8_group128,
            "patterns": [dataclasses.astuple(s) for s in self.specs],
        }
        return InductorPass.hash_dict(state)

    # ---- patterns -----------------------------------------------------------------------------

    @enable_fake_mode
    def _register_patterns(self) -> None:
        target = _patterns.Target(
            group_name=self.group_name,
            handle=self.handle,
            algorithm=_settings.ALGORITHMS[self.algorithm],
            hidden=self.hidden,
            dtype=self.model_dtype,
            device=self.device or "cpu",
            max_tokens=self.max_tokens,
            all_reduce=self.all_reduce_in_graph,
        )
        checks = _patterns.Checks(self.hidden, self.model_dtype, self._symbolic_ok,
                                  self._warn_symbolic)
        for eps in EPSILONS:
            for wb in WEIGHT_BIASES:
                for cls in _patterns.patterns_for(self.all_reduce_in_graph):
                    self.specs += cls(target, checks, eps, wb).register(self.patterns)

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
