"""What an outsider's TLS handshake flood and a key holder's flood of proven connections can
take from a worker (docs/security.md): each attacker is a process of its own, the job runs in
this one, and every step of the job stays exact."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fttree import FTTreeAllreduce
from fttree.net import certs
from fttree.net import handshake as hs
from fttree.net.address import parse_address
from fttree.net.credentials import write_key
from fttree.net.tcp import MEMBER_HOST_HANDSHAKES, PER_HOST_HANDSHAKES, UNKNOWN_UNFINISHED_BYTES, TcpTransport

from .conftest import cluster, exact_steps
from .rawpeer import read_frame_head

HERE = Path(__file__).resolve().parent
FLOODER = HERE / "tls_flooder.py"
HOLDER = HERE / "proven_holder.py"


def tcp(handle: FTTreeAllreduce) -> TcpTransport:
    """The handle's TcpTransport (under the fault layer)."""
    transport = getattr(handle.transport, "inner", handle.transport)
    assert isinstance(transport, TcpTransport)
    return transport


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


def member_hello_s(target: str, tls_dir: Path | None, rank: int, job: str, limit_s: float = 15.0) -> float:
    """How long rank `rank`'s new connection to `target` takes to be answered: TCP connect
    from the rank's own address, the TLS handshake with its certificate (if `tls_dir`), its
    HELLO and the worker's CHALLENGE. `limit_s` (or more) if it is not answered that soon."""
    host, port = target.rsplit(":", 1)
    ctx = None
    if tls_dir is not None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls_dir / "ca.pem"))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(tls_dir / f"rank-{rank}.pem"), str(tls_dir / f"rank-{rank}.key"))
    start = time.monotonic()
    try:
        raw = socket.create_connection((host, int(port)), timeout=limit_s, source_address=(f"127.0.0.{rank + 1}", 0))
    except OSError:
        return max(limit_s, time.monotonic() - start)
    try:
        raw.settimeout(max(0.1, limit_s - (time.monotonic() - start)))
        sock = raw if ctx is None else ctx.wrap_socket(raw, server_hostname="fttree")
        sock.sendall(hs.encode(hs.Hello(src=rank, dst=0, world=3, channel=hs.CONTROL, address="", job=job,
                                        nonce=hs.new_nonce())))
        head = read_frame_head(sock)
        if head is None or not isinstance(hs.decode(head), hs.Challenge):
            return max(limit_s, time.monotonic() - start)
        return time.monotonic() - start
    except (OSError, ssl.SSLError):
        return max(limit_s, time.monotonic() - start)
    finally:
        raw.close()


def redial_s(handle: FTTreeAllreduce, peer: int, limit_s: float = 15.0) -> float:
    """Cut `handle`'s control connection to `peer` and time its own redial (TCP, TLS and the
    fttree handshake) until the new connection is up."""
    loop = handle._loop
    assert loop is not None
    transport = tcp(handle)

    async def cut_and_wait() -> float:
        channel = transport._out[peer].control
        old = channel.writer
        assert old is not None
        start = time.monotonic()
        old.transport.abort()
        while channel.writer is None or channel.writer is old:
            if time.monotonic() - start > limit_s:
                return limit_s
            await asyncio.sleep(0.01)
        return time.monotonic() - start

    return asyncio.run_coroutine_threadsafe(cut_and_wait(), loop).result(limit_s + 5)


def reconnect_during_flood(handles: list[FTTreeAllreduce], mode: str, tls_dir: Path | None, hold_s: float) -> None:
    """Run tls_flooder.py (1,000 connections in `mode`, held `hold_s`) against rank 0 while the
    job runs: a member's new connection is answered, and rank 1's own redial is up, within
    2 s; rank 0's open files and memory stay bounded, and every step is exact."""
    exact_steps(handles, 5)
    target = str(handles[0].peers[0])
    fds_before, rss_before = open_fds(), rss_mb()
    flooder = subprocess.Popen([sys.executable, str(FLOODER), "--target", target, "--count", "1000",
                                "--mode", mode, "--hold", str(hold_s)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None
        assert json.loads(flooder.stdout.readline()) == {"ready": True}
        time.sleep(2.0)  # the flood fills whatever it can fill
        fds_peak, rss_peak = open_fds(), rss_mb()
        redial = redial_s(handles[1], peer=0)
        exact_steps(handles, 2)
        hello_s = [member_hello_s(target, tls_dir, 2, handles[0].credentials.job) for _ in range(3)]
        exact_steps(handles, 2)
        fds_peak, rss_peak = max(fds_peak, open_fds()), max(rss_peak, rss_mb())
        print(f"member HELLO answered in {[round(s, 3) for s in hello_s]} s, rank 1 redialled in "
              f"{redial:.3f} s; open files {fds_before} -> {fds_peak}, RSS {rss_before:.0f} -> {rss_peak:.0f} MB")
        out, err = flooder.communicate(timeout=60)
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait()
    assert flooder.returncode == 0, err
    print(out.strip())
    assert max(hello_s) < 2.0, hello_s
    assert redial < 2.0, redial
    assert fds_peak - fds_before < 200, (fds_before, fds_peak)
    assert rss_peak - rss_before < 50, (rss_before, rss_peak)
    exact_steps(handles, 3)


def test_a_member_reconnects_within_2_s_during_a_tls_handshake_flood(tmp_path: Path) -> None:
    """1,000 stalled TLS handshakes (a partial ClientHello each, from 16 outsider addresses,
    opened again as the worker closes them) while the job runs: a member's new connection is
    answered, and rank 1's own redial is up, within 2 s; the worker's open files and memory
    stay bounded, and every step is exact."""
    certs.make(tmp_path / "tls", range(3))
    with cluster(3, tls_dir=str(tmp_path / "tls"), timeout_s=0.3, step_timeout_s=20) as handles:
        reconnect_during_flood(handles, "partial", tmp_path / "tls", hold_s=12)


def run_holder(handles: list[FTTreeAllreduce], key: Path, *args: str,
               sample: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run proven_holder.py against rank 0 with `args` while the job steps (`sample` after each
    step, every step exact): its JSON report."""
    holder = subprocess.Popen([sys.executable, str(HOLDER), "--target", str(handles[0].peers[0]), "--key-file",
                               str(key), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while holder.poll() is None:
            exact_steps(handles, 1)
            sample()
            time.sleep(0.05)
        out, err = holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert holder.returncode == 0, err
    report: dict[str, Any] = json.loads(out)
    return report


def test_a_key_holder_cannot_open_unbounded_proven_connections(tmp_path: Path) -> None:
    """A key holder opens 400 proven connections as ranks 100 to 499 (each naming an address)
    against a running 3-worker job: rank 0 keeps at most a few of them (unknown ranks are
    capped), its open files grow by fewer than 40 and its memory by under 50 MB, every step
    is exact, and its open files and address table are back to where they were once the
    attacker is gone."""
    key = write_key(tmp_path / "job.key")
    with cluster(3, auth_key_file=str(key), timeout_s=0.3, step_timeout_s=20) as handles:
        exact_steps(handles, 5)
        transport = tcp(handles[0])
        known = sorted(transport.addresses)
        fds_before, rss_before = open_fds(), rss_mb()
        peaks = [fds_before, rss_before]

        def sample() -> None:
            peaks[:] = max(peaks[0], open_fds()), max(peaks[1], rss_mb())

        report = run_holder(handles, key, "--first", "100", "--count", "400", "--hold", "4", sample=sample)
        fds_peak, rss_peak = peaks
        print(f"{report}; open files {fds_before} -> {fds_peak}, RSS {rss_before:.0f} -> {rss_peak:.0f} MB")
        assert report["proven"] + report["refused"] == 400, report
        assert report["kept"] <= 8, report  # 4 unknown ranks at once, on one channel each
        assert fds_peak - fds_before < 40, (fds_before, fds_peak)
        assert rss_peak - rss_before < 50, (rss_before, rss_peak)
        exact_steps(handles, 3)
        deadline = time.monotonic() + 10
        while open_fds() > fds_before and time.monotonic() < deadline:
            exact_steps(handles, 1)
            time.sleep(0.1)
        assert open_fds() <= fds_before, (fds_before, open_fds())
        assert sorted(transport.addresses) == known


def test_an_unknown_rank_that_stays_silent_is_let_go(tmp_path: Path) -> None:
    """Proven connections of ranks the worker does not know are closed after `idle_unknown_s`
    without a frame, so 4 silent ones cannot keep a joiner out for good: afterwards another
    unknown rank is let in."""
    key = write_key(tmp_path / "job.key")
    with cluster(3, auth_key_file=str(key), timeout_s=0.3, step_timeout_s=20) as handles:
        exact_steps(handles, 2)
        transport = tcp(handles[0])
        transport.idle_unknown_s = 1.5
        report = run_holder(handles, key, "--first", "200", "--count", "6", "--hold", "4", "--then", "300")
        assert report["proven"] == 4, report
        assert report["refused"] == 2, report
        assert report["closed_while_held"] == 4, report  # idle: let go
        assert report["then"] == "answered", report  # room again for a rank not known yet
        exact_steps(handles, 2)


def test_a_member_reconnects_within_2_s_during_a_flood_of_silent_connections(tmp_path: Path) -> None:
    """The same with a job key and no TLS: 1,000 connections from 16 outsider addresses that
    send nothing (opened again as the worker closes them) fill no member's place: a member's
    HELLO is answered, and rank 1's redial is up, within 2 s, and every step is exact."""
    key = write_key(tmp_path / "job.key")
    with cluster(3, auth_key_file=str(key), timeout_s=0.3, step_timeout_s=20) as handles:
        reconnect_during_flood(handles, "silent", None, hold_s=10)


def test_places_before_the_proof_follow_the_address_table() -> None:
    """Members' addresses get MEMBER_HOST_HANDSHAKES places per rank listening there (eight
    ranks on one machine all redial at once), any other address PER_HOST_HANDSHAKES; a rank
    only its own HELLO named is no member until the group tells of it, nor known."""
    peers = [parse_address(a) for a in ("127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002", "[::1]:7003")]
    t = TcpTransport(0, peers)
    assert t.handshake_cap("127.0.0.1") == 2 * MEMBER_HOST_HANDSHAKES
    assert t.handshake_cap("::1") == MEMBER_HOST_HANDSHAKES
    assert t.handshake_cap("127.0.0.9") == PER_HOST_HANDSHAKES
    t.learn_from_hello(9, parse_address("127.0.0.9:7009"))
    assert not t.knows(9)
    assert t.handshake_cap("127.0.0.9") == MEMBER_HOST_HANDSHAKES  # where it listens, while it is connected
    t.inbound_gone(9)
    assert 9 not in t.addresses
    assert t.handshake_cap("127.0.0.9") == PER_HOST_HANDSHAKES
    t.learn_from_hello(9, parse_address("127.0.0.9:7009"))
    t.add_peer(9, parse_address("127.0.0.9:7009"))  # the group's word: a rank of the job
    assert t.knows(9)
    t.inbound_gone(9)
    assert 9 in t.addresses


def test_a_key_holder_cannot_make_a_worker_hold_unfinished_payloads_of_invented_ranks(tmp_path: Path) -> None:
    """A key holder proves 4 ranks the job does not have (1000-1003) and starts a 40 MiB frame
    on each, sending 30 MiB of it and never the rest: the worker keeps at most
    UNKNOWN_UNFINISHED_BYTES of such frames (one here), refuses the others by name, and its
    memory grows by less than 100 MB; every step stays exact, and the bytes are released
    when the attacker goes."""
    key = write_key(tmp_path / "job.key")
    with cluster(3, auth_key_file=str(key), timeout_s=0.3, step_timeout_s=20) as handles:
        exact_steps(handles, 3)
        transport = tcp(handles[0])
        refusals_before, rss_before = transport.refusals, rss_mb()
        peaks = [rss_before, 0]

        def sample() -> None:
            peaks[:] = max(peaks[0], rss_mb()), max(peaks[1], transport.unknown_unfinished)

        report = run_holder(handles, key, "--first", "1000", "--count", "4", "--hold", "2", "--payload-mib", "30",
                            "--announce-mib", "40", sample=sample)
        rss_peak, held_peak = peaks
        print(f"{report}; unfinished bytes held at most {held_peak}, RSS {rss_before:.0f} -> {rss_peak:.0f} MB")
        assert report["proven"] == 4, report
        assert report["sent_mib_kept"] <= UNKNOWN_UNFINISHED_BYTES >> 20, report
        assert held_peak <= UNKNOWN_UNFINISHED_BYTES
        assert transport.refusals - refusals_before >= 3  # 40 + 40 MiB would pass the 64 MiB bound
        assert "unfinished payloads" in transport.last_frame_error
        assert rss_peak - rss_before < 100, (rss_before, rss_peak)
        exact_steps(handles, 2)
        deadline = time.monotonic() + 10
        while transport.unknown_unfinished and time.monotonic() < deadline:
            exact_steps(handles, 1)
        assert transport.unknown_unfinished == 0
