"""A model of the one-shot kernel's cluster exchange (row_reduce in csrc/arfuse/kernel.cuh,
docs/design.md), run under random interleavings on the CPU.

C CTAs of a cluster run the same R reductions over their kTpb tokens. Reduction n uses buffer
b = n % 2: each CTA arms its own mbarrier bar[b] (one arrival, expecting kTpb * C * 4 bytes), each
token's first thread sends the CTA's value into slot[b][g][me] of every CTA with st.async, which
completes 4 bytes on that CTA's bar[b] when it lands (deliveries are asynchronous: they land
later, in any order), then every thread waits until the phase of bar[b] with parity (n // 2) % 2
has completed and reads slot[b][g][0..C). A __syncthreads separates one reduction's reads from
the next one's arming and sends (the kernel's warp-partial barrier). Before its first send a CTA
waits on the cluster barrier every CTA arrived on after initialising its mbarriers.

The mbarrier follows PTX: a phase completes when its pending arrival count and its tx-count are
both zero; complete-tx may come before expect-tx (the tx-count goes negative meanwhile); a
completed phase starts the next with the arrival count reset and tx-count zero.

Checked: every read sees exactly the value its sender computed for that reduction and token, every
reduction completes (no CTA waits forever), and no st.async lands on an mbarrier that is not
initialised. A control with one buffer and one mbarrier (no alternation) must be caught.
"""

from __future__ import annotations

import random

import pytest


class Bar:
    """One mbarrier: current phase, pending arrivals, tx-count."""

    def __init__(self, arrivals: int):
        self.count = arrivals
        self.phase = 0
        self.pending = arrivals
        self.tx = 0

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive_expect_tx(self, nbytes: int):
        self.tx += nbytes
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._maybe_complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._maybe_complete()

    def phase_done(self, parity: int) -> bool:
        """try_wait.parity: has the phase with this parity completed (the current phase's parity
        differs from it)?"""
        return (self.phase % 2) != parity


def run(C: int, tpb: int, R: int, seed: int, buffers: int = 2, max_steps: int = 200_000):
    rng = random.Random(seed)
    nbuf = buffers
    bars = [[None] * nbuf for _ in range(C)]            # None until initialised
    slots = [[[[None] * C for _ in range(tpb)] for _ in range(nbuf)] for _ in range(C)]
    in_flight = []  # (dst cta, buffer, token, src cta, value)
    cluster_arrived = [False] * C

    def value(n, cta, g):
        return ("v", n, cta, g)

    # Each CTA: a list of steps; the steps of one reduction between two __syncthreads may run in
    # any order among themselves (different threads), so they are shuffled per CTA.
    def program(cta):
        steps = [("init",), ("arrive_cluster",)]
        for n in range(R):
            b = n % nbuf
            phase_steps = [("arm", n, b)] + [("send", n, b, g) for g in range(tpb)]
            rng.shuffle(phase_steps)
            if n == 0:
                steps.append(("wait_cluster",))
            steps += phase_steps
            steps.append(("wait", n, b, (n // nbuf) % 2))
            steps += [("read", n, b, g) for g in range(tpb)]
            steps.append(("sync",))
        return steps

    progs = [program(c) for c in range(C)]
    pc = [0] * C
    errors = []
    for _ in range(max_steps):
        ready = []
        for c in range(C):
            if pc[c] >= len(progs[c]):
                continue
            st = progs[c][pc[c]]
            if st[0] == "wait_cluster" and not all(cluster_arrived):
                continue
            if st[0] == "wait":
                _, n, b, parity = st
                if not bars[c][b].phase_done(parity):
                    continue
            ready.append(("cta", c))
        if in_flight:
            ready += [("land", i) for i in range(len(in_flight))]
        if not ready:
            break
        kind, i = rng.choice(ready)
        if kind == "land":
            dst, b, g, src, v = in_flight.pop(i)
            if bars[dst][b] is None:
                errors.append(f"st.async into CTA {dst}'s uninitialised mbarrier")
                continue
            slots[dst][b][g][src] = v
            bars[dst][b].complete_tx(4)
            continue
        c = i
        st = progs[c][pc[c]]
        pc[c] += 1
        op = st[0]
        if op == "init":
            bars[c] = [Bar(1) for _ in range(nbuf)]
        elif op == "arrive_cluster":
            cluster_arrived[c] = True
        elif op == "arm":
            bars[c][st[2]].arrive_expect_tx(tpb * C * 4)
        elif op == "send":
            _, n, b, g = st
            for dst in range(C):
                in_flight.append((dst, b, g, c, value(n, c, g)))
        elif op == "read":
            _, n, b, g = st
            got = slots[c][b][g]
            want = [value(n, src, g) for src in range(C)]
            if got != want:
                errors.append(f"CTA {c} reduction {n} token {g}: read {got}, want {want}")
    unfinished = [c for c in range(C) if pc[c] < len(progs[c])]
    if unfinished:
        errors.append(f"CTAs {unfinished} never finished (stuck at "
                      f"{[progs[c][pc[c]] for c in unfinished]})")
    return errors


@pytest.mark.parametrize("C,tpb,R", [(2, 1, 6), (4, 1, 7), (4, 2, 5), (8, 1, 4), (2, 4, 6)])
def test_exchange_reads_each_reduction_exactly(C, tpb, R):
    seed0 = random.randrange(1 << 30)  # fresh interleavings every run; the seed is in the message
    for k in range(300):
        errors = run(C, tpb, R, seed0 + k)
        assert not errors, f"seed {seed0 + k}: {errors[:3]}"


def test_one_buffer_control_is_caught():
    """Without the alternation (one mbarrier, one slot buffer), a CTA that finished reduction n
    sends reduction n + 1 into a peer still waiting for n: some interleaving must show it."""
    seed0 = random.randrange(1 << 30)
    caught = sum(1 for k in range(400) if run(4, 1, 6, seed0 + k, buffers=1))
    assert caught > 0, f"seeds {seed0}..{seed0 + 399}: the one-buffer control was never caught"
