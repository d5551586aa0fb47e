"""Hole punching through real Linux NATs (netem/nat.sh: network namespaces, iptables
MASQUERADE): where the routers keep source ports the punch connects and the relayed bytes
drop to almost nothing; where they map every connection to a new port (--random-fully) it
cannot, and the relay carries the pairs as before. Every step exact either way.

Needs root, network namespaces and iptables; skips with the reason otherwise. Every network
(namespaces `punch...`, their interfaces and rules) is removed even when a test fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from fttree.tools.cli import main
from fttree.tools.launch import LaunchResult
from fttree.tools.punch_rate import measure
from fttree.tools.realfaults import launch_behind_nat

from .test_realnet import realnet_missing

NAT = Path(__file__).resolve().parent.parent / "netem" / "nat.sh"
MLP = 407_050  # float32: 1.63 MB a step
SITES = [[1, 2], [3, 4], [5, 6]]  # rank 0 alone is public: without punches it relays most tensors


def left_behind(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(name)]


@pytest.fixture
def root() -> None:
    missing = realnet_missing()
    if missing:
        pytest.skip(missing)


@pytest.mark.usefixtures("root")
@pytest.mark.parametrize(("nat_ports", "attempts", "connects"), [("keep", 5, True), ("random-fully", 2, False)])
def test_the_sockets_punch_through_a_nat_that_keeps_ports_and_not_through_one_that_maps_each_anew(
        nat_ports: str, attempts: int, connects: bool) -> None:
    """Two hosts behind NATs of their own, a public coordinator (fttree.tools.punch_rate):
    each attempt connects (and a byte passes each way) when the routers keep source ports,
    none does when each connection gets a new port, as the coordinator's view of a port then
    says nothing of the next connection's."""
    name = f"punchsock{os.getpid()}"
    pairs = measure(attempts, nat_ports, 3.0, name)
    assert len(pairs) == attempts
    for a, b in pairs:
        assert (a.ok, b.ok) == (connects, connects), (a, b)
        if connects:
            assert a.mapped == b.peer  # each dialled the mapping the coordinator saw
            assert a.mapped.endswith(f":{a.local_port}")  # (a router that keeps ports)
        else:
            assert "within 3 s" in a.why, a
    assert left_behind(name) == []


def test_the_nat_port_mapping_is_one_of_three_named_before_anything_is_built() -> None:
    out = subprocess.run([str(NAT), "up", "punchbad", "--public", "0", "--site", "1", "--nat-ports", "fixed"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "--nat-ports is keep, random or random-fully: got 'fixed'" in out.stderr
    if shutil.which("ip") is not None:
        assert left_behind("punchbad") == []


def test_launch_takes_a_port_mapping_only_for_ranks_behind_nats() -> None:
    out = CliRunner().invoke(main, ["launch", "-n", "3", "--nat-ports", "random-fully"])
    assert out.exit_code == 2
    assert "--nat-ports is how the --behind-nat routers map ports" in out.output
    out = CliRunner().invoke(main, ["launch", "-n", "3", "--behind-nat", "2", "--nat-ports", "fixed"])
    assert out.exit_code == 2
    assert "'fixed' is not one of 'keep', 'random', 'random-fully'" in out.output


def relayed_in(result: LaunchResult, steps: range) -> int:
    """Envelope bytes sent and carried through relays over all ranks in `steps`."""
    records = result.records
    return sum(records[s][r].relayed_bytes - records[s - 1][r].relayed_bytes for s in steps for r in records[s])


@pytest.mark.usefixtures("root")
@pytest.mark.parametrize(("nat_ports", "punched"), [("keep", True), ("random-fully", False)])
def test_sites_punch_through_their_nats_and_stop_relaying_exactly(nat_ports: str, punched: bool, key: Path,
                                                                   tmp_path: Path) -> None:
    """Public rank 0 and three sites of two ranks, each behind its own NAT: the sites' ranks
    reach each other only through rank 0, which relays most tensors (tests/test_nat_netns.py).
    With routers that keep ports, rank 0 coordinates a punch for every pair of two sites, and
    from then on almost nothing is relayed; with routers that map every connection anew the
    punches fail and the relay carries the tensors as before. Every step exact on every
    rank, everyone in every sum, no view change."""
    steps = 30
    args = ["--steps", str(steps), "--size", str(MLP), "--auth-key-file", str(key), "--no-http",
            "--step-timeout", "30"]
    lines: list[str] = []
    name = f"punchnat{os.getpid()}"
    result = launch_behind_nat(SITES, 7, args, steps=steps, launch_dir=tmp_path / "launch", deadline_s=300,
                               echo=lines.append, name=name, nat_ports=nat_ports)
    report = "\n".join(lines)
    assert result.ok, report
    assert result.shortfalls() == [], report
    late = relayed_in(result, range(steps // 2, steps)) / (steps - steps // 2)
    if punched:
        assert late < 4096, f"{late:.0f} bytes a step still relayed\n{report}"
    else:
        assert late > MLP * 4, f"only {late:.0f} bytes a step relayed\n{report}"
    assert left_behind(name) == []
