"""A key holder that opens proven connections as ranks the job does not have
(tests/test_hardening_transport.py): `--count` connections as ranks `--first` and up, each
proving the job's key on the control channel and naming an address, all held open for
`--hold` seconds; with `--then R`, one more as rank R afterwards. Prints one JSON line:
proven (the worker took the proof and kept the connection a moment), refused, kept (still
open at the end of the hold), closed_while_held, and `then` ("answered" or "refused").
With `--payload-mib N`, each proven connection then announces a frame of `--announce-mib` MiB
and sends N MiB of it, never the rest (sent_mib_kept: MiB that went out on connections the
worker kept)."""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fttree.core.messages import MAGIC, PREFIX, VERSION
from fttree.net import handshake as hs
from fttree.net.credentials import Credentials
from tests.rawpeer import connect, handshake


def closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return not sock.recv(4096)
    except BlockingIOError:
        return False
    except OSError:
        return True


def prove(host: str, port: int, key: bytes, rank: int, world: int) -> socket.socket | None:
    """A proven connection as `rank`, or None if the worker refused it at the handshake."""
    try:
        sock = connect(host, port)
    except OSError:
        return None
    try:
        ok = handshake(sock, rank, dst=0, world=world, key=key, channel=hs.CONTROL, address=f"127.0.0.100:{rank + 1}")
    except OSError:
        ok = False
    if not ok:
        sock.close()
        return None
    return sock


def start_payload(sock: socket.socket, announce_mib: int, mib: int) -> int:
    """Announce a frame of `announce_mib` MiB on `sock` and send `mib` MiB of it: the MiB that
    went out before the worker closed the connection."""
    head = b"\x80" * 16  # decoded only once the payload is complete: never
    chunk = bytes(1 << 20)
    sock.setblocking(True)
    sock.settimeout(5.0)
    sent = 0
    try:
        sock.sendall(PREFIX.pack(MAGIC, VERSION, len(head), announce_mib << 20) + head)
        for _ in range(mib):
            sock.sendall(chunk)
            sent += 1
    except OSError:
        pass
    return sent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--first", type=int, default=100)
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--hold", type=float, default=4.0)
    ap.add_argument("--then", type=int, default=-1)
    ap.add_argument("--payload-mib", type=int, default=0)
    ap.add_argument("--announce-mib", type=int, default=255)
    args = ap.parse_args()
    host, port_s = args.target.rsplit(":", 1)
    port = int(port_s)
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.count + 256, args.count + 256))
    key = Credentials.from_key_file(args.key_file).key
    world = args.first + args.count
    socks = [prove(host, port, key, rank, world) for rank in range(args.first, args.first + args.count)]
    time.sleep(0.5)  # a refusal after the proof shows as the worker closing the connection
    held = [s for s in socks if s is not None and not closed(s)]
    for s in socks:
        if s is not None and s not in held:
            s.close()
    report: dict[str, object] = {"proven": len(held), "refused": args.count - len(held)}
    if args.payload_mib:
        sent = [start_payload(s, args.announce_mib, args.payload_mib) for s in held]
        time.sleep(0.5)
        report["sent_mib_kept"] = sum(mib for s, mib in zip(held, sent, strict=True) if not closed(s))
    time.sleep(args.hold)
    still = [s for s in held if not closed(s)]
    report["kept"] = len(still)
    report["closed_while_held"] = len(held) - len(still)
    if args.then >= 0:
        late = prove(host, port, key, args.then, world=args.then + 1)
        if late is not None:
            time.sleep(0.5)
            report["then"] = "refused" if closed(late) else "answered"
            late.close()
        else:
            report["then"] = "refused"
    for s in held:
        s.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
