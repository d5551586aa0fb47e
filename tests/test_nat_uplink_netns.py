"""`fttree launch --shape-uplink`: every rank's uplink limited on its own interface in
netem/nat.sh's network (rank_uplinks.py), ranks behind NATs and public ones alike, all public
without --behind-nat. The tc counters say the bytes went through each rank's limit and that
the limit held the rank back.

The `realnet` tests need root, network namespaces, iptables and tc; they skip with the reason
otherwise. Every network (namespaces `natrateup...`, their interfaces, rules and qdiscs) is
removed even when a test fails, and a failure while shaping removes it too."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from fttree.errors import ConfigError
from fttree.tools.cli import main
from fttree.tools.realfaults import RealFaultError, launch_behind_nat, netem_dir
from fttree.tools.units import parse_uplinks

from .test_realnet import realnet_missing
from .test_uplink import tc_missing

NAT = Path(__file__).resolve().parent.parent / "netem" / "nat.sh"
SIZE = 100_000  # float32: 400 KB a step, one chunk (one tree): every rank sends it at least once a step
STEPS = 4


def left_behind(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(name)]


@pytest.fixture
def root() -> None:
    missing = realnet_missing() or tc_missing()
    if missing:
        pytest.skip(missing)


def worker_args(key: Path) -> list[str]:
    return ["--steps", str(STEPS), "--size", str(SIZE), "--auth-key-file", str(key), "--no-http",
            "--step-timeout", "60"]


@pytest.mark.parametrize(("args", "message"), [
    (["--shape-uplink", "10xbit"], "bad rate '10xbit'"),
    (["--shape-uplink", "100mbit,5=10mbit"], "rank 5 (5=10mbit) is not one of 0..2"),
    (["--shape-uplink", "100mbit", "--real-faults"], "--shape-uplink and --real-faults cannot be combined"),
])
def test_launch_checks_the_uplinks_before_anything_is_built(args: list[str], message: str) -> None:
    out = CliRunner().invoke(main, ["launch", "-n", "3", *args])
    assert out.exit_code == 2, out.output
    assert message in out.output


@pytest.mark.realnet
@pytest.mark.usefixtures("root")
def test_ranks_behind_a_nat_and_public_ones_are_each_limited_on_their_own_interface(key: Path,
                                                                                    tmp_path: Path) -> None:
    """Public 0, 1, 2, site {3, 4}; every uplink 20 Mbit/s but rank 3's, 10: each rank's class
    has its rate and address (the site ranks' on the site's network, before the router), carried
    at least the rank's own 400 KB of every step, and held the rank back (overlimits): an
    unshaped rank would have no class, one whose filter missed its traffic no bytes."""
    name = f"natrateup{os.getpid()}"
    lines: list[str] = []
    result = launch_behind_nat([[3, 4]], 5, worker_args(key), steps=STEPS, launch_dir=tmp_path / "launch",
                               deadline_s=240, echo=lines.append, name=name,
                               uplinks=parse_uplinks("20mbit,3=10mbit"))
    report = "\n".join(lines)
    assert result.ok, report
    assert result.shortfalls(view=None) == [], report  # a pace agreement may change the view
    up = result.uplinks
    assert sorted(up) == [0, 1, 2, 3, 4], report
    assert [c.address for c in up.values()] == ["10.77.0.10", "10.77.0.11", "10.77.0.12", "10.78.1.13",
                                                "10.78.1.14"]
    assert [c.rate for c in up.values()] == ["20Mbit", "20Mbit", "20Mbit", "10Mbit", "20Mbit"]
    for c in up.values():
        assert c.sent_bytes >= STEPS * SIZE * 4, f"{c}\n{report}"
        assert c.overlimits > 0, f"{c}\n{report}"
    assert "uplink of rank 3 (10.78.1.13, 10Mbit, on eth0 in its namespace): sent" in report
    assert left_behind(name) == []


@pytest.mark.realnet
@pytest.mark.usefixtures("root")
def test_launch_shapes_every_rank_of_an_all_public_network_from_the_command_line(key: Path, tmp_path: Path) -> None:
    """No --behind-nat: the same per-rank network, all public, each rank limited."""
    out = CliRunner().invoke(main, ["launch", "-n", "3", "--shape-uplink", "20mbit,2=10mbit", "--launch-dir",
                                    str(tmp_path / "launch"), *worker_args(key)])
    assert out.exit_code == 0, out.output
    assert "every rank public, each in a namespace of its own" in out.output
    sent = re.findall(r"uplink of rank (\d) \(10\.77\.0\.1\d, (\d+Mbit), on eth0 in its namespace\): sent ([\d,]+) "
                      r"bytes .* held back by the limit ([\d,]+) times", out.output)
    assert [(r, rate) for r, rate, _, _ in sent] == [("0", "20Mbit"), ("1", "20Mbit"), ("2", "10Mbit")], out.output
    for _, _, nbytes, held in sent:
        assert int(nbytes.replace(",", "")) >= STEPS * SIZE * 4, out.output
        assert int(held.replace(",", "")) > 0, out.output
    match = re.search(r"\(network (\S+)\)", out.output)
    assert match is not None, out.output
    assert left_behind(match.group(1)) == []


@pytest.mark.realnet
@pytest.mark.usefixtures("root")
def test_a_failure_while_shaping_removes_the_whole_network(key: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """uplink.sh refusing (here a stand-in that fails, as tc would without the htb module)
    stops the launch with its words before any worker starts, and the network goes."""
    scripts = tmp_path / "netem"
    scripts.mkdir()
    for script in netem_dir().iterdir():
        (scripts / script.name).symlink_to(script)
    (scripts / "uplink.sh").unlink()
    (scripts / "uplink.sh").write_text("#!/bin/sh\necho 'uplink.sh: tc refused the uplink classes' >&2\nexit 1\n")
    (scripts / "uplink.sh").chmod(0o755)
    monkeypatch.setenv("FTTREE_NETEM_DIR", str(scripts))
    name = f"natrateup{os.getpid()}"
    lines: list[str] = []
    with pytest.raises(RealFaultError, match="tc refused the uplink classes"):
        launch_behind_nat([[3, 4]], 5, worker_args(key), steps=STEPS, launch_dir=tmp_path / "launch",
                          deadline_s=60, echo=lines.append, name=name, uplinks=parse_uplinks("20mbit"))
    assert not any(line.startswith("launching") for line in lines), lines
    assert left_behind(name) == []


def test_a_rank_the_job_does_not_have_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ConfigError, match=r"rank 7 \(7=10mbit\) is not one of 0\.\.6"):
        launch_behind_nat([], 7, [], steps=1, uplinks=parse_uplinks("100mbit,7=10mbit"))
