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


def test_compare_writes_the_table(tmp_path):
    def result(mode, step):
        r = run([1, 2], [{1: -0.5}, {2: -0.5}], [None, {1: -0.1}])
        return {"mode": mode, "model": "Qwen3MoeForCausalLM", "layers": 48, "hidden": 2048,
                "gpu": "NVIDIA H200", "vllm": "0.26.0", "torch": "2.11.0", "runs": [[r], [r]],
                "latency": {k: {"median": step, "all": [step]} for k in
                            ("decode_b1_ms", "decode_b32_ms", "prefill_8192_ms")},
                "kv_cache_gib": 50.0, "torch_peak": [{"max_allocated": 2 ** 31}],
                "engine_start_s": 90.0, "profile": {"arfuse::fused": 48} if mode == "arfuse"
                else {"_moe_C::moe_sum": 48},
                "log": ["vllm.arfuse: arfuse: MoE finalize handed to arfuse in 48 of 48 MoE "
                        "layers"] if mode == "arfuse" else []}
    paths = []
    for mode, step in (("vllm", 10.0), ("arfuse", 9.0)):
        p = tmp_path / f"{mode}.json"
        p.write_text(json.dumps(result(mode, step)))
        p.with_suffix(".log").write_text(
            "(EngineCore pid=1) INFO [gpu_worker.py:1] Available KV cache memory: 65.38 GiB\n" +
            ("(EngineCore pid=1) INFO 12-04 02:06:28 [moe_rows.py:333] arfuse: MoE finalize "
             "handed to arfuse in 48 of 48 MoE layers\n" if mode == "arfuse" else ""))
        paths.append(str(p))
    text = E.compare(paths, str(tmp_path / "t.md"))
    assert (tmp_path / "t.md").read_text() == text
    assert "| decode step, batch 1 (ms) | 10.000 [10.00–10.00] | 9.000 (0.900×) [9.00–9.00] |" in text
    assert "| calls in one 1000-token prefill: `arfuse::fused` | 0 | 48 |" in text
    assert "| calls in one 1000-token prefill: `_moe_C::moe_sum` | 48 | 0 |" in text
    assert "arfuse against vllm: greedy tokens equal for the first [2] of 2" in text
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
