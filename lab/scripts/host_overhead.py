"""Eager per-call host time of arfuse's public op, for comparing two builds in one run.

    python3 lab/scripts/host_overhead.py [--calls N] [--label NAME]

Measures the host (CPU) time of one eager call of arfuse.moe_finalize_allreduce_rmsnorm —
argument checks in Python and C++, output allocation, launch — as one rank of a real group makes
it: a two-rank group emulated on one GPU (arfuse.testing.LocalGroup(2)), each rank's call made
eagerly on its own stream right after the other's (not through LocalGroup.run, which queues
launches), in the plain, dense and permuted layouts (bf16, hidden 7168, K = 8, shared output,
T = 16). Each call is timed alone with perf_counter_ns; the GPU is synchronised every 32 calls
outside the timed region, so that a full launch queue never blocks a timed call. Prints one JSON
line per layout: median and 10th/90th percentile in microseconds over both ranks' calls.

It uses only API that every build since API version 8 has, so the same script runs against the
package and library of an older tree (PYTHONPATH=<old tree>, ARFUSE_LIBRARY=<old build>).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import arfuse
from arfuse.testing import LocalGroup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="timed calls per layout")
    ap.add_argument("--label", default=os.environ.get("ARFUSE_LABEL", "build"))
    args = ap.parse_args()
    H, K, T = 7168, 8, 16
    P = T * K
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, dtype=torch.float32, generator=g).to(dtype)

    residual, gamma, shared = rand(T, H), rand(H), rand(T, H)
    rows = rand(P, H)
    idx = torch.randperm(P, device=dev, generator=g)[: T * K].view(T, K).to(torch.int32)
    weights = rand(T, K, dtype=torch.float32)
    dense = rand(T, K, H)
    plain = rand(T, H)
    forms = {
        "plain": (plain, {}),
        "dense": (dense, {"expert_weights": weights}),
        "permuted": (rows, {"permuted_idx": idx, "expert_weights": weights}),
    }
    torch.cuda.synchronize()
    with LocalGroup(2, max_tokens=64, hidden=H, dtype=torch.bfloat16) as group:
        for name, (x, kw) in forms.items():
            def step(times):
                for comm, stream in zip(group.comms, group.streams):
                    with torch.cuda.stream(stream):
                        t0 = time.perf_counter_ns()
                        arfuse.moe_finalize_allreduce_rmsnorm(
                            comm, x, residual, gamma, 1e-6, shared_out=shared,
                            routed_scaling=2.5, **kw)
                        times.append(time.perf_counter_ns() - t0)

            for _ in range(200):  # warm-up: kernel load, allocator
                step([])
            torch.cuda.synchronize()
            times: list[int] = []
            for i in range(args.calls):
                if i % 32 == 0:
                    torch.cuda.synchronize()
                step(times)
            torch.cuda.synchronize()
            assert group.status() == [0, 0], f"a communicator reported a timeout: {group.status()}"
            q = statistics.quantiles(times, n=10)
            print(json.dumps({"label": args.label, "layout": name, "calls": len(times),
                              "median_us": statistics.median(times) / 1e3,
                              "p10_us": q[0] / 1e3, "p90_us": q[-1] / 1e3,
                              "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
