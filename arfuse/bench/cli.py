"""arfuse benchmark: ``python -m arfuse.bench``.

Times, for each token count T, the fused op (auto dispatch, one-shot, two-shot), the unfused
pipeline built from arfuse's separate kernels (standalone ``arfuse.moe_finalize``, then the op on
the reduced input with the plain layout: all-reduce + residual + RMSNorm), a plain PyTorch
composition and, under torchrun with FlashInfer installed, FlashInfer's pattern 7 (MoE finalize +
all-reduce + residual + RMSNorm) and finalize + pattern 1. With ``--layout dense --weights-dtype
none`` (the router-weighted ``[T, K, H]`` rows vLLM's Triton experts produce) also "vLLM today"
(``vllm_today``): what vLLM runs on those rows on Hopper -- ``moe_sum`` (the sum over K, float32
accumulation, one rounding), the copy of the ``[T, H]`` result into the layer's output, the
routed-scaling multiply and shared-expert add (one kernel, as Inductor fuses them), then the
all-reduce + residual + RMSNorm (arfuse's plain-layout kernel stands in for vLLM's FlashInfer or
custom all-reduce + ``fused_add_rms_norm``); the table's ratios are then to it.

Two ways to run::

    # one GPU, N ranks emulated by arfuse.testing.LocalGroup (all ranks' kernels concurrent)
    python -m arfuse.bench --emulate --world-size 8 --model deepseek-v3 --out bench-out

    # one GPU per rank
    torchrun --nproc-per-node 8 -m arfuse.bench --model deepseek-v3 --out bench-out

Timing is CUDA-graph replay: ``--graph-calls`` consecutive calls per graph up to 128 tokens,
proportionally fewer above (at least 2; ``byte_counts.graph_calls_for``) (all N ranks' calls
when emulated: each rank issues its calls on its own stream forked from the capture stream and
joined back, so replays run the ranks concurrently), at least 50 timed replays, per-call time =
replay time / graph-calls; median and p10/p90 reported. Inputs rotate over enough distinct sets
to exceed 4x the L2 cache (consecutive calls use different sets; when the sets outnumber the
calls of one graph, several graphs are captured and replayed round-robin). Before timing, one
call of every implementation is checked against a float32 reference (arfuse.reference); a wrong
kernel is not timed (and the run exits 1). A call that times out waiting for a peer stops that
case (not timed) and the communicators are recreated.

Emulation details: the unfused pipeline and the PyTorch composition run in two phases per call
(every rank's finalize, then every rank's reduction), joined in between, because a finalize
kernel queued behind spinning peers could otherwise never be scheduled; the fused op needs no
join. The PyTorch composition's "all-reduce" is every rank summing the N partials itself.

``--tune`` times one-shot and two-shot only and prints the largest T at which one-shot is faster,
as a row for ``variants/tuning.yaml``.

Byte counts (bytes moved per call per rank) are documented in ``arfuse.bench.byte_counts``.

This module imports neither torch nor the compiled library at import time: ``--help`` and the
argument checks run anywhere.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from . import byte_counts as BB
from . import report as BR
from .outputs import output_stem, write_outputs
from .. import _vocab
from .._cli import HelpFormatter
from .._tools.ranks import torchrun_world

DTYPE_NAMES = _vocab.DTYPE_NAMES
DEFAULT_TOKENS = [1 << i for i in range(14)]  # 1, 2, 4, ..., 8192
ALL_IMPLS = BR.IMPL_ORDER
# What --impls defaults to: all but arfuse_pdl (the same kernel launched otherwise: asked for by name,
# for the programmatic-launch A/B, usually with --producer).
DEFAULT_IMPLS = tuple(i for i in ALL_IMPLS if i != "arfuse_pdl")
TUNE_IMPLS = ("arfuse_oneshot", "arfuse_twoshot")
MAX_WORLD = _vocab.MAX_WORLD


class BenchError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# ---------------------------------------------------------------- models

def _package_dir() -> Path:
    return Path(__file__).resolve().parent


def models_yaml_candidates() -> list[Path]:
    pkg = _package_dir()
    return [pkg / "data" / "models.yaml", pkg.parent / "variants" / "models.yaml"]


def read_models_yaml(path) -> dict[str, dict]:
    """{name: entry} from a YAML file with a top-level ``models:`` list of mappings that have at
    least ``name``, ``hidden`` and ``top_k``."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    items = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise BenchError(f"{path}: expected a top-level 'models:' list")
    out = {}
    for i, m in enumerate(items):
        if not isinstance(m, dict) or "name" not in m:
            raise BenchError(f"{path}: models[{i}] has no 'name'")
        for key in ("hidden", "top_k"):
            if key not in m:
                raise BenchError(f"{path}: model {m['name']!r} has no {key!r}")
        out[str(m["name"])] = dict(m)
    return out


def load_models(path=None) -> dict[str, dict]:
    """The model table: ``path`` if given, else ``arfuse.models()`` if the package provides it,
    else the first of arfuse/data/models.yaml and the repository's variants/models.yaml."""
    if path is not None:
        if not Path(path).is_file():
            raise BenchError(f"models file not found: {path}")
        return read_models_yaml(path)
    try:
        import arfuse
        fn = getattr(arfuse, "models", None)
        if callable(fn):
            return {str(k): dict(v) for k, v in fn().items()}
    except Exception:  # package not built here, or its table missing: read the YAML directly
        pass
    for p in models_yaml_candidates():
        if p.is_file():
            return read_models_yaml(p)
    raise BenchError("no model table: none of " +
                     ", ".join(str(p) for p in models_yaml_candidates()) +
                     " exists; pass --hidden/--topk or --models-file")


def lookup_model(name: str, models: dict[str, dict]) -> dict:
    if name in models:
        return models[name]
    folded = {k.lower(): k for k in models}
    if name.lower() in folded:
        return models[folded[name.lower()]]
    close = difflib.get_close_matches(name, list(models), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    known = ", ".join(sorted(models)) or "(none)"
    raise BenchError(f"unknown model {name!r}.{hint} Known models: {known}")


# ---------------------------------------------------------------- argument parsing

def parse_tokens(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (sorted, duplicates removed). Each entry a positive integer."""
    out = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise BenchError(f"--tokens: {part!r} is not an integer (expected a comma list "
                             "such as 1,2,4,8)") from None
        if v < 1:
            raise BenchError(f"--tokens: {v} is not positive")
        out.add(v)
    if not out:
        raise BenchError("--tokens: empty list")
    return sorted(out)


def parse_impls(text: str) -> list[str]:
    names = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [n for n in names if n not in ALL_IMPLS]
    if bad:
        raise BenchError(f"--impls: unknown {', '.join(bad)}; choose from {', '.join(ALL_IMPLS)}")
    if not names:
        raise BenchError("--impls: empty list")
    return [n for n in ALL_IMPLS if n in names]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arfuse.bench",
        description="Benchmark arfuse's fused MoE finalize + all-reduce + residual + RMSNorm "
                    "against the unfused pipeline, a PyTorch composition and (torchrun) "
                    "FlashInfer. Emulated (--emulate: N ranks on one GPU) or under torchrun "
                    "(one GPU per rank).",
        epilog="Implementations: " + ", ".join(f"{k} = {v}" for k, v in BR.IMPL_LABELS.items()),
        formatter_class=HelpFormatter)
    shape = p.add_argument_group("problem")
    shape.add_argument("--model", help="model name from variants/models.yaml (gives hidden, "
                       "top_k and, if present, routed_scaling)")
    shape.add_argument("--models-file", help="model table to read instead of the packaged one")
    shape.add_argument("--hidden", type=int, help="hidden size H (instead of --model)")
    shape.add_argument("--topk", type=int, help="experts per token K (instead of --model; "
                       "1 for --layout plain)")
    shape.add_argument("--world-size", type=int, help="tensor-parallel ranks N (default: 8 "
                       "with --emulate, $WORLD_SIZE under torchrun)")
    shape.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="activation dtype")
    shape.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                       help="comma list of token counts T")
    shape.add_argument("--layout", choices=BB.LAYOUTS, default="permuted",
                       help="expert output layout: permuted [T*K, H] + int32 indices [T, K], "
                       "dense [T, K, H], plain [T, H] (already reduced over experts)")
    shape.add_argument("--no-shared", dest="shared", action="store_false",
                       help="no shared-expert output")
    shape.add_argument("--routed-scaling", type=float, default=None,
                       help="routed_scaling (default: the model's, else 1.0)")
    shape.add_argument("--eps", type=float, default=1e-6, help="RMSNorm epsilon")
    shape.add_argument("--weight-bias", type=float, default=0.0, choices=(0.0, 1.0),
                       help="0: x*gamma; 1: x*(1+gamma)")
    shape.add_argument("--weights-dtype", choices=("fp32", "act", "none"), default="fp32",
                       help="router weights in float32 or in the activation dtype; none: no "
                       "weights, the rows are already router-weighted (vLLM's TritonExperts hand "
                       "them so; --layout dense only; adds vllm_today)")
    shape.add_argument("--quant", choices=("fp8_static", "fp8_token", "fp8_group128"),
                       help="also time the FP8 output kind: fused into arfuse (arfuse_q) beside "
                       "arfuse's activation-dtype output + a separate Triton quantization kernel "
                       "(arfuse_sepq)")
    shape.add_argument("--absent-frac", type=float, default=0.1,
                       help="fraction of permuted indices set to -1 (experts not on this rank)")

    run = p.add_argument_group("run")
    run.add_argument("--emulate", action="store_true",
                     help="one GPU, N ranks via arfuse.testing.LocalGroup")
    run.add_argument("--device", default="cuda",
                     help="under torchrun: cuda (cuda:LOCAL_RANK, one GPU per rank) or cuda:K "
                     "(every rank on GPU K: ranks sharing one GPU, a test mode; only arfuse's "
                     "implementations run, with gloo for the handle exchange, and the figures "
                     "are labelled as such: they are not the speed of a TP group)")
    run.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                     help="comma list of implementations to time (default: those listed below; "
                     "arfuse_q and arfuse_sepq only with --quant)")
    run.add_argument("--producer", action="store_true",
                     help="precede every arfuse call on its rank's stream by a producer kernel "
                     "(a copy writing the residual the call reads), one group step per call: "
                     "the two-kernel graph in which arfuse_pdl's programmatic launch acts; times "
                     "are producer + call (arfuse implementations only)")
    run.add_argument("--tune", action="store_true",
                     help="time one-shot and two-shot only and report the crossover as a "
                     "variants/tuning.yaml row")
    run.add_argument("--out", default="bench-out", help="output directory")
    run.add_argument("--name", help="stem of the output files (default: from the problem)")
    run.add_argument("--no-plot", dest="plot", action="store_false", help="no PNG plot")
    run.add_argument("--seed", type=int, default=0, help="seed of the random inputs")

    t = p.add_argument_group("timing")
    t.add_argument("--replays", type=int, default=100, help="timed graph replays (>= 50)")
    t.add_argument("--graph-calls", type=int, default=20, help="calls captured per graph")
    t.add_argument("--warmup", type=int, default=2,
                   help="eager warm-up passes of graph-calls calls before capture")
    t.add_argument("--timing", choices=("graph", "eager"), default="graph",
                   help="graph: CUDA-graph replay; eager: the same calls launched from Python "
                   "(for debugging capture problems)")
    t.add_argument("--l2-mb", type=float, default=None,
                   help="L2 size used to size the input rotation (default: the card's)")
    t.add_argument("--max-sets", type=int, default=BB.MAX_SETS,
                   help="cap on distinct input sets per token count (the default keeps even the "
                   "smallest set, 16 KiB at T = 1, H = 2048, N = 2 without expert rows, above 4x "
                   "a 50 MiB L2)")
    t.add_argument("--copy-mb", type=int, default=1024,
                   help="MiB copied to measure the device copy bandwidth")
    t.add_argument("--comm-timeout", type=float, default=10.0,
                   help="seconds a rank waits for a peer before the call gives up (the "
                   "communicators' timeout_s)")
    return p


def resolve_args(ns: argparse.Namespace, *, env_world: int | None = None) -> argparse.Namespace:
    """Checks and completes parsed arguments (no GPU needed). Raises BenchError."""
    ns.tokens = parse_tokens(ns.tokens)
    ns.impls_given = ns.impls != ",".join(DEFAULT_IMPLS)
    ns.impls = list(TUNE_IMPLS) if ns.tune else parse_impls(ns.impls)
    quant_impls = ("arfuse_q", "arfuse_sepq")
    if ns.quant and not ns.tune:
        ns.impls += [i for i in quant_impls if i not in ns.impls]
    elif not ns.quant:
        ns.impls = [i for i in ns.impls if i not in quant_impls]
        if not ns.impls:
            raise BenchError("--impls: arfuse_q and arfuse_sepq need --quant")
    if ns.weights_dtype == "none" and ns.layout != "dense":
        raise BenchError(f"--weights-dtype none: the rows carry the router weights only in the "
                         f"dense layout (vLLM's [T, K, H] rows); got --layout {ns.layout}")
    if ns.weights_dtype != "none":
        ns.impls = [i for i in ns.impls if i != "vllm_today"]
        if not ns.impls:
            raise BenchError("--impls: vllm_today needs --layout dense --weights-dtype none "
                             "(the rows vLLM's Triton experts hand over)")

    model = None
    if ns.model:
        if ns.hidden is not None or ns.topk is not None:
            raise BenchError("give --model or --hidden/--topk, not both")
        model = lookup_model(ns.model, load_models(ns.models_file))
        ns.model_name = str(model.get("name", ns.model))
        ns.hidden, ns.topk = int(model["hidden"]), int(model["top_k"])
        ns.experts = model.get("experts")
        if ns.routed_scaling is None and model.get("routed_scaling") is not None:
            ns.routed_scaling = float(model["routed_scaling"])
    else:
        if ns.hidden is None:
            raise BenchError("give --model NAME or --hidden H (and --topk K)")
        if ns.topk is None:
            if ns.layout != "plain":
                raise BenchError(f"--topk is required with --hidden for --layout {ns.layout}")
            ns.topk = 1
        ns.model_name, ns.experts = None, None
    if ns.layout == "plain":
        ns.topk = 1
    if ns.routed_scaling is None:
        ns.routed_scaling = 1.0
    if ns.hidden < 1:
        raise BenchError(f"--hidden must be positive, got {ns.hidden}")
    if ns.topk < 1:
        raise BenchError(f"--topk must be positive, got {ns.topk}")

    if ns.emulate:
        if ns.world_size is None:
            ns.world_size = 8
    else:
        if env_world is None:
            raise BenchError("not under torchrun (RANK/WORLD_SIZE unset): pass --emulate to run "
                             "N ranks on one GPU, or launch with torchrun --nproc-per-node N")
        if ns.world_size is not None and ns.world_size != env_world:
            raise BenchError(f"--world-size {ns.world_size} but torchrun started {env_world} "
                             "processes")
        ns.world_size = env_world
    from .._tools.ranks import parse_device

    try:
        ns.device = parse_device(ns.device)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if ns.device not in ("cuda", "auto") and not ns.device.startswith("cuda:"):
        raise BenchError(f"--device {ns.device}: the benchmark runs on CUDA devices")
    ns.shared_gpu = ns.device.startswith("cuda:") and not ns.emulate and ns.world_size > 1
    if ns.shared_gpu:
        # NCCL refuses two ranks on one GPU; the unfused pipeline's all-reduce is NCCL's
        needs_nccl = [i for i in ns.impls if not i.startswith("arfuse")]
        if needs_nccl and ns.impls_given:
            raise BenchError(f"--device {ns.device}: {', '.join(needs_nccl)} need NCCL with one "
                             "GPU per rank; with ranks sharing one GPU only arfuse's run")
        ns.impls = [i for i in ns.impls if i.startswith("arfuse")]
    if not 1 <= ns.world_size <= MAX_WORLD:
        raise BenchError(f"--world-size must be in 1..{MAX_WORLD}, got {ns.world_size}")

    if ns.replays < 50:
        raise BenchError(f"--replays must be >= 50, got {ns.replays}")
    if ns.graph_calls < 1:
        raise BenchError(f"--graph-calls must be >= 1, got {ns.graph_calls}")
    if ns.comm_timeout <= 0:
        raise BenchError("--comm-timeout must be positive")
    if ns.max_sets < 2:
        raise BenchError("--max-sets must be >= 2")
    if not 0.0 <= ns.absent_frac < 1.0:
        raise BenchError("--absent-frac must be in [0, 1)")
    if ns.layout != "permuted":
        ns.absent_frac = 0.0
    return ns


def parse_args(argv=None, *, env_world: int | None = None) -> argparse.Namespace:
    """Parse and check the command line. Errors exit with status 2 and one clear line."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return resolve_args(ns, env_world=torchrun_world() if env_world is None else env_world)
    except BenchError as e:
        parser.error(str(e))


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    if ns.emulate:
        # Emulated ranks are N streams whose kernels spin on each other: with fewer hardware work
        # queues than streams, a rank's kernel can wait behind a spinning peer in the same
        # queue. Read when the CUDA context is created, so set before any CUDA call.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    try:
        import torch
    except ImportError:
        print("arfuse.bench: PyTorch is not installed", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("arfuse.bench: no CUDA GPU visible (torch.cuda.is_available() is False); the "
              "benchmark needs one GPU (--emulate) or one GPU per rank (torchrun)",
              file=sys.stderr)
        return 1
    if ns.emulate and torchrun_world() not in (None, 1):
        print("arfuse.bench: --emulate runs in one process; do not launch it with torchrun",
              file=sys.stderr)
        return 2

    from . import run as bench_run

    out = Path(ns.out)
    partial = out / f"{output_stem(ns)}.csv"

    def checkpoint(rows):  # the rows so far, so that an interrupted run leaves its data
        out.mkdir(parents=True, exist_ok=True)
        BR.write_csv(partial, [dict(r) for r in rows])

    try:
        res = bench_run.run(ns, on_token_done=checkpoint)
    except (RuntimeError, ValueError, TypeError) as e:  # e.g. library missing, shape not served
        import traceback
        traceback.print_exc()
        print(f"arfuse.bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if not res["is_main"]:
        return 1 if (res["failed_check"] or res["aborted"]) else 0

    paths = write_outputs(ns, res, argv)
    md = paths["md"].read_text()
    print(md)
    for kind, pth in paths.items():
        print(f"wrote {kind}: {pth}")
    if ns.tune:
        env = json.loads(paths["json"].read_text())
        for w in env["tuning"]["warnings"]:
            print(f"warning: {w}")
        if env["tuning"]["row"]:
            print("tuning row (variants/tuning.yaml, thresholds:):")
            print(env["tuning"]["row"])
    if res["failed_check"]:
        bad = ", ".join(f"{f['impl']} T={f['tokens']} ({f['max_rel_err']:.3g})"
                        for f in res["failed_check"])
        print(f"arfuse.bench: wrong results, not timed: {bad}", file=sys.stderr)
        return 1
    if res["aborted"]:
        print(f"arfuse.bench: {res['aborted']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
