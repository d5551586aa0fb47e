"""Relays: frames between two ranks that cannot connect, through a member both can reach.

Two ranks neither of which can dial the other (two `-`, or ranks behind two different sites:
address.py) have no connection. A frame from one to the other goes to a relay, a third rank
that each of them has a connection with, inside an envelope: the frame's own header behind a
short prefix naming its origin and its destination (ENVELOPE), its payload untouched. The
relay checks the envelope and writes it on its own connection to the destination, which takes
the frame out and hands it to its node as if it had come directly.

Only members carry and only members are carried for. An envelope arrives on a connection that
proved the job's key (handshake.py) like any frame, so an outsider never gets one in. The relay
forwards only an envelope whose origin is the rank whose connection it came on, whose inner
frame says it is from that rank, and whose destination is a rank of the job it has a
connection with itself (one hop, never two: an envelope cannot loop). The destination takes
an envelope only for itself, only from a rank it cannot connect with directly (a member cannot
pass its frames off as relayed from a rank with a link of its own; others are dropped, counted,
and the relay's connection kept, as an address book may lag behind a join), and checks the
inner frame as any frame. What a relay holds is bounded: an envelope for a destination that has
RELAY_BACKLOG_BYTES or more not yet acknowledged is dropped (counted), and the protocol
recovers it as any lost frame, around the link.

Which relay: of the ranks both ends can connect with, the public ones first (listed with no
site: everybody can reach them), then those behind a site; in that order rotated by the pair
(so the relayed pairs of a job spread over the public ranks instead of all passing one), the
first whose connection from here is up. So few bytes take the detour at all: the trees place
ranks that cannot connect apart from each other's primary links (view.py, `reachability`), so
the tensors of a fault-free step never need a relay; what is relayed is the small metadata of
the backup links, probes and membership frames, and data only on a fault.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Protocol

from ..core.messages import MAGIC, PREFIX, VERSION, Frame, decode_header, encode
from ..errors import FrameError
from .address import Address

log = logging.getLogger("fttree.net.relay")

RELAY_MARK = b"\xc1"  # first byte of an envelope's header: never the first byte of msgpack (a frame's own header)
ENVELOPE = struct.Struct(">cII")  # the mark, the origin, the destination
RELAY_BACKLOG_BYTES = 64 << 20  # a relay drops envelopes for a destination with this much not acknowledged


def connectable(a: Address, b: Address) -> bool:
    """Can ranks at `a` and `b` have a connection (one of them can dial the other)?"""
    return a.dialable_from(b) or b.dialable_from(a)


@dataclass(slots=True, kw_only=True)
class Relayed(Frame):
    """An envelope on its way to or through a relay: what a channel queues and writes in place
    of a frame. `inner` is the frame itself on the rank it starts from (whose node is asked
    whether it went stale); None on the relay, which forwards bytes it does not interpret."""

    dst: int = -1
    head: bytes = b""
    inner: Frame | None = field(default=None, repr=False)

    def bufs(self) -> list[bytes | memoryview]:
        payload = b"" if self.payload is None else memoryview(self.payload).cast("B")
        prefix = PREFIX.pack(MAGIC, VERSION, len(self.head), len(payload))
        return [prefix + self.head, payload] if len(payload) else [prefix + self.head]


def wrap(msg: Frame, origin: int, dst: int) -> Relayed:
    """`msg` from `origin` for `dst`, in an envelope."""
    first = encode(msg)[0]
    head = ENVELOPE.pack(RELAY_MARK, origin, dst) + bytes(first[PREFIX.size:])
    return Relayed(kind=msg.kind, src=origin, epoch=msg.epoch, payload=msg.payload, dst=dst, head=head, inner=msg)


def is_envelope(head: bytes) -> bool:
    return head[:1] == RELAY_MARK


class RelayHost(Protocol):
    """What the relays need of their transport (tcp.py's TcpTransport)."""

    rank: int
    addresses: dict[int, Address]
    me: Address
    addresses_changed: int

    def knows(self, rank: int) -> bool: ...

    def link_up(self, peer: int) -> bool: ...

    def backlog_bytes(self, dst: int | None = None) -> int: ...

    def push(self, dst: int, msg: Frame) -> None: ...

    def deliver(self, src: int, head: bytes, payload: bytearray | memoryview | None) -> None: ...


@dataclass(slots=True)
class RelayCounters:
    """What went through relays at one rank, for its status (bytes: envelope headers and payloads)."""

    sent_frames: int = 0  # frames of this rank that went out in envelopes
    sent_bytes: int = 0
    forwarded_frames: int = 0  # envelopes this rank carried for two others
    forwarded_bytes: int = 0
    received_frames: int = 0  # frames for this rank that came in envelopes
    received_bytes: int = 0
    dropped: int = 0  # envelopes dropped: no relay, a full backlog, a destination not reachable from here
    last_drop: str = ""


class Relays:
    """The relays of one transport: sends a frame for a rank it cannot connect with through a
    relay, forwards envelopes as a relay, and takes envelopes meant for this rank."""

    def __init__(self, host: RelayHost) -> None:
        self.host = host
        self.counters = RelayCounters()
        self._logged: set[str] = set()
        self._cache: tuple[int, dict[int, tuple[int, ...]]] = (-1, {})  # (addresses_changed, dst -> candidates)

    def needed(self, peer: int) -> bool:
        """Does a frame for `peer` need a relay (neither of the two can dial the other)?"""
        addr = self.host.addresses.get(peer)
        return addr is not None and peer >= 0 and not connectable(self.host.me, addr)

    def candidates(self, dst: int) -> tuple[int, ...]:
        """The ranks that could relay between this rank and `dst`, best first (the module's
        docstring says the order)."""
        changed, table = self._cache
        if changed != self.host.addresses_changed:
            table = {}
            self._cache = (self.host.addresses_changed, table)
        found = table.get(dst)
        if found is None:
            found = table[dst] = relay_order(self.host.addresses, self.host.rank, dst)
        return found

    def via(self, dst: int) -> int | None:
        """The relay for frames to `dst` now: the first candidate whose connection is up, or the
        first candidate while none is (its frames wait for it); None if there is none."""
        found = self.candidates(dst)
        for r in found:
            if self.host.link_up(r):
                return r
        return found[0] if found else None

    def why_not(self, dst: int) -> str:
        addr = self.host.addresses.get(dst)
        return (f"rank {self.host.rank} ({self.host.me}) and rank {dst} ({addr}) cannot connect, and no rank of the "
                f"job can reach both to relay between them (give one of them an address the other can dial, or "
                f"add a rank both can reach)")

    def send(self, dst: int, msg: Frame) -> None:
        relay = self.via(dst)
        if relay is None:
            self._drop(self.why_not(dst))
            return
        env = wrap(msg, self.host.rank, dst)
        self.counters.sent_frames += 1
        self.counters.sent_bytes += len(env.head) + (0 if msg.payload is None else len(msg.payload))
        self.host.push(relay, env)

    def receive(self, src: int, head: bytes, payload: bytearray | memoryview | None) -> None:
        """An envelope on `src`'s proven connection: forward it, or take the frame inside.
        FrameError for an envelope no member of the job sends."""
        if len(head) <= ENVELOPE.size:
            raise FrameError(f"relay envelope of {len(head)} bytes holds no frame")
        _mark, origin, dst = ENVELOPE.unpack_from(head)
        host, inner_head = self.host, head[ENVELOPE.size:]
        size = len(head) + (0 if payload is None else len(payload))
        if dst == host.rank:
            addr = host.addresses.get(origin)
            if origin == src or not host.knows(origin) or addr is None or connectable(host.me, addr):
                # dropped, not a closed connection: a member's address book may lag behind a join
                self._drop(f"rank {src} relayed a frame from rank {origin}, which is not a rank this one can only "
                           f"reach through a relay")
                return
            self.counters.received_frames += 1
            self.counters.received_bytes += size
            host.deliver(origin, inner_head, payload)
            return
        if origin != src:
            raise FrameError(f"rank {src} asks to relay a frame from rank {origin}: a relay carries only the "
                             f"frames of the rank that sends them")
        if not host.knows(src):
            raise FrameError(f"rank {src} is not a rank of this job yet: relays are for members only")
        inner = decode_header(inner_head, payload)  # checked here too: a relay carries only frames
        if inner.src != origin:
            raise FrameError(f"rank {src} asks to relay a frame that says it is from rank {inner.src}")
        addr = host.addresses.get(dst)
        if dst == src or addr is None or not host.knows(dst) or not connectable(host.me, addr):
            self._drop(f"rank {src} asked to relay to rank {dst}, which this rank has no connection with")
            return
        backlog = host.backlog_bytes(dst)
        if backlog and backlog + size > RELAY_BACKLOG_BYTES:
            self._drop(f"rank {dst} has {backlog} bytes from here not acknowledged (relays hold at most "
                       f"{RELAY_BACKLOG_BYTES})")
            return
        self.counters.forwarded_frames += 1
        self.counters.forwarded_bytes += size
        host.push(dst, Relayed(kind=inner.kind, src=origin, epoch=inner.epoch, payload=payload, dst=dst,
                               head=head))

    def _drop(self, why: str) -> None:
        if why not in self._logged and len(self._logged) < 64:  # once per reason: a flood must not flood the log
            self._logged.add(why)
            log.warning("rank %d: relay dropped a frame: %s", self.host.rank, why)
        self.counters.dropped += 1
        self.counters.last_drop = why


def relay_order(addresses: dict[int, Address], a: int, b: int) -> tuple[int, ...]:
    """The ranks that both `a` and `b` can connect with, public ones first, each group rotated
    by a + b; the same list for (a, b) and (b, a), so both directions of a pair take one relay
    while it is up."""
    if a not in addresses or b not in addresses:
        return ()
    both = sorted(r for r, addr in addresses.items() if r not in (a, b) and r >= 0
                  and connectable(addr, addresses[a]) and connectable(addr, addresses[b]))
    public = [r for r in both if addresses[r].listed and not addresses[r].behind]
    sited = [r for r in both if r not in public]
    out: list[int] = []
    for group in (public, sited):
        if group:
            k = (a + b) % len(group)
            out += group[k:] + group[:k]
    return tuple(out)
