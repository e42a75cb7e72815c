"""vLLM's real MoE models, built small on the CPU and compiled the way vLLM compiles them.

The models are vLLM's own classes from vllm.model_executor.models.* (Qwen3MoeModel with
Qwen3MoeDecoderLayer, DeepseekV2Model with DeepseekV2DecoderLayer from a DeepSeek-V3 config,
MixtralModel with MixtralDecoderLayer, GptOssModel with gpt-oss's TransformerBlock), each
decorated by vLLM with @support_torch_compile. Calling one compiles it through that decorator:
TorchCompileWithNoGuardsWrapper (torch.compile with dynamic=False, guards dropped), the token
dimension marked dynamic by the decorator (torch._dynamo.mark_dynamic), VllmBackend splitting the
graph at the attention ops and compiling each piece with Inductor for vLLM's compile range, and
vLLM's PostGradPassManager (configured by VllmBackend) running the post-grad passes.

What differs from a GPU deployment, and why:

* Tensor parallelism is 2 as far as the model sees it (`tensor_parallel(2)`; a model built with
  tp=1 is the single-GPU case, whose graph has no all-reduce, as on a GPU): vLLM's
  GroupCoordinator.all_reduce returns its input unchanged for one rank, so a TP=1 graph has no
  all-reduce. The TP group reports world size 2 and calls torch.ops.vllm.all_reduce (as it does
  on CUDA), while the process group underneath has this one process: the layers are built as
  rank 0 of 2 (half the heads, half of each expert's intermediate size, half the vocabulary) and
  the all-reduce computes the identity (vllm_harness.ensure_distributed).
* Attention is a stand-in (`StubAttention`, `StubMLAAttention`): vLLM's attention layers need a
  GPU attention backend and a KV cache. The stand-ins keep the interface (the projections, norms
  and rotary embedding around them are vLLM's) and compute plain causal softmax attention over
  the batch as one sequence (no KV cache, sliding window or sinks), through a custom op that is
  listed in vLLM's splitting_ops, so VllmBackend splits the graph there as it splits at
  vllm::unified_attention_with_output.
* The experts run vLLM's CPU MoE backend (UnquantizedMoeBackend.CPU), selected instead of the
  GPU kernels this machine cannot run (cpu_build): in vLLM 0.26 vLLM's own PyTorch code
  (cpu_fused_moe.CPUFusedMOE), in 0.34 vLLM's CPURouter and CPUUnquantizedExperts with PyTorch
  stand-ins for the two C++ kernels of vLLM's CPU build (cpu_moe_kernels). Either runs inside
  vLLM's opaque moe_forward / moe_forward_shared ops, so the graph around them (MoERunner's routed
  scale, shared add, all-reduce) is the one a GPU build has. gpt-oss is built unquantized (bf16
  experts); its released checkpoints are MXFP4, whose experts are GPU-only.
* The weights are random with wide routing margins (init_weights), so that both graphs route
  every token alike in bfloat16 and every output element can be compared.
* The arfuse pass is built and put into vLLM's pass list by the plugin's configure hook body
  (arfuse.vllm.passes.configure_pass_manager, run right after vLLM's PostGradPassManager.configure:
  vllm_harness.pass_added_by_plugin), with arfuse's world-size-1 CPU communicator
  (arfuse.comm.cpu_communicator) in place of the TP group's (vllm_harness.redirect_plugin_to).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import vllm_harness as H

STUB_ATTENTION = "arfuse_test::attention"
STUB_MLA_ATTENTION = "arfuse_test::mla_attention"


# ---- attention stand-ins -------------------------------------------------------------------------


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [T, H, D], k [T, H, D], v [T, H, Dv] -> [T, H * Dv], in float32, causal over T."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    s = (q @ k.transpose(1, 2)) * scale
    t = s.shape[-1]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(0, 1).reshape(t, -1)


@torch.library.custom_op(STUB_ATTENTION, mutates_args=())
def stub_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    t = q.shape[0]
    q = q.reshape(t, num_heads, -1)
    k = k.reshape(t, num_kv_heads, -1).repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.reshape(t, num_kv_heads, -1).repeat_interleave(num_heads // num_kv_heads, dim=1)
    return _causal_attention(q, k, v, scale).to(q.dtype)


@stub_attention.register_fake
def _(q, k, v, num_heads, num_kv_heads, scale):
    return q.new_empty(q.shape[0], num_heads * (v.shape[-1] // num_kv_heads))


@torch.library.custom_op(STUB_MLA_ATTENTION, mutates_args=())
def stub_mla_attention(
    q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
    nope_dim: int, v_dim: int, scale: float,
) -> torch.Tensor:
    """MLA without the weight absorption: kv_b_proj expands the latent into per-head keys and
    values, and the rotary part of the key (one head) is shared by all heads."""
    t, heads, _ = q.shape
    kv = (kv_c.float() @ kv_b_weight.float().t()).view(t, heads, nope_dim + v_dim)
    k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.float().expand(t, heads, k_pe.shape[-1])], dim=-1)
    return _causal_attention(q, k, v, scale).to(q.dtype)


@stub_mla_attention.register_fake
def _(q, kv_c, k_pe, kv_b_weight, nope_dim, v_dim, scale):
    return q.new_empty(q.shape[0], q.shape[1] * v_dim)


class StubAttention(torch.nn.Module):
    """Stands in for vllm.model_executor.layers.attention.Attention (same constructor and
    forward arguments; the KV-cache and backend arguments are accepted and ignored)."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.scale = scale

    def forward(self, query, key, value, output_shape=None, output_dtype=None):
        return torch.ops.arfuse_test.attention(
            query, key, value, self.num_heads, self.num_kv_heads, self.scale
        )


class StubMLAAttention(torch.nn.Module):
    """Stands in for vllm.model_executor.layers.attention.MLAAttention (same arguments)."""

    def __init__(self, num_heads: int, scale: float, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None,
                 kv_lora_rank: int, kv_b_proj: torch.nn.Module, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__()
        self.scale = scale
        self.nope_dim = qk_nope_head_dim
        self.v_dim = v_head_dim
        # Not registered as a submodule: it is the attention module's kv_b_proj already.
        self._kv_b_proj = [kv_b_proj]

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        # q_dcp_replicated (vLLM 0.34): set only with decode context parallelism, off here.
        assert q_dcp_replicated is None
        return torch.ops.arfuse_test.mla_attention(
            q, kv_c_normed, k_pe, self._kv_b_proj[0].weight, self.nope_dim, self.v_dim,
            self.scale,
        )


# ---- the models ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chain:
    """One chain the pass replaces: (kind, outputs) with kind "plain" (all_reduce -> norm),
    "first_layer" (all_reduce -> rms_norm), "scaled_shared" (shared + routed * rsf),
    "shared_scaled" (shared * (1/rsf) + routed), and outputs "both" or "first"."""

    kind: str
    outputs: str


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A vLLM model class, a small config of its architecture, and what the pass should do."""

    name: str
    module: str  # vllm.model_executor.models.<module>
    model_class: str  # the @support_torch_compile model class
    decoder_class: str  # the decoder layer class its layers are
    config: dict[str, Any]
    # norms left in the graph after the pass (rms_norm over heads / latents, never after an
    # all-reduce)
    norms_left: int
    # routed scaling factor of the MoE layers (1.0: none)
    routed_scaling: float = 1.0

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def eps(self) -> float:
        return float(self.config.get("rms_norm_eps", 1e-5))

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def model_cls(self) -> type:
        return getattr(importlib.import_module(f"vllm.model_executor.models.{self.module}"),
                       self.model_class)

    def decoder_cls(self) -> type:
        return getattr(importlib.import_module(f"vllm.model_executor.models.{self.module}"),
                       self.decoder_class)


HIDDEN = 256
# What every case's config has.
# An FP8-block checkpoint's quantization_config (DeepSeek-V3 as released: 128 x 128 weight blocks,
# activations quantized dynamically per token and group of 128).
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
             "weight_block_size": [128, 128]}

SMALL = {"hidden_size": HIDDEN, "num_experts_per_tok": 2, "vocab_size": 512,
         "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"}

QWEN3_MOE = ModelCase(
    name="qwen3-moe",
    module="qwen3_moe",
    model_class="Qwen3MoeModel",
    decoder_class="Qwen3MoeDecoderLayer",
    # Qwen3-30B-A3B's config (vllm_harness.QWEN3_MOE), small.
    config=dict(H.QWEN3_MOE.config, **SMALL, intermediate_size=512, moe_intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # q_norm and k_norm per layer (over the head dimension)
    norms_left=4,
)

DEEPSEEK_V3 = ModelCase(
    name="deepseek-v3",
    module="deepseek_v2",
    model_class="DeepseekV2Model",
    decoder_class="DeepseekV2DecoderLayer",
    config={
        **SMALL,
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 3,
        # MLA
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        # one dense layer, then MoE layers with a shared expert and grouped sigmoid top-k
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 8,
        "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
        },
    },
    # q_a_layernorm and kv_a_layernorm per layer (over the MLA latents)
    norms_left=6,
    routed_scaling=2.5,
)

MIXTRAL = ModelCase(
    name="mixtral",
    module="mixtral",
    model_class="MixtralModel",
    decoder_class="MixtralDecoderLayer",
    config={
        **SMALL,
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "intermediate_size": 256, "num_local_experts": 8, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    },
    norms_left=0,
)

GPT_OSS = ModelCase(
    name="gpt-oss",
    module="gpt_oss",
    model_class="GptOssModel",
    decoder_class="TransformerBlock",
    # The released checkpoints are MXFP4; without a quantization_config vLLM builds the MoE
    # unquantized (bf16), the form its CPU backend runs.
    config={
        **SMALL,
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "intermediate_size": 256, "num_local_experts": 8, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"],
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False,
        },
        "swiglu_limit": 7.0,
    },
    norms_left=0,
)

CASES = (QWEN3_MOE, DEEPSEEK_V3, MIXTRAL, GPT_OSS)


def spec_for(case: ModelCase, dtype: torch.dtype) -> H.ModelSpec:
    """The harness's ModelSpec for the case's config.json (name per dtype: one directory each)."""
    return H.ModelSpec(
        name=f"{case.name}-{str(dtype).removeprefix('torch.')}",
        config=dict(case.config, torch_dtype=str(dtype).removeprefix("torch.")),
        hidden=case.hidden,
        eps=case.eps,
        routed_scaling=case.routed_scaling,
        shared_experts=case.routed_scaling != 1.0,
        n_experts=8,
        top_k=2,
    )


# ---- building ------------------------------------------------------------------------------------


@contextlib.contextmanager
def tensor_parallel(world_size: int = 2) -> Iterator[None]:
    """vLLM's TP group reports `world_size` ranks and calls torch.ops.vllm.all_reduce (the
    custom-op collective path vLLM's CUDA platform takes) while the process group underneath
    stays this one process. Restored on exit."""
    from vllm.distributed import parallel_state as ps

    tp = ps.get_tp_group()
    saved = tp.world_size, tp.use_custom_op_call
    tp.world_size, tp.use_custom_op_call = world_size, True
    try:
        yield
    finally:
        tp.world_size, tp.use_custom_op_call = saved


class _ReportsCpu:
    """vLLM's current platform, except that is_cpu() is true (for vLLM's MoE router factory,
    which picks its CPU router by asking)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_cpu(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


_CPU_MOE_SCHEMAS = {
    # The arguments vllm._cpu_ops.cpu_prepack_moe_weight and cpu_fused_moe (vLLM 0.34) pass to
    # the kernels of vLLM's CPU build, in their order.
    "prepack_moe_weight": "prepack_moe_weight(Tensor weight, Tensor(a!) output, str isa) -> ()",
    "cpu_fused_moe": (
        "cpu_fused_moe(Tensor(a!) output, Tensor input, Tensor w13, Tensor w2, Tensor? w13_bias, "
        "Tensor? w2_bias, Tensor topk_weights, Tensor topk_ids, bool skip_weighted, str act, "
        "str isa) -> ()"
    ),
}
_cpu_moe_lib: Any = None


def _swigluoai(h: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """vLLM's SwigluOAIAndMul.forward_native: gate and up interleaved."""
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def cpu_moe_kernels() -> None:
    """PyTorch stand-ins for the two kernels of vLLM's CPU MoE experts (vLLM 0.34:
    experts/cpu_moe.py CPUUnquantizedExperts) that only vLLM's CPU build has:
    _C.prepack_moe_weight (here a plain copy: the stand-in reads the weights unpacked) and
    _C.cpu_fused_moe (per expert: w13 GEMM, activation, w2 GEMM, times the token's router weight,
    summed over its top-k). Defined once per process, only where missing."""
    global _cpu_moe_lib
    missing = [n for n in _CPU_MOE_SCHEMAS if not hasattr(torch.ops._C, n)]
    if not missing:
        return

    def prepack(weight, output, isa):
        output.copy_(weight)

    def fused_moe(output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids,
                  skip_weighted, act, isa):
        acts = {"silu": _silu_and_mul, "swigluoai": _swigluoai}
        x = input.float()
        acc = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            h = x[tok] @ w13[e].float().t()
            if w13_bias is not None:
                h = h + w13_bias[e].float()
            y = acts[act](h) @ w2[e].float().t()
            if w2_bias is not None:
                y = y + w2_bias[e].float()
            if not skip_weighted:
                y = y * topk_weights[tok, slot, None].float()
            acc.index_add_(0, tok, y)
        output.copy_(acc.to(output.dtype))

    lib = torch.library.Library("_C", "FRAGMENT")
    impls = {"prepack_moe_weight": prepack, "cpu_fused_moe": fused_moe}
    for name in missing:
        lib.define(_CPU_MOE_SCHEMAS[name])
        lib.impl(name, impls[name], "CompositeExplicitAutograd")
    _cpu_moe_lib = lib


@contextlib.contextmanager
def attention_stubs() -> Iterator[None]:
    """While vLLM builds a model: the attention stand-ins in place of vLLM's attention layers."""
    with contextlib.ExitStack() as stack:
        for name in ("qwen3_moe", "deepseek_v2", "mixtral", "gpt_oss"):
            module = importlib.import_module(f"vllm.model_executor.models.{name}")
            stack.enter_context(mock.patch.object(module, "Attention", StubAttention))
        mla = importlib.import_module("vllm.model_executor.layers.mla")
        stack.enter_context(mock.patch.object(mla, "MLAAttention", StubMLAAttention))
        yield


@contextlib.contextmanager
def cpu_build() -> Iterator[None]:
    """While vLLM builds a model: the attention stand-ins in place of vLLM's attention layers,
    and vLLM's CPU MoE backend (UnquantizedMoeBackend.CPU) for the unquantized experts, which the
    GPU platform would not pick:

    * vLLM 0.26: the backend is monolithic PyTorch (cpu_fused_moe.CPUFusedMOE: its own routing,
      per-expert F.linear): selecting it is all.
    * vLLM 0.34: the modular CPUUnquantizedExperts, routed by CPURouter (PyTorch), whose GEMM
      kernels exist only in vLLM's CPU build: cpu_moe_kernels() stands in for them, and vLLM's
      router factory is told the platform is a CPU so that it builds the CPURouter."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as um
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    try:
        cpu_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
        experts_cls = cpu_moe.CPUUnquantizedExperts
    except (ImportError, AttributeError):
        experts_cls = None  # the monolithic CPU backend (vLLM 0.26)

    with contextlib.ExitStack() as stack:
        stack.enter_context(attention_stubs())
        choice = (UnquantizedMoeBackend.CPU, experts_cls)
        stack.enter_context(mock.patch.object(
            um, "select_unquantized_moe_backend", lambda moe_config: choice
        ))
        if experts_cls is not None:
            cpu_moe_kernels()
            factory = importlib.import_module(
                "vllm.model_executor.layers.fused_moe.router.router_factory"
            )
            stack.enter_context(mock.patch.object(
                factory, "current_platform", _ReportsCpu(factory.current_platform)
            ))
        yield


def model_config(root: Path, case: ModelCase, dtype: torch.dtype, **compilation: Any) -> Any:
    """vLLM's config for the case, compiled as vLLM compiles (VLLM_COMPILE, Inductor, graph split
    at the attention ops), one compile range [1, MAX_TOKENS], no CUDA graphs; `compilation`:
    further CompilationConfig fields."""
    config = H.vllm_config(
        root, spec_for(case, dtype), dtype,
        max_num_batched_tokens=H.MAX_TOKENS,
        splitting_ops=[STUB_ATTENTION, STUB_MLA_ATTENTION],
        cudagraph_mode="NONE",
        # A CUDA-only pass (vLLM imports it only on CUDA platforms) that vLLM turns on for MLA
        # models; it fuses rope + KV-cache writes around the attention op, not what arfuse sees.
        passes={"fuse_rope_kvcache_cat_mla": False, **compilation.pop("passes", {})},
        **compilation,
    )
    # What VllmConfig does on platforms with CUDA graphs (_set_cudagraph_sizes), here with none
    # captured: compile_sizes becomes [] (vLLM's piecewise backend then uses the compile ranges).
    cc = config.compilation_config
    cc.cache_dir = str(root / "vllm-compile-cache" / f"{case.name}-{dtype}")
    cc.inductor_compile_config["force_disable_caches"] = True
    if cc.compile_sizes is None:
        cc.cudagraph_capture_sizes = []
        cc.max_cudagraph_capture_size = 0
        cc.post_init_cudagraph_sizes()
    return config


# Routing margins (init_weights): each token's embedding points along the router directions of
# two experts (ROUTE_SCALE, and 0.8 of it for the second) and against all of them (ROUTE_BASE),
# above noise of ROUTE_NOISE per element.
ROUTE_SCALE = 8.0
ROUTE_BASE = 4.0
ROUTE_NOISE = 0.5
# The sublayers' output projections (attention o_proj, dense MLP and expert down projections)
# are scaled by this, so the residual stream, and with it every layer's routing, stays
# dominated by the embedding.
OUTPUT_SCALE = 0.1


def _is_router(name: str) -> bool:
    return name.endswith((".gate.weight", ".router.weight"))


def _is_output_projection(name: str) -> bool:
    return name.endswith(("o_proj.weight", "down_proj.weight", "w2_weight"))


def init_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Random weights, drawn from `generator`, with routing decided by a wide margin.

    In bfloat16 the fused graph and vLLM's unfused one round differently (arfuse adds the
    residual and normalizes in float32; vLLM's graph rounds to bf16 in between), so a router
    input can differ by a bf16 step. With plain random weights a token whose top-k
    experts are that close then picks another expert in one graph only, and its whole output
    row differs (seen in 2 of 4 models at 24 tokens). So that every element can be compared:
    the router weights of every MoE layer are the same E orthonormal random directions u_e, each
    token's embedding is ROUTE_SCALE * (u_a + 0.8 u_b) - ROUTE_BASE * sum_e u_e plus
    N(0, ROUTE_NOISE^2) noise for a random expert pair (a, b), and the sublayers' output
    projections are scaled by OUTPUT_SCALE. After the RMS norm each token's router logits are
    then about +4.7 and +2.8 for a and b and -4.7 +- 0.6 for the others, in every layer (second
    and third largest at least 4.8 apart in 2 x 96 token-layers measured on Qwen3-MoE and
    DeepSeek-V3), against rounding differences of a few hundredths. That holds for softmax top-k
    and for DeepSeek's sigmoid grouped top-k, whose group scores add two experts' scores: the
    other experts' scores must be near 0, not near 0.5 (with ROUTE_BASE = 0, one DeepSeek-V3 run
    under vLLM 0.34 had one token's row off by up to 0.35: a routing flip by its shape). Its
    score correction bias, which shifts the selection, is N(0, 1e-4).

    Everything else: norm weights 1 + N(0, 0.01), other matrices N(0, 1 / fan-in), biases (and
    gpt-oss's sinks) N(0, 0.01)."""
    routers = [p for n, p in model.named_parameters() if _is_router(n)]
    assert routers, "no MoE router weights found"
    experts, hidden = routers[0].shape
    directions = torch.linalg.qr(torch.randn(hidden, experts, generator=generator))[0].t()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=generator)
            elif leaf == "e_score_correction_bias":
                v = 0.01 * torch.randn(p.shape, generator=generator)
            elif p.dim() == 1 or leaf == "sinks":
                v = 0.1 * torch.randn(p.shape, generator=generator)
            elif _is_router(name):
                assert tuple(p.shape) == (experts, hidden), (name, p.shape)
                v = directions
            elif "embed" in name:
                rows = p.shape[0]
                a = torch.randint(0, experts, (rows,), generator=generator)
                b = (a + torch.randint(1, experts, (rows,), generator=generator)) % experts
                v = ROUTE_SCALE * (directions[a] + 0.8 * directions[b])
                v = v - ROUTE_BASE * directions.sum(dim=0)
                v = v + ROUTE_NOISE * torch.randn(p.shape, generator=generator)
            else:
                v = torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5
                if _is_output_projection(name):
                    v = v * OUTPUT_SCALE
            p.copy_(v.to(p.dtype))


def _ensure_workspace() -> None:
    """vLLM's MoE modular kernels take their scratch from the worker's workspace manager, which
    vLLM's GPU worker initializes (gpu_worker.py: init_workspace_manager); here on the CPU. The
    0.26 CPU MoE backend is monolithic and uses none."""
    try:
        from vllm.v1.worker import workspace
    except ImportError:
        return
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))


@dataclasses.dataclass
class Built:
    case: ModelCase
    config: Any
    model: torch.nn.Module
    dtype: torch.dtype
    vocab_shard: int  # token ids < this embed on rank 0 (the others are rank 1's)
    tp: int = 2  # the tensor-parallel size the model was built (and is run) as


def build(
    root: Path, case: ModelCase, dtype: torch.dtype, seed: int, *, tp: int = 2, **compilation: Any
) -> Built:
    """vLLM's model class for the case, as rank 0 of TP=tp (default 2), random weights from
    `seed`, then vLLM's process_weights_after_loading (which sets up the CPU MoE backend);
    `compilation`: further CompilationConfig fields."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    config = model_config(root, case, dtype, **compilation)
    H.ensure_distributed(config)
    default = torch.get_default_dtype()
    with tensor_parallel(tp), cpu_build(), set_current_vllm_config(config):
        torch.set_default_dtype(dtype)
        try:
            model = case.model_cls()(vllm_config=config, prefix="model")
        finally:
            torch.set_default_dtype(default)
    layers = list(model.layers)
    assert layers and all(type(m) is case.decoder_cls() for m in layers), (
        f"{case.model_class}.layers are not {case.decoder_class}"
    )
    init_weights(model, torch.Generator().manual_seed(seed))
    process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    _ensure_workspace()
    vocab = case.config["vocab_size"] // tp
    return Built(case, config, model.requires_grad_(False), dtype, vocab, tp)


def inputs(built: Built, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions) of one sequence of `tokens` tokens: ids from rank 0's vocabulary
    shard (rank 1's would embed to zeros on this rank, and the identity all-reduce would keep
    them zero)."""
    ids = torch.randint(0, built.vocab_shard, (tokens,), generator=generator)
    return ids, torch.arange(tokens)


def run_eager(built: Built, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The model's forward, uncompiled (vLLM's decorator skips compilation while
    do_not_compile is set), as rank 0 of the TP size it was built for."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    model = built.model
    saved = model.do_not_compile
    model.do_not_compile = True
    try:
        with tensor_parallel(built.tp), set_current_vllm_config(built.config), \
                set_forward_context(None, built.config), torch.no_grad():
            return model(*[a.clone() for a in args], None)
    finally:
        model.do_not_compile = saved


@dataclasses.dataclass
class CompiledRun:
    outputs: list[torch.Tensor]  # one per input set, from the one compiled model
    graphs: list[tuple[torch.fx.Graph, torch.fx.Graph]]  # (before, after) the arfuse pass
    record: H.PassRecord

    @property
    def fusion(self) -> Any:
        """The arfuse pass put in (the plugin's: a GuardedPass around ArfuseAllReduceFusionPass;
        or the slot's object)."""
        (fusion,) = set(self.record.passes)
        return fusion


def compile_and_run(
    built: Built, communicator: Any, arg_sets: list[tuple[torch.Tensor, ...]],
    *, slot: Any = None,
) -> CompiledRun:
    """Compiles the model as vLLM does and runs it on every input set (one compilation: every
    token count in [1, MAX_TOKENS] is in the one compile range): the model's own
    @support_torch_compile path (vLLM's TorchCompileWithNoGuardsWrapper: torch.compile with
    dynamic=False, input_ids / positions dim 0 marked dynamic by the decorator, VllmBackend),
    with the arfuse pass built and added by the plugin's configure hook body
    (vllm_harness.pass_added_by_plugin) for `communicator`; or, with `slot` (the
    post_grad_custom_post_pass object the config names), only what vLLM's VllmBackend adds
    itself, the slot, which builds the plugin's pass for `communicator`."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from arfuse.vllm import guard

    torch._dynamo.reset()
    model = built.model
    assert not model.do_not_compile, "vLLM would not compile this model"
    assert guard.active(), guard.disabled_reason()
    outputs = []
    adding = H.pass_added_by_plugin() if slot is None else H.recorded_when_vllm_adds(slot)
    with H.redirect_plugin_to(communicator), adding as record, \
            tensor_parallel(built.tp), set_current_vllm_config(built.config), \
            set_forward_context(None, built.config), torch.no_grad():
        for args in arg_sets:
            outputs.append(model(*[a.clone() for a in args], None))
    if hasattr(model, "cleanup"):
        model.cleanup()  # the bytecode hook vLLM's wrapper registered for this instance
    assert guard.active(), f"arfuse's pass failed: {guard.disabled_reason()}"
    assert record.graphs, "vLLM's pass manager never reached the arfuse pass"
    return CompiledRun(outputs, record.graphs, record)


# ---- reading the compiled graphs -----------------------------------------------------------------


def _source(node: Any) -> str:
    """What produced an arfuse.fused operand: "moe_forward[i]" / "moe_forward_shared[i]" (item i
    of vLLM's MoE op; moe_forward through auto_functionalized), else the producing op's name."""
    import operator

    if not isinstance(node, torch.fx.Node):
        return repr(node)
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        name = H.op_name(src)
        if name == "vllm::moe_forward_shared":
            return f"moe_forward_shared[{idx}]"
        if src.args and isinstance(src.args[0], torch._ops.OpOverload):  # auto_functionalized
            return f"{src.args[0]._schema.name.removeprefix('vllm::')}[{idx}]"
    return H.op_name(node) or str(node.target)


def _is_zeros(node: Any) -> bool:
    return (isinstance(node, torch.fx.Node) and H.op_name(node) == "aten::full"
            and node.args[1] == 0)


def fused_chains(graph: torch.fx.Graph, routed_scaling: float) -> list[tuple[Any, ...]]:
    """One (kind, outputs, sources, eps, weight_bias) per arfuse.fused call, after dead-code
    elimination (as vLLM's cleanup does next):

    kind: "first_layer" (residual zeros: all_reduce -> rms_norm), "plain", "scaled", "shared",
    "scaled_shared" (routed * rsf + shared), "shared_scaled" (shared * (1/rsf) + routed);
    outputs: "both" or "first" (residual output unused); sources: what produced the call's
    activation operands (_source)."""
    import math

    out = []
    for n in H.fused_nodes(graph):
        x, _, _, shared, residual, _w, eps, wb, rsf = n.args[:9]
        used = sorted(u.args[1] for u in n.users)
        outputs = {(0, 1): "both", (0,): "first"}.get(tuple(used), str(used))
        sources = (_source(x),) if shared is None else (_source(x), _source(shared))
        if _is_zeros(residual):
            kind = "first_layer"
        elif shared is None:
            kind = "plain" if rsf == 1.0 else "scaled"
        elif rsf == 1.0:
            kind = "shared"
        elif math.isclose(rsf, routed_scaling, rel_tol=1e-6):
            kind = "scaled_shared"
        elif math.isclose(rsf, 1.0 / routed_scaling, rel_tol=1e-6):
            kind = "shared_scaled"
        else:
            kind = f"shared*{rsf}"
        out.append((kind, outputs, sources, eps, wb))
    return sorted(out, key=str)
