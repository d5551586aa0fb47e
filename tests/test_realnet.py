"""Real faults: the netem/ scripts and `launch --real-faults` against the kernel's own firewall.

Tests marked `realnet` need root, network namespaces and iptables; they skip with the reason
otherwise. Each one works in its own namespace (named after this process, so parallel runs
do not collide), which is deleted with every rule in it even when the test fails.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fttree.core.faults import FaultSchedule
from fttree.errors import ConfigError
from fttree.tools import launch as launch_module
from fttree.tools import realfaults as rf

NETEM = Path(__file__).resolve().parent.parent / "netem"
SCRIPTS = sorted(p for p in NETEM.glob("*.sh") if p.name != "lib.sh")
NS_PREFIX = "fttree-test-"
_counter = itertools.count()


def sh(*cmd: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60, check=check)


def netem(script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh(NETEM / script, *args, check=check)


@functools.cache
def realnet_missing() -> str:
    """Why real-network tests cannot run here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root (iptables rules and network namespaces)"
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    try:
        made = sh("ip", "netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the 'ip' command (iproute2) is not installed"
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        ok = sh("ip", "netns", "exec", probe, "iptables", "-w", "5", "-S", "INPUT", check=False)
        if ok.returncode != 0:
            return f"iptables does not work inside a namespace: {ok.stderr.strip() or 'not installed'}"
    except FileNotFoundError:
        return "iptables is not installed (apt-get install iptables)"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return ""


def namespaces() -> set[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def sweep_dead_namespaces() -> None:
    """Namespaces of earlier test runs that were killed before their cleanup (pid is gone)."""
    for name in namespaces():
        if not name.startswith(NS_PREFIX):
            continue
        pid = name.removeprefix(NS_PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            netem("cluster.sh", "down", name, "--kill", check=False)


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh namespace with lo up for 7 ranks; deleted (rules and all) whatever happens."""
    missing = realnet_missing()
    if missing:
        pytest.skip(missing)
    sweep_dead_namespaces()
    name = f"{NS_PREFIX}{os.getpid()}-{next(_counter)}"
    try:
        netem("cluster.sh", "up", name, "-n", "7")
        yield name
    finally:
        netem("cluster.sh", "down", name, "--kill", check=False)
    assert name not in namespaces()


def in_ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", ns, *cmd, check=check)


def fttree_rules(ns: str) -> list[str]:
    return [line for line in in_ns(ns, "iptables", "-S").stdout.splitlines() if "fttree" in line]


# A listener on rank 0 (127.0.0.1) and one connection attempt from each given rank's address:
# prints "ok", "timeout" (silently dropped) or "refused" per rank.
PROBE = textwrap.dedent("""
    import socket, sys
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    for rank in map(int, sys.argv[1:]):
        c = socket.socket()
        c.bind((f"127.0.0.{rank + 1}", 0))
        c.settimeout(1.0)
        try:
            c.connect(("127.0.0.1", port))
            print("ok")
        except TimeoutError:
            print("timeout")
        except ConnectionRefusedError:
            print("refused")
        finally:
            c.close()
""")


def probe(ns: str, *ranks: int) -> list[str]:
    return in_ns(ns, sys.executable, "-c", PROBE, *map(str, ranks)).stdout.split()


# ---- scripts that need nothing -----------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_has_help_and_strict_mode(script: Path) -> None:
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    out = sh(script, "--help")
    assert out.stdout.startswith("Usage:"), out.stdout
    assert os.access(script, os.X_OK)


def test_scripts_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    out = sh("shellcheck", "-x", *SCRIPTS, NETEM / "lib.sh", check=False)
    assert out.returncode == 0, out.stdout


def test_scripts_exist_for_each_job() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"cluster.sh", "cut.sh", "heal.sh", "loss.sh", "bandwidth.sh", "delay.sh", "status.sh",
            "reset.sh"} <= names


def test_real_faults_refuse_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(rf.RealFaultError, match="needs root"):
        rf.require_real_faults()


def test_schedule_becomes_firewall_changes_at_step_boundaries() -> None:
    plan = rf.boundaries(FaultSchedule("cut 1-0 @5..10; loss 3 20% @8..12"), steps=20)
    cut, loss = rf.Change("cut", "0-1"), rf.Change("loss", "3", "20")
    assert plan == {5: (frozenset(), frozenset({cut})), 8: (frozenset(), frozenset({loss})),
                    11: (frozenset({cut}), frozenset()), 13: (frozenset({loss}), frozenset())}
    # Overlapping rules on one link: installed once, removed only when the last one ends.
    plan = rf.boundaries(FaultSchedule("cut 1-0 @2..4; cut 0-1 @3..6; isolate 4 @19.."), steps=20)
    assert sorted(plan) == [2, 7, 19]
    assert plan[7] == (frozenset({cut}), frozenset())
    assert plan[19] == (frozenset(), frozenset({rf.Change("cut", "4")}))


def test_delay_cannot_be_a_real_fault() -> None:
    with pytest.raises(ConfigError, match="in-process"):
        rf.launch_with_real_faults(FaultSchedule("delay 2-0 50ms"), 3, [], steps=3)


def test_step_gate_waits_for_go_and_stops_on_abort(tmp_path: Path) -> None:
    gate = rf.StepGate(tmp_path, [2], rank=3, timeout_s=5)
    gate(1)  # not gated: returns at once
    (tmp_path / "go-2").touch()
    gate(2)
    assert (tmp_path / "ready-2-3").exists()
    (tmp_path / "go-2").unlink()
    (tmp_path / "abort").write_text("cut.sh failed")
    with pytest.raises(rf.RealFaultError, match=r"rank 3.*before step 2: cut.sh failed"):
        gate(2)


# ---- the scripts against the kernel --------------------------------------------------------


@pytest.mark.realnet
def test_cut_is_silent_and_only_that_link_and_heal_restores(netns: str) -> None:
    assert probe(netns, 1, 2) == ["ok", "ok"]
    out = netem("cut.sh", "--netns", netns, "1-0")
    assert "cut 0-1" in out.stdout
    assert len(fttree_rules(netns)) == 2
    assert probe(netns, 1, 2) == ["timeout", "ok"]  # dropped without a RST; rank 2 unaffected
    assert "already cut" in netem("cut.sh", "--netns", netns, "0-1").stdout
    assert len(fttree_rules(netns)) == 2
    netem("heal.sh", "--netns", netns, "0-1")
    assert fttree_rules(netns) == []
    assert probe(netns, 1, 2) == ["ok", "ok"]


@pytest.mark.realnet
def test_isolate_a_worker_cuts_all_its_links(netns: str) -> None:
    netem("cut.sh", "--netns", netns, "0")
    assert probe(netns, 1, 2) == ["timeout", "timeout"]
    netem("heal.sh", "--netns", netns, "--all")
    assert probe(netns, 1, 2) == ["ok", "ok"]


@pytest.mark.realnet
def test_status_and_reset_touch_only_fttree_rules(netns: str) -> None:
    in_ns(netns, "iptables", "-A", "INPUT", "-s", "127.0.0.9", "-m", "comment", "--comment", "not-ours", "-j",
          "ACCEPT")
    netem("cut.sh", "--netns", netns, "1-0")
    netem("loss.sh", "--netns", netns, "3", "20%")
    netem("loss.sh", "--netns", netns, "5-2", "2.5")
    netem("bandwidth.sh", "--netns", netns, "100mbit")
    status = netem("status.sh", "--netns", netns).stdout
    assert '"fttree cut 0-1"' in status
    assert "--probability 0.2" in status
    assert '"fttree loss 2-5 2.5%"' in status
    assert "tc lo: tbf f7:" in status
    assert "7 fttree rules" in status
    assert "not-ours" not in status
    reset = netem("reset.sh", "--netns", netns).stdout
    assert "7 fttree rules removed" in reset
    assert fttree_rules(netns) == []
    assert "not-ours" in in_ns(netns, "iptables", "-S").stdout
    assert "f7:" not in in_ns(netns, "tc", "qdisc", "show", "dev", "lo").stdout
    assert "0 fttree rules" in netem("status.sh", "--netns", netns).stdout


@pytest.mark.realnet
def test_delay_uses_netem_or_says_plainly_it_cannot(netns: str) -> None:
    out = netem("delay.sh", "--netns", netns, "20ms", "5ms", check=False)
    if out.returncode == 3:  # this kernel has no sch_netem
        assert "no netem qdisc" in out.stderr
        assert '--faults "delay 2-0 50ms' in out.stderr
        assert "f7:" not in in_ns(netns, "tc", "qdisc", "show", "dev", "lo").stdout
    else:
        assert out.returncode == 0, out.stderr
        assert "netem f7:" in in_ns(netns, "tc", "qdisc", "show", "dev", "lo").stdout
        netem("delay.sh", "--netns", netns, "--remove")
        assert "f7:" not in in_ns(netns, "tc", "qdisc", "show", "dev", "lo").stdout


@pytest.mark.realnet
def test_scripts_name_a_missing_namespace() -> None:
    if realnet_missing():
        pytest.skip(realnet_missing())
    out = netem("cut.sh", "--netns", f"{NS_PREFIX}absent-{os.getpid()}", "1-0", check=False)
    assert out.returncode != 0
    assert "does not exist" in out.stderr


# ---- cleanup contract of launch --real-faults ---------------------------------------------------


def _launch_that_cuts_then_fails(seen: list[str]):  # type: ignore[no-untyped-def]
    def fake_launch(*args: object, prefix: list[str], **kwargs: object) -> None:
        ns = prefix[-1]
        seen.append(ns)
        netem("cut.sh", "--netns", ns, "1-0")
        netem("loss.sh", "--netns", ns, "3", "20")
        assert len(fttree_rules(ns)) == 4
        raise RuntimeError("worker launch blew up")
    return fake_launch


@pytest.mark.realnet
def test_failed_run_deletes_the_namespace_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    if realnet_missing():
        pytest.skip(realnet_missing())
    seen: list[str] = []
    monkeypatch.setattr(launch_module, "launch", _launch_that_cuts_then_fails(seen))
    with pytest.raises(RuntimeError, match="blew up"):
        rf.launch_with_real_faults(FaultSchedule("cut 1-0 @2..3"), 7, [], steps=5, echo=lambda s: None)
    assert seen == [f"fttree-{os.getpid()}"]
    assert seen[0] not in namespaces()


@pytest.mark.realnet
def test_failed_run_resets_a_namespace_it_was_given(netns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_module, "launch", _launch_that_cuts_then_fails([]))
    with pytest.raises(RuntimeError, match="blew up"):
        rf.launch_with_real_faults(FaultSchedule("cut 1-0 @2..3"), 7, [], steps=5, netns=netns, echo=lambda s: None)
    assert netns in namespaces()
    assert fttree_rules(netns) == []


@pytest.mark.realnet
def test_refuses_a_namespace_another_run_is_using(netns: str) -> None:
    sleeper = subprocess.Popen(["ip", "netns", "exec", netns, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in rf.namespace_pids(netns):  # until it has entered the namespace
            assert time.monotonic() < deadline, "sleep never showed up in the namespace"
            time.sleep(0.01)
        with pytest.raises(rf.RealFaultError, match="in use by processes"):
            rf.launch_with_real_faults(FaultSchedule("cut 1-0"), 7, [], steps=5, netns=netns, echo=lambda s: None)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


# ---- launch --real-faults: 7 workers, real cuts during steps 5..10 ----------------------------

STEPS = 14
SIZE = 20_000


def run_real(netns: str, schedule: str, *extra: str) -> rf.RealFaultRun:
    lines: list[str] = []
    args = ["--steps", str(STEPS), "--size", str(SIZE), "--timeout", "0.5", "--step-timeout", "20",
            "--startup-timeout", "30", *extra]
    run = rf.launch_with_real_faults(FaultSchedule(schedule, world=7), 7, args, steps=STEPS, netns=netns,
                                     deadline_s=150, echo=lines.append)
    assert run.result.ok, "\n".join(lines)
    return run


def assert_cut_was_real(run: rf.RealFaultRun, links: list[str], netns: str) -> None:
    """Workers ran without in-process faults, so recoveries in steps 5..10 prove the kernel cut."""
    result = run.result
    assert sorted(result.records) == list(range(STEPS))
    assert result.all_exact()
    assert {c for _, c in run.applied} == {f"cut {link}" for link in links} | {f"heal cut {link}" for link in links}
    assert all(step == 5 for step, c in run.applied if c.startswith("cut"))
    assert all(step == 11 for step, c in run.applied if c.startswith("heal"))
    for step in range(5, 11):
        events = [e for rec in result.records[step].values() for e in rec.events]
        assert events, f"step {step} ran with a cut link but nobody recovered anything"
    assert fttree_rules(netns) == []


@pytest.mark.realnet
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("memory", [[], ["--no-link-memory"]], ids=["link-memory", "thesis"])
def test_launch_real_cut_one_link(netns: str, memory: list[str]) -> None:
    # "thesis": every step of the window goes through the stalled TCP link and its timeout.
    run = run_real(netns, "cut 1-0 @5..10", *memory)
    assert_cut_was_real(run, ["0-1"], netns)


@pytest.mark.realnet
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_real_two_serial_failures(netns: str) -> None:
    run = run_real(netns, "cut 3-1 @5..10; cut 1-0 @5..10")  # a node's link up, and its parent's
    assert_cut_was_real(run, ["1-3", "0-1"], netns)


@pytest.mark.realnet
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_real_two_parallel_failures(netns: str) -> None:
    run = run_real(netns, "cut 3-1 @5..10; cut 5-2 @5..10")  # two subtrees, one cut each
    assert_cut_was_real(run, ["1-3", "2-5"], netns)


# ---- the command line ------------------------------------------------------------------------


@pytest.mark.realnet
@pytest.mark.timeout(120)
def test_cli_launch_real_faults_and_netem_status(netns: str) -> None:
    out = sh(sys.executable, "-m", "fttree", "launch", "-n", "7", "--steps", "6", "--size", "1000", "--faults",
             "cut 1-0 @2..3", "--real-faults", "--netns", netns, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"real faults before step 2 in {netns}: +cut 0-1" in out.stdout
    assert f"real faults before step 4 in {netns}: -cut 0-1" in out.stdout
    assert "all exact: yes" in out.stdout
    netem("cut.sh", "--netns", netns, "2-0")
    status = sh(sys.executable, "-m", "fttree", "netem", "status", "--netns", netns).stdout
    assert '"fttree cut 0-2"' in status
    assert "2 fttree rules" in sh(sys.executable, "-m", "fttree", "netem", "reset", "--netns", netns).stdout
    assert fttree_rules(netns) == []


def test_cli_netem_path_and_scope_errors() -> None:
    from click.testing import CliRunner

    from fttree.tools.cli import main

    runner = CliRunner()
    assert runner.invoke(main, ["netem", "path"]).output.strip() == str(NETEM)
    bad = runner.invoke(main, ["netem", "status", "--netns", "x", "--all"])
    assert bad.exit_code != 0
    assert "not both" in bad.output


@pytest.mark.realnet
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_real_cut_through_the_last_step(netns: str) -> None:
    # Rank 1 gets its last result only through a backup: the final gate keeps the backups up.
    run = run_real(netns, "cut 1-0 @5..")
    assert run.applied == [(5, "cut 0-1")]
    assert run.result.all_exact()
    assert sorted(run.result.records) == list(range(STEPS))


@pytest.mark.realnet
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_real_cut_heal_cut_with_adaptive_timeouts(netns: str) -> None:
    """A flapping link under the kernel's firewall: cut, healed, cut again; every step exact."""
    run = run_real(netns, "cut 1-0 @3..5; cut 1-0 @9..11", "--timeout-policy", "adaptive")
    result = run.result
    assert sorted(result.records) == list(range(STEPS))
    assert result.all_exact()
    assert [(step, c) for step, c in run.applied] == [(3, "cut 0-1"), (6, "heal cut 0-1"), (9, "cut 0-1"),
                                                       (12, "heal cut 0-1")]
    for step in (3, 9):  # the first step of each cut needed a recovery
        assert any(rec.events for rec in result.records[step].values()), f"step {step}"
    assert fttree_rules(netns) == []
