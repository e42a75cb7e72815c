"""One rank of tests/test_gpu_shared.py's creation tests: a real process of a group whose ranks
share one GPU creates a Communicator where the last rank differs from the others (CASE:
max_tokens, hidden, dtype, bad_hidden -- a hidden size no kernel serves, refused by that rank's
comm_create alone -- or none), and reports what happened.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env:// rendezvous), CASE.
The attempt is made twice. The first loads the kernels a creation preloads (host::preload: their
modules take device memory once per process and stay). The second is measured: prints "rank R:
refused: <message>" or "rank R: created", then "rank R: leftover B bytes" (the device's free
memory before the second attempt minus after it, both read once every rank is done, so a buffer
left allocated by any rank shows), and "rank R: same outcome twice" when both attempts agree.
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
    def attempt() -> str:
        comm = None
        try:
            comm = arfuse.Communicator(None, device=device, timeout_s=5, **kw)
            outcome = "created"
        except ValueError as e:
            outcome = f"refused: {e}"
        if comm is not None:
            comm.close()
        torch.cuda.synchronize()
        dist.barrier()
        return outcome

    first = attempt()  # loads the modules; not measured
    torch.cuda.synchronize()
    dist.barrier()
    free0 = torch.cuda.mem_get_info(device)[0]
    dist.barrier()
    second = attempt()
    free1 = torch.cuda.mem_get_info(device)[0]
    print(f"rank {rank}: {second}", flush=True)
    print(f"rank {rank}: leftover {free0 - free1} bytes", flush=True)
    if first == second:
        print(f"rank {rank}: same outcome twice", flush=True)
    else:
        print(f"rank {rank}: first attempt differed: {first}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
