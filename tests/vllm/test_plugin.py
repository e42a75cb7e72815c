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
ENTRY_POINT = "arfuse_vllm_plugin:register"
# make test installs the wheel it built and runs the suite from outside the checkout
# (ARFUSE_TEST_INSTALLED=1): the plugin is then found through the installed distribution's own
# metadata, exactly as vLLM finds it in a user's environment.
INSTALLED = os.environ.get("ARFUSE_TEST_INSTALLED") == "1"


def declared_entry_point() -> str | None:
    """The entry point pyproject.toml declares for arfuse, if it declares one."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text()).get("project", {})
    return project.get("entry-points", {}).get("vllm.general_plugins", {}).get("arfuse")


def test_pyproject_entry_point():
    assert declared_entry_point() == ENTRY_POINT


def test_the_installed_distribution_declares_it():
    """Under make test: the wheel's own metadata names the entry point, and it resolves to the
    installed module, not to this checkout."""
    if not INSTALLED:
        pytest.skip("arfuse is imported from the checkout (make test runs the installed wheel)")
    from importlib.metadata import distribution

    eps = [e for e in distribution("arfuse").entry_points if e.group == "vllm.general_plugins"]
    assert [e.value for e in eps] == [ENTRY_POINT]
    import sysconfig

    module = eps[0].load().__module__
    path = Path(sys.modules[module].__file__).resolve()
    site = Path(os.environ.get("ARFUSE_TEST_SITE") or sysconfig.get_paths()["purelib"]).resolve()
    assert path.parent == site, path


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Where the entry point comes from. Installed (make test): nothing to add, the wheel's
    metadata declares it. From the checkout: a distribution on sys.path whose metadata declares
    the pyproject's entry point, with the checkout itself on sys.path."""
    if INSTALLED:
        return None
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


def _environ(site, env) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ARFUSE_VLLM")}
    environ.update(env)
    environ.pop("VLLM_PLUGINS", None)
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(
            [str(site), str(REPO)] + [p for p in [environ.get("PYTHONPATH")] if p]
        )
    environ = {k: v for k, v in environ.items() if v is not None}
    return environ


def _run(script: str, args: list[str], environ: dict[str, str], cwd: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(site, tmp_path, scenario="plain", **env):
    # cwd: a folder outside the checkout, so that the checkout is not on sys.path by accident
    return _run("plugin_probe.py", [str(tmp_path), scenario], _environ(site, env), tmp_path)


def errors(got) -> list[str]:
    return [line for line, level in zip(got["log"], got["levels"]) if level == "ERROR"]


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
    assert len(got["log"]) == 1 and got["levels"] == ["ERROR"], got["log"]
    assert "fusion is OFF" in got["log"][0] and "hook.configure skipped" in got["log"][0]
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


# ---- start-up failures: one ERROR line that says fusion is OFF and why; strict: an exception ----

def _fusion_off(got, reason: str) -> None:
    """Exactly one ERROR line, saying that fusion is OFF, naming `reason`; nothing registered."""
    assert len(errors(got)) == 1, got["log"]
    (line,) = errors(got)
    assert "fusion is OFF" in line and reason in line, line
    assert got["raised"] is None, got["raised"]


# (scenario, environment, what the ERROR line names)
STARTUP_FAILURES = {
    "import-error": ("import-error", {}, "cannot import arfuse.vllm.plugin"),
    "library-missing": ("plain", {"ARFUSE_LIBRARY": "/nonexistent/libarfuse_ops.so"},
                        "the compiled library is not available"),
    "unsupported-vllm": ("newer-no-configure", {}, "is not among the releases checked"),
    "no-kernel": ("no-kernel", {}, "no arfuse kernel for the model: dtype=torch.bfloat16 "
                  "hidden=65544 world_size=1"),
}


@pytest.mark.parametrize("case", sorted(STARTUP_FAILURES))
def test_startup_failure_is_one_error_line_and_vllm_runs_on(site, tmp_path, case):
    scenario, env, reason = STARTUP_FAILURES[case]
    got = probe(site, tmp_path, scenario, ARFUSE_VLLM="1", **env)
    _fusion_off(got, reason)
    assert got["disabled"] is not None or case == "import-error"
    assert not arfuse_passes(got["tp1_passes"])
    assert got["tp1_communicator"] is False
    if case == "import-error":  # nothing was hooked: the plugin module never ran
        assert got["registered"] is False and not got["hash_hooked"]
        assert "arfuse.vllm.contract" in errors(got)[0]


@pytest.mark.parametrize("case", sorted(STARTUP_FAILURES))
def test_strict_turns_a_startup_failure_into_an_error(site, tmp_path, case):
    scenario, env, reason = STARTUP_FAILURES[case]
    got = probe(site, tmp_path, scenario, ARFUSE_VLLM="strict", **env)
    assert got["raised"] is not None, got["log"]
    assert "ARFUSE_VLLM=strict" in got["raised"] and reason in got["raised"], got["raised"]
    assert len(errors(got)) == 1 and "fusion is OFF" in errors(got)[0], got["log"]


def test_strict_with_nothing_wrong_is_on(site, tmp_path):
    got = probe(site, tmp_path, ARFUSE_VLLM="strict")
    assert got["raised"] is None and got["registered"] is True and got["disabled"] is None
    assert got["tp1_communicator"] is True and not errors(got)


def test_malformed_setting_is_one_error_line(site, tmp_path):
    got = probe(site, tmp_path, ARFUSE_VLLM="yes please")
    assert got["registered"] is False and got["raised"] is None
    (line,) = errors(got)
    assert "fusion is OFF" in line and "ARFUSE_VLLM='yes please'" in line, line


def test_unset_entry_point_imports_and_logs_nothing(site, tmp_path):
    """ARFUSE_VLLM unset: loading the plugins through vLLM's own loader imports no module of the
    arfuse package (whose import loads the CUDA library), loads no library and imports no vLLM
    module that vLLM's loader would not have imported without the arfuse plugin; nothing logged."""
    from importlib.metadata import entry_points

    environ = _environ(site, {})
    with_plugin = _run("entry_probe.py", [], environ, tmp_path)
    # vLLM's own general plugins (its LoRA resolvers) load either way
    others = sorted({e.name for e in entry_points(group="vllm.general_plugins")} - {"arfuse"})
    without = _run("entry_probe.py", [], {**environ, "VLLM_PLUGINS": ",".join(others) or "-"},
                   tmp_path)
    added = sorted(set(with_plugin["new_modules"]) - set(without["new_modules"]))
    assert added == ["arfuse_vllm_plugin"], added
    assert with_plugin["loaded_libraries"] == [] and with_plugin["log"] == []


def test_pass_goes_before_vllms_own_allreduce_and_norm_fusions():
    """The plugin's ordering rule, by class name. (vLLM's fusion pass modules cannot be imported
    here: they need vLLM's CUDA kernels, which need a GPU driver; the plugin matches names.)"""
    from types import SimpleNamespace

    from arfuse.vllm.passes import add_pass

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
