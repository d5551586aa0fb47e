"""Per-rank uplink limits (netem/uplink.sh).

The `realnet` tests need root, network namespaces and tc; they skip with the reason otherwise,
and each works in its own namespace, deleted with everything in it even when the test fails.
Rates are measured with plain sockets between rank addresses inside that namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Iterator

import pytest

from .test_realnet import NS_PREFIX, in_ns, namespaces, netem, realnet_missing, sweep_dead_namespaces

RATE_MBIT = 50


@pytest.fixture
def ns3() -> Iterator[str]:
    """A fresh namespace for 7 ranks; deleted (qdiscs and all) whatever happens."""
    missing = realnet_missing() or tc_missing()
    if missing:
        pytest.skip(missing)
    sweep_dead_namespaces()
    name = f"{NS_PREFIX}{os.getpid()}-uplink"
    try:
        netem("cluster.sh", "up", name, "-n", "7")
        yield name
    finally:
        netem("cluster.sh", "down", name, "--kill", check=False)
    assert name not in namespaces()


def tc_missing() -> str:
    if shutil.which("tc") is None:
        return "the 'tc' command (iproute2) is not installed"
    return ""


# Flows that send as fast as they can from each source address to DST for SECONDS, all at
# once (a barrier starts them); prints a JSON list with each flow's received rate in bit/s.
# The rate counts from 0.25 s after a flow's first byte, so a late-scheduled receiver does
# not count the backlog that piled up meanwhile.
FLOWS = textwrap.dedent("""
    import json, socket, sys, threading, time
    dst, seconds, sources = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    srv = socket.create_server((dst, 0), backlog=len(sources))
    port = srv.getsockname()[1]
    go = threading.Barrier(2 * len(sources))
    rates = [0.0] * len(sources)

    def receive(i, conn):
        with conn:
            go.wait()
            conn.recv(1 << 20)
            first = time.monotonic()
            start, end, got = first + 0.25, first + 0.25 + seconds, 0
            while (now := time.monotonic()) < end:
                conn.settimeout(end - now)
                try:
                    n = len(conn.recv(1 << 20))
                except TimeoutError:
                    break
                if now < start:
                    start = time.monotonic()  # still in the first quarter second: restart the clock
                else:
                    got += n
            rates[i] = got * 8 / (time.monotonic() - start)

    def send(sock):
        chunk = bytes(1 << 20)
        go.wait()
        try:
            while True:
                sock.sendall(chunk)
        except OSError:
            pass  # the receiver closed: done
        finally:
            sock.close()

    threads = []
    for i, src in enumerate(sources):
        c = socket.socket()
        c.bind((src, 0))
        c.connect((dst, port))
        conn, _ = srv.accept()
        threads += [threading.Thread(target=receive, args=(i, conn)), threading.Thread(target=send, args=(c,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(rates))
""")


def flows(ns: str, dst: str, seconds: float, *sources: str) -> list[float]:
    """Mbit/s received from each source (flows run at the same time)."""
    out = in_ns(ns, sys.executable, "-c", FLOWS, dst, str(seconds), *sources)
    return [r / 1e6 for r in json.loads(out.stdout)]


def counters(ns: str) -> dict[int, tuple[str, int]]:
    """rank -> (address, bytes sent) from uplink.sh --counters."""
    out = netem("uplink.sh", "--netns", ns, "--counters").stdout
    rows = [line.split() for line in out.splitlines()]
    return {int(r[0]): (r[1], int(r[3])) for r in rows}


# ---- without root -------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["10xbit"], "RATE must look like 100mbit"),
    (["--ranks", "0", "10mbit"], "--ranks needs a number"),
    (["--ranks"], "--ranks needs a number"),
    (["--port", "80", "10mbit"], "--port is not supported"),
    (["--counters", "10mbit"], "--counters takes no RATE"),
    (["10mbit", "20mbit"], "one RATE"),
    (["--bogus"], "unknown option '--bogus'"),
])
def test_uplink_rejects_bad_input(args: list[str], message: str) -> None:
    out = netem("uplink.sh", *args, check=False)
    assert out.returncode != 0
    assert message in out.stderr


def test_uplink_without_rate_prints_usage() -> None:
    out = netem("uplink.sh", check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("Usage:")


# ---- against the kernel -------------------------------------------------------------------


@pytest.mark.realnet
def test_each_rank_gets_its_own_uplink(ns3: str) -> None:
    out = netem("uplink.sh", "--netns", ns3, "--ranks", "3", f"{RATE_MBIT}mbit")
    assert "ranks 0..2 (127.0.0.1 .. 127.0.0.3)" in out.stdout
    low, high = 0.75 * RATE_MBIT, 1.1 * RATE_MBIT

    # One flow from rank 1 to rank 0: held at the rate.
    (alone,) = flows(ns3, "127.0.0.1", 1.5, "127.0.0.2")
    assert low < alone < high, alone

    # Ranks 1 and 2 at once: each gets its own limit, not half of a shared one.
    both = flows(ns3, "127.0.0.1", 1.5, "127.0.0.2", "127.0.0.3")
    assert all(low < r < high for r in both), both

    # Two flows from rank 2 share rank 2's uplink.
    shared = flows(ns3, "127.0.0.1", 1.5, "127.0.0.3", "127.0.0.3")
    assert low < sum(shared) < high, shared

    # Not limited: a rank talking to itself, and an address that is no rank's (rank 5 of 3).
    self_rate, stranger = flows(ns3, "127.0.0.2", 0.5, "127.0.0.2"), flows(ns3, "127.0.0.1", 0.5, "127.0.0.6")
    assert self_rate[0] > 4 * RATE_MBIT, self_rate
    assert stranger[0] > 4 * RATE_MBIT, stranger

    # The counters: ranks 1 and 2 each sent two measured flows' worth (2 x ~1.75 s at 50 Mbit/s,
    # about 22 MB), rank 0 only acknowledged, and rank 1's GBs to itself are not in its class.
    sent = counters(ns3)
    assert [sent[r][0] for r in range(3)] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert 15e6 < sent[1][1] < 40e6, sent
    assert 15e6 < sent[2][1] < 40e6, sent
    assert sent[0][1] < 0.1 * sent[1][1], sent

    status = netem("status.sh", "--netns", ns3).stdout
    assert "tc lo: htb f7:" in status
    assert "uplink of rank 1 127.0.0.2 50Mbit, sent" in status, status
    assert "1 fttree rules" in status
    assert "1 fttree rules removed" in netem("reset.sh", "--netns", ns3).stdout
    assert "f7:" not in in_ns(ns3, "tc", "qdisc", "show", "dev", "lo").stdout


@pytest.mark.realnet
def test_uplink_replaces_itself_and_removes_only_its_own(ns3: str) -> None:
    netem("uplink.sh", "--netns", ns3, "--ranks", "5", "10mbit")
    netem("uplink.sh", "--netns", ns3, "--ranks", "2", "20mbit")
    assert sorted(counters(ns3)) == [0, 1]  # no class left from the 5-rank run
    assert all(line.split()[2] == "20Mbit" for line in netem("uplink.sh", "--netns", ns3, "--counters").stdout
               .splitlines())
    assert "removed the fttree qdisc" in netem("uplink.sh", "--netns", ns3, "--remove").stdout
    assert "f7:" not in in_ns(ns3, "tc", "qdisc", "show", "dev", "lo").stdout
    assert "no fttree qdisc" in netem("uplink.sh", "--netns", ns3, "--remove").stdout

    # Somebody else's root qdisc is left alone.
    in_ns(ns3, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb")
    out = netem("uplink.sh", "--netns", ns3, "10mbit", check=False)
    assert out.returncode != 0
    assert "that fttree did not install" in out.stderr
    in_ns(ns3, "tc", "qdisc", "del", "dev", "lo", "root")

    # bandwidth.sh's tbf is fttree's but no uplink: uplink.sh says so instead of guessing.
    netem("bandwidth.sh", "--netns", ns3, "100mbit")
    out = netem("uplink.sh", "--netns", ns3, "10mbit", check=False)
    assert out.returncode != 0
    assert "not uplink limits" in out.stderr
