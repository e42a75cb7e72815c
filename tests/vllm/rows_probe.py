"""Run by test_moe_rows.py in a fresh process (Triton's interpreter and the hidden GPU must be set
before vLLM is imported): one of vLLM's real MoE models, built small on the CPU, compiled the way
vLLM compiles it with the arfuse pass, with and without the MoE finalize handed to arfuse
(arfuse.vllm.moe_rows.switch). Prints what happened as JSON.

Usage: python rows_probe.py ROOT CASE MODE SEED [TP]
  TP    the tensor-parallel size the model is built and compiled as (default 2; 1: no
        all-reduce in the graph, the single-GPU case)
  CASE  qwen3-moe | deepseek-v3 | mixtral
  MODE  triton: the experts are vLLM's TritonExperts (what vLLM picks on Hopper), run by Triton's
        interpreter with triton_cpu's stand-ins; the switch is expected to take every layer.
        cpu: vLLM's CPU MoE backend (decoder_models.cpu_build); the switch must leave every
        layer as vLLM built it.
        memory: triton's models, uncompiled; the peak of live tensor bytes (live_bytes.LiveBytes)
        while the first MoE block runs once, switched and vLLM's own, on the same input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import operator
import os
import sys
import time
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import vllm  # noqa: E402

import triton_cpu  # noqa: E402

SETUP = triton_cpu.setup(vllm.__version__)

import decoder_models as D  # noqa: E402
import vllm_harness as H  # noqa: E402
from live_bytes import LiveBytes  # noqa: E402

from arfuse.comm import cpu_communicator  # noqa: E402
from arfuse.vllm import moe_rows  # noqa: E402

# One Triton tile configuration for every GEMM (vLLM otherwise asks the platform for a device
# name to pick its tuned configs; the interpreter runs any valid one).
TILE = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
# Mixtral with a wide expert (intermediate 768: N = 2 * 768 / TP 2 = 768 > H = 256), as
# Mixtral-8x7B at TP < 7: vLLM's workspace2 is then larger than the rows.
MIXTRAL_WIDE = dataclasses.replace(D.MIXTRAL, name="mixtral-wide",
                                   config=dict(D.MIXTRAL.config, intermediate_size=768))
# DeepSeek-V3 as released: FP8-block experts (128x128 weight blocks, activations quantized per
# token and group of 128: vLLM's Fp8MoEMethod with TritonExperts). Its intermediate size is 256
# (128 per rank: a whole block).
DEEPSEEK_V3_FP8 = dataclasses.replace(
    D.DEEPSEEK_V3, name="deepseek-v3-fp8",
    config=dict(D.DEEPSEEK_V3.config, moe_intermediate_size=256, quantization_config=D.FP8_BLOCK))
CASES = {"qwen3-moe": D.QWEN3_MOE, "deepseek-v3": D.DEEPSEEK_V3, "mixtral": D.MIXTRAL,
         "mixtral-wide": MIXTRAL_WIDE, "deepseek-v3-fp8": DEEPSEEK_V3_FP8}
TOKENS = (9, 1)
# The MoE ops whose Python kernels LiveBytes follows inside.
MOE_OPS = frozenset({"vllm::moe_forward", "vllm::moe_forward_shared",
                     "arfuse_vllm::moe_forward_rows", "arfuse_vllm::moe_forward_shared_rows"})
MEMORY_TOKENS = (24, 9, 1)


@contextlib.contextmanager
def triton_build():
    """decoder_models.cpu_build with vLLM's TritonExperts for the unquantized and the FP8
    experts (the backend vLLM's oracles pick on Hopper) instead of its CPU backend. With an FP8
    quantization config, only the experts are FP8 (Fp8MoEMethod): vLLM's FP8-block linear layers
    have no CPU kernel, so every other layer is built unquantized (the config's ignored-layer
    test answers yes for them)."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as um
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.quantization import fp8

    with contextlib.ExitStack() as stack:
        for name in ("qwen3_moe", "deepseek_v2", "mixtral"):
            module = importlib.import_module(f"vllm.model_executor.models.{name}")
            stack.enter_context(mock.patch.object(module, "Attention", D.StubAttention))
        mla = importlib.import_module("vllm.model_executor.layers.mla")
        stack.enter_context(mock.patch.object(mla, "MLAAttention", D.StubMLAAttention))
        choice = (UnquantizedMoeBackend.TRITON, TritonExperts)
        stack.enter_context(mock.patch.object(
            um, "select_unquantized_moe_backend", lambda moe_config: choice))
        stack.enter_context(mock.patch.object(
            fp8, "select_fp8_moe_backend",
            lambda *a, **k: (Fp8MoeBackend.TRITON, TritonExperts)))
        stack.enter_context(mock.patch.object(
            fp8, "is_layer_skipped", lambda prefix, *a, **k: not prefix.endswith(".experts")))
        yield


def build(root: Path, case, mode: str, seed: int, tp: int):
    """The case's model: with vLLM's CPU MoE backend (mode cpu), else with TritonExperts."""
    if mode == "cpu":
        return D.build(root, case, torch.bfloat16, seed, tp=tp)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    # vLLM turns its norm + quant fusion passes on for FP8 models; their module needs vLLM's CUDA
    # kernels to import (and the linear layers here are unquantized: nothing for them to fuse).
    quantized = "quantization_config" in case.config
    passes = {"fuse_norm_quant": False, "fuse_act_quant": False} if quantized else {}
    config = D.model_config(root, case, torch.bfloat16, passes=passes)
    H.ensure_distributed(config)
    default = torch.get_default_dtype()
    with D.tensor_parallel(tp), triton_build(), set_current_vllm_config(config):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = case.model_cls()(vllm_config=config, prefix="model")
        finally:
            torch.set_default_dtype(default)
        generator = torch.Generator().manual_seed(seed)
        D.init_weights(model, generator)
        with torch.no_grad():  # FP8 block scales: positive, around 1
            for n, p in model.named_parameters():
                if n.endswith("weight_scale_inv"):
                    p.copy_(1.0 + 0.25 * torch.rand(p.shape, generator=generator))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    D._ensure_workspace()
    return D.Built(case, config, model.requires_grad_(False), torch.bfloat16,
                   case.config["vocab_size"] // tp, tp)


def rows_source(node) -> str:
    """What produced an arfuse.fused expert input: the rows op (its output, or item 1 of the
    shared variant), else the producing op's name."""
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        return f"{H.op_name(src)}[{idx}]"
    return H.op_name(node) or str(node.target)


def calls(graph: torch.fx.Graph) -> list[dict]:
    """Every arfuse.fused call after dead-code elimination: the expert input's rank and source,
    the shared input's source, the routed scale."""
    out = []
    for n in H.fused_nodes(graph):
        x = n.args[0]
        v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        out.append({"dims": v.dim() if v is not None else None,
                    "k": int(v.shape[1]) if v is not None and v.dim() == 3 else None,
                    "source": rows_source(x), "shared": rows_source(n.args[3]),
                    "weights": repr(n.args[2]), "scale": n.args[8], "algorithm": n.args[11]})
    return out


def ops_in(graph: torch.fx.Graph) -> dict[str, int]:
    import collections

    return dict(collections.Counter(H.op_name(n) for n in graph.nodes if H.op_name(n)))


def moe_block(built) -> tuple[torch.nn.Module, object]:
    """The first decoder layer's MoE block (its submodule holding a MoE runner) and the runner."""
    runners = {id(r): r for r in moe_rows.moe_runners(built.config).values()}
    for layer in built.model.layers:
        for child in layer.children():
            for m in child.modules():
                if id(m) in runners:
                    return child, m
    raise AssertionError("no MoE block")


@contextlib.contextmanager
def kernels_allocate_nothing():
    """While LiveBytes counts: a kernel launch under Triton's interpreter runs with the mode off
    (the interpreter's numpy work and triton_cpu's rounding casts go through torch, a GPU kernel
    allocates nothing), and is followed by a garbage collection (the interpreter leaves
    reference cycles holding the kernel's arguments, which would keep them alive past their
    last use in vLLM's code)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter as ti

    launch = ti.GridExecutor.__call__

    def call(self, *args, **kwargs):
        with _disable_current_modes():
            launch(self, *args, **kwargs)
        gc.collect()

    with mock.patch.object(ti.GridExecutor, "__call__", call):
        yield


def peak_bytes(built, block: torch.nn.Module, x: torch.Tensor) -> tuple[LiveBytes, torch.Tensor]:
    """LiveBytes of one eager call of `block` on x, after a first call (which grows vLLM's shared
    workspace to what the call asks: on a GPU vLLM's profile run has done so before serving)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with D.tensor_parallel(built.tp), set_current_vllm_config(built.config), \
            set_forward_context(None, built.config), torch.no_grad():
        block(x.clone())
        x = x.clone()
        gc.collect()
        with kernels_allocate_nothing(), LiveBytes(MOE_OPS) as lb:
            y = block(x)
    return lb, y


def memory(ref_model, model, case, seed: int) -> dict:
    (ref_block, _), (block, runner) = moe_block(ref_model), moe_block(model)
    assert getattr(runner._forward_entry, "arfuse_rows", False)
    routed = runner.routed_experts
    out: dict = {"K": int(runner.moe_config.experts_per_token), "H": case.hidden,
                 "N": int(routed.w13_weight.shape[1]), "itemsize": 2, "runs": []}
    for T in MEMORY_TOKENS:
        g = torch.Generator().manual_seed(seed + T)
        x = torch.randn(T, case.hidden, generator=g).to(torch.bfloat16)
        ref, y_ref = peak_bytes(ref_model, ref_block, x)
        got, y = peak_bytes(model, block, x)
        out["runs"].append({
            "T": T, "vllm_peak": ref.peak, "switched_peak": got.peak,
            "vllm_at_peak": [dataclasses.astuple(a) for a in ref.at_peak],
            "switched_at_peak": [dataclasses.astuple(a) for a in got.at_peak],
            "vllm_allocated": [dataclasses.astuple(a) for a in ref.allocated],
            "switched_allocated": [dataclasses.astuple(a) for a in got.allocated],
            "max_abs": float((y.double() - y_ref.double()).abs().max())})
    return out


def main() -> None:
    from vllm.model_executor.layers.fused_moe import override_config

    root, name, mode, seed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    case = CASES[name]
    out: dict = {"vllm": vllm.__version__, "setup": SETUP, "case": name, "mode": mode, "tp": tp}
    t0 = time.time()
    ref_model = build(root / "ref", case, mode, seed, tp)  # vLLM's own path, eager
    model = build(root / "switched", case, mode, seed, tp)  # same weights, switched, compiled
    out["build_s"] = round(time.time() - t0, 1)
    runners = moe_rows.moe_runners(model.config)
    entries = {n: r._forward_entry for n, r in runners.items()}
    switched, kept = moe_rows.switch(model.config)
    out["layers"] = len(runners)
    out["switched"] = switched
    out["kept"] = kept
    out["entries_unchanged"] = [n for n, r in runners.items() if r._forward_entry is entries[n]]
    if mode == "memory":
        with override_config(TILE):
            out["memory"] = memory(ref_model, model, case, seed)
        print("RESULT " + json.dumps(out))
        return
    inps = [D.inputs(model, T, torch.Generator().manual_seed(seed + T)) for T in TOKENS]
    comm = cpu_communicator(max_tokens=H.MAX_TOKENS, hidden=case.hidden, dtype=torch.bfloat16)
    with override_config(TILE):
        triton_cpu.CALLS.clear()
        t0 = time.time()
        refs = [D.run_eager(ref_model, a) for a in inps]
        out["ref_moe_sum_calls"] = triton_cpu.CALLS.get("moe_sum", 0)
        out["ref_calls"] = dict(triton_cpu.CALLS)
        # The switched model uncompiled: the rows op and the top-k sum, eager.
        eager = [D.run_eager(model, a) for a in inps]
        out["eager_max_abs"] = [float((e.double() - r.double()).abs().max())
                                for e, r in zip(eager, refs)]
        triton_cpu.CALLS.clear()
        run = D.compile_and_run(model, comm, inps)
        out["moe_sum_calls"] = triton_cpu.CALLS.get("moe_sum", 0)
        out["run_s"] = round(time.time() - t0, 1)
    comm.close()
    out["calls"] = sum((calls(after) for _, after in run.graphs), [])
    out["before"] = [ops_in(before) for before, _ in run.graphs]
    out["after"] = [ops_in(after) for _, after in run.graphs]
    errs = []
    for T, ref, got in zip(TOKENS, refs, run.outputs):
        r, g = ref.double(), got.double()
        errs.append({"T": T, "shape": list(got.shape), "finite": bool(torch.isfinite(g).all()),
                     "max_abs": float((g - r).abs().max()), "ref_max": float(r.abs().max()),
                     "rel": float((g - r).norm() / r.norm()),
                     "within": float(((g - r).abs() / (2**-6 + 2**-5 * r.abs())).max()),
                     "within_fp8": float(((g - r).abs() / (2**-4 + 2**-4 * r.abs())).max())})
    out["errors"] = errs
    out["quant_methods"] = sorted({type(r.routed_experts.quant_method).__name__
                                   for r in runners.values()})
    out["experts"] = sorted({type(getattr(getattr(r.routed_experts.quant_method, "moe_kernel",
                                                  None), "fused_experts", None)).__name__
                             for r in runners.values()})
    out["w13_dtype"] = sorted({str(r.routed_experts.w13_weight.dtype) for r in runners.values()})
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
