"""The correctness suite with one process per GPU: ``torchrun -m arfuse.check``.

    torchrun --nproc-per-node 8 -m arfuse.check --out dist-check   # every case, 10,000 replays
    torchrun --nproc-per-node 2 -m arfuse.check --quick             # a subset, 200 replays
    python -m arfuse.check --quick                                  # world size 1 (CPU: the CPU op)

Each process drives one GPU (LOCAL_RANK) with the real ``arfuse.Communicator`` over the default
process group (NCCL on GPUs, gloo on the CPU; ``--backend``), plus a gloo group of its own for the
control messages. The cases are those of the one-shot/two-shot GPU suites (tests/test_gpu_fused.py)
with the world size fixed to the number of processes: the build's specialised instances of that
world size, token counts T in {0, 1, 3, 17, 128, max_tokens} x {oneshot, twoshot, auto}, the input
forms and options (plain / dense / permuted with index -1, K, weights, shared, routed_scaling,
weight_bias, gamma dtype), generic hidden sizes, special values (-0.0, subnormals, NaN, Inf), in
place, one-shot = two-shot, the FP8 static output and no residual; hidden sizes 2048, 2880, 4096
and 7168 among others. For every case:

* every rank draws the inputs of all N ranks from one seed shared by all ranks, and the ranks
  compare a fingerprint of what they drew (a rank that drew other inputs fails the case);
* each rank poisons its outputs (NaN bytes in the very blocks the op then allocates), calls the
  op with its own inputs, and checks every element of its outputs against the float64 reference
  of all N ranks' partials (arfuse._checks: NaN and Inf positions, relative error within 1e-2 /
  2e-3 / 1e-5 for bf16 / fp16 / fp32, FP8 codes within 1 ulp);
* the outputs of all ranks are gathered (all_gather) and compared bit for bit;
* a rank whose communicator reports a timed-out wait, or whose call raised, fails the case and
  the communicator is recreated on every rank.

Then, on GPUs, one call per algorithm (one-shot and two-shot) is captured in a CUDA graph each and
the two graphs are replayed alternately ``--replays`` times (default 10,000): every replay's
outputs must be bitwise identical to the first replay's (compared on the device after every
replay), with no timed-out wait.

Rank 0 writes ``<out>/<name>.json`` (default name ``dist_check_w<N>``): every case with its seed
and worst errors, the worst errors per dtype, failures per rank, skipped cases (an instance the
build lacks), the graph check and the environment (GPUs, driver, torch, CUDA, NCCL, topology,
commit from $ARFUSE_COMMIT or git). Exit status 0 when everything passed, 1 on any failure, 2 on
bad arguments.

NVLink multicast stays off: importing this module sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 as defaults in os.environ, before
any process group, NCCL communicator or CUDA context exists (arfuse's import creates none);
arfuse itself never creates multicast objects.

Testing seam (hidden option): ``--fake-op reference`` replaces the kernel by the float32 PyTorch
definition of all N ranks (no Communicator, no library needed), so that the harness itself --
seeds, fingerprints, gathers, checks, report -- runs with several processes on a CPU;
``--fake-op corrupt`` does the same but the last rank spoils one element (the run must fail).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
import zlib
from pathlib import Path

from .._tools.provenance import command_output, run_info
from .._tools.ranks import ProcessRanks, RanksError, torchrun_world

# NVLink multicast off (see the docstring). Defaults only: an explicit setting is kept, and
# recorded in the report, with a warning when it turns multicast on.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def multicast_off(environ=None) -> dict:
    """Sets the multicast-off variables as defaults in `environ` (os.environ); returns the ones
    whose value differs from the off value (explicit settings left as they are)."""
    environ = os.environ if environ is None else environ
    for key, value in MULTICAST_OFF.items():
        environ.setdefault(key, value)
    return {k: environ[k] for k, v in MULTICAST_OFF.items() if environ[k] != v}


multicast_off()

SUITES = ("specialised", "token_counts", "forms", "generic", "specials", "inplace",
          "oneshot_twoshot", "fp8_static", "no_residual", "graph")
DEFAULT_REPLAYS = 10_000
QUICK_REPLAYS = 200
DEFAULT_MAX_TOKENS = 256
FP8_SCALE = 0.02

# Shapes (hidden, dtype) per suite: the full run, then --quick.
SHAPES = {
    "token_counts": ([(7168, "bf16"), (4096, "bf16"), (2880, "bf16"), (2048, "bf16"),
                      (4096, "fp16")], [(2048, "bf16")]),
    "forms": ([(4096, "fp16"), (2048, "bf16"), (1536, "fp32")], [(2048, "bf16")]),
    "generic": ([(2880, "bf16"), (1536, "bf16"), (6400, "bf16"), (2880, "fp16"), (5120, "fp16"),
                 (7168, "fp32"), (2880, "fp32"), (1000, "fp16"), (24576, "bf16")],
                [(2880, "fp16"), (1536, "fp32")]),
    "specials": ([(7168, "bf16"), (2880, "fp16"), (1536, "fp32")], [(2048, "bf16"), (1536, "fp32")]),
    "inplace": ([(7168, "bf16"), (2880, "bf16")], [(2048, "bf16")]),
    "oneshot_twoshot": ([(7168, "bf16"), (4096, "fp16"), (2880, "bf16"), (1536, "fp32")],
                        [(2048, "bf16")]),
    "fp8_static": ([(2880, "bf16"), (7168, "bf16"), (2048, "bf16")], [(2048, "bf16")]),
    "no_residual": ([(7168, "bf16"), (2880, "fp16")], [(2048, "bf16")]),
    "graph": ([(4096, "fp16")], [(4096, "fp16")]),
}


class DistCheckError(Exception):
    """A user-facing error: one line, exit status 2."""


# ============================================================================ arguments

def build_parser() -> argparse.ArgumentParser:
    from .._cli import HelpFormatter

    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m arfuse.check",
        description="arfuse's correctness suite with one process per GPU: the real Communicator, "
                    "every case of the one-shot/two-shot suites checked element by element "
                    "against a float64 reference, outputs bitwise identical across ranks, and a "
                    "CUDA graph replayed many times. Writes a JSON report; exit status 1 on any "
                    "failure.",
        formatter_class=HelpFormatter)
    p.add_argument("--out", default="dist-check-out", help="directory for the JSON report")
    p.add_argument("--name", help="report file stem (default: dist_check_w<N>)")
    p.add_argument("--replays", type=int, default=None,
                   help=f"graph replays per algorithm (default: {DEFAULT_REPLAYS}, "
                        f"{QUICK_REPLAYS} with --quick; 0: no graph check)")
    p.add_argument("--quick", action="store_true",
                   help="a subset: one or two shapes per suite (every suite still runs)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="the communicators' capacity, also the largest token count checked")
    p.add_argument("--only", default=None,
                   help="comma list of suites to run (default: all): " + ", ".join(SUITES))
    p.add_argument("--seed", type=int, default=None,
                   help="base seed (default: drawn by rank 0); case seeds derive from it and the "
                        "case name, so --seed S --only SUITE reproduces a case")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="default process group's backend (auto: nccl with CUDA, else gloo)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda:LOCAL_RANK when CUDA is available, else the CPU (world "
                        "size 1 only: the CPU implementation)")
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="communicator wait timeout: a call that waits longer for a peer gives "
                        "up (NaN outputs, the case fails) instead of hanging")
    p.add_argument("--pg-timeout-s", type=float, default=600.0,
                   help="timeout of the process groups' collectives")
    p.add_argument("--fake-op", choices=("reference", "corrupt"), default=None,
                   help=argparse.SUPPRESS)
    return p


def resolve_args(ns: argparse.Namespace) -> argparse.Namespace:
    """Checks and completes parsed arguments (no torch needed). Raises DistCheckError."""
    if ns.replays is None:
        ns.replays = QUICK_REPLAYS if ns.quick else DEFAULT_REPLAYS
    if ns.replays < 0:
        raise DistCheckError(f"--replays must be >= 0, got {ns.replays}")
    if ns.max_tokens < 1:
        raise DistCheckError(f"--max-tokens must be >= 1, got {ns.max_tokens}")
    if ns.timeout_s <= 0:
        raise DistCheckError(f"--timeout-s must be positive, got {ns.timeout_s}")
    if ns.pg_timeout_s <= 0:
        raise DistCheckError(f"--pg-timeout-s must be positive, got {ns.pg_timeout_s}")
    if ns.only is None:
        ns.suites = list(SUITES)
    else:
        names = [s.strip() for s in ns.only.split(",") if s.strip()]
        bad = [s for s in names if s not in SUITES]
        if bad:
            raise DistCheckError(f"--only: unknown suite {', '.join(bad)}; choose from "
                                 f"{', '.join(SUITES)}")
        if not names:
            raise DistCheckError("--only: empty list")
        ns.suites = [s for s in SUITES if s in names]
    if ns.name is not None and (not ns.name or "/" in ns.name):
        raise DistCheckError(f"--name: {ns.name!r} is not a file stem")
    return ns


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return resolve_args(ns)
    except DistCheckError as e:
        parser.error(str(e))


# ============================================================================ the cases

@dataclasses.dataclass
class DistCase:
    suite: str
    case: object            # arfuse._checks.Case
    kind: str = "fused"     # fused | inplace | no_residual | oneshot_twoshot
    fp8_scale: float | None = None

    @property
    def name(self) -> str:
        return f"{self.suite}:{self.case}"

    @property
    def algorithms(self) -> list[str]:
        """The calls the case makes, in order."""
        if self.kind == "oneshot_twoshot":
            return ["oneshot", "twoshot"]
        return [self.case.algorithm]


def token_counts(max_tokens: int) -> list[int]:
    return sorted({t for t in (0, 1, 3, 17, 128, max_tokens) if t <= max_tokens})


def specialised_from_manifest(path, world: int) -> list[tuple[str, int]]:
    """(dtype name, hidden) of every specialised norm instance of `world` in a build manifest."""
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return []
    seen = set()
    for inst in m.get("instances", []):
        if (inst.get("hidden") and inst.get("world_size") == world
                and inst.get("output", inst.get("out", "norm")) == "norm"):
            seen.add((inst["dtype"], int(inst["hidden"])))
    return sorted(seen)


def build_cases(world: int, *, quick: bool = False, max_tokens: int = DEFAULT_MAX_TOKENS,
                specialised=(), suites=SUITES) -> list[DistCase]:
    """The cases of the GPU suites for a world size, in a fixed order (every rank builds the same
    list). The graph check is not a case (see run_graph)."""
    from .._checks import OPTION_CASES, Case  # OPTION_CASES: the GPU suite's input forms
    from .._vocab import DTYPES, KERNEL_ALGORITHMS

    def shapes(suite):
        return SHAPES[suite][1 if quick else 0]

    def T(t):
        return min(t, max_tokens)

    N = world
    out: list[DistCase] = []
    if "specialised" in suites:
        specs = list(specialised)[:1] if quick else list(specialised)
        for d, hidden in specs:
            for algo in KERNEL_ALGORITHMS:
                out.append(DistCase("specialised", Case(N, hidden, DTYPES[d], T(17), "dense", 8,
                                                        "f32", True, 2.5, algorithm=algo)))
                out.append(DistCase("specialised", Case(N, hidden, DTYPES[d], T(128), "permuted",
                                                        8, "act", True, 1.0, weight_bias=1.0,
                                                        absent=0.3, algorithm=algo)))
    if "token_counts" in suites:
        for hidden, d in shapes("token_counts"):
            for t in token_counts(max_tokens):
                for algo in (*KERNEL_ALGORITHMS, "auto"):
                    out.append(DistCase("token_counts", Case(N, hidden, DTYPES[d], t, "permuted",
                                                             8, "f32", True, 1.0, absent=0.25,
                                                             algorithm=algo)))
    if "forms" in suites:
        for hidden, d in shapes("forms"):
            for layout, k, w, sh, rs, wb, g32, absent in OPTION_CASES:
                for algo in KERNEL_ALGORITHMS:
                    out.append(DistCase("forms", Case(N, hidden, DTYPES[d], T(33), layout, k, w,
                                                      sh, rs, wb, g32, absent, algorithm=algo)))
    if "generic" in suites:
        for hidden, d in shapes("generic"):
            for algo in KERNEL_ALGORITHMS:
                out.append(DistCase("generic", Case(N, hidden, DTYPES[d], T(40), "dense", 4, "f32",
                                                    True, 1.0, algorithm=algo)))
    if "specials" in suites and max_tokens >= 3:
        for hidden, d in shapes("specials"):
            for layout in ("plain", "dense", "permuted"):
                for algo in KERNEL_ALGORITHMS:
                    out.append(DistCase("specials", Case(
                        N, hidden, DTYPES[d], T(9), layout, 1 if layout == "plain" else 4,
                        None if layout == "plain" else "f32", True, 1.0, specials=True,
                        absent=0.2 if layout == "permuted" else 0, algorithm=algo)))
    if "inplace" in suites:
        for hidden, d in shapes("inplace"):
            for algo in KERNEL_ALGORITHMS:
                out.append(DistCase("inplace", Case(N, hidden, DTYPES[d], T(64), "plain", 1, None,
                                                    True, 1.0, inplace=True, algorithm=algo),
                                    kind="inplace"))
    if "oneshot_twoshot" in suites:
        for hidden, d in shapes("oneshot_twoshot"):
            out.append(DistCase("oneshot_twoshot", Case(N, hidden, DTYPES[d], T(77), "permuted",
                                                        8, "f32", True, 2.5, absent=0.3,
                                                        algorithm="oneshot"),
                                kind="oneshot_twoshot"))
    if "fp8_static" in suites:
        for hidden, d in shapes("fp8_static"):
            for algo in KERNEL_ALGORITHMS:
                out.append(DistCase("fp8_static", Case(N, hidden, DTYPES[d], T(50), "permuted", 8,
                                                       "f32", True, 1.0, absent=0.2, fp8=True,
                                                       algorithm=algo), fp8_scale=FP8_SCALE))
    if "no_residual" in suites:
        for hidden, d in shapes("no_residual"):
            for algo in KERNEL_ALGORITHMS:
                out.append(DistCase("no_residual", Case(N, hidden, DTYPES[d], T(21), "plain", 1,
                                                        None, True, 1.0, algorithm=algo),
                                    kind="no_residual"))
    return out


def case_seed(base: int, name: str) -> int:
    return (base + zlib.crc32(name.encode())) % (1 << 31)


# ============================================================================ report

def dtype_key(case) -> str:
    from .._vocab import DTYPE_NAME_OF

    d = DTYPE_NAME_OF[case.dtype]
    return f"fp8_e4m3 (from {d})" if case.fp8 else d


def summarize(records: list[dict], graph: dict | None) -> dict:
    """Counts and the worst errors per dtype over the passed cases."""
    worst: dict = {}
    for r in records:
        if r["status"] != "passed":
            continue
        w = worst.setdefault(r["dtype_key"], {"cases": 0, "residual_out": 0.0, "norm_out": 0.0})
        w["cases"] += 1
        for k in ("residual_out", "norm_out"):
            if r.get(k) is not None:
                w[k] = max(w[k], r[k])
    counts = {s: sum(1 for r in records if r["status"] == s) for s in ("passed", "failed", "skipped")}
    graph_ok = graph is None or graph.get("status") in ("passed", "skipped")
    return {"cases": len(records), **counts, "worst": dict(sorted(worst.items())),
            "graph": None if graph is None else graph.get("status"),
            "ok": counts["failed"] == 0 and counts["passed"] > 0 and graph_ok}


def write_report(out_dir, name: str, report: dict) -> Path:
    """Writes report as <out_dir>/<name>.json (via a temporary file, then renamed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = out / f".{name}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def format_summary(report: dict) -> list[str]:
    """The worst errors, the failures, then one verdict line (last: launchers quote it)."""
    s = report["summary"]
    lines = []
    for key, w in s["worst"].items():
        lines.append(f"  worst {key}: {w['cases']} cases, residual_out {w['residual_out']:.2e}, "
                     f"norm_out {w['norm_out']:.2e}")
    for f in report["failures"][:20]:
        lines.append(f"  FAILED {f['case']} (seed {f['seed']}): " +
                     "; ".join(f"rank {r}: {m}" for r, m in sorted(f["ranks"].items())))
    if len(report["failures"]) > 20:
        lines.append(f"  ... {len(report['failures']) - 20} more failures in the report")
    verdict = (f"{'PASSED' if s['ok'] else 'FAILED'} arfuse.check N={report['world_size']} "
               f"{report['device']} {report['backend']}: {s['cases']} cases, {s['passed']} passed, "
               f"{s['failed']} failed, {s['skipped']} skipped")
    g = report.get("graph") or {}
    if g.get("status") == "passed":
        verdict += (f"; graph: {g['replays']} replays x {len(g['algorithms'])} algorithms, "
                    "identical, no timeout")
    elif g:
        verdict += f"; graph: {g.get('status')}" + (f" ({g['reason']})" if g.get("reason") else "")
    return lines + [verdict]


# ============================================================================ running

class Runner:
    """One rank's state: process groups, device, communicators by (hidden, dtype)."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.args = args
        self.torch, self.dist = torch, dist
        self.fake = args.fake_op
        self.comms: dict = {}
        world = torchrun_world() or 1
        # On the CPU (a test path: small tensors, often several processes on a few cores) one
        # thread per process: OpenMP threads oversubscribing a loaded machine made a quick run
        # 20x slower. Restored by close().
        self.threads = torch.get_num_threads()
        want_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        if want_cpu and world > 1 and not self.fake:
            raise DistCheckError(
                f"world size {world} on the CPU: the CPU implementation serves world size 1 only "
                "(every rank of a real run needs its own GPU)")
        if want_cpu and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        try:
            self.ranks = ProcessRanks(device=args.device, backend=args.backend,
                                      timeout_s=args.pg_timeout_s)
        except RanksError as e:
            torch.set_num_threads(self.threads)
            raise DistCheckError(str(e)) from None
        r = self.ranks
        self.local_rank, self.device, self.is_cuda = r.local_rank, r.device, r.is_cuda
        self.backend, self.rank, self.world, self.gloo = r.backend, r.rank, r.world, r.gloo

    # ---- collectives -------------------------------------------------------------------------
    def gather_obj(self, obj) -> list:
        return self.ranks.gather_obj(obj)

    def broadcast_obj(self, obj):
        return self.ranks.broadcast_obj(obj)

    def gather_tensor(self, t):
        """Every rank's copy of `t` (same shape and dtype on every rank), in rank order, as raw
        bytes compared on this rank (GPU tensors gathered over NCCL, CPU ones over gloo)."""
        torch = self.torch
        from .._checks import bits

        if self.world == 1:
            return [t]
        b = bits(t).reshape(-1)
        if b.numel() == 0:
            return [t] * self.world
        if self.backend == "nccl":
            out = torch.empty(self.world * b.numel(), dtype=torch.uint8, device=b.device)
            self.dist.all_gather_into_tensor(out, b)
            parts = out.view(self.world, -1)
        else:
            bc = b.cpu()
            parts = [torch.empty_like(bc) for _ in range(self.world)]
            self.dist.all_gather(parts, bc, group=self.gloo)
        return [p.view(t.dtype).reshape(t.shape) for p in parts]

    def sync(self):
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)

    # ---- communicators -----------------------------------------------------------------------
    def comm_for(self, hidden: int, dtype):
        """The communicator of (hidden, dtype), created on first use (collectively: every rank
        meets the same cases in the same order)."""
        if self.fake:
            return None
        key = (hidden, dtype)
        if key not in self.comms:
            import arfuse

            self.comms[key] = arfuse.Communicator(
                None, max_tokens=self.args.max_tokens, hidden=hidden, dtype=dtype,
                device=self.device, timeout_s=self.args.timeout_s)
        return self.comms[key]

    def drop_comm(self, hidden: int, dtype) -> None:
        comm = self.comms.pop((hidden, dtype), None)
        if comm is not None:
            try:
                # No barrier: every caller comes after a gather of all ranks that followed each
                # rank's device sync, so no peer kernel is still writing into this buffer; and a
                # rank whose sync failed must not leave its peers waiting at a barrier.
                comm.close(wait_for_peers=False)
            except Exception:  # a broken device: nothing more to free
                pass

    def close(self) -> None:
        for key in list(self.comms):
            self.drop_comm(*key)
        self.ranks.close()
        self.torch.set_num_threads(self.threads)

    # ---- support -----------------------------------------------------------------------------
    def missing_instance(self, case, algorithms) -> str | None:
        """Why the build cannot serve the case (None when it can)."""
        if self.fake:
            return None
        import arfuse
        from .._vocab import DTYPE_NAME_OF, KERNEL_ALGORITHMS

        output = "fp8_static" if case.fp8 else "norm"
        algos = list(KERNEL_ALGORITHMS) if "auto" in algorithms else algorithms
        for a in algos:
            try:
                name = arfuse.instance_for(case.dtype, case.hidden, case.world, a, output)
            except Exception as e:  # a size no instance can serve
                return f"not served: {_err(e)}"
            if name is None:
                return (f"not in this build: {DTYPE_NAME_OF[case.dtype]} hidden {case.hidden} "
                        f"world {case.world} {a} {output}")
        return None


def fingerprint(tensors) -> int:
    """A checksum of the raw bytes of `tensors` (position-weighted, so a moved byte counts)."""
    import torch

    from .._checks import bits

    total = 0
    chunk = 1 << 24
    for t in tensors:
        b = bits(t).reshape(-1)
        n = b.numel()
        acc = 0
        for start in range(0, n, chunk):
            c = b[start:start + chunk].to(torch.int64)
            w = torch.arange(start, start + c.numel(), device=c.device, dtype=torch.int64) % 65521 + 1
            acc += int((c * w).sum())
        total = (total * 1000003 + acc * 31 + n) % (1 << 61)
    return total


def _input_tensors(inputs):
    ranks, residual, gamma = inputs
    out = []
    for inp in ranks:
        out += [inp[k] for k in sorted(inp)]
    return out + [residual, gamma]


def _fake_call(runner, dc, inputs, algorithm, rank):
    """The op's definition in float32 from all ranks' inputs (testing seam, no kernel)."""
    import torch

    from .. import reference

    case = dc.case
    ranks, residual, gamma = inputs
    res_in = None if dc.kind == "no_residual" else residual
    norm, res = reference.fused_reference(ranks, res_in, gamma, case.eps,
                                          weight_bias=case.weight_bias,
                                          routed_scaling=case.routed_scaling, acc=torch.float32)
    if case.fp8:
        norm = reference.quantize_fp8_static(norm, torch.tensor([dc.fp8_scale], device=norm.device))
    else:
        norm = norm.to(case.dtype)
    res = res.clone()
    if runner.fake == "corrupt" and rank == runner.world - 1 and res.numel():
        res.view(-1)[0] = 1e4
    if dc.kind == "inplace":
        x, r = ranks[rank]["expert_out"].clone(), residual.clone()
        x.copy_(norm)
        r.copy_(res)
        return x, r
    return norm, res


def call_op(runner, dc, comm, inputs, algorithm):
    """This rank's call of the op for a case, outputs poisoned first."""
    import torch

    import arfuse
    from .._checks import poison_like

    if runner.fake:
        return _fake_call(runner, dc, inputs, algorithm, runner.rank)
    case = dc.case
    ranks, residual, gamma = inputs
    inp = ranks[runner.rank]
    if dc.kind == "inplace":  # the inputs are the outputs
        x, res = inp["expert_out"].clone(), residual.clone()
        return arfuse.moe_finalize_allreduce_rmsnorm(
            comm, x, res, gamma, case.eps, shared_out=inp.get("shared_out"),
            routed_scaling=case.routed_scaling, weight_bias=case.weight_bias, inplace=True,
            algorithm=algorithm)
    scale = (torch.tensor([dc.fp8_scale], dtype=torch.float32, device=runner.device)
             if case.fp8 else None)
    T, H = case.tokens, case.hidden
    ptrs = None
    if runner.is_cuda:
        # Poison exactly the blocks the op is about to allocate (same sizes, same stream).
        out_dtype = torch.float8_e4m3fn if case.fp8 else case.dtype
        p_norm = poison_like((T, H), out_dtype, runner.device)
        p_res = poison_like((T, H), case.dtype, runner.device)
        ptrs = {p_norm.data_ptr(), p_res.data_ptr()}
        del p_norm, p_res
    out = arfuse.moe_finalize_allreduce_rmsnorm(
        comm, inp["expert_out"], None if dc.kind == "no_residual" else residual, gamma, case.eps,
        permuted_idx=inp.get("permuted_idx"), expert_weights=inp.get("expert_weights"),
        shared_out=inp.get("shared_out"), routed_scaling=case.routed_scaling,
        weight_bias=case.weight_bias, algorithm=algorithm, fp8_scale=scale)
    if ptrs is not None and T > 0 and {out[0].data_ptr(), out[1].data_ptr()} != ptrs:
        raise AssertionError("poisoning missed the outputs (the op's outputs are not the "
                             "poisoned blocks)")
    return out


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


def _status(comm, status, local_err):
    """The communicator's status word after a call (``status`` unchanged without a communicator
    or when reading it fails), and the first error."""
    if comm is None:
        return status, local_err
    try:
        return comm.status(), local_err
    except Exception as e:
        return status, local_err or _err(e)


def run_case(runner, dc: DistCase, seed: int) -> dict:
    """Runs and checks one case on every rank (collectively); the record of the case."""
    import torch

    from .._checks import (TOL, bits, check_against_reference, check_bitwise_equal, make_inputs,
                          reference_for)

    case = dc.case
    rec = {"case": dc.name, "suite": dc.suite, "seed": seed, "dtype_key": dtype_key(case),
           "world": case.world, "hidden": case.hidden, "tokens": case.tokens,
           "algorithm": "+".join(dc.algorithms), "layout": case.layout, "kind": dc.kind}
    t0 = time.time()
    missing = runner.missing_instance(case, dc.algorithms)
    if missing:
        rec.update(status="skipped", reason=missing)
        return rec

    # 1. local: inputs, the call(s). Nothing here is a collective except creating a communicator.
    local_err, fp, outs, inputs, status = None, None, {}, None, 0
    comm = None
    try:
        comm = runner.comm_for(case.hidden, case.dtype)
        inputs = make_inputs(case, runner.device, seed)
        fp = fingerprint(_input_tensors(inputs))
        for algo in dc.algorithms:
            outs[algo] = call_op(runner, dc, comm, inputs, algo)
        runner.sync()
    except Exception as e:
        local_err = _err(e)
    status, local_err = _status(comm, status, local_err)
    # 2. agree on what happened
    states = runner.gather_obj({"err": local_err, "status": status, "fp": fp})
    problems = {r: s["err"] for r, s in enumerate(states) if s["err"]}
    for r, s in enumerate(states):
        if s["status"]:
            problems.setdefault(r, f"the communicator gave up waiting for rank {s['status'] - 1} "
                                   f"(timeout {runner.args.timeout_s} s)")
    if not problems and len({s["fp"] for s in states}) > 1:
        problems = {r: f"drew inputs with fingerprint {s['fp']:#x} from seed {seed}"
                    for r, s in enumerate(states)}
    if problems:
        # Calls may now be out of step between ranks: a fresh communicator on every rank.
        runner.drop_comm(case.hidden, case.dtype)
        rec.update(status="failed", ranks={str(r): m for r, m in problems.items()},
                   seconds=round(time.time() - t0, 3))
        return rec
    # 3. every rank's outputs, gathered
    gathered = {a: list(zip(runner.gather_tensor(outs[a][0]), runner.gather_tensor(outs[a][1])))
                for a in dc.algorithms}
    # 4. local checks: bitwise across ranks, this rank's outputs against the reference
    try:
        ref = reference_for(case, inputs, None if dc.fp8_scale is None else
                            torch.tensor([dc.fp8_scale], device=runner.device),
                            residual=dc.kind != "no_residual")
        errs = {"residual_out": 0.0, "norm_out": 0.0}
        for algo in dc.algorithms:
            label = dataclasses.replace(case, algorithm=algo)
            check_bitwise_equal(label, gathered[algo])
            e = check_against_reference(label, outs[algo], ref)
            errs = {k: max(errs[k], e[k]) for k in errs}
        if case.specials and case.tokens >= 3 and not torch.isnan(outs[dc.algorithms[0]][0][1]).all():
            raise AssertionError(f"{case}: a NaN in one element must make its token's norm NaN")
        if dc.kind == "oneshot_twoshot":
            one, two = outs["oneshot"], outs["twoshot"]
            if not torch.equal(bits(one[1]), bits(two[1])):
                raise AssertionError(f"{case}: residual_out of one-shot and two-shot differ bitwise")
            a, b = one[0].double(), two[0].double()
            if not torch.equal(a.isnan(), b.isnan()):
                raise AssertionError(f"{case}: norm_out NaN positions differ between one-shot "
                                     "and two-shot")
            fin = torch.isfinite(a)
            den = float(a[fin].norm()) if fin.any() else 0.0
            d = float((a - b)[fin].norm()) / den if den else 0.0
            if d > TOL[case.dtype]:
                raise AssertionError(f"{case}: norm_out one-shot vs two-shot relative error "
                                     f"{d:.3g} > {TOL[case.dtype]:.0e}")
        local = {"ok": True, "errs": errs}
    except Exception as e:  # AssertionError from a check, or anything unexpected
        local = {"ok": False, "msg": _err(e) if not isinstance(e, AssertionError) else str(e)}
    # 5. every rank's verdict
    verdicts = runner.gather_obj(local)
    bad = {str(r): v["msg"] for r, v in enumerate(verdicts) if not v["ok"]}
    if bad:
        rec.update(status="failed", ranks=bad)
    else:
        rec.update(status="passed")
        for k in ("residual_out", "norm_out"):
            rec[k] = max(v["errs"][k] for v in verdicts)
    rec["seconds"] = round(time.time() - t0, 3)
    return rec


def run_graph(runner, seed: int, replays: int, quick: bool) -> dict:
    """One call per algorithm captured in a CUDA graph each; the graphs replayed alternately
    `replays` times; every replay's outputs bitwise equal to the first's, no timed-out wait."""
    import torch

    import arfuse
    from .._checks import (Case, bits, check_against_reference, check_bitwise_equal, make_inputs,
                          reference_for)
    from .._vocab import DTYPES, KERNEL_ALGORITHMS

    hidden, d = SHAPES["graph"][1 if quick else 0][0]
    case = Case(runner.world, hidden, DTYPES[d], min(17, runner.args.max_tokens), "permuted", 8,
                "f32", True, 1.0, absent=0.2)
    algos = list(KERNEL_ALGORITHMS)
    res = {"case": str(case), "seed": seed, "replays": replays, "algorithms": algos}
    if replays == 0:
        return {**res, "status": "skipped", "reason": "--replays 0"}
    if runner.fake:
        return {**res, "status": "skipped", "reason": "--fake-op"}
    if not runner.is_cuda:
        return {**res, "status": "skipped", "reason": "no CUDA device: CUDA graphs need one"}
    missing = runner.missing_instance(case, algos)
    if missing:
        return {**res, "status": "skipped", "reason": missing}

    local_err, mismatches, status, seconds = None, None, 0, 0.0
    outs: dict = {}
    first: dict = {}
    graphs: dict = {}
    comm = None
    try:
        comm = runner.comm_for(case.hidden, case.dtype)
        inputs = make_inputs(case, runner.device, seed)
        ranks, residual, gamma = inputs
        inp = ranks[runner.rank]

        def call(algo):
            return arfuse.moe_finalize_allreduce_rmsnorm(
                comm, inp["expert_out"], residual, gamma, case.eps,
                permuted_idx=inp["permuted_idx"], expert_weights=inp["expert_weights"],
                shared_out=inp["shared_out"], algorithm=algo)

        for algo in algos:  # warm-up outside the graphs
            call(algo)
        runner.sync()
        for algo in algos:
            graphs[algo] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[algo], capture_error_mode="thread_local"):
                outs[algo] = call(algo)
        for algo in algos:
            graphs[algo].replay()
        runner.sync()
        first = {a: (o[0].clone(), o[1].clone()) for a, o in outs.items()}
        count = torch.zeros((), dtype=torch.int64, device=runner.device)
        t0 = time.time()
        for _ in range(replays):
            for algo in algos:
                graphs[algo].replay()
                o, f = outs[algo], first[algo]
                same = (bits(o[0]) == bits(f[0])).all() & (bits(o[1]) == bits(f[1])).all()
                count += (~same).to(torch.int64)
        runner.sync()
        seconds = time.time() - t0
        mismatches = int(count)
    except Exception as e:
        local_err = _err(e)
    status, local_err = _status(comm, status, local_err)
    states = runner.gather_obj({"err": local_err, "status": status, "mismatches": mismatches,
                                "seconds": seconds})
    problems = {}
    for r, s in enumerate(states):
        if s["err"]:
            problems[str(r)] = s["err"]
        elif s["status"]:
            problems[str(r)] = f"the communicator gave up waiting for rank {s['status'] - 1}"
        elif s["mismatches"]:
            problems[str(r)] = f"{s['mismatches']} of {replays * len(algos)} replays differed"
    res["seconds"] = round(max(s["seconds"] for s in states), 3)
    if not problems:
        # The first replay's outputs: bitwise equal across ranks and right.
        try:
            ref = reference_for(case, inputs)
            gathered = {a: list(zip(runner.gather_tensor(first[a][0]),
                                    runner.gather_tensor(first[a][1]))) for a in algos}
            local = {"ok": True}
            try:
                for a in algos:
                    label = dataclasses.replace(case, algorithm=a)
                    check_bitwise_equal(label, gathered[a])
                    check_against_reference(label, first[a], ref)
            except Exception as e:
                local = {"ok": False, "msg": str(e) if isinstance(e, AssertionError) else _err(e)}
        except Exception as e:
            local = {"ok": False, "msg": _err(e)}
        for r, v in enumerate(runner.gather_obj(local)):
            if not v["ok"]:
                problems[str(r)] = v["msg"]
    del graphs, outs, first
    if problems:
        runner.drop_comm(case.hidden, case.dtype)
        return {**res, "status": "failed", "ranks": problems}
    return {**res, "status": "passed"}


def environment(runner) -> dict:
    import torch

    env = run_info()
    env["multicast_env"] = {k: os.environ.get(k) for k in MULTICAST_OFF}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if runner.is_cuda else None
    except Exception:
        env["nccl"] = None
    if runner.is_cuda:
        p = torch.cuda.get_device_properties(runner.device)
        mine = {"rank": runner.rank, "device": str(runner.device), "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "pci_bus_id": getattr(p, "pci_bus_id", None),
                "uuid": str(getattr(p, "uuid", "")) or None}
    else:
        mine = {"rank": runner.rank, "device": "cpu", "name": platform.processor() or "cpu"}
    env["ranks"] = runner.gather_obj(mine)
    if runner.rank == 0:
        env["gpus"] = command_output(["nvidia-smi", "--query-gpu=index,name,driver_version,"
                                "memory.total,pci.bus_id", "--format=csv,noheader"])
        drv = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = drv.splitlines()[0].strip() if drv else None
        env["topology"] = command_output(["nvidia-smi", "topo", "-m"])
    return env


def run(args) -> tuple[dict, int]:
    """The whole check on this rank. Returns (report, exit status); only rank 0's report is
    written."""
    from .. import _lib

    runner = Runner(args)
    try:
        if not runner.fake:
            _lib.require()
        said = multicast_off()
        if said and runner.rank == 0:
            print(f"arfuse.check: warning: multicast variables set to turn it on: {said}",
                  file=sys.stderr)
        base = runner.broadcast_obj(args.seed if args.seed is not None
                                    else int.from_bytes(os.urandom(4), "little") >> 1)
        specialised = ([] if runner.fake else
                       specialised_from_manifest(_lib.manifest_path(), runner.world))
        cases = build_cases(runner.world, quick=args.quick, max_tokens=args.max_tokens,
                            specialised=specialised, suites=args.suites)
        started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        t0 = time.time()
        env = environment(runner)
        records: list[dict] = []
        suite = None
        for dc in cases:
            if dc.suite != suite and runner.rank == 0:
                suite = dc.suite
                n = sum(1 for c in cases if c.suite == suite)
                print(f"[{suite}] {n} cases", flush=True)
            rec = run_case(runner, dc, case_seed(base, dc.name))
            records.append(rec)
            if rec["status"] == "failed" and runner.rank == 0:
                print(f"  FAILED {rec['case']} (seed {rec['seed']}): {rec['ranks']}", flush=True)
        graph = None
        if "graph" in args.suites:
            if runner.rank == 0:
                print(f"[graph] {args.replays} replays x 2 algorithms", flush=True)
            graph = run_graph(runner, case_seed(base, "graph"), args.replays, args.quick)
        summary = summarize(records, graph)
        failures = [{"case": r["case"], "seed": r["seed"], "ranks": r["ranks"]}
                    for r in records if r["status"] == "failed"]
        if graph and graph.get("status") == "failed":
            failures.append({"case": f"graph:{graph['case']}", "seed": graph["seed"],
                             "ranks": graph["ranks"]})
        report = {
            "tool": "arfuse.check",
            "ok": summary["ok"],
            "world_size": runner.world,
            "device": runner.device.type,
            "backend": runner.backend,
            "fake_op": runner.fake,
            "seed": base,
            "args": {k: v for k, v in vars(args).items()},
            "started": started,
            "seconds": round(time.time() - t0, 1),
            "summary": summary,
            "graph": graph,
            "failures": failures,
            "skipped": [{"case": r["case"], "reason": r["reason"]}
                        for r in records if r["status"] == "skipped"],
            "cases": records,
            "environment": env,
        }
        if runner.rank == 0:
            path = write_report(args.out, args.name or f"dist_check_w{runner.world}", report)
            print(f"wrote {path}")
            for line in format_summary(report):
                print(line)
        return report, 0 if summary["ok"] else 1
    finally:
        runner.close()


def main(argv=None) -> int:
    multicast_off()
    args = parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("arfuse.check: PyTorch is not installed", file=sys.stderr)
        return 1
    try:
        _, rc = run(args)
    except DistCheckError as e:
        print(f"arfuse.check: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. the library missing or stale
        print(f"arfuse.check: {e}", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
