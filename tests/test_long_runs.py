"""Long runs: nothing the protocol or its driver keeps may grow with the number of ops run.

Issue 10: the retired-op bookkeeping was limited in ops but pruned by steps, so with many chunks
per step it never shrank and every retire rescanned it. These tests count what the nodes hold
(deterministic), never how long it took.
"""

from __future__ import annotations

import numpy as np

from fttree import StepResult
from fttree.testing.sim import SimNetwork

CHUNKS = 25  # one int64 per 8-byte chunk


def run_steps(net: SimNetwork, first: int, steps: int) -> None:
    world = net.world
    for step in range(first, first + steps):
        for rank in range(world):
            net.submit(rank, step, np.full(CHUNKS, rank + 1, np.int64))
        net.run_until_finished(step)
        for rank in range(world):
            out = net.outcome(rank, step)
            assert isinstance(out, StepResult), f"rank {rank} step {step}: {out}"
            assert np.array_equal(out.data, np.full(CHUNKS, world * (world + 1) // 2))
        net.results.clear()  # the test's own record, not the nodes'
        net.finished_at.clear()
        net.notes.clear()


def test_bookkeeping_stays_bounded_over_many_thousand_ops() -> None:
    """6,000 ops (240 steps of 25 chunks) through 3 nodes, six times the retired-op limit: that
    memory stays at its limit, and nothing else a node keeps grows with the history."""
    net = SimNetwork(3, chunk_bytes=8, retired_memory=1000, wire=False)  # the codec is not under test here
    run_steps(net, 0, 60)
    net.run()  # let finished ops linger out, as between steps of a long job
    early = [n.footprint() for n in net.nodes]
    run_steps(net, 60, 180)
    net.run()
    late = [n.footprint() for n in net.nodes]
    for rank, (before, after) in enumerate(zip(early, late, strict=True)):
        assert after["retired"] <= 1000, f"rank {rank} remembers {after['retired']} retired ops (limit 1000)"
        assert after == before, f"rank {rank} bookkeeping grew with history: {before} -> {after}"
        assert after["active_ops"] == 0
        assert after["steps"] == 0
        assert after["watches"] == 0  # every backup watch ended with its op (owes_peers reads this set)


def run_with_a_straggler(net: SimNetwork, first: int, steps: int, late_by_s: float) -> int:
    """Steps in which rank 2 submits `late_by_s` after the others; how many closed without it."""
    closed = 0
    for step in range(first, first + steps):
        start = net.now
        for rank in range(net.world):
            data = np.full(CHUNKS, rank + 1, np.int64)
            if rank == 2:
                net.at(start + late_by_s, lambda d=data, s=step: net.submit(2, s, d, closable=True))
            else:
                net.submit(rank, step, data, closable=True)
        net.run_until_finished(step)
        out = net.outcome(0, step)
        assert isinstance(out, StepResult)
        closed += out.late == (2,)
        net.results.clear()
        net.finished_at.clear()
        net.notes.clear()
    return closed


def test_a_straggler_late_in_every_step_leaves_nothing_growing() -> None:
    """straggler_policy="deadline" over 120 steps of 25 chunks with rank 2 late in every one:
    every step closes without it, and what the nodes keep (the late rank's closed steps, the
    per-member late counts, the ops) stays the same from step 70, past the cap of 64 closed
    steps kept, to step 120."""
    net = SimNetwork(3, chunk_bytes=8, retired_memory=1000, wire=False, straggler_policy="deadline",
                     straggler_grace_s=0.05)
    assert run_with_a_straggler(net, 0, 70, 0.3) == 70
    net.run()
    early = [n.footprint() for n in net.nodes]
    assert run_with_a_straggler(net, 70, 50, 0.3) == 50
    net.run()
    late = [n.footprint() for n in net.nodes]
    assert early == late, (early, late)
    assert late[2]["closed_steps"] == 64  # at most CLOSE_AHEAD_STEPS: the oldest, long taken, are forgotten
    assert net.nodes[0].status().late_total == {2: 120}
    assert net.nodes[0].status().late_streak == {2: 120}
