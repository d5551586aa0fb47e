"""`fttree launch --faults "crash R @S; restart R @T"`: the launcher kills rank R's process and
starts a new one, which finds the running group and joins it (issue 40: through its NAT where
it is behind one). The schedule's checks here; the run in network namespaces below (root)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fttree.core.faults import FaultKind, FaultSchedule
from fttree.errors import ConfigError
from fttree.tools.nodefaults import NodeFault, link_schedule_text, node_faults
from fttree.tools.realfaults import launch_behind_nat

from .test_nat_netns import MLP, our_networks
from .test_realnet import realnet_missing


def test_a_restart_follows_a_crash_of_its_rank_and_stays_out_of_the_workers_schedule() -> None:
    schedule = FaultSchedule("cut 1-0 @5..10; restart 3 @15; crash 3 @12", world=7, launcher=True)
    assert node_faults(schedule, 30) == [
        NodeFault(rank=3, kind=FaultKind.CRASH, first=12, last=12, rule="crash 3 @12"),
        NodeFault(rank=3, kind=FaultKind.RESTART, first=15, last=15, rule="restart 3 @15")]
    assert link_schedule_text(schedule) == "cut 1-0 @5..10"


@pytest.mark.parametrize(("faults", "message"), [
    ("restart 3 @15", "no earlier crash kills"),
    ("crash 3 @15; restart 3 @12", "no earlier crash kills"),
    ("crash 3 @12; restart 3 @15; restart 3 @20", "restarted once per run"),
    ("crash 3 @12; restart 3 @30", "only 30 steps"),
])
def test_a_restart_the_launcher_cannot_carry_out_is_refused_naming_why(faults: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        node_faults(FaultSchedule(faults, world=7, launcher=True), 30)


def test_outside_the_launcher_a_restart_is_still_refused() -> None:
    with pytest.raises(ConfigError, match="starts a process"):
        FaultSchedule("crash 3 @12; restart 3 @15", world=7)


def test_a_rank_behind_a_nat_killed_and_restarted_rejoins_through_its_nat(tmp_path: Path) -> None:
    """Public 0, 1, 2; sites {3, 4} and {5, 6}. Rank 3 is killed before step 12 and a new
    process of it started after step 14, in its site's namespace: it dials out through the NAT,
    is admitted, and is among the contributors again before the run ends; every step that
    counts is exact. (How many steps that takes is the process's start and its admission:
    37 steps of about 90 ms at load average 21; the run leaves 105 steps for it.)"""
    missing = realnet_missing()
    if missing:
        pytest.skip(missing)
    key = tmp_path / "job.key"
    key.write_bytes(os.urandom(32))
    steps = 120
    args = ["--steps", str(steps), "--size", str(MLP), "--auth-key-file", str(key), "--no-http",
            "--step-timeout", "30"]
    lines: list[str] = []
    schedule = FaultSchedule("crash 3 @12; restart 3 @15", world=7, launcher=True)
    result = launch_behind_nat([[3, 4], [5, 6]], 7, args, steps=steps, launch_dir=tmp_path / "launch",
                               deadline_s=400, echo=lines.append, schedule=schedule)
    report = "\n".join(lines)
    assert result.ok, report
    assert result.all_exact(), report
    back = result.back_at(3)
    assert back is not None, report
    assert back > 15, report
    assert result.exit_codes[3] == 0, report
    assert any(line.startswith("rank 3 restarted: among the contributors again") for line in lines), report
    up = result.up_after.get(3)  # its new process said it was up: the heal from there is fttree's
    assert up is not None, report
    assert 14 <= up <= back, report
    assert not [n for n in our_networks() if n.startswith("fttreenat")], "a NAT network was left behind"
