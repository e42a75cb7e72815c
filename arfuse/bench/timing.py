"""How the benchmark times an implementation: the device's copy bandwidth, the one-call correctness
guard against the reference, and CUDA-graph replay timing over the rotated input sets."""

from __future__ import annotations

import torch

from . import byte_counts as BB
from . import report as BR
from .group import Setup, check_comms, local_comms_broken
from .impls import Impl
from .inputs import rel_err


def copy_bandwidth(device, mb: int, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s: (bytes read + bytes written) / median time."""
    n = int(mb) << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        dst.copy_(src)
        e.record()
    torch.cuda.synchronize(device)
    t = BR.percentile([s.elapsed_time(e) for s, e in ev], 50) * 1e-3
    del src, dst
    return 2 * n / t / 1e9


def check_local(setup: Setup, impl: Impl, ref) -> float:
    """Largest relative error over this process's ranks and both outputs of one call."""
    outs = impl.once(0)
    torch.cuda.synchronize(setup.device)
    check_comms(setup, "the correctness check")
    ref_norm, ref_res = ref
    err = 0.0
    for norm, res in outs:
        err = max(err, rel_err(norm, ref_norm), rel_err(res, ref_res))
    return err


def time_impl(setup: Setup, impl: Impl, n_sets: int, G: int) -> tuple[list, str]:
    """This process's replay times in ms (one per timed replay) and the timing mode used.

    Graph mode: warm up eagerly, capture ceil(n_sets / G) graphs of G consecutive calls (graph g
    uses sets g*G .. g*G+G-1, modulo n_sets, so consecutive calls touch different data and the
    graphs together walk all sets), replay each once, then time the replays of
    ``byte_counts.replay_plan`` (at least ``replays``, at least one per graph: the timed replays
    read the whole rotation) round-robin, each between two CUDA events. The caller takes the
    maximum over ranks of each replay (torchrun) and divides by G for the per-call time."""
    a = setup.args
    n_graphs, n_timed = BB.replay_plan(n_sets, G, a.replays)
    seqs = [[(g * G + c) % n_sets for c in range(G)] for g in range(n_graphs)]

    # Warm-up: one call, then the graph's call sequence; a call that timed out (a peer never
    # arrived) breaks the communicator, and the run must not go on queueing calls that will each
    # wait the full timeout.
    impl.enqueue(seqs[0][:1])
    setup.barrier()
    check_comms(setup, "warm-up call")
    for _ in range(max(1, a.warmup)):
        impl.enqueue(seqs[0])
    setup.barrier()
    check_comms(setup, f"warm-up ({G} consecutive calls)")

    mode = a.timing
    graphs = []
    if mode == "graph":
        stream = torch.cuda.Stream(device=setup.device)
        stream.wait_stream(torch.cuda.current_stream(setup.device))
        pool = None
        with torch.cuda.stream(stream):
            for seq in seqs:
                g = torch.cuda.CUDAGraph()
                if pool is None:
                    g.capture_begin(capture_error_mode="thread_local")
                else:
                    g.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    impl.enqueue(seq)
                finally:
                    g.capture_end()
                if pool is None:
                    pool = g.pool()
                graphs.append(g)
        torch.cuda.current_stream(setup.device).wait_stream(stream)
        for g in graphs:  # first launch uploads the graph
            g.replay()

        def step(i):
            graphs[i % n_graphs].replay()
    else:
        def step(i):
            impl.enqueue(seqs[i % n_graphs])

    setup.barrier()
    check_comms(setup, "graph capture and first replays")

    # At most two replays in flight: the GPU never idles, and a call that times out stops the
    # loop instead of every later call waiting the full timeout (graph replays skip the host's
    # broken-communicator check). status() reads host-mapped memory: no sync.
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n_timed)]
    stopped = False
    for i, (s, e) in enumerate(ev):
        if i >= 2:
            ev[i - 2][1].synchronize()
            if local_comms_broken(setup):
                stopped = True
                break
        s.record()
        step(i)
        e.record()
    torch.cuda.synchronize(setup.device)
    if stopped or setup.max_over_ranks([1.0 if local_comms_broken(setup) else 0.0])[0]:
        raise RuntimeError(f"a call timed out during the timed replays (a rank waited "
                           f"{a.comm_timeout:g} s for a peer); not timed")
    ms = [s.elapsed_time(e) for s, e in ev]
    graphs.clear()  # frees the graphs and their memory pool
    return ms, mode
