"""The GPU suite's checks (tests/fused_cases.py: check_case, check_dynamic_case) on the CPU.

The GPU suite only runs on the GPU machine, where device time is scarce; a broken check found
there costs a session's run. Here every output kind is fed what the op should return, computed
from the float64 rules, and must pass; the same outputs with one element, one code, one scale or
one rank spoilt must fail with a message naming what is wrong.
"""

from __future__ import annotations

import pytest
import torch

from arfuse import reference
from fused_cases import Case, check_case, fp8_ulp_distance, make_inputs, new_seed

CPU = torch.device("cpu")


def _expected(case: Case, inputs, fp8_scale=None):
    """Per-rank outputs as the op should produce them (one copy per rank)."""
    ranks, residual, gamma = inputs
    norm, res = reference.fused_reference(ranks, residual, gamma, case.eps,
                                          weight_bias=case.weight_bias,
                                          routed_scaling=case.routed_scaling, acc=torch.float64)
    if case.quant:
        y = reference.float32_range(reference.rmsnorm(res, gamma, case.eps, case.weight_bias,
                                                      acc=torch.float64))
        ub = None if case.scale_ub is None else torch.tensor([case.scale_ub], dtype=torch.float32)
        q, s = reference.quantize_fp8_dynamic(y, case.group_size, ub, case.ue8m0)
        s = s.float()
        if case.scale_col:
            s = s.t().contiguous().t()
        one = (q, res, s)
    elif case.fp8:
        one = (reference.quantize_fp8_static(norm, fp8_scale), res)
    else:
        one = (norm.to(case.dtype), res)
    return [tuple(t.clone() for t in one) for _ in range(case.world)]


CASES = [
    Case(2, 64, torch.bfloat16, 5, "permuted", 4, "f32", True, 2.5, absent=0.3, specials=True),
    Case(4, 96, torch.float16, 7, "dense", 2, "act", False, 1.0, weight_bias=1.0, gamma_f32=True),
    Case(2, 40, torch.float32, 3, "plain", 1, None, True, 1.0),
    Case(2, 64, torch.bfloat16, 6, "permuted", 8, "f32", True, 1.0, fp8=True),
    Case(2, 256, torch.bfloat16, 5, "permuted", 8, "f32", True, 1.0, quant="fp8_token",
         scale_ub=0.01),
    Case(4, 256, torch.bfloat16, 6, "dense", 4, "act", True, 2.5, quant="fp8_group128",
         scale_col=True, specials=True),
    Case(2, 384, torch.bfloat16, 4, "permuted", 8, "f32", False, 1.0, quant="fp8_group128",
         ue8m0=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_suite_check_accepts_the_right_outputs_and_rejects_spoilt_ones(case):
    seed = new_seed()
    inputs = make_inputs(case, CPU, seed)
    scale = torch.tensor([0.05], dtype=torch.float32) if case.fp8 else None
    outs = _expected(case, inputs, scale)
    errs = check_case(case, outs, inputs, scale)
    assert set(errs) >= {"residual_out", "norm_out"}, errs

    # One rank differs from the others in one element of residual_out.
    spoilt = [tuple(t.clone() for t in o) for o in outs]
    r = spoilt[-1][1]
    # A finite element (special-value cases put NaN / Inf in some rows), moved by at least 1:
    # x * 2 + 1 leaves x = -1 (and every non-finite x) where it was.
    j = int(torch.isfinite(r[case.tokens - 1]).float().argmax())
    assert torch.isfinite(r[case.tokens - 1, j]), "the last row has no finite element to spoil"
    r[case.tokens - 1, j] = r[case.tokens - 1, j] + r[case.tokens - 1, j].abs() + 1
    with pytest.raises(AssertionError, match=f"residual_out of rank {case.world - 1} differs"):
        check_case(case, spoilt, inputs, scale)

    # Every rank wrong the same way: residual_out far from the reference.
    spoilt = [tuple(t.clone() for t in o) for o in outs]
    for o in spoilt:
        o[1][case.tokens - 1] = o[1][case.tokens - 1] * 3 + 2
    with pytest.raises(AssertionError, match="residual_out"):
        check_case(case, spoilt, inputs, scale)

    # One element of norm_out (or code) left unwritten: the poison's NaN pattern.
    spoilt = [tuple(t.clone() for t in o) for o in outs]
    for o in spoilt:
        o[0].view(torch.uint8).reshape(case.tokens, -1)[case.tokens - 1, :o[0].element_size()] = 0xFF
    with pytest.raises(AssertionError, match="NaN positions differ"):
        check_case(case, spoilt, inputs, scale)

    if case.quant:
        # A scale off by far more than float32 rounding; then a code two units off.
        spoilt = [tuple(t.clone() for t in o) for o in outs]
        for o in spoilt:
            s = o[2]
            i = (case.tokens - 1,) if s.dim() == 1 else (case.tokens - 1, 0)
            s[i] = s[i] * 1.5 if not case.ue8m0 else s[i] * 4
        with pytest.raises(AssertionError, match="scale"):
            check_case(case, spoilt, inputs, scale)
    if case.quant or case.fp8:
        spoilt = [tuple(t.clone() for t in o) for o in outs]
        for o in spoilt:
            q = o[0].view(torch.uint8)
            t, h = case.tokens - 1, 2
            code = int(q[t, h])
            q[t, h] = (code & 0x80) | ((code & 0x7F) - 2 if (code & 0x7F) >= 2 else (code & 0x7F) + 2)
        with pytest.raises(AssertionError, match="ulp"):
            check_case(case, spoilt, inputs, scale)


def test_static_fp8_codes_follow_the_ops_own_residual_out():
    # Every rank's partial is rounded to the dtype for transport; where float32 and float64 land
    # on either side of a tie, one residual_out element moves by one ulp of that partial (within
    # residual_out's tolerance), and where that element is near zero its code moves by many
    # ulp. The rule takes the codes from the op's own residual_out (arfuse._checks.Fp8StaticRule):
    # seen on the H100 as "FP8 code 3 ulp from the reference's" in test_fp8_static (2026-12-05).
    case = next(c for c in CASES if c.fp8)
    inputs = make_inputs(case, CPU, new_seed())
    scale = torch.tensor([0.05], dtype=torch.float32)
    q64, r = _expected(case, inputs, scale)[0]
    t = case.tokens - 1
    h = int(r[t].float().abs().argmin())
    r2 = r.clone()
    # The smallest element of the token moved to one partial's ulp on the other side of zero: its
    # code changes sign, so the float64 pipeline's code is far off whatever the random inputs were
    # (with +2^-8 alone an element already near 2^-8 kept its code: a flaky premise, 2026-12-05).
    r2[t, h] = 2.0 ** -8 if float(r[t, h]) <= 0 else -(2.0 ** -8)
    gamma = inputs[2]
    q2 = reference.quantize_fp8_static(
        reference.rmsnorm(r2, gamma, case.eps, case.weight_bias, acc=torch.float32), scale)
    assert int(fp8_ulp_distance(q2, q64)[t, h]) > 1  # the float64 pipeline's code is far off
    errs = check_case(case, [(q2.clone(), r2.clone()) for _ in range(case.world)], inputs, scale)
    assert errs["norm_out"] <= 1
    # The same residual_out with that code two ulp off its own rule still fails, naming where.
    q3 = q2.clone()
    c = int(q3.view(torch.uint8)[t, h])
    q3.view(torch.uint8)[t, h] = c + 2 if (c & 0x7F) < 0x70 else c - 2
    with pytest.raises(AssertionError, match=rf"2 ulp .* at \[{t}, {h}\]"):
        check_case(case, [(q3.clone(), r2.clone()) for _ in range(case.world)], inputs, scale)


def test_gc_is_held_between_poisoning_and_the_op_and_given_back():
    import gc

    from arfuse._checks import gc_held

    assert gc.isenabled()
    with gc_held():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_held():
        raise RuntimeError("the op failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_held():
            pass
        assert not gc.isenabled(), "a collector the caller had disabled was switched on"
    finally:
        gc.enable()
