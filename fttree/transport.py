"""TCP links between workers: framing, per-link send queues, and the in-process fault layer.

Each worker listens on its own host:port and opens one outgoing connection per peer it talks
to, bound to its own host address, so a firewall rule between two addresses cuts exactly one
link. Every outgoing link has its own queue and writer task: a peer that silently drops
packets stalls only its own writer, never the other links. A writer whose drain stalls past
`stall_timeout_s` drops the connection and reconnects, so a healed link comes back without
waiting for TCP's exponential retransmission backoff. Frames lost with a dropped connection are
the protocol's business (it recovers them through backup links).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError, FrameError, PeerError
from .faults import FaultSchedule
from .messages import DEFAULT_MAX_PAYLOAD_BYTES, PREFIX, Kind, Message, decode_header, decode_prefix, encode

log = logging.getLogger("fttree.transport")

STREAM_LIMIT = 16 * 1024 * 1024
HELLO_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad peer address {text.strip()!r}: expected host:port")
    return Address(host.strip("[]"), int(port))


def parse_peers(lines: list[str]) -> list[Address]:
    """Peer addresses, line i for rank i; blank lines and '#' comments are skipped."""
    peers = [parse_address(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    if not peers:
        raise ConfigError("the peers list is empty")
    seen: dict[Address, int] = {}
    for rank, addr in enumerate(peers):
        if addr in seen:
            raise ConfigError(f"ranks {seen[addr]} and {rank} share the address {addr}: each rank needs its own")
        seen[addr] = rank
    return peers


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass
class LinkStats:
    frames_sent: int = 0
    bytes_sent: int = 0
    frames_received: int = 0
    bytes_received: int = 0
    injected_drops: int = 0
    stale_dropped: int = 0
    connects: int = 0
    errors: int = 0
    last_error: str = ""


class _OutLink:
    """The outgoing half of one link: a queue and a writer task that owns the connection."""

    def __init__(self, transport: TcpTransport, peer: int) -> None:
        self.t = transport
        self.peer = peer
        self.queue: deque[Message] = deque()
        self.wake = asyncio.Event()
        self.connected = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"fttree-link-{peer}")

    def backlog_bytes(self) -> int:
        """Bytes waiting to go out on this link: queued frames plus the socket's send buffer."""
        queued = sum(len(m.payload) for m in self.queue if m.payload is not None)
        if self.writer is not None:
            queued += self.writer.transport.get_write_buffer_size()
        return queued

    def push(self, msg: Message) -> None:
        self.queue.append(msg)
        self.wake.set()

    async def _connect(self) -> bool:
        t, addr = self.t, self.t.addresses[self.peer]
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(addr.host, addr.port, local_addr=(t.me.host, 0), limit=STREAM_LIMIT),
                t.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            t.stats[self.peer].last_error = f"connect to {addr}: {exc or type(exc).__name__}"
            if isinstance(exc, ConnectionRefusedError):
                t.on_link_down(self.peer, f"connection to {addr} refused")
            return False
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for buf in encode(Message(kind=Kind.HELLO, src=t.rank, world=t.world)):
            writer.write(buf)
        self.writer = writer
        t.stats[self.peer].connects += 1
        self.connected.set()
        return True

    def _drop_connection(self, why: str) -> None:
        stats = self.t.stats[self.peer]
        stats.errors += 1
        stats.last_error = why
        log.info("rank %d: link to rank %d dropped: %s", self.t.rank, self.peer, why)
        if self.writer is not None:
            self.writer.transport.abort()
        self.writer = None
        self.connected.clear()

    def _drop_stale(self) -> None:
        kept = deque(m for m in self.queue if not self.t.is_stale(m))
        self.t.stats[self.peer].stale_dropped += len(self.queue) - len(kept)
        self.queue = kept

    async def _run(self) -> None:
        backoff = 0.05
        while not self.t.closed:
            if self.writer is None and not await self._connect():
                self._drop_stale()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            try:
                await self._drain_queue()
            except (OSError, TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self._drop_connection(why)
                if isinstance(exc, ConnectionError):  # reset or closed, not merely slow
                    self.t.on_link_down(self.peer, why)
                continue
            self.wake.clear()
            if not self.queue:
                await self.wake.wait()

    async def _drain_queue(self) -> None:
        writer, stats = self.writer, self.t.stats[self.peer]
        assert writer is not None
        while self.queue:
            msg = self.queue.popleft()
            if self.t.is_stale(msg):
                stats.stale_dropped += 1
                continue
            for buf in encode(msg):
                writer.write(buf)
                stats.bytes_sent += len(buf)
            stats.frames_sent += 1
            await asyncio.wait_for(writer.drain(), self.t.stall_timeout_s)


class TcpTransport:
    """Frames over TCP for one rank; calls `on_message` on the event loop for each frame."""

    def __init__(self, rank: int, addresses: list[Address], *,
                 on_message: Callable[[Message], None],
                 is_stale: Callable[[Message], bool] = lambda m: False,
                 on_link_down: Callable[[int, str], None] = lambda peer, why: None,
                 faults: FaultSchedule | None = None,
                 connect_timeout_s: float = 2.0,
                 stall_timeout_s: float = 5.0,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.rank, self.world, self.addresses = rank, len(addresses), addresses
        self.me = addresses[rank]
        self.on_message = on_message
        self.is_stale = is_stale
        self.on_link_down = on_link_down
        self.faults = faults or FaultSchedule()
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.stats = {p: LinkStats() for p in range(self.world) if p != rank}
        self.closed = False
        self.frame_errors = 0
        self.last_frame_error = ""
        self._out: dict[int, _OutLink] = {}
        self._server: asyncio.Server | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self._inbound: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._accept, self.me.host, self.me.port,
                                                      reuse_address=True, limit=STREAM_LIMIT)
        except OSError as exc:
            hint = " (is another worker already running as this rank?)" if exc.errno == 98 else ""
            raise PeerError(f"rank {self.rank} cannot listen on {self.me}: {exc.strerror or exc}{hint}") from None

    def _link(self, peer: int) -> _OutLink:
        link = self._out.get(peer)
        if link is None:
            link = self._out[peer] = _OutLink(self, peer)
        return link

    def send(self, dst: int, msg: Message) -> None:
        """Queue a frame for `dst`; never blocks. The fault layer may drop or delay it."""
        verdict = self.faults.verdict(self.rank, dst, msg.step) if self.faults else None
        if verdict is not None and verdict.drop:
            self.stats[dst].injected_drops += 1
            return
        if verdict is not None and verdict.delay_s:
            asyncio.get_running_loop().call_later(verdict.delay_s, self._link(dst).push, msg)
            return
        self._link(dst).push(msg)

    def backlog_bytes(self, dst: int) -> int:
        link = self._out.get(dst)
        return 0 if link is None else link.backlog_bytes()

    async def wait_for_peers(self, peers: list[int], deadline_s: float) -> None:
        """Connect to each peer, or raise PeerError naming those still unreachable."""
        links = {p: self._link(p) for p in peers}
        waits = {p: asyncio.ensure_future(link.connected.wait()) for p, link in links.items()}
        if not waits:
            return
        _done, pending = await asyncio.wait(waits.values(), timeout=deadline_s)
        for fut in pending:
            fut.cancel()
        missing = [p for p, fut in waits.items() if fut in pending]
        if missing:
            detail = "; ".join(f"rank {p} at {self.addresses[p]} ({self.stats[p].last_error or 'no answer'})"
                               for p in missing)
            raise PeerError(f"rank {self.rank} could not reach peers within {deadline_s:g} s: {detail}",
                            peers=tuple(missing))

    async def close(self) -> None:
        self.closed = True
        if self._server is not None:
            self._server.close()
        for link in self._out.values():
            link.task.cancel()
            if link.writer is not None:
                link.writer.transport.abort()
        for writer in list(self._inbound):
            writer.transport.abort()  # readers then end on their own (no cancel: see _accept)
        tasks = [link.task for link in self._out.values()] + list(self._readers)
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- inbound -----------------------------------------------------------------------

    async def _read_frame(self, reader: asyncio.StreamReader) -> Message:
        prefix = await reader.readexactly(PREFIX.size)
        head_len, payload_len = decode_prefix(prefix, max_payload_bytes=self.max_payload_bytes)
        head = await reader.readexactly(head_len)
        payload = await reader.readexactly(payload_len) if payload_len else None
        return decode_header(head, payload)

    def _check_hello(self, hello: Message, peer_host: str) -> int:
        if hello.kind != Kind.HELLO:
            raise FrameError(f"first frame is {hello.kind.name}, expected HELLO")
        if hello.world != self.world:
            raise FrameError(f"peer runs a world of {hello.world} workers, this rank has {self.world}")
        src = hello.src
        if not 0 <= src < self.world or src == self.rank:
            raise FrameError(f"peer claims rank {src}, which is not another rank of 0..{self.world - 1}")
        expected = self.addresses[src].host
        if _is_ip(expected) and _is_ip(peer_host) and ipaddress.ip_address(expected) != ipaddress.ip_address(peer_host):
            raise FrameError(f"connection from {peer_host} claims rank {src}, whose address is {expected} "
                             f"(two workers with the same rank, or a wrong --rank?)")
        return src

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._readers.add(task)
        self._inbound.add(writer)
        peername = writer.get_extra_info("peername") or ("?", 0)
        src = -1
        try:
            hello = await asyncio.wait_for(self._read_frame(reader), HELLO_TIMEOUT_S)
            src = self._check_hello(hello, str(peername[0]))
            stats = self.stats[src]
            while True:
                msg = await self._read_frame(reader)
                if msg.src != src:
                    raise FrameError(f"frame says it is from rank {msg.src} on rank {src}'s connection")
                stats.frames_received += 1
                stats.bytes_received += PREFIX.size + (0 if msg.payload is None else len(msg.payload))
                if self.faults and self.faults.verdict(src, self.rank, msg.step).drop:
                    stats.injected_drops += 1
                    continue
                self.on_message(msg)
        except FrameError as exc:
            self.frame_errors += 1
            who = f"rank {src}" if src >= 0 else f"{peername[0]}:{peername[1]}"
            self.last_frame_error = f"bad frame from {who}: {exc}"
            log.error("rank %d: %s; closing that connection", self.rank, self.last_frame_error)
        except TimeoutError:
            log.error("rank %d: %s:%s sent no HELLO within %g s; closing", self.rank, *peername[:2], HELLO_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the peer went away; it reconnects when it has something to send
        finally:
            writer.transport.abort()
            self._inbound.discard(writer)
            self._readers.discard(task)
