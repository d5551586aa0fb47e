"""An outsider that holds a TLS worker's port busy with stalled handshakes
(tests/test_hardening_transport.py): `--count` connections from `--sources` loopback
addresses (127.0.0.100 and up), each sending nothing (`--mode silent`) or the first bytes of a
ClientHello (`--mode partial`) and then nothing. A connection the worker closes is opened
again (in batches, every 0.1 s), so the flood holds for `--hold` seconds whatever the worker
does. Prints one JSON line: connections opened in all, and how many the worker closed."""

from __future__ import annotations

import argparse
import json
import resource
import selectors
import socket
import sys
import time

PARTIAL_CLIENT_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"  # a record header and the hello's start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--sources", type=int, default=16)
    ap.add_argument("--mode", choices=["silent", "partial"], default="partial")
    ap.add_argument("--hold", type=float, default=10.0)
    args = ap.parse_args()
    host, port_s = args.target.rsplit(":", 1)
    port = int(port_s)
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.count + 512, args.count + 512))
    sel = selectors.DefaultSelector()
    opened = closed = 0
    live: dict[socket.socket, float] = {}

    def open_one(i: int) -> None:
        nonlocal opened
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((f"127.0.0.{100 + i % args.sources}", 0))
        except OSError:
            sock.close()
            return
        sock.connect_ex((host, port))
        opened += 1
        live[sock] = time.monotonic()
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)

    for i in range(args.count):
        open_one(i)
    print(json.dumps({"ready": True}), flush=True)
    end = time.monotonic() + args.hold
    sent: set[socket.socket] = set()
    while time.monotonic() < end:
        for key, events in sel.select(timeout=0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            gone = False
            if events & selectors.EVENT_WRITE and sock not in sent:
                sent.add(sock)
                if args.mode == "partial":
                    try:
                        sock.send(PARTIAL_CLIENT_HELLO)
                    except OSError:
                        gone = True
                if not gone:
                    sel.modify(sock, selectors.EVENT_READ)
            if events & selectors.EVENT_READ and not gone:
                try:
                    gone = not sock.recv(4096)
                except BlockingIOError:
                    pass
                except OSError:
                    gone = True
            if gone:
                sel.unregister(sock)
                sent.discard(sock)
                del live[sock]
                sock.close()
                closed += 1
        for i in range(args.count - len(live)):  # keep the flood at its size
            open_one(i)
    for sock in list(live):
        sock.close()
    print(json.dumps({"opened": opened, "closed_by_worker": closed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
