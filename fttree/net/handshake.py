"""The handshake every connection opens with: which job, which ranks, and proof of the job's key.

No frame but these is read from a connection before it has proven that it belongs to the job
and which rank it is; from then on the rank is the one proven, never the source address.

    dialer   -> HELLO      job id, its rank, the rank it dials, the channel, where it listens, nonce_d
    acceptor -> CHALLENGE  nonce_a, HMAC(key, "accept" | transcript)   the acceptor holds the key
    dialer   -> PROOF      HMAC(key, "dial" | transcript)               and so does the dialer

The transcript is both nonces with everything the HELLO claims (protocol version, job id, both
ranks, the channel), so an answer recorded on one connection proves nothing on another, and
neither side can be made to prove a rank it does not claim. The job id (derived from the key,
never the key) lets a worker of another job on the same port be named as such, rather than
fail a MAC. Without a key (loopback, or `insecure`) the same frames run with an empty key:
they catch a worker of another job version or a wrong rank, but prove nothing; with TLS the
rank is also read from the peer's certificate (credentials.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

import msgpack

from ..core.messages import MAGIC, PREFIX, VERSION, Kind, unpack_map
from ..errors import FrameError

PROTOCOL = 1  # of the handshake; the frame format has its own VERSION
NONCE_BYTES = 16
MAC_BYTES = 32  # HMAC-SHA256
MAX_HANDSHAKE_BYTES = 1024  # a handshake frame's header; a frame before the proof may be no larger
CONTROL, BULK = 0, 1  # the two connections to a peer (net/tcp.py), as the HELLO names them
# a probe from a port a rank will punch from (net/punch.py): the acceptor answers with the
# address it saw the connection come from and carries nothing else on it
PROBE_CONTROL, PROBE_BULK = 2, 3
CHANNELS = (CONTROL, BULK, PROBE_CONTROL, PROBE_BULK)
CONTACT = -2  # the rank a joiner dials when it knows only an address (whoever listens there)


def job_id(key: bytes) -> str:
    """What names the job in a HELLO: derived from the key, so it reveals nothing of it."""
    return hmac.new(key, b"fttree job id", hashlib.sha256).hexdigest()[:16] if key else ""


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


@dataclass(frozen=True, slots=True)
class Hello:
    """The dialer's opening: who it is, whom it dials, on which channel, where it listens."""

    src: int
    dst: int
    world: int  # the ranks the dialer knows of (a grown group's joiner knows more)
    channel: int  # CONTROL or BULK
    address: str  # where the dialer listens ("host:port"): a rank that joined later may not be known
    job: str
    nonce: bytes
    protocol: int = PROTOCOL


@dataclass(frozen=True, slots=True)
class Challenge:
    """The acceptor's answer: its nonce, and its proof that it holds the key."""

    src: int
    nonce: bytes
    mac: bytes


@dataclass(frozen=True, slots=True)
class Proof:
    """The dialer's proof that it holds the key."""

    src: int
    mac: bytes


Handshake = Hello | Challenge | Proof


def _transcript(hello: Hello, acceptor_nonce: bytes) -> bytes:
    packed: bytes = msgpack.packb([hello.protocol, hello.job, hello.src, hello.dst, hello.channel, hello.nonce,
                                   acceptor_nonce])
    return packed


def accept_mac(key: bytes, hello: Hello, acceptor_nonce: bytes) -> bytes:
    return hmac.new(key, b"accept" + _transcript(hello, acceptor_nonce), hashlib.sha256).digest()


def dial_mac(key: bytes, hello: Hello, acceptor_nonce: bytes) -> bytes:
    return hmac.new(key, b"dial" + _transcript(hello, acceptor_nonce), hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def encode(frame: Handshake) -> bytes:
    """One whole frame (the wire's prefix, a msgpack header, no payload)."""
    match frame:
        case Hello():
            header = {"k": int(Kind.HELLO), "f": frame.src, "to": frame.dst, "w": frame.world, "ch": frame.channel,
                      "ad": frame.address, "jb": frame.job, "nc": frame.nonce, "pv": frame.protocol}
        case Challenge():
            header = {"k": int(Kind.CHALLENGE), "f": frame.src, "nc": frame.nonce, "mac": frame.mac}
        case Proof():
            header = {"k": int(Kind.PROOF), "f": frame.src, "mac": frame.mac}
    head: bytes = msgpack.packb(header)
    return PREFIX.pack(MAGIC, VERSION, len(head), 0) + head


def check_prefix(head_len: int, payload_len: int) -> None:
    """A frame before the proof: a handshake's header, no payload, or FrameError."""
    if payload_len or head_len > MAX_HANDSHAKE_BYTES:
        raise FrameError(f"a frame of {head_len + payload_len} bytes before the handshake finished "
                         f"(only handshake frames of up to {MAX_HANDSHAKE_BYTES} bytes are read then)")


def _field(header: dict[object, object], key: str, kind: type, name: str) -> object:
    value = header.get(key)
    if type(value) is not kind:
        raise FrameError(f"handshake field {name} is missing or not {kind.__name__}")
    return value


def _bytes(header: dict[object, object], key: str, size: int, name: str) -> bytes:
    value = _field(header, key, bytes, name)
    assert isinstance(value, bytes)
    if len(value) != size:
        raise FrameError(f"handshake field {name} has {len(value)} bytes, expected {size}")
    return value


def _int(header: dict[object, object], key: str, name: str) -> int:
    value = _field(header, key, int, name)
    assert isinstance(value, int)
    return value


def _str(header: dict[object, object], key: str, name: str) -> str:
    value = _field(header, key, str, name)
    assert isinstance(value, str)
    return value


def decode(head: bytes) -> Handshake:
    """A handshake frame's header, validated, or FrameError naming what is wrong."""
    header = unpack_map(head, "handshake header")
    kind = header.get("k")
    if kind == Kind.HELLO:
        return Hello(src=_int(header, "f", "src"), dst=_int(header, "to", "dst"), world=_int(header, "w", "world"),
                     channel=_int(header, "ch", "channel"), address=_str(header, "ad", "address"),
                     job=_str(header, "jb", "job"), nonce=_bytes(header, "nc", NONCE_BYTES, "nonce"),
                     protocol=_int(header, "pv", "protocol"))
    if kind == Kind.CHALLENGE:
        return Challenge(src=_int(header, "f", "src"), nonce=_bytes(header, "nc", NONCE_BYTES, "nonce"),
                         mac=_bytes(header, "mac", MAC_BYTES, "mac"))
    if kind == Kind.PROOF:
        return Proof(src=_int(header, "f", "src"), mac=_bytes(header, "mac", MAC_BYTES, "mac"))
    raise FrameError(f"frame of kind {kind!r} before the handshake finished")
