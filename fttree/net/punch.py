"""Hole punching for pairs that meet through a relay: a connection of their own where the NATs allow.

Two ranks that cannot dial each other (two `-`, or two sites: relay.py) exchange frames
through a relay. Where both NATs keep a connection's source port (Linux MASQUERADE as most
home and office routers use it), a TCP hole punch (holepunch.py) gives the pair a direct
connection, and their frames stop taking the detour. A public rank connected to both
coordinates: the first of the pair's relays everybody can dial whose connection is up.

    a (the lower rank) probes c from two fresh ports (control, bulk): c sees their mappings
    a -> c  ASK b, naming the two mappings c answered
    c -> b  OFFER a
    b       probes c from two fresh ports of its own
    b -> c  READY a, naming its two
    c -> a, c -> b  GO: the other's two mappings; dial in GO_AFTER_S
    a, b    dial each other, port to mapped port, until PUNCH_DEADLINE_S (simultaneous open)

A probe is a connection like any other (HELLO, CHALLENGE, PROOF: handshake.py) on which c
answers SEEN, the address the connection came from, and closes it; a rank learns its mapping
only from a member that proved the job's key, and c passes on only mappings it saw that
rank's probes come from (a rank may punch to several peers at once, so the ASK and READY say
which of its probes are this pair's). The notes (ASK ... GO) are
transport-level frames on proven connections, never handed to the node. A punched connection
opens with the same handshake as any (and TLS under TLS): the lower rank sends the HELLO,
the other takes it as an accepted connection. It is no way in for anyone without the key,
whatever address a GO named: the handshake refuses it.

Once both of the pair's connections (control and bulk) have proven the key, frames between
the two go on them (TcpTransport._relayed). If one breaks, the pair is back on the relay at
once, with what was queued on it, and the lower rank punches again after PUNCH_RETRY_S
(doubling), PUNCH_TRIES times in all; a punch that does not connect leaves the relay as it
was, is logged once, and its outcome is in the status (LinkStatus.punch, punch_tries, ...).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from ..core.messages import PREFIX, Frame, Kind, decode_prefix
from ..errors import FrameError
from . import handshake as hs
from .address import Address
from .holepunch import reusable_socket, simultaneous_open
from .relay import Relayed, connectable, relay_order

log = logging.getLogger("fttree.net.punch")

PUNCH_MARK = b"\xc2"  # first byte of a note's header: never the first byte of a frame's msgpack header (a map)
MAX_NOTE_BYTES = 512  # a note's header, at most
PUNCH_DEADLINE_S = 5.0  # both dial for this long after GO before the pair stays on the relay
GO_AFTER_S = 0.2  # the pair dials this long after the coordinator sends GO (both get it about then)
ANSWER_S = 10.0  # a rank waits this long for GO after asking (or saying it is ready)
PUNCH_TRIES = 3  # punches per pair, the first included (again after a failure or a lost connection)
PUNCH_RETRY_S = 2.0  # before the second, twice as long before the third
MAX_ASKS = 64  # punches a coordinator holds open at once
SEEN_PER_RANK = 16  # probes' mappings a coordinator keeps per rank


def note(src: int, dst: int, body: dict[str, Any]) -> Relayed:
    """A transport-level note for `dst`, as a channel writes it (like a relay envelope: the
    header bytes ready, never stale)."""
    head = PUNCH_MARK + msgpack.packb(body)
    return Relayed(kind=Kind.HELLO, src=src, dst=dst, head=head)


def is_note(head: bytes) -> bool:
    return head[:1] == PUNCH_MARK


def read_note(head: bytes) -> dict[str, Any]:
    """A note's fields, or FrameError naming what is wrong (a member's bad frame)."""
    if len(head) > MAX_NOTE_BYTES:
        raise FrameError(f"a hole punch note of {len(head)} bytes (at most {MAX_NOTE_BYTES})")
    try:
        body = msgpack.unpackb(head[1:], strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"a hole punch note that is not msgpack: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("t"), str):
        raise FrameError("a hole punch note without its type")
    if "peer" in body and type(body["peer"]) is not int:
        raise FrameError("a hole punch note whose peer is not a rank")
    return body


def parse_mapping(text: object) -> tuple[str, int]:
    """"host:port" as a coordinator saw it, or FrameError."""
    if not isinstance(text, str):
        raise FrameError("a hole punch mapping that is not host:port")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FrameError(f"a hole punch mapping {text!r} that is not host:port")
    return host.strip("[]"), int(port)


def mapping(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


def coordinators(addresses: dict[int, Address], a: int, b: int) -> tuple[int, ...]:
    """The ranks that may coordinate a punch between `a` and `b`: their relays that everybody
    can dial (a site's rank sees its site-mates' local addresses, not their mappings)."""
    return tuple(r for r in relay_order(addresses, a, b) if addresses[r].listed and not addresses[r].behind)


class PunchHost(Protocol):
    """What punching needs of its transport (tcp.py's TcpTransport)."""

    rank: int
    addresses: dict[int, Address]
    me: Address
    closed: bool

    def knows(self, rank: int) -> bool: ...

    def link_up(self, peer: int) -> bool: ...

    def push(self, dst: int, msg: Frame) -> None: ...

    def probe(self, coordinator: int, channel: int, sock: socket.socket) -> Awaitable[tuple[str, int]]: ...

    def take_punched(self, peer: int, channel: int, sock: socket.socket) -> Awaitable[str]: ...

    def punched(self, peer: int) -> bool: ...

    def connected(self, peer: int, timeout_s: float) -> Awaitable[bool]: ...

    def punch_lost(self, peer: int, why: str) -> None: ...


@dataclass(slots=True)
class PunchOutcome:
    """The punches with one peer, for the status."""

    state: str = ""  # "" never tried, trying, connected, failed (on the relay), lost (back on the relay)
    tries: int = 0
    connected: int = 0  # punches that connected
    took_s: float = 0.0  # the last connected punch: from GO to both connections proven
    why: str = ""  # why the last one failed or was lost
    via: int = -1  # the rank that coordinated the last one


class Punches:
    """The hole punches of one transport: as one of a pair, and as a coordinator."""

    def __init__(self, host: PunchHost, *, enabled: bool = True) -> None:
        self.host = host
        self.enabled = enabled  # off: this rank neither punches nor follows (it still coordinates)
        self.started = False  # start() ran (on the transport's loop)
        self.deadline_s, self.answer_s = PUNCH_DEADLINE_S, ANSWER_S
        self.tries, self.retry_s = PUNCH_TRIES, PUNCH_RETRY_S
        self.outcomes: dict[int, PunchOutcome] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}  # peer -> its punches (both roles)
        self._go: dict[int, asyncio.Future[dict[str, Any]]] = {}  # peer -> the GO waited for
        self._lost: dict[int, asyncio.Event] = {}  # peer -> set when its punched connection breaks
        # as coordinator: each rank's latest probes' mappings, and (a, b) -> until when a's ASK
        # stands, with a's two mappings
        self._seen: dict[int, deque[str]] = {}
        self._asks: dict[tuple[int, int], tuple[float, str, str]] = {}
        self._logged: set[str] = set()

    # ---- which pairs --------------------------------------------------------------------------

    def wanted(self, peer: int) -> bool:
        """Is `peer` a rank this one can only reach through a relay, with a coordinator?"""
        host = self.host
        addr = host.addresses.get(peer)
        return (self.enabled and addr is not None and peer >= 0 and peer != host.rank and not connectable(host.me, addr)
                and bool(coordinators(host.addresses, host.rank, peer)))

    def start(self) -> None:
        """Punch to every peer this rank leads (the lower rank of a pair leads) and has not tried
        yet: at the start, and again when a rank joins."""
        self.started = True
        for peer in sorted(self.host.addresses):
            if peer > self.host.rank and self.wanted(peer) and peer not in self._tasks and peer not in self.outcomes:
                self._spawn(peer, self._lead(peer))

    def _spawn(self, peer: int, work: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await work
            finally:
                if self._tasks.get(peer) is task:
                    del self._tasks[peer]

        task = asyncio.get_running_loop().create_task(run(), name=f"fttree-punch-{self.host.rank}-{peer}")
        self._tasks[peer] = task

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one of the pair ------------------------------------------------------------------------

    async def _lead(self, peer: int) -> None:
        """Punch to `peer`; again after a failure or a lost connection, up to `tries` in all."""
        for attempt in range(self.tries):
            if attempt:
                await asyncio.sleep(self.retry_s * 2 ** (attempt - 1))
            if self.host.closed:
                return
            coordinator = await self._coordinator(peer)
            if coordinator is None:
                self._failed(peer, "no rank that could coordinate is connected")
                continue
            lost = self._lost[peer] = asyncio.Event()
            if await self._attempt(peer, coordinator, {"t": "ask", "peer": peer}):
                await lost.wait()

    async def _coordinator(self, peer: int) -> int | None:
        """The first coordinator for the pair whose connection is up; else the first, once its
        connection comes up (within answer_s: at the start, it is being dialled)."""
        found = coordinators(self.host.addresses, self.host.rank, peer)
        up = next((c for c in found if self.host.link_up(c)), None)
        if up is not None or not found:
            return up
        return found[0] if await self.host.connected(found[0], self.answer_s) else None

    async def _follow(self, peer: int, coordinator: int) -> None:
        await self._attempt(peer, coordinator, {"t": "ready", "peer": peer})

    async def _attempt(self, peer: int, coordinator: int, opening: dict[str, Any]) -> bool:
        """Probe the coordinator, send `opening`, wait for GO and punch: True once connected."""
        out = self.outcomes.setdefault(peer, PunchOutcome())
        out.state, out.tries, out.via = "trying", out.tries + 1, coordinator
        held: list[socket.socket] = []  # the two ports stay this rank's until the punch is over
        try:
            bind = self.host.me.host if self.host.me.listed else "0.0.0.0"
            held += [reusable_socket(bind, 0), reusable_socket(bind, 0)]
            ports = [s.getsockname()[1] for s in held]
            probes = [reusable_socket(bind, port) for port in ports]
            held += probes  # (closed here too if a probe never took its socket)
            seen = await asyncio.wait_for(asyncio.gather(*(
                self.host.probe(coordinator, kind, s)
                for kind, s in zip((hs.PROBE_CONTROL, hs.PROBE_BULK), probes, strict=True))), self.answer_s)
            go = self._go[peer] = asyncio.get_running_loop().create_future()
            opening = {**opening, "ctl": mapping(seen[0]), "bulk": mapping(seen[1])}  # which probes are this pair's
            self.host.push(coordinator, note(self.host.rank, coordinator, opening))
            try:
                answer = await asyncio.wait_for(go, self.answer_s)
            except TimeoutError:
                return self._failed(peer, f"no GO from rank {coordinator} within {self.answer_s:g} s")
            finally:
                self._go.pop(peer, None)
            return await self._punch(peer, answer, (bind, ports[0]), (bind, ports[1]))
        except (OSError, TimeoutError, FrameError) as exc:
            return self._failed(peer, f"coordinated by rank {coordinator}: {str(exc) or type(exc).__name__}")
        finally:
            for s in held:
                s.close()

    async def _punch(self, peer: int, go: dict[str, Any], control: tuple[str, int], bulk: tuple[str, int]) -> bool:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(GO_AFTER_S)
        targets = (parse_mapping(go.get("ctl")), parse_mapping(go.get("bulk")))
        results = await asyncio.gather(*(simultaneous_open(local, remote, self.deadline_s)
                                         for local, remote in zip((control, bulk), targets, strict=True)))
        if not all(r.ok for r in results):
            for r in results:
                if r.sock is not None:
                    r.sock.close()
            why = "; ".join(f"{name}: {r.why}" for name, r in zip(("control", "bulk"), results, strict=True)
                            if not r.ok)
            return self._failed(peer, why)
        taken = await asyncio.gather(*(self.host.take_punched(peer, kind, r.sock) for kind, r in
                                       zip((hs.CONTROL, hs.BULK), results, strict=True) if r.sock is not None),
                                     return_exceptions=True)
        refused = [w if isinstance(w, str) else f"{type(w).__name__}: {w}" for w in taken]
        if any(refused) or not self.host.punched(peer):
            why = "; ".join(w for w in refused if w) or "a punched connection closed at once"
            self.host.punch_lost(peer, why)  # the one that may have connected goes too
            return self._failed(peer, why)
        out = self.outcomes[peer]
        out.state, out.connected, out.took_s, out.why = "connected", out.connected + 1, loop.time() - start, ""
        log.info("rank %d: hole punched to rank %d in %.3f s (coordinated by rank %d): its frames no longer take "
                 "the relay", self.host.rank, peer, out.took_s, out.via)
        return True

    def _failed(self, peer: int, why: str) -> bool:
        out = self.outcomes.setdefault(peer, PunchOutcome())
        out.state, out.why = "failed", why
        key = f"failed:{peer}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("rank %d: no hole punch to rank %d (%s): its frames keep going through a relay",
                        self.host.rank, peer, why)
        return False

    def lost(self, peer: int, why: str) -> None:
        """The pair's punched connection broke: the transport put its frames back on the relay."""
        out = self.outcomes.get(peer)
        if out is None or out.state != "connected":
            return
        out.state, out.why = "lost", why
        log.info("rank %d: the hole punched to rank %d broke (%s): back on the relay", self.host.rank, peer, why)
        event = self._lost.get(peer)
        if event is not None:
            event.set()

    # ---- notes --------------------------------------------------------------------------------

    def receive(self, src: int, head: bytes) -> None:
        """A note on `src`'s proven connection. FrameError for one that is not a note at all."""
        body = read_note(head)
        kind, peer = body.get("t"), body.get("peer")
        if not isinstance(peer, int) or not self.host.knows(src):
            self._ignore(f"a {kind} note from rank {src} without a rank of the job")
            return
        if kind in ("ask", "ready"):
            self._coordinate(src, peer, kind, (body.get("ctl"), body.get("bulk")))
        elif kind == "offer":
            if peer < self.host.rank and self.wanted(peer) and self._may_coordinate(src, peer, self.host.rank) \
                    and peer not in self._tasks:
                self._spawn(peer, self._follow(peer, src))
            else:
                self._ignore(f"rank {src} offered a punch with rank {peer}, which this rank does not follow now")
        elif kind == "go":
            go = self._go.get(peer)
            if go is None or go.done() or not self._may_coordinate(src, self.host.rank, peer):
                self._ignore(f"rank {src} sent GO for rank {peer}, which this rank is not waiting for")
                return
            go.set_result(body)
        else:
            self._ignore(f"rank {src} sent a hole punch note of type {kind!r}")

    def _may_coordinate(self, c: int, a: int, b: int) -> bool:
        return c in coordinators(self.host.addresses, a, b)

    def seen(self, rank: int, channel: int, peer: tuple[str, int]) -> str:
        """A probe of `rank` (a rank of the job) proved the key, from `peer`: its mapping, kept
        for a GO (the latest SEEN_PER_RANK: a rank may punch to several peers at once)."""
        text = mapping(peer)
        self._seen.setdefault(rank, deque(maxlen=SEEN_PER_RANK)).append(text)
        return text

    def _coordinate(self, src: int, peer: int, kind: object, claimed: tuple[object, object]) -> None:
        """As the coordinator: hold an ASK; on the READY for it, send both their GO. Each names
        the mappings of its probes, which must be ones this rank saw (from that rank)."""
        host = self.host
        a, b = (src, peer) if kind == "ask" else (peer, src)
        addr_a, addr_b = host.addresses.get(a), host.addresses.get(b)
        if (addr_a is None or addr_b is None or not host.knows(peer) or a == b or a >= b
                or connectable(addr_a, addr_b) or not self._may_coordinate(host.rank, a, b)):
            self._ignore(f"rank {src} asked to punch with rank {peer}, a pair this rank does not coordinate")
            return
        ctl, bulk = claimed
        if not isinstance(ctl, str) or not isinstance(bulk, str) or not {ctl, bulk} <= set(self._seen.get(src, ())):
            self._ignore(f"rank {src} named mappings this rank did not see its probes come from")
            return
        now = asyncio.get_running_loop().time()
        if kind == "ask":
            if len(self._asks) >= MAX_ASKS:
                self._asks = {pair: ask for pair, ask in self._asks.items() if ask[0] > now}
            if len(self._asks) >= MAX_ASKS:
                self._ignore(f"{MAX_ASKS} punches are open here already")
                return
            self._asks[(a, b)] = (now + self.answer_s, ctl, bulk)
            host.push(b, note(host.rank, b, {"t": "offer", "peer": a}))
            return
        until, a_ctl, a_bulk = self._asks.pop((a, b), (0.0, "", ""))
        if until < now:
            self._ignore(f"rank {b} is ready to punch with rank {a}, which asked nothing (lately)")
            return
        host.push(a, note(host.rank, a, {"t": "go", "peer": b, "ctl": ctl, "bulk": bulk}))
        host.push(b, note(host.rank, b, {"t": "go", "peer": a, "ctl": a_ctl, "bulk": a_bulk}))

    def _ignore(self, why: str) -> None:
        if why not in self._logged and len(self._logged) < 64:
            self._logged.add(why)
            log.info("rank %d: hole punching: ignored: %s", self.host.rank, why)


async def read_seen(reader: asyncio.StreamReader, timeout_s: float) -> tuple[str, int]:
    """The SEEN note a coordinator writes on a probe: the mapping it saw (host, port)."""
    head_len, payload_len = decode_prefix(await asyncio.wait_for(reader.readexactly(PREFIX.size), timeout_s))
    if payload_len or head_len > MAX_NOTE_BYTES:
        raise FrameError("a probe's answer is not a SEEN note")
    head = await asyncio.wait_for(reader.readexactly(head_len), timeout_s)
    if not is_note(head):
        raise FrameError("a probe's answer is not a SEEN note")
    body = read_note(head)
    if body.get("t") != "seen":
        raise FrameError(f"a probe's answer is a {body.get('t')!r} note, not SEEN")
    return parse_mapping(body.get("at"))


def seen_frame(at: str) -> list[bytes | memoryview]:
    """The bytes of a SEEN note (written straight on a probe's connection)."""
    return note(-1, -1, {"t": "seen", "at": at}).bufs()

