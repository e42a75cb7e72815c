"""arfuse.vllm.moe_finalize_allreduce_rms_norm with vLLM's RMSNorm / GemmaRMSNorm layers, on the
CPU with world size 1 (the all-reduce is the identity): against vLLM's own norm layer applied to
the finalized MoE output, through arfuse's communicator (also the plugin's, of world size 1 at tensor
parallelism 1) and through the unfused fallback that the call takes when no communicator serves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vllm_harness as H

H.require_vllm()
H.require_arfuse()

from arfuse.comm import cpu_communicator  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402

from arfuse.vllm import moe_finalize_allreduce_rms_norm  # noqa: E402

T, K = 5, 2
SCALE = 2.5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    spec = H.zoo_spec(256)
    config = H.vllm_config(tmp_path_factory.mktemp("models"), spec, torch.float32)
    H.ensure_distributed(config)
    comms = {}
    with set_current_vllm_config(config):
        yield SimpleNamespace(spec=spec, config=config, comms=comms)
    for c in comms.values():
        c.close()


def communicator(env, dtype):
    if dtype not in env.comms:
        env.comms[dtype] = cpu_communicator(max_tokens=16, hidden=env.spec.hidden, dtype=dtype)
    return env.comms[dtype]


def unfinalized(hidden, dtype, seed=0):
    """What a TRT-LLM MoE kernel hands out with do_finalize=False (vLLM's UnfinalizedMoEOutput,
    which 0.26.0 does not define yet): permuted unweighted rows, routing weights in the
    activation dtype and the permute map with -1 for experts on other ranks."""
    g = torch.Generator().manual_seed(seed)
    P = T * K + 3  # padded rows
    rows = torch.randn(P, hidden, generator=g).to(dtype)
    idx = torch.randperm(T * K, generator=g).to(torch.int32).view(T, K)
    idx[1, 0] = -1
    idx[3, 1] = -1
    weights = torch.rand(T, K, generator=g).to(dtype)
    shared = torch.randn(T, hidden, generator=g).to(dtype)
    residual = torch.randn(T, hidden, generator=g).to(dtype)
    return rows, weights, idx, shared, residual


def expected(norm, rows, weights, idx, shared, residual):
    """vLLM's own layer on the finalized output: norm(x, residual) -> (norm_out, residual_out)."""
    acc = torch.zeros(T, rows.shape[1], dtype=torch.float32)
    for t in range(T):
        for k in range(K):
            if idx[t, k] >= 0:
                acc[t] += weights[t, k].float() * rows[idx[t, k]].float()
    x = (SCALE * acc + shared.float()).to(rows.dtype)
    return norm(x.clone(), residual.clone())


def make_norm(gemma, hidden, dtype, eps=1e-6):
    norm = (GemmaRMSNorm if gemma else RMSNorm)(hidden, eps=eps)
    g = torch.Generator().manual_seed(3)
    norm.weight.data = (0.0 if gemma else 1.0) + 0.1 * torch.randn(hidden, generator=g)
    return norm.to(dtype)


@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma"])
@pytest.mark.parametrize("fused", [True, False], ids=["arfuse", "fallback"])
def test_unfinalized_output(env, gemma, fused):
    dtype = torch.float32
    h = env.spec.hidden
    rows, weights, idx, shared, residual = unfinalized(h, dtype)
    norm = make_norm(gemma, h, dtype)
    want = expected(norm, rows, weights, idx, shared, residual)
    moe_output = SimpleNamespace(
        gemm2_permuted=rows, expert_weights=weights, expanded_idx_to_permuted_idx=idx
    )
    residual_in = residual.clone()
    got = moe_finalize_allreduce_rms_norm(
        moe_output,
        residual,
        norm,
        shared_output=shared,
        routed_scaling_factor=SCALE,
        communicator=communicator(env, dtype) if fused else None,
    )
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(residual, residual_in)


def test_forms_of_the_moe_output(env):
    """MoEOutput (routed + shared + scale), the three tensors as a tuple, a finalized tensor."""
    dtype = torch.bfloat16
    h = env.spec.hidden
    rows, weights, idx, shared, residual = unfinalized(h, dtype, seed=1)
    norm = make_norm(False, h, dtype)
    comm = communicator(env, dtype)
    want = expected(norm, rows, weights, idx, shared, residual)
    moe_output = SimpleNamespace(
        routed=(rows, weights, idx), shared_output=shared, routed_scaling_factor=SCALE
    )
    got = moe_finalize_allreduce_rms_norm(moe_output, residual, norm, communicator=comm)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)

    finalized = torch.randn(T, h, dtype=dtype)
    got = moe_finalize_allreduce_rms_norm(finalized, residual, norm, communicator=comm)
    want = norm(finalized.clone(), residual.clone())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_tp1_takes_a_world_size_1_communicator(env):
    """In vLLM with tensor parallelism 1 the plugin's communicator has world size 1 (the local
    algorithm: no all-reduce); the call through it computes what vLLM's norm layer does."""
    from arfuse.vllm import communicators

    comm = communicators.get_communicator(env.config)
    assert comm is not None and comm.world_size == 1
    assert_as_vllms_norm(env)


def assert_as_vllms_norm(env):
    """The call (the plugin's communicator, whatever it is) on a finalized fp32 MoE output
    computes what vLLM's norm layer does."""
    dtype = torch.float32
    h = env.spec.hidden
    finalized = torch.randn(T, h, dtype=dtype)
    residual = torch.randn(T, h, dtype=dtype)
    norm = make_norm(True, h, dtype)
    got = moe_finalize_allreduce_rms_norm(finalized, residual, norm)
    want = norm(finalized.clone(), residual.clone())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_without_communicator_uses_the_fallback(env, monkeypatch):
    """Where arfuse serves nothing (no communicator for the model), the call still works: the
    same result unfused (PyTorch finalize, vLLM's all-reduce and norm op)."""
    from arfuse.vllm import communicators

    monkeypatch.setattr(communicators, "get_communicator", lambda config, create=True: None)
    assert_as_vllms_norm(env)


def test_rejects_what_it_cannot_compute(env):
    h = env.spec.hidden
    x = torch.randn(T, h)
    with pytest.raises(TypeError, match="norm_layer"):
        moe_finalize_allreduce_rms_norm(x, x, torch.nn.LayerNorm(h))
    with pytest.raises(ValueError, match="var_hidden_size"):
        moe_finalize_allreduce_rms_norm(x, x, RMSNorm(h, var_hidden_size=h // 2))
    with pytest.raises(TypeError, match="moe_output"):
        moe_finalize_allreduce_rms_norm(object(), x, RMSNorm(h))


@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma"])
def test_static_fp8_output(env, gemma, monkeypatch):
    """fp8_scale: norm_out is what vLLM's static per-tensor FP8 quant makes of vLLM's norm output
    (codes within one e4m3 step: arfuse quantizes the float32 norm, vLLM the bf16-rounded one),
    through arfuse, through the fallback, and through the fallback when arfuse's library has no
    fp8_static kernel for the model."""
    from arfuse.vllm import communicators
    from arfuse.vllm.eager import static_fp8_quant

    dtype = torch.bfloat16
    h = env.spec.hidden
    rows, weights, idx, shared, residual = unfinalized(h, dtype, seed=2)
    norm = make_norm(gemma, h, dtype)
    scale = torch.tensor([0.005], dtype=torch.float32)  # saturates the largest outputs
    moe_output = SimpleNamespace(
        routed=(rows, weights, idx), shared_output=shared, routed_scaling_factor=SCALE
    )
    with torch.no_grad():
        want_norm, want_res = expected(norm, rows, weights, idx, shared, residual)
    want = static_fp8_quant(want_norm, scale)
    assert (want.float().abs() == 448).any(), "no output saturates"

    comm = communicator(env, dtype)
    fused = moe_finalize_allreduce_rms_norm(moe_output, residual, norm, communicator=comm,
                                            fp8_scale=scale)
    fallback = moe_finalize_allreduce_rms_norm(moe_output, residual, norm, fp8_scale=scale)
    monkeypatch.setattr(communicators, "fp8_supported", lambda *a: False)
    no_kernel = moe_finalize_allreduce_rms_norm(moe_output, residual, norm, communicator=comm,
                                                fp8_scale=scale)
    for got in (fused, fallback, no_kernel):
        assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == dtype
        torch.testing.assert_close(got[1], want_res, rtol=2e-2, atol=2e-2)
        # Tokens whose residual_out rounded alike (the finalize sums in another order): codes
        # one step apart at most.
        same = (got[1] == want_res).all(dim=-1)
        assert same.sum() >= T - 1
        assert int(H.fp8_steps(got[0][same], want[same]).max()) <= 1
    assert torch.equal(fallback[0].view(torch.uint8), no_kernel[0].view(torch.uint8))
    # The fallback is vLLM's norm and quant on the same bf16 values: the very same codes.
    assert torch.equal(fallback[0].view(torch.uint8), want.view(torch.uint8))
