"""arfuse inside a real vLLM engine on one GPU (tensor parallelism 1): the same model, the same
random weights, the same prompts, with the plugin on and off; generated tokens, logits, latency
and peak memory. Run on the GPU machine (scripts/vllm-gpu-e2e.sh runs the whole set).

    python scripts/vllm_e2e.py engine --model DIR --mode MODE --out FILE.json
    python scripts/vllm_e2e.py compare BASE.json OTHER.json [...] --md FILE.md

`engine` runs one vLLM engine in this process (vLLM's LLM class with its defaults: torch.compile,
piecewise CUDA graphs, V1 multiprocessing, prefix caching) for the model whose config.json is in
DIR, with load_format="dummy" and then every weight replaced by seeded random values of a
trained model's scale (`reinit`: the same values in every run, so that the runs compute the same
function), and writes what it measured:

* mode `vllm`: arfuse installed, ARFUSE_VLLM unset (the plugin does nothing);
  `arfuse`: ARFUSE_VLLM=1 (the plugin's hooks, the MoE rows switch, the fusion pass);
  `arfuse-pdl`: the same with ARFUSE_VLLM_PDL=1 (programmatic dependent launch);
  `plain`: arfuse not importable at all (vLLM as released; run with a PYTHONPATH without it);
* tokens: greedy continuations of random prompts with the top-5 logprobs of every step, and the
  prompts' own top-5 logprobs (teacher-forced: every position scored on identical input), twice
  (the engine's own run-to-run spread);
* what ran: the torch profiler's op counts of one prefill (arfuse's fused calls, vLLM's moe_sum,
  the rows ops) and the plugin's log lines;
* latency: decode steps at batch 1 and 32 (the time of `max_tokens = 1 + S` minus that of
  `max_tokens = 1`, over S, on fresh random prompts each repetition: no prefix-cache hits) and
  one prefill of 8192 tokens, medians;
* memory: vLLM's own accounting (the KV cache it could allocate after its profile run) and the
  worker's torch peak.

`compare` turns the JSON of the runs into one markdown table (docs/vllm.md), and exits 1 with one
line each (on stderr, and in the table) where a run with arfuse on fused no layer (the plugin's
log, the profiler's count of arfuse's kernel) or is bitwise equal to vLLM's own run: a
comparison of "with arfuse" against "without" first proves that arfuse's kernel ran.
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path

PROMPTS, PROMPT_LEN, GEN = 4, 64, 32
# 256 decode steps per repetition: at batch 32 the prefill of the 32 prompts (both terms of the
# difference) varies by about +-2 ms, which 64 steps (the runs of 2026-12-04) left at +-0.03 ms
# per step and once negative (docs/vllm.md).
DECODE_STEPS, DECODE_PROMPT = 256, 128
PROFILE_DECODE = 32  # decode steps of the profiled batch-1 generation
PREFILL = 8192
LOG_PATTERNS = ("arfuse", "Available KV cache memory", "Model loading took",
                "torch.compile took", "Graph capturing finished", "peak")


def reinit(model, seed: int) -> int:
    """Every floating-point parameter of `model` replaced by seeded random values, the same in
    every run: matrices N(0, 1/fan_in) (fan_in: the last dimension; activations stay O(1)), 1-D
    weights (norms) 1 + N(0, 0.1^2), biases N(0, 0.02^2). Buffers (rotary caches) are left alone.
    Returns the number of values written. Runs in vLLM's worker (LLM.apply_model)."""
    import zlib

    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                continue
            g = torch.Generator(device=p.device)
            g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            # slice by slice along dim 0 (a float32 copy of a whole expert tensor of 256
            # experts would be 28 GiB)
            for part in (p.unbind(0) if p.dim() >= 3 else (p,)):
                x = torch.randn(part.shape, generator=g, device=p.device, dtype=torch.float32)
                if p.dim() >= 2:
                    x *= p.shape[-1] ** -0.5
                elif name.endswith("bias"):
                    x *= 0.02
                else:
                    x = 1.0 + 0.1 * x
                part.copy_(x.to(p.dtype))
            n += p.numel()
    torch.cuda.synchronize()
    return n


def torch_peak(model) -> dict:
    import torch

    return {"max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved()}


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if any(p in msg for p in LOG_PATTERNS):
            self.lines.append(f"{record.name}: {msg}")


def random_prompts(rng, n: int, length: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]}
            for _ in range(n)]


def logprob_rows(items) -> list[dict]:
    """[{token id: logprob}] per position (vLLM's Logprob objects, or None)."""
    out = []
    for d in items or []:
        out.append(None if d is None else {int(t): float(lp.logprob) for t, lp in d.items()})
    return out


def run_engine(a) -> dict:
    if a.mode.startswith("arfuse"):
        os.environ["ARFUSE_VLLM"] = "1"
        if a.mode == "arfuse-pdl":  # the fused kernels as programmatic dependent launches
            os.environ["ARFUSE_VLLM_PDL"] = "1"
    else:
        os.environ.pop("ARFUSE_VLLM", None)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model
    import random

    import torch
    from vllm import LLM, SamplingParams

    if a.mode == "plain":
        try:
            import arfuse  # noqa: F401
            raise SystemExit("mode plain: arfuse is importable; run with a PYTHONPATH without it")
        except ImportError:
            pass
    lines = Lines()
    logging.getLogger("vllm").addHandler(lines)
    config = json.loads((Path(a.model) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    profile_dir = Path(a.out).with_suffix("").as_posix() + "-profile"
    kwargs = dict(model=a.model, load_format="dummy", dtype="bfloat16", seed=0,
                  skip_tokenizer_init=True, generation_config="vllm",
                  max_model_len=PREFILL + 256, max_num_batched_tokens=PREFILL,
                  gpu_memory_utilization=a.gpu_memory_utilization,
                  profiler_config={"profiler": "torch", "torch_profiler_dir":
                                   os.path.abspath(profile_dir),
                                   "torch_profiler_with_stack": False,
                                   "torch_profiler_use_gzip": False})
    if a.attention_backend:
        kwargs["attention_config"] = {"backend": a.attention_backend}
    if a.capture_sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes":
                                        [int(x) for x in a.capture_sizes.split(",")]}
    t0 = time.time()
    llm = LLM(**kwargs)
    res: dict = {"mode": a.mode, "model": config.get("architectures", ["?"])[0],
                 "layers": config.get("num_hidden_layers"), "hidden": config.get("hidden_size"),
                 "engine_start_s": round(time.time() - t0, 1), "engine_args": {
                     k: v for k, v in kwargs.items() if k != "profiler_config"},
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import vllm

    res["vllm"] = vllm.__version__
    res["reinit_values"] = llm.apply_model(functools.partial(reinit, seed=a.seed))
    # ---- tokens and logits, twice ----
    rng = random.Random(a.seed)
    prompts = random_prompts(rng, PROMPTS, PROMPT_LEN, vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True, logprobs=5,
                        prompt_logprobs=5, detokenize=False)
    res["runs"] = []
    for _ in range(2):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        res["runs"].append([{"tokens": list(o.outputs[0].token_ids),
                             "logprobs": logprob_rows(o.outputs[0].logprobs),
                             "prompt_logprobs": logprob_rows(o.prompt_logprobs)}
                            for o in outs])
    # ---- what ran in one prefill (not a CUDA-graph size: every op is seen) ----
    p = random_prompts(rng, 1, 1000, vocab)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.start_profile()
    llm.generate(p, one, use_tqdm=False)
    llm.stop_profile()
    res["profile"] = profile_counts(profile_dir)
    # ---- where a decode step's GPU time goes: batch 1, PROFILE_DECODE steps under vLLM's CUDA
    # graphs (kernels inside a graph replay are traced too), GPU time per kernel name ----
    seen = set(trace_files(profile_dir))
    p = random_prompts(rng, 1, DECODE_PROMPT, vocab)
    dec = SamplingParams(temperature=0.0, max_tokens=1 + PROFILE_DECODE, ignore_eos=True,
                         detokenize=False)
    llm.generate(p, dec, use_tqdm=False)  # warm (the same shapes)
    llm.start_profile()
    llm.generate(random_prompts(rng, 1, DECODE_PROMPT, vocab), dec, use_tqdm=False)
    llm.stop_profile()
    res["decode_profile"] = kernel_times([f for f in trace_files(profile_dir) if f not in seen])
    res["decode_profile_steps"] = PROFILE_DECODE
    # ---- latency ----
    def timed(batch, n_prompt, max_tokens) -> float:
        ps = random_prompts(rng, batch, n_prompt, vocab)
        spt = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(ps, spt, use_tqdm=False)
        return time.perf_counter() - t

    lat: dict = {}
    for batch in (1, 32):
        timed(batch, DECODE_PROMPT, 1 + a.decode_steps)  # warm-up
        steps = []
        for _ in range(a.reps):
            t1 = timed(batch, DECODE_PROMPT, 1)
            tn = timed(batch, DECODE_PROMPT, 1 + a.decode_steps)
            steps.append((tn - t1) / a.decode_steps * 1e3)
        lat[f"decode_b{batch}_ms"] = steps
    timed(1, PREFILL, 1)
    lat["prefill_8192_ms"] = [timed(1, PREFILL, 1) * 1e3 for _ in range(a.reps)]
    res["latency"] = {k: {"median": statistics.median(v), "all": v} for k, v in lat.items()}
    res["decode_steps"] = a.decode_steps
    res["torch_peak"] = llm.apply_model(torch_peak)
    res["log"] = lines.lines
    kv = [float(m.group(1)) for ln in lines.lines
          for m in [re.search(r"Available KV cache memory: ([0-9.]+) GiB", ln)] if m]
    res["kv_cache_gib"] = kv[-1] if kv else None
    return res


def trace_files(profile_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(profile_dir, "**", "*.pt.trace.json*"), recursive=True))


def _events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def short_kernel(name: str) -> str:
    """A kernel's name without its template arguments and parameter list (arfuse's own: kernel,
    writer and algorithm), at most 100 characters."""
    m = re.search(r"(arfuse::\w+)<arfuse::KernelConfig<[^,]+, arfuse::(\w+), \(arfuse::Algo\)(\d)",
                  name)
    if m:
        return f"{m.group(1)} {m.group(2)} algo {m.group(3)}"
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:  # drop <...> and (...) groups
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()[:100] or name[:100]


def kernel_times(files: list[str]) -> dict:
    """GPU time by kernel (and memcpy / memset) in the traces: {short name: [total µs, count]},
    the 60 largest; "_total" sums every GPU event."""
    acc: dict = {}
    total = 0.0
    for path in files:
        for ev in _events(path):
            if ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            dur = float(ev.get("dur", 0.0))
            total += dur
            key = short_kernel(ev.get("name", "")) if ev["cat"] == "kernel" else ev["cat"]
            a = acc.setdefault(key, [0.0, 0])
            a[0] += dur
            a[1] += 1
    top = dict(sorted(acc.items(), key=lambda kv: -kv[1][0])[:60])
    top["_total"] = [total, sum(a[1] for a in acc.values())]
    return top


def profile_counts(profile_dir: str) -> dict:
    """Call counts, from the worker's torch-profiler trace of one prefill, of the ops and
    kernels that tell the MoE tails apart: arfuse's fused op and kernel, vLLM's moe_sum, the rows
    ops, vLLM's MoE ops and norms (CPU ops by their schema name, GPU kernels by a short name)."""
    keys = ("arfuse", "moe_sum", "moe_forward", "rms_norm", "all_reduce")
    counts: dict = {}
    for path in trace_files(profile_dir):
        for ev in _events(path):
            cat, name = ev.get("cat", ""), ev.get("name", "")
            if cat not in ("cpu_op", "kernel") or not any(k in name for k in keys):
                continue
            if cat == "kernel":  # the template arguments say little: kernel and algorithm
                m = re.search(r"(arfuse::\w+)<arfuse::KernelConfig<[^,]+, arfuse::(\w+), "
                              r"\(arfuse::Algo\)(\d)", name)
                name = (f"kernel {m.group(1)} {m.group(2)} algo {m.group(3)}" if m
                        else "kernel " + name[:80])
            counts[name] = counts.get(name, 0) + 1
    return counts


# ---------------------------------------------------------------------------- compare

def agreement(base_runs, other_runs) -> dict:
    """Greedy tokens: per prompt, how many of the first GEN tokens equal (up to the first
    difference); logits: |logprob difference| of the base's top-1 token at every step before
    that difference and at every prompt position (teacher-forced: identical inputs)."""
    same, dlp, dprompt, top1_same, top1_n, missing = [], [], [], 0, 0, 0
    base_runs, other_runs = _int_keys(base_runs), _int_keys(other_runs)
    for b, o in zip(base_runs, other_runs):
        n = 0
        while n < min(len(b["tokens"]), len(o["tokens"])) and b["tokens"][n] == o["tokens"][n]:
            n += 1
        same.append(n)
        for i in range(min(n + 1, len(b["logprobs"]))):
            t = b["tokens"][i]
            lo = o["logprobs"][i] or {}
            if t in lo:
                dlp.append(abs(b["logprobs"][i][t] - lo[t]))
        for pb, po in zip(b["prompt_logprobs"], o["prompt_logprobs"]):
            if not pb or not po:
                continue
            t = max(pb, key=pb.get)
            top1_n += 1
            top1_same += int(max(po, key=po.get) == t)
            if t in po:
                dprompt.append(abs(pb[t] - po[t]))
            else:
                missing += 1
    return {"tokens_equal": same, "gen": len(base_runs[0]["tokens"]),
            "max_dlogprob_gen": max(dlp) if dlp else None,
            "max_dlogprob_prompt": max(dprompt) if dprompt else None,
            "mean_dlogprob_prompt": statistics.mean(dprompt) if dprompt else None,
            "prompt_top1_agree": f"{top1_same}/{top1_n}", "prompt_top1_missing": missing}


def _int_keys(runs) -> list:
    """The runs with their logprob dicts keyed by int token ids again (JSON made them str)."""
    def rows(items):
        return [None if d is None else {int(k): v for k, v in d.items()} for d in items]
    return [{**r, "logprobs": rows(r["logprobs"]), "prompt_logprobs": rows(r["prompt_logprobs"])}
            for r in runs]


ENGINE_LOG = {  # what vLLM's engine core logs (in its own process: read from the run's .log)
    "kv_cache_gib": r"Available KV cache memory: ([0-9.]+) GiB",
    "model_gib": r"Model loading took ([0-9.]+) GiB",
    "compile_s": r"torch.compile took ([0-9.]+) s in total",
    "capture_s": r"Graph capturing finished in ([0-9.]+) secs",
}


def engine_log(json_path: str) -> dict:
    """The ENGINE_LOG figures from the .log beside a run's JSON (scripts/vllm-gpu-e2e.sh writes
    both), the last of each; None where there is none."""
    log = Path(json_path).with_suffix(".log")
    text = log.read_text(errors="replace") if log.exists() else ""
    out: dict = {}
    for key, pattern in ENGINE_LOG.items():
        found = re.findall(pattern, text)
        out[key] = float(found[-1]) if found else None
    # the plugin's own lines (vllm.arfuse logger): enabled, the communicator, the layers switched
    out["arfuse_lines"] = list(dict.fromkeys(
        ln.split("] ", 1)[-1].strip() for ln in text.splitlines()
        if "arfuse: " in ln and " INFO " in ln))
    out["arfuse_errors"] = list(dict.fromkeys(
        ln.split("] ", 1)[-1].strip() for ln in text.splitlines()
        if "arfuse: " in ln and (" ERROR " in ln or " WARNING " in ln)))
    return out


def bitwise(a_runs, b_runs) -> bool:
    return json.dumps(a_runs, sort_keys=True) == json.dumps(b_runs, sort_keys=True)


SWITCHED = re.compile(r"MoE finalize handed to arfuse in (\d+) of (\d+) MoE layers")


def fused_layers(run: dict) -> tuple[int, int] | None:
    """(layers switched, MoE layers) from the plugin's line in the run's log (the engine core's
    .log beside the JSON, else the lines the run kept), or None where it logged none."""
    lines = run.get("engine_log", {}).get("arfuse_lines", []) + run.get("log", [])
    found = [SWITCHED.search(ln) for ln in lines]
    found = [m for m in found if m]
    return (int(found[-1].group(1)), int(found[-1].group(2))) if found else None


def arfuse_kernels(run: dict) -> int:
    """Launches of arfuse's kernel in the run's profiled prefill (the torch profiler's count)."""
    return sum(n for name, n in run.get("profile", {}).items() if name.startswith("kernel arfuse::"))


def problems(runs: list[dict], base: dict) -> list[str]:
    """Why the comparison proves nothing, one line each: a run with arfuse on (mode arfuse*) that
    fused no layer (by the plugin's log or by the profiler's count of arfuse's kernel), or that is
    bitwise equal to vLLM's own (arfuse rounds the MoE tail differently: the rows summed in float32
    and rounded once; equal bits mean its kernel never ran)."""
    out = []
    for r in runs:
        if r is base or not r["mode"].startswith("arfuse"):
            continue
        layers, kernels = fused_layers(r), arfuse_kernels(r)
        off = [ln for ln in r.get("engine_log", {}).get("arfuse_errors", []) if "fusion is OFF" in ln]
        if off or not layers or layers[0] == 0 or kernels == 0:
            if off:
                said = f"says {off[0][:200]!r}"
            elif layers:
                said = f"says {layers[0]} of {layers[1]} MoE layers switched"
            else:
                said = "has no line on switched layers"
            out.append(f"the {r['mode']} run fused no layer: the plugin's log {said}, the "
                       f"profiler counted {kernels} launches of arfuse's kernel")
        elif bitwise(base["runs"][0], r["runs"][0]):
            out.append(f"the {r['mode']} run is bitwise equal to the {base['mode']} run, where "
                       f"arfuse must change the rounding: its kernel did not compute these tokens")
    return out


def load_runs(paths: list[str]) -> tuple[list[dict], dict]:
    """The runs' JSON with their engine logs, and the base run (mode vllm, else the first)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    for r, p in zip(runs, paths):
        r["engine_log"] = engine_log(p)
    return runs, next((r for r in runs if r["mode"] == "vllm"), runs[0])


def compare(paths: list[str], md: str | None) -> str:
    runs, base = load_runs(paths)
    out = [f"### {base['model']} ({base['layers']} layers, hidden {base['hidden']}), "
           f"{base['gpu']}, vLLM {base['vllm']}, torch {base['torch']}", ""]
    self_agree = agreement(base["runs"][0], base["runs"][1])
    out.append(f"vllm against itself (two identical generate calls): greedy tokens equal "
               f"{self_agree['tokens_equal']} of {self_agree['gen']}; teacher-forced top-1 "
               f"agrees at {self_agree['prompt_top1_agree']} prompt positions, |Δ logprob| max "
               f"{_f(self_agree['max_dlogprob_prompt'])}, mean "
               f"{_f(self_agree['mean_dlogprob_prompt'])}; bitwise "
               f"{bitwise(base['runs'][0], base['runs'][1])}.")
    for r in runs:
        if r is base:
            continue
        ag = agreement(base["runs"][0], r["runs"][0])
        out.append(f"{r['mode']} against vllm: greedy tokens equal for the first "
                   f"{ag['tokens_equal']} of {ag['gen']} tokens (4 prompts); teacher-forced "
                   f"top-1 agrees at {ag['prompt_top1_agree']} prompt positions, |Δ logprob| of "
                   f"vLLM's top-1 max {_f(ag['max_dlogprob_prompt'])}, mean "
                   f"{_f(ag['mean_dlogprob_prompt'])}; generated steps before the first "
                   f"difference max {_f(ag['max_dlogprob_gen'])}; bitwise equal to vllm: "
                   f"{bitwise(base['runs'][0], r['runs'][0])}.")
    out += ["", "Medians, [min–max] of the repetitions in brackets.", "",
            "| | " + " | ".join(r["mode"] for r in runs) + " |",
            "|---|" + "---:|" * len(runs)]
    keys = [("decode_b1_ms", "decode step, batch 1 (ms)"),
            ("decode_b32_ms", "decode step, batch 32 (ms)"),
            ("prefill_8192_ms", "prefill, 8192 tokens (ms)")]
    for k, label in keys:
        cells = []
        for r in runs:
            v = r["latency"][k]["median"]
            ratio = v / base["latency"][k]["median"]
            vals = sorted(r["latency"][k]["all"])
            cells.append(f"{v:.3f}" + ("" if r is base else f" ({ratio:.3f}×)") +
                         f" [{vals[0]:.2f}–{vals[-1]:.2f}]")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, fn in (("KV cache vLLM could allocate after its profile run (GiB)",
                       lambda r: _f(r["engine_log"]["kv_cache_gib"])),
                      ("model weights (GiB)", lambda r: _f(r["engine_log"]["model_gib"])),
                      ("torch.compile (s)", lambda r: _f(r["engine_log"]["compile_s"])),
                      ("CUDA-graph capture (s)", lambda r: _f(r["engine_log"]["capture_s"])),
                      ("worker torch peak allocated (GiB)",
                       lambda r: f"{r['torch_peak'][0]['max_allocated'] / 2**30:.2f}"),
                      ("engine start (s)", lambda r: str(r["engine_start_s"]))):
        out.append(f"| {label} | " + " | ".join(fn(r) for r in runs) + " |")
    names = sorted({k for r in runs for k in r["profile"]})
    for n in names:
        out.append(f"| calls in one 1000-token prefill: `{n}` | " +
                   " | ".join(str(r["profile"].get(n, 0)) for r in runs) + " |")
    out += decode_profile_table(runs, base)
    out.append("")
    for r in runs:
        for ln in r["engine_log"]["arfuse_lines"] + r["engine_log"]["arfuse_errors"]:
            out.append(f"- {r['mode']} log: {ln[:300]}")
    for p in problems(runs, base):
        out.append(f"- **FAILED**: {p}")
    text = "\n".join(out) + "\n"
    if md:
        Path(md).write_text(text)
    return text


def decode_profile_table(runs: list[dict], base: dict, rows: int = 14) -> list[str]:
    """GPU time per decode step (µs) by kernel, batch 1, for the kernels whose time differs most
    between the runs (the profiler's trace of PROFILE_DECODE steps; its prefill included)."""
    if not all(r.get("decode_profile") for r in runs):
        return []
    steps = base.get("decode_profile_steps") or PROFILE_DECODE
    names = {k for r in runs for k in r["decode_profile"] if k != "_total"}

    def per_step(r, k):
        return r["decode_profile"].get(k, [0.0, 0])[0] / steps

    spread = sorted(names, key=lambda k: -max(abs(per_step(r, k) - per_step(base, k))
                                              for r in runs))
    out = ["", f"GPU time per decode step at batch 1 (µs; the profiler over {steps} steps), "
           "the kernels that differ most:", "",
           "| kernel | " + " | ".join(r["mode"] for r in runs) + " |",
           "|---|" + "---:|" * len(runs)]
    out.append("| all GPU work | " + " | ".join(f"{per_step(r, '_total'):.1f}" for r in runs)
               + " |")
    for k in spread[:rows]:
        out.append(f"| `{k[:90]}` | " + " | ".join(
            f"{per_step(r, k):.1f} ({r['decode_profile'].get(k, [0, 0])[1] / steps:.2g}×)"
            for r in runs) + " |")
    return out


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--model", required=True, help="a directory with the model's config.json")
    e.add_argument("--mode", required=True, choices=("vllm", "arfuse", "arfuse-pdl", "plain"))
    e.add_argument("--out", required=True)
    e.add_argument("--seed", type=int, default=1234)
    e.add_argument("--reps", type=int, default=7)
    e.add_argument("--decode-steps", type=int, default=DECODE_STEPS,
                   help="decode steps timed per repetition (the runs of 2026-12-04: 64)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--attention-backend", default="")
    e.add_argument("--capture-sizes", default="",
                   help="CUDA-graph capture sizes (default: vLLM's own list)")
    c = sub.add_parser("compare")
    c.add_argument("runs", nargs="+")
    c.add_argument("--md")
    a = p.parse_args(argv)
    if a.cmd == "engine":
        res = run_engine(a)
        Path(a.out).write_text(json.dumps(res))
        print(f"engine {a.mode}: started in {res['engine_start_s']} s; latency "
              + ", ".join(f"{k} {v['median']:.3f}" for k, v in res["latency"].items())
              + f"; profile {res['profile']}")
        return 0
    print(compare(a.runs, a.md))
    runs, base = load_runs(a.runs)
    failed = problems(runs, base)
    for p in failed:
        print(f"vllm_e2e compare: FAILED: {p}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
