"""`fttree chaos --side-by-side`: the window arithmetic that turns two jobs' per-second sample
counts into one goodput and its per-window spread, the CPU split and pinning, the options it
refuses, and a short side-by-side run of real processes."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fttree.errors import ConfigError
from fttree.tools.chaos import chaos, prepare_worker
from fttree.tools.chaos_checks import Checks
from fttree.tools.chaos_side import Window, split_cpus, spread, window_bounds, windows

ROOT = Path(__file__).resolve().parent.parent

# ---- the window arithmetic ------------------------------------------------------------------


def test_windows_cover_the_run_in_whole_seconds_the_last_one_shorter() -> None:
    assert window_bounds(1000, 20, 5) == [(1000, 1005), (1005, 1010), (1010, 1015), (1015, 1020)]
    assert window_bounds(1000, 23.7, 10) == [(1000, 1010), (1010, 1020), (1020, 1023)]
    assert window_bounds(1000, 20, 60) == [(1000, 1020)]  # a window longer than the run: the run


@pytest.mark.parametrize(("duration", "window", "says"), [
    (20, 0.5, "--window must be at least 1 s"),
    (20, float("nan"), "--window must be at least 1 s"),
    (0.5, 5, "no whole second"),
])
def test_bad_windows_are_refused_by_name(duration: float, window: float, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        window_bounds(1000, duration, window)


def test_each_window_counts_both_jobs_samples_and_the_windows_add_up() -> None:
    """Per-second counts as the checks keep them: the windows hold exactly the samples the
    whole-run count holds, seconds outside the run (start-up, the stop) count in none."""
    base, chaos_ = Checks(), Checks()
    for sec in range(995, 1025):  # five seconds of start-up before t0 = 1000, five of stopping after
        base.per_second[sec] += 100
        chaos_.per_second[sec] += 50 if 1005 <= sec < 1010 else 100  # a fault costs half in the second window
    bounds = window_bounds(1000, 20, 5)
    ws = windows(base.per_second, chaos_.per_second, bounds, {0: 3.5, 2: 4.0})
    assert [(w.base, w.chaos) for w in ws] == [(500, 500), (500, 250), (500, 500), (500, 500)]
    assert [w.ratio for w in ws] == [1.0, 0.5, 1.0, 1.0]
    assert [w.load for w in ws] == [3.5, None, 4.0, None]
    assert sum(w.base for w in ws) == base.committed_between(1000, 1020) == 2000
    assert sum(w.chaos for w in ws) == chaos_.committed_between(1000, 1020) == 1750


def test_the_spread_leaves_out_windows_where_the_fault_free_job_committed_nothing() -> None:
    ws = [Window(0, 5, 100, 90, None), Window(5, 10, 0, 40, None), Window(10, 15, 100, 110, None),
          Window(15, 20, 100, 100, None)]
    assert ws[1].ratio is None
    sp = spread(ws)
    assert sp is not None
    assert (sp.count, sp.low, sp.median, sp.high) == (3, pytest.approx(0.9), pytest.approx(1.0), pytest.approx(1.1))
    assert sp.sd == pytest.approx(0.1)
    assert "range 0.90-1.10" in str(sp)
    assert spread([Window(0, 5, 0, 10, None)]) is None
    one = spread([Window(0, 5, 100, 97, None)])
    assert one is not None
    assert one.sd == 0.0


# ---- the CPUs ---------------------------------------------------------------------------------


def test_pinning_splits_the_cpus_in_two_halves() -> None:
    assert split_cpus({1, 0}) == (frozenset({0}), frozenset({1}))
    assert split_cpus(range(5)) == (frozenset({0, 1}), frozenset({2, 3, 4}))
    with pytest.raises(ConfigError, match=r"only \[3\]"):
        split_cpus({3})


def test_a_pinned_worker_keeps_to_its_cpus() -> None:
    mine = sorted(os.sched_getaffinity(0))
    cpus = frozenset(mine[-1:])
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         preexec_fn=functools.partial(prepare_worker, cpus), capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == str(sorted(cpus))


@pytest.mark.parametrize(("args", "says"), [
    (["--calibrate"], "add --side-by-side"),
    (["--side-by-side", "--pairs", "2"], "--pairs"),
    (["--side-by-side", "--simulate"], "--simulate"),
    (["--side-by-side", "--cpus", "half"], "'half' is not one of"),
    (["--side-by-side", "--window", "0"], "--window"),
])
def test_options_that_do_not_go_together_are_refused_by_name(args: list[str], says: str) -> None:
    result = CliRunner().invoke(chaos, ["--duration", "10", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output


# ---- a short side-by-side run of real processes -----------------------------------------------


@pytest.mark.timeout(900)  # the command's own deadlines below; a loaded machine takes minutes
def test_a_short_side_by_side_run(tmp_path: Path) -> None:
    """5 fault-free workers beside 5 chaos workers (a small MLP) for 10 s, a kill or (as root) a
    link cut every 2 s on average in the chaos job's own namespace. Both jobs pass every check,
    ran over the same window (every window holds samples of both), and the summary's windows
    add up to each job's samples; no figure is asserted, it is a benchmark's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    keep = tmp_path / "records"
    proc = subprocess.run([sys.executable, "-m", "fttree", "chaos", "-n", "5", "--duration", "10", "--window", "5",
                           "--fault-every", "2", "--seed", "4", "--hidden", "32", "--kinds", "kill,cut",
                           "--side-by-side", "--keep", str(keep)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("goodput "), out
    assert "side by side, CPUs shared" in last, out
    summary = json.loads((keep / "summary.json").read_text())
    side = summary["side_by_side"]
    assert f"{summary['goodput']:.2f}" == last.split()[1]
    assert [(w["start"] - side["t0"], w["end"] - side["t0"]) for w in side["windows"]] == [(0, 5), (5, 10)]
    assert all(w["base"] > 0 and w["chaos"] > 0 for w in side["windows"]), side  # both ran all along
    assert sum(w["base"] for w in side["windows"]) == side["base_samples"] > 0
    assert sum(w["chaos"] for w in side["windows"]) == side["chaos_samples"] > 0
    assert summary["chaos_rate"] / summary["base_rate"] == pytest.approx(side["chaos_samples"] / side["base_samples"])
    assert side["spread"]["count"] == 2
    for job in ("base", "chaos"):  # the checks read both jobs: every rank stepped, an epoch passed its audit
        records = [json.loads(line) for path in sorted((keep / job).glob("rank-*-*.jsonl"))
                   for line in path.read_text().splitlines()]
        assert {r["rank"] for r in records if r["kind"] == "step"} == set(range(5)), job
        assert any(r["kind"] == "epoch" and r["once"] for r in records), job
    assert not (keep / "base" / "faults.jsonl").exists()  # the faults met the chaos job only
    assert (keep / "chaos" / "faults.jsonl").read_text().strip()
    assert summary["faults"], summary
