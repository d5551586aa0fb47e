"""TcpTransport: frames between workers over TCP, with a send queue and writer per link.

Each worker listens on its own host:port and opens one outgoing connection per peer it talks
to, bound to its own host address, so a firewall rule between two addresses cuts exactly one
link. Every outgoing link has its own queue and writer task: a peer that silently drops
packets stalls only its own writer, never the other links. A writer whose drain stalls past
`stall_timeout_s` drops the connection and reconnects, so a healed link comes back without
waiting for TCP's exponential retransmission backoff. Frames lost with a dropped connection are
the protocol's business (it recovers them through backup links). The in-process fault layer
wraps this transport from outside (faulty.py).

A connection serves both directions where only one side can dial (address.py: a rank listed
as `-`, or behind a site that the other rank is not in). The rank that can dial dials its
control and bulk connections at the start and keeps them up whether or not it has frames to
send; the dialled rank never dials back: once such a connection has proven the key
(handshake.py), its own channel of that kind to the dialler writes on it (`_Channel.adopt`), with
the same budget, stall detection and acknowledgement counters as a connection it dialled, and
the dialler reads frames on it (`_Channel._read`). A pair neither of which can dial the other
exchanges its frames through a relay, a rank both can reach (relay.py); the hooks here are
`send`, `deliver`, `link_state` and `wait_for_peers`, and a channel writes an envelope
(relay.Relayed) as it would a frame. Such a pair may get connections of its own by a TCP hole
punch (punch.py): the lower rank's channels take theirs as if dialled (`take_punched`), the
other's adopt them as accepted ones, and while both of the pair's are up its frames go on them
(`_relayed`); when one breaks, back on the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import struct
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..core.buffers import BufferPool
from ..core.limits import DEFAULT_MAX_PAYLOAD_BYTES
from ..core.messages import PREFIX, Frame, decode_header, decode_prefix, encode
from ..errors import ConfigError, FrameError, PeerError
from . import handshake as hs
from .address import Address, is_ip, parse_address
from .credentials import Credentials, rank_of
from .frame_reader import DialledReader, FrameReader
from .punch import Punches, is_note, read_seen, seen_frame
from .relay import Relayed, Relays, is_envelope
from .transport import LinkHealth, LinkState, LinkStatus, TransportEvents, TransportStatus
from .uplink import (
    FAST_RTO_MIN_S,
    POLL_MIN_S,
    RTO_MIN_S,
    LossHistory,
    TcpCounters,
    UplinkMeter,
    fast_rto_min,
    queue_formed,
    quick_rule,
    retransmit_timeout_s,
    stall_found,
    tcp_counters,
    unacked_bytes,
)

log = logging.getLogger("fttree.net.tcp")

STREAM_LIMIT = 16 * 1024 * 1024
DRAIN_ABOVE_BYTES = 256 * 1024  # wait for the socket only when this much is buffered
# A slow but live link (a loss burst: acknowledgements still come, so nothing is stalled) drains
# its queue slower than steps finish around it through relays; frames of finished steps then
# pile up in the queue until the writer reaches them (45 MB in 3 s at 50% loss in a chaos run).
# Once this many payload bytes are queued, pushing drops the stale ones, and again each time the
# queue has doubled since: the queue holds the steps still in flight, not every step run.
PURGE_ABOVE_BYTES = 8 * 1024 * 1024
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
TCP_RTO_MAX_MS = 44  # Linux 6.15+: cap on the retransmission backoff
TCP_RTO_MIN_US = 45  # Linux 6.16+: the connection's least retransmission timeout (uplink.fast_rto_min)


def _bound_retransmissions(sock: socket.socket, stall_timeout_s: float) -> None:
    """After a silent cut heals, TCP may wait out a backed-off retransmission timer (up to
    minutes) before the link carries data again. Drop connections whose data stays
    unacknowledged for stall_timeout_s, and cap the backoff at 1 s where the kernel allows."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, int(stall_timeout_s * 1000))
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, 1000)



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


CONTROL, BULK = hs.CONTROL, hs.BULK  # the two connections to a peer (_OutLink), as the HELLO names them
CONTROL_MAX_PAYLOAD = 16 * 1024  # larger payloads take the bulk connection (16 KiB: 0.13 s at 1 Mbit/s)
SLICE_BYTES = 64 * 1024  # a bulk frame is written in pieces of up to this, as the budget allows
MIN_CHANNEL_BUDGET = 16 * 1024  # however many bulk links share the budget, each may have this in flight
COUNTERS_FRESH_S = 1.0  # TCP_INFO this recent serves what changes slowly (retransmit_s)
SAMPLE_S = 0.05  # how often a busy transport reads its connections' acknowledgements
FLUSH_MAX_S = 60.0  # close() waits at most this long for unacknowledged bytes that still move
HELLO_TIMEOUT_S = 10.0  # a connection must finish the handshake this soon (Config.handshake_timeout_s)
LISTEN_BACKLOG = 1024  # connections the kernel holds until the listener accepts them (it accepts all at once)
ACCEPT_BATCH = 256  # connections a TLS listener accepts in one turn of the event loop
ACCEPT_RETRY_S = 0.1  # a TLS listener out of descriptors tries accepting again after this long
FIRST_BYTE_S = 1.0  # an outsider's TLS connection that sends no byte of its ClientHello this soon is closed
PER_HOST_HANDSHAKES = 4  # TLS connections in their handshake at once from one address no rank listens on
MEMBER_HOST_HANDSHAKES = 8  # ... from an address ranks listen on, per rank there (a rank opens up to 4 at once),
# beside the outsiders' places
MAX_PENDING_HANDSHAKES = 64  # connections not proven yet, at most (Config.max_pending_handshakes)
MAX_RANK = 65535  # the largest rank a HELLO may claim
MAX_UNKNOWN_RANKS = 4  # ranks not in the address table (joiners) with proven connections at once, at most
IDLE_UNKNOWN_S = 60.0  # such a rank's proven connection that carries no byte this long is closed
# Payload bytes such ranks may have announced and not finished sending, all together: a joiner
# sends small frames until the group knows it, and a key holder inventing ranks must not make a
# worker hold 4 ranks x 2 channels x max_payload_bytes of half-sent frames.
UNKNOWN_UNFINISHED_BYTES = 64 << 20
REDIAL_FIRST_S = 0.05  # a failed dial is tried again after this long, then twice as long ...
REDIAL_MAX_S = 1.0  # ... up to this
# A peer nobody here can dial, whose connection closed, dials again at once if it lives (it keeps
# its connections up: they are its peers' only way to it). Not dialled again within this long
# (or eight of the link's round trips, if longer), it counts as refused: its process is likely gone.
REDIAL_GRACE_S = 0.5
# Receive buffers the pool tracks: a 100 MB step in 4 MiB chunks holds one per chunk until its
# result lingers out (linger_s), about two steps' worth; 24 missed most reuses there.
RECEIVE_BUFFERS = 96


@dataclass
class _LinkStats:
    frames_sent: int = 0
    bytes_sent: int = 0
    frames_received: int = 0
    bytes_received: int = 0
    stale_dropped: int = 0
    connects: int = 0
    adopted: int = 0
    errors: int = 0
    last_error: str = ""


class _Conn:
    """A proven connection that a channel writes on: one it dialled (a stream), or one the peer
    dialled (an _Inbound) when the peer cannot be dialled from here. A channel needs only this."""

    __slots__ = ("_drain", "inbound", "transport")

    def __init__(self, transport: asyncio.WriteTransport, drain: Callable[[], Awaitable[None]],
                 inbound: _Inbound | None = None) -> None:
        self.transport, self._drain, self.inbound = transport, drain, inbound

    def writelines(self, bufs: list[bytes | memoryview]) -> None:
        self.transport.writelines(bufs)

    async def drain(self) -> None:
        await self._drain()

    def close(self) -> None:
        self.transport.close()

    def get_extra_info(self, name: str) -> Any:
        return self.transport.get_extra_info(name)


class _Channel:
    """One outgoing connection to a peer, with its queue and its writer task.

    Every peer has two (`_OutLink`): the control channel carries metadata, membership frames
    and small payloads, and is never queued behind tensor data; the bulk channel carries the
    large payloads, and writes them in slices while the rank's unacknowledged bulk bytes stay
    within the uplink budget (uplink.py), so that what the control channel sends waits behind
    little in the network's queues either."""

    def __init__(self, link: _OutLink, *, bulk: bool) -> None:
        self.t = link.t
        self.peer = link.peer
        self.bulk = bulk
        self.queue: deque[Frame] = deque()
        self.queued_bytes = 0  # payload bytes in `queue`, kept as frames come and go
        self.purge_above = PURGE_ABOVE_BYTES  # queued bytes past which a push drops stale frames
        self.slices: deque[memoryview] = deque()  # what is left of the frame being written (bulk)
        self.slice_bytes = 0
        self.wake = asyncio.Event()
        self.connected = asyncio.Event()
        self.idle = asyncio.Event()  # nothing queued and the last drain finished
        self.idle.set()
        self.writer: _Conn | None = None
        self.sock: socket.socket | None = None
        self.ever_connected = False
        self.unreachable = False  # the last dial failed: close() does not wait for what is queued here
        self.redial = False  # the peer closed the connection: dial once to learn whether it is gone
        self.retry_now = asyncio.Event()  # the peer is listening again: end the redial backoff now
        self.rtt_s = 0.0  # the smoothed round trip the kernel gave when the last connection was taken
        self.redial_due: asyncio.TimerHandle | None = None  # a passive peer's grace to dial again
        # acknowledgement progress of the current connection (uplink.py; Linux's SIOCOUTQ)
        self.written = 0  # bytes handed to the connection
        self.acked = 0  # of those, acknowledged by the peer
        self.progress_at = 0.0  # when `acked` last grew, or bytes went out with none outstanding
        self.stalled = False  # outstanding bytes, and no acknowledgement for the stall time
        self.loss = LossHistory()  # what the connection had lost when bytes were last acknowledged
        self.fast_rto = False  # the connection's least retransmission timeout is FAST_RTO_MIN_S
        self.lost_at = -float("inf")  # when frames were last lost with a broken connection
        self._read_at = -float("inf")  # when `_counters` was read (counters()): one read per look
        self._counters: TcpCounters | None = None
        name = f"fttree-link-{self.peer}" + ("-bulk" if bulk else "")
        self.task = asyncio.get_running_loop().create_task(self._run(), name=name)

    def peer_is_up(self) -> None:
        """The peer connected to us, so it listens: a redial waiting out its backoff (up to 1 s)
        dials now. A restarted or joining rank is sent its first ops' frames at once; waiting
        a backoff left them queued until its peers had moved on to a later view and dropped
        them as stale, and the joiner hung in its first step."""
        if self.writer is None:
            self.retry_now.set()

    # ---- what is outstanding -------------------------------------------------------------------

    def outstanding(self) -> int:
        """Bytes handed to the connection and not acknowledged by the peer (the event loop's
        buffer and the kernel's); updates the acknowledgement progress on the way."""
        writer = self.writer
        if writer is None or self.written == self.acked:  # all acknowledged at the last look, nothing since
            return 0
        buffered = writer.transport.get_write_buffer_size()
        in_kernel = None if self.sock is None else unacked_bytes(self.sock)
        if in_kernel is None:  # no SIOCOUTQ: what left the event loop counts as delivered
            in_kernel = 0
        acked = self.written - buffered - in_kernel
        if acked > self.acked:
            self.acked = acked
            self.progress_at = self.t.clock()
            self.stalled = False
        return buffered + in_kernel

    def counters(self, now: float) -> TcpCounters | None:
        """The connection's TCP_INFO as of the look at `now`: read once however many rules ask."""
        if self._read_at != now:
            self._read_at, self._counters = now, None if self.sock is None else tcp_counters(self.sock)
        return self._counters

    def recent_counters(self, now: float) -> TcpCounters | None:
        """The connection's TCP_INFO as read at most COUNTERS_FRESH_S before `now`."""
        return self._counters if now - self._read_at <= COUNTERS_FRESH_S else self.counters(now)

    def pending(self) -> int:
        """Bytes for the peer not yet acknowledged: queued, mid-frame, or on the connection."""
        return self.queued_bytes + self.slice_bytes + self.outstanding()

    def _hand_over(self, bufs: list[bytes | memoryview]) -> None:
        """Write `bufs` to the connection, counting them."""
        assert self.writer is not None
        if self.written == self.acked:  # nothing outstanding: the wait for acknowledgements starts now
            self.progress_at = self.t.clock()
        self.written += sum(len(b) for b in bufs)
        self.writer.writelines(bufs)
        self.t.busy()

    # ---- sending -------------------------------------------------------------------------------

    def push(self, msg: Frame) -> None:
        if self.idle.is_set() and (not self.bulk or self._fits(msg)) and self._write_now(msg):
            return
        self.queue.append(msg)
        if msg.payload is not None:
            self.queued_bytes += len(msg.payload)
            if self.queued_bytes > self.purge_above:
                self._drop_stale()
                self.purge_above = max(PURGE_ABOVE_BYTES, 2 * self.queued_bytes)
        self.idle.clear()
        self.wake.set()
        self.t.busy()

    def _fits(self, msg: Frame) -> bool:
        """A bulk frame may go out whole at once: the rank's in-flight budget has room for all of
        it. On a fast link (a budget of many megabytes) every frame does, and waking the writer
        task to write it in slices cost more than the send; on a slow one the writer slices it."""
        size = PREFIX.size + (0 if msg.payload is None else len(msg.payload))
        return self.writer is not None and self.t.channel_budget - self.outstanding() >= size

    def _write_now(self, msg: Frame) -> bool:
        """Write a frame at once when the link is idle: connected, nothing queued, the socket
        not backed up. A small step sends one frame at a time to each peer, and waking the
        writer task for each cost more than the rest of the send. False: queue it instead
        (the writer task then deals with a closed or slow connection as for any frame)."""
        writer = self.writer
        if (writer is None or self.t.closed or writer.transport.is_closing()
                or writer.transport.get_write_buffer_size() > DRAIN_ABOVE_BYTES):
            return False
        self._hand_over(self._encode_fresh(msg))
        if writer.transport.get_write_buffer_size() > DRAIN_ABOVE_BYTES:
            # backed up: the writer task waits for the socket (with the stall deadline), and
            # until it has, the link is not idle: frames queue behind, and close() waits
            self.idle.clear()
            self.wake.set()
        return True

    def _encode_fresh(self, msg: Frame) -> list[bytes | memoryview]:
        """The frame's buffers, counted as sent; none, counted as dropped, if its op has
        finished here (a frame queued meanwhile, or sent late by the fault layer's delay)."""
        stats = self.t.stats[self.peer]
        if self.t.is_stale(msg):
            stats.stale_dropped += 1
            return []
        bufs = msg.bufs() if isinstance(msg, Relayed) else encode(msg)
        stats.frames_sent += 1
        stats.bytes_sent += sum(len(buf) for buf in bufs)
        return bufs

    async def _connect(self) -> bool:
        t, addr = self.t, self.t.addresses.get(self.peer)
        if addr is None:  # a rank that joined with us, whose address we learn from its HELLO or JOIN
            t.stats[self.peer].last_error = f"the address of rank {self.peer} is not known yet"
            self.unreachable = True
            return False
        if not addr.dialable_from(t.me):  # (_run waits for its connection instead: never comes here)
            t.stats[self.peer].last_error = t.undialable(self.peer)
            self.unreachable = True
            return False
        try:
            tls = t.credentials.tls
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(addr.host, addr.port, local_addr=(t.me.host, 0) if t.me.listed else None,
                                        limit=STREAM_LIMIT,
                                        ssl=None if tls is None else tls.client,
                                        ssl_handshake_timeout=None if tls is None else t.handshake_timeout_s),
                t.connect_timeout_s)
        except ssl.SSLError as exc:  # its certificate is not of the job's CA, or it speaks no TLS
            why = f"TLS handshake with {addr}: {_tls_reason(exc)}"
            t.stats[self.peer].last_error = why
            t.refused(f"dial {addr}", why)
            self.unreachable = True
            return False
        except (OSError, TimeoutError) as exc:
            t.stats[self.peer].last_error = f"connect to {addr}: {exc or type(exc).__name__}"
            self.unreachable = True
            if isinstance(exc, ConnectionRefusedError):
                t.events.on_link_down(self.peer, f"connection to {addr} refused", True)
            return False
        self.sock = self._tune(writer.get_extra_info("socket"))
        refused = await self._handshake(reader, writer, addr)
        if refused:
            writer.transport.abort()
            self.sock = None
            t.stats[self.peer].last_error = refused
            t.refused(f"dial {addr}", refused)
            self.unreachable = True
            return False
        conn = _Conn(writer.transport, writer.drain)
        self._attach(conn)
        t.stats[self.peer].connects += 1
        self._read(reader, writer, conn)
        return True

    def _tune(self, sock: Any) -> socket.socket | None:
        """Set up a new connection's socket: no Nagle delay, bounded retransmissions."""
        if sock is None:
            return None
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _bound_retransmissions(sock, self.t.stall_timeout_s)
        # asyncio hands out a wrapper whose ioctl and getsockopt still reach the socket
        return cast(socket.socket, sock)

    def _attach(self, conn: _Conn) -> None:
        """A proven connection, dialled or adopted, carries this channel's frames from now on."""
        self.writer = conn
        self.rtt_s = tcp_rtt_s(conn) or self.rtt_s
        if self.redial_due is not None:  # the peer dialled again within its grace
            self.redial_due.cancel()
            self.redial_due = None
        self.unreachable = False
        self.written = self.acked = 0
        self._read_at = -float("inf")
        self.loss, self.fast_rto = LossHistory(), False  # a new connection's own history
        if self.sock is not None:
            self.follow_rtt(tcp_counters(self.sock))  # the handshake's round trip
        self.stalled = False
        self.ever_connected = True
        self.connected.set()

    def passive(self) -> bool:
        """The peer cannot be dialled from here: it dials us, and we write on its connection."""
        addr = self.t.addresses.get(self.peer)
        return addr is not None and not addr.dialable_from(self.t.me)

    def keep_up(self) -> bool:
        """The peer cannot dial us: our connection is its only way to us, so it stays up
        whether or not we have frames to send."""
        addr = self.t.addresses.get(self.peer)
        return addr is not None and addr.dialable_from(self.t.me) and not self.t.me.dialable_from(addr)

    def adopt(self, inbound: _Inbound) -> None:
        """The peer, which we cannot dial, dialled this channel's kind of connection to us and
        proved the key: our frames to it go on that connection from now on (its newest one)."""
        transport = inbound.transport
        if transport is None or self.t.closed:
            return
        if self.writer is not None:
            self._drop_connection(f"rank {self.peer} dialled a new connection")
        self.sock = self._tune(transport.get_extra_info("socket"))
        self._attach(_Conn(transport, inbound.drain, inbound))
        self.t.stats[self.peer].adopted += 1
        self.wake.set()

    def adopted_lost(self, inbound: _Inbound) -> None:
        """The connection the peer dialled, which carried our frames, is gone: it dials again."""
        if self.writer is None or self.writer.inbound is not inbound or self.t.closed:
            return
        self._drop_connection(f"rank {self.peer} closed the connection it dialled")
        self.t.events.on_link_down(self.peer, "closed by the peer")
        # one grace per peer (the control channel's), for a peer that dials us again if it lives: not
        # one of a punched pair, which the relay carries on (punch.py)
        if not self.bulk and self.redial_due is None and not self.t.relays.needed(self.peer):
            grace = max(REDIAL_GRACE_S, 8 * self.rtt_s)
            self.redial_due = asyncio.get_running_loop().call_later(grace, self._redial_overdue, grace)
        self.wake.set()

    def _redial_overdue(self, grace: float) -> None:
        """A peer we cannot dial closed its connection and has not dialled again: it is down as a
        dialled peer whose connection is refused is, and the membership hears so at once (without
        this, only a step's silence would suspect it: the node deadline and an unanswered ping)."""
        self.redial_due = None
        if self.writer is None and not self.t.closed:
            self.t.events.on_link_down(
                self.peer, f"rank {self.peer} closed the connection it dialled and did not dial again within "
                f"{grace:.2f} s (it cannot be dialled from here)", True)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         addr: Address | str) -> str:
        return await _dial_handshake(self.t, self.peer, BULK if self.bulk else CONTROL, reader, writer, addr)

    async def take_punched(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str) -> str:
        """A hole punched to the peer (punch.py), this rank opening the handshake as the
        dialler: '' once it carries this channel's frames, else why the peer was refused."""
        t = self.t
        sock = self._tune(writer.get_extra_info("socket"))
        refused = await self._handshake(reader, writer, where)
        if refused or t.closed:
            writer.transport.abort()
            if refused:
                t.refused(f"punched {where}", refused)
            return refused or "closed"
        if self.writer is not None:
            self._drop_connection(f"a newer hole punched to rank {self.peer}")
        self.sock = sock
        conn = _Conn(writer.transport, writer.drain)
        self._attach(conn)
        t.stats[self.peer].connects += 1
        self._read(reader, writer, conn)
        self.wake.set()
        return ""

    def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn) -> None:
        """Read the frames the peer sends on our connection, from the end of the handshake on,
        into exact-size buffers (frame_reader.py). A peer that can dial us writes nothing here,
        so the connection's loss means its process closed the socket (or died): noticed now,
        not at the next send. A peer that cannot dial us sends its frames here; the connection
        proved the peer's key, as an accepted one does before any frame."""
        t, peer = self.t, self.peer

        def frame_error(exc: FrameError) -> None:
            t._frame_error(f"rank {peer}", exc)

        def lost(_exc: Exception | None) -> None:
            if self.writer is conn and not t.closed:
                self._drop_connection(f"rank {peer} closed the connection")
                t.events.on_link_down(peer, "closed by the peer")
                self.redial = True
                self.wake.set()

        frames = DialledReader(t.pool, t.max_payload_bytes, stream=writer.transport.get_protocol(),
                               deliver=lambda head, payload: t.deliver(peer, head, payload),
                               progress=lambda: t.events.on_progress(peer), frame_error=frame_error, lost=lost)
        # what the stream read beyond the handshake (normally nothing: the peer speaks once proven)
        buffered: bytearray = vars(reader)["_buffer"]
        leftover = bytes(buffered)
        buffered.clear()
        frames.take_over(writer.transport, leftover)

    def _drop_connection(self, why: str) -> None:
        stats = self.t.stats[self.peer]
        stats.errors += 1
        stats.last_error = why
        log.info("rank %d: link to rank %d dropped: %s", self.t.rank, self.peer, why)
        if self.writer is not None:
            if self.slices or self.outstanding():
                self.lost_at = self.t.clock()  # what the connection still held is gone with it
            self.writer.transport.abort()
        self.slices.clear()  # a frame cut short cannot go on over a new connection
        self.slice_bytes = 0
        self.writer = None
        self.sock = None
        self.stalled = False
        self.connected.clear()
        if self.t.relays.needed(self.peer) and not self.t.closed:  # a punched connection: back to the relay
            self.t.punch_lost(self.peer, why)

    def _drop_stale(self) -> None:
        kept = deque(m for m in self.queue if not self.t.is_stale(m))
        self.t.stats[self.peer].stale_dropped += len(self.queue) - len(kept)
        self.queue = kept
        self.queued_bytes = sum(len(m.payload) for m in kept if m.payload is not None)

    async def _run(self) -> None:
        backoff = REDIAL_FIRST_S
        while not self.t.closed:
            if self.writer is None and self.passive():
                # nothing to dial: the peer dials us, and adopt() wakes this task with its connection
                self.unreachable = True
                self.t.stats[self.peer].last_error = self.t.undialable(self.peer)
                self._drop_stale()
                if not self.queue:
                    self.idle.set()
                self.wake.clear()
                await self.wake.wait()
                continue
            if (self.writer is None and self.ever_connected and not self.queue and not self.redial
                    and not self.keep_up()):
                self.idle.set()  # nothing to send: dial again only when there is
                self.wake.clear()
                await self.wake.wait()
                continue
            if self.writer is None:
                self.redial = False
                if not await self._connect():
                    self._drop_stale()
                    self.retry_now.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.retry_now.wait(), backoff)
                    backoff = min(backoff * 2, REDIAL_MAX_S)
                    continue
            backoff = REDIAL_FIRST_S
            writer = self.writer
            try:
                await (self._drain_bulk() if self.bulk else self._drain_queue())
            except (OSError, TimeoutError, RuntimeError) as exc:
                if self.writer is not writer:  # replaced meanwhile by the peer's newer connection (adopt)
                    continue
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self._drop_connection(why)
                if isinstance(exc, ConnectionError):  # reset or closed, not merely slow
                    self.t.events.on_link_down(self.peer, why)
                continue
            self.wake.clear()
            if not self.queue and not self.t.closed:  # (closed: asyncio 3.11's wait_for may swallow a cancel)
                self.idle.set()
                await self.wake.wait()

    async def _drain_queue(self) -> None:
        writer = self.writer
        assert writer is not None
        while True:
            # the socket backed up by the last batch, or by a frame written at once: wait for it
            if writer.transport.get_write_buffer_size() > DRAIN_ABOVE_BYTES:
                await asyncio.wait_for(writer.drain(), self.t.stall_timeout_s)
            if not self.queue:
                return
            if writer.transport.is_closing():  # closed under us; uvloop's write() would raise
                raise ConnectionResetError(f"connection to rank {self.peer} was closed")
            # everything queued so far goes out in one writelines (one syscall for a burst of
            # small metadata frames), up to DRAIN_ABOVE_BYTES before waiting for the socket
            bufs: list[bytes | memoryview] = []
            batch_bytes = 0
            while self.queue and batch_bytes <= DRAIN_ABOVE_BYTES:
                msg = self.queue.popleft()
                if msg.payload is not None:
                    self.queued_bytes -= len(msg.payload)
                for buf in self._encode_fresh(msg):
                    bufs.append(buf)
                    batch_bytes += len(buf)
            self._hand_over(bufs)

    async def _drain_bulk(self) -> None:
        """Write queued frames in slices, each when the rank's in-flight budget has room for it:
        bytes beyond the budget wait here, where they hold nothing up, instead of in the
        kernel's or the network's queues, where a control frame would wait behind them."""
        writer = self.writer
        assert writer is not None
        while True:
            if writer.transport.is_closing():
                raise ConnectionResetError(f"connection to rank {self.peer} was closed")
            if not self.slices:
                if not self.queue:
                    if writer.transport.get_write_buffer_size():
                        await asyncio.wait_for(writer.drain(), self.t.stall_timeout_s)
                    return
                msg = self.queue.popleft()
                if msg.payload is not None:
                    self.queued_bytes -= len(msg.payload)
                for buf in self._encode_fresh(msg):
                    view = memoryview(buf).cast("B")
                    self.slices.append(view)
                    self.slice_bytes += len(view)
                continue
            if writer.transport.get_write_buffer_size() > DRAIN_ABOVE_BYTES:
                # the socket is backed up (a fast link's large budget): wake when it takes more,
                # not at the next poll
                await asyncio.wait_for(writer.drain(), self.t.stall_timeout_s)
                continue
            # pieces of SLICE_BYTES on a slow link, of an eighth of the budget on a fast one
            room = min(self.t.channel_budget - self.outstanding(), max(SLICE_BYTES, self.t.channel_budget // 8))
            if room <= 0:
                if self.t.clock() - self.progress_at > self.t.stall_timeout_s:
                    raise TimeoutError(f"rank {self.peer} acknowledged nothing for {self.t.stall_timeout_s:g} s")
                acked = self.acked
                await asyncio.sleep(self.t.poll_s())
                self.outstanding()  # brings `acked` up to date
                if self.acked > acked:
                    # the peer took bytes meanwhile: the budget, not a dead link, held these back
                    self.t.budget_held(self)
                continue
            bufs: list[bytes | memoryview] = []
            while self.slices and room > 0:
                head = self.slices[0]
                if len(head) <= room:
                    bufs.append(self.slices.popleft())
                else:
                    bufs.append(head[:room])
                    self.slices[0] = head[room:]
                taken = len(bufs[-1])
                room -= taken
                self.slice_bytes -= taken
            self._hand_over(bufs)

    def follow_rtt(self, counters: TcpCounters | None) -> None:
        """The connection's least retransmission timeout follows its round trip (uplink.fast_rto_min)."""
        fast = counters is not None and self.t.meter.unbottlenecked and fast_rto_min(counters)
        if counters is None or self.sock is None or fast == self.fast_rto:
            return
        self.fast_rto = not self.fast_rto
        with contextlib.suppress(OSError, ValueError):
            self.sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US,
                                 int((FAST_RTO_MIN_S if self.fast_rto else RTO_MIN_S) * 1e6))

    def check_stall(self, now: float, others_bytes: int) -> bool:
        """True when this channel has just been found stalled: bytes outstanding and no
        acknowledgement for as long as the link's history and the `others_bytes` the rank's
        other connections have outstanding make conclusive (uplink.stalled)."""
        if self.stalled or self.writer is None or self.sock is None:
            return False
        idle = self.written == self.acked
        if idle and self.progress_at <= self.loss.as_of:
            return False
        counters = self.counters(now)
        self.follow_rtt(counters)
        # bytes acknowledged since the last look (the sampler looks every 50 ms while the rank
        # sends): what the link lost so far was lost before any silence that follows
        self.loss = self.loss.judged(counters, self.progress_at)
        if idle or not stall_found(counters, self.loss, now - self.progress_at, others_bytes, self.t.meter):
            return False
        self.stalled = True
        log.info("rank %d: %s link to rank %d stalled after %.3f s with nothing acknowledged (%s; %s)", self.t.rank,
                 "bulk" if self.bulk else "control", self.peer, now - self.progress_at,
                 "a fast link that lost nothing before" if quick_rule(self.loss, self.t.meter) else "the careful rule",
                 counters)
        return True


async def _dial_handshake(t: TcpTransport, peer: int, channel: int, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter, addr: Address | str) -> str:
    """Say who we are and whom we dial, check that the peer holds the job's key, and prove
    that we do (handshake.py). '' once done; otherwise why the peer was refused."""
    hello = hs.Hello(src=t.rank, dst=peer, world=t.world, channel=channel, address=str(t.me),
                     job=t.credentials.job, nonce=hs.new_nonce())
    writer.write(hs.encode(hello))
    try:
        prefix = await asyncio.wait_for(reader.readexactly(PREFIX.size), t.handshake_timeout_s)
        head_len, payload_len = decode_prefix(prefix)
        hs.check_prefix(head_len, payload_len)
        answer = hs.decode(await asyncio.wait_for(reader.readexactly(head_len), t.handshake_timeout_s))
    except asyncio.IncompleteReadError:
        return (f"rank {peer} at {addr} closed the connection during the handshake (a worker of another "
                f"job, with another key, or not rank {peer}?)")
    except (OSError, TimeoutError) as exc:
        return f"handshake with {addr}: {str(exc) or type(exc).__name__}"
    except FrameError as exc:
        return f"handshake with {addr}: {exc}"
    if not isinstance(answer, hs.Challenge) or (answer.src != peer and peer != hs.CONTACT):
        return f"{addr} did not answer as rank {peer} does"
    if t.credentials.tls is not None:
        shown = rank_of(writer.get_extra_info("peercert"))
        if shown != answer.src:
            return f"{addr} answered as rank {answer.src} with a certificate of {_cert_rank(shown)}"
    if not hs.verify(hs.accept_mac(t.credentials.key, hello, answer.nonce), answer.mac):
        return f"rank {peer} at {addr} did not prove the job's key"
    writer.write(hs.encode(hs.Proof(src=t.rank, mac=hs.dial_mac(t.credentials.key, hello, answer.nonce))))
    return ""


class _OutLink:
    """Both outgoing channels to one peer; a frame takes the bulk one when its payload is large."""

    def __init__(self, transport: TcpTransport, peer: int) -> None:
        self.t = transport
        self.peer = peer
        self.control = _Channel(self, bulk=False)
        self._bulk: _Channel | None = None  # opened for the first large payload

    @property
    def bulk(self) -> _Channel:
        if self._bulk is None:
            self._bulk = _Channel(self, bulk=True)
        return self._bulk

    @property
    def channels(self) -> tuple[_Channel, ...]:
        return (self.control,) if self._bulk is None else (self.control, self._bulk)

    def push(self, msg: Frame) -> None:
        payload = msg.payload
        if payload is not None and len(payload) > CONTROL_MAX_PAYLOAD:
            self.bulk.push(msg)
        else:
            self.control.push(msg)

    def peer_is_up(self) -> None:
        for ch in self.channels:
            ch.peer_is_up()

    def backlog_bytes(self) -> int:
        """Bytes for this peer not yet acknowledged by it: queued, or on a connection."""
        return sum(ch.pending() for ch in self.channels)

    def state(self) -> LinkState:
        pending = self.backlog_bytes()  # brings each channel's acknowledgements up to date
        now = self.t.clock()
        everyone = sum(ch.outstanding() for ch in self.t._channels() if not ch.stalled)
        # stalled: acknowledging nothing, or unable to connect at all with frames waiting
        stalled = [ch.check_stall(now, everyone - (0 if ch.stalled else ch.outstanding())) or ch.stalled
                   or (ch.unreachable and bool(ch.queue)) for ch in self.channels]
        return LinkState(pending_bytes=pending, stalled=any(stalled), lost_at=max(ch.lost_at for ch in self.channels))

    @property
    def connected(self) -> asyncio.Event:
        return self.control.connected

    @property
    def writer(self) -> _Conn | None:
        return self.control.writer

    def channel(self, kind: int) -> _Channel:
        return self.bulk if kind == BULK else self.control


_LIVE: weakref.WeakSet[TcpTransport] = weakref.WeakSet()  # transports whose sockets a fork must not keep


def _release_sockets_in_child() -> None:
    """In a process forked from a worker (DataLoader workers, multiprocessing's "fork"): the
    child holds copies of the worker's sockets. Kept open, they outlive a SIGKILLed worker for
    as long as the children do (DataLoader workers notice their parent's death after up to
    5 s): its restart cannot bind its address ("address already in use") and its peers see
    its connections stay up. The child never uses them, so each is pointed at /dev/null:
    not closed, as the socket objects still own the numbers and close them some day."""
    fds: set[int] = set()
    for transport in list(_LIVE):
        with contextlib.suppress(Exception):  # a snapshot taken mid-change on the loop thread
            fds |= transport.socket_fds()
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_release_sockets_in_child)


class TcpTransport:
    """Frames over TCP for one rank; calls its events' `on_message` on the event loop per frame."""

    def __init__(self, rank: int, addresses: Sequence[Address] | Mapping[int, Address], *,
                 connect_timeout_s: float = 2.0,
                 stall_timeout_s: float = 5.0,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 credentials: Credentials | None = None,
                 handshake_timeout_s: float = HELLO_TIMEOUT_S,
                 max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
                 receive_pool_bytes: int | None = None, hole_punch: bool = True) -> None:
        # a joiner that knows only itself and a contact passes {rank: address}
        self.addresses: dict[int, Address] = dict(addresses) if isinstance(addresses, Mapping) \
            else dict(enumerate(addresses))
        self.rank, self.world = rank, max(self.addresses) + 1
        self.me = self.addresses[rank]
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.stats = {p: _LinkStats() for p in range(self.world) if p != rank}
        self.closed = False
        self.credentials = credentials or Credentials()
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending_handshakes = max_pending_handshakes
        self._pending: set[_Inbound] = set()  # accepted connections that have not proven the key yet
        self._pending_hosts: dict[str, int] = {}  # of those, how many from each source address
        self._pending_outsiders = 0  # of those, from addresses no rank listens on
        self._members: tuple[int, dict[str, int], int] = (-1, {}, 0)  # (addresses_changed, member_hosts, unseen)
        self._nat_hosts: dict[int, str] = {}  # rank behind a NAT -> the address its proven connections came from
        # (rank, channel, the rank it dialled) -> its newest proven connection (a joiner's contact
        # is dialled apart from the rank that listens there)
        self._proven: dict[tuple[int, int, int], _Inbound] = {}
        self._hello_learned: set[int] = set()  # ranks whose address only their own HELLO gave (joiners)
        self.unknown_unfinished = 0  # payload bytes ranks not known yet announced and have not finished
        self.addresses_changed = 0  # counts changes of `addresses` (the TLS listener's list of members)
        self.idle_unknown_s = IDLE_UNKNOWN_S
        self.frame_errors = 0
        self.last_frame_error = ""
        self.refusals = 0  # connections refused at the handshake (another job, no key, a wrong rank)
        self._refusals_logged: set[tuple[str, str]] = set()
        self._events: TransportEvents | None = None
        self._out: dict[int, _OutLink] = {}
        self._server: asyncio.Server | None = None  # plain TCP
        self._tls_listener: _TlsListener | None = None  # or TLS
        self._inbound: set[asyncio.Transport] = set()
        self.pool = BufferPool(keep=RECEIVE_BUFFERS, keep_bytes=receive_pool_bytes)
        self.meter = UplinkMeter()
        self.channel_budget = self.meter.budget()  # in-flight bytes each busy bulk channel may have
        self._busy_bulk = 1  # bulk channels with bytes to send or in flight, at the last sample
        self._sampler: asyncio.Task[None] | None = None
        self._work = asyncio.Event()  # set while anything is queued or unacknowledged
        self._loop: asyncio.AbstractEventLoop | None = None  # the one this transport runs on (clock)
        self.relays = Relays(self)  # frames to and for ranks this one cannot connect with (relay.py)
        self.punches = Punches(self, enabled=hole_punch)  # direct connections for some of those (punch.py)

    def clock(self) -> float:
        """The event loop's clock: what LinkState.lost_at and the stall times are measured on."""
        loop = self._loop
        if loop is None:  # (asyncio.get_running_loop asks the system for the process id each call)
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    # ---- the uplink: acknowledgements, stalls, the in-flight budget (uplink.py) -------------------

    def busy(self) -> None:
        """Bytes went out or were queued: sample the connections until all are acknowledged."""
        self._work.set()
        if self._sampler is None and not self.closed:
            self._sampler = asyncio.get_running_loop().create_task(self._sample(), name=f"fttree-uplink-{self.rank}")

    def budget_held(self, ch: _Channel) -> None:
        """`ch` waited for room in the budget: it grows unless the round trip shows a queue on
        the path (then the link is the limit, and the budget follows its rate)."""
        counters = None if ch.sock is None else tcp_counters(ch.sock)
        if counters is None:
            return
        if queue_formed(counters):
            self.meter.saw_queue()
        else:
            self.meter.grow(self.clock(), counters.rtt_s)
        self.channel_budget = max(self.meter.budget() // max(1, self._busy_bulk), MIN_CHANNEL_BUDGET)

    def poll_s(self) -> float:
        """How long a bulk channel waits for room in its budget before it looks again."""
        rate = self.meter.rate
        return POLL_MIN_S if not rate else min(max(self.channel_budget / rate / 4, POLL_MIN_S), 0.02)

    def _channels(self) -> list[_Channel]:
        return [ch for link in self._out.values() for ch in link.channels]

    async def _sample(self) -> None:
        """While anything is outstanding: read every connection's acknowledgements, feed the
        meter the intervals in which the rank had more to send than its budget let out, split
        the budget over the busy bulk channels, and report connections that stalled (their
        peers' backup nodes then carry around them at once). Sleeps while all is acknowledged."""
        loop = asyncio.get_running_loop()
        backlogged = False
        last = loop.time()
        acked = 0
        while not self.closed:
            if not self._work.is_set():
                backlogged = False
                await self._work.wait()
                last, acked = loop.time(), sum(ch.acked for ch in self._channels())
            await asyncio.sleep(SAMPLE_S)
            now = loop.time()
            channels = self._channels()
            pending = [ch.outstanding() for ch in channels]  # updates each channel's acked
            total = sum(ch.acked for ch in channels)
            waiting = [ch for ch in channels if ch.bulk and (ch.slices or ch.queue)]
            queued = False
            for ch, out in zip(channels, pending, strict=True):
                if out and ch.sock is not None:
                    counters = ch.counters(now)
                    if counters is not None and counters.min_rtt_s:
                        self.meter.saw_rtt(counters.min_rtt_s)
                        queued = queued or (ch.bulk and queue_formed(counters))
            if queued:  # whether bytes wait for the budget or not: it is too large for the link
                self.meter.saw_queue()
            if total > acked or queued:
                self.meter.acknowledged(now, total - acked, queued=queued)
            if backlogged and waiting and total > acked and not any(ch.stalled for ch in channels):
                # (a stalled link says nothing of the uplink)
                self.meter.add(now - last, total - acked, now, queued=queued)
            last, acked, backlogged = now, total, bool(waiting)
            everyone = sum(out for ch, out in zip(channels, pending, strict=True) if not ch.stalled)
            for ch, out in zip(channels, pending, strict=True):
                if ch.check_stall(now, everyone - (0 if ch.stalled else out)):
                    self.events.on_link_down(ch.peer, f"nothing acknowledged for {now - ch.progress_at:.1f} s "
                                                      "while the kernel retransmits")
            self._busy_bulk = sum(1 for ch, out in zip(channels, pending, strict=True)
                                  if ch.bulk and (out or ch.slices or ch.queue))
            self.channel_budget = max(self.meter.budget() // max(1, self._busy_bulk), MIN_CHANNEL_BUDGET)
            if not any(pending) and not any(ch.queue or ch.slices for ch in channels):
                self._work.clear()

    def uplink_rate(self) -> float:
        return self.meter.link_rate

    def retransmit_s(self, peer: int) -> float:
        """TCP's retransmission timeout to `peer` once a connection to it has lost packets (a
        link that never lost one waits for no retransmission); 0.0 before. Asked after every
        step for every neighbour: it takes the figures the sampler read lately (COUNTERS_FRESH_S),
        as reading them all again cost more than the rest of a small step's bookkeeping."""
        link = self._out.get(peer)
        now = self.clock()
        counters = [c for ch in (() if link is None else link.channels) for c in [ch.recent_counters(now)]
                    if c is not None]
        if not any(c.total_retrans for c in counters):
            return 0.0
        return max(retransmit_timeout_s(c) for c in counters)

    def link_state(self, peer: int) -> LinkState:
        link = self._out.get(self._relay_for(peer))
        return LinkState() if link is None else link.state()

    def bind(self, events: TransportEvents) -> None:
        self._events = events

    @property
    def events(self) -> TransportEvents:
        if self._events is None:
            raise RuntimeError("TcpTransport used before bind()")
        return self._events

    async def start(self) -> None:
        stuck = [p for p in self.addresses if self.relays.needed(p) and not self.relays.candidates(p)]
        if stuck:  # no frame could ever pass between them: named now, not at a deadline
            raise PeerError("; ".join(self.relays.why_not(p) for p in stuck), peers=tuple(stuck))
        if not self.me.listed:  # nobody can dial this rank: it listens nowhere and dials every rank it can
            _LIVE.add(self)
            for peer in list(self.addresses):
                self._stay_reachable(peer)
            self.punches.start()
            return
        try:
            loop = asyncio.get_running_loop()
            tls = self.credentials.tls
            if tls is None:
                self._server = await loop.create_server(lambda: _Inbound(self), self.me.host, self.me.port,
                                                        reuse_address=True, backlog=LISTEN_BACKLOG)
            else:
                self._tls_listener = _TlsListener(self, tls.server)
            _LIVE.add(self)
        except OSError as exc:
            hint = " (is another worker already running as this rank?)" if exc.errno == 98 else ""
            raise PeerError(f"rank {self.rank} cannot listen on {self.me}: {exc.strerror or exc}{hint}") from None
        for peer in list(self.addresses):
            self._stay_reachable(peer)
        self.punches.start()

    def _stay_reachable(self, peer: int) -> None:
        """A peer that cannot dial this rank and that this rank can dial: open both connections
        to it now and keep them up, as they are its only way to send here."""
        addr = self.addresses.get(peer)
        if peer == self.rank or peer < 0 or addr is None or not addr.dialable_from(self.me) \
                or self.me.dialable_from(addr):
            return
        link = self._link(peer)
        link.bulk  # noqa: B018  (opened now: the peer may send a large payload before this rank does)

    def undialable(self, peer: int) -> str:
        """Why frames to `peer` wait for a connection it dials (or never go)."""
        addr = self.addresses.get(peer)
        if addr is None or addr.dialable_from(self.me):
            return ""
        if not self.me.dialable_from(addr):
            relay = self.relays.via(peer)
            if relay is None:
                return self.relays.why_not(peer)
            return f"rank {self.rank} ({self.me}) and rank {peer} ({addr}) cannot connect: relayed through rank {relay}"
        return f"rank {peer} ({addr}) cannot be dialled from here: waiting for it to dial in"

    def deliver(self, src: int, head: bytes, payload: bytearray | memoryview | None) -> None:
        """A whole frame from `src` on one of its proven connections (either direction), or
        relayed for `src` (relay.py)."""
        if is_envelope(head):
            self.relays.receive(src, head, payload)
            return
        if is_note(head):
            if payload is not None:
                raise FrameError("a hole punch note with a payload")
            self.punches.receive(src, head)
            return
        msg = decode_header(head, payload)
        if msg.src != src:
            raise FrameError(f"frame says it is from rank {msg.src} on rank {src}'s connection")
        stats = self.stats.setdefault(src, _LinkStats())  # a joiner's first frames come before its address
        stats.frames_received += 1
        stats.bytes_received += PREFIX.size + len(head) + (0 if payload is None else len(payload))
        self.events.on_message(msg)

    def socket_fds(self) -> set[int]:
        """The file descriptors of this transport's open sockets: the listening one and every
        connection, accepted or opened."""
        found = []
        if self._server is not None and self._server.is_serving():
            found += list(self._server.sockets)
        if self._tls_listener is not None and self._tls_listener.sock.fileno() >= 0:
            found.append(self._tls_listener.sock)
        found += [t.get_extra_info("socket") for t in self._inbound if not t.is_closing()]
        found += [ch.writer.get_extra_info("socket") for link in self._out.values() for ch in link.channels
                  if ch.writer is not None and not ch.writer.transport.is_closing()]
        fds = {sock.fileno() for sock in found if sock is not None}
        return {fd for fd in fds if fd >= 0}

    def add_peer(self, rank: int, address: Address) -> None:
        """A rank that joined after the start: reachable from now on at `address`."""
        self._hello_learned.discard(rank)  # the group told us of it: a rank of the job from now on
        if rank == self.rank or self.addresses.get(rank) == address:
            return
        self.addresses[rank] = address
        self.addresses_changed += 1
        self.stats.setdefault(rank, _LinkStats())
        link = self._out.get(rank)
        if link is not None:  # frames may wait for this address: dial now
            link.peer_is_up()
        if self._server is not None or self._tls_listener is not None or not self.me.listed:  # started
            self._stay_reachable(rank)
        if self.punches.started:  # a rank behind another NAT that joined: punch to it too
            self.punches.start()

    def address_of(self, rank: int) -> str:
        found = self.addresses.get(rank)
        return "" if found is None else str(found)

    def _link(self, peer: int) -> _OutLink:
        link = self._out.get(peer)
        if link is None:
            link = self._out[peer] = _OutLink(self, peer)
        return link

    def send(self, dst: int, msg: Frame) -> None:
        """Queue a frame for `dst`; never blocks. A rank this one cannot connect with gets it
        through a relay (unless a hole was punched to it)."""
        if self._relayed(dst):
            self.relays.send(dst, msg)
            return
        self._link(dst).push(msg)

    # ---- what the relays need (relay.RelayHost) ---------------------------------------------

    def push(self, dst: int, msg: Frame) -> None:
        """Queue `msg` on the connections to `dst` itself (an envelope for a relay, or from one)."""
        self._link(dst).push(msg)

    def link_up(self, peer: int) -> bool:
        """Is the control connection to `peer` up and not stalled?"""
        link = self._out.get(peer)
        return link is not None and link.control.writer is not None and not link.control.stalled

    def is_stale(self, msg: Frame) -> bool:
        """May a queued frame go unsent? An envelope of this rank's own frame if the frame may;
        one carried for others never (the relay's node knows nothing of their steps)."""
        if isinstance(msg, Relayed):
            return msg.inner is not None and self.events.is_stale(msg.inner)
        return self.events.is_stale(msg)

    # ---- hole punching (punch.PunchHost) --------------------------------------------------------

    def _relayed(self, peer: int) -> bool:
        """Do frames for `peer` take a relay now: the two cannot connect, and no hole was punched?"""
        return self.relays.needed(peer) and not self.punched(peer)

    def punched(self, peer: int) -> bool:
        """Is a punched connection up for each of the pair's channels (control and bulk)? A
        rank this one cannot connect with has connections only through a punch."""
        link = self._out.get(peer)
        return (link is not None and link._bulk is not None and link.control.writer is not None
                and link._bulk.writer is not None and self.relays.needed(peer))

    def punch_lost(self, peer: int, why: str) -> None:
        """One of the pair's punched connections broke: close the other, send what was queued
        on them through the relay, and let the punch know."""
        link = self._out.get(peer)
        if link is None:
            return
        for ch in link.channels:
            if ch.writer is not None:
                ch._drop_connection(f"the other punched connection to rank {peer} broke ({why})")
        for ch in link.channels:
            queued, ch.queue, ch.queued_bytes = ch.queue, deque(), 0
            for msg in queued:
                if not self.is_stale(msg):
                    self.relays.send(peer, msg)
        self.punches.lost(peer, why)

    async def connected(self, peer: int, timeout_s: float) -> bool:
        """Is the control connection to `peer` up, or up within `timeout_s`?"""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._link(peer).control.connected.wait(), timeout_s)
        return self.link_up(peer)

    async def _open(self, sock: socket.socket, host: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream over a connected socket this rank dialled (TLS client under TLS)."""
        tls = self.credentials.tls
        return await asyncio.open_connection(
            sock=sock, limit=STREAM_LIMIT, ssl=None if tls is None else tls.client,
            server_hostname=None if tls is None else host,
            ssl_handshake_timeout=None if tls is None else self.handshake_timeout_s)

    async def probe(self, coordinator: int, channel: int, sock: socket.socket) -> tuple[str, int]:
        """Dial `coordinator` from `sock`'s port, prove the key on a probe connection, and read
        back the address it saw the connection come from (the port's mapping through a NAT)."""
        addr = self.addresses[coordinator]
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(sock, (addr.host, addr.port)), self.connect_timeout_s)
        reader, writer = await asyncio.wait_for(self._open(sock, addr.host), self.handshake_timeout_s)
        try:
            refused = await _dial_handshake(self, coordinator, channel, reader, writer, addr)
            if refused:
                raise ConnectionError(f"probe refused: {refused}")
            return await read_seen(reader, self.handshake_timeout_s)
        finally:
            writer.transport.abort()

    async def take_punched(self, peer: int, channel: int, sock: socket.socket) -> str:
        """A connection punched to `peer` for `channel`: through the handshake, the lower rank
        as the dialler, the other as for an accepted connection (which it then adopts). ''
        once it carries the channel's frames, else why not."""
        link = self._link(peer)
        ch = link.channel(channel)
        where = "{}:{}".format(*sock.getpeername()[:2])
        if self.rank < peer:
            try:
                reader, writer = await asyncio.wait_for(self._open(sock, where.rsplit(":", 1)[0]),
                                                        self.handshake_timeout_s)
            except (OSError, TimeoutError) as exc:
                sock.close()
                return f"TLS with rank {peer} at {where}: {str(exc) or type(exc).__name__}"
            return await ch.take_punched(reader, writer, where)
        tls = self.credentials.tls
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Inbound(self), sock, ssl=None if tls is None else tls.server,
                ssl_handshake_timeout=None if tls is None else self.handshake_timeout_s)
            await asyncio.wait_for(ch.connected.wait(), self.handshake_timeout_s)
        except (OSError, TimeoutError) as exc:
            sock.close()
            return (f"rank {peer} at {where} proved nothing within {self.handshake_timeout_s:g} s "
                    f"({str(exc) or type(exc).__name__})")
        return ""

    def _punch_status(self, peer: int) -> dict[str, Any]:
        out = self.punches.outcomes.get(peer)
        if out is None:
            return {}
        return {"punch": out.state, "punch_tries": out.tries, "punch_connected": out.connected,
                "punch_s": round(out.took_s, 6), "punch_error": out.why, "punch_via": out.via}

    def _relay_for(self, peer: int) -> int:
        """The rank whose connection carries frames to `peer` (itself, unless it needs a relay)."""
        if not self._relayed(peer):
            return peer
        relay = self.relays.via(peer)
        return peer if relay is None else relay

    def backlog_bytes(self, dst: int | None = None) -> int:
        """Bytes queued or on a connection and not yet acknowledged by the peer (of every link:
        those whose connection stalled excepted, as they hold nothing else up)."""
        if dst is None:
            return sum(ch.pending() for link in self._out.values() for ch in link.channels if not ch.stalled)
        link = self._out.get(self._relay_for(dst))
        return 0 if link is None else link.backlog_bytes()

    def link_health(self, peer: int) -> LinkHealth:
        st = self.stats.get(peer)
        return LinkHealth() if st is None else LinkHealth(st.frames_sent, st.errors, 0, st.last_error)

    def status(self) -> TransportStatus:
        links = []
        for peer, st in sorted(self.stats.items()):
            out = self._out.get(peer)
            writer = None if out is None else out.writer
            links.append(LinkStatus(
                peer=peer, connected=None if out is None else writer is not None,
                frames_sent=st.frames_sent, bytes_sent=st.bytes_sent, frames_received=st.frames_received,
                bytes_received=st.bytes_received, stale_dropped=st.stale_dropped, connects=st.connects,
                adopted=st.adopted, errors=st.errors, last_error=st.last_error, rtt_s=tcp_rtt_s(writer),
                relay=self._relay_for(peer) if self._relayed(peer) else -1, **self._punch_status(peer)))
        relayed = self.relays.counters
        return TransportStatus(rank=self.rank, address=str(self.me), links=tuple(links),
                               frame_errors=self.frame_errors, last_frame_error=self.last_frame_error,
                               refusals=self.refusals, relayed_sent_bytes=relayed.sent_bytes,
                               relayed_forwarded_bytes=relayed.forwarded_bytes,
                               relayed_received_bytes=relayed.received_bytes, relay_drops=relayed.dropped)

    async def wait_for_peers(self, peers: Sequence[int], deadline_s: float) -> None:
        """Connect to each peer, or raise PeerError naming those still unreachable. A peer that
        cannot be dialled from here is waited for to dial in; one neither side can dial is
        reached once one of its relays is (relay.py), and named at once if it has none."""
        stuck = [p for p in peers if self.relays.needed(p) and not self.relays.candidates(p)]
        if stuck:
            raise PeerError("; ".join(self.relays.why_not(p) for p in stuck), peers=tuple(stuck))
        links = {p: self._link(p) for p in peers if not self.relays.needed(p)}
        waits: dict[int, asyncio.Future[Any]] = {p: asyncio.ensure_future(link.connected.wait())
                                                 for p, link in links.items()}
        # a rank reached through a relay: connected once any of its relays is
        waits.update((p, asyncio.ensure_future(self._any_connected(self.relays.candidates(p))))
                     for p in peers if self.relays.needed(p))
        if not waits:
            return
        _done, pending = await asyncio.wait(waits.values(), timeout=deadline_s)
        for fut in pending:
            fut.cancel()
        missing = [p for p, fut in waits.items() if fut in pending]
        if missing:
            detail = "; ".join(self._relays_missing(p) if self.relays.needed(p) else
                               f"rank {p} at {self.addresses[p]} ({self.stats[p].last_error or 'no answer'})"
                               for p in missing)
            raise PeerError(f"rank {self.rank} could not reach peers within {deadline_s:g} s: {detail}",
                            peers=tuple(missing))

    async def _any_connected(self, relays: Sequence[int]) -> None:
        """Until one of `relays` is connected (a rank reached through them can be sent to)."""
        waits = [asyncio.ensure_future(self._link(r).connected.wait()) for r in relays]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _relays_missing(self, peer: int) -> str:
        relays = self.relays.candidates(peer)
        why = "; ".join(f"rank {r}: {self.stats[r].last_error or 'no answer'}" for r in relays if r in self.stats)
        return f"rank {peer} at {self.addresses[peer]} through a relay (none of ranks {list(relays)} connected: {why})"

    async def close(self, flush_s: float = 2.0, *, abort: bool = False) -> None:
        """Stop, first giving what is queued or unacknowledged time to reach the peers (a peer
        may still need the last step's result or relay from us): `flush_s`, or longer while it
        moves, up to twice its time at the measured uplink rate. With `abort`, as a killed
        process would: nothing more goes out, every connection is reset and the listener is
        gone at once."""
        if not abort:
            await self._flush(flush_s)
        self.closed = True
        await self.punches.close()
        if self._server is not None:
            self._server.close()
        if self._tls_listener is not None:
            self._tls_listener.close()
        channels = self._channels()
        for ch in channels:
            ch.task.cancel()
            if ch.redial_due is not None:
                ch.redial_due.cancel()
            ch.wake.set()  # a writer whose cancel a finishing wait_for swallowed (asyncio 3.11) ends too
            if ch.writer is not None:
                if abort:
                    ch.writer.transport.abort()
                else:
                    ch.writer.close()  # graceful: what the socket buffer holds still goes out
        for inbound in list(self._inbound):
            inbound.abort()
        tasks: list[asyncio.Task[None]] = [ch.task for ch in channels]
        if self._sampler is not None:
            self._sampler.cancel()
            tasks.append(self._sampler)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _flush(self, flush_s: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            live = [ch for ch in self._channels() if not ch.stalled and not ch.unreachable]
            pending = sum(ch.pending() for ch in live)
            if not pending:
                return
            rate = self.meter.rate
            limit = flush_s if not rate else max(flush_s, min(FLUSH_MAX_S, 2 * pending / rate))
            if loop.time() - start >= limit:
                log.info("rank %d: closing with %d bytes not acknowledged after %.1f s", self.rank, pending,
                         loop.time() - start)
                return
            await asyncio.sleep(0.02)

    # ---- inbound ----------------------------------------------------------------------

    def check_hello(self, hello: hs.Hello, peer_host: str) -> None:
        """Is this HELLO one we answer? FrameError naming what is wrong otherwise."""
        if hello.protocol != hs.PROTOCOL:
            raise FrameError(f"handshake protocol {hello.protocol} is not supported (this is {hs.PROTOCOL})")
        if hello.job != self.credentials.job:
            theirs = f"job {hello.job}" if hello.job else "a job without a key"
            ours = f"job {self.credentials.job}" if self.credentials.job else "a job without a key"
            raise FrameError(f"a worker of {theirs} connected; this is {ours}")
        if hello.dst not in (self.rank, hs.CONTACT):
            raise FrameError(f"peer dialled rank {hello.dst}, but this is rank {self.rank} (a wrong address in "
                             f"its peers?)")
        if hello.channel not in hs.CHANNELS:
            raise FrameError(f"HELLO names connection kind {hello.channel}, expected {CONTROL} (control), "
                             f"{BULK} (bulk) or {hs.PROBE_CONTROL}/{hs.PROBE_BULK} (a hole punch's probe)")
        if not 0 <= hello.src <= MAX_RANK or hello.src == self.rank:
            raise FrameError(f"peer claims rank {hello.src}, which is not another rank of 0..{MAX_RANK}")
        self.check_unknown(hello.src)
        if self.credentials.secured or hello.src not in self.addresses:
            return  # proven by the key (or a joiner: its address arrives with it)
        listed = self.addresses[hello.src]
        if not listed.dialable_from(self.me):  # it dials from behind a NAT: its source address is the NAT's
            return
        expected = listed.host
        if is_ip(expected) and is_ip(peer_host) and ipaddress.ip_address(expected) != ipaddress.ip_address(peer_host):
            raise FrameError(f"connection from {peer_host} claims rank {hello.src}, whose address is {expected} "
                             f"(two workers with the same rank, or a wrong --rank?)")

    def member_hosts(self) -> dict[str, int]:
        """The addresses the job's other ranks listen on, each with how many ranks listen there
        (IP addresses as listed; a rank listed by host name is not recognised by its source
        address, and its connections count as an outsider's)."""
        if self._members[0] != self.addresses_changed:
            hosts: dict[str, int] = {}
            for r, a in self.addresses.items():
                if r != self.rank and r >= 0 and a.dialable_from(self.me):
                    hosts[_host_key(a.host)] = hosts.get(_host_key(a.host), 0) + 1
            for host in self._nat_hosts.values():  # where ranks behind a NAT dial from, once proven
                hosts[host] = hosts.get(host, 0) + 1
            unseen = sum(1 for r, a in self.addresses.items()  # ranks behind a NAT not proven yet
                         if r != self.rank and r >= 0 and not a.dialable_from(self.me) and r not in self._nat_hosts)
            self._members = (self.addresses_changed, hosts, unseen)
        return self._members[1]

    def learn_nat_host(self, rank: int, host: str) -> None:
        """Rank `rank`, which cannot be dialled from here, proved the key from `host` (its NAT's
        address): connections from there count as a member's for the handshake caps, so that
        the ranks of a site dialling at once are not refused as a flood from one outsider."""
        if self._nat_hosts.get(rank) != host:
            self._nat_hosts[rank] = host
            self.addresses_changed += 1

    def handshake_cap(self, host: str) -> int:
        """Connections in their handshake at once from `host`: MEMBER_HOST_HANDSHAKES for each
        rank that listens there (or proved the key from there, behind a NAT), else
        PER_HOST_HANDSHAKES, and two more for each rank behind a NAT not seen yet: all of one
        site's ranks dial both their connections from one address at once when they start."""
        ranks = self.member_hosts().get(host, 0)
        return MEMBER_HOST_HANDSHAKES * ranks if ranks else PER_HOST_HANDSHAKES + 2 * self._members[2]

    def _admit_pending(self, inbound: _Inbound) -> str:
        """Take an accepted connection into its handshake: '' or why it is refused. From an
        address ranks listen on, MEMBER_HOST_HANDSHAKES per rank there, beside the others; from any
        other, PER_HOST_HANDSHAKES at once from one address and max_pending_handshakes in all
        (handshake_cap)."""
        host, member = inbound.host, inbound.member
        cap = self.handshake_cap(host)
        if self._pending_hosts.get(host, 0) >= cap:
            return f"{cap} connections from {host} are in their handshake already (at most {cap})"
        if not member and self._pending_outsiders >= self.max_pending_handshakes:
            return (f"{self.max_pending_handshakes} connections are in their handshake already "
                    f"(at most {self.max_pending_handshakes})")
        self._pending.add(inbound)
        self._pending_hosts[host] = self._pending_hosts.get(host, 0) + 1
        self._pending_outsiders += not member
        return ""

    def _pending_done(self, inbound: _Inbound) -> None:
        if inbound not in self._pending:
            return
        self._pending.discard(inbound)
        left = self._pending_hosts.get(inbound.host, 1) - 1
        if left > 0:
            self._pending_hosts[inbound.host] = left
        else:
            self._pending_hosts.pop(inbound.host, None)
        self._pending_outsiders -= not inbound.member

    def knows(self, rank: int) -> bool:
        """A rank of the job: in the address table from the start, or told of by the group (not
        only by its own HELLO)."""
        return rank in self.addresses and rank not in self._hello_learned

    def unknown_ranks(self) -> set[int]:
        """Ranks this transport does not know that hold proven connections (joiners, or a key
        holder's inventions)."""
        return {slot[0] for slot in self._proven if not self.knows(slot[0])}

    def check_unknown(self, rank: int) -> None:
        """FrameError if `rank` is not known and MAX_UNKNOWN_RANKS others are not either: a
        key holder cannot make a worker keep connections for any number of ranks. (Each rank
        has at most one proven connection per channel and dialled rank: 4.)"""
        if self.knows(rank):
            return
        others = self.unknown_ranks() - {rank}
        if len(others) >= MAX_UNKNOWN_RANKS:
            raise FrameError(f"rank {rank} is not a rank of this job yet, and {MAX_UNKNOWN_RANKS} other such "
                             f"ranks are connected already (at most {MAX_UNKNOWN_RANKS})")

    def hold_unknown(self, rank: int, nbytes: int) -> str:
        """Reserve room for a payload of `nbytes` that rank `rank`, not known yet, begins to
        send: '' or why it is refused (UNKNOWN_UNFINISHED_BYTES for all such ranks together)."""
        if self.unknown_unfinished + nbytes > UNKNOWN_UNFINISHED_BYTES:
            return (f"rank {rank} is not a rank of this job yet, and its payload would make the unfinished "
                    f"payloads of such ranks pass {UNKNOWN_UNFINISHED_BYTES} bytes")
        self.unknown_unfinished += nbytes
        return ""

    def learn_from_hello(self, rank: int, address: Address) -> None:
        """A proven rank not in the address table named where it listens (a joiner): kept
        while it has a proven connection, or for good once the group tells of it (add_peer)."""
        if rank in self.addresses:
            return
        self.add_peer(rank, address)
        self._hello_learned.add(rank)

    def inbound_gone(self, rank: int) -> None:
        """A proven connection of `rank` closed: an address only its HELLO gave is forgotten
        with its last one, unless frames were sent to it meanwhile."""
        if rank not in self._hello_learned or any(slot[0] == rank for slot in self._proven) or rank in self._out:
            return
        self._hello_learned.discard(rank)
        self.addresses.pop(rank, None)
        self.stats.pop(rank, None)
        self.addresses_changed += 1

    def refused(self, who: str, why: str) -> None:
        """A connection refused at the handshake: counted, and logged once per peer and reason
        (a flood of them must not flood the log)."""
        self.refusals += 1
        self.last_frame_error = f"{who}: {why}"
        if (who.rsplit(":", 1)[0], why) not in self._refusals_logged and len(self._refusals_logged) < 256:
            self._refusals_logged.add((who.rsplit(":", 1)[0], why))
            log.error("rank %d: refused %s: %s", self.rank, who, why)

    def _frame_error(self, who: str, exc: FrameError) -> None:
        self.frame_errors += 1
        self.last_frame_error = f"bad frame from {who}: {exc}"
        log.error("rank %d: %s; closing that connection", self.rank, self.last_frame_error)


@dataclass(eq=False)
class _TlsPending:
    """An accepted TLS connection before its TLS handshake has ended."""

    conn: socket.socket
    who: str  # "host:port", for refusals
    host: str  # the source address, as _host_key gives it
    member: bool  # from an address a rank of the job listens on
    timer: asyncio.TimerHandle | None = None
    reading: bool = False  # waiting for its first bytes
    started: bool = False  # in its TLS handshake


def _host_key(host: str) -> str:
    """A source or listed address in one spelling (an IPv4-mapped IPv6 address as IPv4)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


class _TlsListener:
    """Accepts connections for TLS. The TLS handshake runs before a protocol hears of its
    connection, and each costs buffers, so the caps on connections in their handshake sit here.
    Every connection is accepted at once (the kernel's backlog never fills, so a member's
    connection is never left waiting behind a flood there) and then kept or closed:

    - from an address ranks of the job listen on (`TcpTransport.addresses`): up to
      MEMBER_HOST_HANDSHAKES for each rank there at once, each in its TLS handshake at once,
      beside and never behind the outsiders';
    - from any other address: up to PER_HOST_HANDSHAKES at once from one address and
      max_pending_handshakes from all; each must send its first bytes within FIRST_BYTE_S, and
      a quarter of max_pending_handshakes are in their TLS handshake at once (the rest wait
      their turn, within the handshake deadline).

    A connection beyond a cap is closed at once. A failed or closed TLS handshake is a
    refusal, counted and logged once per peer and reason like any other."""

    def __init__(self, owner: TcpTransport, context: ssl.SSLContext) -> None:
        self.t, self.context = owner, context
        me = owner.me
        family, _, _, _, address = socket.getaddrinfo(me.host, me.port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self.sock = socket.create_server(address[:2], family=family, backlog=LISTEN_BACKLOG)
        self.sock.setblocking(False)
        self.loop = asyncio.get_running_loop()
        self.pending: set[_TlsPending] = set()
        self.per_host: dict[str, int] = {}  # pending connections from each source address
        self.outsiders = 0  # pending connections from addresses no rank listens on
        self.handshaking = 0  # of those, in their TLS handshake
        self.queue: deque[_TlsPending] = deque()  # outsiders that sent bytes, waiting for a handshake slot
        self.reading = False
        self.retry: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self._resume()

    def _resume(self) -> None:
        self.retry = None
        if not self.reading and self.sock.fileno() >= 0:
            self.loop.add_reader(self.sock.fileno(), self._accept)
            self.reading = True

    @property
    def limit(self) -> int:
        """Outsiders' TLS handshakes at once: a quarter of max_pending_handshakes, as each holds
        about 0.5 MB of TLS buffers until it ends (a plain handshake holds a 256 KB scratch buffer)."""
        return max(1, self.t.max_pending_handshakes // 4)

    def _accept(self) -> None:
        members = self.t.member_hosts()
        for _ in range(ACCEPT_BATCH):
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: try again a little later
                self.t.refused("a connection", f"accept failed: {exc.strerror or exc}")
                self.loop.remove_reader(self.sock.fileno())
                self.reading = False
                self.retry = self.loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            host = _host_key(str(peer[0]))
            who = f"{peer[0]}:{peer[1]}"
            member = host in members
            cap = self.t.handshake_cap(host)
            if self.per_host.get(host, 0) >= cap:
                conn.close()
                self.t.refused(who, f"{cap} TLS connections from {host} are in their handshake already "
                                    f"(at most {cap})")
                continue
            if not member and self.outsiders >= self.t.max_pending_handshakes:
                conn.close()
                self.t.refused(who, f"{self.t.max_pending_handshakes} TLS connections are in their handshake "
                                    f"already (at most {self.t.max_pending_handshakes})")
                continue
            conn.setblocking(False)
            entry = _TlsPending(conn, who, host, member)
            self.pending.add(entry)
            self.per_host[host] = self.per_host.get(host, 0) + 1
            if member:  # a rank's reconnection: its handshake starts at once
                self._start(entry)
                continue
            self.outsiders += 1
            entry.reading = True
            self.loop.add_reader(conn.fileno(), self._first_bytes, entry)
            first_s = min(FIRST_BYTE_S, self.t.handshake_timeout_s)
            entry.timer = self.loop.call_later(first_s, self._drop, entry, f"sent nothing within {first_s:g} s")
        # more are waiting: let the loop run the rest, then accept them on its next turn

    def _first_bytes(self, entry: _TlsPending) -> None:
        """An outsider's first bytes arrived: its TLS handshake starts when a slot is free."""
        self._stop_reading(entry)
        if entry.timer is not None:
            entry.timer.cancel()
        if self.handshaking < self.limit:
            self._start(entry)
            return
        self.queue.append(entry)
        entry.timer = self.loop.call_later(self.t.handshake_timeout_s, self._drop, entry,
                                           f"no TLS handshake slot within {self.t.handshake_timeout_s:g} s")

    def _stop_reading(self, entry: _TlsPending) -> None:
        if entry.reading:
            entry.reading = False
            with contextlib.suppress(OSError, ValueError):
                self.loop.remove_reader(entry.conn.fileno())

    def _drop(self, entry: _TlsPending, why: str) -> None:
        if entry not in self.pending or entry.started:
            return
        self._stop_reading(entry)
        entry.conn.close()
        self._release(entry)
        if not self.t.closed:
            self.t.refused(entry.who, why)

    def _release(self, entry: _TlsPending) -> None:
        if entry not in self.pending:
            return
        self.pending.discard(entry)
        if entry.timer is not None:
            entry.timer.cancel()
        left = self.per_host.get(entry.host, 1) - 1
        if left > 0:
            self.per_host[entry.host] = left
        else:
            self.per_host.pop(entry.host, None)
        if not entry.member:
            self.outsiders -= 1
            if entry.started:
                self.handshaking -= 1
        while self.queue and self.handshaking < self.limit and not self.t.closed:
            waiting = self.queue.popleft()
            if waiting in self.pending and not waiting.started:
                if waiting.timer is not None:
                    waiting.timer.cancel()
                self._start(waiting)

    def _start(self, entry: _TlsPending) -> None:
        entry.started = True
        if not entry.member:
            self.handshaking += 1
        task = self.loop.create_task(self._handshake(entry))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handshake(self, entry: _TlsPending) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: _Inbound(self.t), entry.conn, ssl=self.context,
                                                    ssl_handshake_timeout=self.t.handshake_timeout_s)
        except (OSError, TimeoutError, ConnectionError) as exc:  # ssl.SSLError is an OSError
            entry.conn.close()
            if not self.t.closed:
                self.t.refused(entry.who, f"TLS handshake failed: {_tls_reason(exc)} (no certificate of the job's "
                                          f"CA, or not TLS)")
        finally:
            self._release(entry)

    def close(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.retry is not None:
            self.retry.cancel()
        self.sock.close()
        for task in self.tasks:
            task.cancel()
        for entry in list(self.pending):
            if not entry.started:
                self._stop_reading(entry)
                entry.conn.close()
                self._release(entry)
        self.queue.clear()


def _tls_reason(exc: BaseException) -> str:
    """An SSL error's short reason (CERTIFICATE_VERIFY_FAILED), else the error or its type."""
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else None
    return str(reason or exc or type(exc).__name__)


def _cert_rank(rank: int | None) -> str:
    return "no rank" if rank is None else f"rank {rank}"


class _Inbound(FrameReader):
    """Reads frames from one accepted connection (frame_reader.py): its handshake first, then
    a proven rank's frames."""

    def __init__(self, owner: TcpTransport) -> None:
        super().__init__(owner.pool, owner.max_payload_bytes)
        self.t = owner
        self.src = -1  # rank, once it proved the job's key
        self.hello: hs.Hello | None = None  # its opening, once checked
        self.nonce = b""  # ours, in the challenge
        self.peer: tuple[str, int] = ("?", 0)
        self.hello_timer: asyncio.TimerHandle | None = None
        self.host = ""  # the source address (_host_key)
        self.member = False  # an address a rank of the job listens on
        self.accepted_at = 0.0
        self.heard_at = 0.0  # when bytes last arrived (an unknown rank's connection is closed when idle)
        self.idle_timer: asyncio.TimerHandle | None = None
        self.unknown_held = 0  # bytes of the payload being read counted in t.unknown_unfinished
        self.writable: asyncio.Event | None = None  # cleared while the transport's write buffer is full
        self.probe = False  # a hole punch's probe (punch.py): answered, then nothing more is read

    # ---- writing, where a channel adopted this connection (its peer cannot be dialled) ---------

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = asyncio.Event()
        self.writable.clear()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set()

    async def drain(self) -> None:
        """Wait until the transport takes more (as StreamWriter.drain); ConnectionResetError once
        the connection is gone."""
        if self.writable is not None and not self.writable.is_set() and self.transport is not None:
            await self.writable.wait()
        if self.transport is None:
            raise ConnectionResetError(f"rank {self.src}'s connection was lost")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        peername = transport.get_extra_info("peername")
        self.peer = (str(peername[0]), int(peername[1])) if peername else ("?", 0)
        t = self.t
        t._inbound.add(self.transport)
        self.host = _host_key(self.peer[0])
        self.member = self.host in t.member_hosts()
        why = t._admit_pending(self)  # a flood of connections: each costs buffers
        if why:
            t.refused(f"{self.peer[0]}:{self.peer[1]}", why)
            self.transport.abort()
            return
        self.accepted_at = time.monotonic()
        self.begin_reading()  # (not for a refused one: a flood refused costs no memset)
        # an outsider's first bytes are due soon (a member's come with its connection); the whole
        # handshake within handshake_timeout_s
        first_s = t.handshake_timeout_s if self.member else min(FIRST_BYTE_S, t.handshake_timeout_s)
        self.hello_timer = asyncio.get_running_loop().call_later(first_s, self._no_hello)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.t._inbound.discard(self.transport)
        self.t._pending_done(self)
        if self.hello is not None and self.t._proven.get(self._slot()) is self:
            del self.t._proven[self._slot()]
        self.transport = None
        self._release_unknown()
        if self.writable is not None:
            self.writable.set()  # a drain waiting here raises
        if self.src >= 0:
            link = self.t._out.get(self.src)
            if link is not None:
                for ch in link.channels:
                    ch.adopted_lost(self)
            self.t.inbound_gone(self.src)
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if self.idle_timer is not None:
            self.idle_timer.cancel()

    def _release_unknown(self) -> None:
        self.t.unknown_unfinished -= self.unknown_held
        self.unknown_held = 0

    def _check_idle(self) -> None:
        """A rank the transport does not know: closed once it sends nothing for idle_unknown_s
        (its slot among MAX_UNKNOWN_RANKS goes to another joiner). A rank of the job never is:
        its peer would take the close for a broken link (_Channel._read)."""
        self.idle_timer = None
        t = self.t
        if self.transport is None or t.closed or t.knows(self.src):
            return
        idle = time.monotonic() - self.heard_at
        if idle < t.idle_unknown_s:
            self.idle_timer = asyncio.get_running_loop().call_later(t.idle_unknown_s - idle, self._check_idle)
            return
        t.refused(f"rank {self.src} at {self.peer[0]}", f"a rank not in this job's address table, silent for "
                                                        f"{t.idle_unknown_s:g} s")
        self.transport.abort()

    def _no_hello(self) -> None:
        self.hello_timer = None
        if self.src >= 0 or self.transport is None:
            return
        t = self.t
        if not self.heard_at:
            why = f"sent nothing within {time.monotonic() - self.accepted_at:.0f} s"
        else:
            left = t.handshake_timeout_s - (time.monotonic() - self.accepted_at)
            if left > 0:  # it began in time: the rest of the handshake deadline
                self.hello_timer = asyncio.get_running_loop().call_later(left, self._no_hello)
                return
            why = f"no handshake within {t.handshake_timeout_s:g} s"
        t.refused(f"{self.peer[0]}:{self.peer[1]}", why)
        self.transport.abort()

    # ---- what a frame is for (frame_reader.py cuts them) ---------------------------------------

    def on_bytes(self) -> None:
        self.heard_at = time.monotonic()

    def on_progress(self) -> None:
        """Part of a payload arrived: the sender is alive."""
        if self.src >= 0:
            self.t.events.on_progress(self.src)

    def on_frame_error(self, exc: FrameError) -> None:
        if self.src >= 0:
            self.t._frame_error(f"rank {self.src}", exc)
        else:
            self.t.refused(f"{self.peer[0]}:{self.peer[1]}", str(exc))

    def check_prefix(self, head_len: int, payload_len: int) -> None:
        if self.src < 0:
            hs.check_prefix(head_len, payload_len)

    def payload_begins(self, payload_len: int, have: int) -> bool:
        """A rank the transport does not know yet holds at most its share of unfinished payloads."""
        if self.src >= 0 and not self.t.knows(self.src):
            why = self.t.hold_unknown(self.src, payload_len)
            if why:
                self.t.refused(f"rank {self.src} at {self.peer[0]}", why)
                assert self.transport is not None
                self.transport.abort()
                return False
            self.unknown_held = payload_len
        return True

    def payload_done(self) -> None:
        self._release_unknown()

    def on_frame(self, head: bytes, payload: bytearray | memoryview | None) -> None:
        self._frame(head, payload)

    def _slot(self) -> tuple[int, int, int]:
        assert self.hello is not None
        return (self.src, self.hello.channel, self.hello.dst)

    def _handshake(self, head: bytes) -> None:
        """HELLO, then PROOF (handshake.py): nothing else is read before the proof."""
        frame, t = hs.decode(head), self.t
        if self.hello is None:
            if not isinstance(frame, hs.Hello):
                raise FrameError("the first frame is not a HELLO")
            t.check_hello(frame, self.peer[0])
            if t.credentials.tls is not None:
                assert self.transport is not None
                shown = rank_of(self.transport.get_extra_info("peercert"))
                if shown != frame.src:
                    raise FrameError(f"a peer claims rank {frame.src} with a certificate of {_cert_rank(shown)}")
            self.hello, self.nonce = frame, hs.new_nonce()
            assert self.transport is not None
            self.transport.write(hs.encode(hs.Challenge(src=t.rank, nonce=self.nonce,
                                                        mac=hs.accept_mac(t.credentials.key, frame, self.nonce))))
            return
        if not isinstance(frame, hs.Proof) or frame.src != self.hello.src:
            raise FrameError("the second frame is not the HELLO's PROOF")
        if not hs.verify(hs.dial_mac(t.credentials.key, self.hello, self.nonce), frame.mac):
            raise FrameError(f"a peer claiming rank {frame.src} did not prove the job's key")
        t.check_unknown(frame.src)  # again: others may have proved meanwhile
        self.src = frame.src
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        t._pending_done(self)
        if self.hello.channel in (hs.PROBE_CONTROL, hs.PROBE_BULK):
            if not t.knows(self.src):
                raise FrameError(f"rank {self.src}, not a rank of this job yet, probed for a hole punch")
            self.probe = True
            assert self.transport is not None
            self.transport.writelines(seen_frame(t.punches.seen(self.src, self.hello.channel, self.peer)))
            self.transport.close()  # (after the answer: a probe carries nothing else)
            return
        # one connection a rank and channel: a newer one (a restart, a reconnect) replaces the old
        older = t._proven.get(self._slot())
        t._proven[self._slot()] = self
        if older is not None and older.transport is not None:
            older.transport.abort()
        if self.src not in t.addresses and self.hello.address:  # a rank that joined with us: where it listens
            with contextlib.suppress(ValueError, ConfigError):
                t.learn_from_hello(self.src, parse_address(self.hello.address))
        if not t.knows(self.src):
            self.idle_timer = asyncio.get_running_loop().call_later(t.idle_unknown_s, self._check_idle)
        listed = t.addresses.get(self.src)
        if listed is not None and not listed.dialable_from(t.me) and self.hello.dst == t.rank:
            # we cannot dial this rank: its proven connection carries our frames of this kind to it
            t.learn_nat_host(self.src, self.host)
            t._link(self.src).channel(self.hello.channel).adopt(self)
            return
        link = t._out.get(self.src)
        if link is not None:
            link.peer_is_up()

    def _frame(self, head: bytes, payload: bytearray | memoryview | None) -> None:
        if self.src < 0:
            self._handshake(head)
            return
        if self.probe:
            raise FrameError(f"rank {self.src} sent a frame on a hole punch's probe connection")
        self.t.deliver(self.src, head, payload)
