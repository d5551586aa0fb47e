"""What a rank's uplink carries: its speed, learnt from the bytes peers acknowledge, and how many
bytes may be in flight so that nothing queues far behind data.

Edge links are slow and their queues are deep (a home router holds seconds of data, and so does
a kernel socket buffer that autotuning grew to 4 MB). TCP fills whatever queue it finds, so a
ping, a confirmation or a view-change frame sent behind megabytes of tensor data waits seconds,
and a slow link looks like a broken one. fttree therefore keeps every rank's unacknowledged bulk
bytes near `rate x (min_rtt + QUEUE_TARGET_S)`: the link stays busy (a bandwidth-delay product
plus a little) while a frame sent now waits about QUEUE_TARGET_S, whatever the rate.

The rate is measured, never configured: bytes acknowledged per second over the intervals in
which the rank had more to send than it was allowed to (so the figure is the link's, not the
application's), the best slice of the last half minute of such busy time. While the budget is
what holds the rank back, the measured rate is the budget over the round trip, and the next
budget is larger by (min_rtt + target) / min_rtt: it grows until the link, not the budget,
limits the rate. Pure arithmetic here; the TCP transport feeds it what the kernel reports
(`unacked_bytes`, `tcp_counters`).
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
INITIAL_BUDGET_BYTES = 32 * 1024  # before any measurement: 0.26 s at 1 Mbit/s, nothing on a LAN
MIN_BUDGET_BYTES = 16 * 1024  # 0.13 s behind 1 Mbit/s
MAX_BUDGET_BYTES = 64 * 1024 * 1024
POLL_MIN_S = 0.002  # a bulk channel waiting for room looks again this often, at the most
LIMITED_CYCLES = 4  # a budget that took this many round trips (or polls) to drain was queued by the link
SLICE_S = 0.2  # the rate is measured over slices of this much busy time ...
RAMP_SLICE_S = 0.05  # ... or this much, while the budget is the limit (one sample of the transport's)
WINDOW_S = 30.0  # ... and is the best slice of this long ago or since
MAX_SLICES = 256


@dataclass
class UplinkMeter:
    """Bytes per second this rank's uplink delivers, and the in-flight budget that follows.

    Busy time is cut into slices of SLICE_S; the rate is the best slice of the last WINDOW_S
    (BBR's bottleneck bandwidth is a windowed maximum for the same reason): a slice in which a
    link stalled (a cut, a retransmission timeout) or a peer was slow to read says little about
    the uplink, and must not pull the estimate down while the link's own figure is recent."""

    min_rtt_s: float | None = None  # the least round trip seen on any link (None: unknown)

    def __post_init__(self) -> None:
        self._slices: deque[tuple[float, float]] = deque()  # (when, rate) of the newest whole slices
        self._busy_s = 0.0  # of the slice being filled
        self._bytes = 0
        self.link_limited = False  # the newest slice's rate was the link's, not the budget's

    def add(self, seconds: float, acked_bytes: int, now: float) -> None:
        """`acked_bytes` were acknowledged over `seconds` (ending `now`) during which this rank
        had more to send."""
        if seconds <= 0:
            return
        self._busy_s += seconds
        self._bytes += acked_bytes
        rate = self._bytes / self._busy_s
        # A budget acknowledged within a few round trips (or polls) was what held the rank back
        # (on loopback 32 KB every 2 ms read as 16 MB/s): the figure is a lower bound, and the
        # budget grows from it at once, without waiting for a whole slice (on loopback a
        # 1.63 MB step is busy for milliseconds: waiting for 0.2 s of it kept the budget small
        # for dozens of steps). Bytes the link held for longer queued: the link limited the rate.
        cycle = max(self.min_rtt_s or 0.0, POLL_MIN_S)
        budget_limited = (self._busy_s >= RAMP_SLICE_S and rate > 0
                          and self.budget() / rate < LIMITED_CYCLES * cycle)
        if self._busy_s >= SLICE_S or budget_limited:
            self.link_limited = not budget_limited
            self._slices.append((now, rate))
            self._busy_s, self._bytes = 0.0, 0
            while self._slices[0][0] < now - WINDOW_S or len(self._slices) > MAX_SLICES:
                self._slices.popleft()

    def saw_rtt(self, rtt_s: float) -> None:
        if rtt_s > 0 and (self.min_rtt_s is None or rtt_s < self.min_rtt_s):
            self.min_rtt_s = rtt_s

    @property
    def rate(self) -> float:
        """Bytes per second, or 0.0 before a whole slice was measured."""
        return max((rate for _at, rate in self._slices), default=0.0)

    @property
    def link_rate(self) -> float:
        """The rate once the link, not the in-flight budget, limited it (0.0 before): what the
        group may pace itself by. A figure the budget held down would start a pace round for a
        link many times faster."""
        return self.rate if self.link_limited else 0.0

    def budget(self) -> int:
        """Bytes this rank may have sent and not yet acknowledged, over all its bulk links."""
        rate = self.rate
        if not rate:
            return INITIAL_BUDGET_BYTES
        wanted = rate * ((self.min_rtt_s or 0.0) + QUEUE_TARGET_S)
        return int(min(max(wanted, MIN_BUDGET_BYTES), MAX_BUDGET_BYTES))


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


RTO_MIN_S = 0.2  # Linux's least retransmission timeout


def retransmit_timeout_s(counters: TcpCounters) -> float:
    """TCP's retransmission timeout from its round-trip figures (RFC 6298, Linux's 200 ms
    floor on the variation term), without the backoff of a link that is failing."""
    return counters.rtt_s + max(4 * counters.rttvar_s, RTO_MIN_S)


def tcp_counters(sock: socket.socket) -> TcpCounters | None:
    """The kernel's view of a connected TCP socket (Linux TCP_INFO), or None. A socket closed
    under us has none: uvloop's socket object then raises ValueError (a negative descriptor),
    which, escaping, once cut short a step's actions on a peer's death."""
    if _TCP_INFO is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 152)
        if len(info) >= 72:
            rtt = struct.unpack_from("<I", info, 68)[0] / 1e6
            rttvar = struct.unpack_from("<I", info, 72)[0] / 1e6
            min_rtt = struct.unpack_from("<I", info, 148)[0] / 1e6 if len(info) >= 152 else 0.0
            last_ack = struct.unpack_from("<I", info, 56)[0] / 1e3  # tcpi_last_ack_recv, ms
            total_retrans = struct.unpack_from("<I", info, 100)[0] if len(info) >= 104 else 0
            return TcpCounters(rtt_s=rtt, rttvar_s=rttvar, min_rtt_s=min_rtt, retransmits=info[2],
                               last_ack_s=last_ack, total_retrans=total_retrans)
    return None
