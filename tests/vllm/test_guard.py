"""A failure inside arfuse never stops vLLM: each scenario of guard_probe.py runs in a fresh
process against the real vLLM with the plugin registered (ARFUSE_VLLM=1)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_harness as H
import checkout

H.require_vllm()

REPO = Path(__file__).resolve().parents[2]


def probe(tmp_path, scenario):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARFUSE_VLLM")}
    env["ARFUSE_VLLM"] = "1"
    env = checkout.pythonpath(env)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("guard_probe.py")), str(tmp_path), scenario],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllms_own_exception_passes_through_unchanged(tmp_path):
    got = probe(tmp_path, "vllm-raises")
    assert got["original_error"] is not None
    assert got["hooked_error"] == got["original_error"]
    assert got["log"] == [] and got["disabled"] is None
    assert got["key_hooked"] != got["key_original"]  # still on: the key names arfuse


@pytest.mark.parametrize("scenario", ["pass-raises", "communicator-raises"])
def test_failing_pass_leaves_vllms_pass_list(tmp_path, scenario):
    got = probe(tmp_path, scenario)
    assert got["hooked_passes"] == got["original_passes"]
    assert len(got["log"]) == 1, got["log"]
    assert "arfuse-test-boom" in got["log"][0]
    assert "PostGradPassManager.configure hook" in got["log"][0]
    assert got["key_hooked"] == got["key_original"]  # off: the cache key as without arfuse


def test_failing_worker_hook_keeps_load_model(tmp_path):
    got = probe(tmp_path, "worker-raises")
    assert got["worker_hooked"] is True
    assert got["result"] == "None" and got["model_runner_calls"] == 1
    assert len(got["log"]) == 1 and "Worker.load_model hook" in got["log"][0]
    assert "arfuse-test-boom" in got["log"][0]
    assert got["key_hooked"] == got["key_original"]


def test_failing_cache_key_step_returns_vllms_key(tmp_path):
    got = probe(tmp_path, "cache-key-raises")
    assert got["key_hooked"] == got["key_original"]
    assert len(got["log"]) == 1 and "arfuse-test-boom" in got["log"][0]


def test_guarded_pass_restores_the_graph():
    """A pass that changes the graph and then raises: the graph is as it was (same code, same
    nodes), and the pass reports itself off."""
    import torch

    from arfuse.vllm import guard
    from arfuse.vllm.guarded_pass import GuardedPass

    def f(x, y):
        return torch.relu(x + y) * 2

    gm = torch.fx.symbolic_trace(f)
    before = copy.deepcopy(gm.graph)

    class HalfDone:
        def __call__(self, graph):
            add = next(n for n in graph.nodes if n.op == "call_function")
            with graph.inserting_after(add):
                extra = graph.call_function(torch.neg, (add,))
            add.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
            raise RuntimeError("half done")

        def uuid(self):
            return "half-done"

    try:
        GuardedPass(HalfDone())(gm.graph)
        assert str(gm.graph) == str(before)
        gm.recompile()
        x, y = torch.randn(3), torch.randn(3)
        assert torch.equal(gm(x, y), f(x, y))
        assert guard.disabled_reason() and "half done" in guard.disabled_reason()
        assert GuardedPass(HalfDone()).uuid() == "arfuse-off"
    finally:
        guard._disabled = None
