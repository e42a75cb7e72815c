"""One rank of tests/test_dist_cpu.py's creation-agreement test: a real process of a two-rank gloo
group on the CPU creates a Communicator where every rank's comm_create fails, each for its own
reason (rank 0: a CPU device at world size 2; the last rank also a hidden size no kernel serves,
which comm_create checks first), and prints what it raised. The GPU topology (local_topology
needs CUDA) is a stand-in: every rank reports the same GPU; nothing else is.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env:// rendezvous).
Prints "rank R: refused: <message>" or "rank R: created".
"""

import sys

import torch
import torch.distributed as dist

import arfuse
from arfuse import comm as _comm


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _comm.local_topology = lambda device: {"host": "h", "hostname": "h", "gpu": "GPU-0",
                                            "bus": "0000:00:00", "access": {"GPU-0": True}}
    hidden = 2052 if rank == world - 1 else 2048
    try:
        arfuse.Communicator(None, max_tokens=16, hidden=hidden, dtype=torch.bfloat16,
                            device="cpu")
        print(f"rank {rank}: created", flush=True)
    except ValueError as e:
        print(f"rank {rank}: refused: {e}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
