"""Per-rank downlink limits (netem/downlink.sh): each rank's incoming traffic in its own htb class.

Structured checks, not timed ones: the classes' rates and their byte counters (downlink.sh
--counters, read from `tc -s class show`) after sending known amounts between rank addresses.
The `realnet` tests need root, network namespaces, tc and the ifb module; they skip with the
reason otherwise, and each works in its own namespace, deleted whatever happens.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator

import pytest

from .test_realnet import NS_PREFIX, in_ns, namespaces, netem, realnet_missing, sweep_dead_namespaces
from .test_uplink import tc_missing

# Send NBYTES from SRC to DST over one TCP connection; the receiver reads to the end and
# prints how many bytes it got.
SEND = textwrap.dedent("""
    import socket, sys, threading
    src, dst, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    srv = socket.create_server((dst, 0))
    c = socket.socket()
    c.bind((src, 0))
    c.connect((dst, srv.getsockname()[1]))
    conn, _ = srv.accept()
    got = 0
    def receive():
        global got
        while chunk := conn.recv(1 << 20):
            got += len(chunk)
    t = threading.Thread(target=receive)
    t.start()
    c.sendall(bytes(nbytes))
    c.close()
    t.join()
    print(got)
""")


def send(ns: str, src: str, dst: str, nbytes: int) -> None:
    out = in_ns(ns, sys.executable, "-c", SEND, src, dst, str(nbytes))
    assert int(out.stdout) == nbytes


def counters(ns: str) -> dict[int, tuple[str, str, int]]:
    """rank -> (address, rate, bytes received) from downlink.sh --counters."""
    out = netem("downlink.sh", "--netns", ns, "--counters").stdout
    rows = [line.split() for line in out.splitlines()]
    return {int(r[0]): (r[1], r[2], int(r[3])) for r in rows}


def ifb_missing(ns: str) -> str:
    probe = in_ns(ns, "ip", "link", "add", "fttree-probe", "type", "ifb", check=False)
    if probe.returncode != 0:
        return f"no ifb devices here (modprobe ifb): {probe.stderr.strip()}"
    in_ns(ns, "ip", "link", "del", "fttree-probe")
    return ""


@pytest.fixture
def ns() -> Iterator[str]:
    """A fresh namespace for 3 ranks; deleted (qdiscs, ifb device and all) whatever happens."""
    missing = realnet_missing() or tc_missing()
    if missing:
        pytest.skip(missing)
    sweep_dead_namespaces()
    name = f"{NS_PREFIX}{os.getpid()}-downlink"
    try:
        netem("cluster.sh", "up", name, "-n", "3")
        missing = ifb_missing(name)
        if missing:
            pytest.skip(missing)
        yield name
    finally:
        netem("cluster.sh", "down", name, "--kill", check=False)
    assert name not in namespaces()


# ---- without root -------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["10xbit"], "RATE must look like 100mbit"),
    (["--ranks", "0", "10mbit"], "--ranks needs a number"),
    (["--port", "80", "10mbit"], "--port is not supported"),
    (["--counters", "10mbit"], "--counters takes no RATE"),
    (["--remove", "10mbit"], "--remove takes no RATE"),
    (["10mbit", "20mbit"], "one RATE"),
    (["--bogus"], "unknown option '--bogus'"),
    (["--rank", "3:10mbit", "100mbit"], "--rank needs RANK=RATE"),
])
def test_downlink_rejects_bad_input(args: list[str], message: str) -> None:
    out = netem("downlink.sh", *args, check=False)
    assert out.returncode != 0
    assert message in out.stderr


def test_downlink_without_rate_prints_usage() -> None:
    out = netem("downlink.sh", check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("Usage:")


# ---- against the kernel -------------------------------------------------------------------


@pytest.mark.realnet
def test_each_rank_gets_its_own_downlink_class(ns: str) -> None:
    out = netem("downlink.sh", "--netns", ns, "--ranks", "3", "--rank", "2=20mbit", "200mbit")
    assert "ranks 0..2 (127.0.0.1 .. 127.0.0.3) receive at most 200mbit each, rank 2 20mbit" in out.stdout
    # The ifb device queues as much as lo would (its own default of 32 packets drops bursts).
    assert in_ns(ns, "cat", "/sys/class/net/fttree-dl/tx_queue_len").stdout == \
        in_ns(ns, "cat", "/sys/class/net/lo/tx_queue_len").stdout
    # The limit sits on the class of the rank's DESTINATION address.
    assert {r: c[:2] for r, c in counters(ns).items()} == {
        0: ("127.0.0.1", "200Mbit"), 1: ("127.0.0.2", "200Mbit"), 2: ("127.0.0.3", "20Mbit")}

    # 4 MB from rank 1 to rank 0 and 1 MB from rank 0 to rank 2: each lands in its
    # receiver's class; the sender's class gets only the ACKs.
    send(ns, "127.0.0.2", "127.0.0.1", 4_000_000)
    send(ns, "127.0.0.1", "127.0.0.3", 1_000_000)
    got = {r: c[2] for r, c in counters(ns).items()}
    assert 4_000_000 <= got[0] < 5_000_000, got  # with the 1 MB's ACKs, which are small
    assert 1_000_000 <= got[2] < 1_300_000, got  # with IP and TCP headers
    assert got[1] < 400_000, got

    # A rank's traffic to itself and traffic to an address that is no rank's: in no class.
    send(ns, "127.0.0.2", "127.0.0.2", 4_000_000)
    send(ns, "127.0.0.6", "127.0.0.7", 4_000_000)
    assert {r: c[2] for r, c in counters(ns).items()} == got

    status = netem("status.sh", "--netns", ns).stdout
    assert "tc fttree-dl: htb f7:" in status, status
    assert "downlink of rank 2 127.0.0.3 20Mbit, received" in status, status


@pytest.mark.realnet
def test_downlink_and_uplink_stack_and_go_away(ns: str) -> None:
    netem("uplink.sh", "--netns", ns, "--ranks", "3", "200mbit")
    netem("downlink.sh", "--netns", ns, "--ranks", "5", "100mbit")
    netem("downlink.sh", "--netns", ns, "--ranks", "2", "200mbit")  # replaces: no class left from 5
    assert sorted(counters(ns)) == [0, 1]
    send(ns, "127.0.0.2", "127.0.0.1", 2_000_000)
    assert counters(ns)[0][2] >= 2_000_000  # through both: rank 1's uplink, then rank 0's downlink
    up = netem("uplink.sh", "--netns", ns, "--counters").stdout.splitlines()
    assert int(up[1].split()[3]) >= 2_000_000

    # uplink.sh --remove leaves the downlinks, downlink.sh --remove leaves the uplinks.
    netem("uplink.sh", "--netns", ns, "--remove")
    assert sorted(counters(ns)) == [0, 1]
    netem("uplink.sh", "--netns", ns, "--ranks", "3", "200mbit")
    assert "removed the fttree downlinks" in netem("downlink.sh", "--netns", ns, "--remove").stdout
    assert "fttree-dl" not in in_ns(ns, "ip", "link").stdout
    assert "ingress" not in in_ns(ns, "tc", "qdisc", "show", "dev", "lo").stdout
    assert "f7:" in in_ns(ns, "tc", "qdisc", "show", "dev", "lo").stdout
    assert "no fttree downlinks" in netem("downlink.sh", "--netns", ns, "--remove").stdout

    # reset.sh removes both; somebody else's ingress qdisc is refused, then left alone.
    netem("downlink.sh", "--netns", ns, "100mbit")
    assert "2 fttree rules removed" in netem("reset.sh", "--netns", ns).stdout
    assert "fttree-dl" not in in_ns(ns, "ip", "link").stdout
    assert "ingress" not in in_ns(ns, "tc", "qdisc", "show", "dev", "lo").stdout
    in_ns(ns, "tc", "qdisc", "add", "dev", "lo", "handle", "ffff:", "ingress")
    out = netem("downlink.sh", "--netns", ns, "10mbit", check=False)
    assert out.returncode != 0
    assert "ingress qdisc that fttree did not install" in out.stderr
    netem("reset.sh", "--netns", ns)
    assert "ingress" in in_ns(ns, "tc", "qdisc", "show", "dev", "lo").stdout
