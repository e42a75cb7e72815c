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


def probe(site, tmp_path, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ARFUSE_VLLM")}
    environ.update(env)
    environ.pop("VLLM_PLUGINS", None)
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(REPO)] + [p for p in [environ.get("PYTHONPATH")] if p]
    )
    script = Path(__file__).with_name("plugin_probe.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_off_by_default(site, tmp_path):
    got = probe(site, tmp_path)
    # The set: an arfuse.egg-info in the repository (left by building the wheel) declares the
    # same entry point a second time.
    assert set(got["entry_points"]) == {declared_entry_point() or ENTRY_POINT}
    assert got["registered"] is False
    assert not got["configure_hooked"] and not got["hash_hooked"]
    assert got["worker_hooked"] is not True
    assert got["hash_after"] == got["hash_before"]
    assert "ArfuseAllReduceFusionPass" not in got["tp1_passes"]


def test_enabled_hooks_once_and_stays_out_at_tp1(site, tmp_path):
    H.require_arfuse()
    got = probe(site, tmp_path, ARFUSE_VLLM="1")
    assert got["registered"] is True
    assert got["configure_hooked"] and got["configure_wrapped_once"]
    assert got["hash_hooked"]
    # The compile cache key names the arfuse configuration.
    assert got["hash_after"] != got["hash_before"]
    # Tensor parallelism 1: no pass, no communicator.
    assert "ArfuseAllReduceFusionPass" not in got["tp1_passes"]
    assert got["tp1_communicator"] is False
    # The GPU worker class is importable on this machine too; its load_model is hooked.
    assert got["worker_hooked"] is True, got["worker_hooked"]


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
