"""The life cycle's transition table: every move it allows, and a named error for the rest."""

from __future__ import annotations

import itertools

import pytest

from fttree.core.lifecycle import TRANSITIONS, Life, Lifecycle, LifecycleError, Phase
from fttree.testing.simulate import simulate


def test_a_first_start_a_join_and_a_leave_walk_the_table() -> None:
    first = Lifecycle()
    assert [first.on(e) for e in (Life.FIRST_START, Life.CONNECTED, Life.LEAVE, Life.STOP)] == [
        Phase.CONNECTING, Phase.ACTIVE, Phase.LEAVING, Phase.STOPPED]
    restart = Lifecycle()
    assert [restart.on(e) for e in (Life.GROUP_FOUND, Life.ADMITTED, Life.CONNECTED)] == [
        Phase.ASKING, Phase.ADMITTED, Phase.ACTIVE]
    assert Lifecycle(join=True).phase is Phase.ASKING


@pytest.mark.parametrize(("phase", "event"), [
    (p, e) for p, e in itertools.product(Phase, Life) if (p, e) not in TRANSITIONS])
def test_a_move_the_table_lacks_is_an_error_naming_phase_and_event(phase: Phase, event: Life) -> None:
    life = Lifecycle()
    life.phase = phase
    with pytest.raises(LifecycleError, match=f"{event.name} .* cannot happen in phase {phase.value}"):
        life.on(event)
    assert life.phase is phase


def test_any_phase_can_stop_and_stopped_is_for_good() -> None:
    assert all(TRANSITIONS[(p, Life.STOP)] is Phase.STOPPED for p in Phase)
    assert {e for (p, e) in TRANSITIONS if p is Phase.STOPPED} == {Life.STOP}


def test_simulated_processes_end_where_the_table_says() -> None:
    run = simulate(5, "restart 2 @2; join 5 @3; isolate 4 @6..", 9)
    run.check()
    phases = {n.rank: n.replica.phase for n in run.network.nodes}
    assert phases == {0: Phase.ACTIVE, 1: Phase.ACTIVE, 2: Phase.ACTIVE, 3: Phase.ACTIVE, 4: Phase.STOPPED,
                      5: Phase.ACTIVE}
    assert [n.rank for n in run.network.nodes if n.joining] == [2, 5]  # the restart, the new rank
