"""Node failures on the simulated network (real Nodes, in-memory transport, fake clock).

A worker that dies or hangs mid-step is confirmed dead by its neighbours, the others agree on a
view without it (membership.py), and the step finishes on the survivors (lossy forward). The
oracle, for every step: each survivor's result is exactly the sum over the contributors it
reports, survivors of one step agree bit for bit, every view epoch has one membership
everywhere, a result only counts ranks of the view it ran in, and nothing hangs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fttree import FTTreeAllreduce, StepAborted, StepResult
from fttree.core.membership import Installed, confirmed_dead
from fttree.core.view import View
from fttree.errors import GroupLeft, StepRetry
from fttree.testing.sim import SimNetwork

from .conftest import cluster
from .test_protocol_sim import contributions

Event = tuple[float, Callable[[], None]]  # (seconds after the step starts, what happens)


class Run:
    """Steps one after another on a SimNetwork, each checked against the oracle."""

    def __init__(self, net: SimNetwork) -> None:
        self.net = net
        self.views: dict[int, tuple[int, ...]] = {0: tuple(range(net.world))}
        self.step_times: dict[int, float] = {}
        for node in net.nodes:
            node.view_listeners.append(self._installed)

    def _installed(self, inst: Installed) -> None:
        members = self.views.setdefault(inst.view.epoch, inst.view.members)
        assert members == inst.view.members, f"two memberships for view {inst.view.epoch}"

    def step(self, s: int, events: list[Event] = ()) -> dict[int, StepResult | BaseException]:  # type: ignore[assignment]
        net = self.net
        data = contributions(net.world, step=s)
        start = net.now
        for r in range(net.world):
            if r not in net.wire.crashed:
                net.submit(r, s, data[r])
        for delay, fn in events:
            net.at(start + delay, fn)
        net.run_until_finished(s, limit_s=120)
        outcomes = {r: out for r in range(net.world) if (out := net.outcome(r, s)) is not None}
        results = {r: out for r, out in outcomes.items() if isinstance(out, StepResult)}
        survivors = {r for r, node in enumerate(net.nodes) if r not in net.wire.crashed and node.stopped is None}
        agreed = {(out.contributors, out.data.tobytes(), out.epoch) for r, out in results.items() if r in survivors}
        assert len(agreed) <= 1, f"step {s}: survivors disagree: {agreed}"
        for r, out in results.items():
            assert len(set(out.contributors)) == len(out.contributors)
            assert np.array_equal(out.data, sum(data[c] for c in out.contributors)), f"rank {r} step {s}"
            assert set(out.contributors) <= set(self.views[out.epoch]), f"step {s} counts a rank of no view"
        for r, out in outcomes.items():
            if not isinstance(out, StepResult):
                assert str(out), f"rank {r} failed without a reason"
        if results:
            self.step_times[s] = max(net.finished_at[(r, s)] for r in results) - start
        net.run(until=net.now + 0.01)
        return outcomes

    def steps(self, n: int, events: dict[int, list[Event]] | None = None) -> None:
        for s in range(n):
            self.step(s, (events or {}).get(s, []))


def survivors_finished(outcomes: dict[int, StepResult | BaseException], dead: set[int]) -> tuple[int, ...]:
    alive = [r for r in outcomes if r not in dead]
    for r in alive:
        assert isinstance(outcomes[r], StepResult), f"rank {r}: {outcomes[r]}"
    contributors = {out.contributors for r, out in outcomes.items() if r in alive and isinstance(out, StepResult)}
    assert len(contributors) == 1
    return contributors.pop()


# ---- pure pieces ----------------------------------------------------------------------------


def test_a_new_view_fills_each_hole_from_the_last_slot() -> None:
    view = View.initial(7)
    assert view.without([3], 1).members == (0, 1, 2, 6, 4, 5)  # a leaf: the last slot moves in
    assert view.without([0], 1).members == (6, 1, 2, 3, 4, 5)  # the root: likewise
    assert view.without([1, 2], 1).members == (0, 6, 5, 3, 4)
    assert view.without([6], 1).members == (0, 1, 2, 3, 4, 5)  # the last slot itself: nothing moves
    assert view.without([5, 6], 2).epoch == 2


def test_confirmation_needs_two_neighbours_unless_the_others_are_gone() -> None:
    view = View.initial(7)
    everyone = range(7)
    assert confirmed_dead(view, {1: {0, 2, 3, 4}}, everyone) == {1}  # a crash: its neighbours agree
    assert confirmed_dead(view, {1: {0}, 0: {1}}, everyone) == set()  # one cut link: each end suspects the other
    assert confirmed_dead(view, {5: {2}}, everyone) == set()  # one silent link of a leaf
    # a partition {1, 3, 4}: 3 and 4 have one neighbour left on this side, 2, and it suspects them
    assert confirmed_dead(view, {1: {0, 2, 5, 6}, 3: {2}, 4: {2}}, everyone) == {1, 3, 4}
    assert confirmed_dead(view, {1: {0, 2, 3, 4}}, [0]) == set()  # not standing long enough yet


# ---- crashes at different points of a step --------------------------------------------------


@pytest.mark.parametrize("victim", [3, 1, 0], ids=["leaf", "interior", "root"])
@pytest.mark.parametrize("at", [0.0002, 0.0015, 0.003, 0.006], ids=["start", "sent-up", "mid", "after"])
def test_a_crash_anywhere_in_a_step_leaves_the_survivors_with_one_result(victim: int, at: float) -> None:
    net = SimNetwork(7)
    run = Run(net)
    run.steps(2)
    out = run.step(2, [(at, lambda: net.crash(victim))])
    contributors = survivors_finished(out, {victim})
    assert contributors in (tuple(range(7)), tuple(r for r in range(7) if r != victim))
    for s in range(3, 6):  # the tree of the survivors from now on
        later = survivors_finished(run.step(s), {victim})
        assert victim not in later
    views = {net.nodes[r].view for r in range(7) if r != victim}
    assert len(views) == 1
    assert victim not in views.pop().members
    assert max(run.step_times[s] for s in (2, 3)) < 1.0  # detection and one rerun, never a deadline
    assert run.step_times[5] < 0.02  # then a plain step of the survivors


def test_a_step_whose_result_was_committed_reaches_the_dead_ranks_children_by_catch_up() -> None:
    """Rank 1 dies while forwarding the root's result; its children's backups are cut too, so
    only the commit's catch-up plan can bring them the result (which counts rank 1: it gave)."""
    net = SimNetwork(7)
    run = Run(net)
    run.steps(1)

    def slow_down() -> None:  # after the root finalized (2 ms in), before rank 1 forwards (3 ms)
        for child in (3, 4):
            net.delay(1, child, 0.05)  # the result from 1 is still in flight when 1 dies...
            net.cut(2, child)  # ...and the uncle cannot push it either

    out = run.step(1, [(0.0025, slow_down), (0.01, lambda: net.crash(1))])
    contributors = survivors_finished(out, {1})
    assert contributors == tuple(range(7))  # committed before the crash: the result everyone else has
    assert any(n.text.endswith("after the view change") for r, n in net.notes if r in (3, 4))


def test_a_hung_rank_is_left_out_and_learns_it_when_it_resumes() -> None:
    net = SimNetwork(7)
    run = Run(net)
    run.steps(2)
    net.hang(4)  # stopped before it could give anything to step 2
    out = run.step(2)
    assert 4 not in survivors_finished({r: o for r, o in out.items() if r != 4}, set())
    assert 1.0 < run.step_times[2] < 3.0  # the node deadline (1 s here), a confirmation, one rerun
    net.resume(4)
    net.run(until=net.now + 0.5)
    late = net.submit(4, 3, contributions(7, step=3)[4])
    net.run(until=net.now + 1.0)
    assert isinstance(late.exception(timeout=0), GroupLeft)
    assert "left out of view" in str(late.exception(timeout=0))


@pytest.mark.parametrize("victims", [(3, 5), (1, 2), (0, 6)], ids=["two leaves", "both of the root's children",
                                                                    "root and a leaf"])
def test_two_crashes_in_one_step(victims: tuple[int, int]) -> None:
    net = SimNetwork(7)
    run = Run(net)
    run.steps(1)
    for v in victims:  # both gone before they could give anything to step 1
        net.crash(v)
    contributors = survivors_finished(run.step(1), set(victims))
    assert contributors == tuple(r for r in range(7) if r not in victims)
    assert run.step_times[1] < 1.0


def test_a_partition_leaves_one_side_training_and_the_minority_says_so() -> None:
    net = SimNetwork(7)
    run = Run(net)
    run.steps(1)
    net.partition([1, 3, 4])
    out = run.step(1)
    majority = survivors_finished({r: out[r] for r in (0, 2, 5, 6)}, set())
    assert majority == (0, 2, 5, 6)
    for r in (1, 3, 4):
        assert isinstance(out[r], GroupLeft), f"rank {r}: {out[r]}"
        assert "minority 3 of 7" in str(out[r])
        assert net.nodes[r].membership.status().state.value == "minority"


@pytest.mark.parametrize(("policy", "error"), [("abort", StepAborted), ("rollback", StepRetry)])
def test_abort_and_rollback_hand_the_step_back_naming_the_dead_rank(policy: str, error: type) -> None:
    net = SimNetwork(7, on_node_failure=policy)
    run = Run(net)
    run.steps(1)
    out = run.step(1, [(0.0002, lambda: net.crash(5))])
    for r in (0, 1, 2, 3, 4, 6):
        assert type(out[r]) is error, f"rank {r}: {out[r]!r}"
        assert out[r].peers == (5,)  # type: ignore[union-attr]
    if policy == "rollback":
        assert out[0].members == (0, 1, 2, 3, 4, 6)  # type: ignore[union-attr]
    assert 5 not in survivors_finished({r: o for r, o in run.step(2).items() if r != 5}, set())


# ---- no false evictions ------------------------------------------------------------------------


@pytest.mark.parametrize("faults", ["cut 1-0", "cut 3-1; cut 5-2", "cut 3-1; cut 1-0", "loss 3 20%"],
                         ids=["one cut", "two parallel", "two serial", "20% loss on rank 3"])
def test_link_faults_never_evict_anyone(faults: str) -> None:
    net = SimNetwork(7, faults=faults, seed=5)
    run = Run(net)
    for s in range(25):
        out = run.step(s)
        if all(isinstance(o, StepResult) for o in out.values()):
            assert {o.contributors for o in out.values()} == {tuple(range(7))}  # type: ignore[union-attr]
    assert {net.nodes[r].view.epoch for r in range(7)} == {0}
    assert all(n.membership.status().evicted_total == 0 for n in net.nodes)


@pytest.mark.parametrize("victim", [5, 3])
def test_a_crash_behind_a_cut_coordinator_link_keeps_the_cut_member(victim: int) -> None:
    """Rank 1 cannot reach the coordinator (rank 0) directly when rank `victim` crashes: the
    agreement's messages also go through a relay, so rank 1 promises and stays a member
    (before, it was left out as one that did not answer the change in time)."""
    net = SimNetwork(7, faults="cut 1-0", seed=3)
    run = Run(net)
    run.steps(2)
    out = run.step(2, [(0.002, lambda: net.crash(victim))])
    survivors_finished({r: o for r, o in out.items() if r != victim}, {victim})  # one result, on every survivor
    expected = tuple(r for r in range(7) if r != victim)
    for s in (3, 4):
        out = run.step(s)
        assert survivors_finished({r: o for r, o in out.items() if r != victim}, {victim}) == expected
    assert net.nodes[1].view.members == net.nodes[0].view.members
    assert 1 in net.nodes[0].view
    assert net.nodes[1].stopped is None


# ---- random schedules --------------------------------------------------------------------------

KINDS = ("crash leaf", "crash interior", "crash root", "hang", "two crashes", "crash and a cut link")


def schedule_of(kind: str, world: int, draw: Callable[[int, int], int]) -> tuple[list[tuple[int, str]], str]:
    leaves = [r for r in range(world) if 2 * r + 1 >= world]
    interior = [r for r in range(1, world) if 2 * r + 1 < world]
    pick = {"crash leaf": [("crash", leaves[draw(0, len(leaves) - 1)])],
            "crash interior": [("crash", interior[draw(0, len(interior) - 1)])],
            "crash root": [("crash", 0)],
            "hang": [("hang", draw(0, world - 1))],
            "two crashes": [("crash", draw(0, world - 1)), ("crash", draw(0, world - 1))],
            "crash and a cut link": [("crash", draw(1, world - 1))]}[kind]
    cut = ""
    if kind == "crash and a cut link":
        child = draw(1, world - 1)
        cut = f"cut {child}-{(child - 1) // 2}"
    return [(r, what) for what, r in pick], cut


@st.composite
def failure_runs(draw: st.DrawFn) -> tuple[str, int, list[tuple[int, str]], str, list[float], int]:
    kind = draw(st.sampled_from(KINDS))
    world = draw(st.sampled_from([7, 15]))
    failures, cut = schedule_of(kind, world, lambda lo, hi: draw(st.integers(lo, hi)))
    delays = [draw(st.sampled_from([0.0002, 0.001, 0.002, 0.003, 0.005, 0.02])) for _ in failures]
    return kind, world, failures, cut, delays, draw(st.integers(0, 1000))


def run_schedule(world: int, failures: list[tuple[int, str]], cut: str, delays: list[float], seed: int) -> bool:
    """Run 5 steps with the failures striking in step 2; True if every survivor finished every step."""
    net = SimNetwork(world, seed=seed, jitter_s=0.0005, faults=cut or None)
    run = Run(net)
    events: list[Event] = []
    for (rank, what), delay in zip(failures, delays, strict=True):
        events.append((delay, (lambda r=rank: net.crash(r)) if what == "crash" else (lambda r=rank: net.hang(r))))
    finished = True
    for s in range(5):
        out = run.step(s, events if s == 2 else [])
        gone = set(net.wire.crashed) | {r for r, what in failures if what == "hang"}
        finished &= all(isinstance(o, StepResult) for r, o in out.items() if r not in gone)
        evicted = {r for r in range(world) if r not in net.nodes[min(set(range(world)) - gone)].view}
        for o in out.values():
            if isinstance(o, StepResult) and s > 2:
                assert not evicted & set(o.contributors), "an evicted rank appears in a later sum"
    return finished


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(failure_runs())
def test_random_node_failures_keep_every_survivor_consistent(case: tuple[str, int, list[tuple[int, str]], str,
                                                                        list[float], int]) -> None:
    _kind, world, failures, cut, delays, seed = case
    run_schedule(world, failures, cut, delays, seed)


def test_fraction_of_random_node_failure_schedules_that_finish(capsys: pytest.CaptureFixture[str]) -> None:
    """Report, per kind, how many schedules finish every step on every survivor without an abort."""
    import random

    rng = random.Random(11)
    lines = []
    for kind in KINDS:
        done = total = 0
        for world in (7, 15):
            for _ in range(6):
                failures, cut = schedule_of(kind, world, rng.randint)
                delays = [rng.choice([0.0002, 0.001, 0.002, 0.003, 0.005, 0.02]) for _ in failures]
                done += run_schedule(world, failures, cut, delays, rng.randint(0, 1000))
                total += 1
        lines.append(f"{kind:>22}: {done}/{total} finish every step on every survivor")
    with capsys.disabled():
        print("\nrandom node failures (worlds 7 and 15, failures in step 2 of 5):\n  " + "\n  ".join(lines))


def test_an_in_process_partition_silences_membership_frames_too() -> None:
    """`partition` in the in-process fault layer acts as a firewall would: the pings and the
    view agreement across it are dropped as well, so the majority evicts the minority and goes
    on, and the minority says it has no majority (before, only tree frames were dropped, and
    the steps of the window timed out with everyone still a member)."""
    outcome: dict[int, list[object]] = {}
    with cluster(7, timeout_s=0.2, step_timeout_s=8.0, faults="partition 1,3,4 @2..4") as handles:
        def run(h: FTTreeAllreduce) -> None:
            got: list[object] = []
            try:
                for _ in range(6):
                    h.allreduce(np.full(4, float(h.rank + 1)))
                    assert h.last is not None
                    got.append(h.last.contributors)
            except GroupLeft as exc:
                got.append(exc)
            outcome[h.rank] = got

        threads = [threading.Thread(target=run, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for r in (1, 3, 4):
        assert isinstance(outcome[r][-1], GroupLeft), outcome[r]
        assert "minority 3 of 7" in str(outcome[r][-1])
    for r in (0, 2, 5, 6):
        assert len(outcome[r]) == 6, outcome[r]
        assert outcome[r][-1] == (0, 2, 5, 6)
