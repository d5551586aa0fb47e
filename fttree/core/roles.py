"""Who in a tree may send each of a step's frames: the role column of the message table.

messages.SENDER_RULES says whose frames a worker takes at all (a member, a coordinator, a rank
that proved the job's key). A step's frame (the `Message` family) also has a place in a tree:
its op's tree, or for a probe the tree it names. `ROLE_RULES` says, for every such kind, which
neighbours of the receiver in that tree may send it (`Role`) and how the frame's `origin` or
`target` must sit beside the two (`Tie`). `role_allows` is the one check: the tree machine
makes it once per frame, before any handler runs, and a frame that breaks it is dropped,
changes nothing, and is counted and logged once as `Foreign`, like a frame from a non-member.

The rules follow from who sends what (protocol.py). Each check of the reduce or the broadcast
is about one primary link, child c -> parent p, watched by c's brother and uncle (its
observers): c tells them it sent (META_REDUCE_SENT), p tells them it received
(META_REDUCE_RECEIVED) or sent on (META_BCAST_SENT), an observer asks c or p (the *_REQUESTs)
and is answered (DATA_REDUCE_REQUEST, META_STALLED), and it relays a sum to p or pushes the
result to c. Seen from the receiver, c's brother is a child of p or p's brother and c's uncle is
p's brother or c's parent's brother, which gives the rows below: every frame the machine sends
fits them (tests/test_roles.py walks the table; tests/test_protocol_sim.py finds no frame
dropped under any single link failure).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from .messages import Kind, Message
from .topology import Neighbours


class Role(Enum):
    """Who the sender of a step's frame is to its receiver, in the frame's tree."""

    PARENT = "the receiver's parent"
    CHILD = "a child of the receiver"
    BROTHER = "the receiver's brother"
    UNCLE = "the receiver's uncle"
    NEPHEW = "a child of the receiver's brother"
    STRANGER = "a member that is no neighbour of the receiver in the frame's tree"


class Tie(Enum):
    """How the frame's `origin` or `target` must sit beside its sender and receiver: the link the
    frame is about."""

    NONE = "no field"
    ORIGIN_MY_CHILD = "`origin` is a child of the receiver (whose subtree sum it is)"
    TARGET_SENDERS_PARENT = "`target` is the sender's parent (the sender's uplink, which the receiver watches)"
    TARGET_MY_PARENT = "`target` is the receiver's parent (the receiver's uplink, which the sender watches)"
    ORIGIN_SENDERS_CHILD = ("`origin` is a child of the sender other than the receiver (a link the receiver "
                            "watches)")
    TARGET_SENDERS_CHILD = ("`target` is a child of the sender other than the receiver (a link the receiver "
                            "watches)")
    TARGET_MY_CHILD = "`target` is a child of the receiver other than the sender (a link the sender watches)"


class RoleRule(NamedTuple):
    """One row's role column: the roles that may send the kind, and the tie its fields must meet."""

    senders: frozenset[Role]
    tie: Tie = Tie.NONE

    @property
    def text(self) -> str:
        """The rule in words, for the log."""
        who = " or ".join(role.value for role in sorted(self.senders, key=lambda r: list(Role).index(r)))
        return who if self.tie is Tie.NONE else f"{who}, where {self.tie.value}"


P, C, B, U, N = Role.PARENT, Role.CHILD, Role.BROTHER, Role.UNCLE, Role.NEPHEW
NEIGHBOURS = frozenset({P, C, B, U, N})
ANYONE = frozenset(Role)

#: every kind of the `Message` family -> who in the frame's tree may send it
ROLE_RULES: dict[Kind, RoleRule] = {
    # the reduce: c's sum to p, or relayed by c's brother (p's other child) or uncle (p's brother)
    Kind.DATA_REDUCE: RoleRule(frozenset({C, B}), Tie.ORIGIN_MY_CHILD),
    # c tells its observers (its brother and uncle) it sent its sum to p; again, answering a check
    Kind.META_REDUCE_SENT: RoleRule(frozenset({B, N}), Tie.TARGET_SENDERS_PARENT),
    # p tells c's observers (its own other child, its brother) that c's sum came
    Kind.META_REDUCE_RECEIVED: RoleRule(frozenset({P, B}), Tie.ORIGIN_SENDERS_CHILD),
    # an observer of c's uplink asks c
    Kind.META_REDUCE_REQUEST: RoleRule(frozenset({B, U}), Tie.TARGET_MY_PARENT),
    # c hands its sum to an observer to relay (asked, or its uplink marked failed)
    Kind.DATA_REDUCE_REQUEST: RoleRule(frozenset({B, N}), Tie.TARGET_SENDERS_PARENT),
    # the result: from p, or pushed by an observer of the receiver's uplink
    Kind.DATA_BCAST: RoleRule(frozenset({P, B, U})),
    # c tells its observers it has the result
    Kind.META_BCAST_RECEIVED: RoleRule(frozenset({B, N})),
    # p tells c's observers it sent c the result; again, answering a check
    Kind.META_BCAST_SENT: RoleRule(frozenset({P, B}), Tie.TARGET_SENDERS_CHILD),
    # a failed op floods every neighbour
    Kind.ABORT: RoleRule(NEIGHBOURS),
    # link memory: c probes its uplink, p answers
    Kind.PROBE: RoleRule(frozenset({C})),
    Kind.PROBE_ACK: RoleRule(frozenset({P})),
    # an observer of c's uplink asks p whether its result to c is getting through...
    Kind.META_BCAST_REQUEST: RoleRule(frozenset({C, B}), Tie.TARGET_MY_CHILD),
    # ...and p says it is not
    Kind.META_STALLED: RoleRule(frozenset({P, B}), Tie.TARGET_SENDERS_CHILD),
    # a root closes a step without its late ranks, down the tree
    Kind.META_CLOSE: RoleRule(frozenset({P})),
    # a committed result after a view change, from whichever member holds it
    Kind.CATCHUP: RoleRule(ANYONE),
}


# the hot path reads these as module globals (an Enum member as a class attribute costs more)
_PARENT, _CHILD, _BROTHER, _UNCLE, _NEPHEW, _STRANGER = (Role.PARENT, Role.CHILD, Role.BROTHER, Role.UNCLE, Role.NEPHEW,
                                                        Role.STRANGER)
_NO_TIE, _TARGET_SENDERS_CHILD, _ORIGIN_SENDERS_CHILD = Tie.NONE, Tie.TARGET_SENDERS_CHILD, Tie.ORIGIN_SENDERS_CHILD
_TARGET_SENDERS_PARENT, _ORIGIN_MY_CHILD, _TARGET_MY_PARENT = (Tie.TARGET_SENDERS_PARENT, Tie.ORIGIN_MY_CHILD,
                                                               Tie.TARGET_MY_PARENT)


def sender_role(me: Neighbours, src: int) -> Role:
    """Who `src` is to the rank whose neighbours are `me` (the heap gives each rank one role)."""
    if src == me.parent:
        return _PARENT
    if src in me.children:
        return _CHILD
    if src == me.brother:
        return _BROTHER
    if src == me.uncle:
        return _UNCLE
    if src in me.nephews:
        return _NEPHEW
    return _STRANGER


def roles_of(me: Neighbours) -> dict[int, Role]:
    """Every neighbour's role, to look up (a tree keeps one: tree_links.Tree.roles)."""
    roles = dict.fromkeys(me.nephews, Role.NEPHEW)
    for rank, role in ((me.uncle, Role.UNCLE), (me.brother, Role.BROTHER), (me.parent, Role.PARENT)):
        if rank is not None:
            roles[rank] = role
    roles.update(dict.fromkeys(me.children, Role.CHILD))
    return roles


def role_allows(msg: Message, me: Neighbours, roles: dict[int, Role] | None = None) -> bool:
    """May `msg` come from its sender to the rank whose neighbours, in the frame's tree, are
    `me` (`roles`: roles_of(me), kept)? Two dict lookups and a few comparisons: every step's
    frame passes here."""
    rule = ROLE_RULES.get(msg.kind)
    if rule is None:
        return False
    role = sender_role(me, msg.src) if roles is None else roles.get(msg.src, _STRANGER)
    if role not in rule.senders:
        return False
    tie = rule.tie
    if tie is _NO_TIE:
        return True
    if tie is _TARGET_SENDERS_CHILD or tie is _ORIGIN_SENDERS_CHILD:  # (the busiest first)
        # a child of the sender but us: our parent's is our brother; our brother's, our nephews
        field = msg.target if tie is _TARGET_SENDERS_CHILD else msg.origin
        if role is _PARENT:
            return field == me.brother
        return role is _BROTHER and field in me.nephews
    if tie is _TARGET_SENDERS_PARENT:  # a brother's parent is ours; a nephew's is our brother
        return msg.target == (me.parent if role is _BROTHER else me.brother if role is _NEPHEW else None)
    if tie is _ORIGIN_MY_CHILD:
        return msg.origin in me.children
    if tie is _TARGET_MY_PARENT:
        return msg.target == me.parent
    return msg.target in me.children and msg.target != msg.src  # TARGET_MY_CHILD
