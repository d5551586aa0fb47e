"""Per-rank uplink limits (netem/uplink.sh) and gloo bound to each rank's address (gloo_baseline --bind).

The `realnet` tests need root, network namespaces and tc; they skip with the reason otherwise,
and each works in its own namespace, deleted with everything in it even when the test fails.
Rates are measured with plain sockets between rank addresses inside that namespace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from fttree.tools import gloo_baseline
from fttree.tools.bindshim import _hex_addr, bound_env

from .test_realnet import NS_PREFIX, in_ns, namespaces, netem, realnet_missing, sweep_dead_namespaces

ROOT = Path(__file__).resolve().parent.parent
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
    (["--rank", "3:10mbit", "100mbit"], "--rank needs RANK=RATE"),
    (["--rank", "3=fast", "100mbit"], "--rank 3=fast: RATE must look like"),
])
def test_uplink_rejects_bad_input(args: list[str], message: str) -> None:
    out = netem("uplink.sh", *args, check=False)
    assert out.returncode != 0
    assert message in out.stderr


def test_uplink_without_rate_prints_usage() -> None:
    out = netem("uplink.sh", check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("Usage:")


# What a process under the connect() wrapper gets as source: an unbound IPv4 socket, an
# IPv4-mapped IPv6 one, and one the program bound itself (left alone).
SOURCES = textwrap.dedent("""
    import socket
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    plain = socket.create_connection(("127.0.0.1", port))
    mapped = socket.socket(socket.AF_INET6)
    mapped.connect(("::ffff:127.0.0.1", port))
    own = socket.socket()
    own.bind(("127.0.0.4", 0))
    own.connect(("127.0.0.1", port))
    print(plain.getsockname()[0], mapped.getsockname()[0], own.getsockname()[0])
""")


def test_connect_wrapper_binds_only_unbound_sockets() -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler (cc) to build the connect() wrapper")
    if sys.platform != "linux":
        pytest.skip("the wrapper and 127.0.0.0/8 on lo are Linux's")
    run = subprocess.run([sys.executable, "-c", SOURCES], env=bound_env("127.0.0.3"), capture_output=True,
                         text=True, timeout=60, check=True)
    assert run.stdout.split() == ["127.0.0.3", "::ffff:127.0.0.3", "127.0.0.4"], run.stderr
    plain = subprocess.run([sys.executable, "-c", SOURCES], capture_output=True, text=True, timeout=60, check=True)
    assert plain.stdout.split() == ["127.0.0.1", "::ffff:127.0.0.1", "127.0.0.4"]


def test_gloo_bind_refuses_bad_input() -> None:
    args = ["--rank", "1", "--world", "3", "--port", "1", "--steps", "1", "--size", "4"]
    with pytest.raises(SystemExit):
        gloo_baseline.parse_args([*args, "--bind", "127.0.0"])
    assert gloo_baseline.parse_args([*args, "--bind", "127.0.0.2"]).bind == "127.0.0.2"
    assert gloo_baseline.main([*args, "--bind", "127.0.0.2"]) == 2  # in-process: it cannot re-execute


def test_proc_addresses_decode() -> None:
    assert _hex_addr("0300007F:1F90") == "127.0.0.3"  # /proc/net/tcp, little-endian
    assert _hex_addr("0000000000000000FFFF00000200007F:9C40") == "127.0.0.2"  # tcp6, IPv4-mapped


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

    # Not limited: a rank talking to itself, and addresses that are no rank's (ranks 5 and 6 of 3).
    # The stranger talks to a stranger: its GB/s would make rank 0's acknowledgements (counted
    # in rank 0's class below) as large as the check on them, so rank 0 stays out of it.
    self_rate, stranger = flows(ns3, "127.0.0.2", 0.5, "127.0.0.2"), flows(ns3, "127.0.0.7", 0.5, "127.0.0.6")
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
def test_a_rank_can_have_an_uplink_of_its_own(ns3: str) -> None:
    """--rank 2=10mbit: rank 2 at 10 Mbit/s while rank 1 keeps the default; a rank beyond
    --ranks is refused before anything is installed."""
    refused = netem("uplink.sh", "--netns", ns3, "--ranks", "3", "--rank", "5=10mbit", "50mbit", check=False)
    assert refused.returncode != 0
    assert "rank 5 is not below --ranks 3" in refused.stderr
    out = netem("uplink.sh", "--netns", ns3, "--ranks", "3", "--rank", "2=10mbit", f"{RATE_MBIT}mbit")
    assert "rank 2 10mbit" in out.stdout
    fast, slow = flows(ns3, "127.0.0.1", 1.5, "127.0.0.2", "127.0.0.3")
    assert 0.75 * RATE_MBIT < fast < 1.1 * RATE_MBIT, fast
    assert 7.5 < slow < 11, slow
    netem("uplink.sh", "--netns", ns3, "--remove")


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


# ---- gloo bound to each rank's address ----------------------------------------------------


def gloo_missing() -> str:
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    if not dist.is_gloo_available():
        return "this torch has no gloo"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler (cc) to build the connect() wrapper that --bind loads"
    return ""


def run_gloo(ns: str, world: int, size: int, steps: int, bind: bool) -> dict[int, set[str]]:
    """Run `world` gloo ranks in `ns` (rank r given --bind 127.0.0.(r+1) when `bind`); while
    they wait for release after their last step, read `ss -tnp` there. Returns, per rank,
    the local addresses of its established TCP connections."""
    port = 29500  # the namespace is fresh: nothing else listens there
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[str]] = []
    try:
        for r in range(world):
            cmd = [sys.executable, "-m", "fttree.tools.gloo_baseline", "--rank", str(r), "--world", str(world),
                   "--port", str(port), "--steps", str(steps), "--size", str(size), "--startup-timeout", "60"]
            if bind:
                cmd += ["--bind", f"127.0.0.{r + 1}"]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        for r, p in enumerate(procs):
            assert p.stdout is not None
            kinds = []
            for line in p.stdout:  # ends when the rank has stepped through (or died)
                kinds.append(json.loads(line)["kind"])
                if kinds[-1] == "done":
                    break
            else:
                assert p.stderr is not None
                pytest.fail(f"gloo rank {r} exited {p.wait()} before its last step: {p.stderr.read()[-2000:]}")
            assert kinds.count("step") == steps
        pid_rank = {p.pid: r for r, p in enumerate(procs)}  # ip netns exec execs: same pid
        sources: dict[int, set[str]] = {r: set() for r in range(world)}
        for line in in_ns(ns, "ss", "-tnpH", "state", "established").stdout.splitlines():
            local = line.split()[2]
            addr = local.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
            for pid in map(int, re.findall(r"pid=(\d+)", line)):
                if pid in pid_rank:
                    sources[pid_rank[pid]].add(addr)
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()  # release: the ranks exit
        for r, p in enumerate(procs):
            assert p.wait(timeout=30) == 0, f"rank {r}"
        return sources
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.realnet
@pytest.mark.slow
def test_gloo_bind_sends_from_each_rank_address(ns3: str) -> None:
    missing = gloo_missing()
    if missing:
        pytest.skip(missing)
    world, size, steps = 3, 1_000_000, 2
    netem("uplink.sh", "--netns", ns3, "--ranks", str(world), "1gbit")
    sources = run_gloo(ns3, world, size, steps, bind=True)
    assert sources == {r: {f"127.0.0.{r + 1}"} for r in range(world)}

    # The uplink classes saw it too: each rank sent at least the ring's 2N(p-1)/p per step.
    # (Unbound, the connections gloo opens leave from 127.0.0.1 and count as rank 0's.)
    bound = 2 * size * 4 * (world - 1) / world * steps
    sent = counters(ns3)
    assert all(0.95 * bound < sent[r][1] < 1.5 * bound for r in range(world)), (bound, sent)


@pytest.mark.realnet
@pytest.mark.slow
def test_gloo_without_bind_sends_from_rank_0s_address(ns3: str) -> None:
    """What --bind fixes: plain gloo (GLOO_SOCKET_IFNAME=lo) uses 127.0.0.1 for every rank."""
    missing = gloo_missing()
    if missing:
        pytest.skip(missing)
    sources = run_gloo(ns3, 3, 1000, 1, bind=False)
    assert sources == {0: {"127.0.0.1"}, 1: {"127.0.0.1"}, 2: {"127.0.0.1"}}
