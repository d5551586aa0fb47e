"""Who coordinates (membership.coordinator): one rule for every decision that needs one rank to
act, so members that know the same name the same rank."""

from __future__ import annotations

from fttree.core.admission import Query
from fttree.core.config import Config
from fttree.core.membership import Membership, coordinator
from fttree.core.messages import Join, Kind
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
