"""An outsider: a process that reaches the workers' ports but holds no key of the job.

    python tests/attacker.py --targets 127.0.0.1:P,127.0.0.2:P,... --job JOBID [--source ADDR] [--rounds N]

It tries, round after round, what an attacker would: garbage, protocol frames with no
handshake (a JOIN, a view commit, a suspicion, a "still computing", a LEAVE, a state request,
data and an abort, claiming members' ranks and an unknown one), a HELLO of no job, a HELLO with
the job's id (which travels in clear) followed by a made-up proof and forged frames, a flood of
connections announcing gigabyte payloads, and connections that never speak. It prints one JSON line: what
it tried, and every connection the workers left open when they should have closed it
(`not_closed`), and whether any of them ever answered a frame past the handshake.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from fttree.core.admission import Query
from fttree.core.messages import PREFIX, VERSION, Agreement, Detection, Join, Kind, Message, Notice, State, encode
from fttree.net import handshake as hs

FORGED = [
    Join(kind=Kind.JOIN, src=1, query=Query.ADMIT_ME, incarnation=99, addresses=((1, "127.0.0.100:1"),)),
    Join(kind=Kind.JOIN, src=1000, query=Query.ADMIT_ME, incarnation=1, addresses=((1000, "127.0.0.100:1"),)),
    Agreement(kind=Kind.VIEW_COMMIT, src=1000, epoch=0, proposed=1, members=(0, 1), ballot=1 << 30),
    Detection(kind=Kind.SUSPECT, src=0, target=2, gone=True),
    Detection(kind=Kind.COMPUTING, src=2, step=0),  # would put off every step deadline for submit_wait_s
    Agreement(kind=Kind.MINORITY, src=1000, promised=(1000,), view_size=3),
    Notice(kind=Kind.LEAVE, src=2),
    State(kind=Kind.STATE_REQUEST, src=1, user_step=0),
    Message(kind=Kind.ABORT, src=0, step=0, reason="forged", code=1),
]


# How long a connection the workers should close may take to be closed. They close at once (a
# bad frame) or at their handshake deadline (a silent peer), but on a loaded machine their event
# loop can be seconds late; the wait tells "never closed" from "closed late", and the report's
# `slowest_close_s` says how late the latest was. A pass waits only as long as the closes take.
CLOSE_WAIT_S = 30.0


def frames() -> list[bytes]:
    out = [b"".join(bytes(b) for b in encode(m)) for m in FORGED]
    data = Message(kind=Kind.DATA_REDUCE, src=1, origin=1, step=0, contributors=(1,), dtype="<f4", numel=4,
                   payload=bytes(16))
    out.append(b"".join(bytes(b) for b in encode(data)))
    return out


class Outsider:
    def __init__(self, targets: list[tuple[str, int]], source: str, job: str) -> None:
        self.targets, self.source, self.job = targets, source, job
        self.tried: dict[str, int] = {}
        self.not_closed: list[str] = []
        self.answered_after_handshake = 0
        self.challenges = 0
        self.slowest_close_s = 0.0

    def _connect(self, target: tuple[str, int], source: str | None = None) -> socket.socket | None:
        try:
            sock = socket.create_connection(target, timeout=5, source_address=(source or self.source, 0))
        except OSError:
            return None
        sock.settimeout(CLOSE_WAIT_S)
        return sock

    def _closed(self, sock: socket.socket, what: str) -> None:
        """Wait for the worker to close `sock` (up to the socket's timeout); note it if it does not."""
        waited = time.monotonic()
        try:
            while True:
                got = sock.recv(65536)
                if not got:
                    break
                self.answered_after_handshake += 1
        except (ConnectionResetError, BrokenPipeError):
            pass
        except TimeoutError:
            self.not_closed.append(what)
        finally:
            sock.close()
            self.slowest_close_s = max(self.slowest_close_s, time.monotonic() - waited)

    def _count(self, what: str) -> None:
        self.tried[what] = self.tried.get(what, 0) + 1

    def garbage(self, target: tuple[str, int]) -> None:
        sock = self._connect(target)
        if sock is not None:
            self._count("garbage")
            with contextlib.suppress(OSError):
                sock.sendall(os.urandom(4096))
            self._closed(sock, "garbage")

    def forged_without_handshake(self, target: tuple[str, int], source: str | None = None) -> None:
        for frame in frames():
            sock = self._connect(target, source)
            if sock is None:
                continue
            self._count("forged frame, no handshake" + (" (member's source address)" if source else ""))
            with contextlib.suppress(OSError):
                sock.sendall(frame)
            self._closed(sock, "forged frame")

    def hello(self, target: tuple[str, int], job: str, rank: int, dst: int) -> None:
        """A HELLO (of no job, or of the job's id seen on the wire), a made-up proof, forged frames."""
        sock = self._connect(target)
        if sock is None:
            return
        self._count(f"hello of job {job or 'none'}")
        hello = hs.Hello(src=rank, dst=dst, world=3, channel=hs.CONTROL, address="127.0.0.100:1", job=job,
                         nonce=hs.new_nonce())
        try:
            sock.sendall(hs.encode(hello))
            head = _read_head(sock)
            if head is not None:
                self.challenges += 1
                sock.sendall(hs.encode(hs.Proof(src=rank, mac=os.urandom(hs.MAC_BYTES))))
                for frame in frames():
                    sock.sendall(frame)
        except OSError:
            pass
        self._closed(sock, f"hello of job {job or 'none'}")

    def flood(self, target: tuple[str, int], n: int) -> None:
        """Connections announcing 1 GiB payloads before any handshake."""
        socks = [s for s in (self._connect(target) for _ in range(n)) if s is not None]
        big = PREFIX.pack(b"FT", VERSION, 16, 1 << 30) + bytes(16)
        for s in socks:
            self._count("flood: 1 GiB announced")
            with contextlib.suppress(OSError):
                s.sendall(big + os.urandom(60_000))
        for s in socks:
            self._closed(s, "flood")

    def idle(self, target: tuple[str, int], n: int, wait_s: float) -> None:
        """Connections that never speak: each must be closed by the handshake deadline."""
        socks = [s for s in (self._connect(target) for _ in range(n)) if s is not None]
        for s in socks:
            self._count("idle connection")
            s.settimeout(wait_s)
        for s in socks:
            self._closed(s, "idle connection")


def _read_head(sock: socket.socket) -> bytes | None:
    raw = b""
    while len(raw) < PREFIX.size:
        got = sock.recv(PREFIX.size - len(raw))
        if not got:
            return None
        raw += got
    head_len = PREFIX.unpack(raw)[2]
    head = b""
    while len(head) < head_len:
        got = sock.recv(head_len - len(head))
        if not got:
            return None
        head += got
    return head


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", required=True)
    p.add_argument("--job", required=True, help="the job id, as seen in a HELLO on the wire")
    p.add_argument("--source", default="127.0.0.100")
    p.add_argument("--member-source", default="127.0.0.2", help="a member's address, to forge the source")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--idle-wait", type=float, default=CLOSE_WAIT_S,
                   help="how long a connection that never speaks may stay open")
    args = p.parse_args()
    targets = [(h, int(port)) for h, port in (t.rsplit(":", 1) for t in args.targets.split(","))]
    o = Outsider(targets, args.source, args.job)
    started = time.monotonic()
    for _ in range(args.rounds):
        for i, target in enumerate(targets):
            o.garbage(target)
            o.forged_without_handshake(target)
            o.forged_without_handshake(target, source=args.member_source)
            o.hello(target, "", rank=(i + 1) % len(targets), dst=i)
            o.hello(target, args.job, rank=(i + 1) % len(targets), dst=i)
            o.hello(target, args.job, rank=1000, dst=i)
            o.flood(target, 40)
    for target in targets:
        o.idle(target, 30, args.idle_wait)
    print(json.dumps({"tried": o.tried, "not_closed": o.not_closed, "challenges": o.challenges,
                      "answered_after_handshake": o.answered_after_handshake,
                      "slowest_close_s": round(o.slowest_close_s, 2),
                      "seconds": round(time.monotonic() - started, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
