"""TCP hole punching: two hosts behind NATs connect by both dialling each other at once.

Neither can be dialled: each NAT drops a connection that starts outside. But a NAT lets in
what answers a connection that started inside, so when each host dials the other's public
(post-NAT) address from the local port whose mapping the other learnt, the first SYN out
opens its own NAT for the other's SYN, which then meets a socket that is itself connecting
(SYN_SENT): TCP's simultaneous open, and both connect() calls return the same connection.

Works where the NAT keeps a connection's source port, or maps a local port to one public port
whatever the destination (endpoint-independent mapping): the port a third host observed is
then the one the peer's SYN must reach. A NAT that picks a new port per connection (Linux
MASQUERADE --random-fully, most carrier NATs) defeats it: the peer dials a port nobody holds.
The measured rates through Linux NAT are in docs/nat.md; the caller keeps its relay for a
punch that fails.

Only the sockets here: who learns what and when to dial is punch.py's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from dataclasses import dataclass

RETRY_PAUSE_S = 0.05  # after a refused or reset attempt (the peer's SYN came before its socket was connecting)


def reusable_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket bound to host:port (port 0: a fresh one) that other sockets
    may bind to as well: the probe that shows a third host the port's mapping and each
    attempt to punch leave from the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True, slots=True)
class PunchResult:
    """How a punch ended: the connected socket, or None and why not."""

    sock: socket.socket | None
    attempts: int  # connect() calls made
    elapsed_s: float
    why: str = ""  # "" when connected

    @property
    def ok(self) -> bool:
        return self.sock is not None


async def simultaneous_open(local: tuple[str, int], remote: tuple[str, int], deadline_s: float) -> PunchResult:
    """Dial `remote` from `local` (a port bound with reuse) until a connection forms or
    `deadline_s` passes. One connect() waits for the whole deadline, as a SYN the peer's NAT
    dropped leaves the socket connecting, and the peer's SYN arriving meanwhile completes it;
    a refusal (the peer's host answered before its socket was connecting) is tried again."""
    if deadline_s <= 0:
        raise ValueError(f"a punch needs a deadline above 0 s, got {deadline_s:g}")
    loop = asyncio.get_running_loop()
    start = loop.time()
    attempts, why = 0, ""
    while True:
        left = deadline_s - (loop.time() - start)
        if left <= 0:
            return PunchResult(None, attempts, loop.time() - start,
                               f"no connection to {remote[0]}:{remote[1]} within {deadline_s:g} s"
                               + (f" (last: {why})" if why else ""))
        try:
            sock = reusable_socket(*local)
        except OSError as exc:
            return PunchResult(None, attempts, loop.time() - start,
                               f"cannot bind {local[0]}:{local[1]}: {exc.strerror or exc}")
        attempts += 1
        try:
            await asyncio.wait_for(loop.sock_connect(sock, remote), left)
        except TimeoutError:
            sock.close()
            continue
        except OSError as exc:
            sock.close()
            why = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.sleep(min(RETRY_PAUSE_S, max(0.0, deadline_s - (loop.time() - start))))
            continue
        return PunchResult(sock, attempts, loop.time() - start)
