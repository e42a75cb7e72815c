"""GPU correctness suite of the fused op (one-shot and two-shot), emulated TP groups on one GPU.

Run on a GPU machine: make test-gpu (or pytest -m gpu tests with ARFUSE_LIBRARY set). Set
ARFUSE_VALIDATION_REPORT=path.json to get the per-case worst errors (docs/validation.md).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import arfuse
from arfuse.testing import LocalGroup
from fused_cases import (DTYPES, TOL, Case, bits, check_case, check_tensor, make_inputs,
                         new_seed, run_case)

pytestmark = pytest.mark.gpu

MAX_TOKENS = 256
_RESULTS: list[dict] = []


@pytest.fixture(scope="module")
def groups():
    cache: dict = {}

    def get(world, hidden, dtype, max_tokens=MAX_TOKENS, timeout_s=10.0):
        key = (world, hidden, dtype, max_tokens, timeout_s)
        if key not in cache:
            cache[key] = LocalGroup(world, max_tokens=max_tokens, hidden=hidden, dtype=dtype,
                                    timeout_s=timeout_s)
        return cache[key]

    yield get
    torch.cuda.synchronize()
    for g in cache.values():
        assert g.status() == [0] * g.world_size, "a communicator reported a timed-out wait"
        g.close()


@pytest.fixture(scope="session", autouse=True)
def report():
    yield
    path = os.environ.get("ARFUSE_VALIDATION_REPORT")
    if path and _RESULTS:
        with open(path, "w") as f:
            json.dump(_RESULTS, f, indent=1)


def run_and_check(groups, case: Case, fp8_scale=None):
    seed = new_seed()
    group = groups(case.world, case.hidden, case.dtype)
    try:
        outs, inputs = run_case(group, case, seed, fp8_scale)
        errs = check_case(case, outs, inputs, fp8_scale)
    except AssertionError as e:
        raise AssertionError(f"{e} (seed {seed})") from None
    algo = case.algorithm
    _RESULTS.append({"case": str(case), "dtype": str(case.dtype).replace("torch.", ""),
                     "world": case.world, "hidden": case.hidden, "tokens": case.tokens,
                     "algorithm": algo, "layout": case.layout, **errs})
    assert group.status() == [0] * case.world
    return outs, inputs


def _ci_specialised():
    """(dtype, hidden, world) of every specialised instance in the build's manifest."""
    from arfuse import _lib

    try:
        with open(_lib.manifest_path()) as f:
            m = json.load(f)
    except OSError:
        return []
    seen = set()
    for inst in m["instances"]:
        if inst.get("hidden") and inst.get("output", inst.get("out", "norm")) == "norm":
            seen.add((inst["dtype"], inst["hidden"], inst["world_size"]))
    return sorted(seen)


# ---- every specialised instance of the build, both algorithms, dense and permuted -------------
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("spec", _ci_specialised(), ids=lambda s: f"{s[0]}-h{s[1]}-w{s[2]}")
def test_specialised_instances(groups, spec, algorithm):
    dtype, hidden, world = DTYPES[spec[0]], spec[1], spec[2]
    assert arfuse.instance_for(dtype, hidden, world, algorithm) == \
        f"arfuse_{spec[0]}_h{hidden}_w{world}_{algorithm}_norm"
    run_and_check(groups, Case(world, hidden, dtype, 17, "dense", 8, "f32", True, 2.5,
                               algorithm=algorithm))
    run_and_check(groups, Case(world, hidden, dtype, 128, "permuted", 8, "act", True, 1.0,
                               weight_bias=1.0, absent=0.3, algorithm=algorithm))


# ---- token counts, including T = 0 and the capacity ---------------------------------------------
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot", "auto"])
@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 128, MAX_TOKENS])
@pytest.mark.parametrize("shape", [(8, 7168, "bf16"), (4, 2880, "bf16"), (2, 2048, "bf16")],
                         ids=lambda s: f"w{s[0]}-h{s[1]}-{s[2]}")
def test_token_counts(groups, shape, tokens, algorithm):
    world, hidden, d = shape
    case = Case(world, hidden, DTYPES[d], tokens, "permuted", 8, "f32", True, 1.0, absent=0.25,
                algorithm=algorithm)
    outs, _ = run_and_check(groups, case)
    assert all(o[0].shape == (tokens, hidden) for o in outs)


# ---- input forms and options ---------------------------------------------------------------
OPTION_CASES = [
    # layout, K, weights, shared, routed_scaling, weight_bias, gamma_f32, absent
    ("plain", 1, None, True, 1.0, 0.0, False, 0.0),
    ("plain", 1, None, False, 2.5, 1.0, True, 0.0),
    ("dense", 1, "f32", False, 1.0, 0.0, False, 0.0),
    ("dense", 2, "act", True, 1.0, 1.0, False, 0.0),
    ("dense", 4, None, True, 2.5, 0.0, True, 0.0),
    ("dense", 8, "f32", False, 1.0, 0.0, False, 0.0),
    ("dense", 10, "act", True, 2.5, 1.0, True, 0.0),
    ("permuted", 1, "f32", True, 1.0, 0.0, False, 0.5),
    ("permuted", 2, None, False, 1.0, 1.0, False, 0.0),
    ("permuted", 4, "act", True, 2.5, 0.0, True, 0.3),
    ("permuted", 8, "f32", True, 2.5, 1.0, False, 0.6),
    ("permuted", 10, "act", False, 1.0, 0.0, True, 0.2),
    ("permuted", 8, "f32", True, 1.0, 0.0, False, 1.0),  # no expert of any token on any rank
]


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("opt", OPTION_CASES, ids=lambda o: f"{o[0]}-K{o[1]}-w{o[2]}-sh{int(o[3])}-rs{o[4]}-wb{o[5]}-g32{int(o[6])}-abs{o[7]}")
@pytest.mark.parametrize("shape", [(4, 4096, "fp16"), (8, 2048, "bf16"), (2, 1536, "fp32")],
                         ids=lambda s: f"w{s[0]}-h{s[1]}-{s[2]}")
def test_forms_and_options(groups, shape, opt, algorithm):
    world, hidden, d = shape
    layout, k, w, sh, rs, wb, g32, absent = opt
    run_and_check(groups, Case(world, hidden, DTYPES[d], 33, layout, k, w, sh, rs, wb, g32, absent,
                               algorithm=algorithm))


# ---- hidden sizes without a specialised instance (generic path), all dtypes and world sizes ----
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("shape", [(4, 2880, "bf16"), (2, 1536, "bf16"), (8, 6400, "bf16"),
                                   (4, 2880, "fp16"), (8, 5120, "fp16"), (2, 7168, "fp32"),
                                   (4, 2880, "fp32"), (8, 1000, "fp16"), (2, 24576, "bf16")],
                         ids=lambda s: f"w{s[0]}-h{s[1]}-{s[2]}")
def test_generic_hidden_sizes(groups, shape, algorithm):
    world, hidden, d = shape
    dtype = DTYPES[d]
    name = arfuse.instance_for(dtype, hidden, world, algorithm)
    assert name is not None
    run_and_check(groups, Case(world, hidden, dtype, 40, "dense", 4, "f32", True, 1.0,
                               algorithm=algorithm))


# ---- -0.0, subnormals, NaN and Inf propagate exactly as in the reference ------------------------
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("layout", ["plain", "dense", "permuted"])
@pytest.mark.parametrize("shape", [(8, 7168, "bf16"), (4, 2880, "fp16"), (2, 1536, "fp32")],
                         ids=lambda s: f"w{s[0]}-h{s[1]}-{s[2]}")
def test_special_values(groups, shape, layout, algorithm):
    world, hidden, d = shape
    outs, _ = run_and_check(groups, Case(world, hidden, DTYPES[d], 9, layout,
                                         1 if layout == "plain" else 4,
                                         None if layout == "plain" else "f32", True, 1.0,
                                         specials=True, absent=0.2 if layout == "permuted" else 0,
                                         algorithm=algorithm))
    norm = outs[0][0]
    assert torch.isnan(norm[1]).all(), "a NaN in one element must make its token's norm NaN"


# ---- in place (vLLM's fused_add_rms_norm contract) ----------------------------------------------
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("shape", [(8, 7168, "bf16"), (4, 2880, "bf16")],
                         ids=lambda s: f"w{s[0]}-h{s[1]}-{s[2]}")
def test_inplace(groups, shape, algorithm):
    world, hidden, d = shape
    case = Case(world, hidden, DTYPES[d], 64, "plain", 1, None, True, 1.0, inplace=True,
                algorithm=algorithm)
    group = groups(world, hidden, case.dtype)
    seed = new_seed()
    outs, inputs = run_case(group, case, seed)
    check_case(case, outs, inputs)


# ---- one-shot and two-shot: the same residual_out bit for bit (both sum the ranks' partials in
# rank order, then add the residual), norm_out within the dtype's tolerance of each other (their
# plans differ -- one-shot splits a row over a cluster, two-shot gives it one CTA -- so the sum of
# squares is reduced in a different order) --------------------------------------------------------
@pytest.mark.parametrize("shape", [(8, 7168, "bf16"), (4, 4096, "fp16"), (4, 2880, "bf16"),
                                   (2, 1536, "fp32")], ids=lambda s: f"w{s[0]}-h{s[1]}-{s[2]}")
def test_oneshot_matches_twoshot(groups, shape):
    world, hidden, d = shape
    dtype = DTYPES[d]
    group = groups(world, hidden, dtype)
    seed = new_seed()
    res = {}
    for algo in ("oneshot", "twoshot"):
        case = Case(world, hidden, dtype, 77, "permuted", 8, "f32", True, 2.5, absent=0.3,
                    algorithm=algo)
        outs, _ = run_case(group, case, seed)
        res[algo] = outs[0]
    one, two = res["oneshot"][0].double(), res["twoshot"][0].double()
    assert torch.equal(one.isnan(), two.isnan()), f"seed {seed}"
    err = ((one - two).norm() / one.norm()).item()
    assert err <= TOL[dtype], f"seed {seed}: norm_out one-shot vs two-shot rel err {err:.3g}"
    assert torch.equal(bits(res["oneshot"][1]), bits(res["twoshot"][1])), f"seed {seed}"


# ---- FP8 static output ---------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("shape", [(4, 2880), (2, 7168), (8, 2048)], ids=lambda s: f"w{s[0]}-h{s[1]}")
def test_fp8_static(groups, shape, algorithm):
    world, hidden = shape
    scale = torch.tensor([0.02], device="cuda")
    run_and_check(groups, Case(world, hidden, torch.bfloat16, 50, "permuted", 8, "f32", True, 1.0,
                               absent=0.2, fp8=True, algorithm=algorithm), fp8_scale=scale)


# ---- the standalone finalize kernel (the unfused pipeline's first step) -------------------------
@pytest.mark.parametrize("layout", ["plain", "dense", "permuted"])
@pytest.mark.parametrize("d", ["bf16", "fp16", "fp32"])
def test_moe_finalize(d, layout):
    from arfuse import reference

    dtype = DTYPES[d]
    case = Case(1, 2880, dtype, 37, layout, 1 if layout == "plain" else 8,
                None if layout == "plain" else "f32", True, 2.5, absent=0.3)
    (inp,), _, _ = make_inputs(case, torch.device("cuda"), new_seed())
    out = arfuse.moe_finalize(inp["expert_out"], num_tokens=37,
                              permuted_idx=inp.get("permuted_idx"),
                              expert_weights=inp.get("expert_weights"),
                              shared_out=inp.get("shared_out"), routed_scaling=2.5)
    ref = reference.finalize(inp["expert_out"], num_tokens=37, permuted_idx=inp.get("permuted_idx"),
                             expert_weights=inp.get("expert_weights"),
                             shared_out=inp.get("shared_out"), routed_scaling=2.5,
                             acc=torch.float64)
    check_tensor(out, ref, TOL[dtype], f"finalize {d} {layout}")


# ---- a captured CUDA graph replayed 10,000 times: same result every time, no hang ---------------
@pytest.mark.slow
def test_graph_replay_10000(groups):
    world, hidden, dtype = 4, 4096, torch.float16
    group = groups(world, hidden, dtype)
    case = Case(world, hidden, dtype, 17, "permuted", 8, "f32", True, 1.0, absent=0.2)
    ranks, residual, gamma = make_inputs(case, group.device, new_seed())

    def fn(rank, comm):
        inp = ranks[rank]
        return arfuse.moe_finalize_allreduce_rmsnorm(
            comm, inp["expert_out"], residual, gamma, case.eps, permuted_idx=inp["permuted_idx"],
            expert_weights=inp["expert_weights"], shared_out=inp["shared_out"])

    group.run(fn)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = group.run(fn)
    graph.replay()
    torch.cuda.synchronize()
    first = [(o[0].clone(), o[1].clone()) for o in outs]
    check_case(case, first, (ranks, residual, gamma))
    mismatches = 0
    t0 = time.time()
    for _ in range(10_000):
        graph.replay()
        same = torch.stack([(bits(o[0]) == bits(f[0])).all() & (bits(o[1]) == bits(f[1])).all()
                            for o, f in zip(outs, first)]).all()
        mismatches += int(not bool(same))
    torch.cuda.synchronize()
    assert mismatches == 0, f"{mismatches} of 10000 replays differed"
    assert group.status() == [0] * world
    print(f"10000 replays in {time.time() - t0:.1f} s")


# ---- errors: raised on the host, before anything is launched ------------------------------------
def test_errors_before_launch(groups):
    world, hidden, dtype = 2, 2048, torch.bfloat16
    group = groups(world, hidden, dtype)
    comm = group.comms[0]
    dev = group.device
    T = 8
    x = torch.randn(T, 4, hidden, device=dev, dtype=dtype)
    r = torch.randn(T, hidden, device=dev, dtype=dtype)
    g = torch.ones(hidden, device=dev, dtype=dtype)
    call = arfuse.moe_finalize_allreduce_rmsnorm
    with pytest.raises(ValueError, match="exceed the communicator's capacity"):
        big = torch.randn(MAX_TOKENS + 1, hidden, device=dev, dtype=dtype)
        call(comm, big, big, g, 1e-6)
    with pytest.raises(ValueError, match="residual: is on cpu"):
        call(comm, x, r.cpu(), g, 1e-6)
    with pytest.raises(ValueError, match="expert_out: must be contiguous"):
        call(comm, x.transpose(0, 1), r, g, 1e-6)
    with pytest.raises(TypeError, match="expert_out: dtype Half does not match"):
        call(comm, x.half(), r, g, 1e-6)
    with pytest.raises(ValueError, match="gamma: want"):
        call(comm, x, r, g[:-8], 1e-6)
    with pytest.raises(ValueError, match="hidden size 1024 does not match"):
        call(comm, x[..., :1024].contiguous(), r[:, :1024].contiguous(), g[:1024], 1e-6)
    with pytest.raises(ValueError, match="one-shot with 200 tokens exceeds"):
        small = LocalGroup(2, max_tokens=256, hidden=hidden, dtype=dtype, oneshot_max_tokens=64)
        try:
            y = torch.randn(200, hidden, device=dev, dtype=dtype)
            call(small.comms[0], y, y, g, 1e-6, algorithm="oneshot")
        finally:
            small.close()
    with pytest.raises(ValueError, match="hidden: 2884 must be a positive multiple of 8"):
        LocalGroup(2, max_tokens=16, hidden=2884, dtype=dtype)
    with pytest.raises(ValueError, match="generic instance serves hidden <= 32768"):
        LocalGroup(2, max_tokens=16, hidden=40960, dtype=dtype)
    assert group.status() == [0, 0]


# ---- a rank that never arrives: the kernel gives up, outputs NaN, the communicator is broken ----
def test_mismatched_ranks_time_out_instead_of_hanging():
    world, hidden, dtype = 2, 2048, torch.bfloat16
    with LocalGroup(world, max_tokens=64, hidden=hidden, dtype=dtype, timeout_s=0.5) as group:
        dev = group.device
        g = torch.ones(hidden, device=dev, dtype=dtype)
        xs = [torch.randn(t, hidden, device=dev, dtype=dtype) for t in (4, 3)]
        t0 = time.time()
        outs = group.run(lambda rank, comm: arfuse.moe_finalize_allreduce_rmsnorm(
            comm, xs[rank], xs[rank], g, 1e-6, algorithm="oneshot"))
        torch.cuda.synchronize()
        elapsed = time.time() - t0
        assert elapsed < 5.0, f"took {elapsed:.1f} s"
        assert group.comms[0].status() == 2, "rank 0 must report waiting for rank 1"
        assert torch.isnan(outs[0][0][3]).all(), "the token rank 1 never sent must be NaN"
        with pytest.raises(RuntimeError, match="communicator is broken"):
            arfuse.moe_finalize_allreduce_rmsnorm(group.comms[0], xs[0], xs[0], g, 1e-6)


# ---- no residual (vLLM's first layer: all-reduce -> rms_norm) ------------------------------------
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("shape", [(8, 7168, "bf16"), (4, 2880, "fp16")],
                         ids=lambda s: f"w{s[0]}-h{s[1]}-{s[2]}")
def test_no_residual(groups, shape, algorithm):
    from arfuse import reference

    world, hidden, d = shape
    dtype = DTYPES[d]
    group = groups(world, hidden, dtype)
    case = Case(world, hidden, dtype, 21, "plain", 1, None, True, 1.0, algorithm=algorithm)
    ranks, _, gamma = make_inputs(case, group.device, new_seed())
    outs = group.run(lambda rank, comm: arfuse.moe_finalize_allreduce_rmsnorm(
        comm, ranks[rank]["expert_out"], None, gamma, case.eps,
        shared_out=ranks[rank]["shared_out"], algorithm=algorithm))
    torch.cuda.synchronize()
    norm_ref, res_ref = reference.fused_reference(ranks, None, gamma, case.eps, acc=torch.float64)
    for n, r in outs:
        assert torch.equal(bits(n), bits(outs[0][0])) and torch.equal(bits(r), bits(outs[0][1]))
    check_tensor(outs[0][1], res_ref, TOL[dtype], "residual_out without residual")
    check_tensor(outs[0][0], norm_ref, TOL[dtype], "norm_out without residual")
