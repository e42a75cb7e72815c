"""One case of ``arfuse.check`` on every rank, and the CUDA-graph replay check: draw all ranks' inputs
from one seed and compare fingerprints, poison the outputs, call the op, check every element
against the float64 reference, compare the ranks' outputs bit for bit."""

from __future__ import annotations

import dataclasses
import time

from .cases import SHAPES, DistCase
from .report import dtype_key
from .runner import _err


def fingerprint(tensors) -> int:
    """A checksum of the raw bytes of `tensors` (position-weighted, so a moved byte counts)."""
    import torch

    from .._checks import bits

    total = 0
    chunk = 1 << 24
    for t in tensors:
        b = bits(t).reshape(-1)
        n = b.numel()
        acc = 0
        for start in range(0, n, chunk):
            c = b[start:start + chunk].to(torch.int64)
            w = torch.arange(start, start + c.numel(), device=c.device, dtype=torch.int64) % 65521 + 1
            acc += int((c * w).sum())
        total = (total * 1000003 + acc * 31 + n) % (1 << 61)
    return total


def _input_tensors(inputs):
    ranks, residual, gamma = inputs
    out = []
    for inp in ranks:
        out += [inp[k] for k in sorted(inp)]
    return out + [residual, gamma]


def _fake_call(runner, dc, inputs, algorithm, rank):
    """The op's definition in float32 from all ranks' inputs (testing seam, no kernel)."""
    import torch

    from .. import reference

    case = dc.case
    ranks, residual, gamma = inputs
    res_in = None if dc.kind == "no_residual" else residual
    norm, res = reference.fused_reference(ranks, res_in, gamma, case.eps,
                                          weight_bias=case.weight_bias,
                                          routed_scaling=case.routed_scaling, acc=torch.float32)
    if case.fp8:
        norm = reference.quantize_fp8_static(norm, torch.tensor([dc.fp8_scale], device=norm.device))
    else:
        norm = norm.to(case.dtype)
    res = res.clone()
    if runner.fake == "corrupt" and rank == runner.world - 1 and res.numel():
        res.view(-1)[0] = 1e4
    if dc.kind == "inplace":
        x, r = ranks[rank]["expert_out"].clone(), residual.clone()
        x.copy_(norm)
        r.copy_(res)
        return x, r
    return norm, res


def call_op(runner, dc, comm, inputs, algorithm):
    """This rank's call of the op for a case, outputs poisoned first."""
    import torch

    import arfuse
    from .._checks import gc_held

    if runner.fake:
        return _fake_call(runner, dc, inputs, algorithm, runner.rank)
    case = dc.case
    ranks, residual, gamma = inputs
    inp = ranks[runner.rank]
    if dc.kind == "inplace":  # the inputs are the outputs
        x, res = inp["expert_out"].clone(), residual.clone()
        runner.before_launch()
        return arfuse.moe_finalize_allreduce_rmsnorm(
            comm, x, res, gamma, case.eps, shared_out=inp.get("shared_out"),
            routed_scaling=case.routed_scaling, weight_bias=case.weight_bias, inplace=True,
            algorithm=algorithm)
    scale = (torch.tensor([dc.fp8_scale], dtype=torch.float32, device=runner.device)
             if case.fp8 else None)
    with gc_held():  # no collection between the poisoning and the op's allocations
        return _poisoned_call(runner, dc, comm, inp, residual, gamma, scale, algorithm)


def _poisoned_call(runner, dc, comm, inp, residual, gamma, scale, algorithm):
    import torch

    import arfuse
    from .._checks import poison_like

    case = dc.case
    T, H = case.tokens, case.hidden
    ptrs = None
    if runner.is_cuda:
        # Poison exactly the blocks the op is about to allocate (same sizes, same stream).
        out_dtype = torch.float8_e4m3fn if case.fp8 else case.dtype
        p_norm = poison_like((T, H), out_dtype, runner.device)
        p_res = poison_like((T, H), case.dtype, runner.device)
        ptrs = {p_norm.data_ptr(), p_res.data_ptr()}
        del p_norm, p_res
    runner.before_launch()
    out = arfuse.moe_finalize_allreduce_rmsnorm(
        comm, inp["expert_out"], None if dc.kind == "no_residual" else residual, gamma, case.eps,
        permuted_idx=inp.get("permuted_idx"), expert_weights=inp.get("expert_weights"),
        shared_out=inp.get("shared_out"), routed_scaling=case.routed_scaling,
        weight_bias=case.weight_bias, algorithm=algorithm, fp8_scale=scale)
    if ptrs is not None and T > 0 and {out[0].data_ptr(), out[1].data_ptr()} != ptrs:
        raise AssertionError("poisoning missed the outputs (the op's outputs are not the "
                             "poisoned blocks)")
    return out


def _status(comm, status, local_err):
    """The communicator's status word after a call (``status`` unchanged without a communicator
    or when reading it fails), and the first error."""
    if comm is None:
        return status, local_err
    try:
        return comm.status(), local_err
    except Exception as e:
        return status, local_err or _err(e)


def run_case(runner, dc: DistCase, seed: int) -> dict:
    """Runs and checks one case on every rank (collectively); the record of the case."""
    import torch

    from .._checks import (TOL, bits, check_against_reference, check_bitwise_equal, make_inputs,
                          reference_for)

    case = dc.case
    rec = {"case": dc.name, "suite": dc.suite, "seed": seed, "dtype_key": dtype_key(case),
           "world": case.world, "hidden": case.hidden, "tokens": case.tokens,
           "algorithm": "+".join(dc.algorithms), "layout": case.layout, "kind": dc.kind}
    t0 = time.time()
    missing = runner.missing_instance(case, dc.algorithms)
    if missing:
        rec.update(status="skipped", reason=missing)
        return rec

    # 1. local: inputs, the call(s). Nothing here is a collective except creating a communicator.
    local_err, fp, outs, inputs, status = None, None, {}, None, 0
    comm = None
    try:
        comm = runner.comm_for(case.hidden, case.dtype)
        inputs = make_inputs(case, runner.device, seed)
        fp = fingerprint(_input_tensors(inputs))
        for algo in dc.algorithms:
            outs[algo] = call_op(runner, dc, comm, inputs, algo)
        runner.sync()
    except Exception as e:
        local_err = _err(e)
    status, local_err = _status(comm, status, local_err)
    # 2. agree on what happened
    states = runner.gather_obj({"err": local_err, "status": status, "fp": fp})
    problems = {r: s["err"] for r, s in enumerate(states) if s["err"]}
    for r, s in enumerate(states):
        if s["status"]:
            problems.setdefault(r, f"the communicator gave up waiting for rank {s['status'] - 1} "
                                   f"(timeout {runner.args.timeout_s} s)")
    if not problems and len({s["fp"] for s in states}) > 1:
        problems = {r: f"drew inputs with fingerprint {s['fp']:#x} from seed {seed}"
                    for r, s in enumerate(states)}
    if problems:
        # Calls may now be out of step between ranks: a fresh communicator on every rank.
        runner.drop_comm(case.hidden, case.dtype)
        rec.update(status="failed", ranks={str(r): m for r, m in problems.items()},
                   seconds=round(time.time() - t0, 3))
        return rec
    # 3. every rank's outputs, gathered
    gathered = {a: list(zip(runner.gather_tensor(outs[a][0]), runner.gather_tensor(outs[a][1])))
                for a in dc.algorithms}
    # 4. local checks: bitwise across ranks, this rank's outputs against the reference
    try:
        ref = reference_for(case, inputs, None if dc.fp8_scale is None else
                            torch.tensor([dc.fp8_scale], device=runner.device),
                            residual=dc.kind != "no_residual")
        errs = {"residual_out": 0.0, "norm_out": 0.0}
        for algo in dc.algorithms:
            label = dataclasses.replace(case, algorithm=algo)
            check_bitwise_equal(label, gathered[algo])
            e = check_against_reference(label, outs[algo], ref)
            errs = {k: max(errs[k], e[k]) for k in errs}
        if case.specials and case.tokens >= 3 and not torch.isnan(outs[dc.algorithms[0]][0][1]).all():
            raise AssertionError(f"{case}: a NaN in one element must make its token's norm NaN")
        if dc.kind == "oneshot_twoshot":
            one, two = outs["oneshot"], outs["twoshot"]
            if not torch.equal(bits(one[1]), bits(two[1])):
                raise AssertionError(f"{case}: residual_out of one-shot and two-shot differ bitwise")
            a, b = one[0].double(), two[0].double()
            if not torch.equal(a.isnan(), b.isnan()):
                raise AssertionError(f"{case}: norm_out NaN positions differ between one-shot "
                                     "and two-shot")
            fin = torch.isfinite(a)
            den = float(a[fin].norm()) if fin.any() else 0.0
            d = float((a - b)[fin].norm()) / den if den else 0.0
            if d > TOL[case.dtype]:
                raise AssertionError(f"{case}: norm_out one-shot vs two-shot relative error "
                                     f"{d:.3g} > {TOL[case.dtype]:.0e}")
        local = {"ok": True, "errs": errs}
    except Exception as e:  # AssertionError from a check, or anything unexpected
        local = {"ok": False, "msg": _err(e) if not isinstance(e, AssertionError) else str(e)}
    # 5. every rank's verdict
    verdicts = runner.gather_obj(local)
    bad = {str(r): v["msg"] for r, v in enumerate(verdicts) if not v["ok"]}
    if bad:
        rec.update(status="failed", ranks=bad)
    else:
        rec.update(status="passed")
        for k in ("residual_out", "norm_out"):
            rec[k] = max(v["errs"][k] for v in verdicts)
    rec["seconds"] = round(time.time() - t0, 3)
    return rec


def run_graph(runner, seed: int, replays: int, quick: bool) -> dict:
    """One call per algorithm captured in a CUDA graph each; the graphs replayed alternately
    `replays` times; every replay's outputs bitwise equal to the first's, no timed-out wait."""
    import torch

    import arfuse
    from .._checks import (Case, bits, check_against_reference, check_bitwise_equal, make_inputs,
                          reference_for)
    from .._vocab import DTYPES, algorithms_for

    hidden, d = SHAPES["graph"][1 if quick else 0][0]
    case = Case(runner.world, hidden, DTYPES[d], min(17, runner.args.max_tokens), "permuted", 8,
                "f32", True, 1.0, absent=0.2)
    algos = list(algorithms_for(runner.world))
    res = {"case": str(case), "seed": seed, "replays": replays, "algorithms": algos}
    if replays == 0:
        return {**res, "status": "skipped", "reason": "--replays 0"}
    if runner.fake:
        return {**res, "status": "skipped", "reason": "--fake-op"}
    if not runner.is_cuda:
        return {**res, "status": "skipped", "reason": "no CUDA device: CUDA graphs need one"}
    missing = runner.missing_instance(case, algos)
    if missing:
        return {**res, "status": "skipped", "reason": missing}

    local_err, mismatches, status, seconds = None, None, 0, 0.0
    outs: dict = {}
    first: dict = {}
    graphs: dict = {}
    comm = None
    try:
        comm = runner.comm_for(case.hidden, case.dtype)
        inputs = make_inputs(case, runner.device, seed)
        ranks, residual, gamma = inputs
        inp = ranks[runner.rank]

        def call(algo):
            return arfuse.moe_finalize_allreduce_rmsnorm(
                comm, inp["expert_out"], residual, gamma, case.eps,
                permuted_idx=inp["permuted_idx"], expert_weights=inp["expert_weights"],
                shared_out=inp["shared_out"], algorithm=algo)

        for algo in algos:  # warm-up outside the graphs
            runner.before_launch()
            call(algo)
        runner.sync()
        for algo in algos:
            graphs[algo] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[algo], capture_error_mode="thread_local"):
                outs[algo] = call(algo)
        for algo in algos:
            graphs[algo].replay()
        runner.sync()
        first = {a: (o[0].clone(), o[1].clone()) for a, o in outs.items()}
        count = torch.zeros((), dtype=torch.int64, device=runner.device)
        t0 = time.time()
        for _ in range(replays):
            for algo in algos:
                graphs[algo].replay()
                o, f = outs[algo], first[algo]
                same = (bits(o[0]) == bits(f[0])).all() & (bits(o[1]) == bits(f[1])).all()
                count += (~same).to(torch.int64)
        runner.sync()
        seconds = time.time() - t0
        mismatches = int(count)
    except Exception as e:
        local_err = _err(e)
    status, local_err = _status(comm, status, local_err)
    states = runner.gather_obj({"err": local_err, "status": status, "mismatches": mismatches,
                                "seconds": seconds})
    problems = {}
    for r, s in enumerate(states):
        if s["err"]:
            problems[str(r)] = s["err"]
        elif s["status"]:
            problems[str(r)] = f"the communicator gave up waiting for rank {s['status'] - 1}"
        elif s["mismatches"]:
            problems[str(r)] = f"{s['mismatches']} of {replays * len(algos)} replays differed"
    res["seconds"] = round(max(s["seconds"] for s in states), 3)
    if not problems:
        # The first replay's outputs: bitwise equal across ranks and right.
        try:
            ref = reference_for(case, inputs)
            gathered = {a: list(zip(runner.gather_tensor(first[a][0]),
                                    runner.gather_tensor(first[a][1]))) for a in algos}
            local = {"ok": True}
            try:
                for a in algos:
                    label = dataclasses.replace(case, algorithm=a)
                    check_bitwise_equal(label, gathered[a])
                    check_against_reference(label, first[a], ref)
            except Exception as e:
                local = {"ok": False, "msg": str(e) if isinstance(e, AssertionError) else _err(e)}
        except Exception as e:
            local = {"ok": False, "msg": _err(e)}
        for r, v in enumerate(runner.gather_obj(local)):
            if not v["ok"]:
                problems[str(r)] = v["msg"]
    del graphs, outs, first
    if problems:
        runner.drop_comm(case.hidden, case.dtype)
        return {**res, "status": "failed", "ranks": problems}
    return {**res, "status": "passed"}
