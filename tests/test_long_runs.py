"""Long runs: nothing the protocol keeps may grow with the number of ops it has run.

Issue 10: the retired-op bookkeeping was limited in ops but pruned by steps, so with many chunks
per step it never shrank and every retire rescanned it. These tests count what the machine
holds (deterministic), never how long it took.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fttree.core.protocol import Complete
from fttree.testing.sim import SimNetwork

CHUNKS = 25


def run_steps(net: SimNetwork, first: int, steps: int) -> None:
    world = net.world
    for step in range(first, first + steps):
        for chunk in range(CHUNKS):
            for rank in range(world):
                net.submit(rank, step, np.full(4, rank + 1, np.int64), chunk=chunk)
        net.run()
        for rank in range(world):
            out = net.outcome(rank, step, CHUNKS - 1)
            assert isinstance(out, Complete), f"rank {rank} step {step}: {out}"
            assert np.array_equal(out.result, np.full(4, world * (world + 1) // 2))
        net.results.clear()  # the test's own record, not the machines'
        net.finished_at.clear()
        net.notes.clear()


def test_bookkeeping_stays_bounded_over_many_thousand_ops() -> None:
    """10,000 ops (400 steps of 25 chunks) through 3 machines: the retired-op memory stays at
    its limit and is a bounded structure, whatever the history."""
    net = SimNetwork(3)
    for machine in net.machines:
        machine.cfg = dataclasses.replace(machine.cfg, retired_memory=1000)
    run_steps(net, 0, 100)
    early = [m.footprint() for m in net.machines]
    run_steps(net, 100, 300)
    late = [m.footprint() for m in net.machines]
    for rank, (before, after) in enumerate(zip(early, late, strict=True)):
        assert after["retired"] <= 1000, f"rank {rank} remembers {after['retired']} retired ops (limit 1000)"
        assert after == before, f"rank {rank} bookkeeping grew with history: {before} -> {after}"
        assert after["active_ops"] == 0
