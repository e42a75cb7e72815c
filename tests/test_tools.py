"""What the tools share (arfuse/_tools): the provenance of a run and the process-group setup."""

import os
import subprocess
from pathlib import Path

import pytest

from arfuse._tools import provenance
from arfuse._tools.ranks import ProcessRanks, RanksError, torchrun_world

ROOT = Path(__file__).resolve().parents[1]


def test_git_commit_is_this_checkout_or_the_environment(monkeypatch):
    monkeypatch.delenv("ARFUSE_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    import arfuse
    if not Path(arfuse.__file__).resolve().is_relative_to(ROOT):
        pytest.skip("arfuse imported from an installed wheel")
    assert provenance.git_commit() == head.stdout.strip()
    monkeypatch.setenv("ARFUSE_COMMIT", "0123abc")
    assert provenance.git_commit() == "0123abc"


def test_command_output_says_none_on_failure():
    assert provenance.command_output(["sh", "-c", "echo hi"]) == "hi"
    assert provenance.command_output(["sh", "-c", "exit 3"]) is None
    assert provenance.command_output(["/nonexistent/tool"]) is None


def test_run_info_fields(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("ARFUSE_COMMIT", "feedbeef")
    info = provenance.run_info("python -m x")
    assert info["arfuse_commit"] == "feedbeef" and info["command"] == "python -m x"
    for key in ("date", "hostname", "python", "torch", "cuda", "library"):
        assert key in info


def test_torchrun_world(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert torchrun_world() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert torchrun_world() == 4


def test_process_ranks_world_1_on_the_cpu(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RanksError, match="--backend nccl needs CUDA"):
        ProcessRanks(device="cpu", backend="nccl")
    r = ProcessRanks(device="cpu", backend="auto", timeout_s=30)
    try:
        assert (r.rank, r.world, r.backend, r.device.type) == (0, 1, "gloo", "cpu")
        assert r.owns_pg and dist.is_initialized()
        assert r.max_over([1.0, 2.0]) == [1.0, 2.0]
        assert r.gather_obj({"a": 1}) == [{"a": 1}] and r.broadcast_obj(3) == 3
        r.barrier()
    finally:
        r.close(barrier=True)
    assert not dist.is_initialized() and not r.owns_pg
    if not torch.cuda.is_available():
        with pytest.raises(RanksError, match="no CUDA device"):
            ProcessRanks(device="cuda")
