"""The arfuse fusion pass, run by vLLM's own PostGradPassManager under Inductor, on graphs traced
(as vLLM traces: vllm_harness.compile_with_pass_manager) from modules that call vLLM's real ops
(all_reduce, vllm_ir rms_norm / fused_add_rms_norm through vLLM's RMSNorm and GemmaRMSNorm layers,
moe_forward / moe_forward_shared) in every combination the pass matches: the pass itself. Its
effect on vLLM's real decoder classes is test_decoder_layers.py. CPU, world size 1: the
all-reduce is the identity, arfuse runs its CPU op."""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch

import vllm_harness as H

H.require_vllm()
H.require_arfuse()

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.config.utils import Range  # noqa: E402
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402

from arfuse.vllm.fusion import (  # noqa: E402
    ArfuseAllReduceFusionPass,
    symbolic_tokens_supported,
)

AR = "vllm::all_reduce"
RMS = "vllm_ir::rms_norm"
ADD_RMS = "vllm_ir::fused_add_rms_norm"
FUSED = "arfuse::fused"
MAX_TOKENS = 64  # the communicators' capacity (tests/vllm/conftest.py)
T = 7  # tokens in the test batches


# root, comms: tests/vllm/conftest.py


def setup(root, spec, dtype):
    return H.distributed_config(root, spec, dtype)


def init_(module: torch.nn.Module, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Random weights; norm weights near their identity (1 for RMSNorm, 0 for Gemma's)."""
    g = torch.Generator().manual_seed(seed)
    H.init_norms(module, g, gates=False)
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = torch.randn(m.weight.shape, generator=g) * m.weight.shape[1] ** -0.5
        elif not isinstance(m, (RMSNorm, GemmaRMSNorm)):
            for p in m.parameters(recurse=False):
                p.data = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
    return module.to(dtype).requires_grad_(False)


def ops(graph) -> Counter:
    return Counter(H.op_name(n) or str(n.target) for n in graph.nodes if n.op == "call_function")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_only_replaced(before, after, removed_extra: Counter) -> None:
    """Apart from the all-reduces and norms the pass replaced (and the MoE-tail / Gemma-weight
    arithmetic it folded in, `removed_extra`), the graph keeps every op it had."""
    b, a = ops(before), ops(after)
    # (aten::full and sym_size: a first layer's zero residual, made for the symbolic token count)
    for name in (AR, RMS, ADD_RMS, FUSED, "aten::full", "aten::sym_size", str(operator.getitem)):
        b.pop(name, None)
        a.pop(name, None)
    expected = b - removed_extra
    assert +a == +expected, f"ops other than the replaced ones changed: {a} vs {expected}"


# ---- every pattern -------------------------------------------------------------------------------


class Zoo(torch.nn.Module):
    """Every pattern of the pass, for one (eps, RMSNorm or GemmaRMSNorm): once with all its
    outputs used and once at the end of a chain (the residual / all-reduce output unused).

    Chain A runs the patterns in a row like decoder layers do; chains B..E start with a norm of
    an all-reduce whose output nothing else reads, and end in one MoE tail each.
    """

    def __init__(self, config, spec, eps, gemma):
        super().__init__()
        norm = GemmaRMSNorm if gemma else RMSNorm
        h = spec.hidden
        self.norms = torch.nn.ModuleList(norm(h, eps=eps) for _ in range(15))
        self.lin = torch.nn.Linear(h, h, bias=False)
        self.gate = torch.nn.Parameter(torch.empty(spec.n_experts, h))
        self.rsf = spec.routed_scaling
        self.shared = H.layer_name("zoo.shared")
        self.routed = H.layer_name("zoo.routed")

    def tail(self, y, kind):
        if kind == "scaled_shared":
            return H.moe_tail(y, self.gate, self.shared, shared=True, routed_scaling=self.rsf)
        if kind == "shared_scaled":
            return H.moe_tail(
                y, self.gate, self.shared, shared=True, routed_scaling=self.rsf,
                form="shared_scaled",
            )
        if kind == "shared":
            return H.moe_tail(y, self.gate, self.shared, shared=True, routed_scaling=1.0)
        return H.moe_tail(y, self.gate, self.routed, shared=False, routed_scaling=self.rsf)

    KINDS = ("scaled_shared", "shared_scaled", "shared", "scaled")

    def forward(self, x0, x1, x2, x3, x4, r1, r2, r3, r4):
        n = iter(self.norms)
        # chain A
        h = H.all_reduce(x0)
        res = h
        y = next(n)(h)  # rms_norm, both outputs
        y, res = next(n)(H.all_reduce(self.lin(y)), res)  # fused_add_rms_norm, both
        for kind in self.KINDS:  # MoE tails, both outputs
            y, res = next(n)(self.tail(y, kind), res)
        out, _ = next(n)(H.all_reduce(self.lin(y)), res)  # fused_add_rms_norm, first only
        # chains B..E
        # (one residual each: vLLM's norms take their residual in place)
        for x, r, kind in zip((x1, x2, x3, x4), (r1, r2, r3, r4), self.KINDS):
            y = next(n)(H.all_reduce(x))  # rms_norm, first only
            z, _ = next(n)(self.tail(y, kind), r)  # MoE tail, first only
            out = out + z
        return out


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma"])
def test_every_pattern_replaced_and_nothing_else(root, comms, eps, gemma):
    spec = H.zoo_spec()
    dtype = torch.float32  # exact enough to hold the fused result to the unfused one tightly
    config = setup(root, spec, dtype)
    module, fusion = H.zoo_module_and_pass(
        config, spec, dtype,
        lambda: init_(Zoo(config, spec, eps, gemma), dtype, seed=int(eps * 1e7) + gemma),
        comms(spec, dtype))
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(T, spec.hidden, generator=g, dtype=dtype) for _ in range(9)]

    expected_out = H.run_eager(module, args, config)
    got = H.compile_with_pass_manager(module, args, config, fusion, compile_range=(1, MAX_TOKENS))

    before, after = got.before, got.after
    # Traced as vLLM traces (dynamic=False, token dimension marked dynamic): T is a symbol, and
    # arfuse.fused traces with it symbolic (arfuse/_fake.py), which the pass checks before it
    # replaces anything (symbolic_tokens_supported).
    H.assert_tokens_symbolic(before)
    assert symbolic_tokens_supported(fusion.handle, spec.hidden, dtype)
    assert (H.count(before, AR), H.count(before, RMS), H.count(before, ADD_RMS)) == (15, 5, 10)
    assert (H.count(after, AR), H.count(after, RMS), H.count(after, ADD_RMS)) == (0, 0, 0)
    wb = 1.0 if gemma else 0.0
    rsf = spec.routed_scaling
    both, first = (0, 1), (0,)
    expected_calls = [
        (eps, wb, 1.0, False, both),  # all_reduce -> rms_norm
        (eps, wb, 1.0, False, both),  # all_reduce -> fused_add_rms_norm
        (eps, wb, rsf, True, both),  # shared + fused * rsf
        (eps, wb, 1.0 / rsf, True, both),  # shared * (1/rsf) + fused (fp16 branch)
        (eps, wb, 1.0, True, both),  # shared + fused
        (eps, wb, rsf, False, both),  # fused * rsf
        (eps, wb, 1.0, False, first),  # all_reduce -> fused_add_rms_norm, end of graph
        *[(eps, wb, 1.0, False, first)] * 4,  # all_reduce -> rms_norm, norm only
        (eps, wb, rsf, True, first),
        (eps, wb, 1.0 / rsf, True, first),
        (eps, wb, 1.0, True, first),
        (eps, wb, rsf, False, first),
    ]
    assert H.fused_calls(after) == sorted(expected_calls)
    # Folded in: the MoE tails' scale multiplies and shared adds, Gemma's `weight.float() + 1`.
    removed = Counter({"aten::mul": 6, "aten::add": 6 + (15 if gemma else 0)})
    assert_only_replaced(before, after, removed)

    assert rel_err(got.output, expected_out) < 1e-5
    torch.testing.assert_close(got.output, expected_out, rtol=1e-4, atol=1e-4)


# ---- when the pass stays out of the way ----------------------------------------------------------
# (The pass on vLLM's real decoder classes, compiled through vLLM's own backend:
# test_decoder_layers.py.)


class OneChain(torch.nn.Module):
    """all_reduce -> fused_add_rms_norm, as after an attention o_proj."""

    def __init__(self, spec):
        super().__init__()
        self.norm = RMSNorm(spec.hidden, eps=spec.eps)

    def forward(self, x, residual):
        return self.norm(H.all_reduce(x), residual)


def test_range_beyond_capacity_left_alone(root, comms):
    spec = H.zoo_spec()
    dtype = torch.bfloat16
    config = setup(root, spec, dtype)
    with set_current_vllm_config(config):
        module = init_(OneChain(spec), dtype)
        fusion = ArfuseAllReduceFusionPass(config, comms(spec, dtype), all_reduce=True)
    assert not fusion.is_applicable_for_range(Range(1, MAX_TOKENS + 1))
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(T, spec.hidden, generator=g).to(dtype) for _ in range(2)]
    got = H.compile_with_pass_manager(
        module, args, config, fusion, compile_range=(1, MAX_TOKENS + 1)
    )
    assert ops(got.after) == ops(got.before)
    assert H.count(got.after, FUSED) == 0 and H.count(got.after, AR) == 1
    # The same graph for a range within the capacity is fused.
    got = H.compile_with_pass_manager(module, args, config, fusion, compile_range=(1, MAX_TOKENS))
    assert H.count(got.after, FUSED) == 1 and H.count(got.after, AR) == 0


def test_pass_disabled_for_a_communicator_of_another_shape(root, comms):
    spec = H.QWEN3_MOE
    config = setup(root, spec, torch.bfloat16)
    fusion = ArfuseAllReduceFusionPass(config, comms(H.zoo_spec(), torch.bfloat16))
    assert fusion.disabled and "hidden" in fusion.reason
    assert not fusion.is_applicable_for_range(Range(1, 2))
    fusion = ArfuseAllReduceFusionPass(config, comms(spec, torch.float16))
    assert fusion.disabled and "dtype" in fusion.reason


def test_uuid_covers_the_configuration(root, comms):
    spec = H.QWEN3_MOE
    dtype = torch.bfloat16
    config = setup(root, spec, dtype)
    comm = comms(spec, dtype)
    a = ArfuseAllReduceFusionPass(config, comm, all_reduce=True)
    assert a.uuid() == ArfuseAllReduceFusionPass(config, comm, all_reduce=True).uuid()
    assert a.uuid() != ArfuseAllReduceFusionPass(config, comms(spec, dtype, 32),
                                                 all_reduce=True).uuid()
    # Same capacity, another communicator: another handle baked into the graph.
    assert a.uuid() != ArfuseAllReduceFusionPass(config, comms(spec, dtype),
                                                 all_reduce=True).uuid()
    # The graph without vLLM's all-reduce (tensor parallelism 1): other patterns.
    b = ArfuseAllReduceFusionPass(config, comm, all_reduce=False)
    assert b.uuid() != a.uuid() and {s.kind for s in b.specs} == \
        {"rows_scaled_shared", "rows_shared", "rows_scaled", "rows"}
    # The communicator has world size 1 (the CPU one): no all-reduce algorithm, a one-shot
    # setting runs the local algorithm ("auto"), as the op would refuse one-shot.
    one = ArfuseAllReduceFusionPass(config, comm, algorithm="oneshot", all_reduce=True)
    assert one.algorithm == "auto" and one.uuid() == a.uuid()
