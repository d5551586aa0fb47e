"""What one rank knows about one op (step, chunk), in the parts the tree machine's parts use.

An `Op` holds its identity and life (submitted, done, failed) itself and the rest in four
small records, one per part of the algorithm (protocol.py): the reduce up the tree, the
broadcast down it, the backup-node watches of neighbours' links, and the straggler close.
Each part reads and writes its own record; plain attributes, so the per-frame code pays one
attribute load per part, no method call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .effects import Fail
from .messages import Message
from .timeouts import Phase

OpId = tuple[int, int]  # (step, chunk)
WatchId = tuple[Phase, int]  # (phase, the watched rank: a reduce's origin or a broadcast's target)


@dataclass(slots=True)
class ReduceState:
    """The subtree sum: what is added here, and how it went up to the parent."""

    acc: np.ndarray | None = None  # own contribution plus children's subtree sums (a buffer of its own)
    acc_wire: tuple[np.ndarray, str] | None = None  # our sum as it travels, once sent up (it no longer changes)
    contributors: set[int] = field(default_factory=set)
    got_children: set[int] = field(default_factory=set)
    held: dict[int, Message] = field(default_factory=dict)  # child -> its data, not added yet (add_in_order)
    added: int = 0  # how many children, in slot order, are in `acc`
    sent: bool = False  # our subtree sum went up (at the root: the result was made)
    sent_at: float = 0.0  # when our subtree sum went to the parent
    rerouted: bool = False  # our subtree sum was re-sent through a relay after a link failure
    rerouted_planned: bool = False  # ... because link memory had marked our uplink failed (a detour)
    sent_direct: bool = False  # ... and then also straight to the parent, as the way around did not get through
    requested_by: list[int] = field(default_factory=list)  # observers that asked us for our sum
    relayed_children: dict[int, int] = field(default_factory=dict)  # child -> relay that brought its sum, this op


@dataclass(slots=True)
class BroadcastState:
    """The result: what it is, whom it holds, and when this rank took it."""

    result: np.ndarray | None = None
    wire: tuple[np.ndarray, str] | None = None  # the result as it travels, when encoded
    contributors: tuple[int, ...] = ()
    late: tuple[int, ...] = ()  # late ranks whose zeros are in the result
    finished_at: float = 0.0  # when we took the result (and sent it to our children)


@dataclass(slots=True)
class Watches:
    """This rank as a backup node (brother or uncle) of its neighbours' links, and as the
    watched end answering their checks."""

    reduce_confirmed: set[int] = field(default_factory=set)
    reduce_tries: dict[int, int] = field(default_factory=dict)
    relayed_for: set[int] = field(default_factory=set)
    detoured_for: set[int] = field(default_factory=set)  # of those, relayed on a planned detour
    bcast_confirmed: set[int] = field(default_factory=set)
    bcast_tries: dict[int, int] = field(default_factory=dict)
    bcast_pending: set[int] = field(default_factory=set)  # to push the result to once we hold it
    started: dict[WatchId, tuple[float, int, float]] = field(default_factory=dict)  # (at, bytes, rate)
    fired: set[WatchId] = field(default_factory=set)  # Karn: no samples from these
    checked_at: dict[WatchId, float] = field(default_factory=dict)  # a check asked, not answered yet
    delivered_told: dict[int, int] = field(default_factory=dict)  # observer -> times told our data was delivered
    delivered_heard: dict[WatchId, int] = field(default_factory=dict)  # watch -> "delivered" answers


@dataclass(slots=True)
class StragglerState:
    """Late ranks (stragglers.py): who took part with zeros, and the root's close."""

    late: set[int] = field(default_factory=set)  # late ranks whose zeros are in `acc`
    closed_at: float = -1.0  # when this rank's own contribution was closed out (it took part with zeros)
    computing: tuple[int, ...] = ()  # members whose caller had not submitted the op when a deadline was put off
    taken: bool = False  # ... and its caller's contribution came after all (not added)
    arrivals: list[float] = field(default_factory=list)  # (root) when each input came: own, then children's
    close_armed: bool = False  # (root) its STRAGGLER timer is set
    closed_children: set[int] = field(default_factory=set)  # children sent META_CLOSE
    closable: bool = False  # the step may close without late ranks (Submit.closable, or the children's sums say so)


@dataclass(slots=True)
class Op:
    """Everything one node knows about one op (step, chunk)."""

    step: int
    chunk: int
    epoch: int = 0  # the view it runs in
    chunks: int = 1  # how many chunks its step has (which tree it runs on depends on it)
    tree: int = 0  # the tree it runs on (TreeMachine.tree_of)
    submitted: bool = False
    maker: int = -1  # the rank whose frame made it before this rank submitted it (-1: ours; MachineBase._get_op)
    signature: str = ""
    dtype: str = ""
    own: np.ndarray | None = None  # our contribution, never written to: a step may run again on it
    combine: np.ufunc = np.add  # how contributions meet (Submit.reduce)
    wire: str = ""  # what our sums and the result we make travel as (Submit.compression; "" before the submit)
    done: bool = False  # Complete or Fail was emitted
    failure: Fail | None = None
    aborted: bool = False  # ABORT already flooded from here
    started: float = 0.0  # when it was submitted here
    nbytes: int = 0  # our contribution's size
    awaiting_catchup: bool = False  # committed in the view it ran in; its result comes straight from a holder
    linger_over: bool = False  # its linger ended during a view change: kept until the change is installed
    reduce: ReduceState = field(default_factory=ReduceState)
    bcast: BroadcastState = field(default_factory=BroadcastState)
    watches: Watches = field(default_factory=Watches)
    stragglers: StragglerState = field(default_factory=StragglerState)
