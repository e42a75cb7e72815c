"""The latency ladder (issue 16): where each microsecond of a small-T call goes.

    python -m arfuse.bench.ladder --model deepseek-v3 --world-size 8 --out build/ladder

One emulated group (N ranks on one GPU), CUDA-graph replay, bf16, and one rung at a time, each
adding one thing to the one before:

    empty       one empty kernel per rank (what a graph node of N concurrent kernels costs)
    floor       csrc/bench/floor.cu: push, poll, sum, residual add, RMSNorm and nothing else
                (no finalize, no epoch or completion step, no grid cap, no timeout; the caller
                hands each call its buffer slot, which only a graph of distinct launches can do)
    safe_floor  the floor made replay-safe: its slot from a per-rank epoch in device memory,
                block 0 advancing it once every block has arrived (what any protocol whose
                graph is replayed unchanged must add; still no grid cap, no timeout)
    plain       arfuse on a reduced [T, H] input: its all-reduce + RMSNorm alone
    dense       + the finalize of dense [T, K, H] rows with float32 router weights
    dense_nw    the finalize of dense rows without weights (vLLM's weighted rows, issue 13)
    permuted    + the permuted layout: [T*K, H] rows through int32 indices, 10 % of them -1
    shared      + the shared expert's row
    scaled      + routed_scaling 2.5 (DeepSeek's)

Each rung is checked against the float32 reference before it is timed (the empty one computes
nothing); medians, p10/p90 and the difference to the rung before go into a markdown table, a CSV
and a JSON with the provenance. The floor kernel is compiled here with nvcc (NVCC, else the one on
PATH, else CUDA_HOME's), one shared object per world size, linked to the cudart torch loaded.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .._cli import HelpFormatter
from .._tools.provenance import run_info
from . import cli
from . import report as BR

RUNGS = {  # name -> (what it adds, python -m arfuse.bench arguments)
    "empty": ("one empty kernel per rank", ["--layout", "plain", "--no-shared"]),
    "floor": ("push, poll, sum, norm only", ["--layout", "plain", "--no-shared"]),
    "safe_floor": ("+ epoch and completion in memory", ["--layout", "plain", "--no-shared"]),
    "plain": ("arfuse, reduced input", ["--layout", "plain", "--no-shared"]),
    "dense": ("+ dense finalize, weights", ["--layout", "dense", "--no-shared"]),
    "dense_nw": ("dense rows, no weights", ["--layout", "dense", "--no-shared",
                                            "--weights-dtype", "none"]),
    "permuted": ("+ permuted rows and indices", ["--layout", "permuted", "--no-shared"]),
    "shared": ("+ shared row", ["--layout", "permuted"]),
    "scaled": ("+ routed_scaling", ["--layout", "permuted", "--routed-scaling", "2.5"]),
}
CUSTOM = ("empty", "floor", "safe_floor")  # rungs that are not an arfuse call
GRAPH_CALLS = 24  # a multiple of 3: the floor's slot of call c is c % 3 (floor.cu)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arfuse.bench.ladder",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="model name from variants/models.yaml")
    p.add_argument("--world-size", type=int, default=8, help="emulated ranks N")
    p.add_argument("--tokens", default="1,2,4,8,16", help="comma list of token counts T")
    p.add_argument("--rungs", default=",".join(RUNGS), help="comma list of rungs, in order")
    p.add_argument("--replays", type=int, default=100, help="timed graph replays (>= 50)")
    p.add_argument("--out", default="ladder-out", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return p


def parse_args(argv=None):
    """(namespace, token counts); a bad argument exits 2 naming it (argparse's error)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.rung_list = [r.strip() for r in ns.rungs.split(",") if r.strip()]
    bad = [r for r in ns.rung_list if r not in RUNGS]
    if bad or not ns.rung_list:
        parser.error(f"--rungs: unknown {', '.join(bad) or '(empty)'}; choose from "
                     f"{', '.join(RUNGS)}")
    if ns.replays < 50:
        parser.error(f"--replays must be >= 50, got {ns.replays}")
    if not 1 <= ns.world_size <= cli.MAX_WORLD:
        parser.error(f"--world-size must be in 1..{cli.MAX_WORLD}, got {ns.world_size}")
    try:
        tokens = cli.parse_tokens(ns.tokens)
        cli.lookup_model(ns.model, cli.load_models())
    except cli.BenchError as e:
        parser.error(str(e))
    return ns, tokens


# ---------------------------------------------------------------- the floor kernel

def _cudart_dir() -> str | None:
    import torch
    hits = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "lib",
                                  "libcudart.so*"))
    if hits:
        return os.path.dirname(os.path.abspath(hits[0]))
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for sub in ("lib64", "lib"):
        if glob.glob(os.path.join(home, sub, "libcudart.so*")):
            return os.path.join(home, sub)
    return None


def compile_floor(world: int, build_dir: Path) -> Path:
    """floor.cu for world size N as a shared object (cached by the source's mtime)."""
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    src = csrc / "bench" / "floor.cu"
    if not src.exists():
        raise RuntimeError(f"{src} not found: the ladder's floor kernel builds from a checkout "
                           "of the repository (it includes csrc/arfuse/device.cuh)")
    out = build_dir / f"floor_w{world}.so"
    deps = [src, csrc / "arfuse" / "device.cuh"]
    if out.exists() and out.stat().st_mtime >= max(d.stat().st_mtime for d in deps):
        return out
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or \
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    cudart = _cudart_dir()
    if cudart is None:
        raise RuntimeError("no libcudart.so found (torch's nvidia package or CUDA_HOME)")
    build_dir.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, "-std=c++17", "-O3", "-gencode", "arch=compute_90,code=sm_90", "-Xcompiler",
           "-fPIC", "-shared", "-cudart", "none", f"-DFLOOR_WORLD={world}", f"-I{csrc}", str(src),
           f"-L{cudart}", "-l:libcudart.so.13", "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    return out


class FloorLib:
    def __init__(self, path: Path, world: int):
        self.lib = ctypes.CDLL(str(path))
        self.lib.floor_launch.restype = ctypes.c_int
        self.lib.floor_launch.argtypes = [ctypes.c_void_p] * 5 + [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.empty_launch.argtypes = [ctypes.c_void_p]
        if self.lib.world_size() != world:
            raise RuntimeError(f"{path}: built for world size {self.lib.world_size()}, not {world}")
        err = self.lib.floor_prepare()
        if err:
            raise RuntimeError(f"floor kernel: cudaFuncGetAttributes failed ({err})")


def _impls(floor: FloorLib):
    """The custom rungs as implementations of arfuse.bench.impls (imported with torch)."""
    import torch

    from .impls import PerRank, Skip

    class Empty(PerRank):
        check = False

        def call(self, rank, comm, inp):
            err = floor.lib.empty_launch(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            if err:
                raise RuntimeError(f"empty kernel launch failed ({err})")
            return inp.residual, inp.residual

    class Floor(PerRank):
        """Each rank's buffer holds 3 slots of [T][N][H], all -0.0 (the sentinel) at the start;
        outputs are allocated once, before any launch (an allocation between two ranks'
        launches could synchronise with a spinning kernel). safe: each rank's slot comes from
        its own {epoch, arrivals} in device memory (zero at the start), not from the launch."""

        def __init__(self, setup, sets, T, safe=False):
            super().__init__(setup, sets)
            N, H = setup.world_size, setup.args.hidden
            props = torch.cuda.get_device_properties(setup.device)
            threads = ((H // 8 + 31) // 32) * 32
            resident = props.multi_processor_count * max(1, 2048 // threads)
            if setup.dtype != torch.bfloat16 or H % 8 or H // 8 > 1024:
                raise Skip("the floor kernel serves bf16 with H % 8 == 0, H <= 8192")
            if N * T > resident:
                raise Skip(f"{N} x {T} blocks would not all be resident ({resident})")
            self.slot_elems = T * N * H
            self.bufs = [torch.full((3 * self.slot_elems,), -0.0, dtype=torch.bfloat16,
                                    device=setup.device) for _ in range(N)]
            self.ptrs = (ctypes.c_void_p * N)(*[b.data_ptr() for b in self.bufs])
            self.outs = {r: (torch.empty(T, H, dtype=setup.dtype, device=setup.device),
                             torch.empty(T, H, dtype=setup.dtype, device=setup.device))
                         for r in setup.ranks}
            self.calls = {r: 0 for r in setup.ranks}
            self.counters = ({r: torch.zeros(2, dtype=torch.int32, device=setup.device)
                              for r in setup.ranks} if safe else None)
            self.T = T

        def call(self, rank, comm, inp):
            st = self.setup
            norm, res = self.outs[rank]
            slot = self.calls[rank] % 3
            self.calls[rank] += 1
            err = floor.lib.floor_launch(
                inp.expert_out.data_ptr(), inp.residual.data_ptr(), st.gamma.data_ptr(),
                norm.data_ptr(), res.data_ptr(), self.ptrs, self.slot_elems, rank, self.T,
                st.args.hidden, slot, float(st.args.eps),
                self.counters[rank].data_ptr() if self.counters else None,
                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            if err:
                raise RuntimeError(f"floor kernel launch failed ({err})")
            return norm, res

    return {"empty": lambda setup, sets, T: Empty(setup, sets),
            "floor": lambda setup, sets, T: Floor(setup, sets, T),
            "safe_floor": lambda setup, sets, T: Floor(setup, sets, T, safe=True)}


# ---------------------------------------------------------------- the run

def run_ladder(ns) -> dict:
    rungs = ns.rung_list
    from . import run as bench_run

    factories = {}
    if any(r in CUSTOM for r in rungs):
        path = compile_floor(ns.world_size, Path(ns.out) / "obj")
        factories = _impls(FloorLib(path, ns.world_size))
    results, envs = {}, None
    for rung in rungs:
        argv = ["--emulate", "--model", ns.model, "--world-size", str(ns.world_size),
                "--tokens", ns.tokens, "--replays", str(ns.replays), "--graph-calls",
                str(GRAPH_CALLS), "--seed", str(ns.seed), "--no-plot", "--impls", "arfuse",
                *RUNGS[rung][1]]
        bns = cli.parse_args(argv)
        bns.impls = [rung] if rung in CUSTOM else ["arfuse"]
        res = bench_run.run(bns, factories=factories)
        results[rung] = {r["tokens"]: r for r in res["rows"]}
        envs = envs or res
        done = ", ".join(f"T={t}: {r['median_us']:.2f}" if r.get("median_us") else
                         f"T={t}: {r.get('note')}" for t, r in results[rung].items())
        print(f"ladder {ns.model} N={ns.world_size} {rung}: {done}", file=sys.stderr, flush=True)
    return {"rungs": rungs, "results": results, "card": envs and envs.get("card"),
            "copy_gbps": envs and envs.get("copy_gbps")}


def markdown(ns, lad: dict, tokens: list[int]) -> str:
    rungs, res = lad["rungs"], lad["results"]
    lines = [f"### Ladder: {ns.model}, N={ns.world_size}, bf16 (emulated on one GPU) — "
             f"{lad['card']}", "",
             "Median µs per call under CUDA-graph replay; in parentheses the difference to the "
             "rung above (the first arfuse rung with the floor rung above it).", "",
             "| rung | adds | " + " | ".join(f"T={t}" for t in tokens) + " |",
             "|---|---|" + "---:|" * len(tokens)]
    prev = None
    for rung in rungs:
        cells = []
        for t in tokens:
            r = res[rung].get(t, {})
            med = r.get("median_us")
            if not med:
                cells.append("—" if not r.get("note") else "skip")
                continue
            c = f"{med:.2f}"
            if prev is not None and res[prev].get(t, {}).get("median_us"):
                c += f" ({med - res[prev][t]['median_us']:+.2f})"
            cells.append(c)
        lines.append(f"| {rung} | {RUNGS[rung][0]} | " + " | ".join(cells) + " |")
        prev = rung if rung != "dense_nw" else prev  # dense_nw is beside dense, not above it
    notes = [f"- {rung} T={t}: {r['note']}" for rung in rungs for t, r in res[rung].items()
             if r.get("note") and not r.get("median_us")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv=None) -> int:
    ns, tokens = parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    lad = run_ladder(ns)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ladder-{ns.model}-w{ns.world_size}"
    md = markdown(ns, lad, tokens)
    (out / f"{stem}.md").write_text(md)
    rows = [dict(r, impl=rung) for rung in lad["rungs"] for r in lad["results"][rung].values()]
    BR.write_csv(out / f"{stem}.csv", rows)
    info = run_info(" ".join(["python", "-m", "arfuse.bench.ladder", *(argv or sys.argv[1:])]))
    info.update(card=lad["card"], copy_gbps=lad["copy_gbps"], args=vars(ns))
    (out / f"{stem}.json").write_text(json.dumps(info, indent=2, default=str))
    print(md)
    failed = [r for rung in lad["rungs"] for r in lad["results"][rung].values()
              if r.get("note", "").startswith(("wrong", "failed", "timing failed"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
