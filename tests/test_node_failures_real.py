"""Node failures with real processes over TCP: `fttree launch` kills (SIGKILL) or stops (SIGSTOP,
then SIGCONT) worker processes by pid at a step, and cuts a partition with iptables.

7 workers, 30 steps, small tensors. For every run: each survivor finishes every step (or raises
the documented error), each result is the sum over the contributors it reports (checked here
again from the reported ranks, not only by the worker), survivors agree bit for bit, and a rank
that was killed or evicted is in no later sum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from fttree.core.faults import FaultKind, FaultSchedule
from fttree.errors import ConfigError
from fttree.tools import realfaults as rf
from fttree.tools.cli import main as cli_main
from fttree.tools.demo import digest, sum_of
from fttree.tools.launch import LaunchResult, launch
from fttree.tools.nodefaults import NODE_TAG, NodeFault, StepGate, link_schedule_text, node_faults

from .conftest import free_port

WORLD, STEPS, SIZE = 7, 30, 1_000
EVERYONE = tuple(range(WORLD))

pytestmark = pytest.mark.timeout(240)


# ---- the plan, without processes ---------------------------------------------------------------


def test_node_faults_are_taken_out_of_the_in_process_schedule() -> None:
    schedule = FaultSchedule("cut 1-0 @5..10; crash 4 @12; hang 2 @14..16; partition 1,3 @20..", world=WORLD)
    assert node_faults(schedule, STEPS) == [
        NodeFault(rank=4, kind=FaultKind.CRASH, first=12, last=12, rule="crash 4 @12"),
        NodeFault(rank=2, kind=FaultKind.HANG, first=14, last=16, rule="hang 2 @14..16")]
    assert link_schedule_text(schedule) == "cut 1-0 @5..10; partition 1,3 @20.."
    (hang,) = node_faults(FaultSchedule("hang 5 @3.."), STEPS)
    assert hang.last == STEPS - 1  # stopped to the end: continued once the others are done


@pytest.mark.parametrize(("faults", "message"), [
    ("crash 4 @12; hang 4 @14", "both strike rank 4"),
    ("crash 4 @30", "only 30 steps"),
])
def test_node_faults_that_cannot_be_carried_out_are_refused(faults: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        node_faults(FaultSchedule(faults, world=WORLD), STEPS)
    out = CliRunner().invoke(cli_main, ["launch", "-n", "7", "--steps", "30", "--faults", faults])
    assert out.exit_code == 2, out.output
    assert message in out.output


def test_a_worker_still_refuses_a_hang_in_process_and_says_who_does_it(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    out = CliRunner().invoke(cli_main, ["worker", "--rank", "0", "--peers", str(peers), "--no-http",
                                        "--faults", "hang 1 @3..4"])
    assert out.exit_code == 1
    assert "carried out by `fttree launch` (SIGSTOP, then SIGCONT)" in out.output


def test_a_partition_is_a_cut_of_every_link_between_its_sides() -> None:
    plan = rf.boundaries(FaultSchedule("partition 1,3,4 @8..12; crash 5 @9", world=WORLD), steps=20, world=WORLD)
    assert sorted(plan) == [8, 13]
    cuts = {rf.Change("cut", f"{min(a, b)}-{max(a, b)}") for a in (1, 3, 4) for b in (0, 2, 5, 6)}
    assert plan[8] == (frozenset(), frozenset(cuts))
    assert plan[13] == (frozenset(cuts), frozenset())


def test_a_node_gate_holds_only_its_own_rank(tmp_path: Path) -> None:
    gate = StepGate(tmp_path, [3], rank=2, timeout_s=0.05, tag=NODE_TAG)
    (tmp_path / "go-3").touch()  # the shared real-fault gate's file does not release it
    with pytest.raises(rf.RealFaultError, match="rank 2 waited"):
        gate(3)
    assert (tmp_path / f"{NODE_TAG}ready-3-2").exists()
    (tmp_path / f"{NODE_TAG}go-3-2").touch()
    gate(3)


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat: T when stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_stopped_victim_is_continued_when_the_driver_closes(tmp_path: Path) -> None:
    """Even when the run ends early (an error, a deadline), no process is left stopped."""
    from fttree.tools.nodefaults import NodeFaultDriver

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], text=True)
    try:
        (fault,) = node_faults(FaultSchedule("hang 0 @0.."), steps=5)
        driver = NodeFaultDriver([fault], world=2, gate_dir=tmp_path, echo=lambda line: None)  # rank 1 never reports
        (tmp_path / f"{NODE_TAG}ready-0-0").touch()  # as the worker's gate would
        with driver:
            driver.start({0: sleeper})
            deadline = time.monotonic() + 30
            while process_state(sleeper.pid) != "T":
                assert time.monotonic() < deadline, "the victim was never stopped"
                time.sleep(0.01)
            assert driver.gone_now() == {0}
            assert (tmp_path / f"{NODE_TAG}go-0-0").exists()  # waiting for it when it wakes up
        assert process_state(sleeper.pid) != "T"
        assert "never continued" not in (driver.fate(0) or "")
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


# ---- real processes ----------------------------------------------------------------------------


def worker_args(schedule: FaultSchedule, *extra: str) -> list[str]:
    args = ["--steps", str(STEPS), "--size", str(SIZE), "--timeout", "0.3", "--step-timeout", "20",
            "--startup-timeout", "60", "--no-http", *extra]
    link = link_schedule_text(schedule)
    return [*args, "--faults", link] if link else args


def run(faults: str, *extra: str) -> tuple[LaunchResult, list[str]]:
    """One launch with the node faults carried out on the processes; the table's lines come back."""
    lines: list[str] = []
    schedule = FaultSchedule(faults, world=WORLD)
    result = launch(WORLD, worker_args(schedule, *extra), steps=STEPS, port=free_port(), deadline_s=200,
                    echo=lines.append, schedule=schedule)
    return result, lines


def step_line(lines: Sequence[str], step: int) -> str:
    return next(line for line in lines if line.startswith(f"step {step:3d} "))


def check_survivors(result: LaunchResult, lines: Sequence[str], gone: dict[int, int]) -> None:
    """`gone`: rank -> the first step it is not in. Everything the issue asks of a lossy-forward run."""
    text = "\n".join(lines)
    survivors = [r for r in EVERYONE if r not in gone]
    assert result.survivors == survivors, text
    for step in range(STEPS):
        recs = result.records[step]
        assert set(survivors) <= set(recs), f"step {step}: no report from {set(survivors) - set(recs)}\n{text}"
        ours = [recs[r] for r in survivors]
        for rec in ours:
            assert not rec.error, f"rank {rec.rank} step {step}: {rec.error}\n{text}"
            assert rec.exact, f"rank {rec.rank} step {step} is not the sum of its contributors {rec.ranks}"
            assert rec.digest == digest(sum_of(rec.ranks, step, SIZE)), f"rank {rec.rank} step {step}"
        assert len({(rec.digest, tuple(rec.ranks)) for rec in ours}) == 1, f"step {step}: survivors differ\n{text}"
        ranks = set(ours[0].ranks)
        assert set(survivors) <= ranks, f"step {step}: survivors {set(survivors) - ranks} missing from the sum"
        for rank, first in gone.items():
            if step >= first:
                assert rank not in ranks, f"step {step}: rank {rank}, gone at step {first}, is in the sum {ranks}"
        if step < min(gone.values()):
            assert ranks == set(EVERYONE), f"step {step} before any fault lost {set(EVERYONE) - ranks}"
    for rank in survivors:
        assert result.exit_codes[rank] == 0, f"survivor {rank} exited with {result.exit_codes[rank]}\n{text}"
    assert result.ok, text
    assert "all exact: yes" in text


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "what"), [(4, "leaf"), (1, "interior"), (0, "root")])
def test_sigkill_at_step_12(victim: int, what: str) -> None:
    result, lines = run(f"crash {victim} @12")
    check_survivors(result, lines, {victim: 12})
    assert result.exit_codes[victim] == -9
    assert result.fates[victim].startswith("killed by fault injection"), result.fates
    assert victim in result.records[11]  # it reported the step before its death
    assert victim not in result.records[12]
    line = step_line(lines, 12)
    assert f"sum of 6/7 (without {victim})" in line
    assert f"rank {victim} killed (crash {victim} @12)" in line
    assert "view 1: " in line
    assert any(line.startswith(f"worker {victim}: killed by fault injection") for line in lines)
    assert not any(f"worker {r} exited" in line for line in lines for r in EVERYONE), lines


@pytest.mark.slow
def test_sigstop_of_one_worker() -> None:
    result, lines = run("hang 2 @12..14")
    check_survivors(result, lines, {2: 12})
    assert "SIGCONT after the others finished step 14" in result.fates[2]
    woke = [result.records[s][2] for s in range(12, STEPS) if 2 in result.records[s]]
    assert woke, "the hung worker never reported after SIGCONT"
    assert all(rec.error_kind == "GroupLeft" for rec in woke), [rec.error for rec in woke]
    assert "stopped (hang 2 @12..14)" in step_line(lines, 12)


@pytest.mark.slow
def test_two_workers_killed_in_one_step() -> None:
    result, lines = run("crash 2 @12; crash 3 @12")  # an interior rank and a leaf of the other subtree
    check_survivors(result, lines, {2: 12, 3: 12})
    assert result.exit_codes[2] == result.exit_codes[3] == -9
    assert "sum of 5/7 (without 2, 3)" in step_line(lines, 12)


@pytest.mark.slow
def test_abort_policy_raises_on_every_survivor_then_goes_on() -> None:
    result, lines = run("crash 1 @12", "--on-node-failure", "abort")
    text = "\n".join(lines)
    survivors = [r for r in EVERYONE if r != 1]
    assert result.survivors == survivors
    for rank in survivors:
        rec = result.records[12][rank]
        assert rec.error_kind == "StepAborted", (rank, rec.error)
        assert "ranks [1] failed during step 12" in rec.error
        assert "on_node_failure='abort'" in rec.error
    for step in [*range(12), *range(13, STEPS)]:
        recs = [result.records[step][r] for r in survivors]
        assert all(rec.exact and not rec.error for rec in recs), f"step {step}\n{text}"
        assert len({rec.digest for rec in recs}) == 1
        assert (1 in recs[0].ranks) == (step < 12)
    assert not result.ok  # an aborted step is a failed step: launch exits 1


@pytest.fixture
def real_faults() -> None:
    from .test_realnet import realnet_missing

    missing = realnet_missing()
    if missing:
        pytest.skip(f"the partition is cut with iptables in a network namespace: {missing}")


@pytest.mark.slow
@pytest.mark.realnet
@pytest.mark.usefixtures("real_faults")
def test_partition_majority_goes_on_minority_stops() -> None:
    lines: list[str] = []
    schedule = FaultSchedule("partition 1,3,4 @12..20", world=WORLD)
    run_ = rf.launch_with_real_faults(schedule, WORLD, worker_args(FaultSchedule()), steps=STEPS,
                                      netns=f"fttree-nf-{os.getpid()}", port=free_port(), deadline_s=200,
                                      echo=lines.append)
    result = run_.result
    text = "\n".join(lines)
    assert {c for _, c in run_.applied if not c.startswith("heal")} == {
        f"cut {min(a, b)}-{max(a, b)}" for a in (1, 3, 4) for b in (0, 2, 5, 6)}
    assert result.survivors == [0, 2, 5, 6], text
    check_survivors(result, lines, {1: 12, 3: 12, 4: 12})
    for rank in (1, 3, 4):
        assert all(result.records[s][rank].exact for s in range(12)), f"rank {rank} before the partition"
        first = result.records[12][rank]
        assert first.error_kind == "GroupLeft", (rank, first.error)
        assert "minority 3 of 7" in first.error
        later = [result.records[s][rank] for s in range(12, STEPS)]
        assert all(rec.error_kind == "GroupLeft" for rec in later), f"rank {rank} produced a result after leaving"
        assert result.left_at(rank) == 12
    assert "left the group at step 12, cut off by partition 1,3,4 @12..20" in text


@pytest.mark.slow
def test_cli_launch_kills_for_real_and_exits_0() -> None:
    """The issue's command line: the killed worker is fault injection, not a failure of the run."""
    cmd = [sys.executable, "-m", "fttree", "launch", "-n", "7", "--steps", "30", "--faults", "crash 1 @12",
           "--size", str(SIZE), "--timeout", "0.3", "--port", str(free_port()), "--no-http"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "fault injection: SIGKILL rank 1 (pid " in out
    assert "sum of 6/7 (without 1)" in out
    assert "worker 1: killed by fault injection (crash 1 @12): SIGKILL of pid" in out
    assert "(exit code -9)" in out
    assert "all exact: yes" in out


# ---- training through a crash ------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def train(script: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[float]]:
    """Run a training example on 7 workers; rank 0's loss per step comes back."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "-n", "7", "--steps", "30", *args],
                          capture_output=True, text=True, timeout=400, check=False)
    losses = {int(line.split()[1]): float(line.split("loss ")[1].split()[0])
              for line in proc.stdout.splitlines() if line.startswith("step ") and "loss " in line}
    assert sorted(losses) == list(range(30)), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, [losses[s] for s in range(30)]


def assert_still_learning(losses: list[float]) -> None:
    """The loss keeps falling after the crash at step 12, not only before it."""
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    before, around, end = mean(losses[:5]), mean(losses[10:15]), mean(losses[25:])
    assert before > around > end, (before, around, end, losses)
    assert end < losses[12] - 0.2, losses


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_train_mlp_trains_to_the_end_through_a_crash() -> None:
    proc, losses = train("train_mlp.py", "--faults", "crash 4 @12")
    assert_still_learning(losses)
    assert "evicted [4]" in proc.stdout + proc.stderr
    # the crashed rank ends as the run asked it to, and nobody else stops
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_train_ddp_on_the_fttree_backend_survives_a_crash() -> None:
    proc, losses = train("train_ddp.py", "--faults", "crash 4 @12")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_still_learning(losses)
    assert "workers 7" in proc.stdout
    assert "workers_at_end 6" in proc.stdout
