"""CPU tests of the multi-GPU check (arfuse.check) and its launcher (scripts/multigpu.sh).

No GPU: the real op runs at world size 1 only (the CPU implementation, arfuse/_cpu.py; the C++
communicator accepts a CPU device only for world size 1), in process over gloo and under
`torchrun --nproc-per-node 1`. Several ranks run on the CPU only with the hidden --fake-op seam
(the op's float32 definition instead of the kernel), which exercises the harness -- shared seeds,
input fingerprints, gathers, bitwise and reference checks, failure reporting -- in two processes
started with torchrun's worker environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkout

from arfuse import _checks
from arfuse.check import cases as ck_cases, cli as ck_cli, multicast as ck_multicast
from arfuse.check import report as ck_report, run as ck_run, run_case as ck_run_case
from arfuse.check import runner as ck_runner

ROOT = Path(__file__).resolve().parent.parent
MULTICAST_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_VARS}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env = checkout.pythonpath(env)
    env.update(extra)
    return env


# ---- NVLink multicast stays off ------------------------------------------------------------------
def test_multicast_off_is_set_by_importing_dist_check():
    # In a fresh process (no variable set beforehand) the torchrun tests below check the same
    # through each rank's report.
    for k, v in ck_multicast.MULTICAST_OFF.items():
        assert os.environ.get(k) == v
    assert ck_multicast.MULTICAST_OFF == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                "NVSHMEM_DISABLE_NVLS": "1"}


def test_multicast_off_defaults_keep_explicit_values():
    env = {}
    assert ck_multicast.multicast_off(env) == {}
    assert env == ck_multicast.MULTICAST_OFF
    env = {"NCCL_NVLS_ENABLE": "1"}
    assert ck_multicast.multicast_off(env) == {"NCCL_NVLS_ENABLE": "1"}  # kept, reported
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_no_multicast_in_the_sources():
    bad = []
    for path in [*ROOT.glob("csrc/**/*"), *ROOT.glob("arfuse/**/*.py"), *ROOT.glob("templates/**/*")]:
        if path.is_file():
            text = path.read_text(errors="replace")
            if re.search(r"cuMulticast|multimem\.|NVLS_ENABLE=1", text):
                bad.append(str(path.relative_to(ROOT)))
    assert bad == []


# ---- arguments -----------------------------------------------------------------------------------
def test_defaults():
    a = ck_cli.parse_args([])
    assert a.replays == 10_000 and a.max_tokens == 256 and a.suites == list(ck_cases.SUITES)
    assert a.out == "dist-check-out" and a.backend == "auto" and a.device == "auto"
    assert a.fake_op is None and a.seed is None
    q = ck_cli.parse_args(["--quick"])
    assert q.replays == 200 and q.quick
    assert ck_cli.parse_args(["--quick", "--replays", "0"]).replays == 0
    o = ck_cli.parse_args(["--only", "graph, token_counts"])
    assert o.suites == ["token_counts", "graph"]  # in the suites' order


@pytest.mark.parametrize("argv, message", [
    (["--replays", "-1"], "--replays must be >= 0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--timeout-s", "0"], "--timeout-s must be positive"),
    (["--pg-timeout-s", "-5"], "--pg-timeout-s must be positive"),
    (["--only", "tokens"], "--only: unknown suite tokens; choose from specialised"),
    (["--only", ","], "--only: empty list"),
    (["--name", "a/b"], "--name: 'a/b' is not a file stem"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--replays", "many"], "invalid int value"),
])
def test_bad_arguments_exit_2_with_one_clear_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        ck_cli.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_options_without_the_testing_seam(capsys):
    with pytest.raises(SystemExit) as e:
        ck_cli.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--out", "--replays", "--quick", "--max-tokens", "--only", "--seed"):
        assert opt in text
    assert "--fake-op" not in text


def test_several_cpu_ranks_without_the_seam_are_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ck_cli.DistCheckError, match="CPU implementation serves world size 1 only"):
        ck_runner.Runner(ck_cli.parse_args(["--device", "cpu"]))
    if not torch.cuda.is_available():
        with pytest.raises(ck_cli.DistCheckError, match="no CUDA device"):
            ck_runner.Runner(ck_cli.parse_args(["--device", "cuda"]))


# ---- the case list -------------------------------------------------------------------------------
def test_full_case_list_covers_the_suites():
    spec = [("bf16", 2048), ("bf16", 7168), ("fp16", 4096)]
    cases = ck_cases.build_cases(8, specialised=spec)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names (and so seeds) must be unique"
    assert all(c.case.world == 8 for c in cases)
    by = {}
    for c in cases:
        by.setdefault(c.suite, []).append(c)
    assert set(by) == set(ck_cases.SUITES) - {"graph"}
    assert len(by["specialised"]) == 3 * 2 * 2
    tc = by["token_counts"]
    assert sorted({c.case.tokens for c in tc}) == [0, 1, 3, 17, 128, 256]
    assert {c.case.algorithm for c in tc} == {"oneshot", "twoshot", "auto"}
    assert {c.case.hidden for c in tc} >= {2048, 2880, 4096, 7168}
    assert all(c.case.absent > 0 and c.case.layout == "permuted" for c in tc)
    hidden = {c.case.hidden for c in cases}
    assert hidden >= {2048, 2880, 4096, 7168}
    assert {c.case.layout for c in by["forms"]} == {"plain", "dense", "permuted"}
    assert any(c.case.absent == 1.0 for c in by["forms"])
    sp = by["specials"]
    assert all(c.case.specials for c in sp)
    assert {c.case.layout for c in sp} == {"plain", "dense", "permuted"}
    assert {c.case.dtype for c in sp} == {torch.bfloat16, torch.float16, torch.float32}
    for suite in ("specialised", "forms", "generic", "specials", "inplace", "fp8_static",
                  "no_residual"):
        assert {c.case.algorithm for c in by[suite]} == {"oneshot", "twoshot"}, suite
    assert all(c.kind == "oneshot_twoshot" and c.algorithms == ["oneshot", "twoshot"]
               for c in by["oneshot_twoshot"])
    assert all(c.case.fp8 and c.fp8_scale == ck_cases.FP8_SCALE for c in by["fp8_static"])
    assert all(c.kind == "inplace" and c.case.inplace for c in by["inplace"])
    assert all(c.kind == "no_residual" for c in by["no_residual"])


def test_quick_and_max_tokens_and_only():
    full = ck_cases.build_cases(2)
    quick = ck_cases.build_cases(2, quick=True, max_tokens=64)
    assert 0 < len(quick) < len(full) / 3
    assert {c.suite for c in quick} == set(ck_cases.SUITES) - {"graph", "specialised"}
    assert max(c.case.tokens for c in quick) == 64
    assert sorted({c.case.tokens for c in quick if c.suite == "token_counts"}) == [0, 1, 3, 17, 64]
    only = ck_cases.build_cases(4, suites=["specials"])
    assert only and {c.suite for c in only} == {"specials"}
    assert not [c for c in ck_cases.build_cases(4, max_tokens=2) if c.suite == "specials"]


def test_specialised_instances_come_from_the_manifest(tmp_path):
    m = {"instances": [
        {"name": "a", "dtype": "bf16", "hidden": 7168, "world_size": 8, "output": "norm"},
        {"name": "b", "dtype": "bf16", "hidden": 7168, "world_size": 8, "output": "norm"},
        {"name": "c", "dtype": "fp16", "hidden": 4096, "world_size": 4, "output": "norm"},
        {"name": "d", "dtype": "bf16", "hidden": 7168, "world_size": 8, "output": "fp8_token"},
        {"name": "e", "dtype": "bf16", "hidden": 0, "world_size": 0, "output": "norm"},
    ]}
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(m))
    assert ck_cases.specialised_from_manifest(p, 8) == [("bf16", 7168)]
    assert ck_cases.specialised_from_manifest(p, 4) == [("fp16", 4096)]
    assert ck_cases.specialised_from_manifest(p, 2) == []
    assert ck_cases.specialised_from_manifest(tmp_path / "missing.json", 8) == []


def test_case_seeds_are_stable_and_per_case():
    assert ck_cases.case_seed(5, "forms:x") == ck_cases.case_seed(5, "forms:x")
    assert ck_cases.case_seed(5, "forms:x") != ck_cases.case_seed(5, "forms:y")
    assert ck_cases.case_seed(5, "forms:x") != ck_cases.case_seed(6, "forms:x")
    assert 0 <= ck_cases.case_seed(2**31 - 1, "z") < 2**31


def test_fingerprint_sees_every_byte():
    a = torch.randn(5, 8, dtype=torch.bfloat16)
    b = a.clone()
    assert ck_run_case.fingerprint([a, b]) == ck_run_case.fingerprint([a.clone(), b.clone()])
    c = b.clone()
    c.view(torch.int16)[3, 2] ^= 1
    assert ck_run_case.fingerprint([a, c]) != ck_run_case.fingerprint([a, b])
    assert ck_run_case.fingerprint([a, b]) != ck_run_case.fingerprint([b.flip(0), a])


# ---- the suite's Case (tests/fused_cases.py, with the FP8 fields) and the package's draw the same inputs
def test_checks_draws_the_same_inputs_as_the_gpu_suite():
    fused_cases = pytest.importorskip("fused_cases")
    assert _checks.TOL == fused_cases.TOL and _checks.DTYPES == fused_cases.DTYPES
    for kw in (dict(layout="permuted", absent=0.3, specials=True),
               dict(layout="dense", topk=4, weights="act", gamma_f32=True, specials=True),
               dict(layout="plain", topk=1, weights=None, shared=False)):
        mine = _checks.Case(3, 64, torch.bfloat16, 9, **kw)
        theirs = fused_cases.Case(3, 64, torch.bfloat16, 9, **kw)
        assert str(mine) == str(theirs)
        a = _checks.make_inputs(mine, torch.device("cpu"), 1234)
        b = fused_cases.make_inputs(theirs, torch.device("cpu"), 1234)
        ta, tb = ck_run_case._input_tensors(a), ck_run_case._input_tensors(b)
        assert len(ta) == len(tb)
        assert all(torch.equal(_checks.bits(x), _checks.bits(y)) for x, y in zip(ta, tb))


def test_checks_catch_wrong_outputs():
    case = _checks.Case(2, 64, torch.bfloat16, 5, "permuted", 4, absent=0.3)
    inputs = _checks.make_inputs(case, torch.device("cpu"), 7)
    norm, res = _checks.reference_for(case, inputs)
    good = (norm.to(torch.bfloat16), res)
    errs = _checks.check_case(case, [good, good], inputs)
    assert errs["norm_out"] < 1e-2 and errs["residual_out"] < 1e-2
    poisoned = (_checks.poison_like((5, 64), torch.bfloat16, "cpu"), res)
    with pytest.raises(AssertionError, match="NaN positions differ"):
        _checks.check_against_reference(case, poisoned, (norm, res))
    other = (good[0].clone(), res.clone())
    other[1][0, 0] = -other[1][0, 0] if other[1][0, 0] != 0 else 1.0
    with pytest.raises(AssertionError, match="residual_out of rank 1 differs bitwise"):
        _checks.check_bitwise_equal(case, [good, other])


# ---- report --------------------------------------------------------------------------------------
def _rec(status, dtype="bf16", res=1e-5, norm=1e-3):
    r = {"case": f"c-{status}-{dtype}-{norm}", "status": status, "dtype_key": dtype, "seed": 1}
    if status == "passed":
        r.update(residual_out=res, norm_out=norm)
    if status == "failed":
        r["ranks"] = {"1": "boom"}
    if status == "skipped":
        r["reason"] = "not in this build"
    return r


def test_summary_and_report_writer(tmp_path):
    recs = [_rec("passed", "bf16", 1e-5, 1e-3), _rec("passed", "bf16", 3e-5, 2e-4),
            _rec("passed", "fp32", 1e-8, 2e-8), _rec("skipped")]
    s = ck_report.summarize(recs, {"status": "passed"})
    assert s["ok"] and (s["passed"], s["failed"], s["skipped"], s["cases"]) == (3, 0, 1, 4)
    assert s["worst"]["bf16"] == {"cases": 2, "residual_out": 3e-5, "norm_out": 1e-3}
    assert list(s["worst"]) == ["bf16", "fp32"]
    assert not ck_report.summarize(recs + [_rec("failed")], None)["ok"]
    assert not ck_report.summarize(recs, {"status": "failed"})["ok"]
    assert ck_report.summarize(recs, {"status": "skipped"})["ok"]
    assert not ck_report.summarize([_rec("skipped")], None)["ok"], "nothing passed is no pass"

    report = {"world_size": 8, "device": "cuda", "backend": "nccl", "summary": s,
              "graph": {"status": "passed", "replays": 10000, "algorithms": ["oneshot", "twoshot"]},
              "failures": [], "cases": recs, "environment": {"path": Path("/x")}}
    path = ck_report.write_report(tmp_path / "new" / "dir", "dist_check_w8", report)
    assert path == tmp_path / "new" / "dir" / "dist_check_w8.json"
    back = json.loads(path.read_text())
    assert back["summary"] == json.loads(json.dumps(s)) and back["environment"]["path"] == "/x"
    assert [p.name for p in path.parent.iterdir()] == ["dist_check_w8.json"]
    lines = ck_report.format_summary(report)
    assert lines[-1] == ("PASSED arfuse.check N=8 cuda nccl: 4 cases, 3 passed, 0 failed, "
                         "1 skipped; graph: 10000 replays x 2 algorithms, identical, no timeout")
    assert lines[0] == "  worst bf16: 2 cases, residual_out 3.00e-05, norm_out 1.00e-03"
    report["failures"] = [{"case": "c", "seed": 3, "ranks": {"1": "boom"}}]
    report["summary"] = ck_report.summarize(recs + [_rec("failed")], None)
    report["graph"] = None
    lines = ck_report.format_summary(report)
    assert "  FAILED c (seed 3): rank 1: boom" in lines
    assert lines[-1].startswith("FAILED arfuse.check N=8 cuda nccl: 5 cases, 3 passed, 1 failed")


# ---- end to end on the CPU ------------------------------------------------------------------------
def test_world_1_in_process_with_the_real_cpu_op(lib, tmp_path, capsys):
    rc = ck_run.main(["--quick", "--max-tokens", "32", "--device", "cpu", "--seed", "11",
                  "--out", str(tmp_path), "--name", "w1"])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "w1.json").read_text())
    assert rc == 0, out
    assert report["ok"] and report["world_size"] == 1 and report["device"] == "cpu"
    assert report["backend"] == "gloo" and report["fake_op"] is None and report["seed"] == 11
    s = report["summary"]
    # World size 1 runs the local algorithm only (no all-reduce): one algorithm per case.
    assert s["failed"] == 0 and s["passed"] >= 30, s
    assert {"bf16", "fp16", "fp32", "fp8_e4m3 (from bf16)"} <= set(s["worst"])
    assert report["graph"]["status"] == "skipped" and "CUDA" in report["graph"]["reason"]
    env = report["environment"]
    assert env["multicast_env"] == ck_multicast.MULTICAST_OFF
    assert env["torch"] == torch.__version__ and env["ranks"][0]["device"] == "cpu"
    # No one-shot against two-shot at world size 1: it has neither; its specialised instances
    # are the local ones of the build.
    assert {r["suite"] for r in report["cases"]} == set(ck_cases.SUITES) - {"graph", "oneshot_twoshot"}
    assert out.strip().splitlines()[-1].startswith("PASSED arfuse.check N=1 cpu gloo")
    assert not torch.distributed.is_initialized()


def _torchrun(nproc, args, tmp_path, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "arfuse.check", "--out", str(tmp_path), *args]
    return subprocess.run(cmd, cwd=checkout.cwd(), env=_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=timeout)


def test_torchrun_world_1_real_cpu_op(lib, tmp_path):
    p = _torchrun(1, ["--quick", "--only", "token_counts,fp8_static", "--max-tokens", "17"],
                  tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "dist_check_w1.json").read_text())
    # 4 token counts x (local, auto), and fp8_static with local: world size 1's one algorithm.
    assert r["ok"] and r["summary"]["passed"] == 4 * 2 + 1
    assert r["environment"]["multicast_env"] == ck_multicast.MULTICAST_OFF


def _launch_ranks(world, args, tmp_path, timeout=120):
    """`world` processes of `python -m arfuse.check` with the environment torchrun gives its
    workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT: env:// rendezvous), without
    torchrun's own process (one torch import less on a 2-core CI machine)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = _env(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "arfuse.check", "--out", str(tmp_path), *args], cwd=checkout.cwd(),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs


def test_two_cpu_ranks_harness_catches_a_bad_rank(tmp_path):
    """Two processes over gloo with the fake op: the last rank spoils one element of
    residual_out in every case with tokens; every such case must fail (bitwise across ranks, and
    against the reference on that rank), the T = 0 cases pass, every rank exits 1."""
    rcs, outs = _launch_ranks(2, ["--fake-op", "corrupt", "--quick", "--only", "token_counts",
                                  "--max-tokens", "3", "--seed", "3"], tmp_path)
    assert rcs == [1, 1], outs
    r = json.loads((tmp_path / "dist_check_w2.json").read_text())
    assert r["world_size"] == 2 and r["backend"] == "gloo" and not r["ok"]
    by = {c["case"]: c for c in r["cases"]}
    assert len(by) == 3 * 3
    for name, c in by.items():
        if c["tokens"] == 0:
            assert c["status"] == "passed", c
        else:
            assert c["status"] == "failed", c
            assert "residual_out of rank 1 differs bitwise from rank 0" in c["ranks"]["0"]
            assert "residual_out of rank 1 differs bitwise" in c["ranks"]["1"]
    assert len(r["failures"]) == 6
    assert outs[0].strip().splitlines()[-1].startswith("FAILED arfuse.check N=2 cpu gloo")
    assert outs[1].strip() == "", "only rank 0 prints"
    assert [x["rank"] for x in r["environment"]["ranks"]] == [0, 1]
    assert r["environment"]["multicast_env"] == ck_multicast.MULTICAST_OFF  # unset in the launch env


# ---- scripts/multigpu.sh --------------------------------------------------------------------------
def _plan(**env):
    return subprocess.run(["bash", str(ROOT / "scripts" / "multigpu.sh"), "unused-in-a-dry-run"],
                          env=_env(DRY_RUN="1", **env), capture_output=True, text=True,
                          timeout=60)


def test_multigpu_script_plan_on_8_gpus():
    p = _plan(NGPUS="8")
    assert p.returncode == 0, p.stderr
    assert not (ROOT / "unused-in-a-dry-run").exists(), "a dry run writes nothing"
    lines = p.stdout.splitlines()
    for k, v in ck_multicast.MULTICAST_OFF.items():
        assert f"env: {k}={v}" in lines
    runs = {m.group(1): m.group(2) for m in (re.match(r"run (\S+): (.*)", l) for l in lines) if m}
    for n in (2, 4, 8):
        for lib in ("default", "ci"):
            cmd = runs[f"check-{lib}-w{n}"]
            assert f"--nproc-per-node {n} -m arfuse.check" in cmd
            assert "-m torch.distributed.run --standalone" in cmd
        assert "build/ci/lib/libarfuse_ops.so" in runs[f"check-ci-w{n}"]
        assert "arfuse/_lib/libarfuse_ops.so" in runs[f"check-default-w{n}"]
        for m in ("deepseek-v3", "qwen3-235b-a22b", "gpt-oss-120b"):
            assert f"--nproc-per-node {n} -m arfuse.bench --model {m} " in runs[f"bench-{m}-w{n}"]
            assert "--tune" not in runs[f"bench-{m}-w{n}"]
            assert "--tune" in runs[f"tune-{m}-w{n}"]
    assert len(runs) == 3 * 2 + 3 * 3 * 2
    order = [l.split(":")[0] for l in lines if l.startswith("run ")]
    assert order.index("run check-ci-w8") < order.index("run tune-deepseek-v3-w2") < \
        order.index("run bench-deepseek-v3-w2")
    builds = [l for l in lines if l.startswith("build ")]
    assert len(builds) == 2 and all("SKIP_GEN=1" in b and "make lib" in b for b in builds)
    assert any(b.startswith("build default: make lib GENDIR=out ") for b in builds)
    assert any("MATRIX=ci GENDIR=build/ci/out BUILD=build/ci/obj LIBDIR=build/ci/lib" in b
               for b in builds)


def test_multigpu_script_caps_worlds_and_knobs():
    p = _plan(NGPUS="4", PHASES="check", CHECK_LIBS="ci")
    runs = [l.split(":")[0][4:] for l in p.stdout.splitlines() if l.startswith("run ")]
    assert p.returncode == 0 and runs == ["check-ci-w2", "check-ci-w4"]
    p = _plan(NGPUS="8", PHASES="bench", MODELS="gpt-oss-120b", WORLDS="8",
              ONLY_RUNS="bench-gpt-oss-120b-w8", BENCH_ARGS="--replays 50")
    runs = [l for l in p.stdout.splitlines() if l.startswith("run ")]
    assert len(runs) == 1 and runs[0].endswith("--replays 50")
    p = _plan(NGPUS="1")
    assert p.returncode == 3 and "needs >= 2 GPUs" in p.stdout


def test_a_failed_creation_is_told_to_every_rank(lib):
    """Two processes over gloo whose comm_create fails on every rank, each for its own reason:
    no rank waits for a peer that gave up, and every rank raises one ValueError naming every
    failed rank and its reason (arfuse.comm.Communicator._create_together)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("agree_probe.py"))], cwd=checkout.cwd(),
        env=_env(OMP_NUM_THREADS="1", RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        (line,) = [ln for ln in out.splitlines() if ln.startswith(f"rank {r}: ")]
        assert "refused: arfuse: Communicator: creation failed on 2 of 2 ranks" in line, out
        assert "rank 0: " in line and "device: cpu is not supported" in line, out
        assert "rank 1: " in line and "hidden: 2052 must be a positive multiple of 8" in line, out
