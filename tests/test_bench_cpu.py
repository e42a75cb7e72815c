"""CPU tests of python -m arfuse.bench: argument parsing, model lookup, byte counts, the writers
and the crossover picker. No GPU, no compiled library."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import checkout

from arfuse.bench import byte_counts as BB
from arfuse.bench import report as BR
from arfuse.bench import cli as bench
from arfuse.bench import outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS_YAML = """\
models:
  - name: deepseek-v3
    hidden: 7168
    top_k: 8
    experts: 256
  - name: tiny
    hidden: 64
    top_k: 2
    experts: 4
    routed_scaling: 2.5
"""


@pytest.fixture
def models_file(tmp_path):
    p = tmp_path / "models.yaml"
    p.write_text(MODELS_YAML)
    return str(p)


def parse(argv, env_world=None):
    return bench.parse_args(argv, env_world=env_world)


# ---------------------------------------------------------------- argument parsing

def test_help_exits_zero_without_gpu_or_library():
    # what `python -m arfuse.bench --help` does (runpy), plus: the GPU module was not imported
    code = ("import runpy, sys\n"
            "sys.argv = ['arfuse.bench', '--help']\n"
            "try:\n"
            "    runpy.run_module('arfuse.bench', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n"
            "    assert not [m for m in ('group', 'inputs', 'impls', 'timing', 'run') if 'arfuse.bench.' + m in sys.modules], 'GPU modules imported'\n"
            "    sys.exit(e.code)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=checkout.cwd(), capture_output=True,
                       text=True, timeout=60,
                       env=checkout.pythonpath({**os.environ,
                                                "ARFUSE_LIBRARY": "/nonexistent/lib.so"}))
    assert r.returncode == 0, r.stderr
    assert "--tokens" in r.stdout and "--emulate" in r.stdout and "--tune" in r.stdout


def test_parse_tokens():
    assert bench.parse_tokens("8,1,2,2, 4") == [1, 2, 4, 8]
    assert bench.parse_tokens("8192") == [8192]
    for bad in ("", "1,x", "0", "-4", "1.5"):
        with pytest.raises(bench.BenchError):
            bench.parse_tokens(bad)


def test_default_tokens_are_powers_of_two(models_file):
    ns = parse(["--emulate", "--model", "tiny", "--models-file", models_file])
    assert ns.tokens == [2 ** i for i in range(14)]
    assert ns.tokens[-1] == 8192


def test_model_lookup(models_file):
    ns = parse(["--emulate", "--model", "tiny", "--models-file", models_file])
    assert (ns.hidden, ns.topk, ns.model_name) == (64, 2, "tiny")
    assert ns.routed_scaling == 2.5
    assert ns.world_size == 8
    ns = parse(["--emulate", "--model", "DeepSeek-V3", "--models-file", models_file,
                "--routed-scaling", "1.5"])
    assert (ns.hidden, ns.topk, ns.routed_scaling) == (7168, 8, 1.5)


def test_bad_model_name_is_a_clear_error(models_file, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--emulate", "--model", "deepseek-v9", "--models-file", models_file])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model 'deepseek-v9'" in err
    assert "deepseek-v3" in err  # suggestion / known list


def test_repository_model_table_is_found():
    ns = parse(["--emulate", "--model", "deepseek-v3"])
    assert (ns.hidden, ns.topk) == (7168, 8)


def test_read_models_yaml_rejects_bad_files(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("models:\n  - name: x\n    hidden: 8\n")
    with pytest.raises(bench.BenchError, match="top_k"):
        bench.read_models_yaml(p)
    p.write_text("foo: 1\n")
    with pytest.raises(bench.BenchError, match="models"):
        bench.read_models_yaml(p)


@pytest.mark.parametrize("argv, msg", [
    (["--emulate"], "--model NAME or --hidden"),
    (["--emulate", "--hidden", "4096"], "--topk is required"),
    (["--emulate", "--hidden", "4096", "--topk", "8", "--replays", "49"], "--replays must be >= 50"),
    (["--emulate", "--hidden", "4096", "--topk", "8", "--world-size", "17"], "1..16"),
    (["--emulate", "--hidden", "4096", "--topk", "8", "--impls", "arfuse,nccl"], "unknown nccl"),
    (["--hidden", "4096", "--topk", "8"], "not under torchrun"),
    (["--emulate", "--hidden", "4096", "--topk", "8", "--tokens", "1,two"], "not an integer"),
])
def test_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_model_and_hidden_conflict(models_file, capsys):
    with pytest.raises(SystemExit):
        parse(["--emulate", "--model", "tiny", "--models-file", models_file, "--hidden", "64"])
    assert "not both" in capsys.readouterr().err


def test_torchrun_world_size():
    ns = parse(["--hidden", "4096", "--topk", "8"], env_world=4)
    assert ns.world_size == 4 and not ns.emulate
    with pytest.raises(SystemExit):
        parse(["--hidden", "4096", "--topk", "8", "--world-size", "8"], env_world=4)


def test_impls_tune_and_plain():
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8", "--impls", "torch,arfuse"])
    assert ns.impls == ["arfuse", "torch"]  # canonical order
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8", "--tune"])
    assert ns.impls == ["arfuse_oneshot", "arfuse_twoshot"]
    ns = parse(["--emulate", "--hidden", "4096", "--layout", "plain"])
    assert ns.topk == 1 and ns.absent_frac == 0.0
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8"])
    assert ns.replays == 100 and ns.graph_calls == 20 and ns.layout == "permuted"
    assert ns.absent_frac == 0.1 and ns.plot and ns.shared


def test_pdl_impl_is_asked_for_by_name():
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8"])
    assert "arfuse_pdl" not in ns.impls and not ns.producer  # not in the default set
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8", "--impls", "arfuse_pdl,arfuse",
                "--producer"])
    assert ns.impls == ["arfuse", "arfuse_pdl"] and ns.producer


def test_output_stem_and_command():
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8", "--dtype", "fp16"])
    assert outputs.output_stem(ns) == "bench_h4096k8_emu8_fp16_permuted"
    assert outputs.command_line(ns, ["--emulate", "--hidden", "4096"]).startswith(
        "python -m arfuse.bench --emulate")
    ns = parse(["--hidden", "4096", "--topk", "8"], env_world=2)
    assert outputs.command_line(ns, ["--hidden", "4096"]).startswith(
        "torchrun --nproc-per-node=2 -m arfuse.bench")


# ---------------------------------------------------------------- byte counts

def test_finalize_input_bytes_by_hand():
    # permuted: T=2, K=3, H=8, bf16; 5 of 6 rows valid; fp32 weights; shared
    b = BB.finalize_input_bytes("permuted", 2, 8, 3, 2, valid_rows=5)
    assert b == {"expert_rows": 5 * 8 * 2, "weights": 6 * 4, "indices": 6 * 4, "shared": 2 * 8 * 2}
    b = BB.finalize_input_bytes("dense", 2, 8, 3, 2, valid_rows=5, shared=False)
    assert b == {"expert_rows": 6 * 8 * 2, "weights": 24, "indices": 0, "shared": 0}
    b = BB.finalize_input_bytes("plain", 2, 8, 3, 4)
    assert b == {"expert_rows": 2 * 8 * 4, "weights": 0, "indices": 0, "shared": 2 * 8 * 4}


def test_oneshot_bytes_by_hand():
    # T=4, H=16, K=2, N=2, bf16 (e=2), dense, fp32 weights, shared
    # F_in = 8 rows*16*2 = 256, weights 8*4 = 32, shared 4*16*2 = 128  -> 416
    # row = T*H*e = 128: push 2*128, peer reads 2*128, clear 2*128 = 768
    # residual 128, gamma 16*2 = 32, outputs 256                      -> 416
    assert BB.op_bytes("oneshot", "dense", 4, 16, 2, 2, 2) == 416 + 768 + 416
    b = BB.op_bytes_breakdown("oneshot", "dense", 4, 16, 2, 2, 2)
    assert b["push"] == b["peer_reads"] == b["clear"] == 256


def test_twoshot_bytes_by_hand():
    # T=4, H=16, K=2, N=2, bf16, dense: row = 128, a rank's own rows 64, its peers' 64
    # (the owner's own partials and gathered rows stay in registers):
    # scatter 64, owner reads 64, owner residual 64, gather writes 64, gather reads 64,
    # clear 2*64 = 128, gamma 32, outputs 256                             -> 736
    assert BB.op_bytes("twoshot", "dense", 4, 16, 2, 2, 2) == 416 + 736
    # T=5, N=2: own rows 2.5 on average -> (5*16*2 + 1) // 2 = 80 bytes, peers' 80
    b = BB.op_bytes_breakdown("twoshot", "plain", 5, 16, 1, 2, 2, shared=False)
    assert b["clear"] == 2 * 80 and b["scatter"] == b["gather_reads"] == 80
    assert b["residual"] == 5 * 16 * 2 // 2
    assert b["expert_rows"] == 5 * 16 * 2 and b["weights"] == 0 and b["shared"] == 0
    # N=8, T=64, H=7168: the docstring's F_in + 8*T*H*e - 5*(T/N)*H*e + H*g
    T, H, N, e = 64, 7168, 8, 2
    f_in = T * H * e
    assert BB.op_bytes("twoshot", "plain", T, H, 1, N, e, shared=False) == \
        f_in + 8 * T * H * e - 5 * (T // N) * H * e + H * e


def test_oneshot_formula_matches_docstring():
    T, H, K, N, e = 64, 7168, 8, 8, 2
    valid = 460
    f_in = valid * H * e + T * K * 4 + T * K * 4 + T * H * e
    got = BB.op_bytes("oneshot", "permuted", T, H, K, N, e, valid_rows=valid)
    assert got == f_in + 3 * N * T * H * e + 3 * T * H * e + H * e


def test_unfused_bytes_by_hand():
    # T=4, H=16, K=2, N=2, bf16, dense: finalize 416 + write 128 = 544
    # plain op one-shot: read 128, push/peer/clear 768, residual 128, gamma 32, outputs 256 = 1312
    assert BB.unfused_bytes("oneshot", "dense", 4, 16, 2, 2, 2) == 544 + 1312


def test_local_bytes_by_hand():
    # World size 1 (no all-reduce). T=4, H=16, K=2, N=1, bf16, dense, fp32 weights, shared:
    # F_in 416 (as above), residual 128, gamma 32, outputs 256             -> 832
    assert BB.op_bytes("local", "dense", 4, 16, 2, 1, 2) == 416 + 128 + 32 + 256
    # unfused: finalize 416 + its [T, H] write 128, then the plain local op (= vLLM's
    # fused_add_rms_norm: x and residual read, both written, gamma): 128 + 128 + 32 + 256
    assert BB.unfused_bytes("local", "dense", 4, 16, 2, 1, 2) == 544 + 544
    # vLLM's tail at TP 1 without shared expert or scale: moe_sum 256 + 128, copy 256, norm 544
    assert BB.vllm_today_bytes("local", 4, 16, 2, 1, 2, shared=False) == 384 + 256 + 544
    # auto at world size 1 is local, needing no threshold; vllm_ops counts as vllm_today
    assert BB.resolve_algorithm("auto", 4096, None, 1) == "local"
    assert BB.impl_bytes("arfuse", "dense", 4, 16, 2, 1, 2, oneshot_max_tokens=None) == 832
    assert BB.impl_bytes("vllm_ops", "dense", 4, 16, 2, 1, 2, oneshot_max_tokens=None,
                         weight_elem=0, shared=False) == \
        BB.vllm_today_bytes("local", 4, 16, 2, 1, 2, shared=False)
    with pytest.raises(ValueError, match="does not serve world size 2"):
        BB.op_bytes("local", "dense", 4, 16, 2, 2, 2)
    with pytest.raises(ValueError, match="does not serve world size 1"):
        BB.op_bytes("oneshot", "dense", 4, 16, 2, 1, 2)


def test_impl_bytes_dispatch():
    kw = dict(oneshot_max_tokens=4)
    one = BB.op_bytes("oneshot", "dense", 4, 16, 2, 2, 2)
    two = BB.op_bytes("twoshot", "dense", 8, 16, 2, 2, 2)
    assert BB.impl_bytes("arfuse", "dense", 4, 16, 2, 2, 2, **kw) == one
    assert BB.impl_bytes("arfuse", "dense", 8, 16, 2, 2, 2, **kw) == two
    assert BB.impl_bytes("arfuse_twoshot", "dense", 8, 16, 2, 2, 2, **kw) == two
    assert BB.impl_bytes("unfused", "dense", 4, 16, 2, 2, 2, **kw) == \
        BB.unfused_bytes("oneshot", "dense", 4, 16, 2, 2, 2)
    assert BB.impl_bytes("torch", "dense", 4, 16, 2, 2, 2, **kw) is None
    assert BB.impl_bytes("arfuse", "dense", 4, 16, 2, 2, 2, oneshot_max_tokens=None) is None
    assert BB.impl_bytes("flashinfer_p1", "dense", 8, 16, 2, 2, 2, algorithm="oneshot") == \
        BB.unfused_bytes("oneshot", "dense", 8, 16, 2, 2, 2)


def test_byte_count_errors():
    with pytest.raises(ValueError):
        BB.op_bytes("threeshot", "dense", 4, 16, 2, 2, 2)
    with pytest.raises(ValueError):
        BB.op_bytes("oneshot", "sparse", 4, 16, 2, 2, 2)
    with pytest.raises(ValueError):
        BB.finalize_input_bytes("permuted", 2, 8, 3, 2, valid_rows=7)


def test_input_rotation():
    # one permuted set, bf16, T=1, H=7168, K=8, fp32 weights, shared
    s = BB.input_set_bytes("permuted", 1, 7168, 8, 2)
    assert s == 8 * 7168 * 2 + 7168 * 2 + 8 * 4 + 8 * 4 + 7168 * 2
    l2 = 60 << 20
    n = BB.num_input_sets(s, l2)
    assert n * s > 4 * l2 and (n - 1) * s <= 4 * l2
    assert BB.num_input_sets(10 << 30, l2) == 2          # huge sets: still 2 (consecutive differ)
    assert BB.num_input_sets(1, l2, max_sets=64) == 64    # capped
    assert BB.num_input_sets(l2, l2) == 5                 # 4x exactly is not "exceeds"


def test_timed_replays_walk_the_whole_rotation():
    """Every input set is read by the timed replays, and the rotation exceeds 4x L2 for the
    smallest set the ladder uses (T = 1, H = 2048, N = 2, plain, no shared: 16 KiB)."""
    l2 = 50 << 20
    set_bytes = BB.input_set_bytes("plain", 1, 2048, 8, 2, shared=False) * 2
    assert set_bytes == 16 << 10
    n_sets = BB.num_input_sets(set_bytes, l2)          # the default cap
    assert n_sets * set_bytes > 4 * l2
    for G, replays in ((24, 50), (20, 100), (2, 50), (1, 50)):
        graphs, timed = BB.replay_plan(n_sets, G, replays)
        walked = {(g * G + c) % n_sets for i in range(timed) for g in [i % graphs] for c in range(G)}
        assert timed >= replays and len(walked) == n_sets
    # the old behaviour, for contrast: 50 replays of 24 calls over 2,048 sets read 19 MiB
    assert min(2048, 50 * 24) * set_bytes < l2
    with pytest.raises(ValueError):
        BB.replay_plan(0, 24, 50)


# ---------------------------------------------------------------- rows and writers

def synthetic_rows():
    rows = []
    for T, a, one, two, unf, tor in [(1, 10.0, 10.0, 14.0, 20.0, 80.0),
                                     (64, 12.0, 12.0, 15.0, 24.0, 90.0),
                                     (512, 30.0, 35.0, 30.0, 60.0, 200.0)]:
        for impl, med in (("arfuse", a), ("arfuse_oneshot", one), ("arfuse_twoshot", two),
                          ("unfused", unf), ("torch", tor)):
            rows.append(BR.new_row(impl, T, median_us=med, p10_us=med * 0.9, p90_us=med * 1.1,
                                   bytes_per_rank=None if impl == "torch" else 1_000_000 * T,
                                   timing="graph", replays=100, graph_calls=20, input_sets=4,
                                   algorithm="oneshot"))
    rows.append(BR.new_row("flashinfer_p7", 1, note="failed: RuntimeError: boom"))
    return rows


def test_percentile_and_summary():
    xs = list(range(1, 11))
    assert BR.percentile(xs, 50) == 5.5
    assert BR.percentile(xs, 10) == pytest.approx(1.9)
    assert BR.percentile(xs, 90) == pytest.approx(9.1)
    assert BR.percentile([3.0], 90) == 3.0
    s = BR.summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert s["median_us"] == 3.0 and s["n"] == 5


def test_finish_rows_ratio_and_bandwidth():
    rows = BR.finish_rows(synthetic_rows(), copy_gbps=4000.0, ranks_per_gpu=8)
    by = {(r["impl"], r["tokens"]): r for r in rows}
    r = by[("arfuse", 64)]
    assert r["ratio_to_unfused"] == pytest.approx(12.0 / 24.0)
    assert r["bytes_counted"] == 64_000_000 * 8
    assert r["gbps"] == pytest.approx(64e6 * 8 / 12e-6 / 1e9)
    assert r["frac_copy_bw"] == pytest.approx(r["gbps"] / 4000.0)
    assert by[("unfused", 64)]["ratio_to_unfused"] == pytest.approx(1.0)
    assert by[("torch", 64)]["gbps"] is None
    assert by[("flashinfer_p7", 1)]["ratio_to_unfused"] is None


def test_csv_roundtrip(tmp_path):
    rows = BR.finish_rows(synthetic_rows(), copy_gbps=4000.0, ranks_per_gpu=1)
    p = tmp_path / "r.csv"
    BR.write_csv(p, rows)
    with open(p) as f:
        recs = list(csv.DictReader(f))
    assert list(recs[0]) == list(BR.CSV_FIELDS)
    assert len(recs) == len(rows)
    assert (recs[0]["impl"], recs[0]["tokens"]) == ("arfuse", "1")  # sorted by T, then impl
    back = BR.read_csv(p)
    a = next(r for r in back if r["impl"] == "arfuse" and r["tokens"] == 512)
    assert a["median_us"] == 30.0 and a["bytes_per_rank"] == 512_000_000
    assert a["ratio_to_unfused"] == pytest.approx(0.5)
    f = next(r for r in back if r["impl"] == "flashinfer_p7")
    assert f["median_us"] is None and f["note"].startswith("failed")


def test_markdown_table():
    rows = BR.finish_rows(synthetic_rows(), copy_gbps=4000.0, ranks_per_gpu=8)
    md = BR.markdown_table(rows, title="t", notes=["n1"], emulated=True, world_size=8,
                           copy_gbps=4000.0)
    lines = md.splitlines()
    head = next(l for l in lines if l.startswith("| T |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cols[:6] == ["T", "arfuse (auto)", "arfuse one-shot", "arfuse two-shot",
                        "unfused (finalize + AR/norm)", "PyTorch composition"]
    assert cols[-2:] == ["arfuse GB/s", "% copy BW"]
    assert "FlashInfer pattern 7" in cols
    body = [l for l in lines if l.startswith("| 64 |")]
    assert len(body) == 1
    cells = [c.strip() for c in body[0].strip("|").split("|")]
    assert cells[1] == "12.0 (0.50×)"
    gbps = 64e6 * 8 / 12e-6 / 1e9
    assert cells[-2] == f"{gbps:,.0f}"
    assert cells[-1] == f"{100 * gbps / 4000:.0f}%"
    assert "share one GPU" in md and "Emulated group: 8 ranks" in md
    assert "- FlashInfer pattern 7, T=1: failed: RuntimeError: boom" in md
    # one line per token count
    assert sum(1 for l in lines if l.startswith("| ") and not l.startswith("| T")) == 3


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "p.png"
    BR.plot(p, BR.finish_rows(synthetic_rows(), copy_gbps=None, ranks_per_gpu=1), title="x")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- crossover

def tune_rows(pairs):
    rows = []
    for T, one, two in pairs:
        rows.append(BR.new_row("arfuse_oneshot", T, median_us=one))
        rows.append(BR.new_row("arfuse_twoshot", T, median_us=two))
    return rows


def test_crossover_simple():
    thr, warns = BR.pick_crossover(tune_rows([(1, 5, 9), (2, 5, 9), (4, 6, 8), (8, 9, 8),
                                              (16, 14, 10)]))
    assert thr == 4 and warns == []


def test_crossover_edges():
    thr, warns = BR.pick_crossover(tune_rows([(1, 9, 5), (2, 9, 5)]))
    assert thr == 0 and warns
    thr, warns = BR.pick_crossover(tune_rows([(1, 1, 5), (2, 1, 5)]))
    assert thr == 2 and any("beyond" in w for w in warns)
    # noisy: two-shot wins at 2, one-shot again at 4 -> largest one-shot win, with a warning
    thr, warns = BR.pick_crossover(tune_rows([(1, 1, 5), (2, 6, 5), (4, 6, 7), (8, 9, 7)]))
    assert thr == 4 and any("not monotone" in w for w in warns)
    # two-shot not timed at T=1 (e.g. T < N): counts as a one-shot win
    rows = tune_rows([(2, 6, 5)]) + [BR.new_row("arfuse_oneshot", 1, median_us=3.0),
                                     BR.new_row("arfuse_twoshot", 1, note="skip")]
    assert BR.pick_crossover(rows)[0] == 1


def test_tuning_row_and_yaml():
    import yaml

    row = BR.tuning_row("bf16", 7168, 8, 128)
    assert row == "- {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 128}"
    doc = yaml.safe_load(BR.tuning_yaml(card="NVIDIA H200", date="2026-01-02T03:04:05+00:00",
                                        commit="abc", command="python -m arfuse.bench --tune",
                                        rows=[row], warnings=["w"]))
    assert doc == {"card": "NVIDIA H200", "date": "2026-01-02", "commit": "abc",
                   "command": "python -m arfuse.bench --tune",
                   "thresholds": [{"dtype": "bf16", "hidden": 7168, "world_size": 8,
                                   "oneshot_max_tokens": 128}]}


# ---------------------------------------------------------------- end to end writers

def test_write_outputs_from_synthetic_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8", "--out", str(tmp_path),
                "--tune", "--tokens", "1,64,512"])
    monkeypatch.setenv("ARFUSE_COMMIT", "deadbeef")
    res = {"rows": synthetic_rows(), "copy_gbps": 4000.0, "oneshot_max_tokens": 64,
           "notes": ["a note"], "checks": [], "failed_check": [], "aborted": None,
           "is_main": True, "l2_bytes": 60 << 20, "card": "Fake GPU", "flashinfer": None,
           "flashinfer_api": None}
    paths = outputs.write_outputs(ns, res, ["--emulate", "--tune"])
    assert set(paths) == {"csv", "md", "json", "yaml", "png"}
    env = json.loads(paths["json"].read_text())
    assert env["card"] == "Fake GPU" and env["arfuse_commit"] == "deadbeef"
    assert env["tuning"]["oneshot_max_tokens"] == 64
    assert env["command"] == "python -m arfuse.bench --emulate --tune"
    assert "oneshot_max_tokens: 64" in paths["yaml"].read_text()
    md = paths["md"].read_text()
    assert "Fake GPU" in md and "Note: a note" in md and "one-shot for T <= 64" in md


def test_no_gpu_message(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = bench.main(["--emulate", "--hidden", "4096", "--topk", "8"])
    assert rc == 1
    assert "no CUDA GPU" in capsys.readouterr().err


# ---------------------------------------------------------------- the PyTorch side on the CPU

class _SeqGroup:
    """LocalGroup stand-in: calls fn(rank, None) for every rank, one after the other."""

    def __init__(self, n):
        self.n = n

    def run(self, fn):
        return [fn(r, None) for r in range(self.n)]

    def status(self):
        return [0] * self.n


def _cpu_setup(layout, dtype_name="bf16", N=3, H=64, K=4, shared=True, scaling=2.5,
               weight_bias=0.0):
    torch = pytest.importorskip("torch")
    from arfuse.bench import group

    dtype = group.TORCH_DTYPES[dtype_name]
    args = SimpleNamespace(hidden=H, topk=1 if layout == "plain" else K, layout=layout,
                           shared=shared, routed_scaling=scaling, eps=1e-6,
                           weight_bias=weight_bias, absent_frac=0.25 if layout == "permuted"
                           else 0.0, seed=1, dtype=dtype_name, world_size=N, tokens=[5],
                           comm_timeout=1.0, weights_dtype="fp32")
    g = torch.Generator().manual_seed(0)
    gamma = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return group.Setup(args=args, dtype=dtype, elem=gamma.element_size(),
                        weight_dtype=torch.float32, device=torch.device("cpu"), emulated=True,
                        world_size=N, rank=0, ranks=list(range(N)), gamma=gamma,
                        gamma_plus=gamma.float() + weight_bias, group=_SeqGroup(N))


@pytest.mark.parametrize("layout", ["permuted", "dense", "plain"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_torch_composition_matches_reference(layout, dtype_name):
    st = _cpu_setup(layout, dtype_name, weight_bias=1.0 if layout == "dense" else 0.0)
    from arfuse.bench import impls as BM, inputs as BI
    sets = BI.make_sets(st, 5, 2)
    assert len(sets) == 2 and set(sets[0]) == {0, 1, 2}
    a, b = sets[0][0], sets[0][1]
    assert a.residual.equal(b.residual)                       # replicated
    assert a.residual.data_ptr() != b.residual.data_ptr()     # in separate memory
    assert not a.expert_out.equal(b.expert_out)               # per-rank partials
    assert not sets[0][0].expert_out.equal(sets[1][0].expert_out)  # sets differ
    if layout == "permuted":
        assert a.idx.dtype.is_floating_point is False and a.idx.shape == (5, 4)
        assert (a.idx >= 0).sum() == a.valid_rows
        assert 0 < BI.mean_valid_rows(sets) <= 20
    ref = BI.reference(st, sets[0])
    outs = BM.TorchEmulated(st, sets).once(0)
    assert len(outs) == 3
    for norm, res in outs:
        assert norm.dtype == st.dtype and res.dtype == st.dtype
        assert BI.rel_err(norm, ref[0]) <= BI.TOLERANCE[dtype_name]
        assert BI.rel_err(res, ref[1]) <= BI.TOLERANCE[dtype_name]
    # the other set gives another answer: the check would catch a kernel reading stale data
    assert BI.rel_err(BM.TorchEmulated(st, sets).once(1)[0][0], ref[0]) > 0.1


def test_rel_err_flags_nan_and_scales_by_max():
    torch = pytest.importorskip("torch")
    from arfuse.bench import inputs as BI

    ref = torch.tensor([1.0, -4.0, 2.0])
    assert BI.rel_err(ref.clone(), ref) == 0.0
    assert BI.rel_err(torch.tensor([1.0, -4.0, 2.04]), ref) == pytest.approx(0.01)
    assert BI.rel_err(torch.tensor([float("nan"), -4.0, 2.0]), ref) == float("inf")


def test_flashinfer_views_fold_scaling_and_absent_rows():
    torch = pytest.importorskip("torch")
    from arfuse import reference

    st = _cpu_setup("permuted", "fp32")
    from arfuse.bench import inputs as BI
    sets = BI.make_sets(st, 5, 1)
    BI.add_flashinfer_views(st, sets)
    inp = sets[0][1]
    assert inp.fi["idx"].min() >= 0 and inp.fi["idx"].dtype == torch.int32
    want = reference.finalize(inp.expert_out, num_tokens=5, permuted_idx=inp.idx,
                              expert_weights=inp.weights, shared_out=inp.shared,
                              routed_scaling=2.5)
    got = reference.finalize(inp.fi["rows"], num_tokens=5, permuted_idx=inp.fi["idx"],
                             expert_weights=inp.fi["weights"], shared_out=inp.shared)
    assert torch.allclose(got, want, atol=1e-5)


def test_graph_calls_for_scales_down_above_128_tokens():
    from arfuse.bench import byte_counts as BB
    assert [BB.graph_calls_for(T, 20) for T in (1, 64, 128, 256, 512, 1024, 8192)] == \
        [20, 20, 20, 10, 5, 2, 2]
    assert BB.graph_calls_for(8192, 1) == 1
    with pytest.raises(ValueError, match="graph_calls must be >= 1"):
        BB.graph_calls_for(4, 0)


def test_quant_byte_counts():
    from arfuse.bench import byte_counts as BB
    T, H, K, N, e = 64, 7168, 8, 8, 2
    base = BB.impl_bytes("arfuse", "permuted", T, H, K, N, e, oneshot_max_tokens=0)
    row = T * H
    # fused: norm_out as 1-byte codes instead of 2-byte values, plus the scales
    assert BB.impl_bytes("arfuse_q", "permuted", T, H, K, N, e, oneshot_max_tokens=0,
                         quant="fp8_static") == base - row
    assert BB.impl_bytes("arfuse_q", "permuted", T, H, K, N, e, oneshot_max_tokens=0,
                         quant="fp8_token") == base - row + 4 * T
    assert BB.impl_bytes("arfuse_q", "permuted", T, H, K, N, e, oneshot_max_tokens=0,
                         quant="fp8_group128") == base - row + 4 * T * (H // 128)
    # separate kernel: the bf16 op, then read norm_out, write codes and scales
    assert BB.impl_bytes("arfuse_sepq", "permuted", T, H, K, N, e, oneshot_max_tokens=0,
                         quant="fp8_token") == base + 2 * row + row + 4 * T
    with pytest.raises(ValueError, match="unknown quant"):
        BB.scale_bytes("int8", T, H)


def test_quant_impls_need_quant():
    from arfuse.bench import cli as bench
    ns = bench.parse_args(["--emulate", "--model", "deepseek-v3", "--quant", "fp8_token"])
    assert "arfuse_q" in ns.impls and "arfuse_sepq" in ns.impls
    ns = bench.parse_args(["--emulate", "--model", "deepseek-v3"])
    assert "arfuse_q" not in ns.impls
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--emulate", "--model", "deepseek-v3", "--impls", "arfuse_q"])
    assert e.value.code == 2


def test_separate_quant_kernel_scales_on_the_triton_interpreter():
    """The bench's separate quantization kernels (Triton), run by Triton's CPU interpreter in a
    subprocess: scale values and the shapes of every kind. Codes are not compared here: the
    interpreter's float8 conversion does not round like the GPU's (the GPU run checks the
    dequantized output against the float32 reference before timing)."""
    pytest.importorskip("triton")
    import textwrap
    code = textwrap.dedent("""
        import torch
        from arfuse.bench import quant as BQ
        torch.manual_seed(0)
        y = (torch.randn(5, 1152) * torch.rand(5, 1) * 10).bfloat16()
        yf = y.float()
        q, sc = BQ.quantize(y, "fp8_token")
        assert q.shape == (5, 1152) and q.dtype == torch.float8_e4m3fn and sc.shape == (5,)
        ref = (yf.abs().amax(1) / 448).clamp_min(1 / (448 * 512))
        assert torch.allclose(sc, ref, rtol=1e-6, atol=0), (sc, ref)
        q, sc = BQ.quantize(y, "fp8_group128")
        ref = yf.reshape(5, 9, 128).abs().amax(2).clamp_min(1e-10) / 448
        assert sc.shape == (5, 9) and torch.allclose(sc, ref, rtol=1e-6, atol=0), (sc, ref)
        q, sc = BQ.quantize(y, "fp8_static", torch.full((1,), 1 / 16))
        assert sc is None and q.shape == (5, 1152)
        assert BQ.quantize(y[:0], "fp8_group128")[1].shape == (0, 9)
        print("ok")
    """)
    env = checkout.pythonpath(dict(os.environ, TRITON_INTERPRET="1"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# ---------------------------------------------------------------- "vLLM today" (issue 13)

def test_vllm_today_arguments():
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8", "--layout", "dense",
                "--weights-dtype", "none"])
    assert "vllm_today" in ns.impls and ns.impls.index("vllm_today") == \
        ns.impls.index("unfused") + 1
    ns = parse(["--emulate", "--hidden", "4096", "--topk", "8", "--layout", "dense"])
    assert "vllm_today" not in ns.impls  # weighted rows: not what vLLM hands over
    for layout in ("permuted", "plain"):
        with pytest.raises(bench.BenchError, match="--weights-dtype none: .*dense"):
            bench.resolve_args(bench.build_parser().parse_args(
                ["--emulate", "--hidden", "4096", "--topk", "8", "--layout", layout,
                 "--weights-dtype", "none"]))
    with pytest.raises(bench.BenchError, match="vllm_today needs --layout dense"):
        bench.resolve_args(bench.build_parser().parse_args(
            ["--emulate", "--hidden", "4096", "--topk", "8", "--impls", "vllm_today"]))


def test_vllm_today_bytes_by_hand():
    # T=4, H=16, K=2, N=2, bf16: moe_sum reads 4*2*16*2 = 256, writes 128; copy 256;
    # shared + rsf*y 384 (or rsf*y 256, or nothing); plain op one-shot 1312 (as unfused's)
    op = 1312
    assert BB.vllm_today_bytes("oneshot", 4, 16, 2, 2, 2, shared=True) == 256 + 128 + 256 + 384 + op
    assert BB.vllm_today_bytes("oneshot", 4, 16, 2, 2, 2, shared=False, scaled=True) == \
        256 + 128 + 256 + 256 + op
    assert BB.vllm_today_bytes("oneshot", 4, 16, 2, 2, 2, shared=False) == 256 + 128 + 256 + op
    assert BB.impl_bytes("vllm_today", "dense", 4, 16, 2, 2, 2, oneshot_max_tokens=4,
                         shared=False, scaled=True, weight_elem=0) == 256 + 128 + 256 + 256 + op
    # the fused call on the same rows reads no weights
    assert BB.op_bytes("oneshot", "dense", 4, 16, 2, 2, 2, weight_elem=0, shared=False) == \
        BB.op_bytes("oneshot", "dense", 4, 16, 2, 2, 2, shared=False) - 4 * 2 * 4


def test_markdown_ratios_to_vllm_today():
    rows = synthetic_rows()
    for T, med in ((1, 40.0), (64, 48.0), (512, 100.0)):
        rows.append(BR.new_row("vllm_today", T, median_us=med, bytes_per_rank=1000))
    rows = BR.finish_rows(rows, copy_gbps=None, ranks_per_gpu=1)
    by = {(r["impl"], r["tokens"]): r for r in rows}
    assert by[("arfuse", 64)]["ratio_to_vllm_today"] == pytest.approx(12.0 / 48.0)
    assert by[("arfuse", 64)]["ratio_to_unfused"] == pytest.approx(12.0 / 24.0)
    md = BR.markdown_table(rows, title="t")
    assert "ratio to vLLM today" in md
    line = next(l for l in md.splitlines() if l.startswith("| 64 |"))
    assert "12.0 (0.25×)" in line
    assert "ratio to the unfused pipeline" in BR.markdown_table(synthetic_rows(), title="t")
    # vLLM's own kernels are the baseline where they were timed, and only there (a run without
    # vLLM importable skips them: the ratios stay to vLLM today, not empty)
    skipped = rows + [BR.new_row("vllm_ops", T, note="vLLM's kernels not available")
                      for T in (1, 64, 512)]
    assert "ratio to vLLM today" in BR.markdown_table(BR.finish_rows(
        skipped, copy_gbps=None, ranks_per_gpu=1), title="t")
    timed = rows + [BR.new_row("vllm_ops", T, median_us=24.0) for T in (1, 64, 512)]
    md = BR.markdown_table(BR.finish_rows(timed, copy_gbps=None, ranks_per_gpu=1), title="t")
    assert "ratio to vLLM's kernels" in md
    assert "12.0 (0.50×)" in next(l for l in md.splitlines() if l.startswith("| 64 |"))


@pytest.mark.parametrize("shared, scaling", [(True, 2.5), (False, 1.0), (False, 2.5)])
def test_vllm_today_composition_on_the_cpu(shared, scaling):
    """The composition on weighted dense rows against the float32 reference of the op's
    definition (world size 1 on the CPU communicator); what it feeds the all-reduce is the
    rows summed in float32 and rounded once, then shared + rsf * y rounded once (vLLM's)."""
    torch = pytest.importorskip("torch")
    from arfuse.comm import cpu_communicator

    st = _cpu_setup("dense", "bf16", N=1, shared=shared, scaling=scaling)
    from arfuse.bench import impls as BM, inputs as BI
    st.args.weights_dtype = "none"
    import arfuse
    st.ar = arfuse
    sets = BI.make_sets(st, 5, 2)
    inp = sets[0][0]
    assert inp.weights is None and inp.expert_out.shape == (5, 4, 64)
    comm = cpu_communicator(max_tokens=5, hidden=64, dtype=torch.bfloat16)
    st.group = None
    st.per_rank = lambda fn: [fn(0, comm)]
    impl = BM.VllmToday(st, sets)
    y = impl._finalize(inp)
    want = inp.expert_out.float().sum(1).to(torch.bfloat16).float() * scaling
    if shared:
        want = want + inp.shared.float()
    assert torch.equal(y, want.to(torch.bfloat16))
    ref = BI.reference(st, sets[0])
    (norm, res), = impl.once(0)
    assert BI.rel_err(norm, ref[0]) <= BI.TOLERANCE["bf16"]
    assert BI.rel_err(res, ref[1]) <= BI.TOLERANCE["bf16"]
    assert BI.rel_err(impl.once(1)[0][0], ref[0]) > 0.1


# ---------------------------------------------------------------- the latency ladder (issue 16)

def test_ladder_table_from_synthetic_rungs():
    from arfuse.bench import ladder

    ns = ladder.build_parser().parse_args(["--model", "deepseek-v3", "--world-size", "8"])
    med = {"empty": 3.0, "floor": 7.0, "safe_floor": 7.25, "plain": 8.0, "dense": 9.0,
           "dense_nw": 8.5,
           "permuted": 9.5, "shared": 10.0, "scaled": 10.0}
    res = {r: {1: BR.new_row("arfuse", 1, median_us=m), 16: BR.new_row("arfuse", 16, note="x")}
           for r, m in med.items()}
    md = ladder.markdown(ns, {"rungs": list(med), "results": res, "card": "Fake"}, [1, 16])
    rows = {l.split("|")[1].strip(): [c.strip() for c in l.strip("|").split("|")]
            for l in md.splitlines() if l.startswith("| ") and not l.startswith("| rung")}
    assert rows["empty"][2] == "3.00" and rows["floor"][2] == "7.00 (+4.00)"
    assert rows["safe_floor"][2] == "7.25 (+0.25)" and rows["plain"][2] == "8.00 (+0.75)"
    assert rows["dense_nw"][2] == "8.50 (-0.50)"      # beside dense ...
    assert rows["permuted"][2] == "9.50 (+0.50)"      # ... so permuted is compared with dense
    assert rows["scaled"][3] == "skip" and "- scaled T=16: x" in md


def test_ladder_rungs_are_bench_arguments():
    from arfuse.bench import ladder

    for rung, (_, argv) in ladder.RUNGS.items():
        ns = bench.parse_args(["--emulate", "--model", "deepseek-v3", "--impls", "arfuse", *argv])
        assert ns.layout in ("plain", "dense", "permuted"), rung
    assert ladder.GRAPH_CALLS % 3 == 0  # floor.cu's slot rotation


def test_floor_kernel_compiles(tmp_path, monkeypatch):
    """floor.cu builds for every world size the ladder uses (nvcc and torch's cudart needed)."""
    pytest.importorskip("torch")
    from arfuse.bench import ladder

    if not (Path(ladder.__file__).resolve().parents[2] / "csrc" / "bench" / "floor.cu").exists():
        pytest.skip("arfuse imported from an installed wheel: the floor kernel needs a checkout")
    recorded = Path(ROOT) / "build" / "nvcc.path"  # where make put the toolchain's nvcc
    nvcc = os.environ.get("NVCC") or (recorded.read_text().strip() if recorded.exists() else "")
    if not nvcc or not Path(nvcc).exists() or ladder._cudart_dir() is None:
        pytest.skip("no nvcc or cudart here")
    monkeypatch.setenv("NVCC", nvcc)
    for n in (2, 8):
        so = ladder.compile_floor(n, tmp_path)
        syms = subprocess.run(["nm", "-D", str(so)], capture_output=True, text=True).stdout
        for name in ("floor_launch", "empty_launch", "floor_prepare", "world_size"):
            assert f" T {name}" in syms


@pytest.mark.parametrize("argv, msg", [
    (["--model", "deepseek-v3", "--rungs", "floor,nope"], "--rungs: unknown nope"),
    (["--model", "deepseek-v3", "--tokens", "1,x"], "not an integer"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--model", "deepseek-v3", "--replays", "10"], "--replays must be >= 50"),
    (["--model", "deepseek-v3", "--world-size", "17"], "1..16"),
])
def test_ladder_argument_errors(argv, msg, capsys):
    from arfuse.bench import ladder

    with pytest.raises(SystemExit) as e:
        ladder.parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_reference_gathers_the_ranks_partials_over_gloo(tmp_path):
    """Under torchrun every rank's partial is gathered for the reference (inputs.reference). With
    ranks sharing one GPU the group is gloo, whose all_gather_into_tensor takes the output as
    [world * T, H] only (seen on an H100, d6d500a: "invalid tensor size ... expected (1, 2048),
    got (1, 1, 2048)"). A one-rank gloo group here: its reference equals the emulated path's."""
    import torch
    import torch.distributed as dist

    from arfuse.bench import inputs

    args = SimpleNamespace(hidden=264, topk=4, seed=7, layout="permuted", weights_dtype="f32",
                           absent_frac=0.1, shared=True, routed_scaling=1.5, eps=1e-6,
                           weight_bias=0.0)
    gamma = torch.rand(264) + 0.5
    setup = SimpleNamespace(args=args, device=torch.device("cpu"), dtype=torch.bfloat16,
                            weight_dtype=torch.float32, ranks=[0], world_size=1, emulated=False,
                            gamma=gamma)
    (per,) = inputs.make_sets(setup, 5, 1)
    want = inputs.reference(SimpleNamespace(**{**vars(setup), "emulated": True}), per)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        got = inputs.reference(setup, per)
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_shared_gpu_runs_are_labelled_as_a_test_mode():
    ns = parse(["--hidden", "2048", "--topk", "8", "--device", "cuda:0"], env_world=2)
    assert ns.shared_gpu
    assert outputs.output_stem(ns) == "bench_h2048k8_shared2_bf16_permuted"
    assert "ranks sharing one GPU, a test mode" in outputs.title(ns, "H100")
    assert "one GPU per rank" not in outputs.title(ns, "H100")
    row = {"impl": "arfuse", "tokens": 16, "median_us": 5.0, "bytes_per_rank": 1000}
    BR.finish_rows([row], copy_gbps=1000.0, ranks_per_gpu=1)
    table = BR.markdown_table([row], shared_gpu=True, copy_gbps=1000.0)
    assert "the N processes share one GPU's HBM" in table and "one GPU per rank" not in table
