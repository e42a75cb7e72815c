"""A model of the kernel's cross-rank protocol (csrc/arfuse/kernel.cuh, docs/design.md), run under
random interleavings on the CPU.

N ranks run the same sequence of calls (token count and algorithm may change from call to
call). Each rank owns three slots of Lamport buffer, all sentinel at the start; call c of a rank
uses slot c % 3. A call's blocks stride over token chunks like the kernel's persistent grid, and
each block does its phases in order:

  one-shot: push the partial of each of its tokens into every rank's slot at [t][r]; then read
            its own [t][0..N) (waiting while a sentinel is there) and reset each to the sentinel;
  two-shot: push each token's partial to its owner at [t_local][r] (not the owner's own: it
            keeps its partials in registers); then, for the owner's tokens, read [t_local][n]
            for every peer n, reset, and push the sum into every peer's gather area at [t]; then
            read its gather rows [t] of the other owners' tokens and reset them.

Two-shot work is split into items (csrc/arfuse/kernel.cuh, TwoShotItems): item w = o * chunks + c
is chunk c of owner o's tokens, and block b takes items b, b + G, ... in all three phases (phase 2:
those of its own rank), so block b only waits for blocks b of its peers. `mapping="legacy"` is
the earlier kernel (phases 1 and 3 strided over tokens, phase 2 over the owner's tokens), kept
as a control.

A rank starts call c + 1 only when every block of call c has finished (stream order). Only
`resident` blocks of a rank run at a time, dispatched in index order (a GPU busy with other work,
or a grid larger than what fits): the model checks that no wait depends on a block that cannot
be dispatched. The scheduler picks any step that can run. Checked: every value read is the one its sender wrote for
that call and token (no stale data from an earlier call, no data of a later call), every call
ends (no deadlock), and after the last call every slot is all sentinel again. A control run with
one slot must be caught, so the check can fail.
"""

from __future__ import annotations

import random

import pytest

SENT = None


class Rank:
    def __init__(self, r: int, world: int, slots: int, size: int):
        self.r = r
        self.world = world
        self.buf = [[SENT] * size for _ in range(slots)]
        self.call = 0  # index of the call in progress (or the next one)
        self.blocks: list[list] = []  # per block: remaining steps of the current call


def partial(call: int, sender: int, t: int) -> tuple:
    return ("partial", call, sender, t)


def build_call(rank: Rank, call: int, T: int, algo: str, grid: int, N: int, slots: int,
               mapping: str = "items"):
    """The steps of one call, per block, in the order a block executes them."""
    slot = call % slots
    per = -(-T // N)
    blocks = [[] for _ in range(grid)]
    for b in range(grid):
        mine = list(range(b, T, grid))
        if algo == "oneshot":
            for t in mine:
                for q in range(N):
                    blocks[b].append(("write", q, slot, t * N + rank.r, partial(call, rank.r, t)))
            for t in mine:
                for n in range(N):
                    blocks[b].append(("read", slot, t * N + n, partial(call, n, t)))
        elif mapping == "items":
            # one token per chunk (tokens_per_block 1): item w = owner * per + local
            items = []
            for w in range(b, per * N, grid):
                owner, local = divmod(w, per)
                t = owner * per + local
                if t < T:
                    items.append((owner, local, t))
            # the owner keeps its own partial and its own gathered row in registers: nothing of
            # its own tokens goes through its buffer, and it does no phase 3 for them
            for owner, local, t in items:
                if owner != rank.r:
                    blocks[b].append(("write", owner, slot, local * N + rank.r, partial(call, rank.r, t)))
            for owner, local, t in items:
                if owner != rank.r:
                    continue
                for n in range(N):
                    if n != rank.r:
                        blocks[b].append(("read", slot, local * N + n, partial(call, n, t)))
                for q in range(N):
                    if q != rank.r:
                        blocks[b].append(("write", q, slot, per * N + t, ("sum", call, t)))
            for owner, local, t in items:
                if owner != rank.r:
                    blocks[b].append(("read", slot, per * N + t, ("sum", call, t)))
        else:  # legacy
            for t in mine:
                owner, local = divmod(t, per)
                blocks[b].append(("write", owner, slot, local * N + rank.r, partial(call, rank.r, t)))
            first = rank.r * per
            count = max(0, min(per, T - first))
            for local in range(b, count, grid):
                t = first + local
                for n in range(N):
                    blocks[b].append(("read", slot, local * N + n, partial(call, n, t)))
                for q in range(N):
                    blocks[b].append(("write", q, slot, per * N + t, ("sum", call, t)))
            for t in mine:
                blocks[b].append(("read", slot, per * N + t, ("sum", call, t)))
    rank.blocks = [blk for blk in blocks if blk]


def simulate(calls, N: int, slots: int, grid: int, seed: int, max_tokens: int,
             resident: int | list[int] | None = None, mapping: str = "items"):
    # blocks of each rank that run at once (one count for every rank, or one per rank)
    resident = grid if resident is None else resident
    per_rank = resident if isinstance(resident, list) else [resident] * N
    rng = random.Random(seed)
    size = max(N * max_tokens, -(-max_tokens // N) * N + max_tokens)
    ranks = [Rank(r, N, slots, size) for r in range(N)]
    for rank in ranks:
        build_call(rank, 0, *calls[0], grid, N, slots, mapping)
    while True:
        runnable = []
        for rank in ranks:
            if rank.call >= len(calls):
                continue
            for bi, blk in enumerate(rank.blocks[:per_rank[rank.r]]):  # in index order
                step = blk[0]
                if step[0] == "read" and rank.buf[step[1]][step[2]] is SENT:
                    continue  # waiting for a peer
                runnable.append((rank, bi))
        if not runnable:
            if all(rank.call >= len(calls) for rank in ranks):
                break
            raise AssertionError("deadlock: every unfinished rank waits for data")
        rank, bi = rng.choice(runnable)
        step = rank.blocks[bi].pop(0)
        if step[0] == "write":
            _, q, slot, pos, value = step
            if ranks[q].buf[slot][pos] is not SENT:
                raise AssertionError(f"rank {rank.r} overwrote unread data at rank {q} slot {slot} "
                                     f"pos {pos}: {ranks[q].buf[slot][pos]} with {value}")
            ranks[q].buf[slot][pos] = value
        else:
            _, slot, pos, want = step
            got = rank.buf[slot][pos]
            if got != want:
                raise AssertionError(f"rank {rank.r} read {got} at slot {slot} pos {pos}, want {want}")
            rank.buf[slot][pos] = SENT  # reset right after reading
        if not rank.blocks[bi]:
            rank.blocks.pop(bi)
        if not rank.blocks:  # the call's last block finished: the next call may start
            rank.call += 1
            if rank.call < len(calls):
                build_call(rank, rank.call, *calls[rank.call], grid, N, slots, mapping)
    for rank in ranks:
        for s, slot in enumerate(rank.buf):
            assert all(v is SENT for v in slot), f"rank {rank.r} slot {s} not clean at the end"


def random_calls(rng: random.Random, n_calls: int, max_tokens: int):
    return [(rng.choice([t for t in (1, 2, 3, 5) if t < max_tokens] + [max_tokens]),
             rng.choice(["oneshot", "twoshot"]))
            for _ in range(n_calls)]


@pytest.mark.parametrize("N", [2, 3, 4])
@pytest.mark.parametrize("seed", range(40))
def test_protocol_under_random_interleavings(N, seed):
    rng = random.Random(1000 * N + seed)
    max_tokens = 6
    calls = random_calls(rng, 8, max_tokens)
    grid = rng.choice([1, 2, 3, 4])
    simulate(calls, N, slots=3, grid=grid, seed=seed, max_tokens=max_tokens)


@pytest.mark.parametrize("N", [2, 3, 4])
@pytest.mark.parametrize("seed", range(30))
def test_no_wait_needs_a_block_that_is_not_resident(N, seed):
    """Fewer blocks resident than the grid has (other kernels on the SMs): every call still ends."""
    rng = random.Random(7000 * N + seed)
    max_tokens = 7
    calls = random_calls(rng, 6, max_tokens)
    grid = rng.choice([2, 3, 4])
    simulate(calls, N, slots=3, grid=grid, seed=seed, max_tokens=max_tokens,
             resident=rng.randint(1, grid - 1))
    # one busy GPU: a single rank short of resident blocks, the others complete
    busy = [grid] * N
    busy[rng.randrange(N)] = rng.randint(1, grid - 1)
    simulate(calls, N, slots=3, grid=grid, seed=seed, max_tokens=max_tokens, resident=busy)


def test_the_model_catches_the_legacy_two_shot_mapping():
    """The earlier two-shot kernel (phase 2 strided over the owner's tokens, so block b waited for
    peers' blocks of other indices) deadlocks when fewer blocks are resident than the grid has."""
    deadlocks = 0
    for seed in range(50):
        try:
            simulate([(6, "twoshot")] * 3, 2, slots=3, grid=4, seed=seed, max_tokens=6,
                     resident=1, mapping="legacy")
        except AssertionError as e:
            assert "deadlock" in str(e)
            deadlocks += 1
    assert deadlocks > 0
    for seed in range(50):  # the kernel's mapping, same calls: no deadlock
        simulate([(6, "twoshot")] * 3, 2, slots=3, grid=4, seed=seed, max_tokens=6, resident=1)


def test_two_slots_are_enough():
    for seed in range(100):
        rng = random.Random(seed)
        simulate(random_calls(rng, 8, 5), 3, slots=2, grid=2, seed=seed, max_tokens=5)


def test_the_model_catches_a_broken_protocol():
    """With one slot, a fast rank writes its next call's data before a slow one has read the
    current call's: the check must fail for some interleaving."""
    failures = 0
    for seed in range(200):
        rng = random.Random(seed)
        try:
            simulate(random_calls(rng, 6, 4), 3, slots=1, grid=2, seed=seed, max_tokens=4)
        except AssertionError:
            failures += 1
    assert failures > 0
