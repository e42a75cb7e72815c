"""The end-to-end vLLM script's bookkeeping (scripts/vllm_e2e.py: what it compares and counts),
on synthetic runs; the engine runs themselves need vLLM on a GPU (scripts/vllm-gpu-e2e.sh)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vllm_e2e", ROOT / "scripts" / "vllm_e2e.py")
E = importlib.util.module_from_spec(spec)
spec.loader.exec_module(E)


def run(tokens, lps, plps):
    return {"tokens": tokens, "logprobs": lps, "prompt_logprobs": plps}


def test_agreement_counts_until_the_first_difference():
    # as the JSON files hold them: token ids as str keys
    base = json.loads(json.dumps(
        [run([5, 6, 7], [{5: -0.1}, {6: -0.2}, {7: -0.3}], [None, {3: -1.0, 4: -2.0}])]))
    other = json.loads(json.dumps([run([5, 6, 9], [{5: -0.15}, {6: -0.2, 8: -1.0}, {9: -0.1}],
                                       [None, {3: -1.25, 4: -0.5}])]))
    ag = E.agreement(base, other)
    assert ag["tokens_equal"] == [2] and ag["gen"] == 3
    # steps 0, 1 and the first differing step 2 (its base token 7 is not in other's top list)
    assert abs(ag["max_dlogprob_gen"] - 0.05) < 1e-12
    # the prompt position: base's top-1 is 3; other's top-1 is 4 (disagrees), |d| = 0.25
    assert ag["prompt_top1_agree"] == "0/1" and abs(ag["max_dlogprob_prompt"] - 0.25) < 1e-12
    assert E.agreement(base, base)["tokens_equal"] == [3]
    assert E.bitwise(base, base) and not E.bitwise(base, other)


KERNEL = "kernel arfuse::fused_kernel NormWriter algo 3"
SWITCH_LINE = ("(EngineCore pid=1) INFO 12-04 02:06:28 [moe_rows.py:333] arfuse: MoE finalize "
               "handed to arfuse in 48 of 48 MoE layers\n")


def result(mode, step, fused=True, same_bits=False):
    r = run([1, 2], [{1: -0.5}, {2: -0.5}], [None, {1: -0.1}])
    if mode.startswith("arfuse") and not same_bits:  # arfuse rounds the MoE tail differently
        r = run([1, 2], [{1: -0.5}, {2: -0.53}], [None, {1: -0.1}])
    arfuse_on = mode.startswith("arfuse") and fused
    return {"mode": mode, "model": "Qwen3MoeForCausalLM", "layers": 48, "hidden": 2048,
            "gpu": "NVIDIA H200", "vllm": "0.26.0", "torch": "2.11.0", "runs": [[r], [r]],
            "latency": {k: {"median": step, "all": [step]} for k in
                        ("decode_b1_ms", "decode_b32_ms", "prefill_8192_ms")},
            "kv_cache_gib": 50.0, "torch_peak": [{"max_allocated": 2 ** 31}],
            "engine_start_s": 90.0,
            "profile": {"arfuse::fused": 48, KERNEL: 48} if arfuse_on
            else {"_moe_C::moe_sum": 48},
            "log": []}


def write_runs(tmp_path, *runs, logs=None) -> list[str]:
    paths = []
    for i, r in enumerate(runs):
        p = tmp_path / f"{i}-{r['mode']}.json"
        p.write_text(json.dumps(r))
        extra = (logs or {}).get(r["mode"], SWITCH_LINE if r["mode"].startswith("arfuse") else "")
        p.with_suffix(".log").write_text(
            "(EngineCore pid=1) INFO [gpu_worker.py:1] Available KV cache memory: 65.38 GiB\n"
            + extra)
        paths.append(str(p))
    return paths


def test_compare_writes_the_table(tmp_path):
    paths = write_runs(tmp_path, result("vllm", 10.0), result("arfuse", 9.0))
    assert E.main(["compare", *paths]) == 0
    text = E.compare(paths, str(tmp_path / "t.md"))
    assert (tmp_path / "t.md").read_text() == text
    assert "| decode step, batch 1 (ms) | 10.000 [10.00–10.00] | 9.000 (0.900×) [9.00–9.00] |" in text
    assert "| calls in one 1000-token prefill: `arfuse::fused` | 0 | 48 |" in text
    assert "| calls in one 1000-token prefill: `_moe_C::moe_sum` | 48 | 0 |" in text
    assert "arfuse against vllm: greedy tokens equal for the first [2] of 2" in text
    assert "FAILED" not in text
    assert "handed to arfuse in 48 of 48" in text
    assert "| KV cache vLLM could allocate after its profile run (GiB) | 65.38 | 65.38 |" in text


def test_profile_counts_reads_the_trace(tmp_path):
    name = ("void arfuse::fused_kernel<arfuse::KernelConfig<__nv_bfloat16, arfuse::NormWriter, "
            "(arfuse::Algo)3, 2048, 1, 128, 1, 1, 2, 0> >(arfuse::LaunchParams)")
    events = [{"cat": "cpu_op", "name": "arfuse::fused"}] * 3 + \
        [{"cat": "kernel", "name": name}] * 3 + [{"cat": "cpu_op", "name": "aten::mm"}] + \
        [{"cat": "cpu_op", "name": "_moe_C::moe_sum"}]
    d = tmp_path / "prof"
    d.mkdir()
    (d / "w.123.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    assert E.profile_counts(str(d)) == {"arfuse::fused": 3, "_moe_C::moe_sum": 1,
                                        "kernel arfuse::fused_kernel NormWriter algo 3": 3}


def test_compare_fails_when_the_arfuse_run_fused_nothing(tmp_path, capsys):
    """As at 0a7c258: the plugin failed to load, vLLM served unfused, and compare said "bitwise
    equal to vllm: True" and exited 0."""
    off = ("(EngineCore pid=1) ERROR 12-07 [arfuse_vllm_plugin.py:40] arfuse: fusion is OFF in "
           "this process: cannot import arfuse.vllm.plugin (ImportError: ...)\n")
    cases = {
        "plugin off": (result("arfuse", 9.0, fused=False, same_bits=True), {"arfuse": off}),
        "no switch line": (result("arfuse", 9.0), {"arfuse": ""}),
        "no kernel in the profile": (result("arfuse", 9.0, fused=False), None),
    }
    for name, (arfuse_run, logs) in cases.items():
        d = tmp_path / name.replace(" ", "-")
        d.mkdir()
        paths = write_runs(d, result("vllm", 10.0), arfuse_run, logs=logs)
        assert E.main(["compare", *paths]) == 1, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the arfuse run fused no layer" in err[0], (name, err)


def test_compare_fails_when_the_arfuse_run_has_vllms_bits(tmp_path, capsys):
    paths = write_runs(tmp_path, result("vllm", 10.0), result("arfuse-pdl", 9.0, same_bits=True))
    assert E.main(["compare", *paths]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "arfuse-pdl run is bitwise equal to the vllm run" in err[0], err


def test_kernel_times_and_the_decode_table(tmp_path):
    name = ("void arfuse::fused_kernel<arfuse::KernelConfig<__nv_bfloat16, arfuse::NormWriter, "
            "(arfuse::Algo)3, 2048, 1, 128, 1, 1, 2, 0> >(arfuse::LaunchParams)")
    events = [{"cat": "kernel", "name": name, "dur": 2.0}] * 4 + \
        [{"cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4, at::native::"
          "FillFunctor<float>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>)",
          "dur": 1.5}] * 2 + [{"cat": "gpu_memcpy", "name": "Memcpy DtoH", "dur": 3.0},
                              {"cat": "cpu_op", "name": "aten::mm", "dur": 100.0}]
    (tmp_path / "w.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    t = E.kernel_times(E.trace_files(str(tmp_path)))
    assert t["arfuse::fused_kernel NormWriter algo 3"] == [8.0, 4]
    assert t["at::native::vectorized_elementwise_kernel"] == [3.0, 2]
    assert t["gpu_memcpy"] == [3.0, 1] and t["_total"] == [14.0, 7]
    base, other = {"mode": "vllm", "decode_profile": {"_total": [40.0, 4], "k": [40.0, 4]},
                   "decode_profile_steps": 2}, \
        {"mode": "arfuse", "decode_profile": {"_total": [20.0, 2], "k": [20.0, 2]}}
    lines = E.decode_profile_table([base, other], base)
    assert "| all GPU work | 20.0 | 10.0 |" in lines and "| `k` | 20.0 (2×) | 10.0 (1×) |" in lines
