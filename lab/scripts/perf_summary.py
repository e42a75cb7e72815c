#!/usr/bin/env python3
"""Summarise a folder of `python -m arfuse.bench` runs against the targets of issue 4.

    python3 lab/scripts/perf_summary.py BENCH_DIR [--md OUT.md]

Reads every */bench_*.csv (and its .json) under BENCH_DIR and prints, per run: the per-T table
of arfuse (auto) / one-shot / two-shot / unfused / PyTorch with ratios, the achieved fraction of
the copy bandwidth, and one line per target (met / missed, with the figures). The plain kernel's
and FlashInfer's latencies are the tables of ../shared/research/anchors.md (H200, emulated ranks,
2026-12-02), keyed by (N, H, T).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

# ../shared/research/anchors.md: the plain one-shot kernel (fused) and FlashInfer pattern 7, us.
PLAIN = {(8, 7168): {1: 13.3, 16: 26.0, 64: 76.2, 256: 276, 1024: 1077, 4096: 4300},
         (4, 4096): {1: 6.8, 16: 7.2, 64: 18.1, 256: 68.6, 1024: 251, 4096: 976},
         (2, 2048): {1: 4.2, 16: 4.6, 64: 5.3, 256: 15.9, 1024: 77.3, 4096: 291}}
FLASHINFER = {(2, 2048): {1: 6.9, 16: 7.1, 64: 20.7, 256: 79.5, 1024: 457},
              (4, 4096): {1: 8.1, 16: 9.3, 64: 31.9, 256: 143},
              (4, 2880): {1: 7.7, 16: 8.4},
              (8, 7168): {1: 11.1, 16: 33.1}}


def load(csv_path: Path):
    rows = list(csv.DictReader(open(csv_path)))
    meta_path = csv_path.with_suffix(".json")
    if not meta_path.exists():  # a run cut off: only its checkpointed CSV
        raise FileNotFoundError(f"{csv_path.parent.name}: partial run (no {meta_path.name})")
    meta = json.load(open(meta_path))
    by = {}
    for r in rows:
        if r["median_us"]:
            by[(r["impl"], int(r["tokens"]))] = r
    return rows, meta, by


def f(x):
    return float(x) if x not in (None, "") else None


def summarise(csv_path: Path) -> tuple[str, list[str], list[str]]:
    rows, meta, by = load(csv_path)
    args = meta["args"]
    N, H = int(args["world_size"]), int(args["hidden"])
    name = f"{args.get('model_name') or 'H' + str(H)} N={N}"
    Ts = sorted({int(r["tokens"]) for r in rows})
    met, missed = [], []

    def check(ok, text):
        (met if ok else missed).append(f"{name}: {text}")

    worst_unfused, worst_small, worst_auto = 0.0, 0.0, 0.0
    for T in Ts:
        a, o, t, u = (by.get((i, T)) for i in ("arfuse", "arfuse_oneshot", "arfuse_twoshot",
                                                 "unfused"))
        if not a:
            continue
        au = f(a["median_us"])
        if u:
            ratio = au / f(u["median_us"])
            worst_unfused = max(worst_unfused, ratio)
            if ratio > 1.0:
                check(False, f"T={T}: auto {au:.1f} us > unfused {f(u['median_us']):.1f} us ({ratio:.2f}x)")
            if T <= 64:
                worst_small = max(worst_small, ratio)
                if ratio > 0.8:
                    check(False, f"T={T}: auto/unfused {ratio:.2f} > 0.8")
        if T <= 64 and T in PLAIN.get((N, H), {}):
            r = au / PLAIN[(N, H)][T]
            check(r <= 0.8, f"T={T}: auto {au:.1f} us = {r:.2f}x the plain kernel's {PLAIN[(N, H)][T]} us (target <= 0.8)")
        if T <= 64 and T in FLASHINFER.get((N, H), {}):
            r = au / FLASHINFER[(N, H)][T]
            check(r <= 0.8, f"T={T}: auto {au:.1f} us = {r:.2f}x FlashInfer pattern 7's {FLASHINFER[(N, H)][T]} us (target <= 0.8)")
        if T >= 1024 and a.get("frac_copy_bw"):
            fr = f(a["frac_copy_bw"])
            check(fr >= 0.85, f"T={T}: {fr:.0%} of the copy bandwidth ({f(a['gbps']):,.0f} GB/s, {a['algorithm']}) (target >= 85 %)")
        if o and t:
            best = min(f(o["median_us"]), f(t["median_us"]))
            r = au / best
            worst_auto = max(worst_auto, r)
            if r > 1.05:
                check(False, f"T={T}: auto {au:.2f} us is {100 * (r - 1):.0f} % above the faster algorithm ({best:.2f} us)")
    if worst_unfused and worst_unfused <= 1.0:  # 0: the run had no unfused column (--quant runs)
        check(True, f"auto <= unfused at every T (worst {worst_unfused:.2f}x)")
    if worst_small and worst_small <= 0.8:
        check(True, f"T <= 64: auto <= 0.8x unfused (worst {worst_small:.2f}x)")
    if worst_auto and worst_auto <= 1.05:
        check(True, f"auto within 5 % of the faster algorithm at every T (worst +{100 * (worst_auto - 1):.1f} %)")
    return name, met, missed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench_dir")
    ns = p.parse_args()
    paths = sorted(Path(ns.bench_dir).glob("*/bench_*.csv"))
    if not paths:
        print(f"no bench_*.csv under {ns.bench_dir}", file=sys.stderr)
        return 2
    for pth in paths:
        try:
            name, met, missed = summarise(pth)
        except FileNotFoundError as e:
            print(f"## {e}")
            continue
        print(f"## {name} ({pth.parent.name})")
        for m in met:
            print(f"- met: {m}")
        for m in missed:
            print(f"- MISSED: {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
