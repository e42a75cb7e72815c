"""Result rows, statistics and writers for ``python -m arfuse.bench`` (no torch, no GPU).

A *row* is a dict with the keys of ``CSV_FIELDS``; one per (implementation, token count). Rows
that were not timed (skipped, wrong result, failed) keep ``median_us`` = None and say why in
``note``.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Iterable, Sequence

IMPL_ORDER = ("arfuse", "arfuse_pdl", "arfuse_oneshot", "arfuse_twoshot", "unfused", "vllm_today", "vllm_ops",
              "torch",
              "arfuse_q", "arfuse_sepq",
              "flashinfer_p7", "flashinfer_p1")

IMPL_LABELS = {
    "arfuse": "arfuse (auto)",
    "arfuse_pdl": "arfuse (auto), programmatic dependent launch",
    "arfuse_oneshot": "arfuse one-shot",
    "arfuse_twoshot": "arfuse two-shot",
    "unfused": "unfused (finalize + AR/norm)",
    "vllm_today": "vLLM today (moe_sum + copy + scale/shared + AR/norm)",
    "vllm_ops": "vLLM's kernels (moe_sum + copy + scale/shared + fused_add_rms_norm)",
    "torch": "PyTorch composition",
    "arfuse_q": "arfuse, FP8 output fused",
    "arfuse_sepq": "arfuse + separate FP8 quant kernel",
    "flashinfer_p7": "FlashInfer pattern 7",
    "flashinfer_p1": "finalize + FlashInfer pattern 1",
}

CSV_FIELDS = ("impl", "tokens", "median_us", "p10_us", "p90_us", "ratio_to_unfused",
              "ratio_to_vllm_today", "ratio_to_vllm_ops",
              "bytes_per_rank", "bytes_counted", "gbps", "frac_copy_bw", "algorithm", "timing",
              "replays", "graph_calls", "input_sets", "max_rel_err", "note")


# ---------------------------------------------------------------- statistics

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics (numpy's
    default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} outside [0, 100]")
    xs = sorted(float(v) for v in values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(per_call_us: Sequence[float]) -> dict[str, float]:
    """Median and spread (p10, p90) of per-call times in microseconds."""
    return {"median_us": percentile(per_call_us, 50), "p10_us": percentile(per_call_us, 10),
            "p90_us": percentile(per_call_us, 90), "n": len(per_call_us)}


# ---------------------------------------------------------------- rows

def new_row(impl: str, tokens: int, **kw) -> dict:
    row = {k: None for k in CSV_FIELDS}
    row.update(impl=impl, tokens=int(tokens), note="")
    row.update(kw)
    return row


def finish_rows(rows: list[dict], *, copy_gbps: float | None, ranks_per_gpu: int) -> list[dict]:
    """Fill ratio_to_unfused (and ratio_to_vllm_today where "vLLM today" was timed),
    bytes_counted, gbps and frac_copy_bw (in place; returns rows).

    bytes_counted = bytes_per_rank * ranks_per_gpu: the bytes that went through one GPU's memory
    system per call (ranks_per_gpu = N for an emulated group, 1 under torchrun)."""
    def medians(impl):
        return {r["tokens"]: r["median_us"] for r in rows
                if r["impl"] == impl and r.get("median_us")}
    bases = {b: medians(b) for b in ("unfused", "vllm_today", "vllm_ops")}
    for r in rows:
        med = r.get("median_us")
        for b, times in bases.items():
            base = times.get(r["tokens"])
            r[f"ratio_to_{b}"] = (med / base) if (med and base) else None
        if r.get("bytes_per_rank") is not None:
            r["bytes_counted"] = int(r["bytes_per_rank"]) * int(ranks_per_gpu)
        if med and r.get("bytes_counted"):
            r["gbps"] = r["bytes_counted"] / (med * 1e-6) / 1e9
            r["frac_copy_bw"] = (r["gbps"] / copy_gbps) if copy_gbps else None
        else:
            r["gbps"] = None
            r["frac_copy_bw"] = None
    return rows


def sort_rows(rows: Iterable[dict]) -> list[dict]:
    order = {name: i for i, name in enumerate(IMPL_ORDER)}
    return sorted(rows, key=lambda r: (r["tokens"], order.get(r["impl"], len(order)), r["impl"]))


# ---------------------------------------------------------------- CSV

def _fmt_csv(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def csv_text(rows: Iterable[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), extrasaction="ignore",
                       lineterminator="\n")
    w.writeheader()
    for r in sort_rows(rows):
        w.writerow({k: _fmt_csv(r.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


def write_csv(path, rows: Iterable[dict]) -> None:
    with open(path, "w", newline="") as f:
        f.write(csv_text(rows))


def read_csv(path) -> list[dict]:
    """Rows back from a CSV written by write_csv (numbers parsed, empty cells -> None)."""
    ints = {"tokens", "bytes_per_rank", "bytes_counted", "replays", "graph_calls", "input_sets"}
    out = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            row = {}
            for k in CSV_FIELDS:
                v = rec.get(k, "")
                if v == "" or v is None:
                    row[k] = "" if k == "note" else None
                elif k in ints:
                    row[k] = int(v)
                elif k in ("impl", "algorithm", "timing", "note"):
                    row[k] = v
                else:
                    row[k] = float(v)
            out.append(row)
    return out


# ---------------------------------------------------------------- markdown

def _us(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def markdown_table(rows: Iterable[dict], *, title: str = "", notes: Sequence[str] = (),
                   emulated: bool = False, world_size: int | None = None,
                   copy_gbps: float | None = None, shared_gpu: bool = False) -> str:
    """One line per token count; one column per implementation with the median per-call time in
    microseconds and, in parentheses, the ratio to the baseline (< 1: faster): "vLLM today" where
    it was timed, else the unfused pipeline; then the achieved GB/s of arfuse (auto) and its
    fraction of the measured copy bandwidth."""
    rows = sort_rows(rows)
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
    impls += sorted({r["impl"] for r in rows} - set(impls))
    tokens = sorted({r["tokens"] for r in rows})
    by = {(r["impl"], r["tokens"]): r for r in rows}

    lines = []
    if title:
        lines += [f"## {title}", ""]
    bw_note = ("per-rank bytes x N / median: the N emulated ranks share one GPU's HBM"
               if emulated else
               "per-process bytes / median, against the copy bandwidth each process measured "
               "while the others did (the N processes share one GPU's HBM)"
               if shared_gpu else "per-rank bytes / median (one GPU per rank)")
    # The baseline: vLLM's own kernels where they were timed, else "vLLM today", else unfused.
    timed = {r["impl"] for r in rows if r.get("median_us")}
    ratio_key, base_name = next(
        (f"ratio_to_{b}", name) for b, name in (("vllm_ops", "vLLM's kernels"),
                                                ("vllm_today", "vLLM today"),
                                                ("unfused", "the unfused pipeline"))
        if b in timed or b == "unfused")
    lines.append(f"Median time per call in µs (ratio to {base_name}; < 1 is faster). "
                 f"GB/s for arfuse (auto): {bw_note}"
                 + (f"; % of the measured copy bandwidth ({copy_gbps:,.0f} GB/s)."
                    if copy_gbps else "."))
    if emulated and world_size:
        lines.append(f"Emulated group: {world_size} ranks on one GPU, running concurrently.")
    for n in notes:
        lines.append(n)
    lines.append("")

    head = ["T"] + [IMPL_LABELS.get(i, i) for i in impls]
    has_bw = "arfuse" in impls
    if has_bw:
        head += ["arfuse GB/s", "% copy BW"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---:"] * len(head)) + "|")
    for t in tokens:
        cells = [str(t)]
        for i in impls:
            r = by.get((i, t))
            if r is None or not r.get("median_us"):
                cells.append("skip" if r is not None else "")
                continue
            c = _us(r["median_us"])
            if r.get(ratio_key):
                c += f" ({r[ratio_key]:.2f}×)"
            cells.append(c)
        if has_bw:
            r = by.get(("arfuse", t))
            gbps = r.get("gbps") if r else None
            frac = r.get("frac_copy_bw") if r else None
            cells.append(f"{gbps:,.0f}" if gbps else "")
            cells.append(f"{100 * frac:.0f}%" if frac else "")
        lines.append("| " + " | ".join(cells) + " |")

    skipped = [r for r in rows if not r.get("median_us") and r.get("note")]
    if skipped:
        lines += ["", "Not timed:", ""]
        for r in skipped:
            lines.append(f"- {IMPL_LABELS.get(r['impl'], r['impl'])}, T={r['tokens']}: "
                         f"{r['note']}")
    return "\n".join(lines) + "\n"


def write_markdown(path, rows, **kw) -> None:
    with open(path, "w") as f:
        f.write(markdown_table(rows, **kw))


# ---------------------------------------------------------------- plot

def plot(path, rows: Iterable[dict], *, title: str) -> None:
    """Latency per call vs tokens, log-log, one line per implementation (matplotlib, imported
    here so that --no-plot runs without it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sort_rows(rows)
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
    impls += sorted({r["impl"] for r in rows} - set(impls))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i in impls:
        pts = [(r["tokens"], r["median_us"], r.get("p10_us"), r.get("p90_us"))
               for r in rows if r["impl"] == i and r.get("median_us")]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        style = "-" if i.startswith("arfuse") else "--"
        line, = ax.plot(xs, ys, style, marker="o", markersize=3, label=IMPL_LABELS.get(i, i))
        if all(p[2] is not None and p[3] is not None for p in pts):
            ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts],
                            color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("tokens (T)")
    ax.set_ylabel("time per call (µs, median; band p10-p90)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------- tuning

def pick_crossover(rows: Iterable[dict], *, oneshot: str = "arfuse_oneshot",
                   twoshot: str = "arfuse_twoshot") -> tuple[int, list[str]]:
    """The largest T at which one-shot is faster than two-shot, and warnings.

    A T where two-shot was not timed (e.g. it does not run for T < N) counts as a one-shot win;
    a T where one-shot was not timed counts as a two-shot win. Returns 0 when one-shot never wins.
    Warns when the comparison is not monotone (two-shot faster at some T below the crossover)
    and when one-shot still wins at the largest T measured (the crossover lies beyond)."""
    rows = list(rows)
    one = {r["tokens"]: r["median_us"] for r in rows if r["impl"] == oneshot}
    two = {r["tokens"]: r["median_us"] for r in rows if r["impl"] == twoshot}
    tokens = sorted(set(one) | set(two))
    if not tokens:
        raise ValueError("no one-shot/two-shot rows to pick a crossover from")
    wins = {}
    for t in tokens:
        a, b = one.get(t), two.get(t)
        wins[t] = bool(a) and (not b or a < b)
    winners = [t for t in tokens if wins[t]]
    warnings = []
    if not winners:
        return 0, ["one-shot is never faster over the measured token counts"]
    cross = max(winners)
    losers_below = [t for t in tokens if t < cross and not wins[t]]
    if losers_below:
        warnings.append("not monotone: two-shot was faster at T=" +
                        ",".join(map(str, losers_below)) +
                        f" below the crossover T={cross}; rerun with more --replays or check noise")
    if cross == tokens[-1]:
        warnings.append(f"one-shot still faster at the largest T measured ({cross}); the true "
                        "crossover lies beyond the token list")
    return cross, warnings


def tuning_row(dtype: str, hidden: int, world_size: int, oneshot_max_tokens: int) -> str:
    """One YAML list item for variants/tuning.yaml."""
    return (f"- {{dtype: {dtype}, hidden: {int(hidden)}, world_size: {int(world_size)}, "
            f"oneshot_max_tokens: {int(oneshot_max_tokens)}}}")


def tuning_yaml(*, card: str, date: str, commit: str | None, command: str, rows: Sequence[str],
                warnings: Sequence[str] = (), mode: str = "") -> str:
    """A document in variants/tuning.yaml's shape (card, date YYYY-MM-DD, commit, command,
    thresholds) holding the measured rows."""
    import json

    lines = ["# Measured by python -m arfuse.bench --tune" + (f" ({mode})" if mode else "") +
             "; merge the thresholds rows into variants/tuning.yaml: into its thresholds where this"
             " card is the default table's, else into a card_thresholds section of this card"
             " (card, date, commit and command as below)."]
    lines += [f"# warning: {w}" for w in warnings]
    lines += [f"card: {json.dumps(card or '')}", f"date: {json.dumps(date[:10])}",
              f"commit: {json.dumps(commit or '')}", f"command: {json.dumps(command)}",
              "thresholds:"]
    lines += [f"  {r}" for r in rows]
    return "\n".join(lines) + "\n"
