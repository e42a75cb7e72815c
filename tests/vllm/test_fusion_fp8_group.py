"""The arfuse fusion pass with vLLM's dynamic per-token-group-128 FP8 quantization
(kFp8Dynamic128Sym, the input quant of FP8-block linear layers such as DeepSeek-V3's
fused_qkv_a_proj) after the norm, run by vLLM's PostGradPassManager under Inductor on the CPU with
world size 1, like test_fusion_fp8.py.

The quant is vLLM's own QuantFP8(static=False, GroupShape(1, 128)) layer, called as vLLM's
FP8-block linear kernels call it (Fp8BlockScaledMMLinearKernel.apply_weights: on a
`view(-1, H)` of the input; DeepGEMM / CUTLASS: column_major_scales=True), with vLLM's custom op
quant_fp8 on, as VllmConfig turns it on for every model with block weights. So the graph holds
what vLLM's real code path puts there on CUDA: QuantFP8.forward_cuda ->
fp8_utils.per_token_group_quant_fp8 -> torch.ops._C.per_token_group_fp8_quant (the CUDA branch
taken by telling fp8_utils the platform is CUDA-alike; the kernel is vllm_harness.cpu_quant_ops's
CPU stand-in with the CUDA kernel's formula). A whole FP8-block decoder layer is not built here:
vLLM's FP8-block GEMMs (Triton, DeepGEMM, CUTLASS) have no CPU path.
"""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch

import vllm_harness as H

H.require_vllm()
H.require_arfuse()
H.cpu_quant_ops()

from vllm.compilation.passes.vllm_inductor_pass import VllmPatternMatcherPass  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8  # noqa: E402
from vllm.model_executor.layers.quantization.utils import fp8_utils  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape  # noqa: E402

from arfuse import reference  # noqa: E402
from arfuse.vllm.fusion import ArfuseAllReduceFusionPass  # noqa: E402

FP8 = torch.float8_e4m3fn
MAX_TOKENS = 64  # the communicators' capacity (tests/vllm/conftest.py)
T = 7  # not a multiple of 4: TMA-aligned scale strides differ from column-major ones
DTYPE = torch.bfloat16
GROUP_QUANT = "_C::per_token_group_fp8_quant"
# How far the fused call's scales may be from the unfused graph's (relative): vLLM's amax is
# taken over the norm rounded to bf16 (rounded twice: the normalized value, then its product
# with the bf16 weight, each relative <= 2^-8), arfuse's over the float32 norm (or, unfolded,
# over arfuse's bf16 norm, rounded once).
SCALE_RTOL = 2.0**-7 + 2.0**-14


# root, comms: tests/vllm/conftest.py


class _CudaAlike:
    """vLLM's current platform, except that is_cuda_alike() is true: per_token_group_quant_fp8
    then calls the CUDA kernel (torch.ops._C.per_token_group_fp8_quant) as on a GPU, instead of
    its Triton fallback."""

    def __init__(self, platform):
        self._platform = platform

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._platform, name)


@pytest.fixture(autouse=True)
def cuda_kernel_path():
    with mock.patch.object(fp8_utils, "current_platform", _CudaAlike(fp8_utils.current_platform)):
        yield


def setup(root, spec, custom_quant: bool = True):
    """vLLM's config; custom_quant: vLLM's quant_fp8 custom op on (what VllmConfig does for
    block-quantized models). vLLM's own norm + quant fusion runs after the arfuse pass and needs
    vLLM's CUDA kernels to import, so it is off here."""
    extra = {"passes": {"fuse_norm_quant": False, "fuse_act_quant": False}}
    if custom_quant:
        extra["custom_ops"] = ["+quant_fp8"]
    return H.distributed_config(root, spec, DTYPE, **extra)


def group_quant(**kw) -> QuantFP8:
    return QuantFP8(static=False, group_shape=GroupShape(1, 128), **kw)


def init_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    H.init_norms(module, torch.Generator().manual_seed(seed))
    return module.to(DTYPE).requires_grad_(False)


def quant_nodes(graph) -> list[tuple[str, tuple]]:
    """The group quants in a graph, each as (op, its arguments by name) with the graph nodes by
    their target, so that two graphs' quants compare equal when built alike."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and n.args and isinstance(n.args[0], torch._ops.OpOverload):
            if n.args[0]._schema.name == GROUP_QUANT:
                kw = tuple(sorted((k, str(v.target) if isinstance(v, torch.fx.Node) else v)
                                  for k, v in n.kwargs.items() if k != "input"))
                out.append((GROUP_QUANT, kw))
    return out


def dynamic_calls(graph) -> list[tuple]:
    """(group_size, scale_ub, col_major_scales, ue8m0) of each arfuse.fused_fp8_dynamic call."""
    return [tuple(n.args[9:13]) for n in graph.nodes
            if H.op_name(n) == "arfuse::fused_fp8_dynamic"]


def before_permutes(graph) -> int:
    return sum(1 for x in graph.nodes if H.op_name(x) == "aten::permute")


def assert_outputs_match(got, want):
    """Every element: FP8 codes within one e4m3 step of the unfused graph's, nearly all the
    same; float32 scales (same shape and strides) within SCALE_RTOL; bf16 residuals within
    torch's bf16 tolerance (fp8_fold.Group128Quant says why: arfuse quantizes the float32 norm,
    vLLM the norm rounded to bf16). Not folded: the same quant of a norm that may differ by a
    bf16 rounding, so the same bounds."""
    assert len(got) == len(want)
    codes = off = 0
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        if w.dtype == FP8:
            codes += w.numel()
            off += H.assert_fp8_codes_close(g, w)
        elif w.dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=SCALE_RTOL, atol=0)
        else:
            torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-5)
    print(f"FP8 codes one e4m3 step from the unfused graph's: {off} of {codes}")


def compile_(module, args, config, fusion):
    table = VllmPatternMatcherPass.match_table
    keys = (fusion.pass_name, f"{fusion.pass_name}.group128_fp8")
    before = [table[k] for k in keys]
    got = H.compile_with_pass_manager(module, args, config, fusion,
                                      compile_range=(1, MAX_TOKENS))
    got.counted = tuple(table[k] - b for k, b in zip(keys, before))
    return got


def inputs(spec, n, seed=1):
    xs, rs = H.chain_inputs(spec, n, T, DTYPE, seed)
    return xs + rs


# ---- every pattern, followed by the group quant ---------------------------------------------------


class Chains(H.QuantChains):
    """H.QuantChains, each norm output quantized per token and group of 128 as an FP8-block
    linear layer does (input viewed as [-1, H]), with the scales row-major (even chains) or
    column-major (odd chains: DeepGEMM / CUTLASS)."""

    def __init__(self, spec, eps, gemma):
        super().__init__(spec, eps, gemma)
        self.quants = torch.nn.ModuleList(
            group_quant(column_major_scales=i % 2 == 1) for i in range(self.N))

    def q(self, i, x):
        return list(self.quants[i](x.view(-1, x.shape[-1])))  # [codes, scales]

    def forward(self, *args):
        return self.chains(args[: self.N], args[self.N :])


@pytest.mark.parametrize("gemma,eps", [(False, 1e-6), (True, 1e-5)], ids=["rmsnorm", "gemma"])
def test_every_pattern_takes_the_group_quant(root, comms, gemma, eps):
    spec = H.zoo_spec_pow2()
    config = setup(root, spec)
    n = Chains.N
    fusion, want, got = H.compile_every_pattern(
        config, spec, DTYPE, lambda: init_(Chains(spec, eps, gemma), seed=int(eps * 1e7) + gemma),
        comms(spec), ("fp8_group128", "fp8_group128"), inputs(spec, n), compile_)
    before, after = got.before, got.after

    assert len(quant_nodes(before)) == n
    assert quant_nodes(after) == [], "a group quant was left in the graph"
    assert H.count(after, "arfuse::fused") == 0
    # One fused_fp8_dynamic call per chain, each with the scale layout its quant asked for.
    assert Counter(dynamic_calls(after)) == Counter(
        {(128, None, False, False): 5, (128, None, True, False): 4})
    assert (fusion.matched_count, fusion.fp8_count) == (n, n)
    assert fusion.fp8_counts == {"fp8_static": 0, "fp8_group128": n}
    assert got.counted == (n, n)
    # The quants' buffers are gone too (the permutes left are the MoE gates' weight transposes).
    left = Counter(H.op_name(x) for x in after.nodes if x.op == "call_function")
    assert left["aten::empty"] == 0 and left["aten::permute"] == before_permutes(before) - 4, left

    assert_outputs_match(got.output, want)


def test_codes_and_scales_are_vllms_formula_on_the_float32_norm(root, comms):
    """The fused call's codes and scales equal, bit for bit and in vLLM's layout, what vLLM's
    per-token-group quant (its CUDA kernel's formula: the stand-in) computes from the float32
    norm (arfuse.reference): the fold changes the quant's input precision, nothing else."""
    spec = H.zoo_spec_pow2()
    config = setup(root, spec)
    with set_current_vllm_config(config):
        module = init_(OneChain(spec, "fold_col"))
        fusion = ArfuseAllReduceFusionPass(config, comms(spec), all_reduce=True)
    if not fusion.fp8_group128:
        pytest.skip("the arfuse library under test has no fp8_group128 kernel for bf16")
    x, r = inputs(spec, 1)
    got = compile_(module, [x, r], config, fusion)
    assert dynamic_calls(got.after) == [(128, None, True, False)]
    q, scales, res = got.output
    norm, residual_out = reference.allreduce_add_rmsnorm(
        [x], r, module.norm.weight, 1e-6, 0.0, DTYPE)
    assert torch.equal(res, residual_out)
    want_q = torch.empty(T, spec.hidden, dtype=FP8)
    want_s = torch.empty(spec.hidden // 128, T, dtype=torch.float32).t()
    torch.ops._C.per_token_group_fp8_quant(norm.float(), want_q, want_s, 128, 1e-10, -448.0,
                                           448.0, False, True, False)
    assert scales.stride() == want_s.stride() == (1, T)
    assert torch.equal(scales, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


# ---- what stays unfolded -------------------------------------------------------------------------


class OneChain(torch.nn.Module):
    """all_reduce -> fused_add_rms_norm, then a group quant of the norm output in one of the forms
    the pass folds ("fold_row", "fold_col") or must leave alone."""

    def __init__(self, spec, variant):
        super().__init__()
        self.variant = variant
        self.norm = RMSNorm(spec.hidden, eps=1e-6)
        kw = {
            "fold_row": {},
            "fold_col": {"column_major_scales": True},
            "ue8m0": {"use_ue8m0": True, "column_major_scales": True},
            "tma_aligned": {"column_major_scales": True, "tma_aligned_scales": True},
            "native": {},
            "norm_also_read": {},
            "quant_of_residual": {},
        }[variant]
        self.quant = group_quant(**kw)

    def forward(self, x, r):
        n, res = self.norm(H.all_reduce(x), r)
        v = self.variant
        if v == "quant_of_residual":
            return (*self.quant(res.view(-1, res.shape[-1])), n)
        q, s = self.quant(n.view(-1, n.shape[-1]))
        if v == "norm_also_read":  # the norm output is read in bf16 too
            return q, s, n, res
        return q, s, res


UNFOLDED = ["ue8m0", "tma_aligned", "native", "norm_also_read", "quant_of_residual"]


@pytest.mark.parametrize("variant", UNFOLDED)
def test_other_quants_stay_as_built(root, comms, variant):
    """The all-reduce and norm are still fused (arfuse.fused); the quant stays exactly as vLLM
    built it: UE8M0 scales, TMA-aligned scales, QuantFP8's native group quant (custom op off: its
    scale floor differs from the kernel's eps), a norm output read elsewhere too, a quant of the
    residual."""
    spec = H.zoo_spec_pow2()
    config = setup(root, spec, custom_quant=variant != "native")
    module, fusion = H.module_and_pass(config, lambda: init_(OneChain(spec, variant)),
                                       comms(spec), ("fp8_group128", "fp8_group128"))
    args = inputs(spec, 1)
    want = H.run_eager(module, args, config)
    got = compile_(module, args, config, fusion)

    if variant == "native":
        # aten ops: an amax, a division, an e4m3 conversion; no kernel call to fold.
        assert quant_nodes(got.before) == []
        assert any(H.op_name(x) == "prims::convert_element_type" and x.args[1] == FP8
                   for x in got.after.nodes)
    else:
        assert len(quant_nodes(got.before)) == 1
    assert quant_nodes(got.after) == quant_nodes(got.before)
    assert dynamic_calls(got.after) == []
    assert H.count(got.after, "arfuse::fused") == 1
    assert (fusion.matched_count, fusion.fp8_count) == (1, 0)
    assert got.counted == (1, 0)
    assert_outputs_match(got.output, want)


def test_fp8_off_leaves_the_group_quant(root, comms, monkeypatch):
    """ARFUSE_VLLM_FP8=0, or no fp8_group128 kernel for the model: the quant stays; the uuid
    says which."""
    spec = H.zoo_spec_pow2()
    config = setup(root, spec)
    module, with_fp8, no_kernel, switched_off = H.passes_without_fp8(
        config, lambda: init_(OneChain(spec, "fold_row")), comms(spec), monkeypatch,
        lambda *a: len(a) < 5 or a[4] != "fp8_group128")
    if not with_fp8.fp8_group128:
        pytest.skip("the arfuse library under test has no fp8_group128 kernel for bf16")
    assert not no_kernel.fp8_group128 and not switched_off.fp8_group128
    assert len({with_fp8.uuid(), no_kernel.uuid(), switched_off.uuid()}) == 3
    args = inputs(spec, 1)
    want = H.run_eager(module, args, config)

    got = compile_(module, args, config, with_fp8)
    assert dynamic_calls(got.after) == [(128, None, False, False)]
    assert_outputs_match(got.output, want)
    for fusion in (no_kernel, switched_off):
        got = compile_(module, args, config, fusion)
        assert dynamic_calls(got.after) == []
        assert quant_nodes(got.after) == quant_nodes(got.before) != []
        assert (fusion.matched_count, fusion.fp8_count) == (1, 0)
        assert_outputs_match(got.output, want)
