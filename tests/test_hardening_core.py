"""Hardening of the core rules (the hardening issue's membership and protocol findings): a joiner
that goes silent right after its admission is evicted like any member, a VIEW_COMMIT counts
only from its ballot's coordinator, a subtree sum's label matches what is added, and data for
steps not submitted yet is held within a byte bound. Deterministic: sans-IO machines and the
simulator, no sockets."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from fttree.core.config import Config
from fttree.core.membership import (
    SLOTS,
    Boundary,
    Busy,
    ControlReceived,
    Fence,
    Fenced,
    Installed,
    Membership,
    MemberTimer,
    NotCoordinator,
    Suspected,
)
from fttree.core.messages import Agreement, Kind, Message, Notice, Sender
from fttree.core.protocol import Complete, Received, Submit, TimerKey, TimerKind, TreeMachine
from fttree.core.replica import EARLY_BYTES_FLOOR, EARLY_FAR_BYTES, Arrived, Connected, FirstStart, Foreign, Replica
from fttree.core.view import View
from fttree.net.node import StepResult
from fttree.testing.sim import SimNetwork
from fttree.testing.simulate import STEP_GAP_S, Simulation, simulate


def _take_part(replica: Replica) -> None:
    """A first start, as the node's: no group runs, the tree neighbours are reachable."""
    replica.step(FirstStart(), 0.0)
    replica.step(Connected(), 0.0)


# ---- 1. a joiner that goes silent right after its admission ------------------------------------


def _exact(run: Simulation, ranks: range) -> None:
    for (rank, step), outcome in run.outcomes.items():
        if rank not in ranks:
            continue
        assert isinstance(outcome, StepResult), f"rank {rank} step {step}: {outcome!r}"
        want = sum((run.contribution(c, step) for c in outcome.contributors), start=np.zeros_like(outcome.data))
        assert np.array_equal(outcome.data, want), f"rank {rank} step {step}: not the sum of {outcome.contributors}"


def test_a_joiner_silent_from_its_admission_is_evicted_and_the_job_finishes_exact() -> None:
    """Rank 3 is admitted at step 4 and says nothing from then on (stopped: its connections stay
    open, no frame comes). Before, a joiner was exempt from detection until its first frame:
    every step from 4 on aborted ("no contribution from ranks [1, 3]") and the view kept it."""
    admitted: dict[str, float] = {}

    def silent(run: Simulation, rank: int, first_step: int) -> None:
        admitted["step"] = first_step
        run.network.hang(rank)

    steps = 12
    run = simulate(3, "join 3 @3", steps, on_admitted=silent, limit_s=120)
    first = int(admitted["step"])
    assert first == 4
    _exact(run, range(3))
    assert all((r, s) in run.outcomes for r in range(3) for s in range(steps)), "a member's step has no outcome"
    net = run.network
    deadline = Config().node_deadline_s
    began = max(net.finished_at[(r, first - 1)] for r in range(3)) + STEP_GAP_S  # the members begin step 4
    for r in range(3):
        node = net.nodes[r]
        assert node.view.members == (0, 1, 2)
        (eviction,) = node.membership.status().evictions
        assert eviction.rank == 3
        assert "suspected by ranks [1, 2]" in eviction.reason
        evicted_in = net.finished_at[(r, first)] - began  # step 4 ends after the eviction, on the survivors
        assert evicted_in < 2 * deadline, f"rank {r}: step {first} took {evicted_in:.3f} s"
        assert run.outcomes[(r, first)].contributors == (0, 1, 2)  # type: ignore[union-attr]


def test_a_joiner_is_watched_from_the_step_its_join_takes_effect() -> None:
    """Sans-IO: rank 1 installs a join of rank 3 (its child) from training step 6. Before step 6
    rank 3 is not watched (it does not know yet that it is in); from step 6 a silent rank 3 is
    pinged at half the node deadline and suspected at one and a half."""
    m = Membership(1, View(0, (0, 1, 2)), Config())
    m.user_step = 5
    joined = View(1, (0, 1, 2, 3))
    commit = Agreement(kind=Kind.VIEW_COMMIT, src=0, epoch=0, ballot=1 * SLOTS + (SLOTS - 1), proposed=1,
                       members=joined.members, user_step=6)
    assert any(isinstance(a, Installed) and a.joined == (3,) for a in m.handle(ControlReceived(msg=commit), 0.0))
    m.handle(Busy(since=0.0, step=10), 0.0)  # steps of the old view run meanwhile
    deadline = m.node_deadline_s
    now, suspected_at = 0.0, None
    while now < 2.0 and suspected_at is None:  # before step 6: never suspected
        now += deadline / 4
        for action in m.handle(MemberTimer(key=TimerKey(TimerKind.MEMBER_CHECK, -1, 0)), now):
            assert not isinstance(action, Suspected), action
        for peer in (0, 2):
            m.heard(peer, now)
    m.handle(Boundary(user_step=6), now)
    took_effect = now
    for _ in range(40):
        now += deadline / 4
        for peer in (0, 2):
            m.heard(peer, now)
        actions = m.handle(MemberTimer(key=TimerKey(TimerKind.MEMBER_CHECK, -1, 0)), now)
        if any(isinstance(a, Suspected) and a.peer == 3 for a in actions):
            suspected_at = now
            break
    assert suspected_at is not None, "the joiner was never suspected"
    assert suspected_at - took_effect <= 1.5 * deadline + deadline / 4 + 1e-9


# ---- 2. a VIEW_COMMIT only from its ballot's coordinator --------------------------------------


def _commit(src: int, coordinator_slot: int, members: tuple[int, ...], **kw: int) -> Agreement:
    return Agreement(kind=Kind.VIEW_COMMIT, src=src, epoch=0, ballot=3 * SLOTS + (SLOTS - 1 - coordinator_slot),
                     proposed=1, members=members, **kw)


def test_a_commit_from_a_member_that_is_not_its_coordinator_changes_nothing() -> None:
    """Rank 2 sends rank 1 a VIEW_COMMIT evicting rank 3 under rank 0's ballot, directly and as a
    relayed copy that names rank 2 as its first sender: both are dropped and counted (before,
    any member's commit was installed). The coordinator's own commit still is."""
    view = View(0, (0, 1, 2, 3))
    m = Membership(1, view, Config())
    forged = _commit(2, 0, (0, 1, 2))
    actions = m.handle(ControlReceived(msg=forged), 0.0)
    assert [type(a) for a in actions] == [NotCoordinator]
    relayed = forged.but(src=3, origin=2, target=1)
    assert [type(a) for a in m.handle(ControlReceived(msg=relayed), 0.0)] == [NotCoordinator]
    own_ballot_of_another = _commit(2, 1, (0, 1, 2))  # a ballot of rank 1's slot, sent by rank 2
    assert [type(a) for a in m.handle(ControlReceived(msg=own_ballot_of_another), 0.0)] == [NotCoordinator]
    assert m.view is view
    assert m.foreign_commits == 3
    assert m.status().evicted_total == 0
    real = m.handle(ControlReceived(msg=_commit(0, 0, (0, 1, 2))), 0.0)
    assert any(isinstance(a, Installed) and a.evicted == (3,) for a in real)
    assert m.view.members == (0, 1, 2)


def test_the_replica_counts_a_commit_from_a_non_coordinator_as_a_foreign_frame() -> None:
    replica = Replica(1, View(0, (0, 1, 2, 3)), Config())
    _take_part(replica)
    out = replica.step(Arrived(msg=_commit(2, 0, (0, 1, 2))), 0.0)
    assert [(type(a), getattr(a, "rule", None)) for a in out] == [(Foreign, Sender.COORDINATOR)]
    assert replica.membership.view.members == (0, 1, 2, 3)
    assert replica.view.members == (0, 1, 2, 3)


def test_a_coordinator_change_still_commits_through_the_group() -> None:
    """The rule keeps real view changes working: rank 3 is confirmed dead and rank 0
    coordinates; every member installs the commit, also one that only gets the relayed copy."""
    view = View(0, (0, 1, 2, 3))
    group = {r: Membership(r, view, Config()) for r in (0, 1, 2)}
    installed: dict[int, list[Installed]] = {r: [] for r in group}
    pending: list[tuple[int, Agreement]] = []

    def run(rank: int, actions: list[object]) -> None:
        while actions:
            action = actions.pop(0)
            if isinstance(action, Installed):
                installed[rank].append(action)
            elif isinstance(action, Fence):
                actions += group[rank].handle(Fenced(held=()), 1.0)
            elif isinstance(action, NotCoordinator):
                raise AssertionError(f"rank {rank} dropped a real commit: {action}")
            elif hasattr(action, "dst") and isinstance(getattr(action, "msg", None), Agreement):
                pending.append((action.dst, action.msg))  # type: ignore[attr-defined]

    for r in group:
        run(r, group[r].handle(ControlReceived(msg=Notice(kind=Kind.LEAVE, src=3, epoch=0)), 1.0))
    while pending:
        dst, msg = pending.pop(0)
        if dst in group:
            run(dst, group[dst].handle(ControlReceived(msg=msg), 1.0))
    for r in group:
        assert [i.view.members for i in installed[r]] == [(0, 1, 2)], (r, installed[r])
        assert group[r].foreign_commits == 0


# ---- 3. a subtree sum's label matches what is added --------------------------------------------


def _reduce(src: int, step: int, data: np.ndarray, contributors: tuple[int, ...], *, epoch: int = 0,
            origin: int | None = None) -> Message:
    return Message(kind=Kind.DATA_REDUCE, src=src, epoch=epoch, step=step, chunk=0, chunks=1, tree=0,
                   origin=src if origin is None else origin, contributors=contributors, dtype=data.dtype.str,
                   numel=int(data.size), signature=f"float64[{data.size}]", payload=data.data.cast("B"))


def _root_result(messages: list[Message]) -> Complete:
    machine = TreeMachine(0, View.initial(3), Config())
    own = np.full(8, 1.0)
    out = list(machine.handle(Submit(step=0, data=own.copy(), signature="float64[8]"), 0.0))
    for msg in messages:
        out += machine.handle(Received(msg=msg), 0.001)
    done = [a for a in out if isinstance(a, Complete)]
    assert len(done) == 1, out
    return done[0]


def test_a_subtree_sum_naming_no_contributor_adds_nothing() -> None:
    """Rank 1's DATA_REDUCE names no contributor but carries 100s: the root takes it as rank 1's
    arrival (a joiner without state sends such a sum) and adds none of it. Before, the 100s were
    in a result labelled (0, 2)."""
    forged = _reduce(1, 0, np.full(8, 100.0), ())
    done = _root_result([forged, _reduce(2, 0, np.full(8, 3.0), (2,))])
    assert done.contributors == (0, 2)
    assert np.array_equal(done.result, np.full(8, 1.0 + 3.0))


def test_a_subtree_sum_outside_its_subtree_or_overlapping_is_not_added() -> None:
    """A sum naming a rank outside the origin's subtree (rank 2's as rank 1's), and one naming
    the receiving rank itself, are dropped with a protocol note; the result holds only what its
    label names."""
    machine = TreeMachine(0, View.initial(3), Config())
    out = list(machine.handle(Submit(step=0, data=np.full(8, 1.0), signature="float64[8]"), 0.0))
    out += machine.handle(Received(msg=_reduce(1, 0, np.full(8, 50.0), (2,))), 0.001)
    out += machine.handle(Received(msg=_reduce(1, 0, np.full(8, 60.0), (0, 1))), 0.001)
    notes = [a for a in out if getattr(a, "cause", None) is not None and a.cause.value == "protocol_violation"]
    assert len(notes) == 2, out
    out += machine.handle(Received(msg=_reduce(1, 0, np.full(8, 2.0), (1,))), 0.002)
    out += machine.handle(Received(msg=_reduce(2, 0, np.full(8, 3.0), (2,))), 0.002)
    (done,) = [a for a in out if isinstance(a, Complete)]
    assert done.contributors == (0, 1, 2)
    assert np.array_equal(done.result, np.full(8, 6.0))


def test_a_joiner_without_state_still_takes_part_with_nothing_added() -> None:
    """A rank that takes part without contributing (zeros, contribute=False) is waited for and
    adds nothing; the others' result is exact."""
    net = SimNetwork(5)
    data = [np.arange(8, dtype=np.float64) + 10.0 * r for r in range(5)]
    for r in (0, 1, 2, 4):
        net.submit(r, 0, data[r])
    fut: Future[StepResult] = Future()  # rank 3 takes part with zeros that are not counted
    net.run_as(3, lambda: net.nodes[3].submit(0, np.zeros(8), "float64[8]", fut, contribute=False))
    net.run_until_finished(0, ranks=(0, 1, 2, 4))
    want = sum(data[r] for r in (0, 1, 2, 4))
    for r in range(5):
        res = net.outcome(r, 0) if r != 3 else fut.result(timeout=0)
        assert isinstance(res, StepResult), res
        assert res.contributors == (0, 1, 2, 4)
        assert np.array_equal(res.data, want)
    assert sum(n.machine.empty_sums for n in net.nodes) == 1  # rank 1 took rank 3's empty sum


# ---- 4. data for steps not submitted yet: a byte bound ------------------------------------------


def test_forged_early_data_beyond_the_bound_is_dropped_and_counted() -> None:
    """Forty 16 MiB subtree sums "from rank 1" for steps 5 to 44, which rank 0 has not reached
    (640 MiB; before, all of it was held until those steps ran): the bytes held stay under the
    bound, the rest is dropped and counted, and one note says so."""
    replica = Replica(0, View.initial(3), Config())
    _take_part(replica)
    replica.step(Submit(step=0, data=np.zeros(1024, np.float32), signature="float32[1024]"), 0.0)
    big = np.ones(4 << 20, np.float32)  # 16 MiB, one buffer for every frame (the test holds no copies)
    notes = []
    for step in range(5, 45):
        msg = Message(kind=Kind.DATA_REDUCE, src=1, step=step, chunk=0, chunks=1, tree=0, origin=1, contributors=(1,),
                      dtype="<f4", numel=int(big.size), signature=f"float32[{big.size}]", payload=big.data.cast("B"))
        out = replica.step(Arrived(msg=msg), 0.0)
        notes += [a for a in out if getattr(a, "cause", None) is not None]
    limit = replica.early_limit()
    assert limit == EARLY_BYTES_FLOOR
    held = sum(len(m.payload) for op in replica.machine._ops.values() for m in op.reduce.held.values()  # type: ignore[arg-type]
               if m.payload is not None)
    assert replica.early_bytes == held <= limit
    assert held == 4 * big.nbytes
    assert replica.early_dropped == 36
    assert replica.early_dropped_bytes == 36 * big.nbytes
    assert len(notes) == 1
    assert "further ones are counted, not logged" in notes[0].text
    # once rank 0 runs those steps, the room is back
    for step in range(1, 9):
        replica.step(Submit(step=step, data=np.zeros(1024, np.float32), signature="float32[1024]"), 1.0)
    assert replica.early_bytes == 0


def test_forged_sums_for_steps_far_ahead_hold_at_most_the_far_bound() -> None:
    """Forty 1 MiB subtree sums "from rank 1" for steps 1,000 to 1,039 (rank 0 is at step 0):
    at most EARLY_FAR_BYTES of them are held (a key holder's sums for steps a thousand ahead
    would sit in memory until those steps ran), the rest dropped and counted; sums for near
    steps still have the whole bound."""
    replica = Replica(0, View.initial(3), Config())
    _take_part(replica)
    replica.step(Submit(step=0, data=np.zeros(1024, np.float32), signature="float32[1024]"), 0.0)
    mib = np.ones(1 << 18, np.float32)

    def sum_for(step: int) -> Message:
        return Message(kind=Kind.DATA_REDUCE, src=1, step=step, chunk=0, chunks=1, tree=0, origin=1, contributors=(1,),
                       dtype="<f4", numel=int(mib.size), signature=f"float32[{mib.size}]", payload=mib.data.cast("B"))

    for step in range(1000, 1040):
        replica.step(Arrived(msg=sum_for(step)), 0.0)
    assert replica.early_bytes == EARLY_FAR_BYTES
    assert replica.early_dropped == 40 - EARLY_FAR_BYTES // mib.nbytes
    for step in range(5, 45):
        replica.step(Arrived(msg=sum_for(step)), 0.0)
    assert replica.early_bytes == EARLY_FAR_BYTES + 40 * mib.nbytes  # near steps: all held
    assert replica.early_dropped == 40 - EARLY_FAR_BYTES // mib.nbytes


def test_children_steps_ahead_of_their_parent_are_never_dropped_and_stay_exact() -> None:
    """A normal run where rank 0 (the root) is behind: its children submit 8 steps at once and
    rank 0 starts them 50 ms later. With 2 MiB steps (16 MiB early per child) and, after a warm-up
    that shows rank 0 the sizes, with 8 MiB steps (128 MiB early in all, above the floor: the
    bound follows the sizes seen), nothing is dropped and every step is exact."""
    for size, warm in ((1 << 18, False), (1 << 20, True)):  # float64: 2 MiB, then 8 MiB a step
        net = SimNetwork(3, step_timeout_s=60, wire=False, trees="single")  # rank 0 the root of every chunk
        steps = 8
        data = {(r, s): np.full(size, float(r + 1 + 10 * s)) for r in range(3) for s in range(steps)}
        base = 0
        if warm:  # steps of this size first, all ranks together
            for s in range(steps):
                for r in range(3):
                    net.submit(r, s, data[(r, s)])
                net.run_until_finished(s)
            base = steps
        for s in range(steps):
            for r in (1, 2):
                net.submit(r, base + s, data[(r, s)])
        net.run(until=net.now + 0.05)
        early = net.nodes[0].replica.early_bytes
        assert early == 2 * steps * size * 8, early  # every child's sum of every step is held early
        assert (early > EARLY_BYTES_FLOOR) == warm
        for s in range(steps):
            net.submit(0, base + s, data[(0, s)])
        for s in range(steps):
            net.run_until_finished(base + s)
        for s in range(steps):
            want = data[(0, s)] + data[(1, s)] + data[(2, s)]
            for r in range(3):
                res = net.outcome(r, base + s)
                assert isinstance(res, StepResult), res
                assert res.contributors == (0, 1, 2)
                assert np.array_equal(res.data, want)
        for node in net.nodes:
            assert node.replica.early_dropped == 0, (size, node.rank, node.replica.early_dropped)
        assert net.nodes[0].replica.early_bytes == 0
