"""What one worker knows about its links and steps, frozen into snapshots for /status and /metrics.

A Monitor listens to its Node (protocol Notes and finished steps, both on the node's loop) and
keeps one record per link: the worker's own links to its tree neighbours, plus any other link a
note names (an observer hears about its brother's link to their parent). Link states:

    up       no fault seen, or the last finished step used the link without trouble
    suspect  a backup watch timed out on it, or the transport saw errors or injected drops
    failed   data went around it (a recovery note at one of its ends), every frame was dropped,
             or the protocol's link memory marked it failed (probes unanswered)
    probing  failed, and the transport is reconnecting, or its probes are answered again and the
             protocol waits before trusting it

Every note the protocol emits about a link concerns a primary link `x -> parent(x)`: watches and
relays name the child end in `note.peer`; only "result reached rank R through rank B" names the
backup sender, and then the link is R's own link to its parent. Only the two ends of a link can
say it failed: an observer that relayed may itself have missed a confirmation on another link,
so on links of other workers it records a suspicion. A link goes back to up when a step
finishes here with no note about it (counted by its two ends and its observers).

`Monitor.snapshot()` must run on the node's loop; it returns frozen dataclasses that any thread
may read, format or serialise.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .. import logs
from ..core.protocol import Note, NoteKind
from ..core.topology import brother_of, parent_of, uncle_of
from .metrics import Histogram, HistogramView

if TYPE_CHECKING:
    from ..net.node import Node

log = logging.getLogger("fttree.status.monitor")

LinkKey = tuple[int, int]  # (higher rank, lower rank): for a primary link (child, parent)


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


_RESULT_VIA = "result reached rank"
_RESENDS = ("relayed rank", "sent the result to rank")
_BACK_IN_USE = "back in use"
_LINK_NOTE = getattr(NoteKind, "LINK", None)  # link memory: "link 1->0 marked failed" / "... back in use"


def note_link(note: Note, rank: int) -> LinkKey | None:
    """The primary link a timeout, recovery or link note is about (see the module docstring)."""
    if note.peer < 0:
        return None
    if _LINK_NOTE is not None and note.kind is _LINK_NOTE:
        return link_key(rank, note.peer) if note.peer != rank else None
    if note.kind not in (NoteKind.TIMEOUT, NoteKind.RECOVERY):
        return None
    end = rank if note.kind is NoteKind.RECOVERY and _RESULT_VIA in note.text else note.peer
    parent = parent_of(end)
    return None if parent is None else link_key(end, parent)


def is_resend(note: Note) -> bool:
    """Recovery notes where this worker sent data a second time, over a backup link."""
    return note.kind is NoteKind.RECOVERY and any(s in note.text for s in _RESENDS)


def tcp_rtt_s(writer: Any) -> float | None:
    """The kernel's smoothed RTT of a connected TCP stream (Linux TCP_INFO), or None."""
    tcp_info = getattr(socket, "TCP_INFO", None)
    sock = None if writer is None else writer.get_extra_info("socket")
    if sock is None or tcp_info is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 104)
    except OSError:
        return None
    if len(info) < 72:
        return None
    return float(struct.unpack_from("<I", info, 68)[0]) / 1e6  # tcpi_rtt, microseconds


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
    link: str | None
    text: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    rank: int
    world: int
    address: str
    started_at: float
    at: float
    parent: int | None
    children: tuple[int, ...]
    brother: int | None
    uncle: int | None
    nephews: tuple[int, ...]
    step: int | None  # the newest step in flight, else the last finished one
    phase: str  # idle, reduce, broadcast, done
    in_flight: tuple[int, ...]
    steps_ok: int
    steps_failed: int
    last_error: str
    last_steps: tuple[tuple[int, float], ...]  # (step, duration_s), oldest first
    timeouts: int
    recoveries: int
    retransmissions: int
    duplicates: int
    stale: int
    protocol_errors: int
    frame_errors: int
    faults: str
    links: tuple[LinkView, ...]
    observed: tuple[LinkView, ...]
    events: tuple[EventView, ...]
    histogram: HistogramView

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
            "address": self.address,
            "uptime_s": round(self.at - self.started_at, 3),
            "time": self.at,
            "neighbours": {"parent": self.parent, "children": list(self.children), "brother": self.brother,
                           "uncle": self.uncle, "nephews": list(self.nephews)},
            "step": {"current": self.step, "phase": self.phase, "in_flight": list(self.in_flight),
                     "completed": self.steps_ok, "failed": self.steps_failed, "last_error": self.last_error},
            "last_steps": [{"step": s, "duration_s": round(d, 6)} for s, d in self.last_steps],
            "counts": {"timeouts": self.timeouts, "recoveries": self.recoveries,
                       "retransmissions": self.retransmissions, "duplicates": self.duplicates,
                       "stale": self.stale, "protocol_errors": self.protocol_errors,
                       "frame_errors": self.frame_errors},
            "links": [link(v) for v in self.links],
            "observed_links": [link(v) for v in self.observed],
            "recent_events": [asdict(e) for e in self.events],
            "faults": self.faults,
        }


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


class Monitor:
    """Watches one Node. Create, use and close it on the node's loop thread."""

    def __init__(self, node: Node, *, history: int = 10, clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.rank, self.world = node.rank, node.cfg.world
        self.clock = clock
        self.started_at = clock()
        self.histogram = Histogram()
        self.steps_ok = self.steps_failed = self.retransmissions = 0
        self.last_error = ""
        self.last_step: int | None = None
        self.events: deque[EventView] = deque(maxlen=history)
        nb = node.neighbours
        self._links: dict[LinkKey, _Link] = {}
        roles = (("parent", (nb.parent,)), ("child", nb.children), ("brother", (nb.brother,)),
                 ("uncle", (nb.uncle,)), ("nephew", nb.nephews))
        for role, peers in roles:
            for peer in peers:
                if peer is not None and link_key(self.rank, peer) not in self._links:
                    key = link_key(self.rank, peer)
                    self._links[key] = _Link(key=key, role=role, peer=peer, changed_at=self.started_at)
        self._observed: dict[LinkKey, _Link] = {}
        node.note_listeners.append(self._on_note)
        node.step_listeners.append(self._on_step)
        logs.bind_thread(self.rank, self.current_step)

    def close(self) -> None:
        for listeners, fn in ((self.node.note_listeners, self._on_note), (self.node.step_listeners, self._on_step)):
            if fn in listeners:
                listeners.remove(fn)  # type: ignore[arg-type]
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

    def _on_note(self, note: Note) -> None:
        if is_resend(note):
            self.retransmissions += 1
        key = note_link(note, self.rank)
        if key is None:
            return
        link = self._links.get(key) or self._observed.get(key)
        if link is None:
            link = self._observed[key] = _Link(key=key, role="observed", peer=None, changed_at=self.clock())
        link.noted_step = max(link.noted_step, note.step)
        if _LINK_NOTE is not None and note.kind is _LINK_NOTE:
            state = LinkState.UP if _BACK_IN_USE in note.text else LinkState.FAILED
            self._set(link, state, note.text, note.step)
            link.recent.append(note.text)
            self.events.append(EventView(step=note.step, kind=note.kind.value, link=link_name(key), text=note.text,
                                         at=self.clock()))
        elif note.kind is NoteKind.RECOVERY:
            # Only an end of the link knows that data went around it; an observer's relay may
            # also come from a lost confirmation on another link, so there it is a suspicion.
            state = LinkState.SUSPECT if link.peer is None else LinkState.FAILED
            self._set(link, state, note.text, note.step)
            link.recent.append(note.text)
            self.events.append(EventView(step=note.step, kind=note.kind.value, link=link_name(key), text=note.text,
                                         at=self.clock()))
        elif link.state is not LinkState.FAILED:
            self._set(link, LinkState.SUSPECT, note.text, note.step)

    def _on_step(self, step: int, duration_s: float, error: str | None) -> None:
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        if error is None:
            self.steps_ok += 1
            self.histogram.observe(duration_s)
        else:
            self.steps_failed += 1
            self.last_error = f"step {step}: {error}"
        stats = self.node.transport.stats
        for link in self._links.values():
            assert link.peer is not None
            s = stats[link.peer]
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
            elif link.state is not LinkState.UP and error is None and self._protocol_view(link) is None:
                self._set(link, LinkState.UP, f"step {step}: finished with no fault on this link", step)
        if error is None:
            for link in self._observed.values():
                if link.noted_step < step and link.state is not LinkState.UP and self._observes(link.key):
                    self._set(link, LinkState.UP, f"step {step}: finished with no fault on this link", step)

    def _protocol_view(self, link: _Link) -> tuple[LinkState, str] | None:
        """What the protocol's link memory says about one of our primary links, if anything:
        our uplink marked failed (probes unanswered) or probing (answered, waiting to be trusted
        again), or a child whose data last came through a relay. Read defensively: link memory
        is optional in TreeMachine."""
        machine = self.node.machine
        up = getattr(machine, "up", None)
        if link.role == "parent" and up is not None and getattr(up, "failed", False):
            via = getattr(up, "via", None)
            if getattr(up, "healthy_since", None) is not None:
                return LinkState.PROBING, f"probes to rank {link.peer} are answered; routing through rank {via} " \
                                          f"until the link has been healthy long enough"
            return LinkState.FAILED, f"marked failed; routing through rank {via} and probing rank {link.peer}"
        if link.role == "child" and link.peer in getattr(machine, "down_failed", ()):
            return LinkState.FAILED, f"rank {link.peer}'s data last came through a relay"
        return None

    def _observes(self, key: LinkKey) -> bool:
        child = key[0]
        return self.rank in (brother_of(child, self.world), uncle_of(child, self.world))

    # ---- output --------------------------------------------------------------------------

    def _phase(self, step: int) -> str:
        # TreeMachine has no public per-op view yet; read its op table defensively.
        ops = [op for (s, _c), op in getattr(self.node.machine, "_ops", {}).items() if s == step]
        if not ops:
            return "starting"
        if all(getattr(op, "done", False) for op in ops):
            return "done"
        if any(not getattr(op, "reduce_sent", True) for op in ops):
            return "reduce"
        return "broadcast"

    def _view(self, link: _Link, current: int | None) -> LinkView:
        state, reason, since = link.state, link.reason, link.since_step
        rtt = connected = None
        extra: dict[str, Any] = {}
        if link.peer is not None:
            remembered = self._protocol_view(link)
            if remembered is not None and remembered[0] is not state:
                state, reason = remembered
            s = self.node.transport.stats[link.peer]
            out = getattr(self.node.transport, "_out", {}).get(link.peer)  # no public accessor yet
            writer = None if out is None else out.writer
            connected = writer is not None
            rtt = tcp_rtt_s(writer)
            extra = {"bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "frames_sent": s.frames_sent,
                     "frames_received": s.frames_received, "injected_drops": s.injected_drops,
                     "errors": s.errors}
            if out is not None and not connected:
                state = LinkState.PROBING
                reason = f"reconnecting to rank {link.peer}: {s.last_error or 'connection lost'}"
                since = current
        return LinkView(name=link_name(link.key), a=link.key[0], b=link.key[1], peer=link.peer, role=link.role,
                        state=state.value, reason=reason, since_step=since, changed_at=link.changed_at,
                        rtt_s=rtt, connected=connected, recent=tuple(link.recent), **extra)

    def snapshot(self) -> Snapshot:
        node, nb = self.node, self.node.neighbours
        in_flight = tuple(node.active_steps())
        current = max(in_flight, default=self.last_step)
        phase = self._phase(in_flight[-1]) if in_flight else "idle"
        counts = node.note_counts
        return Snapshot(
            rank=self.rank, world=self.world, address=str(node.cfg.peers[self.rank]),
            started_at=self.started_at, at=self.clock(),
            parent=nb.parent, children=nb.children, brother=nb.brother, uncle=nb.uncle, nephews=nb.nephews,
            step=current, phase=phase, in_flight=in_flight,
            steps_ok=self.steps_ok, steps_failed=self.steps_failed, last_error=self.last_error,
            last_steps=tuple(node.step_durations)[-10:],
            timeouts=counts[NoteKind.TIMEOUT], recoveries=counts[NoteKind.RECOVERY],
            retransmissions=self.retransmissions, duplicates=counts[NoteKind.DUPLICATE],
            stale=counts[NoteKind.STALE], protocol_errors=counts[NoteKind.PROTOCOL],
            frame_errors=node.transport.frame_errors, faults=str(node.transport.faults),
            links=tuple(self._view(lk, current) for lk in self._links.values()),
            observed=tuple(self._view(lk, current) for _, lk in sorted(self._observed.items())),
            events=tuple(self.events),
            histogram=self.histogram.view(),
        )
