"""`fttree chaos`: the schedule (seeded, reproducible, never below a majority), the checks (each
wrong result fails loudly with its reason), and a short seeded chaos run of real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fttree.errors import ConfigError
from fttree.tools import chaos_schedule as cs
from fttree.tools.chaos import Measure, Run, RunResult, evicted_by, segment
from fttree.tools.chaos_checks import ChaosFailure, Checks

ROOT = Path(__file__).resolve().parent.parent

# ---- the schedule ---------------------------------------------------------------------------


def disturbed_at(faults: list[cs.Fault], t: float, heal: float) -> set[int]:
    return {r for f in faults if f.at_s <= t < f.busy_until(heal) for r in f.ranks}


def test_the_schedule_is_seeded_and_mixes_every_kind() -> None:
    a = cs.draw(7, 3600, 5, seed=11)
    assert a == cs.draw(7, 3600, 5, seed=11)
    assert a != cs.draw(7, 3600, 5, seed=12)
    assert {f.kind for f in a} == set(cs.KINDS)
    assert all(0 <= f.at_s < 3600 for f in a)
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    for f in a:
        low, high = cs.HOLD_S[f.kind]
        assert low <= f.hold_s <= high
        assert len(f.ranks) == (2 if f.kind in cs.LINK_KINDS else 1)
        assert len(set(f.ranks)) == len(f.ranks)
        assert (f.percent in cs.LOSS_PERCENTS) == (f.kind == cs.LOSS)


@pytest.mark.parametrize("world", [3, 5, 7, 8])
def test_the_schedule_never_disturbs_a_majority(world: int) -> None:
    """At every fault's start (where the disturbed set grows), the untouched ranks are a majority
    of the world, and no rank is hit twice at once; the rate makes faults overlap often."""
    heal = 10.0
    kinds = cs.KINDS if world >= 5 else (cs.KILL, cs.STOP, cs.LEAVE)
    faults = cs.draw(world, 2000, 1.0, seed=world, kinds=kinds, heal_allowance_s=heal)
    most = 0
    for f in faults:
        before = disturbed_at([g for g in faults if g is not f], f.at_s, heal)
        assert not set(f.ranks) & before, f
        now = before | set(f.ranks)
        most = max(most, len(now))
        assert 2 * (world - len(now)) > world, (f, now)
    assert most == cs.max_disturbed(world)  # the rule binds: the schedule went up to it


def test_the_rule_at_run_time() -> None:
    assert cs.allowed(set(), (0,), 7)
    assert cs.allowed({1, 2}, (0,), 7)
    assert not cs.allowed({1, 2, 3}, (0,), 7)
    assert not cs.allowed({1}, (1,), 7)
    assert not cs.allowed({1, 2}, (3, 4), 7)


@pytest.mark.parametrize(("call", "says"), [
    (lambda: cs.draw(2, 10, 1, 0), "at least 3 workers"),
    (lambda: cs.draw(4, 10, 1, 0), "at least 5 workers"),
    (lambda: cs.draw(7, 0, 1, 0), "must be > 0"),
    (lambda: cs.draw(7, 10, float("nan"), 0), "must be > 0"),
    (lambda: cs.parse_kinds("kill,explode"), "explode"),
    (lambda: cs.parse_kinds(" , "), "comma-separated"),
])
def test_bad_schedules_are_refused_by_name(call: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        call()


# ---- the checks -----------------------------------------------------------------------------


def step(rank: int, n: int, contributors: tuple[int, ...] = (0, 1, 2), digest: str = "aa", **kw: Any) -> dict[str, Any]:
    rec = {"kind": "step", "rank": rank, "pid": 100 + rank, "t": 1000.0 + n, "step": n, "epoch": 0,
           "contributors": list(contributors), "late": [], "trained": 10, "waiting": False, "skipped": False,
           "digest": digest, "rss": 100 << 20, "notes": []}
    return {**rec, **kw}


def epoch(rank: int, number: int, **kw: Any) -> dict[str, Any]:
    rec = {"kind": "epoch", "rank": rank, "pid": 100 + rank, "t": 0.0, "epoch": number, "complete": True,
           "samples": 30, "committed": 30, "distinct": 30, "repeated": 0, "missing": 0, "once": True}
    return {**rec, **kw}


def test_agreeing_records_pass_and_count_the_samples() -> None:
    c = Checks()
    for n in range(3):
        for r in range(3):
            c.feed(step(r, n, digest=f"d{n}"))
    for r in range(3):
        c.feed(epoch(r, 0))
    assert c.committed_between(1000, 1002) == 60  # steps 0 and 1, three ranks of 10
    assert c.epochs_once == 1


@pytest.mark.parametrize(("records", "says"), [
    ([step(0, 5, digest="aa"), step(1, 5, digest="bb")], "wrong sum: after step 5 rank 0 holds parameters aa"),
    ([step(0, 5), step(1, 5, contributors=(0, 1))], "wrong contributors: step 5 has contributors"),
    ([step(2, 5, skipped=True)], "lists rank 2, which reported it as skipped"),
    ([step(0, 5, contributors=(0, 1), trained=0), step(2, 5, contributors=(0, 1), skipped=True, trained=0),
      step(1, 5, contributors=(0, 1, 2))], "step 5 has contributors"),
    ([step(2, 5, contributors=(0, 1))], "rank 2 trained 10 samples in step 5 but is not among"),
    ([epoch(0, 3, committed=31, repeated=1, once=False)], "epoch 3 finished but not exactly once.*1 samples "
                                                          "committed twice"),
    ([epoch(0, 3, committed=29, distinct=29, missing=1, once=False)], "epoch 3 finished.*1 missing"),
    ([epoch(0, 3, complete=False, once=False, committed=12, distinct=11, repeated=1, missing=19)],
     "stopped early.*1 samples twice"),
    ([epoch(0, 3), epoch(1, 3, committed=29, distinct=29, missing=1, complete=False, once=False)],
     "epoch 3: rank 0 audited"),
])
def test_each_wrong_result_fails_loudly(records: list[dict[str, Any]], says: str) -> None:
    c = Checks()
    for rec in records[:-1]:
        c.feed(rec)  # each alone is right
    with pytest.raises(ChaosFailure, match=says):
        c.feed(records[-1])


def test_memory_growth_fails_and_a_flat_process_passes() -> None:
    c = Checks(warm_steps=5, rss_limit_bytes=10 << 20)
    for n in range(50):
        c.feed(step(0, n, rss=(100 << 20) + (n % 3 << 20)))  # a few MiB of noise: flat
    for n in range(15):
        c.feed(step(1, n, rss=(100 << 20) + (n << 20)))  # 1 MiB a step: 104 MiB after 5 steps, 114 after 15
    with pytest.raises(ChaosFailure, match=r"memory growth: process 101 grew from 104 MiB \(first 5 steps\) to 115"):
        c.feed(step(1, 15, rss=115 << 20))


def test_the_checks_keep_a_window_not_every_step() -> None:
    c = Checks()
    for n in range(2000):
        c.feed(step(0, n, digest=str(n)))
    assert len(c.digests) <= 300
    assert len(c.contributors) <= 300


def test_a_heal_is_credited_to_its_own_restart_not_a_later_one() -> None:
    """Rank 1 killed twice; the first restart never contributes: the second restart's step heals
    only the second kill (crediting the first would report a heal of the whole gap)."""
    run = Run.__new__(Run)
    first = Measure(cs.Fault(0.0, cs.KILL, (1,), 1.0), t_fault=1000.0, t_end=1001.0, t_back=1001.0, pid_back=201)
    second = Measure(cs.Fault(20.0, cs.KILL, (1,), 1.0), t_fault=1020.0, t_end=1021.0, t_back=1021.0, pid_back=301)
    for m in (first, second):
        run._measure(m, step(1, 25, pid=301))
    assert first.healed_s is None
    assert second.healed_s == pytest.approx(5.0)


def test_a_heal_is_split_into_the_scripts_start_up_and_fttrees_part() -> None:
    """Killed at 1000 s, restarted at 1002; the new process (pid 301) is up at 1010, built its
    model at 1013 and contributes at 1015: fttree's part is the last 2 s. Another process's
    records (pid 999) change nothing."""
    run = Run.__new__(Run)
    m = Measure(cs.Fault(0.0, cs.KILL, (1,), 2.0), t_fault=1000.0, t_end=1002.0, t_back=1002.0, pid_back=301)
    run.measures = [m]
    assert m.heal_parts() is None
    for kind, t, pid in (("up", 1010.0, 301), ("up", 1011.0, 999), ("ready", 1013.0, 301), ("ready", 1014.0, 999)):
        run._started({"kind": kind, "rank": 1, "pid": pid, "t": t})
    assert m.heal_parts() is None  # not healed yet
    run._measure(m, step(1, 25, pid=301, t=1015.0))
    parts = m.heal_parts()
    assert parts is not None
    assert (parts.down, parts.imports, parts.setup, parts.fttree) == pytest.approx((2.0, 8.0, 3.0, 2.0))


def test_pairs_split_one_schedule_and_sum_the_segments() -> None:
    """--pairs 3 of 90 s: each chaos segment plays its own 30 s of the one drawn schedule, timed
    from the segment's start, so every fault is played once; goodput sums samples and seconds."""
    faults = cs.draw(7, 90.0, 3.0, seed=5, kinds=cs.KINDS)
    parts = [segment(faults, i * 30.0, 30.0) for i in range(3)]
    assert sum(len(p) for p in parts) == len(faults) > 10
    assert all(0.0 <= f.at_s < 30.0 for p in parts for f in p)
    assert [(f.kind, f.ranks, f.hold_s) for p in parts for f in p] == [(f.kind, f.ranks, f.hold_s) for f in faults]
    a, b = RunResult(100, 10.0, 5, 1, evictions=1), RunResult(300, 20.0, 7, 2, evictions=0)
    total = a + b
    assert (total.samples, total.seconds, total.steps, total.epochs_once, total.evictions) == (400, 30.0, 12, 3, 1)
    assert total.rate == pytest.approx(400 / 30)


def test_an_eviction_is_credited_to_the_stop_that_caused_it() -> None:
    old = Measure(cs.Fault(0.0, cs.STOP, (2,), 1.0), t_fault=1000.0)  # ended, never evicted
    new = Measure(cs.Fault(30.0, cs.STOP, (2,), 20.0), t_fault=1030.0)
    other = Measure(cs.Fault(31.0, cs.STOP, (3,), 20.0), t_fault=1031.0)
    assert evicted_by([old, new, other], 2) is new
    assert evicted_by([old, new, other], 4) is None


# ---- a short chaos run of real processes ----------------------------------------------------


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_worker_ends_when_its_runner_is_killed(tmp_path: Path) -> None:
    """A runner killed with SIGKILL (a test's deadline does that) has no time to end its workers:
    the kernel ends them (die_with_parent), where they were left running before."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import subprocess, sys, time\n"
            "from fttree.tools.chaos import die_with_parent\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], preexec_fn=die_with_parent)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n")
    runner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert runner.stdout is not None
    worker = int(runner.stdout.readline())
    try:
        assert not _gone(worker)
        runner.kill()
        runner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(worker):
            assert time.monotonic() < deadline, f"worker {worker} still running 30 s after its runner was killed"
            time.sleep(0.05)
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)




@pytest.mark.timeout(900)  # the command's own deadline below; a loaded machine takes minutes
def test_a_short_seeded_chaos_run(tmp_path: Path) -> None:
    """5 workers (a small MLP), 20 s fault-free and 20 s under a fault every 2 s: stragglers,
    kills with restarts, and as root cuts and loss bursts of random links. The run passes every check (same digests,
    same contributors, every epoch once, no hang, flat RSS), its last line is the goodput, and
    the records and summary.json show the faults were felt and every kill healed. Deadlines are
    the command's own, every wait naming what it waited for; the test's is a backstop."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    keep = tmp_path / "records"
    proc = subprocess.run([sys.executable, "-m", "fttree", "chaos", "-n", "5", "--duration", "20",
                           "--fault-every", "2", "--seed", "4", "--hidden", "32", "--kinds", "straggler,kill,cut,loss",
                           "--keep", str(keep)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("goodput "), out
    assert 0 < float(last.split()[1]) < 2, out
    records = [json.loads(line) for path in sorted((keep / "chaos-0").glob("rank-*-*.jsonl"))
               for line in path.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert {r["rank"] for r in steps} == set(range(5))
    assert any(r["kind"] == "epoch" and r["once"] for r in records)
    summary = json.loads((keep / "summary.json").read_text())
    assert f"{summary['goodput']:.2f}" == last.split()[1]
    [pair] = summary["pairs"]  # the one pair's rates make the goodput, each with the load it met
    assert pair["chaos_rate"] / pair["base_rate"] == pytest.approx(summary["goodput"])
    assert pair["base_load"] > 0, pair  # measured: five workers were running
    assert pair["chaos_load"] > 0, pair
    kinds = {f["kind"] for f in summary["faults"]}
    assert {"straggler", "kill"} <= kinds, summary["faults"]  # the schedule fired both
    for f in summary["faults"]:
        if f["kind"] == "kill":  # every restart healed, and its heal adds up from its parts
            assert f["healed_s"] is not None, f
            assert f["heal_parts"] is not None, f
            assert sum(f["heal_parts"].values()) == pytest.approx(f["healed_s"]), f
