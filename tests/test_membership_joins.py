"""Join agreement without a network: several Membership machines pass their frames to each
other directly (sans-IO), so the order of events is the test's, not the scheduler's."""

from __future__ import annotations

from fttree.core.admission import Query
from fttree.core.config import Config
from fttree.core.membership import ControlReceived, Fence, Fenced, Installed, Membership, MemberState, MemberTimer
from fttree.core.messages import Agreement, Detection, Frame, Join, Kind, Notice
from fttree.core.protocol import TimerKey, TimerKind
from fttree.core.view import View


class Group:
    """Members of one view and a pump that delivers every frame they send to each other."""

    def __init__(self, members: tuple[int, ...], user_step: int) -> None:
        view = View(0, members)
        self.m = {r: Membership(r, view, Config()) for r in members}
        for m in self.m.values():
            m.user_step = user_step
        self.installed: dict[int, list[Installed]] = {r: [] for r in members}
        self.prepares = 0

    def deliver(self, dst: int, msg: Frame) -> None:
        pending = [(dst, msg)]
        while pending:
            to, frame = pending.pop(0)
            if to not in self.m:
                continue  # the joiner's own process is not simulated here
            self.prepares += frame.kind is Kind.VIEW_PREPARE
            assert isinstance(frame, Agreement | Detection | Join | Notice)
            actions = self.m[to].handle(ControlReceived(msg=frame), 0.0)
            while actions:
                action = actions.pop(0)
                if isinstance(action, Installed):
                    self.installed[to].append(action)
                elif isinstance(action, Fence):
                    actions += self.m[to].handle(Fenced(held=()), 0.0)
                elif hasattr(action, "dst") and hasattr(action, "msg"):
                    pending.append((action.dst, action.msg))

    def ask(self, joiner: int) -> None:
        """`joiner` asks the coordinator (rank 0) to be admitted."""
        self.deliver(0, Join(kind=Kind.JOIN, src=joiner, query=Query.ADMIT_ME))


def test_a_second_join_waits_until_the_first_has_taken_effect() -> None:
    g = Group((0, 1, 2, 3), user_step=5)
    g.ask(4)
    first = [i for i in g.installed[0] if i.joined == (4,)]
    assert len(first) == 1
    assert first[0].activate_at == 6
    for r in (0, 1, 2, 3):
        assert g.m[r].state is MemberState.ACTIVE
        assert 4 in g.m[r].view
    prepares = g.prepares
    # Rank 7 asks before rank 4's admission took effect at step 6: deciding it now would give
    # rank 4 a view it never hears of. Nothing starts; the joiner asks again later.
    g.ask(7)
    assert g.prepares == prepares
    assert all(7 not in g.m[r].view for r in (0, 1, 2, 3))
    # The coordinator reaches step 6, where rank 4's view takes effect: rank 7 is taken now,
    # from a later step, so every member switches views one at a time.
    g.m[0].user_step = 6
    view = first[0].view  # rank 4 hears of its admission as the node does (JOIN_REPLY at step 6)
    g.m[4] = Membership(4, view, Config())
    g.m[4].user_step = 5
    g.installed[4] = []
    g.ask(7)
    second = [i for i in g.installed[0] if i.joined == (7,)]
    assert len(second) == 1
    assert second[0].activate_at > first[0].activate_at
    assert set(second[0].view.members) == {0, 1, 2, 3, 4, 7}


def test_a_leave_before_a_join_takes_effect_forms_its_view_without_the_unaware_joiner() -> None:
    """Rank 4's admission is decided for step 6; before step 6, rank 2 leaves. Rank 4 has not
    heard of its admission (that comes at step 6) and cannot promise: the leave's view is
    formed from those that did, without rank 4, so no member ever waits for a rank that does
    not know it is one (the node drops the superseded join, and rank 4 asks again)."""
    g = Group((0, 1, 2, 3), user_step=5)
    g.ask(4)
    assert all(4 in g.m[r].view for r in (0, 1, 2, 3))
    epoch = g.m[0].view.epoch
    g.deliver(0, Notice(kind=Kind.LEAVE, src=2, epoch=epoch))
    assert not [i for i in g.installed[0] if 2 not in i.view.members]  # waiting for rank 4's promise
    actions = g.m[0].handle(MemberTimer(key=TimerKey(TimerKind.MEMBER_ROUND, -1, 0)), 1.0)
    for action in actions:
        if hasattr(action, "dst") and hasattr(action, "msg"):
            g.deliver(action.dst, action.msg)
    left, *again = [i for i in g.installed[0] if 2 not in i.view.members]
    assert left.activate_at == -1  # at once, as an eviction
    assert set(left.view.members) == {0, 1, 3}
    # The coordinator admits rank 4 again at once, without waiting for it to ask: a view that
    # takes effect at the next training step, which rank 4 hears of then.
    assert [i.joined for i in again] == [(4,)]
    assert again[0].activate_at == 6
    assert set(again[0].view.members) == {0, 1, 3, 4}
