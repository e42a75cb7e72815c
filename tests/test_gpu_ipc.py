"""The real Communicator across processes: 2 processes on one GPU, torch.distributed over gloo,
buffers exchanged as CUDA IPC handles. Contexts of two processes are time-sliced on one GPU, so
this is slow and only checks correctness (never timed)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, seed: int, results):
    import torch.distributed as dist

    import arfuse
    from fused_cases import Case, check_case, make_inputs

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.cuda.set_device(0)
        errs = []
        with arfuse.Communicator(None, max_tokens=64, hidden=2048, dtype=torch.bfloat16,
                                 timeout_s=60.0) as comm:
            for algo in ("oneshot", "twoshot"):
                case = Case(world, 2048, torch.bfloat16, 19, "permuted", 4, "f32", True, 1.0,
                            absent=0.25, algorithm=algo)
                # Every process draws every rank's inputs from the same seed, uses its own.
                ranks, residual, gamma = make_inputs(case, torch.device("cuda"), seed)
                inp = ranks[rank]
                out = arfuse.moe_finalize_allreduce_rmsnorm(
                    comm, inp["expert_out"], residual, gamma, case.eps,
                    permuted_idx=inp["permuted_idx"], expert_weights=inp["expert_weights"],
                    shared_out=inp["shared_out"], algorithm=algo)
                torch.cuda.synchronize()
                # check_case wants every rank's output: gather them over gloo (CPU copies).
                mine = [out[0].cpu(), out[1].cpu()]
                allouts = [None] * world
                dist.all_gather_object(allouts, mine)
                errs.append(check_case(case, [(o[0], o[1]) for o in allouts],
                                       ([{k: v.cpu() for k, v in r.items()} for r in ranks],
                                        residual.cpu(), gamma.cpu())))
            assert comm.status() == 0
        results[rank] = ("ok", errs)
    except BaseException as e:  # report to the parent instead of dying silently
        results[rank] = ("error", repr(e))
    finally:
        dist.destroy_process_group()


def test_two_processes_over_gloo_ipc(lib):
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port = _free_port()
    seed = int.from_bytes(os.urandom(4), "little") >> 1
    procs = [ctx.Process(target=_worker, args=(r, 2, port, seed, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a worker process did not finish within 300 s")
    assert dict(results).keys() == {0, 1}, dict(results)
    for rank in (0, 1):
        status, detail = results[rank]
        assert status == "ok", f"rank {rank}: {detail} (seed {seed})"
