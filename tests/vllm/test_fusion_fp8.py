"""The arfuse fusion pass with vLLM's static per-tensor FP8 quantization (kFp8StaticTensorSym)
after the norm, run by vLLM 0.26.0's PostGradPassManager under Inductor on the CPU with world
size 1, like test_fusion_pass.py.

The quant is vLLM's own QuantFP8 layer (what an FP8 linear layer with a static activation scale
calls on its input), in both forms vLLM compiles: custom ops off (vLLM's default under Inductor;
QuantFP8.forward_native, aten ops in the graph) and "+quant_fp8" (QuantFP8.forward_cuda ->
vllm._custom_ops.scaled_fp8_quant -> torch.ops._C.static_scaled_fp8_quant, with the CPU
stand-in of vllm_harness.cpu_quant_ops). The scale is a parameter of the module, so a graph input,
as an FP8 layer's input_scale is in vLLM's graphs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import vllm_harness as H

H.require_vllm()
H.require_arfuse()
H.cpu_quant_ops()

from vllm.compilation.passes.vllm_inductor_pass import VllmPatternMatcherPass  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape  # noqa: E402


FP8 = torch.float8_e4m3fn
MAX_TOKENS = 64  # the communicators' capacity (tests/vllm/conftest.py)
T = 7
DTYPE = torch.bfloat16
STATIC_QUANT = "_C::static_scaled_fp8_quant"
PER_TOKEN_QUANT = "_C::dynamic_per_token_scaled_fp8_quant"
# Scales of the FP8 layers: the smallest saturates part of each norm output (|norm| > 448 s).
SCALES = (0.004, 0.01, 0.02, 0.05)


# root, comms: tests/vllm/conftest.py


def setup(root, spec, custom_quant: bool):
    """vLLM's config; custom_quant turns vLLM's quant_fp8 custom op on (the kernel form).

    With the custom op on, vLLM also turns on its own RMSNorm + quant fusion passes; they run
    after the arfuse pass, and their module cannot be imported without vLLM's CUDA kernels, so
    they are switched off here."""
    extra = {}
    if custom_quant:
        extra = {
            "custom_ops": ["+quant_fp8"],
            "passes": {"fuse_norm_quant": False, "fuse_act_quant": False},
        }
    return H.distributed_config(root, spec, DTYPE, **extra)


def init_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    H.init_norms(module, torch.Generator().manual_seed(seed))
    scales = {n: p.data.clone() for n, p in module.named_parameters() if "scales." in n}
    module = module.to(DTYPE)
    for name, p in module.named_parameters():
        if name in scales:  # FP8 input scales stay float32, as in vLLM
            p.data = scales[name]
    return module.requires_grad_(False)


def ops(graph) -> Counter:
    return Counter(H.op_name(n) or str(n.target) for n in graph.nodes if n.op == "call_function")


def quant_ops(graph) -> Counter:
    """The static / per-token quant operations in a graph, either form."""
    c = Counter()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = H.op_name(n)
        if name == "prims::convert_element_type" and n.args[1] == FP8:
            c["native"] += 1
        elif n.args and isinstance(n.args[0], torch._ops.OpOverload):  # auto_functionalized
            op = n.args[0]._schema.name
            if op in (STATIC_QUANT, PER_TOKEN_QUANT):
                c[op] += 1
    return c


def assert_outputs_match(got, want):
    """FP8 codes within one e4m3 step of the unfused graph's (the fused call quantizes the
    float32 norm, vLLM the norm rounded to bf16: fold_static_fp8_quant), nearly all identical;
    other outputs (bf16 residuals, the float32 per-token scales of a quant left in place, which
    follow the bf16 norm) within torch's bf16 tolerance."""
    assert len(got) == len(want)
    codes = off = 0
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.dtype == FP8:
            codes += w.numel()
            off += H.assert_fp8_codes_close(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-5)
    print(f"FP8 codes one e4m3 step from the unfused graph's: {off} of {codes}")


def compile_(module, args, config, fusion, **kw):
    table = VllmPatternMatcherPass.match_table
    before = (table[fusion.pass_name], table[f"{fusion.pass_name}.static_fp8"])
    got = H.compile_with_pass_manager(
        module, args, config, fusion, compile_range=(1, MAX_TOKENS), **kw
    )
    got.counted = (
        table[fusion.pass_name] - before[0],
        table[f"{fusion.pass_name}.static_fp8"] - before[1],
    )
    return got


# ---- every pattern, followed by the static quant -------------------------------------------------


class Chains(H.QuantChains):
    """Every pattern of the pass, each on inputs of its own, its norm output quantized by vLLM's
    static per-tensor QuantFP8 with an FP8 layer's float32 input scale:

        all_reduce -> rms_norm (first layer), with and without the all-reduce output used;
        all_reduce -> fused_add_rms_norm, with and without the residual output used;
        the four MoE tails -> fused_add_rms_norm (both outputs), and one at the end of a chain.
    """

    N_CHAINS = H.QuantChains.N

    def __init__(self, spec, eps, gemma):
        super().__init__(spec, eps, gemma)
        self.scales = torch.nn.ParameterList(
            torch.nn.Parameter(torch.tensor(SCALES[i % len(SCALES)]), requires_grad=False)
            for i in range(self.N)
        )
        self.quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)

    def q(self, i, x):
        return [self.quant(x, self.scales[i])[0]]

    def forward(self, xs, rs):
        return self.chains(xs, rs)


def chain_inputs(spec, n, seed=1):
    return H.chain_inputs(spec, n, T, DTYPE, seed)


class Flat(torch.nn.Module):
    """Takes the chains' inputs as separate arguments (what torch.compile marks dynamic)."""

    def __init__(self, inner, n):
        super().__init__()
        self.inner, self.n = inner, n

    def forward(self, *args):
        return self.inner(list(args[: self.n]), list(args[self.n :]))


@pytest.mark.parametrize(
    "form,gemma,eps",
    [
        ("native", False, 1e-6),
        ("native", True, 1e-5),
        ("custom", False, 1e-5),
        ("custom", True, 1e-6),
    ],
    ids=["native-rmsnorm", "native-gemma", "custom-rmsnorm", "custom-gemma"],
)
def test_every_pattern_takes_the_static_quant(root, comms, form, gemma, eps):
    spec = H.zoo_spec_pow2()
    config = setup(root, spec, custom_quant=form == "custom")
    n = Chains.N_CHAINS
    xs, rs = chain_inputs(spec, n)
    fusion, want, got = H.compile_every_pattern(
        config, spec, DTYPE,
        lambda: Flat(init_(Chains(spec, eps, gemma), seed=int(eps * 1e7) + gemma), n),
        comms(spec), ("fp8", "fp8_static"), xs + rs, compile_)
    before, after = got.before, got.after

    quant = "native" if form == "native" else STATIC_QUANT
    assert quant_ops(before) == Counter({quant: n})
    assert not quant_ops(after), "a static quant was left in the graph"
    # Every call took its chain's scale (a graph input) as fp8_scale.
    scales = H.fp8_scale_args(after)
    assert len(scales) == n and None not in scales
    placeholders = {str(p) for p in after.nodes if p.op == "placeholder"}
    assert set(scales) <= placeholders and len(set(scales)) == n
    assert (fusion.matched_count, fusion.fp8_count) == (n, n)
    assert got.counted == (n, n)  # what the pass adds to vLLM's match table
    # Nothing of the quant is left over (Gemma's weight + 1 and the MoE arithmetic are gone too).
    left = ops(after)
    for name in ("aten::reciprocal", "aten::clamp_min", "aten::clamp_max", "aten::empty"):
        assert left[name] == 0, (name, left)

    assert_outputs_match(got.output, want)


# ---- what stays unfused --------------------------------------------------------------------------


class OneChain(torch.nn.Module):
    """all_reduce -> fused_add_rms_norm, then a quant in one of the forms the pass must leave
    alone (or, "static", the one it folds)."""

    def __init__(self, spec, variant):
        super().__init__()
        self.variant = variant
        self.norm = RMSNorm(spec.hidden, eps=1e-6)
        self.scales = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.tensor(0.01), requires_grad=False)]
        )
        self.static = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
        self.per_token = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)

    def forward(self, x, r):
        n, res = self.norm(H.all_reduce(x), r)
        s = self.scales[0]
        v = self.variant
        if v == "static":
            return self.static(n, s)[0], res
        if v == "per_token":  # dynamic per-token scales (kFp8DynamicTokenSym)
            q, scale = self.per_token(n)
            return q, scale, res
        if v == "computed_scale":  # the scale is computed in the graph, not an input
            return self.static(n, s * 2.0)[0], res
        if v == "scale_from_activation":  # a per-tensor scale derived from an activation
            return self.static(n, (x.float().abs().amax() / 448.0).clamp(min=1e-6))[0], res
        if v == "quant_of_residual":
            return n, self.static(res, s)[0]
        if v == "quant_of_other":  # the norm output, changed before the quant
            return self.static(n * 0.5, s)[0], res
        if v == "norm_also_read":  # the norm output is read in bf16 too
            return self.static(n, s)[0], n, res
        raise AssertionError(v)


UNFUSED = [
    ("per_token", "native"),
    ("per_token", "custom"),
    ("computed_scale", "native"),
    ("computed_scale", "custom"),
    ("scale_from_activation", "native"),
    ("quant_of_residual", "native"),
    ("quant_of_other", "native"),
    ("norm_also_read", "native"),
    ("norm_also_read", "custom"),
]


@pytest.mark.parametrize("variant,form", UNFUSED, ids=[f"{v}-{f}" for v, f in UNFUSED])
def test_other_quants_stay_separate(root, comms, variant, form):
    """The all-reduce and norm are still fused; the quant stays as it was."""
    spec = H.zoo_spec_pow2()
    config = setup(root, spec, custom_quant=form == "custom")
    module, fusion = H.module_and_pass(config, lambda: init_(OneChain(spec, variant)),
                                       comms(spec), ("fp8", "fp8_static"))
    args = chain_inputs(spec, 1)
    args = [args[0][0], args[1][0]]
    want = H.run_eager(module, args, config)
    got = compile_(module, args, config, fusion)

    q_before = quant_ops(got.before)
    assert q_before, "the graph has no quant to leave alone"
    if variant == "per_token":
        assert set(q_before) == {"native" if form == "native" else PER_TOKEN_QUANT}
    assert quant_ops(got.after) == q_before
    assert H.fp8_scale_args(got.after) == [None]
    assert (fusion.matched_count, fusion.fp8_count) == (1, 0)
    assert got.counted == (1, 0)
    assert H.count(got.after, "vllm::all_reduce") == 0
    assert_outputs_match(got.output, want)


def test_without_fp8_kernels_the_quant_stays(root, comms, monkeypatch):
    """No fp8_static kernel for the model in arfuse's library, or ARFUSE_VLLM_FP8=0: the pass
    fuses the all-reduce and norm and leaves the quant alone; its uuid says so."""
    spec = H.zoo_spec_pow2()
    config = setup(root, spec, custom_quant=False)
    module, with_fp8, no_kernel, switched_off = H.passes_without_fp8(
        config, lambda: init_(OneChain(spec, "static")), comms(spec), monkeypatch,
        lambda *a: False)
    if not with_fp8.fp8:
        pytest.skip("the arfuse library under test has no fp8_static kernel for bf16")
    assert not no_kernel.fp8 and not switched_off.fp8
    assert no_kernel.uuid() == switched_off.uuid() != with_fp8.uuid()
    args = chain_inputs(spec, 1)
    args = [args[0][0], args[1][0]]
    want = H.run_eager(module, args, config)

    got = compile_(module, args, config, with_fp8)
    assert len(H.fp8_scale_args(got.after)) == 1 and None not in H.fp8_scale_args(got.after)
    assert (with_fp8.matched_count, with_fp8.fp8_count) == (1, 1)
    assert not quant_ops(got.after)
    assert_outputs_match(got.output, want)

    got = compile_(module, args, config, no_kernel)
    assert H.fp8_scale_args(got.after) == [None]
    assert (no_kernel.matched_count, no_kernel.fp8_count) == (1, 0)
    assert quant_ops(got.after) == quant_ops(got.before) == Counter({"native": 1})
    assert_outputs_match(got.output, want)
