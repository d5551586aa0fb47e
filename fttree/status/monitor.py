"""What one worker knows about its links and steps, frozen into snapshots for /status and /metrics.

A Monitor listens to its Node (protocol Notes and finished steps, both on the node's loop) and
keeps one record per link: the worker's own links to its tree neighbours, plus any other link a
note names (an observer hears about its brother's link to their parent). Link states:

    up       no fault seen, or the last finished step used the link without trouble
    suspect  a backup watch timed out on it, or the transport saw errors or injected drops
    failed   data went around it (seen at one of its ends), every frame was dropped, or the
             protocol's link memory marked it failed (probes unanswered)
    probing  failed, and the transport is reconnecting, or its probes are answered again and the
             protocol waits before trusting it

Everything here is read from structured data: each protocol Note names its `cause` and the
primary link (child, parent) it is about, and `Node.status()` gives the link memory, the ops in
flight and the transport's per-link counters. Only the two ends of a link can say it failed: an
observer that relayed may itself have missed a confirmation on another link, so on links of
other workers it records a suspicion. A detour planned by link memory is not news: the link's
state then comes from link memory itself (failed, or probing once probes are answered). A link
goes back to up when a step finishes here with no note about it.

`Monitor.snapshot()` must run on the node's loop; it returns frozen dataclasses that any thread
may read, format or serialise.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .. import logs
from ..core.effects import Cause, Note, NoteKind
from ..core.protocol import OpPhase, TreeStatus
from .metrics import Histogram, HistogramView

if TYPE_CHECKING:
    from ..core.membership import Installed
    from ..net.node import Node, NodeStatus
    from ..net.transport import LinkStatus

log = logging.getLogger("fttree.status.monitor")

LinkKey = tuple[int, int]  # (higher rank, lower rank): the spelling of the fault language


class LinkState(Enum):
    UP = "up"
    SUSPECT = "suspect"
    FAILED = "failed"
    PROBING = "probing"


def link_key(x: int, y: int) -> LinkKey:
    return (x, y) if x > y else (y, x)


def link_name(key: LinkKey) -> str:
    """'1-0': the spelling of the fault language (`cut 1-0`)."""
    return f"{key[0]}-{key[1]}"


#: causes that say data or a result had to go around this link because it lost them
_LOST_ON_LINK = frozenset({Cause.DATA_CAME_AROUND, Cause.DATA_RELAYED, Cause.RESULT_CAME_AROUND,
                           Cause.RESULT_PUSHED})
#: causes where this worker sent data a second time over a backup link
_RESENDS = frozenset({Cause.DATA_RELAYED, Cause.RESULT_PUSHED})


def note_link(note: Note) -> LinkKey | None:
    """The link a note is about, as a link key."""
    return None if note.link is None else link_key(*note.link)


# ---- snapshot types -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkView:
    name: str
    a: int
    b: int
    peer: int | None  # the other end, for this worker's own links
    role: str  # parent, child, brother, uncle, nephew; "observed" for links of other workers
    state: str
    reason: str
    since_step: int | None  # the step of the last change (None: never changed)
    changed_at: float  # unix time of the last change
    rtt_s: float | None = None
    connected: bool | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    injected_drops: int = 0
    errors: int = 0
    recent: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class EventView:
    step: int
    kind: str
    cause: str
    link: str | None
    text: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionView:
    rank: int
    epoch: int  # the view it was left out of
    reason: str
    detected_after_s: float
    suspected_by: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeView:
    """This worker in one tree (Config.trees): its family there and what link memory holds
    about that tree's links. Tree 0 carries every one-chunk step; the others carry chunks of
    larger steps over other links, so a link can fail in some trees and not in others."""

    tree: int
    parent: int | None
    children: tuple[int, ...]
    brother: int | None
    uncle: int | None
    uplink: str  # up, failed (later steps go around it), probing (answered, not trusted yet)
    relays: tuple[int, ...]  # who carries our data around a failed uplink
    relayed_children: tuple[int, ...]  # children whose data last came around a broken link


@dataclass(frozen=True, slots=True, kw_only=True)
class PunchView:
    """Hole punching to a peer this worker reaches only through a relay (net/punch.py)."""

    peer: int
    state: str  # trying, connected (frames go direct), failed (they stay on the relay), lost (back on it)
    tries: int
    connected: int  # punches that connected
    took_s: float  # the last that connected, from the coordinator's GO to both connections proven
    error: str  # why the last one failed or broke
    via: int  # the rank that coordinated the last one


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    rank: int
    world: int
    epoch: int
    members: tuple[int, ...]
    member_state: str  # active, changing, minority, evicted
    stopped: str  # why this rank produces no more results ("" while it does)
    suspects: dict[int, tuple[int, ...]]  # rank -> the ranks suspecting it now
    evictions: tuple[EvictionView, ...]  # newest last
    evicted_total: int
    suspicions_total: int  # neighbours this worker suspected (a healthy group has none)
    self_checks: int  # freezes this worker noticed and checked with its neighbours (core/self_check.py)
    self_check_stops: int  # of those, the checks nobody confirmed: it stopped
    no_change: str  # why the last look for a view change started none (membership's decision)
    node_deadline_s: float
    reruns: int
    address: str
    started_at: float
    at: float
    parent: int | None
    children: tuple[int, ...]
    brother: int | None
    uncle: int | None
    nephews: tuple[int, ...]
    trees: tuple[TreeView, ...]  # tree 0 (its links are `links`), then the others of Config.trees
    step: int | None  # the newest step in flight, else the last finished one
    phase: str  # idle, starting, reduce, broadcast, done
    in_flight: tuple[int, ...]
    steps_ok: int
    steps_failed: int
    last_error: str
    last_steps: tuple[tuple[int, float], ...]  # (step, duration_s), oldest first
    timeouts: int
    recoveries: int
    detours: int
    retransmissions: int
    duplicates: int
    stale: int
    protocol_errors: int
    frame_errors: int
    refusals: int  # connections refused at the handshake
    foreign_frames: int  # frames dropped because their sender may not send them
    empty_sums: int  # subtree sums that named no contributor: nothing of them added
    early_dropped: int  # data frames for steps not submitted here yet, dropped for want of room
    early_dropped_bytes: int
    ops_refused: int  # step frames dropped: over their sender's share (ops, later views' frames), or a cut not ours
    late_streak: dict[int, int]  # member -> steps in a row it was late in (straggler_policy="deadline")
    late_total: dict[int, int]  # member -> steps it was late in
    computing_waits: int  # steps whose deadline was put off for a member still computing (submit_wait_s)
    faults: str
    links: tuple[LinkView, ...]
    observed: tuple[LinkView, ...]
    events: tuple[EventView, ...]
    histogram: HistogramView
    punches: tuple[PunchView, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The /status JSON document."""
        def link(v: LinkView) -> dict[str, Any]:
            d = asdict(v)
            d["rtt_ms"] = None if v.rtt_s is None else round(v.rtt_s * 1000, 3)
            del d["rtt_s"]
            return d

        return {
            "rank": self.rank,
            "world": self.world,
            "view": {"epoch": self.epoch, "members": list(self.members)},
            "membership": {"state": self.member_state, "stopped": self.stopped,
                           "suspects": {str(r): list(by) for r, by in self.suspects.items()},
                           "evictions": [asdict(e) for e in self.evictions], "evicted_total": self.evicted_total,
                           "suspicions_total": self.suspicions_total, "self_checks": self.self_checks,
                           "self_check_stops": self.self_check_stops, "no_change": self.no_change,
                           "node_deadline_s": round(self.node_deadline_s, 3), "reruns": self.reruns},
            "address": self.address,
            "uptime_s": round(self.at - self.started_at, 3),
            "time": self.at,
            "neighbours": {"parent": self.parent, "children": list(self.children), "brother": self.brother,
                           "uncle": self.uncle, "nephews": list(self.nephews)},
            "trees": [asdict(t) for t in self.trees],
            "step": {"current": self.step, "phase": self.phase, "in_flight": list(self.in_flight),
                     "completed": self.steps_ok, "failed": self.steps_failed, "last_error": self.last_error},
            "last_steps": [{"step": s, "duration_s": round(d, 6)} for s, d in self.last_steps],
            "counts": {"timeouts": self.timeouts, "recoveries": self.recoveries, "detours": self.detours,
                       "retransmissions": self.retransmissions, "duplicates": self.duplicates,
                       "stale": self.stale, "protocol_errors": self.protocol_errors,
                       "frame_errors": self.frame_errors, "refusals": self.refusals,
                       "foreign_frames": self.foreign_frames, "empty_sums": self.empty_sums,
                       "early_dropped": self.early_dropped, "early_dropped_bytes": self.early_dropped_bytes,
                       "ops_refused": self.ops_refused},
            "stragglers": {"late_in_a_row": {str(r): n for r, n in sorted(self.late_streak.items())},
                           "late_total": {str(r): n for r, n in sorted(self.late_total.items())},
                           "waited_past_deadline": self.computing_waits},
            "links": [link(v) for v in self.links],
            "observed_links": [link(v) for v in self.observed],
            "hole_punches": [asdict(p) for p in self.punches],
            "recent_events": [asdict(e) for e in self.events],
            "faults": self.faults,
        }


def _tree_view(t: TreeStatus) -> TreeView:
    up, nb = t.uplink, t.neighbours
    state = ("probing" if up.probing else "failed") if up.failed else "up"
    return TreeView(tree=t.tree, parent=nb.parent, children=nb.children, brother=nb.brother, uncle=nb.uncle,
                    uplink=state, relays=up.relays if up.failed else (), relayed_children=t.relayed_children)


# ---- the monitor ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Link:
    key: LinkKey
    role: str
    peer: int | None
    changed_at: float
    state: LinkState = LinkState.UP
    reason: str = "no fault seen"
    since_step: int | None = None
    noted_step: int = -1  # newest step a note named this link in
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=5))
    seen_drops: int = 0
    seen_errors: int = 0
    seen_sent: int = 0
    primary: tuple[int, int] | None = None  # (child, parent), for links of other workers


class Monitor:
    """Watches one Node. Create, use and close it on the node's loop thread."""

    def __init__(self, node: Node, *, world: int | None = None, history: int = 10,
                 clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.rank = node.rank
        self.world = world if world is not None else node.view.size  # the job's ranks, whatever the view
        self.clock = clock
        self.started_at = clock()
        self.histogram = Histogram()
        self.steps_ok = self.steps_failed = self.retransmissions = 0
        self.last_error = ""
        self.last_step: int | None = None
        self.events: deque[EventView] = deque(maxlen=history)
        self._links: dict[LinkKey, _Link] = {}
        self._observed: dict[LinkKey, _Link] = {}
        self._own_links()
        node.note_listeners.append(self._on_note)
        node.step_listeners.append(self._on_step)
        node.view_listeners.append(self._on_view)
        logs.bind_thread(self.rank, self.current_step)

    def _own_links(self) -> None:
        """One record per link to a tree neighbour in the current view; a link that stays a
        link across a view change keeps its history."""
        nb = self.node.machine.me
        old, self._links = self._links, {}
        roles = (("parent", (nb.parent,)), ("child", nb.children), ("brother", (nb.brother,)),
                 ("uncle", (nb.uncle,)), ("nephew", nb.nephews))
        for role, peers in roles:
            for peer in peers:
                key = None if peer is None else link_key(self.rank, peer)
                if key is None or key in self._links:
                    continue
                link = old.get(key) or _Link(key=key, role=role, peer=peer, changed_at=self.clock())
                link.role, link.peer = role, peer
                self._links[key] = link

    def _on_view(self, inst: Installed) -> None:
        self._own_links()
        self._observed.clear()  # other workers' links: the tree around us changed
        for rank in inst.evicted:
            self.events.append(EventView(step=self.last_step if self.last_step is not None else -1, kind="view",
                                         cause="evicted", link=None, at=self.clock(),
                                         text=f"view {inst.view.epoch}: rank {rank} left out ({inst.reason})"))

    def close(self) -> None:
        pairs: tuple[tuple[list[Any], Any], ...] = ((self.node.note_listeners, self._on_note),
                                                     (self.node.step_listeners, self._on_step),
                                                     (self.node.view_listeners, self._on_view))
        for listeners, fn in pairs:
            if fn in listeners:
                listeners.remove(fn)
        logs.unbind_thread()

    def current_step(self) -> int | None:
        return max(self.node.active_steps(), default=self.last_step)

    # ---- inputs (on the loop) ----------------------------------------------------------

    def _set(self, link: _Link, state: LinkState, reason: str, step: int | None) -> None:
        if link.state is state and link.reason == reason:
            return
        if link.state is not state:
            log.info("rank %d: link %s %s -> %s: %s", self.rank, link_name(link.key), link.state.value,
                     state.value, reason)
        link.state, link.reason, link.since_step, link.changed_at = state, reason, step, self.clock()

    def _event(self, link: _Link, note: Note) -> None:
        link.recent.append(note.text)
        self.events.append(EventView(step=note.step, kind=note.kind.value, cause=note.cause.value,
                                     link=link_name(link.key), text=note.text, at=self.clock()))

    def _on_note(self, note: Note) -> None:
        if note.cause in _RESENDS:
            self.retransmissions += 1
        key = note_link(note)
        if key is None:
            return
        link = self._links.get(key) or self._observed.get(key)
        if link is None:
            link = self._observed[key] = _Link(key=key, role="observed", peer=None, changed_at=self.clock(),
                                               primary=note.link)
        link.noted_step = max(link.noted_step, note.step)
        if note.cause is Cause.LINK_MARKED_FAILED:
            self._set(link, LinkState.FAILED, note.text, note.step)
            self._event(link, note)
        elif note.cause is Cause.LINK_BACK_IN_USE:
            self._set(link, LinkState.UP, note.text, note.step)
            self._event(link, note)
        elif note.cause in _LOST_ON_LINK:
            # Only an end of the link knows that data went around it; an observer's relay may
            # also come from a lost confirmation on another link, so there it is a suspicion.
            state = LinkState.SUSPECT if link.peer is None else LinkState.FAILED
            self._set(link, state, note.text, note.step)
            self._event(link, note)
        elif note.kind is NoteKind.TIMEOUT and link.state is not LinkState.FAILED:
            self._set(link, LinkState.SUSPECT, note.text, note.step)
        # Cause.DETOUR: routine while link memory holds the link failed; its state says so.

    def _on_step(self, step: int, duration_s: float, error: str | None) -> None:
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        if error is None:
            self.steps_ok += 1
            self.histogram.observe(duration_s)
        else:
            self.steps_failed += 1
            self.last_error = f"step {step}: {error}"
        # Every step: only the counters of our links. The whole node status (every tree, op and
        # view) is built only when a link is not up, which a step with no fault never needs;
        # built every step it was the largest cost of a 4 KB step after the protocol itself.
        transport = self.node.transport
        whole: NodeStatus | None = None

        def node_status() -> NodeStatus:
            nonlocal whole
            if whole is None:
                whole = self.node.status()
            return whole

        for link in self._links.values():
            assert link.peer is not None
            s = transport.link_health(link.peer)
            drops, errors, sent = (s.injected_drops - link.seen_drops, s.errors - link.seen_errors,
                                   s.frames_sent - link.seen_sent)
            link.seen_drops, link.seen_errors, link.seen_sent = s.injected_drops, s.errors, s.frames_sent
            if link.noted_step >= step:
                continue  # the notes of this step already said what happened
            if drops and not sent:
                self._set(link, LinkState.FAILED,
                          f"step {step}: fault injection dropped all {drops} frames to and from rank {link.peer}", step)
            elif drops:
                self._set(link, LinkState.SUSPECT,
                          f"step {step}: fault injection dropped {drops} frames to and from rank {link.peer}", step)
            elif errors:
                self._set(link, LinkState.SUSPECT, f"step {step}: connection to rank {link.peer} broke "
                                                   f"{errors} time(s): {s.last_error}", step)
            elif link.state is not LinkState.UP and error is None and self._remembered(link, node_status()) is None:
                self._set(link, LinkState.UP, f"step {step}: finished with no fault on this link", step)
        if error is None:
            for link in self._observed.values():
                if link.noted_step < step and link.state is not LinkState.UP and self._observes(link, node_status()):
                    self._set(link, LinkState.UP, f"step {step}: finished with no fault on this link", step)

    def _remembered(self, link: _Link, status: NodeStatus) -> tuple[LinkState, str] | None:
        """What the protocol's link memory says about one of our primary links, if anything:
        our uplink marked failed (probes unanswered) or probing (answered, waiting to be trusted
        again), or a child whose data last came through a relay."""
        tree0 = status.machine.tree0
        up = tree0.uplink
        if link.role == "parent" and up.failed:
            via = " and ".join(map(str, up.relays))
            if up.probing:
                return LinkState.PROBING, (f"probes to rank {link.peer} are answered; routing through rank {via} "
                                           f"until the link has been healthy for {up.hold_s:g} s")
            return LinkState.FAILED, f"marked failed; routing through rank {via} and probing rank {link.peer}"
        if link.role == "child" and link.peer in tree0.relayed_children:
            return LinkState.FAILED, f"rank {link.peer}'s data last came through a relay"
        return None

    @staticmethod
    def _observes(link: _Link, status: NodeStatus) -> bool:
        """Do we watch this primary link as its child's brother or uncle?"""
        if link.primary is None:
            return False
        child = link.primary[0]
        view = status.machine.view
        if child not in view:
            return False
        n = view.neighbours(child)
        return status.rank in (n.brother, n.uncle)

    # ---- output --------------------------------------------------------------------------

    @staticmethod
    def _phase(status: NodeStatus, step: int) -> str:
        phases = {op.phase for op in status.machine.ops if op.step == step}
        if not phases:
            return "starting" if step in status.steps_in_flight else "done"
        if OpPhase.REDUCE in phases or OpPhase.WAITING in phases:
            return "reduce"
        return "broadcast"

    def _view(self, link: _Link, current: int | None, status: NodeStatus) -> LinkView:
        state, reason, since = link.state, link.reason, link.since_step
        rtt = connected = None
        extra: dict[str, Any] = {}
        if link.peer is not None:
            remembered = self._remembered(link, status)
            if remembered is not None and remembered[0] is not state:
                state, reason = remembered
            s: LinkStatus = status.transport.link(link.peer)
            connected, rtt = s.connected, s.rtt_s
            extra = {"bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "frames_sent": s.frames_sent,
                     "frames_received": s.frames_received, "injected_drops": s.injected_drops,
                     "errors": s.errors}
            if connected is False:
                state = LinkState.PROBING
                reason = f"reconnecting to rank {link.peer}: {s.last_error or 'connection lost'}"
                since = current
        return LinkView(name=link_name(link.key), a=link.key[0], b=link.key[1], peer=link.peer, role=link.role,
                        state=state.value, reason=reason, since_step=since, changed_at=link.changed_at,
                        rtt_s=rtt, connected=connected, recent=tuple(link.recent), **extra)

    def snapshot(self) -> Snapshot:
        status = self.node.status()
        nb = status.machine.tree0.neighbours
        in_flight = status.steps_in_flight
        current = max(in_flight, default=self.last_step)
        phase = self._phase(status, in_flight[-1]) if in_flight else "idle"
        counts = status.note_counts
        view = status.machine.view
        member = status.membership
        return Snapshot(
            rank=self.rank, world=self.world, epoch=view.epoch, members=view.members,
            member_state=member.state.value, stopped=member.reason,
            suspects=dict(member.suspects),
            evictions=tuple(EvictionView(rank=e.rank, epoch=e.epoch, reason=e.reason,
                                         detected_after_s=e.detected_after_s, suspected_by=e.suspected_by)
                              for e in member.evictions),
            evicted_total=member.evicted_total, suspicions_total=member.suspicions_total,
            self_checks=member.self_checks, self_check_stops=member.self_check_stops,
            no_change=member.no_change, node_deadline_s=member.node_deadline_s, reruns=status.reruns,
            address=status.transport.address, started_at=self.started_at, at=self.clock(),
            parent=nb.parent, children=nb.children, brother=nb.brother, uncle=nb.uncle, nephews=nb.nephews,
            trees=tuple(_tree_view(t) for t in status.machine.trees),
            step=current, phase=phase, in_flight=in_flight,
            steps_ok=self.steps_ok, steps_failed=self.steps_failed, last_error=self.last_error,
            last_steps=status.last_steps[-10:],
            timeouts=counts.get(NoteKind.TIMEOUT, 0), recoveries=counts.get(NoteKind.RECOVERY, 0),
            detours=counts.get(NoteKind.DETOUR, 0), retransmissions=self.retransmissions,
            duplicates=counts.get(NoteKind.DUPLICATE, 0), stale=counts.get(NoteKind.STALE, 0),
            protocol_errors=counts.get(NoteKind.PROTOCOL, 0), frame_errors=status.transport.frame_errors,
            refusals=status.transport.refusals, foreign_frames=status.foreign_frames,
            empty_sums=status.empty_sums, early_dropped=status.early_dropped,
            early_dropped_bytes=status.early_dropped_bytes, ops_refused=status.ops_refused,
            late_streak=status.late_streak, late_total=status.late_total,
            computing_waits=counts.get(NoteKind.WAIT, 0),
            faults=status.transport.faults,
            links=tuple(self._view(lk, current, status) for lk in self._links.values()),
            observed=tuple(self._view(lk, current, status) for _, lk in sorted(self._observed.items())),
            events=tuple(self.events),
            histogram=self.histogram.view(),
            punches=tuple(PunchView(peer=lk.peer, state=lk.punch, tries=lk.punch_tries, connected=lk.punch_connected,
                                    took_s=lk.punch_s, error=lk.punch_error, via=lk.punch_via)
                          for lk in status.transport.links if lk.punch),
        )
