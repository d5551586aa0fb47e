"""HoldQueue (net/holds.py): submits and boundaries wait while a join is agreed, then run in order,
or fail when the rank stops."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import numpy as np

from fttree.errors import GroupLeft
from fttree.net.holds import HoldQueue
from fttree.net.steps import StepResult
from fttree.testing.sim import SimNetwork


def test_calls_wait_while_held_and_run_in_order_when_the_hold_is_lifted() -> None:
    holds, ran = HoldQueue(), list[object]()
    assert not holds.defer(lambda: ran.append("now"))  # no hold: the caller runs it at once
    holds.set(True)
    assert holds.defer(lambda: ran.append(1))
    assert holds.defer(lambda: ran.append(2))
    assert ran == []
    assert len(holds) == 2
    holds.set(False)
    assert ran == [1, 2]
    assert len(holds) == 0


def test_a_call_that_holds_again_stops_the_rest_until_the_next_lift() -> None:
    """A boundary released from the queue may start another join's agreement: what came after
    it waits for that one too."""
    holds, ran = HoldQueue(), list[str]()

    def boundary() -> None:
        ran.append("boundary")
        holds.set(True)

    holds.set(True)
    holds.defer(boundary)
    holds.defer(lambda: ran.append("submit"))
    holds.set(False)
    assert ran == ["boundary"]
    holds.set(False)
    assert ran == ["boundary", "submit"]


def test_a_rank_crashed_while_a_join_was_agreed_fails_the_steps_that_waited_for_it() -> None:
    """A rank that crashes (FTTreeAllreduce.crash, fault injection) while a join or pace round
    holds its next training step: what waited must fail with GroupLeft at once. Held instead,
    a bench's killed ranks sat in opt.step() for nine minutes, waiting for a decision their
    stopped node would never take."""
    sim = SimNetwork(3, wire=False)
    node = sim.nodes[2]
    node.holds.set(True)  # as the replica's Hold(on=True) does while a join is agreed
    waited: Future[StepResult] = Future()
    node.submit(0, np.ones(4, dtype=np.float32), "float32[4]", waited)
    assert not waited.done()
    asyncio.run(node.crash("bench: killed"))
    assert isinstance(waited.exception(timeout=0), GroupLeft)
    later: Future[StepResult] = Future()
    node.submit(1, np.ones(4, dtype=np.float32), "float32[4]", later)
    assert isinstance(later.exception(timeout=0), GroupLeft)
