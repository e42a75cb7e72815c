"""The plugin, loaded through vLLM's own loader (vllm.plugins.load_general_plugins) from the
`vllm.general_plugins` entry point, each time in a fresh process as vLLM does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import vllm_harness as H

H.require_vllm()

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINT = "arfuse.vllm.plugin:register"


def declared_entry_point() -> str | None:
    """The entry point pyproject.toml declares for arfuse, if it declares one."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text()).get("project", {})
    return project.get("entry-points", {}).get("vllm.general_plugins", {}).get("arfuse")


def test_pyproject_entry_point():
    declared = declared_entry_point()
    if declared is None:
        pytest.skip('pyproject.toml declares no [project.entry-points."vllm.general_plugins"]')
    assert declared == ENTRY_POINT


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A distribution on sys.path whose metadata declares the entry point (what installing arfuse
    with the pyproject line does), so the test does not depend on how arfuse is installed."""
    d = tmp_path_factory.mktemp("site")
    info = d / "arfuse_vllm_entry_point-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: arfuse-vllm-entry-point\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\narfuse = {declared_entry_point() or ENTRY_POINT}\n"
    )
    return d


def probe(site, tmp_path, scenario="plain", **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ARFUSE_VLLM")}
    environ.update(env)
    environ.pop("VLLM_PLUGINS", None)
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(REPO)] + [p for p in [environ.get("PYTHONPATH")] if p]
    )
    script = Path(__file__).with_name("plugin_probe.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), scenario],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def arfuse_passes(names):
    return [n for n in names if n.startswith("Arfuse") or n == "GuardedPass"]


def test_off_by_default(site, tmp_path):
    got = probe(site, tmp_path)
    # The set: an arfuse.egg-info in the repository (left by building the wheel) declares the
    # same entry point a second time.
    assert set(got["entry_points"]) == {declared_entry_point() or ENTRY_POINT}
    assert got["registered"] is False
    assert not got["configure_hooked"] and not got["hash_hooked"]
    assert got["worker_hooked"] is not True
    assert got["key_after"] == got["key_before"]
    assert got["variants_after"] == got["variants_before"]
    assert not arfuse_passes(got["tp1_passes"])
    assert got["log"] == []


def test_enabled_hooks_once_and_fuses_the_rows_at_tp1(site, tmp_path):
    got = probe(site, tmp_path, ARFUSE_VLLM="1")
    assert got["registered"] is True, got["log"]
    assert got["disabled"] is None
    assert got["configure_hooked"] and got["configure_wrapped_once"]
    # The compile cache key method of this release: compute_hash up to 0.33, compile_factors 0.34.
    vllm = H.require_vllm()
    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    assert got["hash_method"] == ("compile_factors" if major_minor >= (0, 34) else "compute_hash")
    assert got["hash_hooked"] and got["hash_wrapped_once"]
    # vLLM's own compile cache key (aot_compile_hash_factors: env hash, config hash, ...) names
    # the arfuse configuration: only the config part changes.
    assert got["key_after"][1] != got["key_before"][1]
    assert got["key_after"][0] == got["key_before"][0]
    # ... also as FlashInfer's autotune cache asks (include_version=False, 0.30+), which a
    # wrapper without **kwargs broke; on 0.26-0.29 vLLM's own method has no such keyword and
    # the wrapped one raises the same TypeError.
    before, after = got["variants_before"][0], got["variants_after"][0]
    if before.startswith("TypeError"):
        assert after == before
    else:
        assert after != before
    # Tensor parallelism 1: the pass with the MoE tails on the expert rows alone (vLLM's graph
    # has no all-reduce there), and a communicator of world size 1 (the local algorithm).
    assert arfuse_passes(got["tp1_passes"]) == ["GuardedPass"]
    assert got["tp1_kinds"] == ["rows", "rows_scaled", "rows_scaled_shared", "rows_shared"]
    assert got["tp1_communicator"] is True and got["tp1_world"] == 1
    # The GPU worker class is importable on this machine too; its load_model is hooked.
    assert got["worker_hooked"] is True, got["worker_hooked"]
    assert any("integration enabled" in line for line in got["log"]), got["log"]
    # Besides that line, only the TP=1 communicator's creation is logged.
    others = [line for line in got["log"] if "enabled" not in line]
    assert len(others) <= 1 and all("Communicator(rank=0, world_size=1" in line
                                    for line in others), got["log"]


def test_missing_hook_target_leaves_vllm_running(site, tmp_path):
    """A release without one of the hook targets (simulated: configure removed before the
    plugins load): register() returns, one log line names the target, nothing is hooked."""
    got = probe(site, tmp_path, "no-configure", ARFUSE_VLLM="1")
    assert got["registered"] is False
    assert len(got["log"]) == 1, got["log"]
    assert "hook.configure skipped" in got["log"][0]
    assert "PostGradPassManager.configure" in got["log"][0]
    assert not got["hash_hooked"] and got["worker_hooked"] is not True
    assert got["key_after"] == got["key_before"]


def test_newer_release_checks_the_contract_first(site, tmp_path):
    """A vLLM release the integration was not checked against: register() checks the contract
    against the installed vLLM; with everything there it hooks (and says so in one line)."""
    got = probe(site, tmp_path, "newer", ARFUSE_VLLM="1")
    assert got["registered"] is True
    assert got["hash_hooked"] and got["configure_hooked"]
    others = [line for line in got["log"] if "enabled" not in line
              and "Communicator(rank=0, world_size=1" not in line]  # the probe's TP=1 one
    assert len(others) == 1 and "0.35.0 is not among the releases checked" in others[0]


def test_newer_release_lacking_something_stays_off(site, tmp_path):
    got = probe(site, tmp_path, "newer-no-configure", ARFUSE_VLLM="1")
    assert got["registered"] is False
    assert len(got["log"]) == 1, got["log"]
    assert "0.35.0" in got["log"][0] and "hook.configure: missing" in got["log"][0]
    assert not got["hash_hooked"] and got["worker_hooked"] is not True


def test_pass_goes_before_vllms_own_allreduce_and_norm_fusions():
    """The plugin's ordering rule, by class name. (vLLM's fusion pass modules cannot be imported
    here: they need vLLM's CUDA kernels, which need a GPU driver; the plugin matches names.)"""
    from types import SimpleNamespace

    from arfuse.vllm.plugin import add_pass

    def passes(*names):
        return [type(n, (), {})() for n in names]

    mine = object()
    pm = SimpleNamespace(passes=passes("NoOpEliminationPass", "AllReduceFusionPass",
                                       "RMSNormQuantFusionPass", "ActivationQuantFusionPass"))
    add_pass(pm, mine)
    assert pm.passes.index(mine) == 1
    pm = SimpleNamespace(passes=passes("NoOpEliminationPass", "RMSNormQuantFusionPass"))
    add_pass(pm, mine)
    assert pm.passes.index(mine) == 1
    pm = SimpleNamespace(passes=passes("NoOpEliminationPass"))
    add_pass(pm, mine)
    assert pm.passes[-1] is mine
