"""Ranks behind real NATs (netem/nat.sh: network namespaces, iptables MASQUERADE, no port
forwarding) train with public ones: every step exact on every rank, nobody left out.

Needs root, network namespaces and iptables; skips with the reason otherwise. Every network
is removed, namespaces, interfaces and rules, even when a test fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from fttree.errors import ConfigError
from fttree.tools.realfaults import launch_behind_nat, nat_network, parse_sites

from .test_realnet import realnet_missing

NAT = Path(__file__).resolve().parent.parent / "netem" / "nat.sh"
MLP = 407_050  # float32: 1.63 MB a step


def our_networks() -> set[str]:
    out = subprocess.run([str(NAT), "list"], capture_output=True, text=True, check=True, timeout=30).stdout
    return set(out.split())


@pytest.fixture
def root() -> None:
    missing = realnet_missing()
    if missing:
        pytest.skip(missing)


def test_sites_are_checked_before_anything_is_built() -> None:
    assert parse_sites(["3,4"], 5) == [[3, 4]]
    with pytest.raises(ConfigError, match=r"rank 5 is not one of 0\.\.4"):
        parse_sites(["3,5"], 5)
    with pytest.raises(ConfigError, match="rank 3 is behind two NATs"):
        parse_sites(["3", "3,4"], 5)
    with pytest.raises(ConfigError, match="at least one must be public"):
        parse_sites(["0,1"], 2)
    assert parse_sites(["3", "4"], 5) == [[3], [4]]  # two sites: their ranks meet through a relay


# One listener per given address and one dial per (from-rank, to-address): "ok" or the error.
PROBE = textwrap.dedent("""
    import socket, sys
    c = socket.socket()
    c.settimeout(1.0)
    try:
        c.connect((sys.argv[1], int(sys.argv[2])))
        print("ok", c.getpeername()[0])
    except OSError as exc:
        print(type(exc).__name__)
""")
LISTEN = "import socket, sys; s = socket.create_server((sys.argv[1], 4000)); print('up', flush=True); s.accept()"
# A listener that says where each connection came from, for two connections.
SEEN = ("import socket, sys; s = socket.create_server((sys.argv[1], 4000)); print('up', flush=True)\n"
        "for _ in range(2): print('from', s.accept()[1][0], flush=True)")


def dial(name: str, rank: int, host: str) -> str:
    out = subprocess.run([str(NAT), "exec", name, str(rank), "--", sys.executable, "-c", PROBE, host, "4000"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


@pytest.mark.usefixtures("root")
def test_site_ranks_dial_out_and_nobody_dials_in() -> None:
    """Ranks 0, 1 public; 2 and 3 behind one NAT, 4 behind another: a site rank dials a public
    one (which sees the router's address) and its site-mate; a public rank cannot dial a site
    rank, nor its router's public address (no port forwarding); two sites cannot meet."""
    with nat_network([[2, 3], [4]], 5, name=f"fttreenattest{os.getpid()}") as name:
        peers = subprocess.run([str(NAT), "peers", name, "--site-local", "--port", "4000"], capture_output=True,
                               text=True, check=True, timeout=30).stdout.splitlines()
        assert peers == ["10.77.0.10:4000", "10.77.0.11:4000", "10.78.1.12:4000 behind site1",
                         "10.78.1.13:4000 behind site1", "10.78.2.14:4000 behind site2"]
        listeners = [subprocess.Popen([str(NAT), "exec", name, str(r), "--", sys.executable, "-c", LISTEN, host],
                                      stdout=subprocess.PIPE, text=True)
                     for r, host in ((0, "10.77.0.10"), (2, "10.78.1.12"))]
        try:
            for proc in listeners:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "up"
            assert dial(name, 3, "10.77.0.10") == "ok 10.77.0.10"
            assert dial(name, 3, "10.78.1.12") == "ok 10.78.1.12"  # a site-mate
            assert dial(name, 0, "10.78.1.12") != "ok 10.78.1.12"  # no route in
            assert dial(name, 1, "10.77.0.201") == "TimeoutError"  # the router forwards nothing in
            assert dial(name, 4, "10.78.1.12") != "ok 10.78.1.12"  # another site
        finally:
            for proc in listeners:
                proc.kill()
                proc.wait(timeout=10)
    assert name not in our_networks()
    out = subprocess.run([str(NAT), "down", name], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0  # idempotent
    assert "nothing to do" in out.stderr + out.stdout


@pytest.mark.usefixtures("root")
def test_routed_sites_are_dialled_by_everybody() -> None:
    """The control network (`nat_ports="route"`, nat.sh --routed): the same namespaces and
    routers with no NAT, so a public rank and another site dial a site rank, which sees their
    own addresses, and the peers file lists every rank's host:port."""
    with nat_network([[2, 3], [4]], 5, name=f"fttreenatrt{os.getpid()}", nat_ports="route") as name:
        peers = subprocess.run([str(NAT), "peers", name, "--site-local", "--port", "4000"], capture_output=True,
                               text=True, check=True, timeout=30).stdout.splitlines()
        assert peers == ["10.77.0.10:4000", "10.77.0.11:4000", "10.78.1.12:4000", "10.78.1.13:4000",
                         "10.78.2.14:4000"]
        listener = subprocess.Popen([str(NAT), "exec", name, "2", "--", sys.executable, "-c", SEEN, "10.78.1.12"],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout is not None
            assert listener.stdout.readline().strip() == "up"
            assert dial(name, 0, "10.78.1.12") == "ok 10.78.1.12"  # a public rank dials in
            assert listener.stdout.readline().strip() == "from 10.77.0.10"  # no NAT on the way
            assert dial(name, 4, "10.78.1.12") == "ok 10.78.1.12"  # and another site
            assert listener.stdout.readline().strip() == "from 10.78.2.14"
        finally:
            listener.kill()
            listener.wait(timeout=10)
    assert name not in our_networks()
    with pytest.raises(ConfigError, match="nat_ports is one of"), nat_network([[1]], 2, nat_ports="forward"):
        pass


@pytest.mark.usefixtures("root")
@pytest.mark.parametrize(("world", "site", "site_local"), [(5, [3, 4], True), (4, [3], False)],
                         ids=["site-3-4-behind", "rank-3-dash"])
def test_ranks_behind_a_nat_train_exactly_with_the_public_ones(world: int, site: list[int], site_local: bool,
                                                                key: Path, tmp_path: Path) -> None:
    """Public 0, 1, 2 and a site behind a NAT (3 and 4 listed `behind site1`, dialling each
    other; or 3 alone listed `-`): steps of 1.63 MB exact on every rank, every rank in every
    sum, all in view 0 (no view change removed anyone)."""
    steps = 6
    args = ["--steps", str(steps), "--size", str(MLP), "--auth-key-file", str(key), "--no-http",
            "--step-timeout", "30"]
    lines: list[str] = []
    result = launch_behind_nat([site], world, args, steps=steps, launch_dir=tmp_path / "launch", deadline_s=240,
                               echo=lines.append, site_local=site_local)
    report = "\n".join(lines)
    assert result.ok, report
    assert result.shortfalls() == [], report
    assert not [n for n in our_networks() if n.startswith("fttreenat")], "a NAT network was left behind"


@pytest.mark.usefixtures("root")
@pytest.mark.parametrize(("sites", "relayed"), [([[3, 4], [5, 6]], False), ([[1, 2], [3, 4], [5, 6]], True)],
                         ids=["public-0-1-2-sites-3-4-and-5-6", "public-0-only-three-sites"])
def test_ranks_behind_different_nats_train_exactly_through_relays(sites: list[list[int]], relayed: bool,
                                                                  key: Path, tmp_path: Path) -> None:
    """Seven ranks, the sites' ranks unable to reach another site's: every step exact on every
    rank with everybody in the sum, in view 0. With three public ranks the trees keep every
    pair that cannot connect off the primary links, and almost nothing is relayed; with one,
    the relay (rank 0) carries tensors, and the launch says how much. (Hole punching off: it
    would take the pairs off the relay; tests/test_punch_netns.py.)"""
    steps = 6
    args = ["--steps", str(steps), "--size", str(MLP), "--auth-key-file", str(key), "--no-http",
            "--step-timeout", "30", "--set", "hole_punch=false"]
    lines: list[str] = []
    result = launch_behind_nat(sites, 7, args, steps=steps, launch_dir=tmp_path / "launch", deadline_s=240,
                               echo=lines.append)
    report = "\n".join(lines)
    assert result.ok, report
    assert result.shortfalls() == [], report
    per_step = result.relayed_per_step()
    if relayed:
        assert per_step > MLP * 4, report  # tensors pass the relay
        assert any("relayed" in line for line in lines), report
    else:
        assert per_step < 64 * 1024, report  # backup-link metadata only
    assert not [n for n in our_networks() if n.startswith("fttreenat")], "a NAT network was left behind"


STALL = Path(__file__).resolve().parent / "nat_stall.py"


@pytest.fixture
def loopback_ns(root: None) -> Iterator[str]:
    """A namespace of its own with lo up (netem/cluster.sh), deleted whatever happens."""
    name = f"fttree-test-nat-{os.getpid()}"
    cluster = NAT.parent / "cluster.sh"
    try:
        subprocess.run([str(cluster), "up", name, "-n", "3"], capture_output=True, check=True, timeout=30)
        yield name
    finally:
        subprocess.run([str(cluster), "down", name, "--kill"], capture_output=True, check=False, timeout=60)


def test_a_silent_cut_of_the_connections_a_rank_behind_a_nat_dialled_is_detected_and_dialled_again(
        loopback_ns: str) -> None:
    """Rank 2 is `-`; rank 0 sends to it on the two connections rank 2 dialled. The firewall
    drops everything on those two (by port, both ways) for good: rank 0's stall detection
    gives up on them as on any connection it dialled (errors), the backups carry the steps
    meanwhile, and rank 2 dials again, rank 0 adopting the new connections. Every step exact
    on every rank, with all three in the sum and no view change (nat_stall.py)."""
    out = subprocess.run(["ip", "netns", "exec", loopback_ns, sys.executable, str(STALL)], capture_output=True,
                         text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(STALL.parent.parent)))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["cut_ports"]) == 2, report  # control and bulk
    assert report["wrong"] == [], report
    before, after = report["before"], report["after"]
    assert before["connects"] == after["connects"] == 0, report  # rank 0 never dialled rank 2
    assert after["errors"] > before["errors"], report  # the stalled connections were given up
    assert after["adopted"] >= before["adopted"] + 1, report  # and rank 2's new ones carry rank 0's frames
