"""One rank of tests/test_gpu_shared.py's fault runs: a real process of a group whose ranks share
one GPU (gloo for the handle exchange, the real Communicator and CUDA IPC), replaying a captured
CUDA graph of the fused call step after step, as vLLM does, with arfuse.vllm.watch reading the
communicator's error word after every step before the step's output is "returned" (printed).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env:// rendezvous), FAULT (none, sleep
or kill: what the last rank does at step FAULT_AFTER), STEPS, TIMEOUT_S.
Prints "rank R step S ok max|out| M" per returned step; "NAN RETURNED" (exit 9) if a returned
output is not finite.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import arfuse
from arfuse.vllm import watch


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    fault, after = os.environ.get("FAULT", "none"), int(os.environ.get("FAULT_AFTER", "5"))
    steps, timeout_s = int(os.environ.get("STEPS", "20")), float(os.environ.get("TIMEOUT_S", "5"))
    T, H = 16, 2048
    comm = arfuse.Communicator(None, max_tokens=T, hidden=H, dtype=torch.bfloat16, device=device,
                               timeout_s=timeout_s)
    print(f"rank {rank}: {comm!r} ranks_per_device={comm.ranks_per_device}", flush=True)
    watch.watch(comm)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(T, H, generator=g, device=device, dtype=torch.bfloat16)
    residual = torch.randn(T, H, generator=g, device=device, dtype=torch.bfloat16)
    gamma = torch.rand(H, generator=g, device=device, dtype=torch.bfloat16)
    # Each step's own work (the check below) once before any rank's kernel waits: the ranks share
    # one GPU context under MPS, where a first allocation or a lazily loaded kernel on one rank
    # waits for every kernel on the GPU, a peer's spinning one included (docs/multigpu.md).
    out = torch.empty(T, H, device=device, dtype=torch.float32)
    out.copy_(x)
    torch.isfinite(out).all().item()
    out.abs().max().item()
    torch.cuda.synchronize()
    dist.barrier()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up, then capture: every rank the same calls
        arfuse.moe_finalize_allreduce_rmsnorm(comm, x, residual, gamma, 1e-6)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            norm_out, _ = arfuse.moe_finalize_allreduce_rmsnorm(comm, x, residual, gamma, 1e-6)
    torch.cuda.synchronize()
    dist.barrier()
    for step in range(steps):
        if rank == world - 1 and step == after and fault != "none":
            print(f"rank {rank}: {fault} at step {step}", flush=True)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        graph.replay()
        torch.cuda.synchronize()
        watch.check(f"after step {step}")  # what the Worker.execute_model hook does
        out.copy_(norm_out)
        if not torch.isfinite(out).all().item():
            print(f"rank {rank} step {step}: NAN RETURNED", flush=True)
            return 9
        print(f"rank {rank} step {step} ok max|out| {out.abs().max().item():.3f}", flush=True)
    dist.barrier()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
