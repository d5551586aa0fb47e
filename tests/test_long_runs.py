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
