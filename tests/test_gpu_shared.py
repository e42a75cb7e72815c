"""Ranks as real processes sharing one GPU (gloo, the real Communicator, CUDA IPC), under MPS:
a failing rank is contained the way NCCL contains it -- its peers give up within the timeout,
say so in one line and exit with arfuse.vllm.watch.EXIT_CODE, and no NaN output is returned.

Needs a GPU and an MPS daemon (run under scripts/mps.sh, which sets CUDA_MPS_PIPE_DIRECTORY):
without MPS the processes' kernels are time-sliced and cannot wait for each other in time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import checkout

pytestmark = pytest.mark.gpu
PROBE = Path(__file__).with_name("fault_probe.py")
CREATE_PROBE = Path(__file__).with_name("create_probe.py")
RANK_CONNECTIONS = "2"  # CUDA_DEVICE_MAX_CONNECTIONS of each rank process (launch)


def launch(world: int, probe: Path = PROBE, **env) -> list[subprocess.Popen]:
    if not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        pytest.skip("needs CUDA MPS: run under scripts/mps.sh (several processes on one GPU)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        e = checkout.pythonpath(os.environ)
        e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), **{k: str(v) for k, v in env.items()})
        # Under MPS the clients' connections (work queues) come from one shared pool, each
        # client owning its share (NVIDIA's MPS guide, CUDA_DEVICE_MAX_CONNECTIONS). conftest's 32,
        # for the emulated ranks' streams, would be every rank's: at 4 ranks on an H100 (d6d500a)
        # one rank's context creation failed with "out of memory". A rank here uses one stream.
        e["CUDA_DEVICE_MAX_CONNECTIONS"] = RANK_CONNECTIONS
        procs.append(subprocess.Popen([sys.executable, str(probe)], env=e, cwd=checkout.cwd(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(p: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        out = p.communicate()[0]
        return -999, out
    return p.returncode, out


@pytest.mark.parametrize("world", [2, 4])
def test_healthy_group_runs_every_step(world):
    procs = launch(world, FAULT="none", STEPS=50, TIMEOUT_S=20)
    outs = [finish(p, 180) for p in procs]
    every = "\n".join(f"--- rank {r}: exit {rc}\n{out[-1500:]}" for r, (rc, out) in enumerate(outs))
    for r, (rc, out) in enumerate(outs):
        assert rc == 0, f"rank {r}: exit {rc}\n{every}"
        assert out.count(" ok max|out| ") == 50 and "NAN" not in out
        assert f"ranks_per_device={world}" in out


@pytest.mark.parametrize("fault", ["kill", "sleep"])
def test_a_peer_that_stops_ends_its_peers_loudly(fault):
    from arfuse.vllm.watch import EXIT_CODE

    timeout_s = 5
    procs = launch(2, FAULT=fault, FAULT_AFTER=5, STEPS=20, TIMEOUT_S=timeout_s)
    t0 = time.monotonic()
    rc, out = finish(procs[0], timeout_s + 120)
    took = time.monotonic() - t0
    procs[1].kill()
    finish(procs[1], 30)
    assert rc == EXIT_CODE, f"rank 0: exit {rc} after {took:.0f} s\n{out[-3000:]}"
    assert "gave up waiting for rank 1" in out and "NAN RETURNED" not in out, out[-3000:]
    assert out.count(" ok max|out| ") == 5, out[-3000:]  # the steps before the fault only
    print(f"{fault}: rank 0 exit {rc} after {took:.1f} s; its last lines:\n" +
          "\n".join(out.strip().splitlines()[-3:]))


@pytest.mark.parametrize("case, rule", [
    ("max_tokens", "was created with max_tokens="),
    ("hidden", "was created with hidden="),
    ("dtype", "was created with dtype=torch."),
    ("bad_hidden", ("creation failed on 1 of 2 ranks (rank 1: ",
                    "hidden: 2052 must be a positive multiple of 8")),
])
def test_mismatched_ranks_are_refused_on_every_rank(case, rule):
    """Every rank refuses with one clear error (naming the rank that differs and the rule), none
    waits for a peer that gave up, and no buffer is left allocated on the GPU."""
    outs = [finish(p, 120) for p in launch(2, CREATE_PROBE, CASE=case)]
    for r, (rc, out) in enumerate(outs):
        assert rc == 0, f"rank {r}: exit {rc}\n{out[-3000:]}"
        refused = [ln for ln in out.splitlines() if ln.startswith(f"rank {r}: refused: ")]
        rules = (rule,) if isinstance(rule, str) else rule
        assert len(refused) == 1 and all(r_ in refused[0] for r_ in rules), out[-3000:]
        assert f"rank {r}: leftover 0 bytes" in out, out[-3000:]
        assert f"rank {r}: same outcome twice" in out, out[-3000:]


def test_a_matching_group_is_created_and_leaves_nothing_after_close():
    outs = [finish(p, 120) for p in launch(2, CREATE_PROBE, CASE="none")]
    for r, (rc, out) in enumerate(outs):
        assert rc == 0 and f"rank {r}: created" in out, out[-3000:]
        assert f"rank {r}: leftover 0 bytes" in out, out[-3000:]
        assert f"rank {r}: same outcome twice" in out, out[-3000:]
