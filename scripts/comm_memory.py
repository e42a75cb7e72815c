"""GPU memory a tensor-parallel group's communicators take, measured: for each model of
variants/models.yaml (bf16, its hidden size) and each max_tokens, every rank creates its
Communicator twice -- with the one-shot capacity the vLLM plugin used before (= max_tokens) and
with the one it uses now (arfuse.vllm.communicators.oneshot_capacity: what auto dispatches to
one-shot on this card) -- and the device's free memory (torch.cuda.mem_get_info) is read around
each creation. Run as real processes sharing one GPU, so the drop is every rank's allocation
together; the table gives it per rank beside Communicator.buffer_bytes.

    torchrun --standalone --nproc-per-node N scripts/comm_memory.py [--max-tokens 8192 ...]
        [--models qwen3-30b-a3b,deepseek-v3] [--out FILE.md]

Every rank uses cuda:0 and gloo (ranks sharing one GPU: run it under scripts/mps.sh, or
time-sliced; nothing here waits on a peer's kernel). The table is printed by rank 0.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,deepseek-v3")
    ap.add_argument("--out", default=None, help="also write the table here (rank 0)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    import arfuse
    from arfuse.models import models
    from arfuse.vllm.communicators import oneshot_capacity

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    card = torch.cuda.get_device_name(device)
    by_name = models()

    class Auto:  # the plugin's settings where nothing is forced (ARFUSE_VLLM_* unset)
        oneshot_max_tokens = None
        algorithm = "auto"

    def create(hidden: int, max_tokens: int, cap: int):
        return arfuse.Communicator(None, max_tokens=max_tokens, hidden=hidden,
                                   dtype=torch.bfloat16, oneshot_max_tokens=cap, device=device)

    def measure(hidden: int, max_tokens: int, cap: int) -> tuple[int, int]:
        # a creation preloads its kernels (host::preload): their modules take device memory
        # once per process and stay, so one unmeasured creation goes first
        create(hidden, max_tokens, cap).close()
        torch.cuda.synchronize()
        dist.barrier()
        free0 = torch.cuda.mem_get_info(device)[0]
        dist.barrier()
        comm = create(hidden, max_tokens, cap)
        torch.cuda.synchronize()
        dist.barrier()
        free1 = torch.cuda.mem_get_info(device)[0]
        nbytes = comm.buffer_bytes
        comm.close()
        return (free0 - free1) // world, nbytes

    rows = []
    for name in args.models.split(","):
        m = by_name[name]
        H = m["hidden"]
        for T in args.max_tokens:
            now = oneshot_capacity(Auto, torch.bfloat16, H, world, T, device)
            before = measure(H, T, T)
            after = measure(H, T, now)
            rows.append((name, H, T, now, before, after))
    if rank == 0:
        mib = 1 << 20
        lines = [f"Communicator memory per rank, {world} ranks sharing one {card} "
                 f"(torch.cuda.mem_get_info around each creation; bf16)", "",
                 "| model | hidden | max_tokens | one-shot cap (before → now) | buffer before | "
                 "measured before | buffer now | measured now |",
                 "|---|---|---|---|---|---|---|---|"]
        for name, H, T, now, (mb, bb), (ma, ba) in rows:
            lines.append(f"| {name} | {H} | {T} | {T} → {now} | {bb / mib:.0f} MiB | "
                         f"{mb / mib:.0f} MiB | {ba / mib:.0f} MiB | {ma / mib:.0f} MiB |")
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
