"""ShapedNetwork: frames carried as TCP carries them behind real uplinks, on a SimClock.

MemoryNetwork (memory.py) delivers whole frames after a latency, as if bandwidth were free.
Here every rank has an uplink of a given rate (netem/uplink.sh: one htb class a rank), its
frames travel as segments through that uplink's one queue, and each link loses segments at a
given rate (netem/loss.sh), which TCP sends again after its retransmission timeout while the
stream waits behind the hole. Every peer has two streams, as the TCP transport opens two
connections (net/tcp.py): a control stream whose frames enter the queue at once, and a bulk
stream whose segments enter it only while the rank's unacknowledged bulk bytes stay within
the in-flight budget that the transport's UplinkMeter sets from acknowledgements. So slow and
lossy links, and how the transport copes with them, are tested deterministically and fast.

The fault language speaks of packets here, as iptables does: `cut` drops every segment of a
link (TCP retransmits with a backoff, the sender sees no acknowledgement and calls the link
stalled; the frames arrive once the link heals), `drop(a, b, p)` loses a share of them,
`delay` adds one-way latency. `crash` takes a rank's sockets away (peers get a refused
connection); `hang` stops its process (its kernel still acknowledges what fits its receive
buffer, and delivers it on `resume`).
"""

from __future__ import annotations

import functools
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..core.messages import Frame, decode, encode
from ..net.address import Address
from ..net.tcp import CONTROL_MAX_PAYLOAD, MIN_CHANNEL_BUDGET
from ..net.transport import LinkHealth, LinkState, LinkStatus, TransportEvents, TransportStatus
from ..net.uplink import QUEUE_SEEN_S, RTO_MIN_S, LossHistory, TcpCounters, UplinkMeter, stall_found
from .clock import SimClock
from .memory import Pair, WireStats, pair

HEADER_BYTES = 64  # a frame's prefix and header, as far as the uplink's time goes
RTO_MAX_S = 1.0  # net/tcp.py caps the backoff at 1 s where the kernel allows
RECEIVE_BUFFER_BYTES = 4 << 20  # what a hung rank's kernel still takes before its window closes
PROGRESS_EVERY_S = 0.05  # as net/frame_reader.py reports bytes of a payload still arriving


def segment_bytes(rate: float) -> int:
    """The unit a rank's uplink sends: about 2 ms of it, between one Ethernet packet and one
    loopback GSO packet (finer would cost events, coarser would hide the queue)."""
    return int(min(max(rate * 0.002, 1448), 65536))


@dataclass(slots=True)
class _Segment:
    stream: _Stream
    start: int  # stream offset
    size: int
    tries: int = 0  # transmissions so far


@dataclass(slots=True)
class _Stream:
    """One direction of one connection (src -> dst, control or bulk): a TCP byte stream."""

    src: int
    dst: int
    bulk: bool
    frames: deque[tuple[int, Frame]] = field(default_factory=deque)  # (end offset, frame), not yet delivered
    unsent: deque[tuple[int, int]] = field(default_factory=deque)  # (start, end) of bytes not yet in the queue
    unsent_bytes: int = 0  # their total, kept as they change: read for every segment queued
    written: int = 0  # bytes handed to the stream (its next frame starts here)
    acked: int = 0  # cumulatively acknowledged
    arrived: set[int] = field(default_factory=set)  # starts of segments received beyond the in-order point
    sizes: dict[int, int] = field(default_factory=dict)  # start -> size of segments received out of order
    delivered: int = 0  # the receiver has everything before this offset
    progress_at: float = 0.0  # when `acked` last grew (or bytes went out with none outstanding)
    head_tries: int = 0  # retransmission timeouts of the oldest unacknowledged segment in a row
    last_ack_at: float = 0.0  # when any acknowledgement (a duplicate too) last came back
    stalled: bool = False
    loss: LossHistory = field(default_factory=LossHistory)  # what it had lost when bytes were last acknowledged
    reported_at: float = -1.0  # when the receiver last heard of a payload in progress
    frames_sent: int = 0
    bytes_sent: int = 0
    lost: int = 0  # segments of this stream lost on the way (TCP sent them again)
    waiting: dict[int, Frame] = field(default_factory=dict)  # bulk frames not begun yet, by start offset
    voided: set[int] = field(default_factory=set)  # end offsets of frames found stale as they began

    @property
    def outstanding(self) -> int:
        return self.written - self.acked


@dataclass(slots=True)
class _Uplink:
    rate: float
    segment: int
    queue: deque[_Segment] = field(default_factory=deque)
    queued_bytes: int = 0  # the queue's total, kept as it changes: read on every acknowledgement
    busy: bool = False
    meter: UplinkMeter = field(default_factory=UplinkMeter)
    backlogged: bool = False  # bulk bytes wait for room in the budget: acknowledgements measure the link
    sampled_at: float = 0.0


class ShapedTransport:
    """One rank's end of a ShapedNetwork (the `Transport` of fttree.net.transport)."""

    def __init__(self, rank: int, network: ShapedNetwork) -> None:
        self.rank = rank
        self.network = network
        self.events: TransportEvents | None = None

    def bind(self, events: TransportEvents) -> None:
        self.events = events

    async def start(self) -> None:
        return None

    async def wait_for_peers(self, peers: Sequence[int], deadline_s: float) -> None:
        return None

    def send(self, dst: int, msg: Frame) -> None:
        self.network.transmit(self.rank, dst, msg)

    def add_peer(self, rank: int, address: Address) -> None:
        return None

    def address_of(self, rank: int) -> str:
        return f"sim:{rank}"

    def backlog_bytes(self, dst: int | None = None) -> int:
        net = self.network
        return sum(s.outstanding for s in net.streams_of(self.rank) if (dst is None or s.dst == dst) and not s.stalled)

    def uplink_rate(self) -> float:
        return self.network.uplinks[self.rank].meter.link_rate

    def retransmit_s(self, peer: int) -> float:
        return self.network.retransmit_s(self.rank, peer)

    def link_state(self, peer: int) -> LinkState:
        streams = [s for s in self.network.streams_of(self.rank) if s.dst == peer]
        for s in streams:
            self.network.check_stall(s)
        return LinkState(pending_bytes=sum(s.outstanding for s in streams), stalled=any(s.stalled for s in streams),
                         lost_at=self.network.lost_at.get((self.rank, peer), -float("inf")))

    def link_health(self, peer: int) -> LinkHealth:
        streams = [s for s in self.network.streams_of(self.rank) if s.dst == peer]
        return LinkHealth(frames_sent=sum(s.frames_sent for s in streams))

    def status(self) -> TransportStatus:
        by_peer: dict[int, list[_Stream]] = {}
        for s in self.network.streams_of(self.rank):
            by_peer.setdefault(s.dst, []).append(s)
        links = tuple(LinkStatus(peer=p, frames_sent=sum(s.frames_sent for s in ss),
                                 bytes_sent=sum(s.bytes_sent for s in ss)) for p, ss in sorted(by_peer.items()))
        return TransportStatus(rank=self.rank, address=f"sim:{self.rank}", links=links)

    async def close(self, flush_s: float = 2.0, *, abort: bool = False) -> None:
        return None


class ShapedNetwork:
    """Ranks behind uplinks of `uplink` bytes per second (one rate, or one per rank), with
    one-way `latency_s` and a share `loss` of segments lost on every link."""

    def __init__(self, clock: SimClock, *, uplink: float | Mapping[int, float], latency_s: float = 0.001,
                 loss: float = 0.0, seed: int = 0, wire: bool = False) -> None:
        self.clock = clock
        self.latency_s, self.loss, self.wire = latency_s, loss, wire
        self._uplink = uplink
        self.rng = random.Random(seed)
        self.stats = WireStats()
        self.transports: dict[int, ShapedTransport] = {}
        self.uplinks: dict[int, _Uplink] = {}
        self._streams: dict[tuple[int, int, bool], _Stream] = {}
        self._by_src: dict[int, list[_Stream]] = {}
        self._cut: set[Pair] = set()
        self._drop: dict[Pair, float] = {}
        self._delay: dict[Pair, float] = {}
        self.crashed: set[int] = set()
        self._hung: dict[int, list[tuple[_Stream, Frame]]] = {}  # rank -> frames its kernel took meanwhile
        self._hung_bytes: dict[int, int] = {}
        self.lost_at: dict[tuple[int, int], float] = {}  # (src, dst) -> when frames went with a dead peer

    def transport(self, rank: int) -> ShapedTransport:
        rate = self._uplink[rank] if isinstance(self._uplink, Mapping) else self._uplink
        self.uplinks[rank] = _Uplink(rate=float(rate), segment=segment_bytes(float(rate)))
        self.uplinks[rank].meter.saw_rtt(2 * self.latency_s)
        t = self.transports[rank] = ShapedTransport(rank, self)
        return t

    def reshape(self, rank: int, rate: float) -> None:
        """`rank`'s uplink sends `rate` bytes per second from now on (tc class change)."""
        up = self.uplinks[rank]
        up.rate, up.segment = float(rate), segment_bytes(float(rate))

    def streams_of(self, rank: int) -> list[_Stream]:
        return self._by_src.get(rank, [])

    # ---- the fault language (packets, as iptables sees them) ------------------------------------

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
        up = self.uplinks.get(rank)
        if up is not None:
            up.queue.clear()
            up.queued_bytes = 0
        now = self.clock.now()
        for s in [s for ss in self._by_src.values() for s in ss if s.dst == rank]:
            if s.outstanding:  # the connection is reset: what it held is lost
                self.lost_at[(s.src, rank)] = now
            s.unsent.clear()
            s.unsent_bytes = 0
            s.waiting.clear()
            s.voided.clear()
            s.frames.clear()
            s.acked = s.written

    def hang(self, rank: int) -> None:
        self._hung.setdefault(rank, [])
        self._hung_bytes.setdefault(rank, 0)

    def resume(self, rank: int) -> None:
        waiting = self._hung.pop(rank, [])
        self._hung_bytes.pop(rank, None)
        for stream, msg in waiting:
            self._hand_up(stream, msg)
        for stream in [s for ss in self._by_src.values() for s in ss if s.dst == rank]:
            self._ack_upto(stream, stream.delivered)  # the window opens: what waited is acknowledged
        for src in list(self.uplinks):
            self._pump(src)
        self._pump(rank)

    # ---- sending -------------------------------------------------------------------------------

    def _stream(self, src: int, dst: int, bulk: bool) -> _Stream:
        key = (src, dst, bulk)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = _Stream(src=src, dst=dst, bulk=bulk)
            self._by_src.setdefault(src, []).append(s)
        return s

    def transmit(self, src: int, dst: int, msg: Frame) -> None:
        self.stats.sent += 1
        if src in self.crashed:
            return
        if dst in self.crashed:  # the peer's sockets are gone: the sender's next connect is refused
            self.stats.dropped += 1
            self.lost_at[(src, dst)] = self.clock.now()
            self.clock.call_later(self.latency_s, lambda: self._refused(src, dst))
            return
        payload = 0 if msg.payload is None else len(memoryview(msg.payload).cast("B"))
        self.stats.data_bytes += payload
        if self.wire:
            msg = decode(b"".join(bytes(b) for b in encode(msg)))
        s = self._stream(src, dst, payload > CONTROL_MAX_PAYLOAD)
        size = payload + HEADER_BYTES
        start = s.written
        if s.written == s.acked:
            s.progress_at = self.clock.now()
        s.written += size
        s.frames.append((s.written, msg))
        s.unsent.append((start, s.written))
        s.unsent_bytes += size
        if s.bulk:
            s.waiting[start] = msg
        s.frames_sent += 1
        s.bytes_sent += size
        self._pump(src)

    def _pump(self, src: int) -> None:
        """Move what the rank's streams may send into its uplink's queue: control bytes at once,
        bulk bytes while the in-flight budget has room (a segment a stream in turn, as the
        transport's channels share it); then keep the uplink busy."""
        up = self.uplinks.get(src)
        if up is None or src in self.crashed or src in self._hung:
            return
        streams = self.streams_of(src)
        for s in streams:
            while not s.bulk and s.unsent:
                self._segment_out(up, s)
        waiting = [s for s in streams if s.bulk and s.unsent]
        if waiting and not up.backlogged:
            up.backlogged, up.sampled_at = True, self.clock.now()
        # each busy bulk stream may have its share of the budget in flight, as each bulk
        # channel of the transport does: a stream stuck on a dead or stopped peer holds up no other
        busy = [s for s in streams if s.bulk and s.outstanding and s.dst not in self.crashed]
        share = max(up.meter.budget() // max(1, len(busy)), MIN_CHANNEL_BUDGET)
        while waiting:
            for s in list(waiting):
                if s.outstanding - s.unsent_bytes >= share:
                    waiting.remove(s)
                    continue
                self._segment_out(up, s)
                if not s.unsent:
                    waiting.remove(s)
        up.backlogged = any(s.bulk and s.unsent for s in streams)
        if not up.busy and up.queue:
            self._send_next(src, up)

    def _segment_out(self, up: _Uplink, s: _Stream) -> int:
        """Queue one segment of `s`'s unsent bytes; its size."""
        start, end = s.unsent[0]
        msg = s.waiting.pop(start, None)
        if msg is not None:
            # a bulk frame begins only once the budget lets it out, and the transport drops it
            # then if its op or view is out of date (net/tcp.py's _encode_fresh); its bytes
            # still go here, as a stand-in, but nothing is handed up
            t = self.transports.get(s.src)
            if t is not None and t.events is not None and t.events.is_stale(msg):
                s.voided.add(end)
        size = min(end - start, up.segment)
        up.queue.append(_Segment(stream=s, start=start, size=size))
        up.queued_bytes += size
        s.unsent_bytes -= size
        if start + size >= end:
            s.unsent.popleft()
        else:
            s.unsent[0] = (start + size, end)
        return size

    def _send_next(self, src: int, up: _Uplink) -> None:
        seg = up.queue.popleft()
        up.queued_bytes -= seg.size
        up.busy = True
        self.clock.call_later(seg.size / up.rate, functools.partial(self._sent, src, seg))

    def _sent(self, src: int, seg: _Segment) -> None:
        """The uplink put `seg` on the wire: it arrives, or is lost and sent again later."""
        up = self.uplinks[src]
        up.busy = False
        if src not in self.crashed:
            self._fly(seg)
            if up.queue:
                self._send_next(src, up)
            else:
                self._pump(src)

    def _fly(self, seg: _Segment) -> None:
        s = seg.stream
        seg.tries += 1
        link = pair(s.src, s.dst)
        lost = link in self._cut or self.rng.random() < self._drop.get(link, self.loss)
        if lost:
            self.stats.dropped += 1
            s.lost += 1
            self.clock.call_later(self._resend_after_s(seg), functools.partial(self._retransmit, seg))
            return
        delay = self.latency_s + self._delay.get(link, 0.0)
        self.clock.call_later(delay, functools.partial(self._arrive, seg))

    def _resend_after_s(self, seg: _Segment) -> float:
        """When TCP sends a lost segment again: its first loss is found by the duplicate
        acknowledgements of the segments behind it (or a tail-loss probe), about a round trip
        later; a loss of the retransmission waits for the retransmission timer, doubling."""
        link = pair(seg.stream.src, seg.stream.dst)
        rtt = 2 * (self.latency_s + self._delay.get(link, 0.0))
        if seg.tries == 1:
            return rtt + 4 * seg.size / self.uplinks[seg.stream.src].rate + 0.002
        return float(min(max(RTO_MIN_S, 2 * rtt) * 2 ** (seg.tries - 2), RTO_MAX_S))

    def retransmit_s(self, src: int, dst: int) -> float:
        """The retransmission timeout of the link, without backoff, once it has lost a segment
        (as the TCP transport reads it); 0.0 before."""
        if not any(s.lost for s in self.streams_of(src) if s.dst == dst):
            return 0.0
        rtt = 2 * (self.latency_s + self._delay.get(pair(src, dst), 0.0))
        return float(max(RTO_MIN_S, 2 * rtt))

    def _retransmit(self, seg: _Segment) -> None:
        s = seg.stream
        if s.src in self.crashed or s.dst in self.crashed or seg.start + seg.size <= s.acked:
            return
        if seg.start == s.acked and seg.tries >= 2:  # a retransmission timeout, as tcpi_retransmits counts
            s.head_tries += 1
            self.check_stall(s, report=True)
        up = self.uplinks[s.src]
        up.queue.appendleft(seg)  # TCP sends a timed-out segment before new data
        up.queued_bytes += seg.size
        if not up.busy:
            self._send_next(s.src, up)

    def check_stall(self, s: _Stream, *, report: bool = False) -> None:
        """As net/tcp.py decides it (uplink.stalled, fed the figures the kernel would report):
        bytes outstanding and no acknowledgement for as long as the link's history makes
        conclusive. Reported once (as the transport's sampler does) when found by a
        retransmission."""
        now = self.clock.now()
        if s.stalled or not s.outstanding:
            return
        up = self.uplinks[s.src]
        segs_out = max(1, s.bytes_sent // up.segment)
        in_flight = s.outstanding - s.unsent_bytes
        queue_s = up.queued_bytes / up.rate
        others = sum(o.outstanding for o in self.streams_of(s.src) if o is not s and not o.stalled)
        counters = TcpCounters(rtt_s=2 * (self.latency_s + self._delay.get(pair(s.src, s.dst), 0.0)) + queue_s,
                               rttvar_s=0.0,
                               min_rtt_s=2 * self.latency_s, retransmits=s.head_tries, last_ack_s=now - s.last_ack_at,
                               total_retrans=s.lost, unacked_packets=-(-in_flight // up.segment), segs_out=segs_out,
                               delivery_rate=up.meter.rate or up.rate, snd_mss=up.segment)
        s.loss = s.loss.judged(counters, s.progress_at)  # what it lost so far was lost before this silence
        if stall_found(counters, s.loss, now - s.progress_at, others, up.meter):
            s.stalled = True
            t = self.transports.get(s.src)
            if report and t is not None and t.events is not None and s.src not in self._hung:
                t.events.on_link_down(s.dst, f"nothing acknowledged for {now - s.progress_at:.1f} s while the "
                                             "kernel retransmits")

    # ---- receiving -----------------------------------------------------------------------------

    def _arrive(self, seg: _Segment) -> None:
        s = seg.stream
        if s.dst in self.crashed or s.src in self.crashed:
            return
        ack_at = self.latency_s + self._delay.get(pair(s.src, s.dst), 0.0)
        self.clock.call_later(ack_at, functools.partial(self._heard_ack, s))  # any segment is acknowledged
        if seg.start + seg.size <= s.delivered or seg.start in s.arrived:
            self._ack_upto(s, s.delivered)  # a duplicate: acknowledged again
            return
        if s.dst in self._hung:
            held = self._hung_bytes.get(s.dst, 0)
            if held >= RECEIVE_BUFFER_BYTES:
                return  # the window is closed: the sender waits (and does not call it a stall)
            self._hung_bytes[s.dst] = held + seg.size
        s.arrived.add(seg.start)
        s.sizes[seg.start] = seg.size
        while s.delivered in s.arrived:
            s.arrived.discard(s.delivered)
            s.delivered += s.sizes.pop(s.delivered)
        while s.frames and s.frames[0][0] <= s.delivered:
            end, msg = s.frames.popleft()
            if end in s.voided:
                s.voided.discard(end)
                continue
            self._hand_up(s, msg)
        if s.frames and s.delivered > 0 and s.bulk:
            self._progress(s)
        self.clock.call_later(ack_at, functools.partial(self._ack_upto, s, s.delivered))

    def _heard_ack(self, s: _Stream) -> None:
        s.last_ack_at = self.clock.now()

    def _progress(self, s: _Stream) -> None:
        now = self.clock.now()
        if now - s.reported_at >= PROGRESS_EVERY_S and s.dst not in self._hung:
            s.reported_at = now
            t = self.transports[s.dst]
            if t.events is not None:
                t.events.on_progress(s.src)

    def _hand_up(self, s: _Stream, msg: Frame) -> None:
        if s.dst in self._hung:
            self._hung[s.dst].append((s, msg))
            return
        t = self.transports[s.dst]
        if t.events is not None:
            t.events.on_message(msg)

    def _ack_upto(self, s: _Stream, offset: int) -> None:
        if offset <= s.acked or s.src in self.crashed:
            return
        now = self.clock.now()
        up = self.uplinks[s.src]
        # a queue formed when what waits in the uplink's queue takes QUEUE_SEEN_S to go out (the
        # TCP transport reads the same from the round trip's rise)
        queue_s = up.queued_bytes / up.rate
        queued = queue_s > QUEUE_SEEN_S
        if queued:
            up.meter.saw_queue()
        up.meter.acknowledged(now, offset - s.acked, queued=queued)
        if up.backlogged:  # the rank had more to send: the acknowledgements measure its uplink
            up.meter.add(now - up.sampled_at, offset - s.acked, now, queued=queued)
            up.sampled_at = now
            if not queued and s.bulk and s.unsent:  # the budget held this stream's bytes back, and no queue formed
                up.meter.grow(now, 2 * (self.latency_s + self._delay.get(pair(s.src, s.dst), 0.0)) + queue_s)
        s.acked = offset
        s.progress_at = now
        s.head_tries = 0
        s.stalled = False
        self._pump(s.src)

    def _refused(self, src: int, dst: int) -> None:
        t = self.transports.get(src)
        if t is not None and t.events is not None and src not in self.crashed and src not in self._hung:
            t.events.on_link_down(dst, f"connection to rank {dst} refused", True)
