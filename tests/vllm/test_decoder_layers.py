"""The arfuse pass on vLLM's real MoE decoder classes, compiled the way vLLM compiles them.

Qwen3MoeDecoderLayer, DeepseekV2DecoderLayer (DeepSeek-V3 config: MLA, sigmoid grouped routing,
one shared expert, routed scaling 2.5, first layer dense), MixtralDecoderLayer and gpt-oss's
TransformerBlock, inside their vLLM model classes, built small on the CPU as rank 0 of TP=2 and
compiled through vLLM's @support_torch_compile / VllmBackend with the arfuse pass added to vLLM's
PostGradPassManager (decoder_models says how, and what differs from a GPU deployment).

Each test checks which chains the pass replaced (kind, outputs used, and which ops produced the
operands), what is left of the all-reduces, norms and MoE tail arithmetic, and that the fused
model computes what the uncompiled, unfused model does, element by element, for three token
counts run through the one compiled graph."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch

import vllm_harness as H

H.require_vllm()
H.require_arfuse()

import decoder_models as D  # noqa: E402


AR = "vllm::all_reduce"
RMS = "vllm_ir::rms_norm"
ADD_RMS = "vllm_ir::fused_add_rms_norm"
FUSED = "arfuse::fused"
# Token counts run through the one compiled graph (vLLM's compile range is [1, MAX_TOKENS]):
# the first call compiles, the others reuse it (a prefill-sized batch, an odd one, one token).
TOKENS = (24, 7, 1)

# |fused - unfused| <= atol + rtol * |unfused| for every element. bf16 / fp16: a few units in
# the last place of outputs of unit RMS (arfuse adds and normalizes in float32, vLLM rounds to the
# model dtype in between; vLLM's own compiled graph differs from its eager run by as much);
# float32: rounding only.
TOLERANCES = {
    torch.bfloat16: (2**-6, 2**-5),
    torch.float16: (2**-8, 2**-7),
    torch.float32: (1e-5, 1e-5),
}


@pytest.fixture
def seed():
    """A fresh seed each run (weights and inputs); ARFUSE_TEST_SEED=<n> repeats a run."""
    value = int(os.environ.get("ARFUSE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed {value} (ARFUSE_TEST_SEED={value} repeats this run)")
    return value


def build_with_communicator(root, comms, case, dtype, seed):
    """vLLM's model for the case, and the world-size-1 CPU communicator the plugin's pass gets."""
    return D.build(root, case, dtype, seed), comms(D.spec_for(case, dtype), dtype)


def build_and_compile(root, comms, case, dtype, seed):
    """(built, run, want): the case's model compiled as vLLM compiles it with the arfuse pass and
    run on TOKENS (one compile, checked), and the uncompiled model's outputs on the same inputs."""
    built, comm = build_with_communicator(root, comms, case, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    arg_sets = [D.inputs(built, t, g) for t in TOKENS]
    want = [D.run_eager(built, a) for a in arg_sets]
    run = D.compile_and_run(built, comm, arg_sets)
    assert_symbolic_single_compile(built, run)
    return built, run, want


def ops(graph) -> Counter:
    return Counter(H.op_name(n) or str(n.target) for n in graph.nodes if n.op == "call_function")


def total(graphs, name) -> int:
    return sum(H.count(g, name) for g in graphs)


def expected_chains(case: D.ModelCase, dtype: torch.dtype) -> list[tuple]:
    """The chains of the case's graph (over all its pieces), as D.fused_chains names them.

    Every model: the embedding's all-reduce -> layer 0's input_layernorm (rms_norm, first layer),
    each layer's o_proj all-reduce -> post_attention_layernorm, each layer's MLP / MoE output ->
    the next layer's input_layernorm, the last one -> the final norm (residual output unused)."""
    eps = case.eps
    first = ("first_layer", "both", ("aten::where",), eps, 0.0)  # masked vocab-parallel lookup
    o_proj = "aten::addmm" if case is D.GPT_OSS else "aten::mm"  # gpt-oss's o_proj has a bias
    attn = [("plain", "both", (o_proj,), eps, 0.0)] * case.layers
    if case is D.DEEPSEEK_V3:
        dense = [("plain", "both", ("aten::mm",), eps, 0.0)]  # layer 0's DeepseekV2MLP
        shared = ("moe_forward_shared[1]", "moe_forward_shared[0]")
        moe = [("scaled_shared", "both", shared, eps, 0.0),
               ("scaled_shared", "first", shared, eps, 0.0)]
        return sorted([first, *attn, *dense, *moe], key=str)
    moe = [("plain", "both", ("moe_forward[0]",), eps, 0.0),
           ("plain", "first", ("moe_forward[0]",), eps, 0.0)]
    return sorted([first, *attn, *moe], key=str)


def assert_symbolic_single_compile(built, run) -> None:
    """One VllmBackend compilation for all token counts: one pass manager, one graph per piece
    of the split graph (the layers' attention ops split it), each with the token count a
    symbol. In the pass manager the arfuse pass runs after vLLM's NoOpEliminationPass (which
    removes DeepSeek's and Mixtral's no-op views and gpt-oss's [:, :hidden] slice between the
    all-reduce and the norm)."""
    assert len(run.record.managers) == 1
    names = [type(p).__name__ for p in run.record.managers[0].passes]
    print("vLLM's post-grad passes:", names)
    assert names.index("NoOpEliminationPass") < run.record.managers[0].passes.index(run.fusion)
    assert type(run.fusion).__name__ == "GuardedPass"  # what the plugin puts into vLLM's list
    assert type(run.fusion.inner).__name__ == "ArfuseAllReduceFusionPass"
    assert len(run.graphs) == built.case.layers + 1, "one graph per piece, one compile range"
    for before, _ in run.graphs:
        dims = [d for n in before.nodes if n.op == "placeholder"
                and isinstance(n.meta.get("val"), torch.Tensor) for d in n.meta["val"].shape]
        assert any(isinstance(d, torch.SymInt) for d in dims), "the token count is not symbolic"


def assert_only_replaced(run, removed: Counter) -> None:
    """Apart from the all-reduces and norms the pass replaced, no op of any piece changed but
    the MoE-tail arithmetic it folded in, `removed` in all."""
    folded = Counter()
    for before, after in run.graphs:
        b, a = ops(before), ops(after)
        # (aten::full and sym_size: the first layer's zero residual, made for the token count)
        for name in (AR, RMS, ADD_RMS, FUSED, "aten::full", "aten::sym_size",
                     "<built-in function getitem>"):
            b.pop(name, None)
            a.pop(name, None)
        assert not a - b, f"ops added: {a - b}"
        folded += b - a
    assert folded == removed, f"ops removed: {folded}, expected {removed}"


def assert_same_outputs(got, want, dtype, tokens=TOKENS) -> None:
    """Every element of every output within TOLERANCES[dtype] of the unfused model's."""
    rtol, atol = TOLERANCES[dtype]
    assert len(got) == len(want) == len(tokens)
    for tokens, g, w in zip(tokens, got, want):
        assert g.shape == w.shape == (tokens, w.shape[-1]) and g.dtype == w.dtype == dtype
        assert torch.isfinite(w).all() and w.abs().amax() > 0
        diff = (g.float() - w.float()).abs()
        bound = atol + rtol * w.float().abs()
        worst = (diff / bound).max().item()
        rel = (diff.norm() / w.float().norm()).item()
        print(f"T={tokens}: max |fused - unfused| {diff.max().item():.3g}, relative (norm) "
              f"{rel:.3g}, worst element at {worst:.2f} of the tolerance")
        bad = diff > bound
        assert not bad.any(), (
            f"T={tokens}: {int(bad.sum())} of {bad.numel()} elements beyond rtol={rtol} "
            f"atol={atol} (max difference {diff.max().item():.3g})"
        )


# bf16 for every model; float32 (rounding-level agreement) for the two MoE tails the pass treats
# differently: plain (Qwen3-MoE; Mixtral and gpt-oss have the same graph there) and scaled with
# shared experts (DeepSeek-V3).
CASE_DTYPES = [(c, torch.bfloat16) for c in D.CASES] + [
    (D.QWEN3_MOE, torch.float32), (D.DEEPSEEK_V3, torch.float32)
]


@pytest.mark.parametrize(
    "case,dtype", CASE_DTYPES,
    ids=[f"{c.name}-{str(d).removeprefix('torch.')}" for c, d in CASE_DTYPES],
)
def test_real_decoder_layers(root, comms, case, dtype, seed):
    built, run, want = build_and_compile(root, comms, case, dtype, seed)
    if case is D.DEEPSEEK_V3:  # the classes vLLM builds for DeepSeek-V3 on a GPU
        layers = list(built.model.layers)
        assert {type(m.self_attn).__name__ for m in layers} == {"DeepseekV2MLAAttention"}
        assert [type(m.mlp).__name__ for m in layers] == ["DeepseekV2MLP"] + [
            "DeepseekV2MoE"] * (case.layers - 1)
    befores = [b for b, _ in run.graphs]
    afters = [a for _, a in run.graphs]

    # What vLLM put in the graph: one all-reduce per chain, each before a norm.
    chains = expected_chains(case, dtype)
    assert total(befores, AR) == len(chains)
    assert total(befores, RMS) == 1 + case.norms_left
    assert total(befores, ADD_RMS) == len(chains) - 1
    # What the pass made of it.
    got = sorted((c for a in afters for c in D.fused_chains(a, case.routed_scaling)), key=str)
    assert got == chains
    assert (total(afters, AR), total(afters, ADD_RMS)) == (0, 0)
    assert total(afters, RMS) == case.norms_left  # q/k or MLA latent norms: no all-reduce
    assert total(afters, FUSED) == len(chains)
    moe_layers = case.layers - (1 if case is D.DEEPSEEK_V3 else 0)
    removed = Counter()
    if case.routed_scaling != 1.0:  # `routed * rsf` and `shared + routed` of each MoE layer
        removed = Counter({"aten::mul": moe_layers, "aten::add": moe_layers})
    assert_only_replaced(run, removed)

    assert_same_outputs(run.outputs, want, dtype)


# DeepSeek-V3 with one dense and one MoE layer: the scaled shared-expert tail once.
DEEPSEEK_V3_2L = dataclasses.replace(
    D.DEEPSEEK_V3, name="deepseek-v3-2l", config=dict(D.DEEPSEEK_V3.config, num_hidden_layers=2),
    norms_left=4,
)


def test_deepseek_fp16_overflow_scaling(root, comms, seed):
    """DeepSeek-V3 in float16: vLLM guards against fp16 overflow by scaling the shared experts'
    output by 1/rsf instead of the routed output by rsf (MoERunner), and by scaling every
    attention output and the dense MLP output by 1/rsf between their all-reduce and the next
    norm (DeepseekV2DecoderLayer.forward). The pass takes the MoE tails in their fp16 form
    (shared * (1/rsf) + routed) and the first layer; the chains with vLLM's multiply between the
    all-reduce and the norm match no pattern and stay as they are (the plain all-reduce + norm
    pattern has nothing in between)."""
    case, dtype = DEEPSEEK_V3_2L, torch.float16
    built, run, want = build_and_compile(root, comms, case, dtype, seed)
    afters = [a for _, a in run.graphs]

    shared = ("moe_forward_shared[0]", "moe_forward_shared[1]")  # x = shared, shared_out = routed
    assert sorted((c for a in afters for c in D.fused_chains(a, case.routed_scaling)), key=str) == [
        ("first_layer", "both", ("aten::where",), case.eps, 0.0),
        ("shared_scaled", "first", shared, case.eps, 0.0),
    ]
    # Left: the 2 attention and the dense MLP all-reduces, each -> mul(1/rsf) -> the norm.
    left = [n for a in afters for n in a.nodes if H.op_name(n) == AR]
    assert len(left) == case.layers + 1
    for node in left:
        (mul,) = node.users
        assert H.op_name(mul) == "aten::mul" and mul.args[1] == pytest.approx(1 / 2.5)
        assert [H.op_name(u) for u in mul.users] == [ADD_RMS]
    assert total(afters, ADD_RMS) == case.layers + 1
    assert_only_replaced(run, Counter({"aten::mul": 1, "aten::add": 1}))

    assert_same_outputs(run.outputs, want, dtype)


class _Forward(torch.nn.Module):
    """The model's forward(input_ids, positions) for torch.compile called directly."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions, None)


def test_trace_mode_decides_the_deepseek_scaled_match(root, comms, seed):
    """The same DeepSeek-V3 model through the same backend (Inductor with vLLM's pass manager
    and the plugin's arfuse pass: vllm_harness.compile_with_pass_manager), traced two ways:

    * as vLLM traces (dynamic=False, token dimension marked dynamic): routed_scaling_factor
      stays a Python constant, `shared + routed * 2.5` matches, and the MoE tail is one fused call;
    * torch.compile(dynamic=True): Dynamo turns the float into a graph input (a tensor), the
      scaled pattern (whose scale is a constant) does not match, and only the all-reduce + norm
      after vLLM's own `shared + routed * rsf` is fused (plain).

    (vLLM's VllmBackend cannot trace dynamic=True at all: the float's tensorification restarts
    Dynamo's analysis, which calls the backend a second time, and VllmBackend compiles once.)"""
    case, dtype = DEEPSEEK_V3_2L, torch.bfloat16
    built, comm = build_with_communicator(root, comms, case, dtype, seed)
    args = list(D.inputs(built, 24, torch.Generator().manual_seed(seed + 1)))
    want = D.run_eager(built, args)
    moe = ("moe_forward_shared[1]", "moe_forward_shared[0]")
    common = [("first_layer", "both", ("aten::where",), case.eps, 0.0)]
    common += [("plain", "both", ("aten::mm",), case.eps, 0.0)] * 3  # 2 o_proj, dense MLP
    expected = {
        "vllm": [("scaled_shared", "first", moe, case.eps, 0.0)],
        "dynamic": [("plain", "first", ("aten::add",), case.eps, 0.0)],
    }
    for mode in ("dynamic", "vllm"):
        with D.tensor_parallel(2), H.redirect_plugin_to(comm):
            got = H.compile_with_pass_manager(
                _Forward(built.model), args, built.config, None,
                compile_range=(1, H.MAX_TOKENS), mode=mode,
            )
        chains = D.fused_chains(got.after, case.routed_scaling)
        assert chains == sorted(common + expected[mode], key=str), mode
        assert H.count(got.after, AR) == 0
        # The MoE tail's multiply and add: folded into the call, or left for Inductor.
        moe_node = next(n for n in got.after.nodes if H.op_name(n) == "vllm::moe_forward_shared")
        tail = {H.op_name(u) for item in moe_node.users for u in item.users}
        assert tail == ({FUSED} if mode == "vllm" else {"aten::mul", "aten::add"}), mode
        if mode == "dynamic":  # the scale is a 0-d tensor input of the graph, not a constant
            (mul,) = [u for item in moe_node.users for u in item.users
                      if H.op_name(u) == "aten::mul"]
            scale = mul.args[1]
            while isinstance(scale, torch.fx.Node) and scale.op == "call_function":
                scale = scale.args[0]
            assert scale.op == "placeholder" and scale.meta["val"].dim() == 0
        assert_same_outputs([got.output], [want], dtype, tokens=(24,))
