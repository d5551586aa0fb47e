"""A key holder that opens proven connections as ranks the job does not have
(tests/test_hardening_transport.py): `--count` connections as ranks `--first` and up, each
proving the job's key on the control channel and naming an address, all held open for
`--hold` seconds; with `--then R`, one more as rank R afterwards. Prints one JSON line:
proven (the worker took the proof and kept the connection a moment), refused, kept (still
open at the end of the hold), closed_while_held, and `then` ("answered" or "refused")."""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--first", type=int, default=100)
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--hold", type=float, default=4.0)
    ap.add_argument("--then", type=int, default=-1)
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
