"""Stragglers (core/stragglers.py, Config.straggler_policy = "deadline"): a tree's root closes a
step without a late rank, which takes part with zeros and is named in the result's `late`; every
rank gets the others' exact sum at once, the late rank too when its contribution comes; labels are
the same everywhere and each contribution is added once or not at all; nothing waits that is
not closable; a late rank's batch is dealt again exactly once (the sampler's "lost" member)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fttree import StepAborted, StepResult
from fttree.core.config import Config
from fttree.core.messages import Kind, Message
from fttree.core.protocol import Cause, Foreign, NoteKind, Received, Send, Submit, TreeMachine
from fttree.core.stragglers import close_at, identity_zeros
from fttree.core.view import View
from fttree.errors import ConfigError
from fttree.testing.sim import SimNetwork

from .test_sampler import Cluster

GRACE = 0.2
LATE_BY = 1.0


def one_late_step(net: SimNetwork, step: int, late: dict[int, float], elements: int,
                  closable: bool = True) -> tuple[list[np.ndarray], float]:
    """Every rank submits `step`, rank r `late.get(r, 0)` seconds after the others; runs until
    every rank has an outcome. The contributions and when the step began."""
    data = [np.full(elements, float(r + 1) * (step + 1), dtype=np.float32) for r in range(net.world)]
    start = net.now
    for r in range(net.world):
        if late.get(r, 0.0) > 0:
            net.at(start + late[r], lambda r=r: net.submit(r, step, data[r], closable=closable))
        else:
            net.submit(r, step, data[r], closable=closable)
    net.run_until_finished(step, limit_s=60 + max(late.values(), default=0.0))
    return data, start


def outcomes(net: SimNetwork, step: int) -> list[StepResult]:
    outs = [net.outcome(r, step) for r in range(net.world)]
    for r, out in enumerate(outs):
        assert isinstance(out, StepResult), (r, step, out)
    return outs  # type: ignore[return-value]


@pytest.mark.parametrize(("late_rank", "elements"), [(3, 1000), (1, 1000), (0, 1000), (1, 3_000_000)],
                         ids=["leaf", "interior", "root", "interior-rotated-trees"])
def test_a_late_rank_is_left_out_and_everyone_gets_the_others_sum_at_once(late_rank: int, elements: int) -> None:
    world = 7
    net = SimNetwork(world, straggler_policy="deadline", straggler_grace_s=GRACE)
    for step in range(2):
        data, start = one_late_step(net, step, {late_rank: LATE_BY}, elements)
        want = sum(d for r, d in enumerate(data) if r != late_rank)
        for r, out in enumerate(outcomes(net, step)):
            np.testing.assert_array_equal(out.data, want)
            assert out.contributors == tuple(x for x in range(world) if x != late_rank)
            assert out.late == (late_rank,)
            took = net.finished_at[(r, step)] - start
            if r == late_rank:  # the result was here: its late contribution returns at once
                assert took == pytest.approx(LATE_BY, abs=0.01)
            else:
                assert took < GRACE + 0.1, (r, took)
    dropped = [n for r, n in net.notes if n.cause is Cause.LATE_DROPPED]
    assert [(n.peer, n.step) for n in dropped] == [(late_rank, 0), (late_rank, 1)]
    assert all(n.seconds is not None and LATE_BY - GRACE - 0.1 < n.seconds < LATE_BY - GRACE + 0.01 for n in dropped)
    assert any(n.cause is Cause.STEP_CLOSED for _, n in net.notes)
    assert all(n.kind is NoteKind.LATE for _, n in net.notes if n.cause in (Cause.STEP_CLOSED, Cause.LATE_DROPPED))
    status = net.nodes[2].status()
    assert status.late_total == {late_rank: 2}
    assert status.late_streak == {late_rank: 2}
    assert net.nodes[late_rank].membership.status().evicted_total == 0


@pytest.mark.parametrize(("policy", "closable"), [("wait", True), ("deadline", False)])
def test_the_default_policy_and_a_step_that_is_not_closable_wait_for_everyone(policy: str, closable: bool) -> None:
    """A broadcast, a layout check or an audit is not closable: its zeros would not be neutral
    (a broadcast's root) or its sum would miss what it counts."""
    net = SimNetwork(7, straggler_policy=policy, straggler_grace_s=GRACE)
    data, start = one_late_step(net, 0, {3: LATE_BY}, 1000, closable=closable)
    for r, out in enumerate(outcomes(net, 0)):
        np.testing.assert_array_equal(out.data, sum(data))
        assert out.contributors == tuple(range(7))
        assert out.late == ()
        assert net.finished_at[(r, 0)] - start >= LATE_BY


@pytest.mark.parametrize("late_rank", [5, 1, 0], ids=["leaf", "interior", "root"])
def test_at_defaults_a_rank_computing_for_longer_than_every_deadline_is_waited_for(late_rank: int) -> None:
    """Slow compute is not broken: at defaults (the wait policy) a rank whose caller submits a
    minute after the others, past the root's give-up (15 s) and the step deadline (30 s), is
    waited for: it says it is alive and computing when its neighbours ping it. The step ends
    with everyone's sum, nobody is evicted, and every other rank noted what it waited for."""
    net = SimNetwork(7)
    for step, late_by in ((0, 60.0), (1, 0.0), (2, 45.0)):
        data, start = one_late_step(net, step, {late_rank: late_by}, 1000)
        for r, out in enumerate(outcomes(net, step)):
            np.testing.assert_array_equal(out.data, sum(data))
            assert out.contributors == tuple(range(7))
            assert net.finished_at[(r, step)] - start < late_by + 1.0
    assert all(net.nodes[r].membership.view.epoch == 0 for r in range(7)), "a slow rank was evicted"
    waits = [(r, n) for r, n in net.notes if n.cause is Cause.STILL_COMPUTING]
    assert {n.step for _, n in waits} == {0, 2}
    assert all(n.peer == late_rank and n.kind is NoteKind.WAIT for _, n in waits)
    assert len(waits) == 2 * 6  # once a step on each rank that waited
    assert {r for r, _ in waits} == set(range(7)) - {late_rank}  # each deadline found it computing


def test_a_rank_computing_between_pipelined_steps_is_waited_for() -> None:
    """Gradient buckets are steps submitted while the previous ones are in flight. Every rank
    submits steps 0 and 1 at once but rank 5, whose step 1 comes a minute later: the pings and
    the answers must speak of the newest step submitted, not of the first of the run."""
    net = SimNetwork(7)
    data = {(r, s): np.full(1000, float(10 * r + s + 1), np.float32) for r in range(7) for s in (0, 1)}
    for r in range(7):
        net.submit(r, 0, data[(r, 0)])
        if r == 5:
            net.at(60.0, lambda: net.submit(5, 1, data[(5, 1)]))
        else:
            net.submit(r, 1, data[(r, 1)])
    net.run_until_finished(1, limit_s=90)
    for step in (0, 1):
        for out in outcomes(net, step):
            np.testing.assert_array_equal(out.data, sum(data[(r, step)] for r in range(7)))
            assert out.contributors == tuple(range(7))
    assert net.finished_at[(0, 1)] == pytest.approx(60.0, abs=1.0)


def test_a_live_rank_that_never_submits_fails_the_step_after_submit_wait_s_naming_it() -> None:
    """A caller that never comes (a user's loop that skipped a step) is bounded: submit_wait_s
    after the step began, every rank's step fails, naming the rank and why it was waited for."""
    net = SimNetwork(7, submit_wait_s=40.0)
    data = [np.ones(1000, dtype=np.float32) for _ in range(7)]
    for r in range(7):
        if r != 5:
            net.submit(r, 0, data[r])
    net.run_until_finished(0, ranks=[r for r in range(7) if r != 5], limit_s=120)
    for r in range(7):
        if r == 5:
            continue
        out = net.outcome(r, 0)
        assert isinstance(out, StepAborted), (r, out)
        # the root gives up 40 s past its own deadline (15 s) and tells everyone; rank 2's
        # subtree sent nothing: the root sees no further
        assert "no contribution from ranks [2, 5, 6] within 55 s, put off while ranks [5] said they were still " \
               "computing it (by at most submit_wait_s = 40 s)" in out.reason, (r, out.reason)
        assert net.finished_at[(r, 0)] == pytest.approx(55.0, abs=1.0)


def test_a_root_missing_more_inputs_than_max_late_waits_for_them() -> None:
    """Ranks 3 and 5 are late, below the root's two children: with max_late=1 the root of the
    one-chunk step misses two inputs and waits; with max_late=2 it closes without both."""
    for max_late, late in ((1, ()), (2, (3, 5))):
        net = SimNetwork(7, straggler_policy="deadline", straggler_grace_s=GRACE, max_late=max_late)
        data, _ = one_late_step(net, 0, {3: LATE_BY, 5: LATE_BY}, 1000)
        for out in outcomes(net, 0):
            assert out.late == late
            np.testing.assert_array_equal(out.data, sum(d for r, d in enumerate(data) if r not in late))


def test_whatever_the_lateness_each_contribution_is_added_once_and_the_labels_agree() -> None:
    """Random ranks late by random amounts around the grace, on one and several trees: every
    result is exactly the sum of its contributors' data, late and contributors split the
    members, and every rank holds the same result and labels."""
    rng = random.Random(5)
    world = 7
    net = SimNetwork(world, straggler_policy="deadline", straggler_grace_s=GRACE, max_late=2)
    closed = 0
    for step in range(16):
        late = {r: rng.uniform(0.0, 2 * GRACE) for r in rng.sample(range(world), rng.randint(1, 2))}
        data, _ = one_late_step(net, step, late, 1000 if step % 2 else 600_000)
        outs = outcomes(net, step)
        first = outs[0]
        assert set(first.contributors) | set(first.late) == set(range(world))
        assert not set(first.contributors) & set(first.late)
        np.testing.assert_array_equal(first.data, sum(data[r] for r in first.contributors))
        for out in outs[1:]:
            assert (out.contributors, out.late) == (first.contributors, first.late)
            np.testing.assert_array_equal(out.data, first.data)
        closed += bool(first.late)
    assert 0 < closed < 16  # both outcomes happened: the labels were checked on each


def test_a_rank_left_behind_finds_the_steps_closed_ahead_and_takes_them_at_once() -> None:
    """Rank 3 is late for three steps running; the group goes on. Its machine knows which steps
    closed without it (the training layer's steps_behind), and submitting them returns at once."""
    world = 7
    net = SimNetwork(world, straggler_policy="deadline", straggler_grace_s=GRACE)
    data = {s: [np.full(100, float(r + 1 + s), dtype=np.float32) for r in range(world)] for s in range(3)}
    for s in range(3):
        for r in range(world):
            if r != 3:
                net.submit(r, s, data[s][r], closable=True)
        net.run_until_finished(s, limit_s=30, ranks=[r for r in range(world) if r != 3])
    assert net.nodes[3].machine.closed_run(0) == 3
    assert net.nodes[3].machine.closed_run(1) == 2
    before = net.now
    for s in range(3):
        net.submit(3, s, data[s][3], closable=True)
    net.run_until_finished(2, limit_s=5)
    for s in range(3):
        out = net.outcome(3, s)
        assert isinstance(out, StepResult)
        assert out.late == (3,)
        np.testing.assert_array_equal(out.data, sum(d for r, d in enumerate(data[s]) if r != 3))
        assert net.finished_at[(3, s)] == pytest.approx(before, abs=0.01)


def test_a_close_from_anyone_but_the_parent_or_for_no_chunk_changes_nothing() -> None:
    view = View.initial(7)
    machine = TreeMachine(3, view, Config(straggler_policy="deadline"))  # rank 3: parent 1 in tree 0

    def close(src: int, **kw: object) -> list[object]:
        fields = {"size": 10, "dtype": "<f4", "signature": "float32[10]", **kw}
        msg = Message(kind=Kind.META_CLOSE, src=src, step=0, chunk=0, **fields)  # type: ignore[arg-type]
        return machine.handle(Received(msg=msg), 0.0)  # type: ignore[return-value]

    for src in (4, 0):  # its brother, and no neighbour: senders the role rule refuses (roles.py)
        out = close(src)
        assert [type(a) for a in out] == [Foreign], (src, out)
    for kw in ({"dtype": "|O"}, {"size": 1 << 40}, {"size": 0}):
        out = close(1, **kw)
        assert [getattr(a, "cause", None) for a in out] == [Cause.PROTOCOL_VIOLATION], (kw, out)
    assert machine.closed_run(0) == 0
    out = close(1)  # from the parent: rank 3 takes part with zeros, late
    assert machine.closed_run(0) == 1
    sent = [a.msg for a in out if isinstance(a, Send) and a.msg.kind is Kind.DATA_REDUCE]
    assert len(sent) == 1
    assert sent[0].late == (3,)
    assert sent[0].contributors == ()
    # its own contribution comes after all: not added, nothing sent again
    again = machine.handle(Submit(step=0, data=np.ones(10, np.float32), signature="float32[10]", closable=True), 1.0)
    assert not [a for a in again if isinstance(a, Send)]
    assert [a.seconds for a in again if getattr(a, "cause", None) is Cause.LATE_DROPPED] == [1.0]


def test_the_rules_of_the_close() -> None:
    assert close_at([1.0], 3, 1, 0.2) is None  # two of three inputs missing, max_late 1
    assert close_at([1.0], 3, 2, 0.2) == pytest.approx(1.2)
    assert close_at([1.0, 2.0], 3, 1, 0.2) == pytest.approx(2.2)  # the (upper) median arrival, plus the grace
    assert close_at([2.0, 1.0], 2, 1, 0.2) is None  # nothing missing
    assert close_at([], 2, 2, 0.2) is None  # nothing came: no median to wait past
    assert close_at([1.0], 2, 1, 0.2) == pytest.approx(1.2)
    assert np.signbit(identity_zeros(3, "<f4")).all()  # -0.0: x + -0.0 is x to the bit
    assert identity_zeros(2, "<i8").tolist() == [0, 0]


@pytest.mark.parametrize(("settings", "needle"), [({"straggler_policy": "first"}, "straggler_policy"),
                                                  ({"max_late": 0}, "max_late"),
                                                  ({"straggler_grace_s": 0}, "straggler_grace_s")])
def test_bad_straggler_settings_are_named(settings: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Config(**settings)  # type: ignore[arg-type]


def test_a_late_ranks_batches_are_dealt_again_exactly_once() -> None:
    """The sampler's side: a late rank stays a member, its batch of that step goes back to the
    pool and is dealt again over the members; over an epoch every sample is committed once."""
    rng = random.Random(2)
    cluster = Cluster(7, 300, 5, horizon=1, seed=1)
    while not cluster.done():
        cluster.run_step(lose=[3] if rng.random() < 0.5 else [])
    cluster.check_exactly_once()
