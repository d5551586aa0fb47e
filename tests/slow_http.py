"""A slowloris against a worker's status port (tests/test_status_flood.py), run as its own process:

    python tests/slow_http.py --target 127.0.0.1:PORT --count 400 --hold 10 [--body]

It opens `count` connections at once (waiting up to 5 s for them to connect), sends each the
first lines of a request (never the blank line that ends the headers), then for `hold` seconds
adds one more header line to every connection still open, every half second, as a slowloris
does to look alive. With --body it sends whole headers of a POST /faults instead, announcing a
1,000-byte body, and trickles the body a byte at a time. It prints "sent" once the first bytes
are out, then one JSON line: how many connections it made, how many the worker closed, how
many were still open at the end, the longest time one of them stayed open (from when its first
bytes were sent), and the status codes of what the worker answered before closing (`answers`).
"""

from __future__ import annotations

import argparse
import json
import resource
import select
import socket
import sys
import time

PARTIAL = b"GET /status HTTP/1.1\r\nHost: fttree\r\nUser-Agent: slow\r\n"
TRICKLE = b"X-Slow: 1\r\n"
POST = b"POST /faults HTTP/1.1\r\nHost: fttree\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\n"


def closed(sock: socket.socket, got: dict[socket.socket, bytes]) -> bool:
    """True if the worker has closed (or reset) this connection; what it sent is kept in `got`."""
    try:
        while data := sock.recv(4096):
            got[sock] = got.get(sock, b"") + data
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--hold", type=float, default=10.0)
    ap.add_argument("--source", default="127.0.0.100")
    ap.add_argument("--body", action="store_true", help="whole headers, then a body a byte at a time")
    args = ap.parse_args()
    first, more = (POST, b"c") if args.body else (PARTIAL, TRICKLE)
    host, port = args.target.rsplit(":", 1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.count + 256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    socks = []
    for _ in range(args.count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((args.source, 0))
        sock.connect_ex((host, int(port)))
        socks.append(sock)
    pending = select.poll()
    for sock in socks:
        pending.register(sock, select.POLLOUT)
    waiting, until = len(socks), time.monotonic() + 5.0
    while waiting and time.monotonic() < until:  # connects beyond the listen backlog are retried by the kernel
        for fd, _ in pending.poll(100):
            pending.unregister(fd)
            waiting -= 1
    sent_at: dict[socket.socket, float] = {}
    for sock in socks:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
            continue
        try:
            sock.send(first)
        except OSError:
            continue
        sent_at[sock] = time.monotonic()
    print("sent", flush=True)
    got: dict[socket.socket, bytes] = {}
    lifetimes: list[float] = []
    live = dict(sent_at)
    end = time.monotonic() + args.hold
    while live and time.monotonic() < end:
        time.sleep(0.5)
        for sock, t0 in list(live.items()):
            gone = closed(sock, got)
            if not gone:
                try:
                    sock.send(more)
                except OSError:
                    gone = True
            if gone:
                lifetimes.append(time.monotonic() - t0)
                del live[sock]
    now = time.monotonic()
    longest = max([*lifetimes, *(now - t0 for t0 in live.values())], default=0.0)
    answers: dict[str, int] = {}
    for data in got.values():
        code = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.") else "other"
        answers[code] = answers.get(code, 0) + 1
    for sock in socks:
        sock.close()
    print(json.dumps({"opened": args.count, "connected": len(sent_at), "closed_by_worker": len(lifetimes),
                      "still_open": len(live), "longest_s": round(longest, 2), "answers": answers}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
