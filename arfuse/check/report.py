"""The report of ``arfuse.check``: the counts and worst errors per dtype, the JSON file rank 0 writes, and
the summary lines it prints."""

from __future__ import annotations

import json
import os
from pathlib import Path


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
