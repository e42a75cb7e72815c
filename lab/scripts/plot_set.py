#!/usr/bin/env python3
"""The plots of a stored benchmark set, drawn from its CSVs on any machine (no GPU, no torch).

    python3 lab/scripts/plot_set.py docs/perf/h100-e93deef [--out DIR]

Needs matplotlib. Writes into DIR (default SET/plots):

- ``vllm-today-<model>-w<N>.png`` for every CSV of SET/vllm-today: time per call against T,
  arfuse beside the unfused pipeline and "vLLM today", drawn by ``arfuse.bench``'s own plot
  function (``arfuse/bench/report.py``: ``read_csv``, then ``plot``, as a benchmark run draws its
  PNG), titled from the run's JSON (model, sizes, card, commit);
- ``copy-bw.png`` from SET/tables: arfuse (auto)'s share of the copy bandwidth (the run's
  ``frac_copy_bw``: bytes counted over the per-call time, against the copy bandwidth the same run
  measured) against T for T >= 64, one line per configuration.

``arfuse/bench/report.py`` is loaded by path (it imports only the standard library), so neither
arfuse's package nor torch is imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def report_module():
    spec = importlib.util.spec_from_file_location("arfuse_bench_report",
                                                  REPO / "arfuse" / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_info(csv_path: Path) -> dict:
    """The run's JSON beside its CSV: model, sizes, card, commit."""
    env = json.loads(csv_path.with_suffix(".json").read_text())
    a = env["args"]
    return {"model": a.get("model_name") or a.get("model"), "hidden": a["hidden"],
            "topk": a["topk"], "n": a["world_size"], "dtype": a["dtype"], "layout": a["layout"],
            "card": env.get("card"), "commit": env.get("arfuse_commit")}


def vllm_today_plots(BR, set_dir: Path, out: Path) -> list[Path]:
    made = []
    for csv_path in sorted((set_dir / "vllm-today").glob("bench_*.csv")):
        i = run_info(csv_path)
        rows = [r for r in BR.read_csv(csv_path) if r["impl"] in ("arfuse", "unfused", "vllm_today")]
        png = out / f"vllm-today-{i['model']}-w{i['n']}.png"
        BR.plot(png, rows, title=(f"{i['model']} H={i['hidden']} K={i['topk']} N={i['n']} "
                                  f"{i['dtype']} {i['layout']} (emulated on one GPU) — "
                                  f"{i['card']}, {i['commit']}"))
        made.append(png)
    return made


def copy_bw_plot(BR, set_dir: Path, out: Path, min_tokens: int = 64) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    runs = []
    for csv_path in sorted((set_dir / "tables").glob("bench_*.csv")):
        i = run_info(csv_path)
        pts = sorted((r["tokens"], 100 * r["frac_copy_bw"]) for r in BR.read_csv(csv_path)
                     if r["impl"] == "arfuse" and r.get("frac_copy_bw") is not None
                     and r["tokens"] >= min_tokens)
        runs.append((i, pts))
    if not runs:
        sys.exit(f"plot_set: no tables/bench_*.csv under {set_dir}")
    models = sorted({i["model"] for i, _ in runs})
    colors = {m: f"C{k}" for k, m in enumerate(models)}
    styles = {8: "-", 4: "--", 2: ":"}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, pts in sorted(runs, key=lambda x: (x[0]["model"], -x[0]["n"])):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(i["n"], "-."), marker="o",
                markersize=3, color=colors[i["model"]], label=f"{i['model']} N={i['n']}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("tokens (T)")
    ax.set_ylabel("% of the copy bandwidth (arfuse, auto)")
    card, commit = runs[0][0]["card"], runs[0][0]["commit"]
    ax.set_title(f"arfuse's share of the copy bandwidth, bf16 permuted (emulated on one GPU) — "
                 f"{card}, {commit}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png = out / "copy-bw.png"
    fig.savefig(png, dpi=130)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("set_dir", type=Path)
    p.add_argument("--out", type=Path, help="default: SET/plots")
    ns = p.parse_args(argv)
    out = ns.out or ns.set_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    BR = report_module()
    for png in [*vllm_today_plots(BR, ns.set_dir, out), copy_bw_plot(BR, ns.set_dir, out)]:
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
