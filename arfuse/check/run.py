"""The whole of ``arfuse.check`` on this rank: the cases in order, the graph check, the environment, the
report, and ``main`` (the exit status: 0 passed, 1 a failure, 2 bad arguments)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time

from .._tools.provenance import command_output, run_info
from .cases import build_cases, case_seed, specialised_from_manifest
from .cli import DistCheckError, parse_args
from .multicast import MULTICAST_OFF, multicast_off
from .report import format_summary, summarize, write_report
from .run_case import run_case, run_graph
from .runner import Runner


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
