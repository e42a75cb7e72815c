"""Set-up shared by the tests against the real vLLM package: lane A vLLM 0.26.0 with torch 2.11
(requirements-vllm.txt), lane B vLLM 0.34.0 with torch 2.14 (requirements-vllm-0.34.txt).

Everything runs on the CPU in one process with vLLM's distributed state for a world of one rank
(gloo). Modules call vLLM's real ops the way vLLM's decoder layers do, with one deliberate
difference: vLLM's GroupCoordinator.all_reduce returns its input unchanged when the group has one
rank, so a TP=1 graph holds no all-reduce at all. The modules here call
torch.ops.vllm.all_reduce(x, group_name=...) directly, exactly as GroupCoordinator.all_reduce does
for TP > 1, and the group gets vLLM's base device communicator (torch.distributed.all_reduce over
the one-rank gloo group, i.e. the identity) so that the original graph runs too.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

# vLLM's ModelConfig asks the Hugging Face hub about the model unless told it is offline; the
# tests' models are local config.json files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The arfuse communicators' capacity in the tests, and vLLM's max_num_batched_tokens where the
# test sets it (the compile range is then [1, MAX_TOKENS]).
MAX_TOKENS = 64


_NO_VLLM = "vLLM is not installed (scripts/install-vllm.sh installs the pinned release)"


def _no_vllm_reason() -> str:
    """Why vLLM is absent: scripts/install-vllm.sh leaves a note in the environment when it gave up
    for lack of disk space; otherwise nobody installed it."""
    try:
        return (Path(sys.prefix) / ".arfuse-vllm-skipped").read_text().strip() or _NO_VLLM
    except OSError:
        return _NO_VLLM


def require_vllm() -> Any:
    """At a test module's top: skips the module unless the real vLLM package is importable."""
    try:
        import vllm
    except ImportError:
        pytest.skip(_no_vllm_reason(), allow_module_level=True)
    # Without vLLM installed, `import vllm` can find this very folder (tests/vllm) as a namespace
    # package; the real one has a version.
    if getattr(vllm, "__version__", None) is None:
        pytest.skip(_no_vllm_reason(), allow_module_level=True)
    return vllm


def require_arfuse() -> Any:
    """At a test module's top: skips the module unless arfuse's compiled library loads."""
    import arfuse

    if not arfuse.is_built():
        from arfuse import _lib

        pytest.skip(
            f"arfuse's compiled library is not usable here (torch {torch.__version__}): "
            f"{getattr(_lib, '_error', None) or arfuse.library_path() + ' not loadable'}",
            allow_module_level=True,
        )
    return arfuse


# ---- vLLM's FP8 quant kernels, on the CPU --------------------------------------------------------

_quant_lib: Any = None

# Schemas as vLLM 0.26.0's kernel library (_C_stable_libtorch.abi3.so) declares them.
_QUANT_SCHEMAS = {
    "static_scaled_fp8_quant": (
        "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
        "int[]? group_shape=None) -> ()"
    ),
    "dynamic_per_token_scaled_fp8_quant": (
        "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, "
        "Tensor? scale_ub) -> ()"
    ),
    # The same in 0.26.0 and 0.34.0 (the space before ")" is vLLM's).
    "per_token_group_fp8_quant": (
        "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, "
        "int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, "
        "bool dummy_is_scale_transposed, bool dummy_is_tma_aligned ) -> ()"
    ),
}


def cpu_quant_ops() -> None:
    """Stand-ins for vLLM's FP8 quant kernels torch.ops._C.static_scaled_fp8_quant,
    _C.dynamic_per_token_scaled_fp8_quant and _C.per_token_group_fp8_quant where the kernel library is not loaded (no GPU driver):
    the same schemas, CPU implementations of vLLM's semantics (x * (1 / scale), clamped to
    +-448; per-token scale max(amax, ...) / 448 with vLLM's lower bound 1 / (448 * 512)). They let
    vLLM's own code path for the custom quant op (QuantFP8.forward_cuda ->
    vllm._custom_ops.scaled_fp8_quant) run and be traced. Defined once per process, and only
    for the ops that are missing."""
    global _quant_lib
    missing = [n for n in _QUANT_SCHEMAS if not hasattr(torch.ops._C, n)]
    if not missing:
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def static(result, input, scale, group_shape=None):
        y = input.float() * scale.float().reciprocal()
        result.copy_(y.clamp(-fp8_max, fp8_max).to(result.dtype))

    def per_token(result, input, scale, scale_ub=None):
        amax = input.float().abs().amax(dim=-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub.float())
        s = (amax / fp8_max).clamp(min=1.0 / (fp8_max * 512.0))
        scale.copy_(s.view(scale.shape))
        result.copy_((input.float() * s.reciprocal()).clamp(-fp8_max, fp8_max).to(result.dtype))

    def per_group(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0,
                  dummy_is_scale_transposed, dummy_is_tma_aligned):
        # vLLM's CUDA kernel (per_token_group_quant.cu) for finite inputs: amax over the group
        # starting from eps, y_s = amax / fp8_max in float32 (UE8M0: rounded up to a power of
        # two), q = clamp(x / y_s) (true division); the scale's layout is output_s's strides
        # (the kernel reads them; the two dummy flags are unused).
        x = input.float().reshape(-1, input.shape[-1] // group_size, group_size)
        amax = x.abs().amax(dim=-1).clamp(min=eps)
        s = amax / torch.tensor(fp8_max, dtype=torch.float32)
        if scale_ue8m0:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        q = (x / s.unsqueeze(-1)).clamp(fp8_min, fp8_max)
        output_s.copy_(s.reshape(output_s.shape))
        output_q.copy_(q.reshape(output_q.shape).to(output_q.dtype))

    impls = {"static_scaled_fp8_quant": static, "dynamic_per_token_scaled_fp8_quant": per_token,
             "per_token_group_fp8_quant": per_group}
    for name in missing:
        lib.define(_QUANT_SCHEMAS[name])
        lib.impl(name, impls[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"_C::{name}", lambda *args, **kwargs: None, lib=lib)
    _quant_lib = lib


# ---- models --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A model's config.json (only what vLLM's ModelConfig reads) and its MoE tail."""

    name: str
    config: dict[str, Any]
    hidden: int
    eps: float
    routed_scaling: float
    shared_experts: bool
    n_experts: int
    top_k: int


QWEN3_MOE = ModelSpec(
    name="qwen3-30b-a3b",
    config={
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    hidden=2048,
    eps=1e-6,
    routed_scaling=1.0,
    shared_experts=False,
    n_experts=8,
    top_k=2,
)

def zoo_spec(hidden: int = 256) -> ModelSpec:
    """A small model for the every-pattern graphs (the pass only reads hidden size and dtype)."""
    cfg = dict(QWEN3_MOE.config, hidden_size=hidden)
    return ModelSpec(
        name=f"zoo-h{hidden}",
        config=cfg,
        hidden=hidden,
        eps=1e-6,
        routed_scaling=2.5,
        shared_experts=True,
        n_experts=4,
        top_k=2,
    )


def zoo_spec_pow2() -> ModelSpec:
    """The every-pattern model with a routed scale that is a power of two. With 2.5, vLLM rounds
    `routed * 2.5` to bf16 before adding the shared output and arfuse does not, so residual_out
    differs by a bf16 step here and there (test_fusion_pass covers that arithmetic); and a
    normed value's difference is then many e4m3 steps for codes near zero (their steps are
    2^-9 * scale apart). A power-of-two scale is exact in bf16, so both graphs give the same
    residual_out and FP8 codes show the quant fold alone."""
    import dataclasses

    return dataclasses.replace(zoo_spec(), routed_scaling=4.0)


def model_dir(root: Path, spec: ModelSpec) -> Path:
    d = root / spec.name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(spec.config))
    return d


def vllm_config(
    root: Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    *,
    passes: dict[str, Any] | None = None,
    max_num_batched_tokens: int | None = None,
    device: str = "cpu",
    **compilation: Any,
) -> Any:
    """vLLM's config for `spec` on the CPU (or `device`); `passes` sets PassConfig fields,
    `compilation` CompilationConfig fields, `max_num_batched_tokens` the scheduler's (and so the
    end of vLLM's compile range)."""
    from vllm.config import (
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.config.compilation import PassConfig

    model_config = ModelConfig(
        model=str(model_dir(root, spec)),
        dtype=str(dtype).removeprefix("torch."),
        skip_tokenizer_init=True,
    )
    extra = {}
    if max_num_batched_tokens is not None:
        extra["scheduler_config"] = SchedulerConfig.default_factory(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=min(max_num_batched_tokens, 128),
            max_model_len=model_config.max_model_len,
            is_encoder_decoder=False,
        )
    return VllmConfig(
        model_config=model_config,
        **extra,
        device_config=DeviceConfig(device=device),
        compilation_config=CompilationConfig(
            pass_config=PassConfig(eliminate_noops=True, **(passes or {})), **compilation
        ),
    )


# ---- vLLM's distributed state (one rank) ---------------------------------------------------------

_group_name: str | None = None


def distributed_config(root: Path, spec: ModelSpec, dtype: torch.dtype, **extra: Any) -> Any:
    """vllm_config(root, spec, dtype, **extra) with vLLM's distributed state set up for it."""
    config = vllm_config(root, spec, dtype, **extra)
    ensure_distributed(config)
    return config


def init_norms(module: torch.nn.Module, g: torch.Generator, gates: bool = True) -> None:
    """Norm weights near their identity: 1 + N(0, 0.01) for RMSNorm, N(0, 0.01) for Gemma's;
    with `gates`, then every parameter named gate N(0, 1 / fan-in)."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    for m in module.modules():
        if isinstance(m, GemmaRMSNorm):
            m.weight.data = torch.randn(m.weight.shape, generator=g) * 0.1
        elif isinstance(m, RMSNorm):
            m.weight.data = 1.0 + torch.randn(m.weight.shape, generator=g) * 0.1
    for name, p in module.named_parameters() if gates else ():
        if name.split(".")[-1] == "gate":
            p.data = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5


def chain_inputs(spec: ModelSpec, n: int, tokens: int, dtype: torch.dtype,
                 seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(xs, rs): n activations and n residuals [tokens, hidden], N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, spec.hidden, generator=g).to(dtype) for _ in range(n)]
    rs = [torch.randn(tokens, spec.hidden, generator=g).to(dtype) for _ in range(n)]
    return xs, rs


class QuantChains(torch.nn.Module):
    """Every pattern of the pass, each on inputs of its own, its norm output quantized by
    `q(i, x)` (a list of the quant's outputs to return):

        all_reduce -> rms_norm, with and without the all-reduce output used;
        all_reduce -> fused_add_rms_norm, with and without the residual output used;
        the four MoE tails -> fused_add_rms_norm, and one without its residual output used.

    Needs MoE runners "zoo.shared" and "zoo.routed" (moe_runner)."""

    KINDS = ("scaled_shared", "shared_scaled", "shared", "scaled")
    N = 9

    def __init__(self, spec: ModelSpec, eps: float, gemma: bool) -> None:
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

        super().__init__()
        norm = GemmaRMSNorm if gemma else RMSNorm
        self.norms = torch.nn.ModuleList(norm(spec.hidden, eps=eps) for _ in range(self.N))
        self.gate = torch.nn.Parameter(torch.empty(spec.n_experts, spec.hidden))
        self.rsf = spec.routed_scaling
        self.shared = layer_name("zoo.shared")
        self.routed = layer_name("zoo.routed")

    def tail(self, y: torch.Tensor, kind: str) -> torch.Tensor:
        name = self.routed if kind == "scaled" else self.shared
        return moe_tail(
            y, self.gate, name, shared=kind != "scaled",
            routed_scaling=1.0 if kind == "shared" else self.rsf,
            form="shared_scaled" if kind == "shared_scaled" else "runner",
        )

    def q(self, i: int, x: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def chains(self, xs: Sequence[torch.Tensor], rs: Sequence[torch.Tensor]) -> tuple:
        out = []
        y = all_reduce(xs[0])
        out += self.q(0, self.norms[0](y)) + [y]  # rms_norm, both outputs
        out += self.q(1, self.norms[1](all_reduce(xs[1])))  # rms_norm, first only
        n, res = self.norms[2](all_reduce(xs[2]), rs[2])
        out += self.q(2, n) + [res]  # fused_add_rms_norm, both
        n, _ = self.norms[3](all_reduce(xs[3]), rs[3])
        out += self.q(3, n)  # fused_add_rms_norm, first only
        for i, kind in enumerate(self.KINDS, start=4):  # MoE tails, both outputs
            n, res = self.norms[i](self.tail(xs[i], kind), rs[i])
            out += self.q(i, n) + [res]
        n, _ = self.norms[8](self.tail(xs[8], "scaled_shared"), rs[8])
        out += self.q(8, n)  # MoE tail, first only
        return tuple(out)


def zoo_module_and_pass(config: Any, spec: ModelSpec, dtype: torch.dtype,
                        make: Callable[[], torch.nn.Module], communicator: Any) -> tuple:
    """(module, fusion): under `config`, the MoE runners "zoo.shared" and "zoo.routed"
    (moe_runner) the every-pattern modules call, the module make() builds, and the arfuse pass
    for `communicator`, asserted enabled."""
    from vllm.config import set_current_vllm_config

    from arfuse.vllm.fusion import ArfuseAllReduceFusionPass

    with set_current_vllm_config(config):
        moe_runner(config, "zoo.shared", spec, dtype, shared=True)
        moe_runner(config, "zoo.routed", spec, dtype, shared=False)
        module = make()
        fusion = ArfuseAllReduceFusionPass(config, communicator, all_reduce=True)
    assert not fusion.disabled, fusion.reason
    return module, fusion


def assert_tokens_symbolic(graph: torch.fx.Graph) -> None:
    """Traced as vLLM traces (dynamic=False, the token dimension marked dynamic): an input's
    token count is a symbol."""
    assert any(isinstance(d, torch.SymInt) for n in graph.nodes
               if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
               for d in n.meta["val"].shape), "the token count was not symbolic"


def module_and_pass(config: Any, make: Callable[[], torch.nn.Module], communicator: Any,
                    kernel: tuple[str, str]) -> tuple:
    """(module, fusion): under `config`, the module make() builds and the arfuse pass for
    `communicator`; skipped unless the pass has the kernel (kernel: (the pass's attribute, its
    name in arfuse's library))."""
    from vllm.config import set_current_vllm_config

    from arfuse.vllm.fusion import ArfuseAllReduceFusionPass

    with set_current_vllm_config(config):
        module = make()
        fusion = ArfuseAllReduceFusionPass(config, communicator, all_reduce=True)
    if not getattr(fusion, kernel[0]):
        pytest.skip(f"the arfuse library under test has no {kernel[1]} kernel")
    return module, fusion


def fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two FP8 tensors are, element by element (codes as signed
    magnitudes, so -0 and +0 are one value and the count runs across zero)."""

    def ordinal(x):
        u = x.contiguous().view(torch.uint8).to(torch.int32)
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)

    return (ordinal(a) - ordinal(b)).abs()


def assert_fp8_codes_close(got: torch.Tensor, want: torch.Tensor) -> int:
    """FP8 codes within one e4m3 step of want's, at least 90% of them equal; returns how many
    differ."""
    steps = fp8_steps(got, want)
    assert int(steps.max()) <= 1, f"FP8 codes {int(steps.max())} steps apart"
    assert (steps == 0).float().mean().item() >= 0.9, "FP8 codes mostly differ"
    return int((steps != 0).sum())


def passes_without_fp8(config: Any, make: Callable[[], torch.nn.Module], communicator: Any,
                       monkeypatch: Any, fp8_supported: Callable[..., bool]) -> tuple:
    """(module, with_fp8, no_kernel, switched_off): under `config`, the module make() builds and
    the arfuse pass three times: with arfuse's library as it is, with
    communicators.fp8_supported answering `fp8_supported` (a kernel missing), and with
    ARFUSE_VLLM_FP8=0."""
    from vllm.config import set_current_vllm_config

    from arfuse.vllm import communicators
    from arfuse.vllm.fusion import ArfuseAllReduceFusionPass

    with set_current_vllm_config(config):
        module = make()
        with_fp8 = ArfuseAllReduceFusionPass(config, communicator, all_reduce=True)
        monkeypatch.setattr(communicators, "fp8_supported", fp8_supported)
        no_kernel = ArfuseAllReduceFusionPass(config, communicator, all_reduce=True)
        monkeypatch.undo()
        monkeypatch.setenv("ARFUSE_VLLM_FP8", "0")
        switched_off = ArfuseAllReduceFusionPass(config, communicator, all_reduce=True)
    return module, with_fp8, no_kernel, switched_off


def compile_every_pattern(config: Any, spec: ModelSpec, dtype: torch.dtype,
                          make: Callable[[], torch.nn.Module], communicator: Any,
                          kernel: tuple[str, str], args: Sequence[torch.Tensor],
                          compile_fn: Callable[..., Any]) -> tuple[Any, Any, Any]:
    """(fusion, want, got) for an every-pattern module (zoo_module_and_pass): skipped unless
    the pass has the kernel (kernel: (the pass's attribute, its name in arfuse's library)); run
    uncompiled (want) and by compile_fn(module, args, config, fusion) (got), traced with the
    token count a symbol, no all-reduce or norm left."""
    module, fusion = zoo_module_and_pass(config, spec, dtype, make, communicator)
    if not getattr(fusion, kernel[0]):
        pytest.skip(f"the arfuse library under test has no {kernel[1]} kernel for {dtype}")
    want = run_eager(module, args, config)
    got = compile_fn(module, args, config, fusion)
    assert_tokens_symbolic(got.before)
    assert count(got.after, "vllm::all_reduce") == 0
    assert count(got.after, "vllm_ir::rms_norm") + count(got.after,
                                                         "vllm_ir::fused_add_rms_norm") == 0
    return fusion, want, got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed(config: Any) -> str:
    """vLLM's world/TP groups for one rank on gloo (once per process); returns the TP group name."""
    global _group_name
    if _group_name is not None:
        return _group_name
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    with set_current_vllm_config(config):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                local_rank=0,
                backend="gloo",
            )
            ps.initialize_model_parallel(1)
    class OutOfPlace(DeviceCommunicatorBase):
        # The base class reduces in place and returns its input, which torch.ops.vllm.all_reduce
        # (an out-of-place op) must not: vLLM's GPU communicators return a new tensor.
        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            return super().all_reduce(input_.clone())

    tp = ps.get_tp_group()
    if tp.device_communicator is None:
        tp.device_communicator = OutOfPlace(
            tp.cpu_group, tp.device, tp.device_group, tp.unique_name
        )
    _group_name = tp.unique_name
    return _group_name


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """What vLLM's GroupCoordinator.all_reduce puts in the graph for TP > 1."""
    assert _group_name is not None
    return torch.ops.vllm.all_reduce(x, group_name=_group_name)


# ---- an MoE layer behind vLLM's moe_forward ops ---------------------------------------------------


def _runner_class() -> type:
    """A MoERunnerInterface whose _forward_impl computes a dense top-k MoE with PyTorch.

    vLLM's torch.ops.vllm.moe_forward(_shared) look the layer up by name in the forward context
    and call its _forward_impl; the real runners need vLLM's compiled MoE kernels, which the CUDA
    wheel cannot load without a GPU driver. Only _forward_impl is called.
    """
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
        MoERunnerInterface,
    )

    def unused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("not used by the tests")

    def __init__(self, name, hidden, n_experts, top_k, inter, shared, dtype, renormalize):
        MoERunnerInterface.__init__(self)
        self.layer_name = name
        self.top_k = top_k
        self.renormalize = renormalize
        # zlib.crc32, not hash(): str hashes change with PYTHONHASHSEED from run to run.
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))

        def param(*shape: int, std: float) -> torch.nn.Parameter:
            t = torch.randn(*shape, generator=g, dtype=torch.float32) * std
            return torch.nn.Parameter(t.to(dtype), requires_grad=False)

        self.w13 = param(n_experts, 2 * inter, hidden, std=hidden**-0.5)
        self.w2 = param(n_experts, hidden, inter, std=inter**-0.5)
        self.shared13 = param(2 * inter, hidden, std=hidden**-0.5) if shared else None
        self.shared2 = param(hidden, inter, std=inter**-0.5) if shared else None

    def _mlp(x, w13, w2):
        gate, up = (x.float() @ w13.float().t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2.float().t()

    def _forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids):
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for e in range(self.w13.shape[0]):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel():
                y = _mlp(hidden_states[tok], self.w13[e], self.w2[e])
                out.index_add_(0, tok, y * weights[tok, slot, None])
        fused = out.to(hidden_states.dtype)
        if self.shared13 is None:
            return fused
        shared = _mlp(hidden_states, self.shared13, self.shared2).to(hidden_states.dtype)
        return shared, fused

    namespace = {name: unused for name in MoERunnerInterface.__abstractmethods__}
    namespace.update(__init__=__init__, _forward_impl=_forward_impl)
    return type("DenseTestMoERunner", (MoERunnerInterface,), namespace)


_RUNNER: type | None = None


def moe_runner(config: Any, name: str, spec: ModelSpec, dtype: torch.dtype, shared: bool) -> Any:
    """A runner registered in `config` under `name`, as MoERunner registers itself."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = _runner_class()
    runner = _RUNNER(
        name, spec.hidden, spec.n_experts, spec.top_k, 32, shared, dtype, renormalize=True
    )
    cc = config.compilation_config
    cc.static_forward_context[name] = runner
    cc.static_all_moe_layers.append(name)
    return runner


def layer_name(name: str) -> Any:
    from vllm.utils.torch_utils import _USE_LAYERNAME, LayerName

    return LayerName(name) if _USE_LAYERNAME else name


def moe_tail(
    h: torch.Tensor,
    gate: torch.Tensor,
    name: Any,
    *,
    shared: bool,
    routed_scaling: float,
    form: str = "runner",
) -> torch.Tensor:
    """MoERunner.forward (vllm/model_executor/layers/fused_moe/runner/moe_runner.py, 0.26.0)
    from the moe_forward op on: routed scale, shared add, final all-reduce.

    form "runner" follows its code (`fused *= rsf`, or for fp16 with shared experts
    `shared *= 1/rsf`); "shared_scaled" forces the fp16 branch for any dtype.
    """
    router_logits = torch.nn.functional.linear(h, gate)
    if shared:
        shared_out, fused_out = torch.ops.vllm.moe_forward_shared(
            h, router_logits, None, None, name, 0
        )
    else:
        fused_out = torch.ops.vllm.moe_forward(h, router_logits, None, None, name, 0)
        shared_out = None
    if routed_scaling != 1.0:
        fp16_branch = form == "shared_scaled" or fused_out.dtype == torch.float16
        if not fp16_branch or shared_out is None:
            fused_out *= routed_scaling
        else:
            shared_out *= 1.0 / routed_scaling
    result = shared_out + fused_out if shared_out is not None else fused_out
    return all_reduce(result)


# ---- running vLLM's pass manager -----------------------------------------------------------------


def op_name(node: Any) -> str:
    target = getattr(node, "target", None)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return ""


def count(graph: torch.fx.Graph, name: str) -> int:
    return sum(1 for n in graph.nodes if op_name(n) == name)


def fused_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The arfuse.fused calls of a copy of the graph after dead-code elimination (as vLLM's
    cleanup pass does next)."""
    graph = copy.deepcopy(graph)
    graph.eliminate_dead_code()
    return [n for n in graph.nodes if op_name(n) == "arfuse::fused"]


def fused_calls(graph: torch.fx.Graph) -> list[tuple[Any, ...]]:
    """(eps, weight_bias, routed_scaling, has shared, outputs used) of each arfuse.fused call,
    after dead-code elimination (as vLLM's cleanup pass does next)."""
    out = []
    for n in fused_nodes(graph):
        a = n.args
        used = sorted(u.args[1] for u in n.users)
        out.append((a[6], a[7], a[8], a[3] is not None, tuple(used)))
    return sorted(out)


def fp8_scale_args(graph: torch.fx.Graph) -> list[str | None]:
    """The fp8_scale argument of each arfuse.fused call (the node's name, None without one)."""
    return sorted(
        (str(n.args[9]) if n.args[9] is not None else None for n in graph.nodes
         if op_name(n) == "arfuse::fused"),
        key=str,
    )


class GraphRecorder:
    """Test instrumentation placed in vLLM's pass list: copies the graph at its position."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.Graph] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(copy.deepcopy(graph))

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        return True

    def uuid(self) -> str:
        return "arfuse-test-graph-recorder"


class _CudaOnlyStep:
    """vLLM's FixFunctionalizationPass starts by naming torch.ops._C.rotary_embedding, which the
    CUDA wheel's kernel library registers only where it loads (it needs the GPU driver,
    libcuda.so.1). Without it that step cannot run at all; it only rewrites auto_functionalized
    calls of vLLM's own kernels, none of which these graphs hold. Everything else of the pass
    manager runs as vLLM wrote it."""

    def __init__(self, step: Any) -> None:
        self.step = step

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> Any:
        return self.step.uuid()


@dataclass
class Compiled:
    output: Any
    before: torch.fx.Graph  # the graph as the arfuse pass received it
    after: torch.fx.Graph  # the graph as the arfuse pass left it
    pass_manager: Any
    timings: dict[str, float] = field(default_factory=dict)


class PassRecord:
    """What pass_added_by_plugin saw: the pass managers vLLM configured, the arfuse passes put
    into them, and the graph before and after the arfuse pass for every graph it ran on (one per
    piece of vLLM's split graph and compile range)."""

    def __init__(self) -> None:
        self.managers: list[Any] = []
        self.passes: list[Any] = []
        self._before = GraphRecorder()
        self._after = GraphRecorder()

    @property
    def graphs(self) -> list[tuple[torch.fx.Graph, torch.fx.Graph]]:
        assert len(self._before.graphs) == len(self._after.graphs)
        return list(zip(self._before.graphs, self._after.graphs))

    def instrument(self, manager: Any, added: Any) -> None:
        """Records the graph before and after `added`, a pass in manager's list."""
        i = manager.passes.index(added)
        manager.passes[i : i + 1] = [self._before, added, self._after]
        if not hasattr(torch.ops._C, "rotary_embedding"):
            manager.fix_functionalization = _CudaOnlyStep(manager.fix_functionalization)
        self.managers.append(manager)
        self.passes.append(added)


@contextlib.contextmanager
def pass_added_by_plugin(fusion_pass: Any = None, *, append: bool = False) -> Iterator[PassRecord]:
    """While active, every PostGradPassManager vLLM configures gets the arfuse pass right after
    vLLM's own configure, where the plugin's hook (arfuse.vllm.plugin, hook.configure) adds it:

    * fusion_pass None: the plugin's hook body itself, passes.configure_pass_manager (build_pass:
      ArfuseAllReduceFusionPass(config) in a GuardedPass, then add_pass). It asks
      communicators.get_communicator for the communicator; tests redirect that to a CPU one
      (redirect_plugin_to);
    * a pass: put in by the plugin's add_pass, or with append by vLLM's own
      PostGradPassManager.add (after vLLM's passes, as VllmBackend.configure_post_pass adds the
      post_grad_custom_post_pass slot's object).

    Around the arfuse pass, test instrumentation copies the graph before and after it."""
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    from arfuse.vllm import passes

    record = PassRecord()
    original = PostGradPassManager.configure

    def configure(self: Any, config: Any) -> None:
        original(self, config)
        if fusion_pass is None:
            added = passes.configure_pass_manager(self, config)
            assert added is not None, "the plugin added no arfuse pass"
        else:
            added = fusion_pass
            if append:
                self.add(fusion_pass)
            else:
                passes.add_pass(self, fusion_pass)
        record.instrument(self, added)

    with mock.patch.object(PostGradPassManager, "configure", configure):
        yield record


@contextlib.contextmanager
def recorded_when_vllm_adds(pass_: Any) -> Iterator[PassRecord]:
    """While active, when vLLM's own code puts `pass_` into a PostGradPassManager with
    PostGradPassManager.add (VllmBackend.configure_post_pass does so with the
    post_grad_custom_post_pass slot's object), test instrumentation copies the graph before and
    after it."""
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    record = PassRecord()
    original = PostGradPassManager.add

    def add(self: Any, added: Any) -> None:
        original(self, added)
        if added is not pass_:
            return
        record.instrument(self, added)

    with mock.patch.object(PostGradPassManager, "add", add):
        yield record


@contextlib.contextmanager
def redirect_plugin_to(communicator: Any) -> Iterator[None]:
    """The plugin's pass gets `communicator` (arfuse's world-size-1 CPU communicator) from
    communicators.get_communicator, and the pass compares it with that world size instead of vLLM's
    tensor-parallel size (which the tests force to 2 so that vLLM emits its all-reduce; no
    communicator of 2 ranks exists in one CPU process)."""
    from unittest import mock

    from arfuse.vllm import communicators, fusion

    world = int(communicator.world_size)
    with mock.patch.object(communicators, "get_communicator", lambda config, create=True: communicator), \
            mock.patch.object(fusion, "get_tensor_model_parallel_world_size", lambda: world):
        yield


# How compile_with_pass_manager traces: "vllm" as vLLM's TorchCompileWithNoGuardsWrapper and
# @support_torch_compile do (torch.compile(dynamic=False) with the token dimension, dim 0 of
# every input, marked by torch._dynamo.mark_dynamic: T is a symbol, Python scalars such as a
# routed scaling factor stay constants); "dynamic": torch.compile(dynamic=True) (everything
# dynamic, Python floats included); "static": dynamic=False without marks (T fixed).
TRACE_MODES = ("vllm", "dynamic", "static")


def compile_with_pass_manager(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    config: Any,
    fusion_pass: Any,
    *,
    compile_range: tuple[int, int],
    mode: str = "vllm",
    append: bool = False,
) -> Compiled:
    """torch.compile `module` with Inductor and vLLM's PostGradPassManager (configured from
    `config`, the arfuse pass added as pass_added_by_plugin says), as vLLM's backend sets them up:
    the IR functionalization pass pre-grad, the pass manager post-grad, inside vLLM's pass
    context for `compile_range`; traced as `mode` says (TRACE_MODES). Returns the output of one
    call and the graph around the pass. (The tests on vLLM's model classes compile through
    vLLM's own decorator and VllmBackend instead: decoder_models.)
    append: the pass goes in with vLLM's own PostGradPassManager.add (after vLLM's passes), as
    VllmBackend.configure_post_pass adds the post_grad_custom_post_pass slot's object."""
    from torch._inductor.compile_fx import compile_fx
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import (
        VllmIRInplaceFunctionalizationPass,
    )
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range
    from vllm.env_override import _apply_constrain_to_fx_strides_patch
    from vllm.forward_context import set_forward_context

    if mode not in TRACE_MODES:
        raise ValueError(f"mode={mode!r}: want one of {TRACE_MODES}")
    # vLLM's Inductor adaptor applies this before each compile (opaque LayerName arguments of
    # the moe_forward ops; pytorch/pytorch#175973).
    _apply_constrain_to_fx_strides_patch()
    with pass_added_by_plugin(fusion_pass, append=append) as record, \
            set_current_vllm_config(config):
        pm = PostGradPassManager()
        pm.configure(config)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        patches = {
            "post_grad_custom_post_pass": pm,
            "pre_grad_custom_pass": VllmIRInplaceFunctionalizationPass(config),
            "force_disable_caches": True,
            # vLLM's CompilationConfig turns auto-functionalization v2 off for its fusion passes
            # (mutating ops then reach the passes as auto_functionalized, v1).
            **{
                k: v
                for k, v in config.compilation_config.inductor_compile_config.items()
                if k == "enable_auto_functionalized_v2"
            },
        }
        with pass_context(Range(*compile_range)):
            return compile_fx(gm, example_inputs, config_patches=patches)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=mode == "dynamic")
    args = [a.clone() for a in args]
    if mode == "vllm":
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
    with set_current_vllm_config(config), set_forward_context(None, config), torch.no_grad():
        output = compiled(*args)
    assert record.graphs, "vLLM's pass manager never reached the arfuse pass"
    before, after = record.graphs[-1]
    return Compiled(output, before, after, pm)


def run_eager(module: torch.nn.Module, args: Sequence[torch.Tensor], config: Any) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(config), set_forward_context(None, config), torch.no_grad():
        return module(*[a.clone() for a in args])
