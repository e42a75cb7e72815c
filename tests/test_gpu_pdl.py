"""GPU tests of programmatic dependent launch (Communicator.pdl): the fused kernel launched as a
programmatic dependent of the kernel before it on the stream must read that kernel's output, never
what its input held before.

The upstream kernel here (tests/pdl_producer.cu, compiled with nvcc) lets its dependents start at
once (griddepcontrol.launch_dependents as its first instruction), then spins 200 us and only then
writes the expert rows the fused call reads. A fused kernel that read before its
griddepcontrol.wait would see the stale rows (a different random tensor) and fail the float64
reference check. A control consumer without the wait is run first and must see the stale data:
that shows the early start is real on this machine, so the checks below could fail. Where it is
not (on an H100 with CUDA_DEVICE_MAX_CONNECTIONS=32, the count an emulated group of 8 ranks needs,
a single try did not start early in four runs out of four, three tries did in the fifth; with 8
one try did in three runs out of three), the control is skipped with the reason and the calls
below check only what they still can: the results and PDL's bits against a plain launch's.
scripts/gpu-check.sh runs this file a second time with 8 connections (world sizes up to 4:
LocalGroup needs 2 per rank) and ARFUSE_PDL_REQUIRE_EARLY=1, under which the control fails
instead of skipping.
Fresh random inputs every run (the seed is in the failure message), outputs poisoned (eager: the
blocks the op allocates; graph: the graph's output tensors before each replay), every element
checked, tolerances per dtype (arfuse._checks.TOL); and PDL's outputs bitwise equal to a plain
launch's.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess

import pytest
import torch

import arfuse
from arfuse import _checks
from arfuse.testing import LocalGroup
from fused_cases import Case, make_inputs, new_seed, poison_like

pytestmark = pytest.mark.gpu

SPIN_NS = 200_000  # the producer's delay before it writes (the fused kernel takes < 50 us here)
HERE = os.path.dirname(os.path.abspath(__file__))


def _cudart_dir() -> str | None:
    hits = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "lib",
                                  "libcudart.so*"))
    return os.path.dirname(os.path.abspath(hits[0])) if hits else None


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or \
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip(f"needs nvcc to build tests/pdl_producer.cu (not found: {nvcc}; set NVCC)")
    out = tmp_path_factory.mktemp("pdl") / "pdl_producer.so"
    cudart = _cudart_dir()
    link = [f"-L{cudart}", "-l:libcudart.so.13"] if cudart else ["-lcudart"]
    cmd = [nvcc, "-std=c++17", "-O2", "-gencode", "arch=compute_90,code=sm_90", "-Xcompiler",
           "-fPIC", "-shared", "-cudart", "none", os.path.join(HERE, "pdl_producer.cu"),
           *link, "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}"
    lib = ctypes.CDLL(str(out))
    lib.produce_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_void_p]
    lib.consume_launch_pdl.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                       ctypes.c_void_p]
    return lib


def produce(lib, src: torch.Tensor, dst: torch.Tensor):
    """dst <- src by the early-triggering producer, on the current stream."""
    assert src.is_contiguous() and dst.is_contiguous() and src.nbytes == dst.nbytes
    err = lib.produce_launch(src.data_ptr(), dst.data_ptr(), src.nbytes, SPIN_NS,
                             torch.cuda.current_stream().cuda_stream)
    assert err == 0, f"producer launch failed (cudaError {err})"


@pytest.fixture
def side_stream():
    """Every test runs on a stream of its own: the legacy default stream, with its implicit
    synchronisation, is no place for a programmatic dependent launch (on the H100 a dependent
    launched there did not start early)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        yield s
    torch.cuda.current_stream().wait_stream(s)


def _connections() -> str:
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8 (unset)")


def _control_once(producer) -> bool:
    """One producer + no-wait consumer pair; True when the consumer read only the stale data."""
    g = torch.Generator(device="cuda")
    g.manual_seed(new_seed())
    src = torch.randint(1, 1 << 30, (1 << 16,), generator=g, device="cuda", dtype=torch.int32)
    dst = torch.randint(1, 1 << 30, (1 << 16,), generator=g, device="cuda", dtype=torch.int32)
    stale = dst.clone()
    out = torch.full_like(src, -1)
    produce(producer, src, dst)
    err = producer.consume_launch_pdl(dst.data_ptr(), out.data_ptr(), dst.nbytes,
                                      torch.cuda.current_stream().cuda_stream)
    assert err == 0, f"consumer launch failed (cudaError {err})"
    torch.cuda.synchronize()
    assert torch.equal(dst, src), "the producer did not write its output"
    assert not (out == -1).any(), "the control consumer did not write every element"
    return torch.equal(out, stale)


@pytest.fixture(scope="module")
def early_start(producer):
    """Whether a programmatic dependent starts before its producer finishes on this machine, in
    this process's stream configuration (three tries: one is enough)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        seen = any(_control_once(producer) for _ in range(3))
    torch.cuda.current_stream().wait_stream(s)
    return seen


def test_control_consumer_without_wait_reads_early(producer, early_start):
    """The premise: a programmatic dependent that does not wait runs before the producer writes.
    Skipped, with the reason, where the device does not start dependents early: then nothing
    this file checks could see a kernel that reads before its wait."""
    if not early_start and os.environ.get("ARFUSE_PDL_REQUIRE_EARLY") == "1":
        pytest.fail("ARFUSE_PDL_REQUIRE_EARLY=1: a programmatic dependent without "
                    "griddepcontrol.wait read the producer's output, not the stale data, in 3 "
                    f"tries (CUDA_DEVICE_MAX_CONNECTIONS={_connections()}): the dependent did not "
                    "start early")
    if not early_start:
        pytest.skip("a programmatic dependent did not start early here in 3 tries "
                    f"(CUDA_DEVICE_MAX_CONNECTIONS={_connections()}; on the H100 it did with 8, "
                    "not always with 32): the read-order checks of this file cannot fail in this "
                    "process; scripts/gpu-check.sh runs the file again with 8")
    assert early_start


class Single:
    """A world-size-1 communicator shaped like LocalGroup (run, close)."""

    def __init__(self, hidden, dtype, max_tokens):
        self.comms = [arfuse.local_communicator(max_tokens=max_tokens, hidden=hidden, dtype=dtype)]

    def run(self, fn):
        return [fn(0, self.comms[0])]

    def close(self):
        self.comms[0].close()


def _group(case: Case):
    if case.world == 1:
        return Single(case.hidden, case.dtype, case.tokens)
    return LocalGroup(case.world, max_tokens=case.tokens, hidden=case.hidden, dtype=case.dtype)


CASES = [
    Case(1, 2048, torch.bfloat16, 16, layout="permuted", absent=0.1),
    Case(1, 7168, torch.bfloat16, 3, layout="dense"),
    Case(1, 2880, torch.float16, 257, layout="permuted", topk=4, absent=0.2),
    Case(2, 2048, torch.bfloat16, 5, layout="permuted", absent=0.1, algorithm="oneshot"),
    Case(4, 2880, torch.bfloat16, 64, layout="permuted", topk=4, absent=0.1, algorithm="twoshot"),
    Case(8, 7168, torch.bfloat16, 1, layout="permuted", absent=0.1, algorithm="oneshot"),
    Case(2, 4096, torch.bfloat16, 300, layout="dense", algorithm="auto"),
]


def _fused(comm, case: Case, inp: dict, expert_out, residual, gamma):
    return arfuse.moe_finalize_allreduce_rmsnorm(
        comm, expert_out, residual, gamma, case.eps, permuted_idx=inp.get("permuted_idx"),
        expert_weights=inp.get("expert_weights"), shared_out=inp.get("shared_out"),
        routed_scaling=case.routed_scaling, weight_bias=case.weight_bias,
        algorithm=case.algorithm)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pdl_call_reads_the_producers_rows(producer, side_stream, case, mode):
    """The fused call as a programmatic dependent of the producer: the float64 check and PDL's
    bits against a plain launch's. It can catch a read before the wait only where the control
    above passed (early_start); elsewhere it still checks the results of a PDL launch."""
    conns = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if case.world > 1 and conns is not None and int(conns) < 2 * case.world:
        pytest.skip(f"world size {case.world} needs CUDA_DEVICE_MAX_CONNECTIONS >= "
                    f"{2 * case.world} (LocalGroup), this process has {conns}")
    seed = new_seed()
    ranks, residual, gamma = make_inputs(case, torch.device("cuda"), seed)
    g = torch.Generator(device="cuda")
    g.manual_seed(seed + 1)
    # What the expert rows held before the producer ran: other random values of the same shape.
    stale = [torch.randn(r["expert_out"].shape, generator=g, device="cuda").to(case.dtype)
             for r in ranks]
    rows = [s.clone() for s in stale]  # what the producer writes and the fused call reads
    group = _group(case)
    try:
        for c in group.comms:
            assert c.pdl is False, "a new communicator must launch plainly"
            c.pdl = True
            assert c.pdl is True

        def fn(rank, comm):
            inp = ranks[rank]
            produce(producer, inp["expert_out"], rows[rank])
            if mode == "graph":
                return _fused(comm, case, inp, rows[rank], residual, gamma)
            poisoned = [poison_like((case.tokens, case.hidden), case.dtype, "cuda")
                        for _ in range(2)]
            ptrs = sorted(t.data_ptr() for t in poisoned)
            del poisoned
            out = _fused(comm, case, inp, rows[rank], residual, gamma)
            assert sorted(o.data_ptr() for o in out) == ptrs, "poisoning missed the outputs"
            return out

        if mode == "eager":
            with _checks.gc_held():
                outs = group.run(fn)
        else:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    outs = group.run(fn)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            for _ in range(2):  # every replay starts from the stale rows and poisoned outputs
                for r, s in zip(rows, stale):
                    r.copy_(s)
                for out in outs:
                    for o in out:
                        o.view(torch.uint8).fill_(0xFF)
                graph.replay()
        torch.cuda.synchronize()
        assert all(c.status() == 0 for c in group.comms), "a wait timed out"
        assert all(torch.equal(r["expert_out"], w) for r, w in zip(ranks, rows)), \
            "the producer did not write the rows"
        try:
            _checks.check_case(case, outs, (ranks, residual, gamma))
        except AssertionError as e:
            raise AssertionError(f"{e} (seed {seed})") from None
        # The same call launched plainly (the producer's rows in place): the same bits.
        for c in group.comms:
            c.pdl = False
        plain = group.run(lambda rank, comm: _fused(comm, case, ranks[rank], rows[rank],
                                                    residual, gamma))
        torch.cuda.synchronize()
        for got, want in zip(outs, plain):
            for a, b in zip(got, want):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
                    f"PDL and plain launches differ (seed {seed})"
    finally:
        torch.cuda.synchronize()
        group.close()
