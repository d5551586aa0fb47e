"""What a rank's uplink carries: its speed, learnt from the bytes peers acknowledge, and how many
bytes may be in flight so that nothing queues far behind data.

Edge links are slow and their queues are deep (a home router holds seconds of data, and so does
a kernel socket buffer that autotuning grew to 4 MB). TCP fills whatever queue it finds, so a
ping, a confirmation or a view-change frame sent behind megabytes of tensor data waits seconds,
and a slow link looks like a broken one. fttree therefore keeps every rank's unacknowledged bulk
bytes near `rate x (min_rtt + QUEUE_TARGET_S)`: the link stays busy (a bandwidth-delay product
plus a little) while a frame sent now waits about QUEUE_TARGET_S, whatever the rate.

The budget starts small (a slow link must not fill its queue on the first step) and grows as
TCP's window does in slow start: it doubles once a round trip while the rank has more to send
than it lets out and no queue forms on the path. A queue is seen as a round trip
QUEUE_SEEN_S above the least one: bytes wait in some buffer, so the link, not the budget,
limits the rate. From then on the budget follows the measured rate, `rate x (min_rtt +
QUEUE_TARGET_S)`. The rate is measured, never configured: bytes acknowledged per second over
the intervals in which the rank had more to send than it was allowed to, the best slice of the
last half minute of such busy time. Only slices in which a queue formed say what the link
carries (`link_rate`, what the group may pace itself by): on loopback or a LAN the sender's
CPU, the receiver's or the budget is what limits a slice, no queue forms, and the group runs
unpaced. Pure arithmetic here; the TCP transport feeds it what the kernel reports
(`unacked_bytes`, `tcp_counters`), the shaped simulator what its queues hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
from collections import deque
from dataclasses import dataclass

QUEUE_TARGET_S = 0.05  # how long a frame may wait behind bulk data this rank sent before it
QUEUE_SEEN_S = QUEUE_TARGET_S / 2  # a round trip this far above the least one: a queue formed on the path
INITIAL_BUDGET_BYTES = 32 * 1024  # before any measurement: 0.26 s at 1 Mbit/s, nothing on a LAN
MIN_BUDGET_BYTES = 16 * 1024  # 0.13 s behind 1 Mbit/s
MAX_BUDGET_BYTES = 64 * 1024 * 1024
POLL_MIN_S = 0.002  # a bulk channel waiting for room looks again this often, at the most
SLICE_S = 0.2  # the rate is measured over slices of this much busy time ...
RAMP_SLICE_S = 0.05  # ... or this much for the first figure of a link that queues (one sample of the transport's)
WINDOW_S = 30.0  # ... and is the best slice of this long ago or since
MAX_SLICES = 256
CLEAR_BYTES = 4 * 1024 * 1024  # acknowledged over WINDOW_S with no queue: the link limits nothing


@dataclass
class UplinkMeter:
    """Bytes per second this rank's uplink delivers, and the in-flight budget that follows.

    Busy time is cut into slices of SLICE_S; the rate is the best slice of the last WINDOW_S
    (BBR's bottleneck bandwidth is a windowed maximum for the same reason): a slice in which a
    link stalled (a cut, a retransmission timeout) or a peer was slow to read says little about
    the uplink, and must not pull the estimate down while the link's own figure is recent."""

    min_rtt_s: float | None = None  # the least round trip seen on any link (None: unknown)

    def __post_init__(self) -> None:
        self._slices: deque[tuple[float, float, bool]] = deque()  # (when, rate, a queue formed) of whole slices
        # their maxima, kept as the slices change: read on every acknowledgement (a simulated
        # 16 MB step spent a fifth of its CPU taking them over the slices again)
        self._rate = self._link_rate = 0.0
        self._busy_s = 0.0  # of the slice being filled
        self._bytes = 0
        self._queued = False  # a queue formed during the slice being filled
        self._budget = INITIAL_BUDGET_BYTES
        self._grown_at = -float("inf")
        self._queue_at = -float("inf")  # when a queue was last seen on the path
        self._clear_bytes = 0  # bytes acknowledged since, with no queue

    def add(self, seconds: float, acked_bytes: int, now: float, *, queued: bool = False) -> None:
        """`acked_bytes` were acknowledged over `seconds` (ending `now`) during which this rank
        had more to send; `queued`: the round trip showed a queue on the path meanwhile."""
        if seconds <= 0:
            return
        self._busy_s += seconds
        self._bytes += acked_bytes
        self._queued = self._queued or queued
        if queued:
            self._queue_at, self._clear_bytes = now, 0
        # the first figure of a link that queues comes after RAMP_SLICE_S, to bring the budget
        # down soon; later ones over whole slices (a lossy link's acknowledgements come in bursts
        # after each hole, and a short slice's maximum overstates the link)
        first = self._queued and not self.link_rate
        if self._busy_s < (RAMP_SLICE_S if first else SLICE_S):
            return
        self._slices.append((now, self._bytes / self._busy_s, self._queued))
        self._busy_s, self._bytes, self._queued = 0.0, 0, False
        while self._slices[0][0] < now - WINDOW_S or len(self._slices) > MAX_SLICES:
            self._slices.popleft()
        self._rate = max(rate for _at, rate, _queued in self._slices)
        self._link_rate = max((rate for _at, rate, queued in self._slices if queued), default=0.0)
        if self.link_rate:
            self._budget = self._rate_budget(self.link_rate)

    def acknowledged(self, now: float, acked_bytes: int, *, queued: bool) -> None:
        """`acked_bytes` were acknowledged by `now`, whether the rank had more to send or not;
        `queued`: the round trip showed a queue meanwhile. A link that carried CLEAR_BYTES and
        more over WINDOW_S with no queue forming limits nothing (any more): its link rate is
        forgotten, so that a pace a loss burst or a slow spell brought is lifted (the group
        paces itself by link_rate). Without traffic nothing is forgotten: an idle slow link
        (rounds apart) keeps its figure."""
        if queued:
            self._queue_at, self._clear_bytes = now, 0
            return
        self._clear_bytes += acked_bytes
        if self._link_rate and now - self._queue_at >= WINDOW_S and self._clear_bytes >= CLEAR_BYTES:
            self._slices = deque((at, rate, False) for at, rate, _queued in self._slices)
            self._link_rate = 0.0

    def grow(self, now: float, rtt_s: float) -> None:
        """The budget held the rank back (it had more to send) and no queue formed on the path:
        doubled, at most once a round trip `rtt_s` (or poll), as TCP's window in slow start, so
        that the round trip can show a queue before the budget outgrows the link."""
        if now - self._grown_at < max(rtt_s, POLL_MIN_S):
            return
        self._grown_at = now
        self._budget = min(2 * self._budget, MAX_BUDGET_BYTES)

    def saw_queue(self) -> None:
        """A queue formed on the path (the round trip rose QUEUE_SEEN_S above the least one): the
        link limits the rate, and the budget comes down to what keeps the queue near
        QUEUE_TARGET_S."""
        self._queued = True
        rate = self.link_rate or self.rate
        self._budget = min(self._budget, self._rate_budget(rate) if rate else max(self._budget // 2, MIN_BUDGET_BYTES))

    def saw_rtt(self, rtt_s: float) -> None:
        if rtt_s > 0 and (self.min_rtt_s is None or rtt_s < self.min_rtt_s):
            self.min_rtt_s = rtt_s

    @property
    def rate(self) -> float:
        """Bytes per second, or 0.0 before a whole slice was measured."""
        return self._rate

    @property
    def link_rate(self) -> float:
        """The best rate of the slices in which a queue formed, so the link limited them (0.0
        while none did): what the group may pace itself by. A figure the budget or a CPU held
        down would start a pace round for a link many times faster (on loopback it held a
        7-worker job to 23.5 MB/s)."""
        return self._link_rate

    @property
    def unbottlenecked(self) -> bool:
        """The budget grew with no queue forming on the path: a LAN's or loopback's uplink, where
        a silence of a few round trips is evidence (stalled) and a short retransmission timeout
        safe (fast_rto_min). Behind a slow uplink a queue forms at the first budget already
        (at 10 Mbit/s 32 KB wait 26 ms), and the handshake's round trip said nothing of it. A
        job of small steps grows its budget only as far as its frames need."""
        return self._budget > INITIAL_BUDGET_BYTES and not self.link_rate

    def _rate_budget(self, rate: float) -> int:
        wanted = rate * ((self.min_rtt_s or 0.0) + QUEUE_TARGET_S)
        return int(min(max(wanted, MIN_BUDGET_BYTES), MAX_BUDGET_BYTES))

    def budget(self) -> int:
        """Bytes this rank may have sent and not yet acknowledged, over all its bulk links."""
        return self._budget


def queue_formed(counters: TcpCounters) -> bool:
    """The connection's round trip says bytes wait in a queue on the path (a bottleneck's
    buffer), not merely on the wire: QUEUE_SEEN_S above its least round trip."""
    return bool(counters.min_rtt_s) and counters.rtt_s - counters.min_rtt_s > QUEUE_SEEN_S


# ---- what the kernel says about one TCP socket (Linux; elsewhere the fields are None) ---------

_SIOCOUTQ = getattr(termios, "TIOCOUTQ", 0x5411)
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_OUTQ = struct.Struct("i")


def unacked_bytes(sock: socket.socket) -> int | None:
    """Bytes written to `sock` that its peer has not acknowledged yet (sent or not), or None."""
    try:
        raw = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return None
    return int(_OUTQ.unpack(raw)[0])


@dataclass(frozen=True, slots=True)
class TcpCounters:
    rtt_s: float  # smoothed round trip
    rttvar_s: float  # its variation (RFC 6298)
    min_rtt_s: float  # the least round trip seen (0.0 where the kernel does not say)
    retransmits: int  # retransmission timeouts in a row without an acknowledgement
    last_ack_s: float  # since the last acknowledgement of any kind arrived (a lossy link's duplicates count)
    total_retrans: int = 0  # segments sent again over the connection's life: the link has lost packets
    unacked_packets: int = 0  # segments sent and not yet acknowledged (in flight)
    segs_out: int = 0  # segments sent over the connection's life
    delivery_rate: float = 0.0  # bytes per second the connection delivered lately (0.0: not measured)
    snd_mss: int = 0  # bytes a segment carries


RTO_MIN_S = 0.2  # Linux's least retransmission timeout
FAST_RTO_MIN_S = 0.02  # the least the TCP transport sets on a connection whose round trip shows no queue
FAST_RTT_S = 0.002  # ... a round trip below this (a LAN, loopback) ...
FAST_DELIVERY = 100e6  # ... while it delivers at least this many bytes per second (800 Mbit/s)


def fast_rto_min(counters: TcpCounters) -> bool:
    """May the connection's least retransmission timeout be FAST_RTO_MIN_S? While its round
    trip is a LAN's: a lost segment is sent again after tens of milliseconds, and a cut shows
    as a timeout in vain as soon (stalled). A round trip that grew (a queue, a slow or far
    link) takes Linux's 0.2 s again, so a segment waiting in a queue is not sent twice. A
    handshake's round trip says nothing of the link's rate (behind a 10 Mbit/s uplink on
    loopback it is microseconds): the connection must have delivered fast too."""
    return counters.rtt_s < FAST_RTT_S and counters.delivery_rate >= FAST_DELIVERY


def retransmit_timeout_s(counters: TcpCounters) -> float:
    """TCP's retransmission timeout from its round-trip figures (RFC 6298, Linux's 200 ms
    floor on the variation term), without the backoff of a link that is failing."""
    return counters.rtt_s + max(4 * counters.rttvar_s, RTO_MIN_S)


# ---- when a connection is stalled (a cut), not slow or lossy --------------------------------------

STALL_MIN_S = 1.0  # the careful rule: no acknowledgement for this long and STALL_RTTS round trips ...
STALL_RTTS = 4
STALL_RETRANSMITS = 3  # ... while the retransmission timer expired this often in a row
QUIET_STALL_MIN_S = 0.05  # the quick rule, on a link that loses nothing: no acknowledgement for this long ...
QUIET_STALL_RETRANSMITS = 1  # ... and this many retransmission timeouts in a row
DELAYED_ACK_S = 0.2  # ... and this longer with one segment in flight (Linux may delay its acknowledgement)
CLEAN_LOSS = 1 / 256  # a link that resent at most this share of its segments before the silence loses nothing
CLEAN_SLACK = 3  # ... and these few segments besides


def lost_nothing(counters: TcpCounters) -> bool:
    """Had the connection lost (almost) nothing: at most CLEAN_LOSS of its segments, and a few
    more? Read soon after bytes were last acknowledged; the few allow for what a silence that
    began before the look already cost (a tail-loss probe and the segments a retransmission
    timeout sends again, besides the timeouts' own, `retransmits`)."""
    return counters.total_retrans - counters.retransmits - CLEAN_SLACK <= CLEAN_LOSS * counters.segs_out


ASSUMED_RATE = 125_000.0  # bytes/s an unmeasured uplink is taken to carry (1 Mbit/s): a wait it sets errs long


def ahead_s(others_bytes: int, rate: float) -> float:
    """How long the rank's uplink takes for the bytes of its other connections that are not
    acknowledged yet: they may sit ahead of this connection's in the uplink's queue."""
    return others_bytes / (rate or ASSUMED_RATE)


def stall_wait_s(counters: TcpCounters | None, clean: bool, queued_ahead_s: float = 0.0) -> float:
    """How long a connection with bytes in flight may go without any acknowledgement before it
    is stalled.

    What the silence proves depends on the link. On a link that lost nothing before (`clean`)
    a live receiver's kernel acknowledges every round trip, whatever its process is doing, so
    a silence of a few round trips (at least QUIET_STALL_MIN_S), plus twice the time of the
    bytes ahead (what the rank's other connections have queued in its uplink, `queued_ahead_s`,
    and its own segments in flight at the rate it delivered lately), with a retransmission
    timeout gone in vain (a lossy link that had not shown its losses yet must lose a tail and
    its probe in a row), is a cut: on a LAN, where the transport sets the least timeout to
    FAST_RTO_MIN_S, about 50 ms, where TCP's own evidence (three timeouts
    in a row, 0.2 + 0.4 + 0.8 s) took 1.5 s; a wrong call there costs a detour of a few
    milliseconds. A lossy link's holes keep the acknowledgements still for a timeout or two, and
    a wrong call there doubles a slow link's traffic: it takes the careful rule, as does a
    connection that has delivered nothing measurable yet."""
    rtt = 0.0 if counters is None else counters.rtt_s
    if not clean or counters is None or not counters.delivery_rate:
        return max(STALL_MIN_S, STALL_RTTS * rtt)
    # its own segments in flight take their time too, at the rate the connection delivered lately
    own_s = counters.unacked_packets * counters.snd_mss / counters.delivery_rate
    wait = max(QUIET_STALL_MIN_S, STALL_RTTS * rtt) + 2 * (queued_ahead_s + own_s)
    return wait + DELAYED_ACK_S if counters.unacked_packets <= 1 else wait


def stalled(counters: TcpCounters | None, silent_s: float, clean: bool, queued_ahead_s: float = 0.0) -> bool:
    """Is a connection whose oldest outstanding byte has waited `silent_s` for an
    acknowledgement stalled? Without counters (no TCP_INFO) only the careful wait counts."""
    wait = stall_wait_s(counters, clean, queued_ahead_s)
    if silent_s < wait:
        return False
    if counters is None:
        return True
    if counters.last_ack_s < wait:
        return False  # acknowledgements of some kind still come (a lossy link's duplicates)
    if clean and counters.delivery_rate:  # segments in flight (not a closed window), sent again in vain
        return counters.unacked_packets > 0 and counters.retransmits >= QUIET_STALL_RETRANSMITS
    return counters.retransmits >= STALL_RETRANSMITS


@dataclass(frozen=True, slots=True)
class LossHistory:
    """What a connection had lost when bytes were last acknowledged: the stall rule's `clean`.
    Judged at each new acknowledgement only, so what a silence that follows costs (its
    retransmissions) never makes the link look lossy before it is called stalled."""

    clean: bool = False  # it had lost (almost) nothing (lost_nothing)
    as_of: float = -float("inf")  # the acknowledgement progress it was judged at

    def judged(self, counters: TcpCounters | None, progress_at: float) -> LossHistory:
        """Brought up to date with `counters`, read at or after acknowledgement progress `progress_at`."""
        if counters is None or progress_at <= self.as_of:
            return self
        return LossHistory(clean=lost_nothing(counters), as_of=progress_at)


def quick_rule(history: LossHistory, meter: UplinkMeter) -> bool:
    """Does the quick rule apply: a link that lost nothing, behind an uplink with no bottleneck?"""
    return history.clean and meter.unbottlenecked


def stall_found(counters: TcpCounters | None, history: LossHistory, silent_s: float, others_bytes: int,
                meter: UplinkMeter) -> bool:
    """The stall rule, whole, as the TCP transport (net/tcp.py) and the shaped simulator
    (testing/shaped.py) both apply it: a connection whose oldest outstanding byte has waited
    `silent_s`, with `others_bytes` of the rank's other connections outstanding ahead of it in
    the uplink, and `history` judged with the same `counters`."""
    return stalled(counters, silent_s, quick_rule(history, meter), ahead_s(others_bytes, meter.rate))


def tcp_counters(sock: socket.socket) -> TcpCounters | None:
    """The kernel's view of a connected TCP socket (Linux TCP_INFO), or None. A socket closed
    under us has none: uvloop's socket object then raises ValueError (a negative descriptor),
    which, escaping, once cut short a step's actions on a peer's death."""
    if _TCP_INFO is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 168)
        if len(info) >= 72:
            rtt = struct.unpack_from("<I", info, 68)[0] / 1e6
            rttvar = struct.unpack_from("<I", info, 72)[0] / 1e6
            min_rtt = struct.unpack_from("<I", info, 148)[0] / 1e6 if len(info) >= 152 else 0.0
            last_ack = struct.unpack_from("<I", info, 56)[0] / 1e3  # tcpi_last_ack_recv, ms
            total_retrans = struct.unpack_from("<I", info, 100)[0] if len(info) >= 104 else 0
            unacked = struct.unpack_from("<I", info, 24)[0]
            segs_out = struct.unpack_from("<I", info, 136)[0] if len(info) >= 140 else 0
            delivery = struct.unpack_from("<Q", info, 160)[0] if len(info) >= 168 else 0
            return TcpCounters(rtt_s=rtt, rttvar_s=rttvar, min_rtt_s=min_rtt, retransmits=info[2],
                               last_ack_s=last_ack, total_retrans=total_retrans, unacked_packets=unacked,
                               segs_out=segs_out, delivery_rate=float(delivery),
                               snd_mss=struct.unpack_from("<I", info, 16)[0])
    return None
