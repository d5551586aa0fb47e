"""The message table's role column (fttree/core/roles.py): who in a tree may send each of a
step's frames. The walk: for every kind, a frame from each role the row does not allow is
dropped before any handler sees it and counted as foreign; one from an allowed role, with its
`origin`/`target` where the link it is about puts them, is handled; and one from an allowed
role whose field names another link is dropped too. Then simulated runs that take the ways
around faults (relays, pushes, probes, closes, aborts) drop no frame for its sender's role."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fttree.core.config import Config
from fttree.core.effects import Cause, Foreign, Note, Send
from fttree.core.events import Submit
from fttree.core.messages import Kind, Message, make
from fttree.core.replica import Arrived, Connected, FirstStart, Replica
from fttree.core.roles import ROLE_RULES, Role, RoleRule, Tie, role_allows, roles_of, sender_role
from fttree.core.topology import Neighbours
from fttree.core.view import View
from fttree.net.notes import ForeignLog
from fttree.net.steps import StepResult
from fttree.testing.sim import SimNetwork

P, C, B, U, N = Role.PARENT, Role.CHILD, Role.BROTHER, Role.UNCLE, Role.NEPHEW

#: the protocol's rule, written from who sends what (protocol.py's docstring): the table must say
#: exactly this; a row loosened or lost fails here before the walk
SPEC: dict[Kind, set[Role]] = {
    Kind.DATA_REDUCE: {C, B},  # the origin (a child), or its brother (another child) or uncle (our brother) relaying
    Kind.META_REDUCE_SENT: {B, N},  # we watch the sender's uplink: we are its brother or uncle
    Kind.META_REDUCE_RECEIVED: {P, B},  # from the parent of a link we watch
    Kind.META_REDUCE_REQUEST: {B, U},  # from an observer of our uplink
    Kind.DATA_REDUCE_REQUEST: {B, N},  # a sum to relay, from the child end of a link we watch
    Kind.DATA_BCAST: {P, B, U},  # the result: from the parent, or pushed by an observer of our uplink
    Kind.META_BCAST_RECEIVED: {B, N},
    Kind.META_BCAST_SENT: {P, B},
    Kind.ABORT: {P, C, B, U, N},  # flooded to every neighbour
    Kind.PROBE: {C},
    Kind.PROBE_ACK: {P},
    Kind.META_BCAST_REQUEST: {C, B},  # from an observer of a child's uplink
    Kind.META_STALLED: {P, B},
    Kind.META_CLOSE: {P},
    Kind.CATCHUP: set(Role),  # a committed result, from whichever member holds it
}
WORLD = 15
RECEIVER = 3  # in tree 0: parent 1, children 7 and 8, brother 4, uncle 2, nephews 9 and 10
DATA = {Kind.DATA_REDUCE, Kind.DATA_REDUCE_REQUEST, Kind.DATA_BCAST, Kind.CATCHUP}


def test_every_step_kind_has_one_row_and_the_rows_are_the_protocols() -> None:
    assert set(ROLE_RULES) == set(Message.RULES)
    assert {kind: set(rule.senders) for kind, rule in ROLE_RULES.items()} == SPEC


def _in_role(heap: View, me: Neighbours, role: Role) -> int:
    """A rank that is `role` to the receiver in `heap`, found from the heap's relations."""
    ranks = {P: [me.parent], C: list(me.children), B: [me.brother], U: [me.uncle], N: list(me.nephews),
             Role.STRANGER: [r for r in heap.members if r != me.rank and r not in me.all]}[role]
    assert ranks, role
    assert ranks[0] is not None, role
    return ranks[-1]


def _on_the_link(tie: Tie, heap: View, me: Neighbours, src: int) -> set[int]:
    """The ranks the tied field (`origin` or `target`) may name, from the heap's relations: the
    link the frame is about."""
    sender = heap.neighbours(src)
    return {Tie.ORIGIN_MY_CHILD: set(me.children),
            Tie.TARGET_SENDERS_PARENT: {sender.parent},
            Tie.TARGET_MY_PARENT: {me.parent},
            Tie.ORIGIN_SENDERS_CHILD: set(sender.children) - {me.rank},
            Tie.TARGET_SENDERS_CHILD: set(sender.children) - {me.rank},
            Tie.TARGET_MY_CHILD: set(me.children) - {src}}.get(tie, set()) - {None}  # type: ignore[return-value]


def _tied_field(tie: Tie) -> str:
    return "origin" if tie in (Tie.ORIGIN_MY_CHILD, Tie.ORIGIN_SENDERS_CHILD) else "target"


def _link_fields(tie: Tie, heap: View, me: Neighbours, src: int) -> dict[str, int]:
    """`origin` and `target` as a legitimate frame has them (the sender's own sum: its origin)."""
    if tie is Tie.NONE:
        return {}
    ranks = _on_the_link(tie, heap, me, src)
    fields = {_tied_field(tie): src if src in ranks else min(ranks, default=-1)}
    if tie is Tie.TARGET_SENDERS_PARENT:
        fields["origin"] = src
    return fields


def _frame(kind: Kind, src: int, tree: int, chunks: int, **fields: int) -> Message:
    extra: dict[str, object] = {}
    if kind in DATA:
        extra = {"dtype": "<f4", "numel": 4, "signature": "float32[4]", "contributors": (fields.get("origin", src),),
                 "payload": np.ones(4, np.float32).data.cast("B")}
    elif kind is Kind.META_CLOSE:
        extra = {"dtype": "<f4", "size": 4, "signature": "float32[4]"}
    msg = make(kind, src, step=0, chunk=tree if chunks > 1 else 0, chunks=chunks, tree=tree, **fields, **extra)
    assert isinstance(msg, Message)
    return msg


def _replica_of(rank: int, view: View) -> Replica:
    """A replica taking part (a first start, its tree neighbours reachable)."""
    replica = Replica(rank, view, Config(straggler_policy="deadline"))
    replica.step(FirstStart(), 0.0)
    replica.step(Connected(), 0.0)
    return replica


def _replica(tree: int, chunks: int) -> Replica:
    """The receiver, taking part, with its contribution to the frames' op submitted."""
    replica = _replica_of(RECEIVER, View.initial(WORLD))
    replica.step(Submit(step=0, chunk=tree if chunks > 1 else 0, chunks=chunks, data=np.ones(4, np.float32),
                        signature="float32[4]"), 0.0)
    return replica


@pytest.mark.parametrize("tree", [0, 13])  # rank 3 holds slot 5 of rotated tree 13: other neighbours
def test_the_walk_a_frame_from_a_role_its_row_refuses_is_dropped_and_counted(tree: int) -> None:
    chunks = WORLD if tree else 1  # chunk c of WORLD runs on rotated tree c
    heap = View.initial(WORLD).tree(tree, "rotated")
    me = heap.neighbours(RECEIVER)
    log = ForeignLog(RECEIVER)
    refused: Counter[Kind] = Counter()
    for kind, rule in ROLE_RULES.items():
        for role in Role:
            src = _in_role(heap, me, role)
            msg = _frame(kind, src, tree, chunks, **_link_fields(rule.tie, heap, me, src))
            out = _replica(tree, chunks).step(Arrived(msg=msg), 0.0)
            foreign = [a for a in out if isinstance(a, Foreign)]
            for drop in foreign:
                log.dropped(drop.msg, drop.rule)
            if role in SPEC[kind]:  # handled: no drop, and its handler found no fault with it
                assert not foreign, (kind, role, out)
                faults = [a.text for a in out if isinstance(a, Note) and a.cause is Cause.PROTOCOL_VIOLATION]
                assert faults in ([], [f"dropped {kind.name} from rank {src}: nothing sent yet to relay"]), faults
            else:
                assert [(a.msg, a.rule) for a in foreign] == [(msg, rule)], (kind, role, out)
                assert len(out) == 1, (kind, role, out)  # nothing else happened
                refused[kind] += 1
    assert log.by_role == refused
    assert log.count == sum(refused.values()) == sum(len(set(Role) - allowed) for allowed in SPEC.values())


def test_a_field_naming_another_link_is_dropped_from_an_allowed_role() -> None:
    """The ties: from a role the row allows, `origin` or `target` must name the link the
    frame is about; naming any other rank, the frame is dropped as foreign."""
    heap = View.initial(WORLD)
    me = heap.neighbours(RECEIVER)
    tied = 0
    for kind, rule in ROLE_RULES.items():
        if rule.tie is Tie.NONE:
            continue
        for role in rule.senders:
            src = _in_role(heap, me, role)
            good = _link_fields(rule.tie, heap, me, src)
            assert role_allows(_frame(kind, src, 0, 1, **good), me), (kind, role, good)
            name = _tied_field(rule.tie)
            for other in set(range(-1, WORLD)) - _on_the_link(rule.tie, heap, me, src):
                msg = _frame(kind, src, 0, 1, **{**good, name: other})
                out = _replica(0, 1).step(Arrived(msg=msg), 0.0)
                assert [a for a in out if isinstance(a, Foreign)] == [Foreign(msg=msg, rule=rule)], (kind, role, other)
                tied += 1
    assert tied > 100


def test_a_frame_its_sender_may_not_send_in_the_tree_it_names_is_foreign_not_a_tree_mismatch() -> None:
    """Rank 1 is rank 0's child in tree 0, so it never announces its sum to rank 0: a flood of
    such frames naming tree 0 for chunks our rule puts on other trees is dropped as foreign,
    making no op and no ABORT (as a mismatch, each made an op here and an abort flood that made
    ops on the neighbours, until max_live_ops stopped real steps on all three)."""
    replica = _replica_of(0, View.initial(3))
    for chunk in (0, 400, 999):  # trees 0, 1 and 2 of the rotated family by our rule
        msg = make(Kind.META_REDUCE_SENT, 1, step=5, chunk=chunk, chunks=1000, tree=0, origin=1, target=0)
        assert replica.step(Arrived(msg=msg), 0.0) == [Foreign(msg=msg, rule=ROLE_RULES[Kind.META_REDUCE_SENT])]
    assert replica.machine.footprint()["ops"] == 0
    # "I have the result" from a child: its observers hear that, never its parent
    msg = make(Kind.META_BCAST_RECEIVED, 1, step=5, chunk=400, chunks=1000, tree=0)
    assert [type(a) for a in replica.step(Arrived(msg=msg), 0.0)] == [Foreign]
    # a result from rank 2, rank 0's parent in rotated tree 2, which the frame names, for a
    # chunk our rule puts on tree 1: the workers differ in their trees, and the op fails everywhere
    msg = make(Kind.DATA_BCAST, 2, step=5, chunk=400, chunks=1000, tree=2, dtype="<f4", numel=1,
               signature="float32[1]", payload=b"\0\0\0\0")
    aborts = [a.msg for a in replica.step(Arrived(msg=msg), 0.0) if isinstance(a, Send)]
    assert [m.kind for m in aborts] == [Kind.ABORT], aborts  # to rank 1 (not back to rank 2)
    assert isinstance(aborts[0], Message)
    assert "tree mismatch" in aborts[0].reason


def test_the_roles_are_one_each_and_the_rule_reads_as_a_sentence() -> None:
    heap = View.initial(WORLD)
    me = heap.neighbours(RECEIVER)
    assert [sender_role(me, r) for r in (1, 7, 8, 4, 2, 9, 10, 0, 3, 14)] == [P, C, C, B, U, N, N] + [Role.STRANGER] * 3
    for tree in range(WORLD):  # the roles a tree keeps (roles_of) are sender_role's, for every rank
        heap = View.initial(WORLD).tree(tree, "rotated")
        for rank in heap.members:
            mine = heap.neighbours(rank)
            kept = roles_of(mine)
            assert {r: kept.get(r, Role.STRANGER) for r in heap.members} == {r: sender_role(mine, r)
                                                                             for r in heap.members}
    assert RoleRule(frozenset({B, P}), Tie.TARGET_MY_PARENT).text == (
        "the receiver's parent or the receiver's brother, where `target` is the receiver's parent (the receiver's "
        "uplink, which the sender watches)")


def _exact(net: SimNetwork, world: int, steps: range, size: int = 64) -> None:
    for s in steps:
        data = [np.arange(size, dtype=np.float32) + 100 * r + s for r in range(world)]
        net.submit_all(s, data)
        net.run_until_finished(s)
        for r in range(world):
            out = net.outcome(r, s)
            assert isinstance(out, StepResult), (r, s, out)
            assert np.array_equal(out.data, sum(data)), (r, s)


def _dropped_for_role(net: SimNetwork) -> dict[int, Counter[Kind]]:
    return {n.rank: n.foreign.by_role for n in net.nodes if n.foreign.by_role}


@pytest.mark.parametrize("faults", ["cut 1-0 @2..5", "cut 3-1; cut 2-0 @1..3"])
def test_the_ways_around_faults_send_no_frame_the_table_refuses(faults: str) -> None:
    """Relays, pushes, checks and their answers, link memory's detours and probes, on the
    rotated trees of several chunks: every frame fits the table."""
    world = 7
    net = SimNetwork(world, timeout_s=0.2, timeout_policy="static", faults=faults, chunk_bytes=64)
    _exact(net, world, range(12))
    causes = {n.cause.name for _r, n in net.notes}
    assert {"DATA_CAME_AROUND", "LINK_MARKED_FAILED"} <= causes, causes
    assert not _dropped_for_role(net)


def test_a_close_and_an_abort_send_no_frame_the_table_refuses() -> None:
    world = 7
    net = SimNetwork(world, straggler_policy="deadline", straggler_grace_s=0.05)
    for r in range(world):
        if r != 4:
            net.submit(r, 0, np.ones(16, np.float32), closable=True)
    net.run_until_finished(0, ranks=[r for r in range(world) if r != 4])
    assert any(n.cause.name == "STEP_CLOSED" for _r, n in net.notes)
    for r in range(world):  # a mismatched tensor: the step aborts everywhere
        net.submit(r, 1, np.ones(16 if r != 5 else 8, np.float32))
    net.run_until_finished(1, ranks=[r for r in range(world) if r != 4])
    assert not isinstance(net.outcome(0, 1), StepResult)
    assert not _dropped_for_role(net)
