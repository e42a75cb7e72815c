"""Run by test_moe_rows.py in a fresh process (Triton's interpreter and the hidden GPU must be set
before vLLM is imported): one of vLLM's real MoE models, built small on the CPU, compiled the way
vLLM compiles it with the arfuse pass, with and without the MoE finalize handed to arfuse
(arfuse.vllm.moe_rows.switch). Prints what happened as JSON.

Usage: python rows_probe.py ROOT CASE MODE SEED
  CASE  qwen3-moe | deepseek-v3 | mixtral
  MODE  triton: the experts are vLLM's TritonExperts (what vLLM picks on Hopper), run by Triton's
        interpreter with triton_cpu's stand-ins; the switch is expected to take every layer.
        cpu: vLLM's CPU MoE backend (decoder_models.cpu_build); the switch must leave every
        layer as vLLM built it.
"""

from __future__ import annotations

import contextlib
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

from arfuse.comm import cpu_communicator  # noqa: E402
from arfuse.vllm import moe_rows  # noqa: E402

# One Triton tile configuration for every GEMM (vLLM otherwise asks the platform for a device
# name to pick its tuned configs; the interpreter runs any valid one).
TILE = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
CASES = {"qwen3-moe": D.QWEN3_MOE, "deepseek-v3": D.DEEPSEEK_V3, "mixtral": D.MIXTRAL}
TOKENS = (9, 1)


@contextlib.contextmanager
def triton_build():
    """decoder_models.cpu_build with vLLM's TritonExperts for the unquantized experts (the
    backend vLLM's oracle picks on Hopper) instead of its CPU backend."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as um
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    with contextlib.ExitStack() as stack:
        for name in ("qwen3_moe", "deepseek_v2", "mixtral"):
            module = importlib.import_module(f"vllm.model_executor.models.{name}")
            stack.enter_context(mock.patch.object(module, "Attention", D.StubAttention))
        mla = importlib.import_module("vllm.model_executor.layers.mla")
        stack.enter_context(mock.patch.object(mla, "MLAAttention", D.StubMLAAttention))
        choice = (UnquantizedMoeBackend.TRITON, TritonExperts)
        stack.enter_context(mock.patch.object(
            um, "select_unquantized_moe_backend", lambda moe_config: choice))
        yield


def build(root: Path, case, mode: str, seed: int):
    if mode == "cpu":
        return D.build(root, case, torch.bfloat16, seed)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    config = D.model_config(root, case, torch.bfloat16)
    H.ensure_distributed(config)
    default = torch.get_default_dtype()
    with D.tensor_parallel(2), triton_build(), set_current_vllm_config(config):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = case.model_cls()(vllm_config=config, prefix="model")
        finally:
            torch.set_default_dtype(default)
        D.init_weights(model, torch.Generator().manual_seed(seed))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    D._ensure_workspace()
    return D.Built(case, config, model.requires_grad_(False), torch.bfloat16,
                   case.config["vocab_size"] // 2)


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
    import copy

    g = copy.deepcopy(graph)
    g.eliminate_dead_code()
    out = []
    for n in g.nodes:
        if H.op_name(n) != "arfuse::fused":
            continue
        x = n.args[0]
        v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        out.append({"dims": v.dim() if v is not None else None,
                    "k": int(v.shape[1]) if v is not None and v.dim() == 3 else None,
                    "source": rows_source(x), "shared": rows_source(n.args[3]),
                    "weights": repr(n.args[2]), "scale": n.args[8]})
    return out


def ops_in(graph: torch.fx.Graph) -> dict[str, int]:
    import collections

    return dict(collections.Counter(H.op_name(n) for n in graph.nodes if H.op_name(n)))


def main() -> None:
    from vllm.model_executor.layers.fused_moe import override_config

    root, name, mode, seed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    case = CASES[name]
    out: dict = {"vllm": vllm.__version__, "setup": SETUP, "case": name, "mode": mode}
    t0 = time.time()
    ref_model = build(root / "ref", case, mode, seed)  # vLLM's own path, eager
    model = build(root / "switched", case, mode, seed)  # the same weights, switched, compiled
    out["build_s"] = round(time.time() - t0, 1)
    runners = moe_rows.moe_runners(model.config)
    entries = {n: r._forward_entry for n, r in runners.items()}
    switched, kept = moe_rows.switch(model.config)
    out["layers"] = len(runners)
    out["switched"] = switched
    out["kept"] = kept
    out["entries_unchanged"] = [n for n, r in runners.items() if r._forward_entry is entries[n]]
    inps = [D.inputs(model, T, torch.Generator().manual_seed(seed + T)) for T in TOKENS]
    comm = cpu_communicator(max_tokens=H.MAX_TOKENS, hidden=case.hidden, dtype=torch.bfloat16)
    with override_config(TILE):
        triton_cpu.CALLS.clear()
        t0 = time.time()
        refs = [D.run_eager(ref_model, a) for a in inps]
        out["ref_moe_sum_calls"] = triton_cpu.CALLS.get("moe_sum", 0)
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
                     "within": float(((g - r).abs() / (2**-6 + 2**-5 * r.abs())).max())})
    out["errors"] = errs
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
