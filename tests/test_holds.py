"""HoldQueue (net/holds.py): submits and boundaries wait while a join is agreed, then run in order."""

from __future__ import annotations

from fttree.net.holds import HoldQueue


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
