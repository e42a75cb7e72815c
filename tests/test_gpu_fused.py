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
from arfuse import _checks
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
    entry = {"case": str(case), "dtype": str(case.dtype).replace("torch.", ""),
             "world": case.world, "hidden": case.hidden, "tokens": case.tokens,
             "algorithm": algo, "layout": case.layout, **errs}
    if case.quant:
        # norm_out: worst FP8 code distance (ulp); scales: worst relative error of the scales.
        entry.update(quant=case.quant, scale_layout="col" if case.scale_col else "row",
                     ue8m0=case.ue8m0, scale_ub=case.scale_ub)
    _RESULTS.append(entry)
    assert group.status() == [0] * case.world
    return outs, inputs


def _manifest_instances():
    from arfuse import _lib

    try:
        with open(_lib.manifest_path()) as f:
            return json.load(f)["instances"]
    except OSError:
        return []


def _ci_specialised():
    """(dtype, hidden, world, algorithm) of every specialised norm instance in the build's
    manifest (token splits' twins: test_token_split_twins)."""
    seen = set()
    for inst in _manifest_instances():
        if inst.get("hidden") and inst.get("output", inst.get("out", "norm")) == "norm" and \
                inst["algorithm"] != "local" and not inst.get("max_tokens"):  # local: test_gpu_local
            seen.add((inst["dtype"], inst["hidden"], inst["world_size"], inst["algorithm"]))
    return sorted(seen)


# ---- every specialised instance of the build, dense and permuted ------------------------------
@pytest.mark.parametrize("spec", _ci_specialised(), ids=lambda s: f"{s[0]}-h{s[1]}-w{s[2]}-{s[3]}")
def test_specialised_instances(groups, spec):
    dtype, hidden, world, algorithm = DTYPES[spec[0]], spec[1], spec[2], spec[3]
    assert arfuse.instance_for(dtype, hidden, world, algorithm) == \
        f"arfuse_{spec[0]}_h{hidden}_w{world}_{algorithm}_norm"
    run_and_check(groups, Case(world, hidden, dtype, 17, "dense", 8, "f32", True, 2.5,
                               algorithm=algorithm))
    run_and_check(groups, Case(world, hidden, dtype, 128, "permuted", 8, "act", True, 1.0,
                               weight_bias=1.0, absent=0.3, algorithm=algorithm))


# ---- token splits: each twin (variants/tuning.yaml min_blocks_splits: without the blocks-per-SM
# bound; buffered_splits: the owner's own tokens through its buffer) serves the token counts from
# the next smaller twin's limit + 1 up to its own; above the largest, the sibling ----------------
def _token_splits():
    insts = [i for i in _manifest_instances() if i.get("max_tokens") and i.get("output") == "norm"]
    out = []
    for i in insts:
        key = (i["dtype"], i["hidden"], i["world_size"], i["algorithm"])
        limits = sorted(j["max_tokens"] for j in insts
                        if (j["dtype"], j["hidden"], j["world_size"], j["algorithm"]) == key)
        lo = max([m for m in limits if m < i["max_tokens"]], default=0) + 1
        above = [j["name"] for j in insts if (j["dtype"], j["hidden"], j["world_size"],
                                                j["algorithm"]) == key and j["max_tokens"] > i["max_tokens"]]
        nxt = min(above, key=lambda n: int(n.rsplit("_upto", 1)[1])) if above \
            else i["name"].rsplit("_upto", 1)[0]
        out.append(key + (lo, i["max_tokens"], i["name"], nxt))
    return sorted(out)


@pytest.mark.parametrize("split", _token_splits(), ids=lambda s: s[6])
@pytest.mark.parametrize("algorithm", ["named", "auto"])
def test_token_split_twins(groups, split, algorithm):
    d, hidden, world, algo, lo, limit, twin, above = split
    dtype = DTYPES[d]
    big = lambda w, h, dt: groups(w, h, dt, max_tokens=limit + 1)  # noqa: E731
    for tokens, name in ((lo, twin), (limit, twin), (limit + 1, above)):
        assert arfuse.instance_for(dtype, hidden, world, algo, num_tokens=tokens) == name
        run_and_check(big, Case(world, hidden, dtype, tokens, "permuted", 8, "f32", True, 2.5,
                                absent=0.2, algorithm=algo if algorithm == "named" else "auto"))


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
# layout, K, weights, shared, routed_scaling, weight_bias, gamma_f32, absent
OPTION_CASES = _checks.OPTION_CASES


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


# ---- FP8 with dynamic scales: per token (fp8_token) and per group of 128 (fp8_group128) ---------
# Codes within one ulp of the float64 rules applied to the op's own residual_out, scales within
# float32 error of them (fused_cases.SCALE_RTOL), NaN where the reference is NaN, every output
# poisoned before the run and bitwise identical on every rank; residual_out as everywhere.
DYN_KINDS = [  # quant, scale_ub, column-major scales, ue8m0
    ("fp8_token", None, False, False),
    ("fp8_token", 4.0, False, False),  # bounds the amax of some tokens, not of others
    ("fp8_group128", None, False, False),
    ("fp8_group128", None, True, False),
    ("fp8_group128", None, False, True),
    ("fp8_group128", None, True, True),
]


def _dyn_id(k) -> str:
    quant, ub, col, ue8m0 = k
    return quant + (f"-ub{ub}" if ub is not None else "") + ("-col" if col else "") + \
        ("-ue8m0" if ue8m0 else "")


def _dyn_case(world, hidden, tokens, kind, algorithm, **kw) -> Case:
    quant, ub, col, ue8m0 = kind
    args = dict(layout="permuted", topk=8, weights="f32", shared=True, routed_scaling=2.5,
                absent=0.2, algorithm=algorithm, quant=quant, scale_ub=ub, scale_col=col,
                ue8m0=ue8m0)
    args.update(kw)
    return Case(world, hidden, torch.bfloat16, tokens, **args)


GROUP_RULE = r"hidden: 2880 is not a multiple of group_size=128 \(per-group FP8 scales need whole groups"


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("hidden", [2880, 2048, 4096, 7168, 1152])
@pytest.mark.parametrize("kind", DYN_KINDS, ids=_dyn_id)
def test_fp8_dynamic(groups, kind, hidden, world, algorithm):
    # 1152 = 9 * 128: a multiple of 128 that no matrix specialises (generic path).
    case = _dyn_case(world, hidden, 37, kind, algorithm, weight_bias=1.0 if world == 4 else 0.0,
                     gamma_f32=hidden == 4096)
    if kind[0] == "fp8_group128" and hidden % 128:
        group = groups(world, hidden, torch.bfloat16)
        with pytest.raises(ValueError, match=GROUP_RULE):
            run_case(group, case, new_seed())
        assert group.status() == [0] * world
        return
    name = arfuse.instance_for(torch.bfloat16, hidden, world, algorithm, kind[0])
    assert name is not None and name.endswith(f"_{algorithm}_{kind[0]}")
    run_and_check(groups, case)


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot", "auto"])
@pytest.mark.parametrize("tokens", [0, 1, 3, 129, MAX_TOKENS])
@pytest.mark.parametrize("kind", [DYN_KINDS[1], DYN_KINDS[5]], ids=_dyn_id)
def test_fp8_dynamic_token_counts(groups, kind, tokens, algorithm):
    outs, _ = run_and_check(groups, _dyn_case(8, 7168, tokens, kind, algorithm))
    assert all(o[0].shape == (tokens, 7168) for o in outs)


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
@pytest.mark.parametrize("kind", [DYN_KINDS[0], DYN_KINDS[1], DYN_KINDS[3], DYN_KINDS[4]], ids=_dyn_id)
@pytest.mark.parametrize("shape", [(8, 7168), (2, 2048), (4, 1152)], ids=lambda s: f"w{s[0]}-h{s[1]}")
def test_fp8_dynamic_special_values(groups, shape, kind, algorithm):
    """-0.0, subnormals, a NaN (token 1: its scale and every code NaN), an Inf (token 2: the
    sum of squares is Inf, y is NaN at the Inf and 0 elsewhere: per token all NaN; per group
    the Inf's group NaN, the others at the 1e-10 floor with zero codes)."""
    world, hidden = shape
    outs, _ = run_and_check(groups, _dyn_case(world, hidden, 9, kind, algorithm, layout="dense",
                                              topk=4, absent=0.0, specials=True))
    q, _, sc = outs[0]
    assert torch.isnan(q[1].float()).all() and torch.isnan(sc[1]).all()
    assert torch.isnan(sc[2]).any()
    if kind[0] == "fp8_token":
        assert torch.isnan(q[2].float()).all()
    else:  # the Inf is in column 3: group 0
        assert torch.isnan(q[2, :128].float()).all() and not torch.isnan(q[2, 128:].float()).any()


@pytest.mark.parametrize("kind", [DYN_KINDS[1], DYN_KINDS[5]], ids=_dyn_id)
@pytest.mark.parametrize("shape", [(8, 1152), (4, 1152)], ids=lambda s: f"w{s[0]}-h{s[1]}")
def test_fp8_dynamic_oneshot_equals_twoshot(groups, shape, kind):
    """Bitwise equal where both algorithms reduce the sum of squares in the same order: the
    generic instances (1152 is specialised by no matrix). Specialised one-shot and two-shot plans
    differ (a 4-CTA cluster against one 448-thread CTA at 7168), so their float32 sums of squares,
    and with them y and the scales, may differ in the last bit; each is checked on its own."""
    world, hidden = shape
    for algo in ("oneshot", "twoshot"):
        assert arfuse.instance_for(torch.bfloat16, hidden, world, algo, kind[0]) == \
            f"arfuse_bf16_generic_{algo}_{kind[0]}"
    group = groups(world, hidden, torch.bfloat16)
    seed = new_seed()
    res = {}
    for algo in ("oneshot", "twoshot"):
        outs, _ = run_case(group, _dyn_case(world, hidden, 77, kind, algo), seed)
        res[algo] = outs[0]
    for i, what in enumerate(("q", "residual_out", "scales")):
        assert torch.equal(bits(res["oneshot"][i]), bits(res["twoshot"][i])), f"{what}, seed {seed}"


def test_fp8_dynamic_errors_before_launch(groups):
    """Bad arguments raise on the host and launch nothing; T = 0 returns empty outputs."""
    world, hidden, dtype = 2, 2880, torch.bfloat16
    group = groups(world, hidden, dtype)
    comm = group.comms[0]
    dev = group.device
    T = 8
    x = torch.randn(T, hidden, device=dev, dtype=dtype)
    g = torch.ones(hidden, device=dev, dtype=dtype)

    def call(y=x, **kw):
        return arfuse.moe_finalize_allreduce_rmsnorm(comm, y, y, g, 1e-6, **kw)

    torch.ops.arfuse.defer_launches(True)
    try:
        with pytest.raises(ValueError, match=GROUP_RULE):
            call(quant="fp8_group128")
        with pytest.raises(ValueError, match="scale_ub: is on cpu but the communicator is on cuda"):
            call(quant="fp8_token", scale_ub=torch.ones(1))
        with pytest.raises(TypeError, match=r"scale_ub: dtype Double \(want float32\)"):
            call(quant="fp8_token", scale_ub=torch.ones(1, dtype=torch.float64, device=dev))
        with pytest.raises(ValueError, match="scale_ub: want one element"):
            call(quant="fp8_token", scale_ub=torch.ones(2, device=dev))
        q, r, s = call(x[:0], quant="fp8_token")
        assert q.shape == (0, hidden) and q.dtype == torch.float8_e4m3fn and r.shape == (0, hidden)
        assert s.shape == (0,) and s.dtype == torch.float32 and s.device == dev
        assert torch.ops.arfuse.flush_launches(False) == 0, "an error or T = 0 queued a launch"
    finally:
        torch.ops.arfuse.defer_launches(False)
    with LocalGroup(2, max_tokens=8, hidden=1152, dtype=dtype) as g2:
        y = torch.randn(0, 1152, device=dev, dtype=dtype)
        _, _, s = arfuse.moe_finalize_allreduce_rmsnorm(
            g2.comms[0], y, y, torch.ones(1152, device=dev, dtype=dtype), 1e-6,
            quant="fp8_group128", scale_layout="col")
        assert s.shape == (0, 9)
    if arfuse.instance_for(torch.float16, 4096, 4, "oneshot", "fp8_token") is None:
        fgroup = groups(4, 4096, torch.float16)
        z = torch.randn(T, 4096, device=dev, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"no kernel instance serves \(dtype fp16, hidden 4096, "
                           r"world size 4, algorithm oneshot, output fp8_token\)"):
            arfuse.moe_finalize_allreduce_rmsnorm(fgroup.comms[0], z, z, torch.ones_like(z[0]),
                                                  1e-6, quant="fp8_token", algorithm="oneshot")
    assert group.status() == [0] * world


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
        call(comm, torch.randn(4, T, hidden, device=dev, dtype=dtype).transpose(0, 1), r, g, 1e-6)
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


# ---- auto's one-shot limit comes from this card's rows (variants/tuning.yaml card_thresholds) ----
def test_auto_threshold_is_this_cards_row():
    # The manifest records the default table and every card's own rows; a communicator resolves
    # its device's name once, at creation, and its auto limit must be that card's row where it
    # has one, else the default table's (capped by oneshot_max_tokens).
    with open(arfuse._lib.manifest_path()) as f:
        tuning = json.load(f)["tuning"]
    card = torch.cuda.get_device_name()
    rows = {(r["dtype"], r["hidden"], r["world_size"]): r["oneshot_max_tokens"] for r in tuning["thresholds"]}
    own: list = []
    for sec in tuning["card_thresholds"]:
        if sec["card"] == card:
            own = [(r["dtype"], r["hidden"], r["world_size"]) for r in sec["thresholds"]]
            rows.update({(r["dtype"], r["hidden"], r["world_size"]): r["oneshot_max_tokens"]
                         for r in sec["thresholds"]})
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    # this card's own rows first (where it has a section), then the default table's
    order = sorted(own) + [k for k in sorted(rows) if k not in own]
    served = [k for k in order if arfuse.supported(k[0], k[1], k[2])][:max(4, len(own))]
    assert served, "no measured row has an instance in this build"
    assert not own or set(own) <= set(served), (card, own, served)
    for dtype, hidden, world in served:
        want = rows[(dtype, hidden, world)]
        assert arfuse.oneshot_threshold(dtype, hidden, world) == want, (card, dtype, hidden, world)
        with LocalGroup(world, max_tokens=4 * want, hidden=hidden, dtype=names[dtype]) as g:
            assert [c.auto_oneshot_max_tokens for c in g.comms] == [want] * world, (card, hidden, world)
        with LocalGroup(world, max_tokens=4 * want, hidden=hidden, dtype=names[dtype],
                        oneshot_max_tokens=max(1, want // 2)) as g:
            assert g.comms[0].auto_oneshot_max_tokens == max(1, want // 2)


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
