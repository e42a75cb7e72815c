"""CPU tests of the FP8 outputs with dynamic scales (fused_fp8_dynamic: fp8_token, fp8_group128):
schema, dispatch, fake shapes, every validation error, and the world-size-1 CPU implementation
against the float64 rules of arfuse.reference. They need the library but no GPU."""

from __future__ import annotations

import re

import pytest
import torch

import arfuse
from arfuse import reference
from arfuse.comm import cpu_communicator
from op_errors import op_raises
from fused_cases import SCALE_RTOL, check_fp8_dynamic, fp8_ulp_distance

H = 256  # two groups of 128


@pytest.fixture
def comm(lib):
    c = cpu_communicator(max_tokens=32, hidden=H, dtype=torch.bfloat16)
    yield c
    c.close()


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


FUSED_SCHEMA = ("arfuse::fused(Tensor expert_out, Tensor? permuted_idx, Tensor? expert_weights, "
                "Tensor? shared_out, Tensor? residual, Tensor gamma, float eps, float weight_bias, "
                "float routed_scaling, Tensor? fp8_scale, int comm, int algorithm) -> (Tensor, Tensor)")


def test_schemas(lib):
    # The vLLM pass calls `fused`: its schema must not change.
    assert str(torch.ops.arfuse.fused.default._schema) == FUSED_SCHEMA
    s = str(torch.ops.arfuse.fused_fp8_dynamic.default._schema)
    assert s == ("arfuse::fused_fp8_dynamic(Tensor expert_out, Tensor? permuted_idx, "
                 "Tensor? expert_weights, Tensor? shared_out, Tensor? residual, Tensor gamma, "
                 "float eps, float weight_bias, float routed_scaling, int group_size, "
                 "Tensor? scale_ub, bool col_major_scales, bool ue8m0, int comm, int algorithm) "
                 "-> (Tensor, Tensor, Tensor)"), s
    assert hasattr(torch.ops.arfuse, "validate_fp8_dynamic")
    assert arfuse.QUANT_KINDS == ("fp8_static", "fp8_token", "fp8_group128")


def test_dispatch_of_the_dynamic_kinds(lib, manifest):
    outs = {i["output"] for i in manifest["instances"]}
    assert {"fp8_token", "fp8_group128"} <= outs
    for kind in ("fp8_token", "fp8_group128"):
        for algo in ("oneshot", "twoshot"):
            # Specialised in the CI matrix: bf16, hidden 7168, world size 8.
            assert arfuse.instance_for("bf16", 7168, 8, algo, kind) == f"arfuse_bf16_h7168_w8_{algo}_{kind}"
            assert arfuse.instance_for("bf16", 1152, 4, algo, kind) == f"arfuse_bf16_generic_{algo}_{kind}"
    with pytest.raises(ValueError, match="output: 'fp8_block' is not one of"):
        arfuse.instance_for("bf16", 7168, 8, "oneshot", "fp8_block")
    with op_raises(ValueError, "out_kind: 4 is not one of"):
        torch.ops.arfuse.instance_for(torch.bfloat16, 7168, 8, 1, 4)


def _op(comm, T=4, *, group_size=0, scale_ub=None, col=False, ue8m0=False, device="cpu"):
    x = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    g = torch.empty(H, dtype=torch.float32, device=device)
    return torch.ops.arfuse.fused_fp8_dynamic(x, None, None, None, x, g, 1e-6, 0.0, 1.0,
                                              group_size, scale_ub, col, ue8m0, comm.handle, 0)


def test_meta_shapes(lib, comm):
    q, r, s = _op(comm, 5, device="meta")
    assert q.shape == (5, H) and q.dtype == torch.float8_e4m3fn and r.dtype == torch.bfloat16
    assert s.shape == (5,) and s.dtype == torch.float32
    _, _, s = _op(comm, 5, group_size=128, device="meta")
    assert s.shape == (5, 2) and s.stride() == (2, 1)
    _, _, s = _op(comm, 5, group_size=128, col=True, device="meta")
    assert s.shape == (5, 2) and s.stride() == (1, 5)


def test_fake_keeps_token_count_symbolic(lib, comm):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, r, g):
        return torch.ops.arfuse.fused_fp8_dynamic(x, None, None, None, r, g, 1e-6, 0.0, 1.0, 128,
                                                  None, True, True, comm.handle, 0)

    gm = make_fx(f, tracing_mode="symbolic")(rand(5, H), rand(5, H), rand(H))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.arfuse.fused_fp8_dynamic.default)
    q, r, s = node.meta["val"]
    assert isinstance(q.shape[0], torch.SymInt) and q.shape[1] == H
    assert isinstance(s.shape[0], torch.SymInt) and s.shape[1] == H // 128
    assert s.stride()[0] == 1


# ---- the world-size-1 CPU implementation against the float64 rules ------------------------------
@pytest.mark.parametrize("quant,ub,col,ue8m0", [
    ("fp8_token", None, False, False),
    ("fp8_token", 0.5, False, False),        # clips most tokens' amax
    ("fp8_token", 1e-9, False, False),       # below the 1 / (448 * 512) floor
    ("fp8_group128", None, False, False),
    ("fp8_group128", None, True, False),
    ("fp8_group128", None, False, True),
    ("fp8_group128", None, True, True),
])
@pytest.mark.parametrize("layout", ["plain", "dense", "permuted"])
def test_cpu_world1_matches_float64_rules(lib, layout, quant, ub, col, ue8m0):
    T, K = 9, 4
    with cpu_communicator(max_tokens=16, hidden=H, dtype=torch.bfloat16) as c:
        kw = {}
        if layout == "plain":
            x = rand(T, H)
        elif layout == "dense":
            x = rand(T, K, H)
            kw["expert_weights"] = torch.rand(T, K)
        else:
            x = rand(T * K, H)
            idx = torch.randperm(T * K).reshape(T, K).to(torch.int32)
            idx[0, 1] = -1
            kw["permuted_idx"] = idx
            kw["expert_weights"] = torch.rand(T, K).to(torch.bfloat16)
        shared = rand(T, H)
        res = rand(T, H, scale=3.0)
        gamma = torch.rand(H) + 0.5
        ubt = None if ub is None else torch.tensor([ub], dtype=torch.float32)
        out = arfuse.moe_finalize_allreduce_rmsnorm(
            c, x, res, gamma, 1e-6, shared_out=shared, routed_scaling=2.5, weight_bias=1.0,
            quant=quant, scale_ub=ubt, scale_layout="col" if col else "row", scale_ue8m0=ue8m0, **kw)
        assert len(out) == 3
        kw["shared_out"] = shared
        q, ro, s = out
        ref_n, ref_r = reference.fused_reference([{"expert_out": x, **kw}], res, gamma, 1e-6,
                                                 weight_bias=1.0, routed_scaling=2.5)
        assert (ro.double() - ref_r.double()).norm() / ref_r.double().norm() <= 1e-2
        if col:
            assert s.stride() == (1, T)
        y = reference.rmsnorm(ro, gamma, 1e-6, 1.0, acc=torch.float64)
        errs = check_fp8_dynamic(q, s, y, group_size=0 if quant == "fp8_token" else 128,
                                 scale_ub=ubt, ue8m0=ue8m0, what=f"cpu {layout} {quant}")
        assert errs["norm_out"] <= 1 and errs["scales"] <= SCALE_RTOL
        if ub == 1e-9:
            assert torch.all(s == torch.tensor(1.0 / (448 * 512), dtype=torch.float32))
        if ue8m0:
            m, _ = torch.frexp(s)
            assert torch.all(m == 0.5), "UE8M0 scales must be powers of two"


def test_cpu_special_values(lib):
    """-0.0 rows, a NaN (its token NaN), an Inf (its group NaN, the other group all zeros)."""
    T = 4
    with cpu_communicator(max_tokens=8, hidden=H, dtype=torch.bfloat16) as c:
        x = rand(T, H)
        res = rand(T, H)
        gamma = torch.rand(H) + 0.5
        x[0] = -0.0
        res[0] = -0.0
        x[1, 5] = float("nan")
        x[2, 200] = float("inf")  # token 2: sum of squares Inf, y = NaN there and 0 elsewhere
        for quant, gs in (("fp8_token", 0), ("fp8_group128", 128)):
            q, ro, s = arfuse.moe_finalize_allreduce_rmsnorm(c, x, res, gamma, 1e-6, quant=quant)
            y = reference.rmsnorm(ro, gamma, 1e-6, 0.0, acc=torch.float64)
            check_fp8_dynamic(q, s, y, group_size=gs, what=f"cpu specials {quant}")
            assert torch.isnan(q[1].float()).all() and torch.isnan(s[1]).all()
            assert (q[0].float() == 0).all()
            if gs:
                assert torch.isnan(s[2, 1]) and torch.isnan(q[2, 128:].float()).all()
                assert s[2, 0] == torch.tensor(1e-10 / 448, dtype=torch.float32)
                assert (q[2, :128].float() == 0).all()
                assert s[0].eq(torch.tensor(1e-10 / 448, dtype=torch.float32)).all()
            else:
                assert torch.isnan(s[2]) and torch.isnan(q[2].float()).all()
                assert s[0] == torch.tensor(1.0 / (448 * 512), dtype=torch.float32)


def test_cpu_infinite_y_and_scale_ub(lib):
    """A float32 gamma element near FLT_MAX makes y infinite (amax Inf): the per-token scale is
    Inf (codes y / Inf: 0, NaN for the Inf elements) unless scale_ub bounds it (codes saturate)."""
    T = 6
    with cpu_communicator(max_tokens=8, hidden=H, dtype=torch.bfloat16) as c:
        x = rand(T, H)
        res = rand(T, H)
        res[:, 7] = 8.0
        gamma = torch.rand(H) + 0.5
        gamma[7] = 3e38
        q, ro, s = arfuse.moe_finalize_allreduce_rmsnorm(c, x, res, gamma, 1e-6, quant="fp8_token")
        y = reference.rmsnorm(ro, gamma, 1e-6, 0.0, acc=torch.float64)
        assert not torch.isinf(y).any()  # float64 holds it; float32 does not
        y = reference.float32_range(y)
        assert torch.isinf(y).any()
        check_fp8_dynamic(q, s, y, group_size=0, what="cpu inf y")
        assert torch.isinf(s).any()
        ub = torch.tensor([2.0])
        q, ro, s = arfuse.moe_finalize_allreduce_rmsnorm(c, x, res, gamma, 1e-6, quant="fp8_token",
                                                         scale_ub=ub)
        check_fp8_dynamic(q, s, y, group_size=0, scale_ub=ub, what="cpu inf y, ub")
        assert torch.all(s == torch.tensor(2.0 / 448, dtype=torch.float32))
        assert torch.all(q[:, 7].float().abs() == 448)


def test_cpu_zero_tokens(lib, comm):
    q, r, s = arfuse.moe_finalize_allreduce_rmsnorm(comm, rand(0, H), rand(0, H), rand(H), 1e-6,
                                                    quant="fp8_token")
    assert q.shape == (0, H) and q.dtype == torch.float8_e4m3fn and r.shape == (0, H)
    assert s.shape == (0,) and s.dtype == torch.float32
    for col in (False, True):
        _, _, s = arfuse.moe_finalize_allreduce_rmsnorm(
            comm, rand(0, H), rand(0, H), rand(H), 1e-6, quant="fp8_group128",
            scale_layout="col" if col else "row")
        assert s.shape == (0, 2) and s.dtype == torch.float32


def test_reference_rules():
    """The float64 rules themselves, on hand-made rows."""
    y = torch.zeros(3, 256, dtype=torch.float64)
    y[0, 3] = -896.0               # amax 896: token scale 2, group 0 scale 2, group 1 floor
    y[1, 130] = float("nan")
    y[2, 0] = 1e-30                # below every floor
    s = reference.fp8_token_scales(y)
    assert s[0] == 2.0 and torch.isnan(s[1]) and s[2] == 1.0 / (448 * 512)
    assert reference.fp8_token_scales(y, torch.tensor([448.0]))[0] == 1.0
    g = reference.fp8_group_scales(y)
    assert g[0, 0] == 2.0 and g[0, 1] == 1e-10 / 448
    assert g[1, 0] == 1e-10 / 448 and torch.isnan(g[1, 1])
    u = reference.ue8m0(torch.tensor([2.0, 3.0, 0.75, 1e-10 / 448, float("inf")], dtype=torch.float64))
    assert u.tolist() == [2.0, 4.0, 1.0, 2.0 ** -42, float("inf")]
    q, _ = reference.quantize_fp8_dynamic(y, 0)
    assert q[0, 3].float() == -448 and torch.isnan(q[1].float()).all() and q[2, 0].float() == 0
    # Saturation and round to nearest even: 464 (halfway between 448 and 480) saturates to 448;
    # 17 / 1 is halfway between 16 and 18 -> 16 (even mantissa).
    x = torch.tensor([[464.0, -1e9, 17.0, float("inf")]], dtype=torch.float64)
    qq = reference.quantize_fp8_scaled(x, torch.ones(1, dtype=torch.float64))
    assert qq.float().tolist() == [[448.0, -448.0, 16.0, 448.0]]
    assert int(fp8_ulp_distance(qq, qq).max()) == 0


# ---- one clear error per bad argument, naming the argument and the rule -------------------------
def _api(comm, **over):
    T = 4
    args = dict(expert_out=rand(T, 2, H), residual=rand(T, H), gamma=rand(H), eps=1e-6,
                expert_weights=torch.rand(T, 2), quant="fp8_token")
    args.update(over)
    return arfuse.moe_finalize_allreduce_rmsnorm(
        comm, args.pop("expert_out"), args.pop("residual"), args.pop("gamma"), args.pop("eps"),
        **args)


@pytest.mark.parametrize("over,exc,msg", [
    (dict(quant="fp8_block"), ValueError, "quant: 'fp8_block' is not one of"),
    (dict(quant="fp8_static"), ValueError, "fp8_scale: quant='fp8_static' needs"),
    (dict(fp8_scale=torch.ones(1)), ValueError, "fp8_scale: only for quant='fp8_static'"),
    (dict(quant=None, scale_ub=torch.ones(1)), ValueError, "scale_ub: an upper bound of per-token scales"),
    (dict(quant="fp8_group128", scale_ub=torch.ones(1)), ValueError, "scale_ub: an upper bound of per-token scales"),
    (dict(scale_layout="diag"), ValueError, "scale_layout: 'diag' is not one of"),
    (dict(scale_layout="col"), ValueError, "scale_layout: 'col' is only for quant='fp8_group128'"),
    (dict(scale_ue8m0=True), ValueError, "scale_ue8m0: power-of-two scales are only for"),
    (dict(quant=None, scale_ue8m0=True), ValueError, "scale_ue8m0: power-of-two scales are only for"),
    (dict(scale_ub=torch.ones(1, dtype=torch.float64)), TypeError, "scale_ub: dtype Double (want float32)"),
    (dict(scale_ub=torch.ones(2)), ValueError, "scale_ub: want one element"),
    (dict(inplace=True), ValueError, "inplace: needs the plain layout"),
    (dict(inplace=True, expert_out=rand(4, H), expert_weights=None), ValueError,
     "inplace: the FP8 output cannot be written into the input"),
    (dict(residual=rand(4, H + 8)), ValueError, "residual: hidden size 264 does not match"),
    (dict(expert_out=rand(4, 2, H, dtype=torch.float16)), TypeError,
     "expert_out: dtype Half does not match the communicator's BFloat16"),
    (dict(weight_bias=0.5), ValueError, "weight_bias: 0.5 must be 0 (x * gamma) or 1"),
    (dict(algorithm="threeshot"), ValueError, "algorithm: 'threeshot' is not one of"),
])
def test_bad_arguments(lib, comm, over, exc, msg):
    inputs = {k: v.clone() for k, v in over.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc) as e:
        _api(comm, **over)
    assert msg in str(e.value).splitlines()[0], str(e.value)
    for k, v in inputs.items():  # nothing written
        assert torch.equal(over[k], v)


def _raw(comm, **over):
    T = 4
    a = dict(group_size=0, scale_ub=None, col=False, ue8m0=False)
    a.update(over)
    x, r, g = rand(T, H), rand(T, H), rand(H)
    return torch.ops.arfuse.fused_fp8_dynamic(x, None, None, None, r, g, 1e-6, 0.0, 1.0,
                                              a["group_size"], a["scale_ub"], a["col"], a["ue8m0"],
                                              comm.handle, 0)


@pytest.mark.parametrize("over,exc,msg", [
    (dict(group_size=64), ValueError,
     "group_size: 64 is not supported (want 0: one scale per token, or 128: one scale per group of 128 elements)"),
    (dict(group_size=-1), ValueError, "group_size: -1 is not supported"),
    (dict(group_size=128, scale_ub=torch.ones(1)), ValueError,
     "scale_ub: an upper bound applies to per-token scales only (group_size=0)"),
    (dict(col=True), ValueError, "col_major_scales: the column-major layout applies to per-group scales only"),
    (dict(ue8m0=True), ValueError, "ue8m0: power-of-two scales apply to per-group scales only"),
    (dict(scale_ub=torch.ones(1, dtype=torch.float16)), TypeError, "scale_ub: dtype Half (want float32)"),
    (dict(scale_ub=torch.ones(1, 2)), ValueError, "scale_ub: want one element"),
])
def test_bad_op_arguments(lib, comm, over, exc, msg):
    with op_raises(exc, re.escape(msg)):
        _raw(comm, **over)


def test_group128_needs_whole_groups(lib):
    """2880 (gpt-oss-120b) is not a multiple of 128: group scales are refused, per-token work."""
    with cpu_communicator(max_tokens=4, hidden=2880, dtype=torch.bfloat16) as c:
        x, r, g = rand(2, 2880), rand(2, 2880), rand(2880)
        with pytest.raises(ValueError) as e:
            arfuse.moe_finalize_allreduce_rmsnorm(c, x, r, g, 1e-6, quant="fp8_group128")
        assert ("hidden: 2880 is not a multiple of group_size=128 (per-group FP8 scales need whole "
                "groups of 128 elements; use group_size=0, one scale per token)") in str(e.value)
        q, _, s = arfuse.moe_finalize_allreduce_rmsnorm(c, x, r, g, 1e-6, quant="fp8_token")
        assert q.shape == (2, 2880) and s.shape == (2,)
    with pytest.raises(ValueError, match="hidden 2880 is not a multiple of group_size 128"):
        reference.fp8_group_scales(torch.zeros(1, 2880))
