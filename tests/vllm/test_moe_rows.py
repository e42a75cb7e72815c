"""The MoE finalize handed to arfuse (arfuse.vllm.moe_rows), on vLLM's real MoE model classes.

Each case runs rows_probe.py in a fresh process (Triton's interpreter must be on before vLLM is
imported): Qwen3-MoE, DeepSeek-V3 and Mixtral, built small on the CPU with vLLM's TritonExperts
(the experts vLLM picks on Hopper; run by Triton's interpreter, CUDA-only ops by PyTorch
stand-ins, tests/vllm/triton_cpu.py), then

* switched by the same function the plugin's Worker.load_model hook calls,
* compiled the way vLLM compiles (decoder_models.compile_and_run: the model's own
  @support_torch_compile, VllmBackend, the arfuse pass added by the plugin's configure-hook code),
* and compared, every element, with the same weights run by vLLM's own path (its opaque MoE ops,
  moe_sum, eager).

A model whose experts are not eligible (vLLM's CPU MoE backend) must be left exactly as vLLM
built it. Fresh seeds each run (ARFUSE_TEST_SEED repeats one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_harness as H
import checkout

H.require_vllm()
H.require_arfuse()

PROBE = Path(__file__).with_name("rows_probe.py")
REPO = Path(__file__).resolve().parents[2]
RSF = {"qwen3-moe": 1.0, "deepseek-v3": 2.5, "mixtral": 1.0, "deepseek-v3-fp8": 2.5}


def probe(tmp_path: Path, case: str, mode: str, tp: int = 2) -> dict:
    seed = int(os.environ.get("ARFUSE_TEST_SEED") or int.from_bytes(os.urandom(3), "little"))
    env = checkout.pythonpath(os.environ)
    proc = subprocess.run([sys.executable, str(PROBE), str(tmp_path), case, mode, str(seed),
                           str(tp)],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"seed {seed}: probe failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    out["seed"] = seed
    return out


@pytest.mark.parametrize("case", ["qwen3-moe", "deepseek-v3", "mixtral", "deepseek-v3-fp8"])
def test_triton_experts_hand_their_rows_to_arfuse(tmp_path, case):
    """deepseek-v3-fp8: DeepSeek-V3's FP8-block experts (vLLM's Fp8MoEMethod, 128x128 FP8 weight
    blocks with float32 scales, activations quantized per token and group of 128 by vLLM's
    prepare step and silu_and_mul_per_block_quant, TritonExperts with use_fp8_w8a8), the rest of
    the model unquantized (vLLM's FP8-block linear layers have no CPU kernel)."""
    got = probe(tmp_path, case, "triton")
    seed = got["seed"]
    fp8 = case.endswith("-fp8")
    assert got["setup"]["bf16_dot"] and got["setup"]["rne_casts"]
    assert got["experts"] == ["TritonExperts"]
    assert got["quant_methods"] == (["Fp8MoEMethod"] if fp8 else ["UnquantizedFusedMoEMethod"])
    assert got["w13_dtype"] == (["torch.float8_e4m3fn"] if fp8 else ["torch.bfloat16"])
    if fp8:  # vLLM's own path ran the FP8 activation quant (GEMM2's input) in both layers
        assert got["ref_calls"].get("silu_and_mul_per_block_quant") == 2 * 2, got["ref_calls"]
    # Uncompiled, the switched model (rows op, then rows.sum(1)) computes exactly what vLLM's
    # own path (moe_sum inside vLLM's op) does: every element equal.
    assert got["eager_max_abs"] == [0.0] * 2, (seed, got["eager_max_abs"])
    # Every MoE layer switched, none kept.
    assert got["layers"] == 2 and len(got["switched"]) == 2 and got["kept"] == {}, got["kept"]
    assert got["entries_unchanged"] == []
    # vLLM's own path sums the top-k rows with moe_sum (once per layer per call); the rows path
    # never does.
    assert got["ref_moe_sum_calls"] == 2 * 2 and got["moe_sum_calls"] == 0
    # Each MoE tail became one arfuse call on the dense rows [T, K, H] from the rows op, router
    # weights already in them (expert_weights None), the routed scale and the shared output in.
    dense = [c for c in got["calls"] if c["dims"] == 3]
    assert len(dense) == 2, got["calls"]
    shared = case.startswith("deepseek-v3")
    for c in dense:
        assert c["k"] == 2 and c["weights"] == "None" and c["scale"] == RSF[case]
        if shared:
            assert c["source"] == "arfuse_vllm::moe_forward_shared_rows[1]"
            assert c["shared"] == "arfuse_vllm::moe_forward_shared_rows[0]"
        else:
            assert c["source"] == "arfuse_vllm::moe_forward_rows" and c["shared"] == "None"
    # Nothing of the chains is left: no top-k sum, no all-reduce, no add + norm; the rows ops
    # stay (they run the experts).
    left = {}
    for ops in got["after"]:
        for k, v in ops.items():
            left[k] = left.get(k, 0) + v
    for op in ("aten::sum", "vllm::all_reduce", "vllm_ir::fused_add_rms_norm",
               "vllm::moe_forward", "vllm::moe_forward_shared"):
        assert left.get(op, 0) == 0, (op, left)
    rows_op = "arfuse_vllm::moe_forward_shared_rows" if shared else "arfuse_vllm::moe_forward_rows"
    assert left.get(rows_op) == 2
    # The same model, switched and compiled with arfuse, against vLLM's own path, uncompiled:
    # every element within |d| <= 2^-6 + 2^-5 |ref| (bf16; arfuse sums the rows, scales and adds
    # in float32 and rounds once, vLLM rounds after each step). FP8-block experts: within
    # |d| <= 2^-4 + 2^-4 |ref|: the compiled model's MoE input differs from the uncompiled one's
    # by bf16 roundings (arfuse's fused norms), and the experts quantize it to FP8 (3 mantissa
    # bits), where one bf16 step can move a value to the next FP8 step (2^-3 relative).
    for e in got["errors"]:
        assert e["finite"] and e["within_fp8" if fp8 else "within"] <= 1.0, (seed, e)


@pytest.mark.parametrize("case", ["qwen3-moe", "deepseek-v3"])
def test_tp1_rows_go_to_the_local_kernel(tmp_path, case):
    """Tensor parallelism 1 (one GPU): vLLM's graph has no all-reduce, its MoE tail is moe_sum +
    copy (+ scale + shared add) + the next layer's fused_add_rms_norm. Switched and compiled,
    each MoE tail becomes one arfuse call on the dense rows with no all-reduce around it (auto:
    the local algorithm of a world-size-1 communicator); the attention outputs' norms stay
    vLLM's (one kernel already); the result matches vLLM's own path."""
    got = probe(tmp_path, case, "triton", tp=1)
    seed = got["seed"]
    assert got["tp"] == 1
    assert got["eager_max_abs"] == [0.0] * 2, (seed, got["eager_max_abs"])
    assert got["layers"] == 2 and len(got["switched"]) == 2 and got["kept"] == {}, got["kept"]
    assert got["ref_moe_sum_calls"] == 2 * 2 and got["moe_sum_calls"] == 0
    shared = case == "deepseek-v3"
    dense = [c for c in got["calls"] if c["dims"] == 3]
    assert len(dense) == 2 and len(got["calls"]) == 2, got["calls"]
    for c in dense:
        assert c["k"] == 2 and c["weights"] == "None" and c["scale"] == RSF[case]
        assert c["algorithm"] == 0  # auto: local at world size 1
        src = "arfuse_vllm::moe_forward_shared_rows" if shared else "arfuse_vllm::moe_forward_rows"
        assert c["source"] == (f"{src}[1]" if shared else src)
    left = {}
    for ops in got["before"] + got["after"]:
        assert ops.get("vllm::all_reduce", 0) == 0, ops  # none at TP = 1, before or after
    for ops in got["after"]:
        for k, v in ops.items():
            left[k] = left.get(k, 0) + v
    assert left.get("aten::sum", 0) == 0, left
    # Each attention output's post_attention_layernorm stays vLLM's (Qwen3-MoE: 2 layers;
    # DeepSeek-V3: 3 layers), and so does the dense MLP's next norm (DeepSeek-V3's first layer);
    # the MoE outputs' norms (the next layer's input_layernorm, the final norm) are arfuse's.
    vllms = {"qwen3-moe": 2, "deepseek-v3": 3 + 1}[case]
    assert left.get("vllm_ir::fused_add_rms_norm", 0) == vllms, left
    for e in got["errors"]:
        assert e["finite"] and e["within"] <= 1.0, (seed, e)


def test_ineligible_experts_are_left_as_vllm_built_them(tmp_path):
    """vLLM's CPU MoE backend finalizes inside its own kernel: no layer is switched, each keeps
    vLLM's own entry (the same object), the graph holds vLLM's MoE op and no rows op."""
    got = probe(tmp_path, "qwen3-moe", "cpu")
    assert got["switched"] == [] and len(got["kept"]) == 2
    assert sorted(got["entries_unchanged"]) == sorted(got["kept"])
    for why in got["kept"].values():
        assert why == ["experts finalize inside one kernel (not vLLM's modular Triton path)"] or \
            any("not TritonExperts" in w for w in why), why
    before = {}
    for ops in got["before"]:
        for k, v in ops.items():
            before[k] = before.get(k, 0) + v
    assert not any(k.startswith("arfuse_vllm::") for k in before), before
    assert all(c["dims"] == 2 for c in got["calls"])
    for e in got["errors"]:
        assert e["finite"] and e["within"] <= 1.0, (got["seed"], e)


@pytest.mark.parametrize("case", ["qwen3-moe", "deepseek-v3", "mixtral-wide"])
def test_switched_layer_peak_memory(tmp_path, case):
    """Peak of live tensor bytes while the first MoE block of the model runs once, eager on the
    CPU, switched vs vLLM's own (same weights, same input; T = 24, 9, 1), counted exactly by
    live_bytes.LiveBytes: every storage an op creates, from its creation to its release, vLLM's
    shared workspace excluded (grown by a first call, as vLLM's profile run grows it), Triton
    kernels allocating nothing (as on the GPU). The GPU's peak is not measured.

    From the code (b = 2 bytes, bf16; K top-k; N the w13 rows per rank; H hidden):

    * the two layers allocate the same tensors (op by op, shape and dtype) except that vLLM's
      [T, H] MoE output (FusedMoEKernelModularImpl.apply's empty_like) is gone and two come in:
      the fresh workspace2, W = T*K*max(N, H)*b bytes (its first T*K*H elements are the rows),
      and the top-k sum's [T, H] (rows.sum(dim=1), in the graph after the rows op);
    * vLLM's peak is at its all-reduce (the MoE output and the all-reduce's output live; with
      shared experts also the shared output and shared + rsf * routed); the switched layer's at
      its top-k sum (workspace2 and the sum live): the difference is
      max(0, W - T*H*b) without shared experts, max(0, W - 2*T*H*b) with them.

    Here H = 256, K = 2: Qwen3-MoE (N = 128): W - T*H*b = T*512 B (12288 B at T = 24);
    DeepSeek-V3 (N = 128, shared experts): 0 B; Mixtral with an intermediate size of 768
    (N = 768 > H, as Mixtral-8x7B at TP < 7): W - T*H*b = T*2560 B (61440 B at T = 24)."""
    from collections import Counter

    got = probe(tmp_path, case, "memory")
    assert got["switched"] and got["kept"] == {}, got["kept"]
    m = got["memory"]
    K, N, H, b = m["K"], m["N"], m["H"], m["itemsize"]
    assert (K, H) == (2, 256) and N == {"qwen3-moe": 128, "deepseek-v3": 128,
                                        "mixtral-wide": 768}[case]
    shared = case == "deepseek-v3"
    for r in m["runs"]:
        T = r["T"]
        W = T * K * max(N, H) * b
        # The same output, every element (eager: moe_sum and rows.sum(1) round once each).
        assert r["max_abs"] == 0.0, r
        # The allocations, as (op, bytes, shape, dtype), differ by exactly these three.
        vllm_allocs = Counter((a[0], a[1], tuple(a[2]), a[3]) for a in r["vllm_allocated"])
        sw_allocs = Counter((a[0], a[1], tuple(a[2]), a[3]) for a in r["switched_allocated"])
        assert sw_allocs - vllm_allocs == Counter([
            ("aten::empty.memory_format", W, (T, K, max(N, H)), "torch.bfloat16"),
            ("aten::sum.dim_IntList", T * H * b, (T, H), "torch.bfloat16")]), T
        ((op, *gone), n), = (vllm_allocs - sw_allocs).items()  # 0.26 empty_like, 0.34 new_empty
        assert n == 1 and op in ("aten::empty_like", "aten::new_empty") and \
            gone == [T * H * b, (T, H), "torch.bfloat16"], (T, op, gone)
        # workspace2 is live at the switched layer's peak.
        assert [W, [T, K, max(N, H)], "torch.bfloat16"] in [a[1:] for a in r["switched_at_peak"]]
        expected = max(0, W - (2 if shared else 1) * T * H * b)
        assert r["switched_peak"] - r["vllm_peak"] == expected, (T, r["switched_peak"],
                                                                 r["vllm_peak"], expected)
