"""The wheel holds the whole package: every .py under arfuse/ and the top-level modules, the
library, its manifest and models.yaml, and the vLLM entry point pointing at a module it holds.

The wheel read is ARFUSE_WHEEL (make test: the CI-matrix wheel it built and installed), else the
one `make` left in dist/, else one built here from the checkout with the library under test
(scripts/build_wheel.sh, as make builds it). A wheel that lacks a module fails with its name.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIB_FILES = ("arfuse/_lib/libarfuse_ops.so", "arfuse/_lib/manifest.json", "arfuse/_lib/models.yaml")


def tree_modules() -> set[str]:
    """Every Python file the package consists of, as the wheel must name it."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "arfuse").rglob("*.py")
             if "__pycache__" not in p.parts}
    files |= {p.name for p in ROOT.glob("arfuse_*.py")}
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("ARFUSE_WHEEL")
    if given:
        return Path(given)
    built = sorted(glob.glob(str(ROOT / "dist" / "arfuse-*.whl")))
    if built:
        return Path(built[-1])
    from arfuse import _lib

    if not os.path.exists(_lib.library_path()):
        pytest.skip(f"no wheel (ARFUSE_WHEEL, dist/) and no library at {_lib.library_path()} "
                    "to build one with: run make")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(["scripts/build_wheel.sh", sys.executable, _lib.library_path(),
                           _lib.manifest_path(), str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def members(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_every_module_of_the_tree_is_in_the_wheel(members):
    missing = sorted(tree_modules() - members)
    assert not missing, f"the wheel lacks {len(missing)} module(s) of the tree: {missing}"


def test_the_wheel_holds_nothing_the_tree_does_not(members):
    extra = sorted(m for m in members if m.endswith(".py") and m not in tree_modules())
    assert not extra, f"the wheel holds modules the tree does not: {extra}"


def test_the_library_manifest_and_models_are_in_the_wheel(wheel, members):
    missing = [f for f in LIB_FILES if f not in members]
    assert not missing, f"the wheel lacks {missing}"
    with zipfile.ZipFile(wheel) as z:
        manifest = json.loads(z.read("arfuse/_lib/manifest.json"))
        assert z.getinfo("arfuse/_lib/libarfuse_ops.so").file_size > 1_000_000
        models = z.read("arfuse/_lib/models.yaml")
    from arfuse import _lib

    assert manifest["api_version"] == _lib.API_VERSION
    assert models == (ROOT / "variants" / "models.yaml").read_bytes()


def test_the_entry_point_names_a_module_of_the_wheel(wheel, members):
    with zipfile.ZipFile(wheel) as z:
        info = next(m for m in members if m.endswith(".dist-info/entry_points.txt"))
        text = z.read(info).decode()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = declared["vllm.general_plugins"]["arfuse"]
    assert f"arfuse = {target}" in text, text
    module = target.split(":")[0]
    assert module.replace(".", "/") + ".py" in members or \
        module.replace(".", "/") + "/__init__.py" in members, (target, sorted(members)[:20])


def test_the_readme_states_the_versions_the_files_pin():
    """The README's versions are the ones pyproject.toml and the requirements files pin."""
    import re

    readme = " ".join((ROOT / "README.md").read_text().split())  # line breaks as spaces
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    py = project["requires-python"].removeprefix(">=")
    assert f"Python ≥ {py} (`requires-python`" in readme, py
    torch_pin = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert f"torch {torch_pin}" in readme, torch_pin
    assert "torch>=2.11" in project["dependencies"] and "torch 2.11 or later" in readme
    for req, lane in (("requirements-vllm.txt", "A"), ("requirements-vllm-0.34.txt", "B")):
        pins = (ROOT / req).read_text()
        vllm = re.search(r"^vllm==(\S+)", pins, re.M).group(1)
        torch_v = re.search(r"^torch==(\d+\.\d+)", pins, re.M).group(1)
        assert f"**lane {lane}** — vLLM {vllm} and torch {torch_v}" in readme, (req, vllm, torch_v)
