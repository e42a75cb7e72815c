"""The post_grad_custom_post_pass slot (arfuse_vllm_pass.post_grad_pass, arfuse.vllm.slot),
through vLLM's own code: CompilationConfig resolves the qualified name, VllmBackend's
configure_post_pass appends the object to vLLM's pass manager, vLLM's cache key changes with it,
and it fuses vLLM's real DeepSeek-V3 decoder layers compiled through vLLM's own backend
(decoder_models: CPU, rank 0 of TP=2, the communicator lookup redirected to a world-size-1 CPU
communicator)."""

from __future__ import annotations

import copy
import os
import pickle

import torch

import vllm_harness as H

H.require_vllm()

from vllm.config import set_current_vllm_config  # noqa: E402

SLOT = "arfuse_vllm_pass.post_grad_pass"
KEY = "post_grad_custom_post_pass"
MAX_TOKENS = 64


def slot_config(root, spec=None, dtype=torch.bfloat16, slot=True):
    spec = spec or H.zoo_spec()
    config = H.vllm_config(root, spec, dtype, inductor_passes={KEY: SLOT} if slot else {})
    H.ensure_distributed(config)
    return config


def test_vllm_resolves_the_qualified_name(root):
    import arfuse_vllm_pass
    from vllm.compilation.passes.inductor_pass import InductorPass

    config = slot_config(root)
    obj = config.compilation_config.inductor_compile_config[KEY]
    # The object itself (an InductorPass), not wrapped in vLLM's CallableInductorPass.
    assert obj is arfuse_vllm_pass.post_grad_pass
    assert isinstance(obj, InductorPass)
    # vLLM deep-copies the inductor config and pickles the config to its workers.
    assert copy.deepcopy(obj) is obj
    assert pickle.loads(pickle.dumps(obj)) is obj


def test_backend_appends_it_after_vllms_passes(root):
    from vllm.compilation.backends import VllmBackend

    config = slot_config(root)
    with set_current_vllm_config(config):
        backend = VllmBackend(config)
        backend.configure_post_pass()
    names = [type(p).__name__ for p in backend.pass_manager.passes]
    assert names[-1] == "ArfuseSlotPass", names
    assert backend.inductor_config[backend.pass_key] is backend.pass_manager


def test_cache_key_names_the_slot(root):
    from vllm.compilation.caching import aot_compile_hash_factors

    with_slot = aot_compile_hash_factors(slot_config(root))
    without = aot_compile_hash_factors(slot_config(root, slot=False))
    assert with_slot[1] != without[1]


def test_slot_fuses_the_chain(root, comms):
    """vLLM's DeepSeek-V3 classes (one dense, one MoE layer) compiled by vLLM as it compiles
    them, with the slot in the config: VllmBackend appends it, the slot builds the plugin's pass,
    and the pass replaces every all-reduce chain, the MoE tail with its routed scale and shared
    add included; every output element as the unfused model's."""
    H.require_arfuse()
    import arfuse_vllm_pass
    import decoder_models as D
    from test_decoder_layers import DEEPSEEK_V3_2L, TOLERANCES

    case, dtype = DEEPSEEK_V3_2L, torch.bfloat16
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    built = D.build(root, case, dtype, seed, inductor_passes={KEY: SLOT})
    slot = built.config.compilation_config.inductor_compile_config[KEY]
    assert slot is arfuse_vllm_pass.post_grad_pass
    args = D.inputs(built, 24, torch.Generator().manual_seed(seed + 1))
    expected = D.run_eager(built, args)
    comm = comms(D.spec_for(case, dtype), dtype)
    run = D.compile_and_run(built, comm, [args], slot=slot)
    assert [type(p).__name__ for p in run.record.managers[0].passes][-2:] == [
        "ArfuseSlotPass", "GraphRecorder"]  # appended after vLLM's passes (and our recorder)
    afters = [a for _, a in run.graphs]
    chains = sorted((c for a in afters for c in D.fused_chains(a, case.routed_scaling)), key=str)
    eps, moe = case.eps, ("moe_forward_shared[1]", "moe_forward_shared[0]")
    assert chains == sorted([
        ("first_layer", "both", ("aten::where",), eps, 0.0),
        *[("plain", "both", ("aten::mm",), eps, 0.0)] * 3,  # 2 o_proj, the dense MLP
        ("scaled_shared", "first", moe, eps, 0.0),
    ], key=str)
    assert sum(H.count(a, "vllm::all_reduce") for a in afters) == 0
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(run.outputs[0], expected, rtol=rtol, atol=atol)
    with D.tensor_parallel(2), H.redirect_plugin_to(comm), \
            set_current_vllm_config(built.config):  # as during the compile
        assert slot.inner() is not None
        assert slot.uuid() != slot.off_uuid()


def test_slot_at_tp1_leaves_the_graph(root, comms):
    """TP=1: the slot builds no pass, and a graph with an all-reduce before a norm stays as it
    is (vLLM itself emits no all-reduce at TP=1; the chain here calls the op directly)."""
    H.require_arfuse()
    from test_fusion_pass import OneChain, init_

    spec = H.zoo_spec()
    config = slot_config(root, spec)
    with set_current_vllm_config(config):
        module = init_(OneChain(spec), torch.bfloat16)
    slot = config.compilation_config.inductor_compile_config[KEY]
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(7, spec.hidden, generator=g).to(torch.bfloat16) for _ in range(2)]
    got = H.compile_with_pass_manager(module, args, config, slot,
                                      compile_range=(1, MAX_TOKENS), append=True)
    assert H.count(got.before, "vllm::all_reduce") == 1
    assert str(got.after) == str(got.before)
    with set_current_vllm_config(config):
        assert slot.inner() is None
        assert slot.uuid() == slot.off_uuid()


def test_slot_steps_aside_for_the_plugin(root, monkeypatch):
    from arfuse.vllm import communicators, plugin

    config = slot_config(root)
    monkeypatch.setattr(plugin, "_hooked", True)
    monkeypatch.setattr(communicators, "tensor_parallel_size", lambda: 2)
    slot = config.compilation_config.inductor_compile_config[KEY]
    with set_current_vllm_config(config):
        assert slot.inner() is None


def test_slot_load_hook_leaves_the_moe_layers(root, monkeypatch):
    """The slot's Worker.load_model hook body creates the communicator but does not switch the MoE
    layers (docs/vllm.md: the slot fuses after vLLM's finalized output); the plugin's does."""
    from types import SimpleNamespace

    from arfuse.vllm import communicators, load

    config = slot_config(root)
    switched = []
    monkeypatch.setattr(load, "switch_moe_rows", lambda c: switched.append(c) or [])
    monkeypatch.setattr(communicators, "get_communicator", lambda c, create=True: object())
    worker = SimpleNamespace(vllm_config=config)
    load.after_load_model_slot(worker, None, (), {})
    assert switched == [] and load.worker_config() is config
    load.after_load_model(worker, None, (), {})
    assert switched == [config]
