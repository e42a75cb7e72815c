"""CPU tests of the compiled library: schemas, dispatch table, Meta (fake) implementations,
validation errors, and the op's definition through the world-size-1 CPU implementation.
They need the library (make test builds the CI matrix) but no GPU."""

from __future__ import annotations

import json

import pytest
import torch

import arfuse
from arfuse import reference
from arfuse.comm import cpu_communicator
from op_errors import op_raises

H = 64


@pytest.fixture
def comm(lib):
    c = cpu_communicator(max_tokens=32, hidden=H, dtype=torch.bfloat16)
    yield c
    c.close()


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def test_library_matches_manifest(lib, manifest):
    names = sorted(arfuse.supported_variants())
    assert names == sorted(i["name"] for i in manifest["instances"])
    assert manifest["api_version"] == arfuse._lib.API_VERSION == 13


def test_schemas_are_registered(lib):
    for op in ("fused", "fused_inplace", "moe_finalize", "comm_create", "comm_destroy",
               "supported_variants", "instance_for", "oneshot_threshold"):
        assert hasattr(torch.ops.arfuse, op), op
    s = str(torch.ops.arfuse.fused_inplace.default._schema)
    assert "Tensor(a!) input" in s and "Tensor(b!) residual" in s


def test_dispatch_prefers_specialised_then_generic(lib, manifest):
    spec = [i for i in manifest["instances"] if not i["generic"]][0]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec["dtype"]]
    assert arfuse.instance_for(dtype, spec["hidden"], spec["world_size"], spec["algorithm"]) == spec["name"]
    # 2880 has no specialised instance in the CI matrix: the generic one serves it.
    assert arfuse.instance_for("bf16", 2880, 4, "oneshot") == "arfuse_bf16_generic_oneshot_norm"
    assert arfuse.instance_for("bf16", 2884, 4, "oneshot") is None  # not a multiple of 8
    assert arfuse.instance_for("bf16", 40960, 4, "oneshot") is None  # beyond the generic's 32768
    assert arfuse.instance_for("bf16", 2880, 4, "oneshot", "fp8_static") == "arfuse_bf16_generic_oneshot_fp8_static"
    assert arfuse.supported("fp32", 1536, 2)


def test_token_splits_pick_the_twin_up_to_its_token_count(lib, manifest):
    # variants/tuning.yaml: min_blocks_splits (a twin built without the plan's blocks-per-SM bound)
    # and buffered_splits (a two-shot twin whose owner sends its own tokens through its buffer).
    # The dispatch runs the twin with the smallest max_tokens that covers T, the sibling above.
    twins = [i for i in manifest["instances"] if i["max_tokens"]]
    assert twins, "the CI matrix builds a token split (variants/ci.yaml)"
    assert any(i["buffered"] for i in twins) and any(not i["buffered"] for i in twins)
    by_name = {i["name"]: i for i in manifest["instances"]}
    tuning = manifest["tuning"]
    for twin in twins:
        sibling = by_name[twin["name"].rsplit("_upto", 1)[0]]
        assert sibling["max_tokens"] == 0 and not sibling["buffered"]
        assert {k: v for k, v in twin["plan"].items() if k != "min_blocks_per_sm"} == \
            {k: v for k, v in sibling["plan"].items() if k != "min_blocks_per_sm"}
        axes = (twin["dtype"], twin["hidden"], twin["world_size"], twin["algorithm"], twin["output"])
        row = {"dtype": twin["dtype"], "hidden": twin["hidden"], "world_size": twin["world_size"],
               "algorithm": twin["algorithm"], "output": twin["output"]}
        limit = twin["max_tokens"]
        unbound = [r["unbound_max_tokens"] for r in tuning["min_blocks_splits"]["rows"]
                   if {k: r[k] for k in row} == row]
        if twin["buffered"]:
            assert twin["algorithm"] == "twoshot"
            assert dict(row, buffered_max_tokens=limit) in tuning["buffered_splits"]["rows"]
            # unbound where the instance has an unbound twin (that range ran unbound), else the
            # plan's own bound
            assert twin["plan"]["min_blocks_per_sm"] == \
                (0 if unbound else sibling["plan"]["min_blocks_per_sm"])
        else:
            assert sibling["plan"]["min_blocks_per_sm"] > 0 and twin["plan"]["min_blocks_per_sm"] == 0
            assert limit in unbound
        # its range: from the next smaller twin's limit + 1 up to its own; above, the next twin
        others = sorted(i["max_tokens"] for i in twins if i is not twin and
                        (i["dtype"], i["hidden"], i["world_size"], i["algorithm"], i["output"]) == axes)
        lo = max([m for m in others if m < limit], default=0) + 1
        above = [by_name[n]["name"] for n in by_name if by_name[n] in twins and
                 (by_name[n]["dtype"], by_name[n]["hidden"], by_name[n]["world_size"],
                  by_name[n]["algorithm"], by_name[n]["output"]) == axes and
                 by_name[n]["max_tokens"] > limit]
        nxt = min(above, key=lambda n: by_name[n]["max_tokens"]) if above else sibling["name"]
        for t in ({0, lo, (lo + limit) // 2, limit} if lo == 1 else {lo, (lo + limit) // 2, limit}):
            assert arfuse.instance_for(*axes, num_tokens=t) == twin["name"], t
        assert arfuse.instance_for(*axes, num_tokens=limit + 1) == nxt
        assert arfuse.instance_for(*axes, num_tokens=8192) == sibling["name"]
        assert arfuse.instance_for(*axes) == sibling["name"]  # every token count: the sibling
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="num_tokens"):
            arfuse.instance_for(*axes, num_tokens=bad)


def test_world_size_1_is_the_local_algorithms(lib, manifest):
    # World size 1 has no all-reduce: the local algorithm serves it, specialised (2048, 7168 in
    # the CI matrix) or generic, and serves nothing else; the all-reduce algorithms never serve it.
    assert arfuse.instance_for("bf16", 2048, 1, "local") == "arfuse_bf16_h2048_w1_local_norm"
    assert arfuse.instance_for("bf16", 7168, 1, "local", "fp8_group128") == \
        "arfuse_bf16_h7168_w1_local_fp8_group128"
    assert arfuse.instance_for("bf16", 2880, 1, "local") == "arfuse_bf16_generic_local_norm"
    assert arfuse.instance_for("fp32", 1536, 1, "local") == "arfuse_fp32_generic_local_norm"
    for algo in ("oneshot", "twoshot"):
        assert arfuse.instance_for("bf16", 2048, 1, algo) is None
        assert arfuse.instance_for("bf16", 2880, 1, algo) is None  # not even the generic one
    for world in (2, 8):
        assert arfuse.instance_for("bf16", 2048, world, "local") is None
    assert arfuse.supported("bf16", 2880, 1) and arfuse.supported("fp16", 4096, 1)
    assert not arfuse.supported("bf16", 2884, 1)
    local = [i for i in manifest["instances"] if i["algorithm"] == "local"]
    assert local and all(i["world_size"] in (0, 1) for i in local)
    assert all(i["world_size"] != 1 for i in manifest["instances"] if i["algorithm"] != "local")


def test_world_size_1_algorithm_rule(lib, comm):
    # auto and local run (the CPU implementation); an all-reduce algorithm at world size 1 is one
    # clear error naming the argument and the rule, before anything is computed.
    x, r, g = rand(4, H), rand(4, H), torch.rand(H).bfloat16()
    want = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, r, g, 1e-6)
    got = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, r, g, 1e-6, algorithm="local")
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for algo in ("oneshot", "twoshot"):
        with pytest.raises(ValueError, match=f"algorithm: {algo} is an all-reduce algorithm; a "
                           "communicator of world size 1 has no all-reduce"):
            arfuse.moe_finalize_allreduce_rmsnorm(comm, x, r, g, 1e-6, algorithm=algo)
    with op_raises(ValueError, r"algorithm: 4 is not one of 0 \(auto\), 1 \(oneshot\), 2 \(twoshot\), "
                   r"3 \(local\)"):
        torch.ops.arfuse.fused(x, None, None, None, r, g, 1e-6, 0.0, 1.0, None, comm.handle, 4)


def test_local_communicator_on_the_cpu(lib):
    from arfuse.comm import local_communicator

    with local_communicator(max_tokens=8, hidden=H, dtype=torch.float32, device="cpu") as c:
        assert (c.world_size, c.rank, c.device.type, c.max_tokens) == (1, 0, "cpu", 8)
        info = torch.ops.arfuse.comm_info(c.handle)
        assert info[9] == 0, "a world-size-1 communicator holds no exchange buffer"
        assert c.auto_oneshot_max_tokens == info[11] == 0, "world size 1 runs local: no one-shot"
        with pytest.raises(ValueError, match="a CPU communicator has no IPC handle"):
            arfuse.comm._op("comm_ipc_handle", c.handle)


def test_oneshot_threshold_default_rule(lib):
    # Unmeasured: one-shot while N * T * H * elem <= 1 MiB (csrc/dispatch.cpp, docs/performance.md).
    # (variants/tuning.yaml measures bf16 at the four models' sizes; fp16 7168 is unmeasured.)
    assert arfuse.oneshot_threshold("fp16", 7168, 8) == (1 << 20) // (8 * 7168 * 2) == 9
    assert arfuse.oneshot_threshold("fp32", 2048, 2) == (1 << 20) // (2 * 2048 * 4) == 64
    assert arfuse.oneshot_threshold("fp16", 65536, 16) == 1  # at least one token


def _default_rule(dtype: str, hidden: int, world_size: int) -> int:
    elem = 4 if dtype == "fp32" else 2
    return max(1, (1 << 20) // (world_size * hidden * elem))


def test_oneshot_threshold_per_card(lib, manifest):
    # variants/tuning.yaml card_thresholds: on a device of exactly that name a combination's row
    # comes from its section, else from the default table, else the default rule; every other
    # name ("" included: no device) gets the default table. The manifest is the generator's
    # record of both; the library must agree with it on every row.
    t = manifest["tuning"]
    default = {(r["dtype"], r["hidden"], r["world_size"]): r["oneshot_max_tokens"]
               for r in t["thresholds"]}
    assert t["card_thresholds"], "variants/tuning.yaml has the H100's own rows"
    unmeasured = ("fp16", 7168, 8)
    for sec in t["card_thresholds"]:
        own = {(r["dtype"], r["hidden"], r["world_size"]): r["oneshot_max_tokens"]
               for r in sec["thresholds"]}
        assert own, sec["card"]
        for key in sorted(default.keys() | own.keys()):
            want = own.get(key, default.get(key))
            assert arfuse.oneshot_threshold(*key, card=sec["card"]) == want, (sec["card"], key)
            # matched exactly: a longer or shorter name is another card
            for other in (sec["card"] + " NVL", sec["card"][:-1]):
                assert arfuse.oneshot_threshold(*key, card=other) == default.get(key, _default_rule(*key))
        if unmeasured not in default and unmeasured not in own:  # in neither table: the rule
            assert arfuse.oneshot_threshold(*unmeasured, card=sec["card"]) == _default_rule(*unmeasured) == 9
    for key, want in default.items():
        assert arfuse.oneshot_threshold(*key, card="") == want
        assert arfuse.oneshot_threshold(*key, card="no such card") == want
        if not torch.cuda.is_available():  # None: the current device's name, here none
            assert arfuse.oneshot_threshold(*key) == want
    with pytest.raises(TypeError, match="card: want a device name"):
        arfuse.oneshot_threshold("bf16", 7168, 8, card=8)


def test_meta_shapes(lib, comm):
    T = 5
    x = torch.empty(T, 3, H, dtype=torch.bfloat16, device="meta")
    r = torch.empty(T, H, dtype=torch.bfloat16, device="meta")
    g = torch.empty(H, dtype=torch.float32, device="meta")
    n, ro = torch.ops.arfuse.fused(x, None, None, None, r, g, 1e-6, 0.0, 1.0, None, comm.handle, 0)
    assert n.shape == (T, H) and n.dtype == torch.bfloat16 and n.device.type == "meta"
    s = torch.empty(1, dtype=torch.float32, device="meta")
    n8, _ = torch.ops.arfuse.fused(x, None, None, None, r, g, 1e-6, 0.0, 1.0, s, comm.handle, 0)
    assert n8.dtype == torch.float8_e4m3fn
    f = torch.ops.arfuse.moe_finalize(x, None, None, None, 1.0, T)
    assert f.shape == (T, H)


def test_fake_tensor_tracing(lib, comm):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, H, dtype=torch.bfloat16)
        r = torch.empty(7, H, dtype=torch.bfloat16)
        g = torch.empty(H, dtype=torch.bfloat16)
        n, ro = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, r, g, 1e-5)
        assert n.shape == (7, H)


@pytest.mark.parametrize("layout", ["plain", "dense", "permuted"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_world1_matches_float64_reference(lib, layout, dtype):
    T, K = 9, 4
    with cpu_communicator(max_tokens=16, hidden=H, dtype=dtype) as c:
        kw = {}
        if layout == "plain":
            x = rand(T, H, dtype=dtype)
        elif layout == "dense":
            x = rand(T, K, H, dtype=dtype)
            kw["expert_weights"] = torch.rand(T, K)
        else:
            x = rand(T * K, H, dtype=dtype)
            idx = torch.randperm(T * K).reshape(T, K).to(torch.int32)
            idx[0, 1] = -1
            kw["permuted_idx"] = idx
            kw["expert_weights"] = torch.rand(T, K).to(dtype)
        shared = rand(T, H, dtype=dtype)
        res = rand(T, H, dtype=dtype)
        gamma = torch.rand(H) + 0.5
        n, ro = arfuse.moe_finalize_allreduce_rmsnorm(c, x, res, gamma, 1e-6, shared_out=shared,
                                                      routed_scaling=2.5, weight_bias=1.0, **kw)
        ref_n, ref_r = reference.fused_reference(
            [{"expert_out": x, "shared_out": shared, **kw}], res, gamma, 1e-6, weight_bias=1.0,
            routed_scaling=2.5)
        tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
        assert (ro.double() - ref_r.double()).norm() / ref_r.double().norm() <= tol
        assert (n.double() - ref_n).norm() / ref_n.norm() <= tol


def test_fake_keeps_token_count_symbolic(lib, comm):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, r, g):
        return torch.ops.arfuse.fused(x, None, None, None, r, g, 1e-6, 0.0, 1.0, None, comm.handle, 0)

    gm = make_fx(f, tracing_mode="symbolic")(rand(5, H), rand(5, H), rand(H))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.arfuse.fused.default)
    norm_val = node.meta["val"][0]
    assert isinstance(norm_val.shape[0], torch.SymInt), norm_val.shape
    assert norm_val.shape[1] == H


def test_no_residual(lib, comm):
    T = 5
    x = rand(T, H)
    g = torch.rand(H) + 0.5
    n, ro = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, None, g, 1e-6, routed_scaling=2.0)
    ref_n, ref_r = reference.fused_reference([{"expert_out": x}], None, g, 1e-6, routed_scaling=2.0)
    assert torch.equal(ro, ref_r)
    assert (n.double() - ref_n).norm() / ref_n.norm() <= 1e-2
    m = torch.empty(T, H, dtype=torch.bfloat16, device="meta")
    nm, rm = torch.ops.arfuse.fused(m, None, None, None, None, g.to("meta"), 1e-6, 0.0, 1.0, None,
                                    comm.handle, 0)
    assert nm.shape == (T, H) and rm.shape == (T, H)


def test_cpu_inplace(lib, comm):
    T = 6
    x, res, g = rand(T, H), rand(T, H), rand(H)
    x0, res0 = x.clone(), res.clone()
    out = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, res, g, 1e-6, inplace=True)
    assert out[0] is x and out[1] is res
    ref_n, ref_r = reference.fused_reference([{"expert_out": x0}], res0, g, 1e-6)
    assert torch.equal(res, ref_r)
    assert (x.double() - ref_n).norm() / ref_n.norm() <= 1e-2


def test_deferred_launch_queue(lib):
    torch.ops.arfuse.defer_launches(True)
    try:
        assert torch.ops.arfuse.flush_launches(False) == 0
    finally:
        torch.ops.arfuse.defer_launches(False)
    assert torch.ops.arfuse.flush_launches(True) == 0


def test_zero_tokens(lib, comm):
    n, r = arfuse.moe_finalize_allreduce_rmsnorm(comm, rand(0, H), rand(0, H), rand(H), 1e-6)
    assert n.shape == (0, H) and r.shape == (0, H)


# ---- one clear error per bad argument, naming the argument and the rule -------------------------
def _call(comm, **over):
    T = 4
    args = dict(expert_out=rand(T, 2, H), residual=rand(T, H), gamma=rand(H), eps=1e-6,
                expert_weights=torch.rand(T, 2))
    args.update(over)
    return arfuse.moe_finalize_allreduce_rmsnorm(
        comm, args.pop("expert_out"), args.pop("residual"), args.pop("gamma"), args.pop("eps"),
        **args)


@pytest.mark.parametrize("over,exc,msg", [
    (dict(expert_out=rand(4, 2, H, dtype=torch.float16)), TypeError,
     "expert_out: dtype Half does not match the communicator's BFloat16"),
    (dict(residual=rand(4, H + 8)), ValueError, "residual: want [T=4, H=64] (T from expert_out), got [4, 72]"),
    (dict(residual=rand(40, H), expert_out=rand(40, H), expert_weights=None), ValueError,
     "40 tokens exceed the communicator's capacity max_tokens=32"),
    (dict(expert_out=rand(2, 4, H).transpose(0, 1)), ValueError, "expert_out: must be contiguous"),
    (dict(expert_out=rand(5, 2, H)), ValueError, "residual: want [T=5, H=64] (T from expert_out), got [4, 64]"),
    (dict(expert_out=rand(4, 2, H + 8)), ValueError, "expert_out: hidden size 72 does not match the communicator's 64"),
    (dict(expert_weights=torch.rand(4, 3)), ValueError, "expert_weights: want [T=4, K=2]"),
    (dict(expert_weights=torch.rand(4, 2, dtype=torch.float64)), TypeError,
     "expert_weights: dtype Double (want float32 or BFloat16)"),
    (dict(expert_out=rand(4, H), expert_weights=torch.rand(4, 1)), ValueError,
     "expert_weights: the plain layout is already reduced"),
    (dict(permuted_idx=torch.zeros(4, 2, dtype=torch.int64), expert_out=rand(8, H)), TypeError,
     "permuted_idx: dtype Long (want int32)"),
    (dict(permuted_idx=torch.zeros(4, 70, dtype=torch.int32), expert_out=rand(8, H),
          expert_weights=None), ValueError, "permuted_idx: want [T=4, K] with 1 <= K <= 64"),
    (dict(shared_out=rand(3, H)), ValueError, "shared_out: want [T=4, H=64]"),
    (dict(gamma=rand(H - 8)), ValueError, "gamma: want [H=64]"),
    (dict(gamma=torch.rand(H, dtype=torch.float64)), TypeError, "gamma: dtype Double"),
    (dict(weight_bias=0.5), ValueError, "weight_bias: 0.5 must be 0 (x * gamma) or 1"),
    (dict(eps=-1.0), ValueError, "eps: -1 must be >= 0"),
    (dict(algorithm="threeshot"), ValueError, "algorithm: 'threeshot' is not one of"),
    (dict(fp8_scale=torch.ones(2)), ValueError, "fp8_scale: want one element"),
    (dict(inplace=True), ValueError, "inplace: needs the plain layout"),
])
def test_bad_arguments(lib, comm, over, exc, msg):
    with pytest.raises(exc) as e:
        _call(comm, **over)
    assert msg in str(e.value).splitlines()[0], str(e.value)


def test_bad_communicator_arguments(lib):
    def mk(**kw):
        args = dict(rank=0, world_size=1, hidden=H, dtype=torch.bfloat16, max_tokens=8,
                    oneshot_max_tokens=-1, ranks_per_device=1, device=torch.device("cpu"),
                    timeout_s=1.0)
        args.update(kw)
        return arfuse.comm._op("comm_create", *args.values())

    with pytest.raises(ValueError, match="world_size: 17 is not supported"):
        mk(world_size=17)
    with pytest.raises(ValueError, match="rank: 2 is outside the group"):
        mk(world_size=2, rank=2)
    with pytest.raises(ValueError, match="hidden: 60 must be a positive multiple of 8"):
        mk(hidden=60)
    with pytest.raises(TypeError, match="dtype: dtype Double is not supported"):
        mk(dtype=torch.float64)
    with pytest.raises(ValueError, match="device: cpu is not supported"):
        mk(world_size=2)
    with pytest.raises(ValueError, match="oneshot_max_tokens: 9 must not exceed max_tokens"):
        mk(oneshot_max_tokens=9)
    # The op itself raises RuntimeError, the kind first in the message (stable ABI).
    with op_raises(ValueError, "world_size: 17 is not supported"):
        torch.ops.arfuse.comm_create(0, 17, H, torch.bfloat16, 8, -1, 1, torch.device("cpu"), 1.0)
    with op_raises(TypeError, "dtype: dtype Double is not supported"):
        torch.ops.arfuse.comm_create(0, 1, H, torch.float64, 8, -1, 1, torch.device("cpu"), 1.0)


def test_close_waits_for_peers_at_a_barrier(lib, monkeypatch):
    # A Communicator with peers in other processes frees its buffer only after a barrier of its
    # group (their queued kernels write into it); leaving a `with` block by an exception and
    # wait_for_peers=False free at once. There is no multi-process group on the CPU: the group
    # is a stand-in and the barrier records whether the buffer was still open when it ran.
    import torch.distributed as dist

    def is_open(h):
        try:
            torch.ops.arfuse.comm_info(h)
            return True
        except Exception:
            return False

    group, current, barriers = object(), [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier",
                        lambda group=None: barriers.append((group, is_open(current[-1]))))

    from arfuse.comm import Communicator

    # What the constructor records: peers whenever the group has several ranks, the default
    # group (None) included; none for one rank.
    assert Communicator._peers(group, 4) == (True, group)
    assert Communicator._peers(None, 2) == (True, None)
    assert Communicator._peers(None, 1)[0] is False

    def peered(g=group):
        c = cpu_communicator(max_tokens=4, hidden=H, dtype=torch.bfloat16)
        c._has_peers, c._peer_group = Communicator._peers(g, 2)
        current.append(c.handle)
        barriers.clear()
        return c

    c = peered()
    c.close()
    assert barriers == [(group, True)] and not is_open(current[-1])
    c.close()  # closed already: no second barrier
    assert len(barriers) == 1

    c = peered()
    with c:
        pass
    assert barriers == [(group, True)] and not is_open(current[-1])

    c = peered(None)  # Communicator(None, ...): the default group is the peers' group too
    c.close()
    assert barriers == [(None, True)] and not is_open(current[-1])

    c = peered()
    with pytest.raises(RuntimeError, match="boom"):
        with c:
            raise RuntimeError("boom")
    assert barriers == [] and not is_open(current[-1])

    c = peered()
    c.close(wait_for_peers=False)
    assert barriers == [] and not is_open(current[-1])

    c = cpu_communicator(max_tokens=4, hidden=H, dtype=torch.bfloat16)  # no peers: no barrier
    current.append(c.handle)
    c.close()
    assert barriers == [] and not is_open(current[-1])


def test_closed_communicator(lib):
    c = cpu_communicator(max_tokens=4, hidden=H, dtype=torch.bfloat16)
    h = c.handle
    c.close()
    c.close()  # harmless
    with pytest.raises(ValueError, match="closed"):
        c.handle
    with op_raises(ValueError, f"comm: {h} is not an open communicator"):
        torch.ops.arfuse.fused(rand(2, H), None, None, None, rand(2, H), rand(H), 1e-6, 0.0, 1.0,
                               None, h, 0)


def test_wrong_comm_type(lib):
    with pytest.raises(TypeError, match="comm: want an arfuse.Communicator"):
        arfuse.moe_finalize_allreduce_rmsnorm("x", rand(2, H), rand(2, H), rand(H), 1e-6)


def test_models_table():
    m = arfuse.models()
    assert m["deepseek-v3"]["hidden"] == 7168 and m["deepseek-v3"]["top_k"] == 8
    assert m["gpt-oss-120b"]["hidden"] == 2880 and m["gpt-oss-120b"]["top_k"] == 4


def test_manifest_plans_are_consistent(manifest):
    for inst in manifest["instances"]:
        p = inst["plan"]
        if inst["generic"]:
            continue
        assert inst["hidden"] == p["nvec"] * p["vec"]
        assert p["slice"] * p["cluster"] == p["nvec"]
        assert p["threads_per_token"] * p["vecs_per_thread"] >= p["slice"]
        json.dumps(inst)


def test_python_speaks_the_headers_api_version():
    import os
    import re

    from arfuse import _lib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # csrc/arfuse/vocab.h and arfuse/_vocab_tables.py: both generated from gen/tables.go.
    with open(os.path.join(root, "csrc", "arfuse", "vocab.h")) as f:
        m = re.search(r"#define ARFUSE_DEVICE_API_VERSION (\d+)", f.read())
    assert m and int(m.group(1)) == _lib.API_VERSION
