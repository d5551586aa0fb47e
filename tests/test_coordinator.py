"""Who coordinates (membership.coordinator): one rule for every decision that needs one rank to
act, so members that know the same name the same rank."""

from __future__ import annotations

from fttree.core.admission import Query
from fttree.core.config import Config
from fttree.core.effects import Send
from fttree.core.membership import Boundary, ControlReceived, Membership, coordinator
from fttree.core.messages import Join, Kind, Notice
from fttree.core.view import View

from .test_membership_joins import Group


def test_the_lowest_slot_not_passed_over_coordinates() -> None:
    members = (4, 1, 7, 2)  # slot order, not rank order
    assert coordinator(members) == 4
    assert coordinator(members, frozenset({4})) == 1
    assert coordinator(members, {4, 1, 7}) == 2


def test_nobody_coordinates_when_every_member_is_passed_over() -> None:
    assert coordinator((0, 1), {0, 1}) is None
    assert coordinator(()) is None


def test_every_member_names_the_same_coordinator() -> None:
    view = View(3, (5, 0, 2, 9))
    ranks = [Membership(r, view, Config()) for r in view.members]
    assert {m.coordinator() for m in ranks} == {5}
    assert {m.coordinator(passed_over={5, 0}) for m in ranks} == {2}


def test_only_the_coordinator_admits_a_joiner() -> None:
    """A join request reaches every member; the coordinator alone starts the round, and the
    others' passing it on lands there too: the joiner is admitted into one new view."""
    group = Group((0, 1, 2), user_step=3)
    group.deliver(1, Join(kind=Kind.JOIN, src=9, query=Query.ADMIT_ME))  # asks a member, not rank 0
    views = {r: [i.view for i in installed] for r, installed in group.installed.items()}
    assert views[0] == views[1] == views[2]
    assert len(views[0]) == 1
    assert 9 in views[0][0]


def test_status_says_why_a_member_starts_no_view_change() -> None:
    """A leave reaches every member: the coordinator starts the change, and the others' status
    says who coordinates it instead of nothing."""
    view = View(0, (0, 1, 2, 3))
    leave = Notice(kind=Kind.LEAVE, src=2, epoch=0)
    member = Membership(1, view, Config())
    sent = member.handle(ControlReceived(msg=leave), 0.0)
    assert not any(isinstance(a, Send) and a.msg.kind is Kind.VIEW_PREPARE for a in sent)
    assert member.status().no_change == "rank 0 coordinates the change without [2]"
    coordinating = Membership(0, view, Config())
    sent = coordinating.handle(ControlReceived(msg=leave), 0.0)
    assert any(isinstance(a, Send) and a.msg.kind is Kind.VIEW_PREPARE for a in sent)
    assert coordinating.status().no_change == ""


def test_a_join_waiting_for_the_last_one_to_take_effect_says_so() -> None:
    group = Group((0, 1, 2, 3), user_step=5)
    assert group.m[0].joins.why_not_now() == ""
    group.ask(4)  # decided to take effect at training step 6
    assert group.m[0].joins.why_not_now() == ("the change decided for training step 6 has not taken effect here "
                                              "(this rank is in step 5)")
    group.m[0].handle(Boundary(user_step=6), 0.0)
    assert group.m[0].joins.why_not_now() == ""
