"""A worker's life cycle as one transition table: from its start to the end of its results.

A process starts by asking its peers whether a group already runs (STARTING). If none does it
is a first start and connects to its tree neighbours (CONNECTING); if one does, or it was told to
join, it asks to be admitted (ASKING) and, once admitted, connects (ADMITTED). Then it takes part
(ACTIVE) until it leaves (LEAVING) or stops: left out of a view, on a minority side, closed,
crashed (STOPPED, for good: a new process must join again). View changes happen inside ACTIVE
and LEAVING; the membership machine tracks them (core/membership.py).

The replica moves through the table with `Lifecycle.on(event)` as the driver's news comes
(`Replica.step`: FirstStart, GroupFound, Connected, Leave, Stop, and an admission it hears);
an event that the table does not allow in the current phase is a bug, named with both, never
a silent change.
"""

from __future__ import annotations

from enum import Enum

from ..errors import FTTreeError


class Phase(Enum):
    STARTING = "starting"  # asking the peers whether a group runs
    ASKING = "asking"  # a joiner: asking the group to admit it
    CONNECTING = "connecting"  # a first start: connecting to the tree neighbours
    ADMITTED = "admitted"  # a joiner the group admitted: connecting to its tree neighbours
    ACTIVE = "active"  # taking part in steps and views
    LEAVING = "leaving"  # said it leaves: waiting for the view without it
    STOPPED = "stopped"  # produces no more results (left out, minority, closed, crashed)


class Life(Enum):
    FIRST_START = "every peer is starting too"
    GROUP_FOUND = "a group runs already"
    ADMITTED = "the group admitted it"
    CONNECTED = "its tree neighbours are reachable"
    LEAVE = "it leaves"
    STOP = "it stops"


TRANSITIONS: dict[tuple[Phase, Life], Phase] = {
    (Phase.STARTING, Life.FIRST_START): Phase.CONNECTING,
    (Phase.STARTING, Life.GROUP_FOUND): Phase.ASKING,
    (Phase.ASKING, Life.ADMITTED): Phase.ADMITTED,
    (Phase.CONNECTING, Life.CONNECTED): Phase.ACTIVE,
    (Phase.ADMITTED, Life.CONNECTED): Phase.ACTIVE,
    (Phase.ACTIVE, Life.LEAVE): Phase.LEAVING,
    **{(phase, Life.STOP): Phase.STOPPED for phase in Phase},
}

#: phases in which frames from members are kept for later, not handled: the process does not
#: know yet whether it is in a group, or which view (a restarted process may be handed frames its
#: previous incarnation's peers had queued, which must not be answered from the first view)
EARLY_PHASES = frozenset({Phase.STARTING, Phase.ASKING, Phase.CONNECTING})
#: phases in which a broken link is news (before, peers are still starting up)
RUNNING_PHASES = frozenset({Phase.ACTIVE, Phase.LEAVING})


class LifecycleError(FTTreeError):
    """An event the transition table does not allow in the current phase (a bug)."""


class Lifecycle:
    """Where one process is in TRANSITIONS."""

    __slots__ = ("early", "phase", "running")

    def __init__(self, *, join: bool = False) -> None:
        self.phase = Phase.ASKING if join else Phase.STARTING
        self.early = True  # phase in EARLY_PHASES, kept as a field: the node asks it for every frame
        self.running = False  # phase in RUNNING_PHASES, likewise (for every read of a large frame)

    def on(self, event: Life) -> Phase:
        """Take `event`; raises LifecycleError if the table has no such move from here."""
        nxt = TRANSITIONS.get((self.phase, event))
        if nxt is None:
            raise LifecycleError(f"{event.name} ({event.value}) cannot happen in phase {self.phase.value}")
        self.phase = nxt
        self.early = nxt in EARLY_PHASES
        self.running = nxt in RUNNING_PHASES
        return nxt

    def __repr__(self) -> str:
        return f"Lifecycle({self.phase.value})"
