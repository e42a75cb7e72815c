"""GPU correctness suite of the world-size-1 op (algorithm local: finalize + shared add + residual
+ RMSNorm in one kernel, no all-reduce), through arfuse.local_communicator.

Every case as in test_gpu_fused.py: fresh random inputs (the seed is in the failure message),
outputs poisoned before the run, every element checked against the float64 reference of the op's
definition (arfuse.reference.fused_reference with one rank: the partial rounded once to the
activation dtype, + residual, RMSNorm), tolerances per dtype (arfuse._checks.TOL).
"""

from __future__ import annotations

import json

import pytest
import torch

import arfuse
from arfuse import _checks, reference
from arfuse.testing import LocalGroup
from fused_cases import (DTYPES, TOL, Case, bits, check_case, check_tensor, make_inputs,
                         new_seed, run_case)

pytestmark = pytest.mark.gpu

MAX_TOKENS = 256


class One:
    """A local_communicator in the shape of an emulated group of one rank (run_case's interface):
    fn runs on the current stream, nothing is deferred."""

    def __init__(self, hidden, dtype, max_tokens=MAX_TOKENS):
        self.comm = arfuse.local_communicator(max_tokens=max_tokens, hidden=hidden, dtype=dtype)
        self.device = self.comm.device
        self.world_size = 1

    def run(self, fn):
        return [fn(0, self.comm)]

    def status(self):
        return [self.comm.status()]

    def close(self):
        self.comm.close()


@pytest.fixture(scope="module")
def ones():
    cache: dict = {}

    def get(hidden, dtype):
        if (hidden, dtype) not in cache:
            cache[(hidden, dtype)] = One(hidden, dtype)
        return cache[(hidden, dtype)]

    yield get
    torch.cuda.synchronize()
    for g in cache.values():
        g.close()


def run_and_check(ones, case: Case, fp8_scale=None):
    seed = new_seed()
    group = ones(case.hidden, case.dtype)
    try:
        outs, inputs = run_case(group, case, seed, fp8_scale)
        check_case(case, outs, inputs, fp8_scale)
    except AssertionError as e:
        raise AssertionError(f"{e} (seed {seed})") from None
    return outs, inputs


def _local_specialised():
    """(dtype, hidden) of every specialised world-size-1 instance with the norm output."""
    from arfuse import _lib

    with open(_lib.manifest_path()) as f:
        m = json.load(f)
    return sorted({(i["dtype"], i["hidden"]) for i in m["instances"]
                   if i["algorithm"] == "local" and i["hidden"] and i["output"] == "norm"})


def test_the_build_has_local_instances():
    assert _local_specialised(), "the build has no specialised local instance to test"


# ---- every specialised local instance of the build, dense and permuted -------------------------
@pytest.mark.parametrize("spec", _local_specialised(), ids=lambda s: f"{s[0]}-h{s[1]}")
def test_specialised_instances(ones, spec):
    dtype, hidden = DTYPES[spec[0]], spec[1]
    assert arfuse.instance_for(dtype, hidden, 1, "local") == f"arfuse_{spec[0]}_h{hidden}_w1_local_norm"
    run_and_check(ones, Case(1, hidden, dtype, 17, "dense", 8, "f32", True, 2.5))
    run_and_check(ones, Case(1, hidden, dtype, 128, "permuted", 8, "act", True, 1.0,
                             weight_bias=1.0, absent=0.3))


# ---- token counts, including T = 0 and the capacity; auto picks local -------------------------
@pytest.mark.parametrize("algorithm", ["auto", "local"])
@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 128, MAX_TOKENS])
@pytest.mark.parametrize("shape", [(7168, "bf16"), (2880, "bf16"), (2048, "bf16"), (4096, "fp16")],
                         ids=lambda s: f"h{s[0]}-{s[1]}")
def test_token_counts(ones, shape, tokens, algorithm):
    hidden, d = shape
    case = Case(1, hidden, DTYPES[d], tokens, "permuted", 8, "f32", True, 1.0, absent=0.25,
                algorithm=algorithm)
    outs, _ = run_and_check(ones, case)
    assert outs[0][0].shape == (tokens, hidden) and outs[0][1].shape == (tokens, hidden)


# ---- input forms and options ------------------------------------------------------------------
@pytest.mark.parametrize("opt", _checks.OPTION_CASES,
                         ids=lambda o: f"{o[0]}-K{o[1]}-w{o[2]}-sh{int(o[3])}-rs{o[4]}-wb{o[5]}-g32{int(o[6])}-abs{o[7]}")
@pytest.mark.parametrize("shape", [(4096, "fp16"), (2048, "bf16"), (1536, "fp32")],
                         ids=lambda s: f"h{s[0]}-{s[1]}")
def test_forms_and_options(ones, shape, opt):
    hidden, d = shape
    layout, k, w, sh, rs, wb, g32, absent = opt
    run_and_check(ones, Case(1, hidden, DTYPES[d], 33, layout, k, w, sh, rs, wb, g32, absent))


# ---- hidden sizes without a specialised instance (the generic local instance), odd ones too ----
@pytest.mark.parametrize("shape", [(2880, "bf16"), (1536, "bf16"), (6400, "bf16"), (5120, "fp16"),
                                   (7168, "fp32"), (2880, "fp32"), (1000, "fp16"), (8, "bf16"),
                                   (4, "fp32"), (24576, "bf16"), (16384, "fp32")],
                         ids=lambda s: f"h{s[0]}-{s[1]}")
def test_generic_hidden_sizes(ones, shape):
    hidden, d = shape
    dtype = DTYPES[d]
    assert arfuse.instance_for(dtype, hidden, 1, "local") == f"arfuse_{d}_generic_local_norm"
    run_and_check(ones, Case(1, hidden, dtype, 40, "dense", 4, "f32", True, 1.0))


# ---- -0.0, subnormals, NaN and Inf propagate exactly as in the reference ------------------------
@pytest.mark.parametrize("layout", ["plain", "dense", "permuted"])
@pytest.mark.parametrize("shape", [(7168, "bf16"), (2880, "fp16"), (1536, "fp32")],
                         ids=lambda s: f"h{s[0]}-{s[1]}")
def test_special_values(ones, shape, layout):
    hidden, d = shape
    outs, _ = run_and_check(ones, Case(1, hidden, DTYPES[d], 9, layout,
                                       1 if layout == "plain" else 4,
                                       None if layout == "plain" else "f32", True, 1.0,
                                       specials=True, absent=0.2 if layout == "permuted" else 0))
    norm = outs[0][0]
    assert torch.isnan(norm[1]).all(), "a NaN in one element must make its token's norm NaN"


@pytest.mark.parametrize("d", ["bf16", "fp16", "fp32"])
def test_signed_zero_is_the_definitions(ones, d):
    """The partial is a sum (from +0.0) of weighted rows, rounded once: an all -0.0 row gives a
    +0.0 partial (IEEE: +0.0 + -0.0 = +0.0), as the reference and every algorithm give; with no
    residual, residual_out is that partial bit for bit; + a -0.0 residual stays +0.0."""
    dtype = DTYPES[d]
    H = 2048
    comm = ones(H, dtype).comm
    x = torch.full((3, H), -0.0, dtype=dtype, device="cuda")
    x[2] = torch.randn(H, device="cuda").to(dtype)
    g = torch.ones(H, dtype=dtype, device="cuda")
    plus = torch.zeros_like(x)
    plus[2] = x[2]
    _, r = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, None, g, 1e-6)
    torch.cuda.synchronize()
    assert torch.equal(bits(r), bits(plus)), "without a residual, residual_out is the partial"
    ref = reference.fused_reference([{"expert_out": x.cpu()}], None, g.cpu(), 1e-6,
                                    acc=torch.float64)[1]
    assert torch.equal(bits(r.cpu()), bits(ref)), "the reference's signed zeros"
    res = torch.full((3, H), -0.0, dtype=dtype, device="cuda")
    _, r = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, res, g, 1e-6)
    torch.cuda.synchronize()
    assert torch.equal(bits(r), bits(plus)), "+0.0 + -0.0 is +0.0"


# ---- in place (vLLM's fused_add_rms_norm contract) and without a residual ------------------------
@pytest.mark.parametrize("shape", [(7168, "bf16"), (2880, "bf16"), (4096, "fp16")],
                         ids=lambda s: f"h{s[0]}-{s[1]}")
def test_inplace(ones, shape):
    hidden, d = shape
    case = Case(1, hidden, DTYPES[d], 64, "plain", 1, None, True, 1.0, inplace=True)
    seed = new_seed()
    outs, inputs = run_case(ones(hidden, case.dtype), case, seed)
    check_case(case, outs, inputs)


@pytest.mark.parametrize("shape", [(7168, "bf16"), (2880, "fp16")], ids=lambda s: f"h{s[0]}-{s[1]}")
def test_no_residual(ones, shape):
    hidden, d = shape
    dtype = DTYPES[d]
    group = ones(hidden, dtype)
    case = Case(1, hidden, dtype, 21, "dense", 8, "f32", True, 1.0)
    ranks, _, gamma = make_inputs(case, group.device, new_seed())
    inp = ranks[0]
    n, r = arfuse.moe_finalize_allreduce_rmsnorm(
        group.comm, inp["expert_out"], None, gamma, case.eps, expert_weights=inp["expert_weights"],
        shared_out=inp["shared_out"])
    torch.cuda.synchronize()
    norm_ref, res_ref = reference.fused_reference(ranks, None, gamma, case.eps, acc=torch.float64)
    check_tensor(r, res_ref, TOL[dtype], "residual_out without residual")
    check_tensor(n, norm_ref, TOL[dtype], "norm_out without residual")


# ---- FP8 outputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [2880, 7168, 2048])
def test_fp8_static(ones, hidden):
    scale = torch.tensor([0.02], device="cuda")
    run_and_check(ones, Case(1, hidden, torch.bfloat16, 50, "permuted", 8, "f32", True, 1.0,
                             absent=0.2, fp8=True), fp8_scale=scale)


DYN_KINDS = [("fp8_token", None, False, False), ("fp8_token", 4.0, False, False),
             ("fp8_group128", None, False, False), ("fp8_group128", None, True, True)]


@pytest.mark.parametrize("tokens", [1, 37, 200])
@pytest.mark.parametrize("hidden", [7168, 2048, 1152])
@pytest.mark.parametrize("kind", DYN_KINDS, ids=lambda k: "-".join(str(x) for x in k))
def test_fp8_dynamic(ones, kind, hidden, tokens):
    quant, ub, col, ue8m0 = kind
    case = Case(1, hidden, torch.bfloat16, tokens, "permuted", 8, "f32", True, 2.5, absent=0.2,
                quant=quant, scale_ub=ub, scale_col=col, ue8m0=ue8m0,
                weight_bias=1.0 if hidden == 2048 else 0.0, gamma_f32=hidden == 1152)
    assert arfuse.instance_for(torch.bfloat16, hidden, 1, "local", quant).endswith(f"_local_{quant}")
    run_and_check(ones, case)


def test_fp8_group128_needs_whole_groups(ones):
    group = ones(2880, torch.bfloat16)
    case = Case(1, 2880, torch.bfloat16, 5, "dense", 4, "f32", True, 1.0, quant="fp8_group128")
    with pytest.raises(ValueError, match=r"hidden: 2880 is not a multiple of group_size=128"):
        run_case(group, case, new_seed())


# ---- CUDA graphs (vLLM replays its decode steps): every replay the same bits ----------------------
def test_graph_replay(ones):
    hidden, dtype = 2048, torch.bfloat16
    group = ones(hidden, dtype)
    case = Case(1, hidden, dtype, 8, "dense", 8, None, False, 1.0)
    ranks, residual, gamma = make_inputs(case, group.device, new_seed())
    rows = ranks[0]["expert_out"]
    call = lambda: arfuse.moe_finalize_allreduce_rmsnorm(group.comm, rows, residual, gamma, 1e-6)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    first = (out[0].clone(), out[1].clone())
    check_case(case, [first], (ranks, residual, gamma))
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(2000):
        graph.replay()
        bad += (bits(out[0]) != bits(first[0])).any() | (bits(out[1]) != bits(first[1])).any()
    torch.cuda.synchronize()
    assert int(bad) == 0, f"{int(bad)} of 2000 replays differed"


# ---- errors, on the host before anything is launched; nothing allocated -----------------------------
def test_errors_before_launch(ones):
    H, dtype = 2048, torch.bfloat16
    comm = ones(H, dtype).comm
    x = torch.randn(8, 4, H, device="cuda", dtype=dtype)
    r = torch.randn(8, H, device="cuda", dtype=dtype)
    g = torch.ones(H, device="cuda", dtype=dtype)
    call = arfuse.moe_finalize_allreduce_rmsnorm
    for algo in ("oneshot", "twoshot"):
        with pytest.raises(ValueError, match=f"algorithm: {algo} is an all-reduce algorithm; a "
                           "communicator of world size 1 has no all-reduce"):
            call(comm, x, r, g, 1e-6, algorithm=algo)
    with pytest.raises(ValueError, match="exceed the communicator's capacity max_tokens=256"):
        big = torch.randn(MAX_TOKENS + 1, H, device="cuda", dtype=dtype)
        call(comm, big, big, g, 1e-6)
    with pytest.raises(ValueError, match="residual: is on cpu"):
        call(comm, x, r.cpu(), g, 1e-6)
    with pytest.raises(ValueError, match="input and residual overlap in memory"):
        y = torch.randn(8, H, device="cuda", dtype=dtype)
        call(comm, y, y, g, 1e-6, inplace=True)
    with pytest.raises(ValueError, match="a communicator of world size 1 has no buffer"):
        arfuse.comm._op("comm_ipc_handle", comm.handle)
    with pytest.raises(ValueError, match="hidden: 2884 must be a positive multiple of 8"):
        arfuse.local_communicator(max_tokens=8, hidden=2884, dtype=dtype)
    with pytest.raises(ValueError, match="generic instance serves hidden <= 32768"):
        arfuse.local_communicator(max_tokens=8, hidden=40960, dtype=dtype)
    with LocalGroup(2, max_tokens=8, hidden=H, dtype=dtype) as group:
        with pytest.raises(ValueError, match="algorithm: local is the world-size-1 op; this "
                           "communicator has world size 2"):
            group.run(lambda rank, c: call(c, r, r, g, 1e-6, algorithm="local"))
        assert group.status() == [0, 0]
    assert comm.status() == 0


def test_local_communicator_allocates_nothing():
    """A world-size-1 communicator has no buffer: one of 65,536 tokens at hidden 7168 would be a
    5.6 GB Lamport buffer for an all-reduce algorithm; the local one takes no device memory."""
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    comms = [arfuse.local_communicator(max_tokens=65536, hidden=7168, dtype=torch.bfloat16)
             for _ in range(4)]
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    for c in comms:
        assert torch.ops.arfuse.comm_info(c.handle)[9] == 0
        c.close()
    assert free0 - free1 < (64 << 20), f"{(free0 - free1) >> 20} MiB taken by 4 local communicators"
