"""Joins and restarts run whole in the simulator: `fttree.testing.simulate` drives training loops
through a schedule that mixes link faults, crashes, hangs, restarts and joins, and its oracle
holds every run to exactly-once sums, one result per step, no hang, and admission."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fttree.core.faults import FaultSchedule
from fttree.core.messages import Kind
from fttree.errors import ConfigError, GroupLeft, StepAborted
from fttree.net.node import StepResult
from fttree.testing.simulate import counted, simulate

STEPS = 14


def contributors(run: object, step: int) -> set[tuple[int, ...]]:
    from fttree.testing.simulate import Simulation

    assert isinstance(run, Simulation)
    return {res.contributors for res in run.results(step).values()}


def test_the_operations_guide_example_gives_what_it_says() -> None:
    run = simulate(7, "crash 3 @4; restart 5 @6; join 7 @8; cut 1-0 @2..9", steps=20)
    run.check()
    assert run.results(12)[0].contributors == (0, 1, 2, 4, 5, 6, 7)
    assert run.admitted == {5: 7, 7: 9}


def test_a_restarted_rank_is_evicted_then_admitted_and_contributes_again() -> None:
    run = simulate(5, "restart 2 @3", STEPS)
    run.check()
    assert contributors(run, 2) == {(0, 1, 2, 3, 4)}
    assert contributors(run, 3) == {(0, 1, 3, 4)}  # the old process died in step 3
    start = run.admitted[2]
    assert 3 < start <= 6
    assert contributors(run, start) == {(0, 1, 2, 3, 4)}
    assert run.network.process_of(2) == 1
    new = run.network.nodes[2]
    assert new.joined_at is not None
    assert new.joined_at[0] == start


def test_a_restart_after_a_window_comes_back_once_the_others_passed_it() -> None:
    run = simulate(5, "restart 1 @2..5", STEPS)
    run.check()
    assert all(1 not in c for s in range(2, 6) for cs in [contributors(run, s)] for c in cs)
    assert run.admitted[1] > 5
    assert contributors(run, STEPS - 1) == {(0, 1, 2, 3, 4)}


def test_a_new_rank_joins_a_running_group() -> None:
    run = simulate(5, "join 5 @3; join 6 @3", STEPS)
    run.check()
    assert set(run.admitted) == {5, 6}
    assert contributors(run, STEPS - 1) == {(0, 1, 2, 3, 4, 5, 6)}
    for rank in (5, 6):  # a joiner takes part from its admission on, not before
        assert all((rank, s) not in run.outcomes for s in range(run.admitted[rank]))


def test_the_oracle_catches_a_result_that_is_not_the_sum_of_its_contributors() -> None:
    run = simulate(3, None, 3)
    run.check()
    res = run.outcomes[(1, 1)]
    assert isinstance(res, StepResult)
    res.data[0] += 1.0  # as a contribution added twice would
    with pytest.raises(AssertionError, match="step 1: rank 1's result is not the sum"):
        run.check()


def test_the_oracle_catches_a_step_that_never_finished() -> None:
    run = simulate(3, None, 2)
    run.pending.add((0, 1))
    with pytest.raises(AssertionError, match=r"steps without an outcome .*\(0, 1\)"):
        run.check()


def test_a_contribution_function_is_each_ranks_input() -> None:
    def ones(rank: int, step: int) -> np.ndarray:
        return np.full(4, float(rank == 0), dtype=np.float32)

    run = simulate(4, "crash 3 @2", 5, contribution=ones)
    run.check()
    res = run.results(4)[0]
    assert res.data.tolist() == [1.0] * 4
    assert res.contributors == (0, 1, 2)


def test_restart_join_and_leave_are_refused_outside_the_simulator_naming_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"fttree worker --join.*only the simulator does"):
        FaultSchedule("restart 1 @3", world=4)
    with pytest.raises(ConfigError, match=r"SIGTERM.*leave\(\)"):
        FaultSchedule("leave 1 @3", world=4)
    with pytest.raises(ConfigError, match="a leave happens at one step"):
        FaultSchedule("leave 1 @3..4", world=4, simulated=True)
    with pytest.raises(ConfigError, match="in the world of 4 already"):
        FaultSchedule("join 2 @3", world=4, simulated=True)
    with pytest.raises(ConfigError, match="a join happens at one step"):
        FaultSchedule("join 5 @3..4", world=4, simulated=True)
    with pytest.raises(ConfigError, match=r"new ranks are 4, 5, \.\.\. and join in that order"):
        simulate(4, "join 5 @3", 5)


def test_a_rank_that_leaves_is_in_no_later_result_and_the_group_runs_on_without_a_timeout() -> None:
    run = simulate(5, "leave 2 @4", 8, step_timeout_s=30.0)
    run.check()
    assert run.left == {2: 4}
    assert contributors(run, 3) == {(0, 1, 2, 3, 4)}
    assert all(c == {(0, 1, 3, 4)} for c in (contributors(run, s) for s in range(4, 8)))
    assert "rank 2 left the group" in str(run.network.nodes[2].stopped)
    # a graceful leave is no failure: the others wait for no deadline (30 s here) at step 4
    assert max(run.network.finished_at[(r, 4)] for r in (0, 1, 3, 4)) < 2.0


def test_the_oracle_catches_a_rank_that_left_but_still_counts() -> None:
    run = simulate(5, "leave 2 @4", 6)
    run.left[2] = 3  # pretend it left before step 3, which it took part in
    with pytest.raises(AssertionError, match=r"rank 2 left before step 3 but is in the results of steps \[3"):
        run.check()


def test_a_minority_cut_off_gets_errors_not_results_and_nothing_hangs() -> None:
    run = simulate(5, "partition 3,4 @2..", 6)
    run.check()
    for rank in (3, 4):
        assert all(isinstance(run.outcomes[(rank, s)], (StepAborted, GroupLeft)) for s in range(2, 6))
    assert contributors(run, 5) == {(0, 1, 2)}


def test_members_fenced_by_a_coordinator_that_is_gone_find_out_and_stop() -> None:
    """Rank 0 coordinates a view change and stops as a minority; ranks 2 (stopped meanwhile) and
    3 (its link to rank 0 cut) promised nothing it could count and stay fenced with a step held
    back. They watch the members while fenced, find no majority either, and that step fails:
    before, it waited for ever."""
    run = simulate(5, "crash 1 @1; hang 2 @1..1; cut 0-3 @0..1", 4, seed=0, jitter_s=0.002)
    run.check()
    for rank in (2, 3):
        assert isinstance(run.outcomes[(rank, 2)], StepAborted)


def test_a_member_fenced_with_no_coordinator_in_reach_stops_within_a_bounded_wait() -> None:
    """Rank 1 restarts while rank 3's link to rank 0 is cut: ranks 0 and 2 find no majority and
    stop; rank 3, fenced, reaches no coordinator and no majority. Its step fails after a
    bounded wait (MAX_STALLS stall deadlines), naming why, instead of never."""
    run = simulate(4, "restart 1 @1; cut 0-3 @0..1", 4, seed=0, jitter_s=0.002)
    run.check()
    out = run.outcomes[(3, 1)]
    assert isinstance(out, StepAborted)
    assert "did not finish within 12 s and this rank could reach no majority" in str(out)


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, str, int]:
    """A world and a schedule that mixes every kind: at most two ranks fail, restart or leave (a
    majority stays), up to two new ranks join, up to two links fail for a while."""
    world = draw(st.integers(4, 7))
    rules: list[str] = []
    struck = draw(st.lists(st.integers(1, world - 1), max_size=2 if world >= 5 else 1, unique=True))
    for rank in struck:
        kind = draw(st.sampled_from(["crash", "hang", "restart", "restart-late", "leave"]))
        at = draw(st.integers(1, STEPS - 6))
        if kind == "hang":
            rules.append(f"hang {rank} @{at}..{at + draw(st.integers(0, 3))}")
        elif kind == "restart-late":
            rules.append(f"restart {rank} @{at}..{at + draw(st.integers(1, 3))}")
        else:
            rules.append(f"{kind} {rank} @{at}")
    joins = sorted(draw(st.lists(st.integers(1, STEPS - 6), max_size=2)))
    rules += [f"join {world + i} @{at}" for i, at in enumerate(joins)]
    for _ in range(draw(st.integers(0, 2))):
        a, b = draw(st.lists(st.integers(0, world - 1), min_size=2, max_size=2, unique=True))
        first = draw(st.integers(0, STEPS - 4))
        rules.append(f"cut {a}-{b} @{first}..{first + draw(st.integers(0, 4))}")
    return world, "; ".join(rules), draw(st.integers(0, 2**16))


EXAMPLES = int(os.environ.get("FTTREE_SIM_EXAMPLES", "300"))  # about 0.1 s each on one core


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_random_schedules_of_faults_restarts_joins_and_leaves_hold_the_oracle(case: tuple[int, str, int]) -> None:
    world, faults, seed = case
    run = simulate(world, faults, STEPS, seed=seed, jitter_s=0.002, contribution=counted(4))
    try:
        run.check()
    except AssertionError as exc:
        raise AssertionError(f"simulate({world}, {faults!r}, {STEPS}, seed={seed}, jitter_s=0.002): {exc}") from None


@pytest.mark.parametrize("world", [15, 31])
def test_a_restart_asks_each_member_a_few_times_not_once_per_answer(world: int) -> None:
    """A restarted process asks every member to admit it; it asks again at once only when an
    answer brings news (the group found or changed). Asking again after every answer made each
    restart cost p(p - 1) JOIN frames (930 at 31 ranks); here it stays a few per member."""
    quiet = simulate(world, None, 12, wire=False, quick_start=True)
    run = simulate(world, "restart 2 @3", 12, wire=False, quick_start=True)
    run.check()
    assert 2 in run.admitted
    joins = run.network.stats.by_kind[Kind.JOIN] - quiet.network.stats.by_kind[Kind.JOIN]
    assert 0 < joins <= 6 * world, joins
