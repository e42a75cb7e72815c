"""Bad input and misuse on the CPU (issue 14): what the world-size-1 CPU path and the
Communicator constructor refuse, before anything is written, allocated or opened; and that the
CPU path gives what the GPU gives for inputs that are valid but unusual. The GPU side of the same
items is in test_gpu_misuse.py."""

from __future__ import annotations

import pytest
import torch

import arfuse
from arfuse import comm as comm_mod
from arfuse import reference
from arfuse.comm import cpu_communicator

H = 64


def rand(*shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, dtype=torch.float32) + 0.5).to(dtype)  # never all zeros


@pytest.fixture
def comm(lib):
    with cpu_communicator(max_tokens=16, hidden=H, dtype=torch.bfloat16) as c:
        yield c


# ---- item 1: aliased buffers ---------------------------------------------------------------------

def aliased_cases():
    """(name, make) -> the in-place call's (input, residual, shared_out, gamma) with an overlap
    between a written buffer and another argument."""
    def same():
        x = rand(4, H)
        return x, x, None, rand(H)

    def overlapping_rows():
        buf = rand(8, H)
        return buf[0:4], buf[2:6], None, rand(H)

    def shared_is_input():
        x = rand(4, H)
        return x, rand(4, H), x, rand(H)

    def gamma_in_residual():
        r = rand(4, H)
        return rand(4, H), r, None, r[1]

    return {"input is residual": (same, "input", "residual"),
            "overlapping views": (overlapping_rows, "input", "residual"),
            "shared_out is input": (shared_is_input, "input", "shared_out"),
            "gamma inside residual": (gamma_in_residual, "residual", "gamma")}


@pytest.mark.parametrize("case", sorted(aliased_cases()))
def test_inplace_refuses_aliased_buffers(comm, case):
    make, a, b = aliased_cases()[case]
    x, r, s, g = make()
    before = (x.clone(), r.clone())
    with pytest.raises(ValueError, match=f"{a}.*{b}|{b}.*{a}") as e:
        arfuse.moe_finalize_allreduce_rmsnorm(comm, x, r, g, 1e-6, shared_out=s, inplace=True)
    assert "overlap" in str(e.value)
    assert torch.equal(x, before[0]) and torch.equal(r, before[1]), "written before the error"


def test_inplace_distinct_views_of_one_buffer_are_fine(comm):
    buf = rand(8, H)
    x, r = buf[0:4], buf[4:8]
    want_norm, want_res = arfuse.moe_finalize_allreduce_rmsnorm(comm, x.clone(), r.clone(),
                                                                torch.ones(H, dtype=torch.bfloat16),
                                                                1e-6)
    arfuse.moe_finalize_allreduce_rmsnorm(comm, x, r, torch.ones(H, dtype=torch.bfloat16), 1e-6,
                                          inplace=True)
    assert torch.equal(x, want_norm) and torch.equal(r, want_res)


# ---- item 2: in place without a residual ---------------------------------------------------------

def test_inplace_without_residual_is_refused_before_writing(comm):
    x = rand(4, H)
    before = x.clone()
    with pytest.raises(ValueError, match="residual: inplace=True writes residual_out"):
        arfuse.moe_finalize_allreduce_rmsnorm(comm, x, None, rand(H), 1e-6, inplace=True)
    assert torch.equal(x, before)
    # The op itself, called without a residual tensor, refuses too (nothing written).
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.arfuse.fused_inplace(x, None, None, rand(H), 1e-6, 0.0, 1.0, comm.handle, 0)
    assert torch.equal(x, before)


def test_missing_required_tensor_names_it(comm):
    x = rand(4, H)
    with pytest.raises(RuntimeError, match="ValueError: arfuse: gamma: a tensor is required"):
        torch.ops.arfuse.fused(x, None, None, None, x, None, 1e-6, 0.0, 1.0, None, comm.handle, 0)


# ---- item 3: the CPU path gives what the GPU gives ------------------------------------------------

def test_rank_without_any_expert_rows(comm):
    """0 permuted rows, every index -1: valid (this rank holds none of the tokens' experts); the
    partial is the shared output alone (here: none, so 0), as on the GPU."""
    T, K = 3, 4
    r, g, s = rand(T, H), rand(H), rand(T, H)
    rows = torch.empty(0, H, dtype=torch.bfloat16)
    idx = torch.full((T, K), -1, dtype=torch.int32)
    w = torch.rand(T, K)
    norm, res = arfuse.moe_finalize_allreduce_rmsnorm(comm, rows, r, g, 1e-6, permuted_idx=idx,
                                                      expert_weights=w)
    assert torch.equal(res, r)
    norm, res = arfuse.moe_finalize_allreduce_rmsnorm(comm, rows, r, g, 1e-6, permuted_idx=idx,
                                                      expert_weights=w, shared_out=s)
    assert torch.equal(res, (s.double() + r.double()).to(torch.bfloat16))
    want = reference.rmsnorm(res, g, 1e-6, 0.0, acc=torch.float64).to(torch.bfloat16)
    assert torch.equal(norm, want) or (norm.float() - want.float()).abs().max() <= 2 ** -7 * want.abs().max()


def test_out_of_range_index_gives_nan_for_that_token_only(comm):
    """An index outside [-1, P): the kernel makes that token's outputs NaN; so does the CPU path,
    with P = 0 rows too."""
    T, P = 4, 5
    r, g = rand(T, H), rand(H)
    for rows, idx in ((rand(P, H), [[0, 1], [P, -1], [-2, 3], [4, -1]]),
                      (torch.empty(0, H, dtype=torch.bfloat16), [[-1, -1], [0, -1], [-1, -1], [-1, 7]])):
        idx = torch.tensor(idx, dtype=torch.int32)
        bad = ((idx < -1) | (idx >= rows.shape[0])).any(dim=1)
        norm, res = arfuse.moe_finalize_allreduce_rmsnorm(comm, rows, r, g, 1e-6, permuted_idx=idx)
        assert torch.equal(norm.isnan().all(dim=1), bad) and torch.equal(res.isnan().all(dim=1), bad)
        assert not norm[~bad].isnan().any() and not res[~bad].isnan().any()


# ---- item 7: errors name the argument that is wrong ----------------------------------------------

def test_residual_of_the_wrong_length_is_named(comm):
    T, K, P = 5, 2, 10
    rows, idx = rand(P, H), torch.randint(0, P, (T, K), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"residual: want \[T=5, H=64\] \(T from permuted_idx\), got \[4, 64\]"):
        arfuse.moe_finalize_allreduce_rmsnorm(comm, rows, rand(T - 1, H), rand(H), 1e-6,
                                              permuted_idx=idx)
    with pytest.raises(ValueError, match=r"residual: want \[T=5, H=64\] \(T from expert_out\), got \[5, 32\]"):
        arfuse.moe_finalize_allreduce_rmsnorm(comm, rand(T, K, H), rand(T, 32), rand(H), 1e-6)
    with pytest.raises(ValueError, match=r"shared_out: want \[T=5, H=64\], got \[4, 64\]"):
        arfuse.moe_finalize_allreduce_rmsnorm(comm, rand(T, H), rand(T, H), rand(H), 1e-6,
                                              shared_out=rand(T - 1, H))


# ---- item 6: topologies the kernel cannot serve --------------------------------------------------

def topo(host, gpu, visible, no_peer=()):
    return {"host": host, "hostname": f"node-{host}", "gpu": gpu, "bus": f"0000:{gpu}:00",
            "access": {v: v not in no_peer for v in visible}}


def test_topology_problems():
    gpus = [f"{i:02x}" for i in range(8)]
    one_node = [topo("a", g, gpus) for g in gpus]
    assert comm_mod.topology_problems(one_node) == []
    # Two processes on one GPU (the IPC test) are fine.
    assert comm_mod.topology_problems([topo("a", "00", ["00"]), topo("a", "00", ["00"])]) == []
    # Tensor parallelism 16 over two 8-GPU nodes.
    two_nodes = one_node + [topo("b", g, gpus) for g in gpus]
    (p,) = comm_mod.topology_problems(two_nodes)
    assert "2 hosts" in p and "ranks 0, 1, 2, 3, 4, 5, 6, 7 on host node-a" in p
    assert "ranks 8, 9, 10, 11, 12, 13, 14, 15 on host node-b" in p
    # GPUs without P2P between them, and a peer's GPU hidden from a process.
    no_p2p = [topo("a", "00", ["00", "01"], no_peer=("01",)), topo("a", "01", ["00", "01"])]
    (p,) = comm_mod.topology_problems(no_p2p)
    assert p == ("rank 0's GPU (0000:00:00) cannot access rank 1's GPU (0000:01:00) as a peer "
                 "(no P2P between them)")
    hidden = [topo("a", "00", ["00"]), topo("a", "01", ["00", "01"])]
    (p,) = comm_mod.topology_problems(hidden)
    assert p.startswith("rank 1's GPU (0000:01:00) is not visible to rank 0's process")


def test_communicator_refuses_two_hosts_before_allocating(lib, monkeypatch):
    """A stand-in group of 2 ranks on 2 hosts: the constructor raises on every rank, naming the
    ranks and the reason, before it creates (allocates) anything."""
    import torch.distributed as dist

    infos = [topo("a", "00", ["00"]), topo("b", "00", ["00"])]
    created = []
    for rank in (0, 1):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(comm_mod, "local_topology", lambda device, r=rank: infos[r])

        def gather(out, obj, group=None):
            out[:] = infos

        monkeypatch.setattr(dist, "all_gather_object", gather)
        monkeypatch.setattr(comm_mod, "_op", lambda *a: created.append(a))
        with pytest.raises(ValueError) as e:
            arfuse.Communicator(object(), max_tokens=8, hidden=H, dtype=torch.bfloat16,
                                device="cpu")
        assert "group of 2 ranks not supported" in str(e.value)
        assert "ranks 0 on host node-a; ranks 1 on host node-b" in str(e.value)
        assert "Nothing was allocated or opened" in str(e.value)
    assert created == []


# ---- programmatic dependent launch (Communicator.pdl) -------------------------------------------

def test_pdl_is_off_and_refused_on_a_cpu_communicator(comm):
    assert comm.pdl is False
    with pytest.raises(ValueError, match=r"pdl: a CPU communicator launches no kernels"):
        comm.pdl = True
    assert comm.pdl is False  # nothing changed
    with pytest.raises(TypeError, match=r"pdl: want a bool, got int"):
        comm.pdl = 1


def test_pdl_of_a_closed_communicator_names_it(lib):
    c = cpu_communicator(max_tokens=4, hidden=H, dtype=torch.bfloat16)
    handle = c.handle
    c.close()
    with pytest.raises(ValueError, match=r"closed"):
        c.pdl
    with pytest.raises(ValueError, match=rf"comm: {handle}"):
        comm_mod._op("comm_set_pdl", handle, True)
