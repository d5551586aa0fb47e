"""What the replica hands back to its driver, and the keys it hands back with them.

The effect types (send a frame, arm or cancel a timer, a step's result or failure, a note
worth counting, an op voided by a view change) live apart from the tree machine so that the
membership, the transport and the status pages can speak them without importing the tree
allreduce itself. The driver's whole job is to carry these out: it decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, NamedTuple

import numpy as np

from .messages import Frame, Sender
from .roles import RoleRule


class TimerKind(Enum):
    REDUCE_WATCH = "reduce_watch"  # observer waits for META_REDUCE_RECEIVED(peer)
    BCAST_WATCH = "bcast_watch"  # observer waits for META_BCAST_RECEIVED from peer
    DEADLINE = "deadline"  # this node gives up on the op
    ROOT_DEADLINE = "root_deadline"  # the root gives up waiting for contributions
    LINGER = "linger"  # a finished op is kept this long to serve late observers
    PROBE = "probe"  # time to probe a primary link marked failed (link memory)
    STRAGGLER = "straggler"  # a root closes its op without its late inputs (stragglers.py)
    MEMBER_CHECK = "member_check"  # membership: look for silent neighbours while a step is in flight
    MEMBER_CONFIRM = "member_confirm"  # membership: a suspicion may have stood long enough
    MEMBER_ROUND = "member_round"  # membership: the coordinator's round deadline
    MEMBER_STALL = "member_stall"  # membership: fenced and no decision yet
    MEMBER_DOUBT = "member_doubt"  # membership: after a freeze, ask the neighbours again (self_check.py)


@dataclass(frozen=True, slots=True)
class TimerKey:
    kind: TimerKind
    step: int
    chunk: int
    peer: int = -1
    epoch: int = 0  # an op's timers fire for that op only, not for the same step run again in a later view


class AbortCode(IntEnum):
    UNREACHABLE = 1  # contributions or the result could not reach some ranks
    MISMATCH = 2  # workers submitted different tensors
    TIMEOUT = 3  # this node's own deadline passed
    NONFINITE = 4  # a rank's contribution held NaN or Inf (Config.nonfinite = "abort")


class NoteKind(Enum):
    """What a note is counted as (metrics, /status)."""

    CHECK = "check"  # a backup watch ran out and asked the sender whether its frame gets through
    TIMEOUT = "timeout"  # a backup watch expired and the check confirmed it: a primary link looks broken
    RECOVERY = "recovery"  # data went around a link that lost it
    DETOUR = "detour"  # data took the way around a link that link memory marked failed
    DUPLICATE = "duplicate"  # a copy was dropped (exactly-once at work)
    STALE = "stale"  # a message of a retired op was dropped
    PROTOCOL = "protocol"  # a message broke the protocol and was dropped
    LINK = "link"  # a primary link was marked failed, or put back into use
    NONFINITE = "nonfinite"  # a contribution held NaN or Inf and was left out of its step
    LATE = "late"  # a step closed without a straggler's contribution (stragglers.py)
    WAIT = "wait"  # a step waits past its deadline on a live member still computing it


class Cause(Enum):
    """Exactly what happened; `Note.link` names the primary link (child, parent) it is about."""

    LINK_CHECKED = "link_checked"  # an observer heard no confirmation in time and asked the sender
    WATCH_EXPIRED = "watch_expired"  # ... and the sender said its frame did not get through, or never answered
    DATA_CAME_AROUND = "data_came_around"  # (parent) a child's lost sum arrived through a relay
    DATA_RELAYED = "data_relayed"  # (observer) carried a child's sum to its parent
    RESULT_CAME_AROUND = "result_came_around"  # the result reached this rank through a backup
    RESULT_PUSHED = "result_pushed"  # (backup) sent the result to a rank directly
    DETOUR = "detour"  # data or result went the planned way around a link marked failed
    LINK_MARKED_FAILED = "link_marked_failed"  # link memory: later steps route around our uplink
    LINK_BACK_IN_USE = "link_back_in_use"  # probes answered long enough: the uplink is used again
    DUPLICATE_DROPPED = "duplicate_dropped"
    STALE_DROPPED = "stale_dropped"
    PROTOCOL_VIOLATION = "protocol_violation"
    NONFINITE_SKIPPED = "nonfinite_skipped"  # this rank's contribution held NaN or Inf: left out
    STEP_CLOSED = "step_closed"  # (root) closed an op without the late rank(s) of child `peer`'s subtree
    LATE_DROPPED = "late_dropped"  # this rank's contribution came `seconds` after its step closed: not added
    STILL_COMPUTING = "still_computing"  # a deadline was put off: member `peer` is alive and has not submitted yet

    @property
    def kind(self) -> NoteKind:
        return _KIND_OF[self]


_KIND_OF = {
    Cause.LINK_CHECKED: NoteKind.CHECK,
    Cause.WATCH_EXPIRED: NoteKind.TIMEOUT,
    Cause.DATA_CAME_AROUND: NoteKind.RECOVERY, Cause.DATA_RELAYED: NoteKind.RECOVERY,
    Cause.RESULT_CAME_AROUND: NoteKind.RECOVERY, Cause.RESULT_PUSHED: NoteKind.RECOVERY,
    Cause.DETOUR: NoteKind.DETOUR,
    Cause.LINK_MARKED_FAILED: NoteKind.LINK, Cause.LINK_BACK_IN_USE: NoteKind.LINK,
    Cause.DUPLICATE_DROPPED: NoteKind.DUPLICATE, Cause.STALE_DROPPED: NoteKind.STALE,
    Cause.PROTOCOL_VIOLATION: NoteKind.PROTOCOL,
    Cause.NONFINITE_SKIPPED: NoteKind.NONFINITE,
    Cause.STEP_CLOSED: NoteKind.LATE, Cause.LATE_DROPPED: NoteKind.LATE,
    Cause.STILL_COMPUTING: NoteKind.WAIT,
}


class LinkState(NamedTuple):
    """What the sending end's transport knows about its frames to one peer: handed to the
    machine with a backup node's question whether they are getting through (a slow link is
    not a broken one)."""

    pending_bytes: int = 0  # queued, or sent and not yet acknowledged by the peer
    stalled: bool = False  # bytes are outstanding and the peer has acknowledged nothing for a while
    lost_at: float = -float("inf")  # when a frame to the peer was last lost (a dropped connection, an injected fault)


# ---- actions ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Void:
    """An op of a view that was left without a result anywhere: it is dropped here, and the
    driver runs its step again in the new view or hands it back to the caller (by policy)."""

    step: int
    chunk: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Send:
    dst: int
    msg: Frame


@dataclass(frozen=True, slots=True, kw_only=True)
class SetTimer:
    key: TimerKey
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelTimer:
    key: TimerKey


@dataclass(frozen=True, slots=True, kw_only=True)
class Complete:
    step: int
    chunk: int
    result: np.ndarray  # read-only view; copy before handing it to a user
    contributors: tuple[int, ...]
    late: tuple[int, ...] = ()  # members that took part with zeros, late (stragglers.py): not counted


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    step: int
    chunk: int
    code: AbortCode
    reason: str
    peers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Note:
    """Something worth counting or showing (recoveries, timeouts, dropped copies): structured
    fields for status and metrics, and a sentence for people."""

    step: int
    cause: Cause
    text: str
    peer: int = -1  # the other rank it concerns
    link: tuple[int, int] | None = None  # the primary link (child, parent) it is about
    seconds: float | None = None  # LATE_DROPPED: how late the contribution came, after its step closed

    @property
    def kind(self) -> NoteKind:
        return self.cause.kind

    def as_record(self) -> dict[str, Any]:
        """A JSON-ready form, for step records and logs."""
        return {"step": self.step, "kind": self.kind.value, "cause": self.cause.value, "peer": self.peer,
                "link": None if self.link is None else f"{self.link[0]}-{self.link[1]}", "text": self.text,
                "seconds": self.seconds}


@dataclass(frozen=True, slots=True, kw_only=True)
class Foreign:
    """`msg` was dropped, changing nothing: its sender may not send it. `rule` is the rule it
    broke: a sender rule (messages.SENDER_RULES, the replica's check), or for a step's frame the
    role its sender must have in the frame's tree (roles.ROLE_RULES, the tree machine's check).
    For the driver to count and log."""

    msg: Frame
    rule: Sender | RoleRule


Action = Send | SetTimer | CancelTimer | Complete | Fail | Note | Void | Foreign

__all__ = [
    "AbortCode", "Action", "CancelTimer", "Cause", "Complete", "Fail", "Foreign", "LinkState", "Note", "NoteKind",
    "Send", "SetTimer", "TimerKey", "TimerKind", "Void",
]
