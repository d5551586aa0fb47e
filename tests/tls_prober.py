"""A process that tries a TLS job's ports as an outsider would (tests/test_tls.py): in clear,
with a certificate of another job's CA, with none, and with a member's certificate claiming
another rank. Prints one JSON line: what each try got back."""

from __future__ import annotations

import argparse
import json
import resource
import socket
import ssl
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fttree.net import handshake as hs
from tests.rawpeer import closed_by_peer, hello_frame, read_frame_head


def tls_client(ca: Path, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the prober does not care who answers; the worker must care who calls
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def try_tls(host: str, port: int, ctx: ssl.SSLContext, src: int, job: str) -> str:
    """'refused' if the worker ends the TLS handshake or closes after our HELLO without a
    challenge; 'answered' if it sent anything back."""
    raw = socket.create_connection((host, port), timeout=10, source_address=("127.0.0.100", 0))
    try:
        sock = ctx.wrap_socket(raw, server_hostname="fttree")
        sock.settimeout(10)
        sock.sendall(hs.encode(hs.Hello(src=src, dst=0, world=3, channel=hs.CONTROL, address="", job=job,
                                        nonce=hs.new_nonce())))
        return "refused" if read_frame_head(sock) is None else "answered"
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return "refused"
    finally:
        raw.close()


def try_clear(host: str, port: int) -> str:
    sock = socket.create_connection((host, port), timeout=10, source_address=("127.0.0.100", 0))
    try:
        _, frame = hello_frame(1, dst=0, world=3)
        sock.sendall(frame)
        return "refused" if closed_by_peer(sock) else "kept open"
    finally:
        sock.close()


def flood(host: str, port: int, count: int, hold_s: float) -> dict[str, int]:
    """`count` connections opened at once (non-blocking), each sending the first bytes of a
    TLS ClientHello and then nothing, held for `hold_s`: what a worker answers is its memory."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (count + 256, count + 256))
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind(("127.0.0.100", 0))
        sock.connect_ex((host, port))
        socks.append(sock)
    time.sleep(1.0)  # the attacker's own pace: let the kernel finish what connects it will
    sent = 0
    for sock in socks:
        try:
            sock.send(b"\x16\x03\x01\x00")
            sent += 1
        except OSError:
            pass
    time.sleep(hold_s)
    for sock in socks:
        sock.close()
    return {"opened": count, "sent": sent}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)  # host:port of rank 0
    ap.add_argument("--job-dir", type=Path, required=True)  # the job's certificates (ca.pem, rank-1.*)
    ap.add_argument("--other-dir", type=Path, required=True)  # another job's certificates
    ap.add_argument("--job", required=True)  # the job id its HELLOs name (not a secret)
    ap.add_argument("--flood", type=int, default=0)  # instead: this many idle TLS connections
    ap.add_argument("--hold", type=float, default=5.0)
    args = ap.parse_args()
    host, port = args.target.rsplit(":", 1)
    if args.flood:
        print(json.dumps(flood(host, int(port), args.flood, args.hold)))
        return 0
    job, other, port_n = args.job_dir, args.other_dir, int(port)
    member = tls_client(job / "ca.pem", job / "rank-1.pem", job / "rank-1.key")
    report = {
        "clear": try_clear(host, port_n),
        "no_certificate": try_tls(host, port_n, tls_client(job / "ca.pem", None, None), 1, args.job),
        "other_job": try_tls(host, port_n, tls_client(job / "ca.pem", other / "rank-1.pem", other / "rank-1.key"),
                             1, args.job),
        "rank1_as_rank2": try_tls(host, port_n, member, 2, args.job),
        "rank1_as_itself": try_tls(host, port_n, member, 1, args.job),  # shows that the probe can succeed
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
