"""One rank of tests/test_gpu_shared.py's creation tests: a real process of a group whose ranks
share one GPU creates a Communicator where the last rank differs from the others (CASE:
max_tokens, hidden, dtype, bad_hidden -- a hidden size no kernel serves, refused by that rank's
comm_create alone -- or none), and reports what happened.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env:// rendezvous), CASE.
Prints "rank R: refused: <message>" or "rank R: created", then "rank R: leftover B bytes" (the
device's free memory before the attempt minus after it, both read once every rank is done, so a
buffer left allocated by any rank shows).
"""

import os
import sys

import torch
import torch.distributed as dist

import arfuse


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    case = os.environ.get("CASE", "none")
    kw = {"max_tokens": 64, "hidden": 2048, "dtype": torch.bfloat16}
    if rank == world - 1:
        kw.update({"max_tokens": {"max_tokens": 128}, "hidden": {"hidden": 4096},
                   "dtype": {"dtype": torch.float16}, "bad_hidden": {"hidden": 2052},
                   "none": {}}[case])
    torch.cuda.synchronize()
    dist.barrier()
    free0 = torch.cuda.mem_get_info(device)[0]
    dist.barrier()
    comm = None
    try:
        comm = arfuse.Communicator(None, device=device, timeout_s=5, **kw)
        print(f"rank {rank}: created", flush=True)
    except ValueError as e:
        print(f"rank {rank}: refused: {e}", flush=True)
    if comm is not None:
        comm.close()
    torch.cuda.synchronize()
    dist.barrier()
    free1 = torch.cuda.mem_get_info(device)[0]
    print(f"rank {rank}: leftover {free0 - free1} bytes", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
