"""A peer made of a bare socket, for tests that play a broken or hostile worker: it speaks the
handshake (net/handshake.py) with whatever key it is given, then sends any bytes."""

from __future__ import annotations

import socket

from fttree.core.messages import PREFIX, Message, decode_prefix, encode
from fttree.net import handshake as hs


def hello_frame(src: int, dst: int = 0, world: int = 3, *, key: bytes = b"", channel: int = hs.CONTROL,
                address: str = "", nonce: bytes = b"\0" * hs.NONCE_BYTES) -> tuple[hs.Hello, bytes]:
    hello = hs.Hello(src=src, dst=dst, world=world, channel=channel, address=address, job=hs.job_id(key),
                     nonce=nonce)
    return hello, hs.encode(hello)


def message_frame(msg: Message) -> bytes:
    return b"".join(bytes(b) for b in encode(msg))


def connect(host: str, port: int, source: str = "127.0.0.100", timeout_s: float = 10.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s, source_address=(source, 0))
    sock.settimeout(timeout_s)
    return sock


def read_frame_head(sock: socket.socket) -> bytes | None:
    """The next frame's header (handshake frames carry no payload), or None at end of stream."""
    prefix = _read(sock, PREFIX.size)
    if prefix is None:
        return None
    head_len, _payload = decode_prefix(prefix)
    return _read(sock, head_len)


def _read(sock: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        try:
            got = sock.recv(n - len(out))
        except (ConnectionResetError, TimeoutError):
            return None
        if not got:
            return None
        out += got
    return out


def handshake(sock: socket.socket, src: int, dst: int = 0, world: int = 3, *, key: bytes = b"",
              channel: int = hs.CONTROL, address: str = "") -> bool:
    """Open as rank `src` and prove `key`; True if the worker took the proof (it closes the
    connection on a bad one, which shows on the next read)."""
    hello, frame = hello_frame(src, dst, world, key=key, channel=channel, address=address, nonce=hs.new_nonce())
    sock.sendall(frame)
    head = read_frame_head(sock)
    if head is None:
        return False
    challenge = hs.decode(head)
    assert isinstance(challenge, hs.Challenge)
    sock.sendall(hs.encode(hs.Proof(src=src, mac=hs.dial_mac(key, hello, challenge.nonce))))
    return True


def closed_by_peer(sock: socket.socket) -> bool:
    """Wait for the worker to close the connection (True), or for the timeout (False)."""
    try:
        while True:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
