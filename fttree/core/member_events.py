"""What goes into the membership and what comes out: its events, its actions, the value a view
change agrees on (with its catch-up plan as it travels) and the status it shows. Membership
(membership.py) takes the events and routes them to its parts; the driver and the replica carry
out the actions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .effects import CancelTimer, Send, SetTimer, TimerKey
from .messages import Agreement, Detection, Join, Notice
from .view import View


class MemberState(Enum):
    """Where this rank stands in its view: the last two are final."""

    ACTIVE = "active"
    CHANGING = "changing"  # promised in a view change: results are fenced until it is decided
    MINORITY = "minority"  # on the side of a partition without a majority: produces no results
    EVICTED = "evicted"  # the group went on without this rank


# ---- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerDown:
    """The transport could not reach `peer`: its connection was refused."""

    peer: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Busy:
    """This rank has had a step in flight since `since` (None: idle); `step` is the newest
    step it submitted (members done before it leave the view)."""

    since: float | None
    step: int = -1


MemberFrame = Detection | Agreement | Join | Notice  # the frames the membership takes (messages.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlReceived:
    msg: MemberFrame


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberTimer:
    key: TimerKey


@dataclass(frozen=True, slots=True, kw_only=True)
class Uplink:
    """This rank's uplink, as its transport measured it (bytes per second), and the longest
    retransmission timeout of its links to its neighbours (TCP's, without backoff)."""

    rate: float
    retransmit_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Fenced:
    """The node fenced its results as asked (Fence); `held` are the steps it holds complete
    results of, final from now on."""

    held: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Boundary:
    """The caller began training step `user_step`: joins and pace changes take effect at such
    boundaries, and one that waited for the last to take effect may be agreed now."""

    user_step: int


MemberEvent = PeerDown | Busy | ControlReceived | MemberTimer | Fenced | Uplink | Boundary


# ---- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CatchUp:
    step: int
    holder: int
    lacking: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """Stop taking or producing results of the current view, then report the steps held
    (the Fenced event)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Installed:
    """A new view: run the uncommitted steps in it, and carry out the catch-up plan. A view
    that only adds `joined` ranks takes effect at training step `activate_at` (the tree keeps
    the old view until this rank reaches it); otherwise at once (`activate_at` is -1)."""

    view: View
    previous: View
    committed: frozenset[int]
    catch_up: tuple[CatchUp, ...]
    evicted: tuple[int, ...]
    reason: str
    joined: tuple[int, ...] = ()
    activate_at: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """A join is being agreed (`on`): start no new training step until it is decided, so the
    step it takes effect at is still ahead of this rank; `on=False`: go on."""

    on: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Stopped:
    """This rank can produce no more results: its side has no majority, or it was evicted."""

    state: MemberState
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Suspected:
    """This rank has begun to suspect `peer` (for the log: a suspicion on a healthy link is a
    false event, and the reason says what the evidence was)."""

    peer: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Doubted:
    """This process did not run for `frozen_s`: it may have been left out
    meanwhile, so its results wait until one of `asked` confirms it is still a member
    (self_check.py)."""

    frozen_s: float
    asked: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Confirmed:
    """A neighbour (`by`) confirmed this rank is still a member after a freeze of `frozen_s`, or
    (`by` -1) it has no neighbour, or a view change kept it: the results kept back go out."""

    frozen_s: float
    by: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NotCoordinator:
    """A VIEW_COMMIT of this view from a member that is not the coordinator its ballot names:
    dropped, changing nothing (for the driver to count with the other foreign frames)."""

    msg: Agreement


MemberAction = (Send | SetTimer | CancelTimer | Fence | Installed | Stopped | Hold | Suspected | NotCoordinator
                | Doubted | Confirmed)


# ---- the value agreed on -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewValue:
    epoch: int
    members: tuple[int, ...]
    committed: tuple[int, ...]
    plan: tuple[int, ...]
    user_step: int = -1  # a join or a pace change: the training step it takes effect at (-1: at once)
    pace: int = 0  # the view's pace (view.py)
    uplinks: tuple[int, ...] = ()  # the members' measured uplinks, in the order of `members` (view.py)

    @classmethod
    def of(cls, msg: Agreement) -> ViewValue | None:
        if not msg.proposed:
            return None
        return cls(epoch=msg.proposed, members=msg.members, committed=msg.committed, plan=msg.plan,
                   user_step=msg.user_step, pace=msg.pace, uplinks=msg.uplinks)

    def fields(self) -> dict[str, Any]:
        return {"proposed": self.epoch, "members": self.members, "committed": self.committed, "plan": self.plan,
                "user_step": self.user_step, "pace": self.pace, "uplinks": self.uplinks}


def flatten_plan(plan: Iterable[CatchUp]) -> tuple[int, ...]:
    out: list[int] = []
    for c in plan:
        out += [c.step, c.holder, len(c.lacking), *c.lacking]
    return tuple(out)


def unflatten_plan(flat: Sequence[int]) -> tuple[CatchUp, ...]:
    out, i = [], 0
    while i + 3 <= len(flat):
        step, holder, n = flat[i], flat[i + 1], flat[i + 2]
        if n < 0 or i + 3 + n > len(flat):
            raise ValueError(f"catch-up plan is cut short at item {i}")
        out.append(CatchUp(step=step, holder=holder, lacking=tuple(flat[i + 3:i + 3 + n])))
        i += 3 + n
    if i != len(flat):
        raise ValueError("catch-up plan has trailing items")
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Eviction:
    rank: int
    epoch: int  # the view it was left out of
    reason: str
    detected_after_s: float  # from the first suspicion to the commit
    suspected_by: tuple[int, ...]  # the ranks whose reports this rank heard


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberStatus:
    """For /status and /metrics: suspicions, the agreement, and what was evicted."""

    state: MemberState
    epoch: int
    reason: str  # why this rank stopped, if it did
    suspects: dict[int, tuple[int, ...]]  # suspect -> the ranks suspecting it
    evictions: tuple[Eviction, ...]  # newest last
    evicted_total: int
    node_deadline_s: float
    suspicions_total: int = 0  # neighbours this rank has suspected (each once per suspicion)
    no_change: str = ""  # why the last look for a view change started none ("": it started one, or none looked yet)
    self_checks: int = 0  # freezes this rank noticed, each checked with its neighbours
    self_check_stops: int = 0  # of those, the checks no neighbour confirmed: this rank stopped
