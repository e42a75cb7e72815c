"""Bad input and misuse on the GPU (issue 14): refused before anything is launched or written,
nothing touches freed memory (`MISUSE=1 lab/scripts/gpu-sanitize.sh` runs this file under
compute-sanitizer memcheck too), and the group stays usable afterwards. The CPU side is
test_misuse_cpu.py."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import arfuse
from arfuse import reference
from arfuse._checks import TOL, rel_err
from arfuse.testing import LocalGroup

pytestmark = pytest.mark.gpu

H = 2048
DT = torch.bfloat16


def rand(*shape, dtype=DT):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) + 0.5).to(dtype)


@pytest.fixture
def group(lib):
    with LocalGroup(2, max_tokens=64, hidden=H, dtype=DT, timeout_s=20.0) as g:
        yield g


def call_all(group, make):
    """The op on every rank (make(rank, comm) -> outputs), launched together; returns them."""
    out = group.run(make)
    torch.cuda.synchronize()
    assert group.status() == [0] * group.world_size
    return out


def works(group, T=7):
    """A plain fused call on every rank gives the float64 reference (the group is usable):
    residual_out is the rank-ordered sum + residual rounded once (bitwise), norm_out within the
    bf16 tolerance."""
    xs = [rand(T, H) for _ in range(group.world_size)]
    r, g = rand(T, H), rand(H)
    outs = call_all(group, lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(c, xs[rank], r, g, 1e-6))
    # residual_out: the rank-ordered float32 sum + residual, rounded once, as the kernel adds.
    _, ref_res = reference.allreduce_add_rmsnorm(xs, r, g, 1e-6, 0.0, DT, acc=torch.float32)
    ref_norm, _ = reference.allreduce_add_rmsnorm(xs, r, g, 1e-6, 0.0, DT, acc=torch.float64)
    for norm, res in outs:
        assert torch.equal(res, ref_res)
        assert rel_err(norm, ref_norm) < TOL[DT]


def test_aliased_inplace_refused_nothing_written(group):
    T = 5
    x = rand(T, H)
    before = x.clone()
    for r_of, s_of in ((lambda: x, lambda: None), (lambda: rand(T, H), lambda: x)):
        with pytest.raises(ValueError, match="overlap in memory"):
            group.run(lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(
                c, x, r_of(), rand(H), 1e-6, shared_out=s_of(), inplace=True))
        torch.cuda.synchronize()
        assert torch.equal(x, before)
    buf = rand(2 * T, H)
    with pytest.raises(ValueError, match="input and residual overlap"):
        group.run(lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(
            c, buf[0:T], buf[2:T + 2], rand(H), 1e-6, inplace=True))
    assert group.status() == [0, 0]
    works(group)


def test_inplace_without_residual_refused(group):
    x = rand(3, H)
    before = x.clone()
    with pytest.raises(ValueError, match="residual: inplace=True writes residual_out"):
        group.run(lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(c, x, None, rand(H), 1e-6,
                                                                        inplace=True))
    # The op itself with a None for its required residual: refused, nothing launched.
    with pytest.raises(RuntimeError, match="ValueError: arfuse: residual: a tensor is required"):
        torch.ops.arfuse.fused_inplace(x, None, None, rand(H), 1e-6, 0.0, 1.0,
                                       group.comms[0].handle, 0)
    torch.cuda.synchronize()
    assert torch.equal(x, before)
    works(group)


def test_rank_without_expert_rows_and_out_of_range_indices(group):
    """0 permuted rows with every index -1 is a valid input (the partial is the shared output);
    an index outside [-1, P) makes that token NaN on every rank and nothing else."""
    T, K = 6, 4
    r, g = rand(T, H), rand(H)
    shared = [rand(T, H) for _ in range(2)]
    empty = torch.empty(0, H, device="cuda", dtype=DT)
    none = torch.full((T, K), -1, device="cuda", dtype=torch.int32)
    outs = call_all(group, lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(
        c, empty, r, g, 1e-6, permuted_idx=none, shared_out=shared[rank]))
    want = (shared[0].float() + shared[1].float() + r.float()).to(DT)  # the kernel's float32 sum
    for _, res in outs:
        assert torch.equal(res, want)
    P = 9
    rows = rand(P, H)
    idx = torch.randint(0, P, (T, K), device="cuda", dtype=torch.int32)
    idx[1, 2] = P
    idx[4, 0] = -3
    outs = call_all(group, lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(
        c, rows, r, g, 1e-6, permuted_idx=idx))
    bad = torch.zeros(T, dtype=torch.bool, device="cuda")
    bad[1] = bad[4] = True
    for norm, res in outs:
        assert torch.equal(norm.isnan().all(dim=1), bad) and not norm[~bad].isnan().any()
        assert torch.equal(res.isnan().all(dim=1), bad) and not res[~bad].isnan().any()
    # The CPU path agrees on which tokens are NaN (world size 1: the same rows twice is 2x one).
    with arfuse.comm.cpu_communicator(max_tokens=64, hidden=H, dtype=DT) as c:
        norm, _ = arfuse.moe_finalize_allreduce_rmsnorm(c, rows.cpu(), r.cpu(), g.cpu(), 1e-6,
                                                        permuted_idx=idx.cpu())
        assert torch.equal(norm.isnan().all(dim=1), bad.cpu())


def test_closed_rank_refused_before_launch(lib):
    with LocalGroup(2, max_tokens=16, hidden=H, dtype=DT, timeout_s=20.0) as group:
        x, r, g = rand(3, H), rand(3, H), rand(H)
        group.comms[1].close()
        with pytest.raises(ValueError, match="comm: rank 1 of this emulated group is closed"):
            arfuse.moe_finalize_allreduce_rmsnorm(group.comms[0], x, r, g, 1e-6)
        with pytest.raises(ValueError):
            group.run(lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(c, x, r, g, 1e-6))
        torch.cuda.synchronize()
        assert group.comms[0].status() == 0  # nothing waited for the closed rank


def test_unusable_device_refused_and_no_error_left_behind(lib):
    # The communicator reads its card's name (its dispatch rows) at creation: a device that does
    # not exist is one ValueError naming it, refused before any CUDA call touches it (so no CUDA
    # error is raised: this file also runs under compute-sanitizer, which reports every failed
    # API call), and the next launch works.
    from arfuse.comm import local_communicator

    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device: cuda:{n} does not exist \(this process sees {n} "):
        local_communicator(max_tokens=8, hidden=H, dtype=DT, device=f"cuda:{n}")
    with local_communicator(max_tokens=8, hidden=H, dtype=DT) as c:
        x, r, g = rand(3, H), rand(3, H), rand(H)
        norm, _ = arfuse.moe_finalize_allreduce_rmsnorm(c, x, r, g, 1e-6)
        torch.cuda.synchronize()
        assert norm.isfinite().all()


def test_bad_argument_during_capture_leaves_a_clean_capture(group):
    T = 4
    xs, r, g = [rand(T, H) for _ in range(2)], rand(T, H), rand(H)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="eps: -1 must be >= 0"):
        with torch.cuda.graph(graph):
            group.run(lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(c, xs[rank], r, g, -1.0))
    torch.cuda.synchronize()
    works(group)  # eager calls work afterwards
    # ... and a new capture, replayed, gives what eager gives.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = group.run(lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(c, xs[rank], r, g, 1e-6))
    eager = call_all(group, lambda rank, c: arfuse.moe_finalize_allreduce_rmsnorm(c, xs[rank], r, g, 1e-6))
    graph.replay()
    torch.cuda.synchronize()
    for (gn, gr), (en, er) in zip(outs, eager):
        assert torch.equal(gn, en) and torch.equal(gr, er)
    assert group.status() == [0, 0]


def test_single_stream_capture_with_a_bad_argument(lib):
    """One communicator called on the capturing stream itself (no side streams): the error
    comes out of the capture, which ends cleanly."""
    with LocalGroup(1, max_tokens=16, hidden=H, dtype=DT) as group:
        c = group.comms[0]
        x, r, g = rand(3, H), rand(3, H), rand(H)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match="weight_bias: 2"):
            with torch.cuda.graph(graph):
                arfuse.moe_finalize_allreduce_rmsnorm(c, x, r, g, 1e-6, weight_bias=2.0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = arfuse.moe_finalize_allreduce_rmsnorm(c, x, r, g, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        eager = arfuse.moe_finalize_allreduce_rmsnorm(c, x, r, g, 1e-6)
        torch.cuda.synchronize()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
        want_res = (x.double() + r.double()).to(DT)
        assert torch.equal(eager[1], want_res)
        assert c.status() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _topology_worker(rank: int, port: int, results):
    import torch.distributed as dist

    import arfuse
    from arfuse import comm as comm_mod

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.cuda.set_device(0)
        if rank == 1:  # rank 1 stands for a process on another node
            comm_mod._host_identity = lambda: ("other-boot-id", "node-b")
        try:
            arfuse.Communicator(None, max_tokens=16, hidden=H, dtype=DT)
            results[rank] = ("created", "")
        except ValueError as e:
            results[rank] = ("refused", str(e))
    except BaseException as e:  # report to the parent instead of dying silently
        results[rank] = ("error", repr(e))
    finally:
        dist.destroy_process_group()


def test_two_processes_on_two_hosts_refused(lib):
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    port = _free_port()
    procs = [ctx.Process(target=_topology_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        if p.is_alive():
            p.kill()
            pytest.fail("a worker did not finish within 180 s")
    for rank in (0, 1):
        status, msg = results[rank]
        assert status == "refused", (rank, status, msg)
        assert "ranks 0 on host" in msg and "ranks 1 on host node-b" in msg
        assert "Nothing was allocated or opened" in msg
