"""The post_grad_custom_post_pass slot (arfuse_vllm_pass.post_grad_pass, arfuse.vllm.slot),
through vLLM's own code: CompilationConfig resolves the qualified name, VllmBackend's
configure_post_pass appends the object to vLLM's pass manager, vLLM's cache key changes with it,
and under Inductor it fuses a DeepSeek-V2-like stack (CPU, world size 1; the TP > 1 gate and
the communicator lookup are redirected to a world-size-1 CPU communicator, as in
test_fusion_pass)."""

from __future__ import annotations

import copy
import pickle

import torch

import vllm_harness as H

H.require_vllm()

from vllm.config import set_current_vllm_config  # noqa: E402

SLOT = "arfuse_vllm_pass.post_grad_pass"
KEY = "post_grad_custom_post_pass"
MAX_TOKENS = 64


def slot_config(root, spec=H.DEEPSEEK_V2, dtype=torch.bfloat16, slot=True):
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


def build(root, dtype=torch.bfloat16):
    from test_fusion_pass import DeepseekV2Stack, init_

    spec = H.DEEPSEEK_V2
    config = slot_config(root, spec, dtype)
    with set_current_vllm_config(config):
        H.moe_runner(config, "model.layers.1.mlp.experts", spec, dtype, shared=True)
        module = init_(DeepseekV2Stack(config, spec), dtype)
    x = torch.randn(7, spec.hidden, generator=torch.Generator().manual_seed(2), dtype=dtype)
    return config, module, x


def compiled(config, module, x):
    slot = config.compilation_config.inductor_compile_config[KEY]
    return slot, H.compile_with_pass_manager(module, [x], config, slot,
                                             compile_range=(1, MAX_TOKENS), append=True)


def test_slot_fuses_the_chain(root, comms, monkeypatch):
    H.require_arfuse()
    from test_fusion_pass import assert_accurate

    from arfuse.vllm import plugin

    config, module, x = build(root)
    comm = comms(H.DEEPSEEK_V2, torch.bfloat16)
    monkeypatch.setattr(plugin, "tensor_parallel_size", lambda: 2)
    monkeypatch.setattr(plugin, "get_communicator", lambda cfg, create=True: comm)
    expected = H.run_eager(module, [x], config)
    slot, got = compiled(config, module, x)
    eps, rsf = H.DEEPSEEK_V2.eps, H.DEEPSEEK_V2.routed_scaling
    calls = [(eps, 0.0, 1.0, False, (0, 1))] * 4 + [(eps, 0.0, rsf, True, (0,))]
    assert H.fused_calls(got.after) == sorted(calls)
    assert H.count(got.after, "vllm::all_reduce") == 0
    assert_accurate(module, x, config, got.output, expected)
    with set_current_vllm_config(config):  # as during the compile: the slot's pass is built
        assert slot.inner() is not None
        assert slot.uuid() != slot.off_uuid()


def test_slot_at_tp1_leaves_the_graph(root):
    H.require_arfuse()
    config, module, x = build(root)
    slot, got = compiled(config, module, x)
    assert str(got.after) == str(got.before)
    with set_current_vllm_config(config):
        assert slot.inner() is None
        assert slot.uuid() == slot.off_uuid()


def test_slot_steps_aside_for_the_plugin(root, monkeypatch):
    from arfuse.vllm import plugin

    config = slot_config(root)
    monkeypatch.setattr(plugin, "_hooked", True)
    monkeypatch.setattr(plugin, "tensor_parallel_size", lambda: 2)
    slot = config.compilation_config.inductor_compile_config[KEY]
    with set_current_vllm_config(config):
        assert slot.inner() is None
