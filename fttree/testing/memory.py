"""In-memory transports: frames between simulated ranks, delivered on a SimClock.

`MemoryNetwork` is the wire. It adds latency, jitter (which reorders frames) and duplicates,
and speaks the fault language by hand: `cut`, `drop`, `delay`, `isolate`, `partition`, `heal`
for links; `crash` (the rank's sockets are gone: senders learn it as a refused connection) and
`hang`/`resume` (nothing is delivered to the rank, frames wait as in a socket buffer) for ranks.
With `wire=True` every frame goes through the real codec, so what the simulator carries is
exactly what TCP would.
"""

from __future__ import annotations

import functools
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.messages import Frame, Kind, decode, encode
from ..net.address import Address
from ..net.transport import LinkHealth, LinkState, LinkStatus, TransportEvents, TransportStatus
from .clock import SimClock

Pair = tuple[int, int]


def pair(a: int, b: int) -> Pair:
    return (min(a, b), max(a, b))


@dataclass
class WireStats:
    sent: int = 0
    dropped: int = 0
    duplicated: int = 0
    data_bytes: int = 0
    by_kind: Counter[Kind] = field(default_factory=Counter)  # frames sent, by message kind


@dataclass
class _Counts:
    frames_sent: int = 0
    bytes_sent: int = 0
    frames_received: int = 0
    bytes_received: int = 0


class MemoryTransport:
    """One rank's end of a MemoryNetwork (the `Transport` of fttree.net.transport)."""

    def __init__(self, rank: int, network: MemoryNetwork) -> None:
        self.rank = rank
        self.network = network
        self.events: TransportEvents | None = None
        self.counts: defaultdict[int, _Counts] = defaultdict(_Counts)

    def bind(self, events: TransportEvents) -> None:
        self.events = events

    async def start(self) -> None:
        return None

    async def wait_for_peers(self, peers: Sequence[int], deadline_s: float) -> None:
        return None

    def send(self, dst: int, msg: Frame) -> None:
        self.network.transmit(self.rank, dst, msg)

    def add_peer(self, rank: int, address: Address) -> None:
        return None  # every rank of the network is reachable by number

    def address_of(self, rank: int) -> str:
        return f"sim:{rank}"

    def backlog_bytes(self, dst: int | None = None) -> int:
        return 0

    def uplink_rate(self) -> float:
        return 0.0

    def retransmit_s(self, peer: int) -> float:
        return 0.0  # whole frames, never lost in transit (a drop is a fault, not a loss TCP repairs)


    def link_state(self, peer: int) -> LinkState:
        net = self.network
        return LinkState(pending_bytes=net.in_flight.get((self.rank, peer), 0),
                         lost_at=net.lost_at.get((self.rank, peer), -float("inf")))

    def link_health(self, peer: int) -> LinkHealth:
        counts = self.counts.get(peer)
        return LinkHealth() if counts is None else LinkHealth(frames_sent=counts.frames_sent)

    def status(self) -> TransportStatus:
        links = tuple(LinkStatus(peer=p, frames_sent=c.frames_sent, bytes_sent=c.bytes_sent,
                                 frames_received=c.frames_received, bytes_received=c.bytes_received)
                      for p, c in sorted(self.counts.items()))
        return TransportStatus(rank=self.rank, address=f"sim:{self.rank}", links=links)

    async def close(self, flush_s: float = 2.0, *, abort: bool = False) -> None:
        return None


class MemoryNetwork:
    def __init__(self, clock: SimClock, *, latency_s: float = 0.001, jitter_s: float = 0.0,
                 duplicate_p: float = 0.0, seed: int = 0, wire: bool = True, fifo: bool = False) -> None:
        """`fifo`: frames of one link arrive in the order sent, as over one TCP connection;
        otherwise jitter may reorder them, which tests the protocol's tolerance of any order."""
        self.clock = clock
        self.fifo = fifo
        self._last_at: dict[tuple[int, int], float] = {}
        self.latency_s, self.jitter_s, self.duplicate_p, self.wire = latency_s, jitter_s, duplicate_p, wire
        self.rng = random.Random(seed)
        self.stats = WireStats()
        self.transports: dict[int, MemoryTransport] = {}
        self._cut: set[Pair] = set()
        self._drop: dict[Pair, float] = {}
        self._delay: dict[Pair, float] = {}
        self.crashed: set[int] = set()
        self.process: defaultdict[int, int] = defaultdict(int)  # rank -> its process (a restart counts up)
        self._hung: dict[int, list[Frame]] = {}  # rank -> frames waiting for it
        self.lost_at: dict[tuple[int, int], float] = {}  # (src, dst) -> when a frame was last dropped
        self.in_flight: defaultdict[tuple[int, int], int] = defaultdict(int)  # (src, dst) -> bytes on their way

    def transport(self, rank: int) -> MemoryTransport:
        t = self.transports[rank] = MemoryTransport(rank, self)
        return t

    # ---- the fault language ------------------------------------------------------------------

    def cut(self, a: int, b: int) -> None:
        self._cut.add(pair(a, b))

    def drop(self, a: int, b: int, p: float) -> None:
        self._drop[pair(a, b)] = p

    def delay(self, a: int, b: int, s: float) -> None:
        self._delay[pair(a, b)] = s

    def isolate(self, a: int) -> None:
        for r in self.transports:
            if r != a:
                self.cut(a, r)

    def partition(self, group: Sequence[int]) -> None:
        inside = set(group)
        for a in inside:
            for b in self.transports:
                if b not in inside:
                    self.cut(a, b)

    def heal(self, a: int | None = None, b: int | None = None) -> None:
        """Heal one link, every link of rank `a`, or (no arguments) every link fault."""
        if a is None:
            self._cut.clear()
            self._drop.clear()
            self._delay.clear()
            return

        def keep(p: Pair) -> bool:
            return p != pair(a, b) if b is not None else a not in p

        self._cut = {p for p in self._cut if keep(p)}
        self._drop = {p: v for p, v in self._drop.items() if keep(p)}
        self._delay = {p: v for p, v in self._delay.items() if keep(p)}

    def crash(self, rank: int) -> None:
        self.crashed.add(rank)
        self._hung.pop(rank, None)

    def revive(self, rank: int) -> None:
        """A new process of `rank` (crashed, or never there): frames of its previous one, and
        frames sent to it, that are still on their way are lost, as a reset connection loses them."""
        self.crashed.discard(rank)
        self._hung.pop(rank, None)
        self.process[rank] += 1

    def hang(self, rank: int) -> None:
        self._hung.setdefault(rank, [])

    def resume(self, rank: int) -> None:
        for msg in self._hung.pop(rank, []):
            self._deliver(rank, msg)

    # ---- carrying frames ---------------------------------------------------------------------

    def transmit(self, src: int, dst: int, msg: Frame) -> None:
        self.stats.sent += 1
        self.stats.by_kind[msg.kind] += 1
        if src in self.crashed:
            return
        if dst in self.crashed:
            # the peer's sockets are gone: the sender's next connect is refused
            self.stats.dropped += 1
            self.clock.call_later(self.latency_s, lambda: self._refused(src, dst))
            return
        link = pair(src, dst)
        if link in self._cut or self.rng.random() < self._drop.get(link, 0.0):
            self.stats.dropped += 1
            self.lost_at[(src, dst)] = self.clock.now()  # the sender's end knows what it lost
            return
        size = 0 if msg.payload is None else len(memoryview(msg.payload).cast("B"))
        self.stats.data_bytes += size
        counts = self.transports[src].counts[dst]
        counts.frames_sent += 1
        counts.bytes_sent += size
        if self.wire:
            msg = decode(b"".join(bytes(b) for b in encode(msg)))
        copies = 2 if self.duplicate_p and self.rng.random() < self.duplicate_p else 1
        self.stats.duplicated += copies - 1
        self.in_flight[(src, dst)] += size  # unacknowledged, as TCP would say, until the first copy lands
        for copy in range(copies):
            delay = self.latency_s + self._delay.get(link, 0.0)
            if self.jitter_s:
                delay += self.rng.uniform(0, self.jitter_s)
            at = self.clock.now() + delay
            if self.fifo:  # one TCP connection: what was sent first lands first
                at = self._last_at[(src, dst)] = max(at, self._last_at.get((src, dst), at))
            self.clock.call_at(at, functools.partial(self._deliver, dst, msg, size if copy == 0 else 0,
                                                     (self.process[src], self.process[dst])))

    def _deliver(self, dst: int, msg: Frame, acked: int = 0, processes: tuple[int, int] | None = None) -> None:
        if acked:
            self.in_flight[(msg.src, dst)] -= acked
        if dst in self.crashed or msg.src in self.crashed:  # a killed process's unsent data is lost with it
            return
        if processes is not None and processes != (self.process[msg.src], self.process[dst]):
            return  # sent by, or to, a process that has been replaced since
        if dst in self._hung:
            self._hung[dst].append(msg)
            return
        t = self.transports[dst]
        counts = t.counts[msg.src]
        counts.frames_received += 1
        counts.bytes_received += 0 if msg.payload is None else len(memoryview(msg.payload).cast("B"))
        if t.events is not None:
            t.events.on_message(msg)

    def _refused(self, src: int, dst: int) -> None:
        t = self.transports.get(src)
        if t is not None and t.events is not None and src not in self.crashed and src not in self._hung:
            t.events.on_link_down(dst, f"connection to rank {dst} refused", True)
