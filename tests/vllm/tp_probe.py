"""One rank of vLLM's MoE decoder layers at tensor parallelism N, as N real processes sharing one
GPU (tests/vllm/test_tp_processes.py; scripts/vllm-gpu-tp.sh runs it on the GPU machine).

Each rank builds vLLM's real model class (Qwen3MoeModel of Qwen3MoeDecoderLayer, or DeepseekV2Model
of DeepseekV2DecoderLayer from a DeepSeek-V3 config; decoder_models' small configs at a real hidden
size) as rank r of TP N, with vLLM's parallel state set up for N ranks and the weights sharded by
vLLM's own parallel layers, then:

1. vLLM's unfused computation: the model's forward uncompiled (vLLM's decorator skips
   compilation while do_not_compile is set), for several token counts.
2. arfuse as a vLLM user gets it: the plugin registered by vLLM's own plugin loader
   (vllm.plugins.load_general_plugins, ARFUSE_VLLM=1, the installed wheel's entry point), the
   plugin's Worker.load_model hook body (arfuse.vllm.load.after_load_model: the communicator over the TP
   group, the MoE layers' rows switch, the ranks' agreement, the watch), then the model compiled
   through its @support_torch_compile path (VllmBackend, Inductor, vLLM's PostGradPassManager
   with the arfuse pass added by the plugin's configure hook) and run on the same inputs; one
   token count also captured in a CUDA graph and replayed.
3. Every output element compared with (1) within the tolerance of tests/vllm/test_decoder_layers.py,
   the ranks' fused outputs compared bit for bit, arfuse's kernels counted with the profiler, and
   vLLM all-reduces left in the compiled model counted.
4. What the communicator costs vLLM's KV-cache budget: the non-torch memory that grew across
   the load hook, by vLLM's own MemorySnapshot (what its memory profiling subtracts), beside
   the buffer_bytes every rank reports.

What differs from a deployment, and why:
* vLLM's all-reduce. Two ranks on one GPU: NCCL refuses them (one device per rank) and vLLM's
  custom all-reduce needs a GPU per rank too. The TP group's device communicator -- the class
  vLLM's platform names, CudaCommunicator -- is replaced by GlooAllReduce below: the sum over the
  group's CPU (gloo) group, in float32, rounded once to the activation dtype (what NCCL's
  two-rank sum gives). vLLM's GroupCoordinator, its torch.ops.vllm.all_reduce op and everything
  above it are unchanged; arfuse's own path (its Communicator over the TP group's CPU group for
  the handle exchange, CUDA IPC, its kernel) is untouched.
* Attention: decoder_models' stand-ins (no KV cache; see there).
* vLLM's engine is not used: it refuses a TP size above the GPU count. The processes come from
  torchrun; the CUDA graph is captured by torch.cuda.graph around the compiled model rather than
  by vLLM's CUDAGraphWrapper.
* Run time-sliced (no MPS): under MPS the ranks share one GPU context, where loading a kernel
  lazily (Inductor's and Triton's, at their first call) waits for every kernel on the GPU, a
  peer's arfuse kernel spinning for this rank included (docs/multigpu.md).

FP8-block cases (CASE qwen3-moe-fp8, deepseek-v3-fp8): the model as an FP8-block checkpoint
builds it (quantization_config fp8, weight_block_size [128, 128], dynamic activations): vLLM's
Fp8LinearMethod for the linear layers and Fp8MoEMethod for the experts, with the backends vLLM's
oracles pick on the GPU. The small configs' sizes are made multiples of the 128 block per rank
(vLLM's validate_fp8_block_shape). Left unquantized: the routers (as the released FP8 checkpoints
leave them) and DeepSeek's kv_b_proj, whose weight the MLA attention stand-in reads directly.
FP8 weights are drawn in e4m3's normal range (x16) with block scales 1/16 of the bf16 draw's
(fp8_weights); their bound is FP8_BOUND.

Environment: torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), CASE (qwen3-moe,
deepseek-v3, qwen3-moe-fp8 or deepseek-v3-fp8), HIDDEN (2048), OUT (a folder for rank R's result, tp-R.json), SEED.
Exit status 0 when every check passed on this rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("ARFUSE_VLLM", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from vllm.distributed.device_communicators.base_device_communicator import (  # noqa: E402
    DeviceCommunicatorBase,
)

TOKENS = (24, 7, 1)  # through the one compiled model (compile range [1, MAX_TOKENS])
GRAPH_TOKENS = 8  # captured in a CUDA graph and replayed
REPLAYS = 20
# Every element within atol + rtol * |reference| for the FP8-block cases: the expert and linear
# inputs are quantized to e4m3 per token and group of 128 in both computations, and a bf16 step
# of difference in a norm output (arfuse normalizes in float32 and rounds once) can move an
# element to the neighbouring e4m3 value (a relative step of 2^-3 at most).
FP8_BOUND = (2**-5, 2**-4)
FP8_WEIGHT_GAIN = 16.0


class DryRunDone(Exception):
    """No GPU: the set-up and vLLM's unfused forward ran; nothing of arfuse's can."""


class GlooAllReduce(DeviceCommunicatorBase):
    """vLLM's TP device communicator for ranks sharing one GPU: the all-reduce over the group's
    CPU (gloo) group, summed in float32 and rounded once (not capturable in a CUDA graph; the
    fused model must not need it)."""

    calls = 0

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        GlooAllReduce.calls += 1
        t = input_.float().cpu()
        dist.all_reduce(t, group=self.cpu_group)
        return t.to(device=input_.device, dtype=input_.dtype)


class Worker:
    """What the plugin's Worker.load_model hook reads from vLLM's Worker (its vllm_config), and
    the execute_model the watch hooks."""

    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config

    def execute_model(self, *args, **kwargs):
        return None


def parallel_state(config, world: int, rank: int) -> None:
    """vLLM's world and TP groups for N processes on gloo, every rank on cuda:0, with the TP
    group's device communicator GlooAllReduce (the class vLLM's platform names is resolved by
    qualified name: this module's)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.platforms import current_platform

    name = f"{__name__ if __name__ != '__main__' else 'tp_probe'}.GlooAllReduce"
    with set_current_vllm_config(config), mock.patch.object(
            type(current_platform), "get_device_communicator_cls", classmethod(lambda cls: name)):
        ps.init_distributed_environment(world_size=world, rank=rank,
                                        distributed_init_method="env://", local_rank=0,
                                        backend="gloo")
        ps.initialize_model_parallel(world)
    tp = ps.get_tp_group()
    assert tp.world_size == world and type(tp.device_communicator).__name__ == "GlooAllReduce", (
        tp.world_size, type(tp.device_communicator))


def build(case, dtype, seed: int, root: Path, world: int):
    """vLLM's model class for the case on cuda:0 as this rank of TP `world` (vLLM's parallel
    layers shard it), decoder_models' weights (every rank draws the same values from the seed
    for the shapes of its shard), vLLM's process_weights_after_loading (the GPU MoE backend)."""
    import decoder_models as D
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    quantized = is_fp8(case)
    # (no GPU: vLLM's norm + quant fusion passes, on for FP8 models, need its CUDA kernels)
    passes = ({"fuse_norm_quant": False, "fuse_act_quant": False}
              if device.type == "cpu" and quantized else {})
    config = D.model_config(root, case, dtype, device=device.type, passes=passes)
    rank = int(os.environ["RANK"])
    parallel_state(config, world, rank)
    default = torch.get_default_dtype()
    # (no GPU: vLLM's CPU MoE backend -- a dry run of the set-up and the unfused forward only)
    stubs = D.attention_stubs() if device.type == "cuda" else D.cpu_build()
    with stubs, fp8_skips() if quantized else contextlib.nullcontext(), \
            set_current_vllm_config(config), device:
        torch.set_default_dtype(dtype)
        try:
            model = case.model_cls()(vllm_config=config, prefix="model")
        finally:
            torch.set_default_dtype(default)
    generator = torch.Generator().manual_seed(seed)
    D.init_weights(model, generator)
    if quantized:
        assert fp8_weights(model, generator) > 0, "an FP8-block case with no FP8 weight"
    process_weights_after_loading(model, config.model_config, device)
    if device.type == "cpu":
        D._ensure_workspace()
    try:
        from vllm.v1.worker import workspace

        if not workspace.is_workspace_manager_initialized():
            workspace.init_workspace_manager(device)
    except ImportError:
        pass
    return config, model.requires_grad_(False)


def forward(model, config, ids, pos, compiled: bool) -> torch.Tensor:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    model.do_not_compile = not compiled
    with set_current_vllm_config(config), set_forward_context(None, config), torch.no_grad():
        return model(ids, pos, None)


def close_enough(got: torch.Tensor, want: torch.Tensor, dtype,
                 bound: tuple[float, float] | None = None) -> tuple[bool, float, int]:
    """Every element within atol + rtol * |want| (test_decoder_layers' bounds unless `bound`
    gives them), NaN where want is NaN; (ok, max |got - want|, elements outside)."""
    atol, rtol = bound or {torch.bfloat16: (2**-6, 2**-5), torch.float16: (2**-8, 2**-7)}[dtype]
    g, w = got.double(), want.double()
    bad = ~((g - w).abs() <= atol + rtol * w.abs())
    bad &= ~(g.isnan() & w.isnan())
    diff = (g - w).abs().nan_to_num(float("inf"))
    return not bool(bad.any()), float(diff.max()) if diff.numel() else 0.0, int(bad.sum())


def arfuse_kernels(fn) -> int:
    """arfuse kernels launched by fn() (CUDA kernel names from the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "arfuse" in e.name and e.device_type.name == "CUDA")


def make_case(name: str, hidden: int, world: int):
    """decoder_models' case at this hidden size; the FP8-block variants with every size that
    vLLM splits over the TP ranks a multiple of the 128 block per rank."""
    import decoder_models as D

    base = {"qwen3-moe": D.QWEN3_MOE, "deepseek-v3": D.DEEPSEEK_V3}[name.removesuffix("-fp8")]
    config = dict(base.config, hidden_size=hidden)
    if name.endswith("-fp8"):
        assert hidden % 128 == 0, f"HIDDEN {hidden}: FP8-block needs a multiple of 128"
        config.update(quantization_config=D.FP8_BLOCK, moe_intermediate_size=128 * world)
        if base is D.QWEN3_MOE:  # q 2 x 128, k and v 128 a rank at TP 2; o_proj's input 256
            config.update(num_attention_heads=2 * world, num_key_value_heads=world, head_dim=128)
        else:  # MLA: q_lora_rank and the heads' q / kv_b / o_proj shards 128 a rank
            config.update(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                          qk_rope_head_dim=64, v_head_dim=64, num_attention_heads=2 * world,
                          num_key_value_heads=2 * world, intermediate_size=256 * world)
    elif name not in ("qwen3-moe", "deepseek-v3"):
        raise SystemExit(f"CASE {name!r}: qwen3-moe, deepseek-v3, qwen3-moe-fp8 or deepseek-v3-fp8")
    return dataclasses.replace(base, name=name, config=config)


def is_fp8(case) -> bool:
    return "quantization_config" in case.config


@contextlib.contextmanager
def fp8_skips():
    """While an FP8-block model is built: the routers and DeepSeek's kv_b_proj left unquantized
    (vLLM's own is_layer_skipped decides every other layer)."""
    from vllm.model_executor.layers.quantization import fp8

    own = fp8.is_layer_skipped

    def skipped(prefix, *args, **kwargs):
        return prefix.endswith((".gate", ".kv_b_proj")) or own(prefix, *args, **kwargs)

    with mock.patch.object(fp8, "is_layer_skipped", skipped):
        yield


def fp8_weights(model, generator: torch.Generator) -> int:
    """FP8 weights redrawn after decoder_models.init_weights: e4m3 values N(0, 16^2) (its normal
    range; init_weights' N(0, 1 / fan-in) would be mostly subnormal) and block scales
    (1 + U(0, 1/4)) / (16 sqrt(fan-in)), times OUTPUT_SCALE for the output projections -- the
    same weight scale as the bf16 models'. Returns how many FP8 weights there are."""
    import decoder_models as D

    params = dict(model.named_parameters())
    n = 0
    with torch.no_grad():
        for name, p in params.items():
            if p.dtype != torch.float8_e4m3fn:
                continue
            scale = params.get(name + "_scale_inv")
            assert scale is not None, f"{name}: no block scale {name}_scale_inv"
            w = (FP8_WEIGHT_GAIN * torch.randn(p.shape, generator=generator)).clamp(-448, 448)
            p.copy_(w.to(p.dtype))
            s = (1.0 + 0.25 * torch.rand(scale.shape, generator=generator))
            s = s * p.shape[-1] ** -0.5 / FP8_WEIGHT_GAIN
            if D._is_output_projection(name):
                s = s * D.OUTPUT_SCALE
            scale.copy_(s.to(scale.dtype))
            n += 1
    return n


def main() -> int:
    import decoder_models as D

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    hidden = int(os.environ.get("HIDDEN", "2048"))
    case = make_case(os.environ.get("CASE", "qwen3-moe"), hidden, world)
    dtype = torch.bfloat16
    seed = int(os.environ.get("SEED") or 1234)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    logs: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(self.format(record))
            print(f"rank {rank}: {record.getMessage()}", flush=True)

    logging.getLogger("vllm.arfuse").addHandler(Keep())
    res: dict = {"rank": rank, "world": world, "case": case.name, "hidden": hidden,
                 "dtype": str(dtype), "seed": seed, "card": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                 "checks": {}}
    ok = True
    try:
        import vllm.plugins

        vllm.plugins.load_general_plugins()  # the arfuse entry point, as vLLM loads it
        from arfuse.vllm import guard, load

        assert guard.active(), f"the plugin did not load: {guard.disabled_reason()}"
        root = Path(tempfile.mkdtemp(prefix=f"arfuse-tp{rank}-"))
        config, model = build(case, dtype, seed, root, world)
        g = torch.Generator().manual_seed(seed + 1)
        vocab = int(case.config["vocab_size"])
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        sets = {t: (torch.randint(0, vocab, (t,), generator=g).to(dev), torch.arange(t).to(dev))
                for t in (*TOKENS, GRAPH_TOKENS)}
        # 1. vLLM's unfused computation (eager, vLLM's all-reduce through GlooAllReduce)
        ref = {t: forward(model, config, *a, compiled=False).clone() for t, a in sets.items()}
        from vllm.distributed.parallel_state import get_tp_group

        # the instance vLLM made: of this file imported as module tp_probe, not of __main__
        vllm_ar = type(get_tp_group().device_communicator)
        res["reference_all_reduces"] = vllm_ar.calls
        if not torch.cuda.is_available():  # the dry run ends here
            res["dry_run_cpu"] = {t: float(r.float().abs().max()) for t, r in ref.items()}
            raise DryRunDone
        # 2. the plugin's load_model hook body, then the compiled model
        # vLLM's KV-cache budget is what its memory profiling leaves: gpu_memory_utilization x
        # total, less the weights, the activations' peak and the non-torch memory that grew since
        # the worker's first snapshot (gpu_worker.determine_available_memory). The communicator's
        # buffer is cudaMalloc'ed outside torch in this hook, so it is counted there: measured here
        # with vLLM's own MemorySnapshot around the hook. The GPU's memory is every rank's (they
        # share it) and the ranks create together: the difference is all ranks' buffers.
        from vllm.utils.mem_utils import MemorySnapshot

        torch.cuda.synchronize()
        dist.barrier()
        before_hook = MemorySnapshot()
        dist.barrier()
        load.after_load_model(Worker(config), None, (), {})
        torch.cuda.synchronize()
        dist.barrier()
        grown = MemorySnapshot() - before_hook
        dist.barrier()
        assert guard.active(), f"arfuse switched off: {guard.disabled_reason()}"
        from arfuse.vllm import communicators

        comm = communicators.get_communicator(config, create=False)
        assert comm is not None and comm.world_size == world, comm
        res["communicator"] = repr(comm)
        res["buffer_bytes"] = comm.buffer_bytes
        every = [None] * world
        dist.all_gather_object(every, comm.buffer_bytes)
        res["kv_budget"] = {
            "non_torch_growth_all_ranks": grown.non_torch_memory,
            "torch_growth_all_ranks": grown.torch_memory,
            "buffer_bytes_all_ranks": sum(every),
            "per_rank": grown.non_torch_memory / world,
        }
        before = vllm_ar.calls
        t0 = time.time()
        got = {t: forward(model, config, *sets[t], compiled=True).clone() for t in TOKENS}
        res["compile_and_run_s"] = round(time.time() - t0, 1)
        res["fused_all_reduces_left"] = vllm_ar.calls - before
        res["arfuse_kernels_per_call"] = arfuse_kernels(
            lambda: forward(model, config, *sets[7], compiled=True))
        # one token count captured in a CUDA graph and replayed
        ids, pos = sets[GRAPH_TOKENS]
        forward(model, config, ids, pos, compiled=True)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = forward(model, config, ids, pos, compiled=True)
        replayed = []
        for _ in range(REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
            replayed.append(graph_out.clone())
        got[GRAPH_TOKENS] = replayed[0]
        res["graph_replays_identical"] = all(torch.equal(r, replayed[0]) for r in replayed)
        res["status"] = comm.status()
        # 3. checks
        bound = FP8_BOUND if is_fp8(case) else None
        res["bound_atol_rtol"] = bound or "test_decoder_layers'"
        for t, y in got.items():
            good, worst, n_bad = close_enough(y, ref[t], dtype, bound)
            res["checks"][f"T={t}" + (" graph" if t == GRAPH_TOKENS else "")] = {
                "ok": good, "max_abs_diff": worst, "elements_outside": n_bad,
                "elements": y.numel()}
            ok &= good
        mine = torch.cat([got[t].reshape(-1) for t in sorted(got)]).view(torch.int16).cpu()
        theirs = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(theirs, mine)
        res["ranks_bitwise_equal"] = all(torch.equal(x, theirs[0]) for x in theirs)
        ok &= res["ranks_bitwise_equal"] and res["graph_replays_identical"]
        ok &= res["fused_all_reduces_left"] == 0 and res["arfuse_kernels_per_call"] > 0
        ok &= res["status"] == 0 and guard.active()
    except DryRunDone:
        pass
    except Exception as e:  # noqa: BLE001 -- reported, then exit 1
        ok = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        print(res["traceback"], flush=True)
    res["ok"] = bool(ok)
    res["arfuse_log"] = logs
    (out / f"tp-{rank}.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"rank {rank}: {'PASSED' if ok else 'FAILED'} "
          + json.dumps({k: v for k, v in res.items() if k not in ("arfuse_log", "traceback")},
                       default=str), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no teardown of vLLM's groups or arfuse's communicator at exit
