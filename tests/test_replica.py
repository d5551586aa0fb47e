"""The Replica without a network: its one entrance makes the hand-offs between the tree, the
membership and the life cycle, and the test pumps the frames between replicas itself."""

from __future__ import annotations

import pytest

from fttree.core.admission import Answer, Query, Reply
from fttree.core.config import Config
from fttree.core.lifecycle import LifecycleError, Phase
from fttree.core.membership import ControlReceived, MemberFrame, MemberTimer
from fttree.core.messages import Agreement, Detection, Join, Kind, Message, Notice
from fttree.core.protocol import Send, TimerKey, TimerKind
from fttree.core.replica import (
    AckDue,
    Admit,
    Arrived,
    Connected,
    FirstStart,
    JoinInEffect,
    Leave,
    Redeliver,
    Replica,
    ReplicaAction,
    StepBoundary,
    StepDone,
    Stop,
    ViewApplied,
)
from fttree.core.view import View


class Group:
    def __init__(self, members: tuple[int, ...], user_step: int) -> None:
        view = View(0, members)
        self.r = {m: Replica(m, view, Config()) for m in members}
        for m in members:
            self.r[m].step(StepBoundary(user_step=user_step, first_step=user_step), 0.0)
        self.seen: dict[int, list[ReplicaAction]] = {m: [] for m in members}
        self.promises: list[Agreement] = []

    def pump(self, rank: int, actions: list[ReplicaAction]) -> None:
        queue = [(rank, a) for a in actions]
        while queue:
            src, action = queue.pop(0)
            self.seen[src].append(action)
            if isinstance(action, Send) and action.dst in self.r:
                msg = action.msg
                assert isinstance(msg, Agreement | Detection | Join | Notice)
                if isinstance(msg, Agreement) and msg.kind is Kind.VIEW_PROMISE:
                    self.promises.append(msg)
                out = self.r[action.dst].step(ControlReceived(msg=msg), 0.0)
                queue += [(action.dst, a) for a in out]

    def deliver(self, dst: int, msg: MemberFrame) -> None:
        self.pump(dst, self.r[dst].step(ControlReceived(msg=msg), 0.0))


def test_a_join_is_kept_until_its_training_step_and_taken_in_at_the_boundary() -> None:
    g = Group((0, 1, 2, 3), user_step=5)
    g.deliver(0, Join(kind=Kind.JOIN, src=4, query=Query.ADMIT_ME))
    for m in (0, 1, 2, 3):
        (admit,) = [a for a in g.seen[m] if isinstance(a, Admit)]
        assert admit.installed.activate_at == 6
        assert list(g.r[m].pending) == [admit.installed]
        assert 4 not in g.r[m].view  # the tree keeps the old view until step 6
    out = g.r[1].step(StepBoundary(user_step=6, first_step=60), 1.0)
    (effect,) = [a for a in out if isinstance(a, JoinInEffect)]
    assert effect.first_step == 60
    assert effect.installed.joined == (4,)
    # the joiner hears from which step it takes part, before anyone is told the join took effect
    (reply,) = [a for a in out if isinstance(a, Reply)]
    assert reply == Reply(dst=4, answer=Answer.ADMITTED, view=effect.installed.view, first_step=60, user_step=6)
    assert out.index(reply) < out.index(effect)
    assert 4 in g.r[1].view
    assert not g.r[1].pending


def test_a_view_change_fences_with_the_steps_held_and_supersedes_a_join_not_in_effect() -> None:
    g = Group((0, 1, 2, 3, 4), user_step=5)
    g.deliver(0, Join(kind=Kind.JOIN, src=5, query=Query.ADMIT_ME))
    assert all(len(g.r[m].pending) == 1 for m in range(5))
    g.r[1].step(StepDone(step=4), 0.0)  # rank 1 holds the result of step 4
    epoch = g.r[0].membership.view.epoch
    g.deliver(0, Notice(kind=Kind.LEAVE, src=3, epoch=epoch))
    # the coordinator waits for rank 5's promise (it does not know it is a member): time runs out
    g.pump(0, g.r[0].step(MemberTimer(key=TimerKey(TimerKind.MEMBER_ROUND, -1, 0)), 1.0))
    assert any(p.src == 1 and p.steps == (4,) for p in g.promises)  # fenced, answering with what it holds
    for m in (0, 1, 2, 4):
        applied = [a for a in g.seen[m] if isinstance(a, ViewApplied)]
        assert applied, m
        assert 3 not in applied[-1].installed.view
        assert applied[0].superseded == (1,)  # the join decided in view 1 never took effect
        assert 3 not in g.r[m].view


def test_frames_before_taking_part_wait_and_come_back_once_connected() -> None:
    """A member's step frame that comes while this process does not know yet whether a group
    runs changes nothing; `Connected` hands it back for the driver to deliver again."""
    replica = Replica(0, View(0, (0, 1, 2)), Config())
    early = Message(kind=Kind.PROBE, src=1, epoch=0, step=3)
    assert replica.step(Arrived(msg=early), 0.0) == []
    assert replica.step(FirstStart(), 0.1) == []
    assert replica.phase is Phase.CONNECTING
    assert replica.step(Connected(), 0.2) == [Redeliver(frames=(early,))]
    assert replica.phase is Phase.ACTIVE
    assert replica.running
    with pytest.raises(LifecycleError, match="CONNECTED"):  # a second one is a bug, not a silent no-op
        replica.step(Connected(), 0.3)
    replica.step(Leave(), 0.4)
    assert replica.leaving
    replica.step(Stop(), 0.5)
    assert replica.phase is Phase.STOPPED
    assert not replica.running


def test_a_move_the_life_cycle_lacks_is_refused_by_the_replica_too() -> None:
    replica = Replica(0, View(0, (0, 1, 2)), Config())
    with pytest.raises(LifecycleError, match=r"CONNECTED .* in phase starting"):  # no first start or admission yet
        replica.step(Connected(), 0.0)
    assert replica.phase is Phase.STARTING


def test_done_acks_are_due_once_the_finished_peers_last_step_has_an_outcome_here() -> None:
    replica = Replica(0, View(0, (0, 1, 2)), Config())
    replica.step(FirstStart(), 0.0)
    replica.step(Connected(), 0.0)
    replica.step(Arrived(msg=Notice(kind=Kind.DONE, src=1, epoch=0, step=7)), 0.0)
    assert replica.owes_acks
    assert replica.step(AckDue(last_submitted=7, pending=frozenset({7}), stopped=False), 0.1) == []  # step 7 runs
    assert replica.step(AckDue(last_submitted=6, pending=frozenset(), stopped=False), 0.1) == []  # not submitted
    (ack,) = replica.step(AckDue(last_submitted=7, pending=frozenset(), stopped=False), 0.2)
    assert ack == Send(dst=1, msg=Notice(kind=Kind.DONE_ACK, src=0, epoch=0, step=7))
    assert not replica.owes_acks
    assert replica.step(AckDue(last_submitted=7, pending=frozenset(), stopped=False), 0.3) == []  # sent once
