"""What the membership knows for one view only, in one record that a view change replaces whole.

A view's suspicions, this rank's part in agreeing the next view, the joiners it does not watch
yet and the ranks it told of the view's decision mean nothing in the next view. They used to be
fields of Membership that the install reset one by one (seventeen of them), so a field added
later had to be remembered there; now the next view starts from a fresh `Term`. What does carry
over (who finished or leaves, measured rates, ping round trips, the decided join's step) lives in
the part that keeps it, which filters it to the new view (detection.py, joins.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .member_events import MemberState, ViewValue
from .view import View


@dataclass(slots=True)
class Suspicions:
    """Who is suspected in this view, by whom and since when (detection.py)."""

    mine: dict[int, str] = field(default_factory=dict)  # this rank's own suspicions -> why
    reports: dict[int, set[int]] = field(default_factory=dict)  # suspect -> reporters
    standing: dict[int, float] = field(default_factory=dict)  # suspect -> since when it stands unrefuted
    first: dict[int, float] = field(default_factory=dict)  # suspect -> the first report this view
    refute: set[int] = field(default_factory=set)  # suspects pinged to check them for the others
    ping_since: dict[int, float] = field(default_factory=dict)  # silent neighbour -> its first unanswered ping

    def reported(self, rank: int) -> bool:
        """Does anyone here suspect `rank` (this rank, or a report it heard)?"""
        return rank in self.mine or bool(self.reports.get(rank))


@dataclass(slots=True)
class Round:
    """A view change this rank coordinates (agreement.py)."""

    ballot: int
    dead: frozenset[int]
    joining: tuple[int, ...] = ()  # a join round: these ranks are added, nobody fences
    pace: bool = False  # a pace round: the same members at the slowest promised uplink, nobody fences
    rates: dict[int, int] = field(default_factory=dict)  # promiser -> its measured uplink (0: not measured)
    user_steps: dict[int, int] = field(default_factory=dict)  # promiser -> its current training step
    accepting: bool = False
    promises: dict[int, tuple[tuple[int, ...], int, ViewValue | None]] = field(default_factory=dict)
    refusals: set[int] = field(default_factory=set)
    value: ViewValue | None = None
    accepts: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Ballots:
    """This rank's part in agreeing the view after this one (agreement.py): as a member, what it
    promised, accepted and reported held; as coordinator, its round."""

    round: Round | None = None
    promised: int = 0  # the highest ballot promised (0: none)
    accepted: tuple[int, ViewValue] | None = None  # (ballot, value) accepted
    held: tuple[int, ...] | None = None  # once fenced: the steps reported held
    # (ballot, coordinator) promised before the node reported the steps it holds
    waiting: list[tuple[int, int]] = field(default_factory=list)
    stalls: int = 0  # stall deadlines passed in this view change
    holding: bool = False  # promised in a join or pace round: start no training step until it is decided


@dataclass(slots=True)
class Term:
    """One view and what this rank knows only for it."""

    view: View
    installed_at: float = 0.0
    state: MemberState = MemberState.ACTIVE  # MINORITY and EVICTED are final: no later view is installed
    decided: tuple[int, ViewValue] | None = None  # the change that installed this view: (its base epoch, value)
    unheard: set[int] = field(default_factory=set)  # joiners of this view, until heard or their join takes effect here
    pace_asked: bool = False  # this rank asked for a pace round in this view
    told: set[int] = field(default_factory=set)  # ranks told of this view's decision (stale senders)
    suspicions: Suspicions = field(default_factory=Suspicions)
    ballots: Ballots = field(default_factory=Ballots)
