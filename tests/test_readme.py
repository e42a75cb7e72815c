"""The README's examples, run as written: each ```python block after an `<!-- example: NAME -->`
line is saved to a file in an empty folder outside the checkout and run there (the package from
the checkout, or the installed one with ARFUSE_TEST_INSTALLED=1; the library under test through
ARFUSE_LIBRARY, as for every test)."""

import os
import re
import subprocess
import sys

import pytest
import torch

import checkout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALLED = os.environ.get("ARFUSE_TEST_INSTALLED") == "1"  # as in conftest.py
EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```", re.S)


def readme_examples() -> dict[str, str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return dict(EXAMPLE.findall(f.read()))


def run_example(tmp_path, name: str, filename: str, launcher: list[str]) -> str:
    code = readme_examples()[name]
    (tmp_path / filename).write_text(code)
    env = checkout.pythonpath(os.environ)
    p = subprocess.run([*launcher, filename], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"README example {name}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_readme_has_the_examples():
    assert set(readme_examples()) == {"cpu", "one-gpu", "torchrun"}


def test_cpu_example(lib, tmp_path):
    out = run_example(tmp_path, "cpu", "cpu_example.py", [sys.executable])
    assert out == "ok: (4, 256) torch.bfloat16\n"


def test_torchrun_example_one_process(lib, tmp_path):
    """The several-GPU example with one process: on the CPU here, on GPU 0 on a GPU machine."""
    out = run_example(tmp_path, "torchrun", "moe_tail.py",
                      [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "1"])
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert f"rank 0 of 1: ok on {device}\n" in out


@pytest.mark.gpu
def test_one_gpu_example(lib, tmp_path):
    out = run_example(tmp_path, "one-gpu", "one_gpu_example.py", [sys.executable])
    assert out.startswith("4 ranks on ") and out.endswith(": ok\n")


@pytest.mark.gpu
def test_torchrun_example_two_gpus(lib, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = run_example(tmp_path, "torchrun", "moe_tail.py",
                      [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2"])
    assert sorted(out.splitlines()) == ["rank 0 of 2: ok on cuda:0", "rank 1 of 2: ok on cuda:1"]
