"""Smoke tests of the benchmark harness: tiny tensors, few steps; they check structure, never timing."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fttree.core.faults import FaultSchedule
from fttree.errors import ConfigError
from fttree.tools import analyze, longrun
from fttree.tools.bench_cli import analyze as analyze_cmd
from fttree.tools.bench_cli import bench as bench_cmd
from fttree.tools.bench_patterns import HANG_STEPS, NODE_LATER, PATTERNS, WARMUP_STEPS, pattern_links
from fttree.tools.bench_plan import BenchOptions, fault_plan, plan
from fttree.tools.bench_report import render
from fttree.tools.bench_run import execute, machine_info, worker_commands
from fttree.tools.bench_spec import RunResult, RunSpec
from fttree.tools.bench_summary import Summary
from fttree.tools.bench_worker import Payload
from fttree.tools.units import parse_size

from .test_protocol_sim import bridgeable as protocol_bridgeable


@pytest.mark.parametrize("world", [3, 7, 10, 15])
def test_bridgeable_is_the_rule_of_the_protocol_tests(world: int) -> None:
    rng = random.Random(world)
    links = analyze.all_links(world)
    for _ in range(300):
        failed = set(rng.sample(links, rng.randint(0, min(6, len(links)))))
        assert analyze.bridgeable(world, failed) == protocol_bridgeable(world, failed), sorted(failed)


def test_tolerated_failures_stops_at_the_first_unbridgeable_failure() -> None:
    world = 15
    links = analyze.all_links(world)
    for seed in range(50):
        tolerated = analyze.tolerated_failures(world, random.Random(seed))
        order = links[:]
        random.Random(seed).shuffle(order)
        assert analyze.bridgeable(world, set(order[:tolerated]))
        assert not analyze.bridgeable(world, set(order[:tolerated + 1]))


def test_three_workers_always_survive_exactly_one_failure() -> None:
    (res,) = analyze.monte_carlo([1], trials=50)
    assert (res.world, res.links, res.min_tolerated, res.max_tolerated) == (3, 3, 1, 1)
    assert res.mean_percent == pytest.approx(100 / 3)


def test_analyze_command_writes_json_and_png(tmp_path: Path) -> None:
    out = CliRunner().invoke(analyze_cmd, ["--heights", "1,2", "--trials", "30", "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    data = json.loads((tmp_path / "fig11.json").read_text())
    assert [r["world"] for r in data["results"]] == [3, 7]
    assert (tmp_path / "fig11.png").stat().st_size > 0


def test_sizes_parse_to_float32_elements() -> None:
    assert parse_size("4KB") == 1000
    assert parse_size("mlp") == 407_050
    assert parse_size("100MB") == 25_000_000
    assert parse_size("1MiB") == 262_144
    assert parse_size("12") == 12
    for bad in ("4XB", "", "2B"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_fault_plan_puts_the_first_window_at_steps_5_to_10() -> None:
    steps, schedule, windows, skipped = fault_plan(7, PATTERNS, window=6, gap=4, clean_steps=10)
    assert windows == (("1", 5, 10), ("2p", 15, 20), ("2s", 25, 30))
    assert steps == 35
    assert skipped == []
    faults = FaultSchedule(schedule, world=7)
    assert faults.verdict(1, 0, 5).drop
    assert faults.verdict(0, 1, 10).drop
    assert not faults.verdict(1, 0, 11).drop
    assert faults.verdict(5, 2, 15).drop
    assert faults.verdict(3, 1, 20).drop
    assert not faults.verdict(5, 2, 25).drop
    assert faults.verdict(1, 0, 25).drop
    assert faults.verdict(3, 1, 30).drop


def test_two_faults_are_not_applicable_to_three_workers() -> None:
    _steps, schedule, windows, skipped = fault_plan(3, PATTERNS, window=6, gap=4, clean_steps=10)
    assert windows == (("1", 5, 10),)
    assert schedule == "cut 1-0 @5..10"
    assert skipped == ["2p", "2s"]
    assert pattern_links(3, "2p") is None
    assert pattern_links(7, "2p") == [(3, 1), (5, 2)]


def test_payload_sum_is_checked_exactly() -> None:
    world, step = 4, 3
    parts = [Payload(r, world, 37) for r in range(world)]
    total = np.sum([p.fill(step).copy() for p in parts], axis=0)
    assert parts[0].check(total, step)
    total[5] += 1
    assert not parts[0].check(total, step)
    assert not parts[0].check(total[:-1], step)


def _fake_run(world: int, timeout_s: float, times: dict[str, float], windows: tuple[tuple[str, int, int], ...],
              steps: int, kind: str = "fttree") -> RunResult:
    spec = RunSpec(kind=kind, world=world, size=407_050, steps=steps, timeout_s=timeout_s, windows=windows)
    res = RunResult(spec=spec)
    for s in range(steps):
        for r in range(world):
            t = times[spec.pattern_of(s)] * (1 + 0.01 * r)
            res.records[s][r] = {"rank": r, "step": s, "duration_s": t, "exact": True, "error": "", "events": []}
    return res


def test_summary_medians_targets_and_table() -> None:
    opts = BenchOptions(workers=(7,), timeouts=(0.5,), policies=("static",), sweep_workers=(), sweep_sizes=())
    steps, _, windows, _ = fault_plan(7, PATTERNS, 6, 4, 10)
    ft = _fake_run(7, 0.5, {"none": 0.05, "1": 0.55, "2p": 0.62, "2s": 1.4}, windows, steps)
    plain = _fake_run(7, 0.5, {"none": 0.045}, (), 12, kind="plain")
    gloo = _fake_run(7, 0.5, {"none": 0.04}, (), 12, kind="gloo")
    summary = Summary(opts=opts, results=[ft, plain, gloo], notes=["a note"])
    assert ft.median("1") == pytest.approx(0.55 * 1.06)  # slowest of 7 ranks
    assert len(ft.times("none")) == steps - WARMUP_STEPS - 18
    targets = dict((text.split(":")[0], met) for met, text in summary.targets())
    assert targets["no fault, 7 workers, 1.63 MB"] is False  # 0.053 > gloo's 0.0424
    assert targets["no fault, 7 workers"] is True  # 1.11 x plain
    assert targets["1 fault, 7 workers, t=0.5 s"] is True
    assert targets["2 serial, 7 workers, t=0.5 s"] is False  # 2.6 t extra
    table = render(summary)
    for expected in ("[0.033]", "[1.449]", "[1.495]", "[2.822]", "fttree/gloo", "MISS", "note: a note"):
        assert expected in table
    data = summary.to_json(machine_info(), ["fttree", "bench"])
    assert json.loads(json.dumps(data, default=str))["runs"][0]["medians_s"]["2s"] == pytest.approx(1.4 * 1.06)


def test_failed_steps_stay_out_of_medians_and_miss_the_target() -> None:
    opts = BenchOptions(workers=(7,), timeouts=(0.5,), policies=("static",), sweep_workers=(), sweep_sizes=())
    steps, _, windows, _ = fault_plan(7, PATTERNS, 6, 4, 10)
    ft = _fake_run(7, 0.5, {"none": 0.05, "1": 0.3, "2p": 0.3, "2s": 0.3}, windows, steps)
    for rec in ft.records[5].values():  # the first step of the 1-fault window
        rec.update(duration_s=15.0, exact=False, error="step 5 aborted: no contribution from ranks [1]")
    assert ft.failed_steps() == [5]
    assert not ft.ok
    assert max(ft.times("1")) < 1.0
    assert ft.first_of_window("1") is None
    summary = Summary(opts=opts, results=[ft], notes=[])
    met = {text.split(":")[0]: m for m, text in summary.targets()}
    assert met["1 fault, 7 workers, t=0.5 s"] is False
    assert met["2 serial, 7 workers, t=0.5 s"] is True
    assert "no contribution from ranks [1]" in render(summary)


def test_both_timeout_policies_get_a_column() -> None:
    opts = BenchOptions(workers=(7,), timeouts=(0.5,), sweep_workers=(), gloo=False, plain=False,
                          node_patterns=())
    runs, _ = plan(opts)
    assert [r.policy for r in runs] == ["static", "adaptive"]
    cmd = worker_commands(runs[1], Path("/tmp"))[0]
    assert cmd[cmd.index("--timeout-policy") + 1] == "adaptive"


@pytest.mark.slow
def test_fault_run_records_every_rank_and_the_recovery(tmp_path: Path) -> None:
    spec = RunSpec(kind="fttree", world=3, size=64, steps=3, warmup=1, timeout_s=0.2, faults="cut 1-0 @2",
                     windows=(("1", 2, 2),), step_timeout_s=20)
    res = execute(spec, tmp_path)
    assert res.ok, (res.error, res.stderr_tail)
    assert res.complete_steps() == [0, 1, 2]
    assert res.exit_codes == {0: 0, 1: 0, 2: 0}
    assert res.times("none")
    assert res.times("1")
    events = [e for rec in res.records[2].values() for e in rec["events"]]
    assert {"data_came_around", "data_relayed"} & {e["cause"] for e in events if e["link"] == "1-0"}, events


def test_a_worker_that_dies_ends_the_run_with_its_reason(tmp_path: Path) -> None:
    spec = RunSpec(kind="fttree", world=2, size=8, steps=2, faults="cut 5-0")  # rank 5 is not in a world of 2
    res = execute(spec, tmp_path)
    assert not res.ok
    assert "exited" in res.error
    assert any("rank 5" in line for tail in res.stderr_tail.values() for line in tail), res.stderr_tail


@pytest.mark.slow
def test_bench_command_end_to_end(tmp_path: Path) -> None:
    args = ["--workers", "3", "--timeouts", "0.5", "--patterns", "none", "--policies", "static", "--size", "256",
            "--sizes", "1KB", "--sweep-workers", "3", "--clean-steps", "3", "--fig11-trials", "20",
            "--strict", "--out", str(tmp_path)]
    out = CliRunner().invoke(bench_cmd, args)
    assert out.exit_code == 0, out.output
    assert "fttree/gloo" in out.output
    assert "fttree/plain" in out.output
    data = json.loads((tmp_path / "bench.json").read_text())
    kinds = sorted((r["spec"]["kind"], r["spec"]["purpose"]) for r in data["runs"])
    assert kinds == [("fttree", "matrix"), ("fttree", "sweep"), ("fttree", "sweep"), ("fttree", "sweep"),
                     ("gloo", "matrix"), ("gloo", "sweep"), ("plain", "matrix")]  # sweep: single, double, rotated
    assert sorted(r["spec"]["trees"] for r in data["runs"] if r["spec"]["purpose"] == "sweep"
                  and r["spec"]["kind"] == "fttree") == ["double", "rotated", "single"]
    assert all(r["ok"] for r in data["runs"])
    assert all(len(recs) == 3 for r in data["runs"] for recs in r["records"].values())
    assert data["fig11"]["results"][0]["world"] == 3
    for png in ("fig14_3workers.png", "size_sweep.png", "fig11.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_long_run_figure_compares_the_last_500_steps_with_steps_100_to_599() -> None:
    spec = longrun.spec(2000)
    assert (spec.world, spec.size, spec.chunk_bytes) == (3, 25_600, 4096)  # 25 chunks a step

    def run(step_time: Callable[[int], float]) -> RunResult:
        res = RunResult(spec=spec)
        for s in range(2000):
            for r in range(3):
                res.records[s][r] = {"rank": r, "step": s, "duration_s": step_time(s) * (1 + 0.01 * r),
                                     "exact": True, "error": "", "events": []}
        return res

    flat = longrun.figure(run(lambda s: 0.05 if s >= 20 else 0.5))  # slow start-up steps do not count
    assert flat.ratio == pytest.approx(1.0)
    assert flat.met
    growing = longrun.figure(run(lambda s: 0.05 * (1 + s / 1000)))
    assert growing.late_median_s == pytest.approx(0.05 * 1.02 * (1 + 1749.5 / 1000), rel=1e-3)
    assert not growing.met
    assert "MISSED" in longrun.render(growing)
    with pytest.raises(ValueError, match="at least 1100 steps"):
        longrun.spec(1000)


def test_long_run_reports_the_largest_rank_s_bookkeeping_at_step_599_at_the_end_and_at_its_peak(tmp_path: Path) -> None:
    spec = longrun.spec(1200)
    assert spec.footprint_every == longrun.FOOTPRINT_EVERY
    assert "--footprint-every" in worker_commands(spec, tmp_path)[0]
    res = RunResult(spec=spec)
    for s in range(1200):
        for r in range(3):
            res.records[s][r] = {"rank": r, "step": s, "duration_s": 0.02, "exact": True, "error": "", "events": []}
            if (s + 1) % spec.footprint_every == 0:  # rank 2's ops peak at step 899
                ops = 40 + r + (30 if (r, s) == (2, 899) else 0)
                res.footprints[r].append((s, {"ops": ops, "rss_kib": 1000 * (r + 1) + s}))
    fig = longrun.figure(res)
    assert fig.footprint_early == {"ops": 42, "rss_kib": 3599}
    assert fig.footprint_late == {"ops": 42, "rss_kib": 4199}
    assert fig.footprint_peak == {"ops": 72, "rss_kib": 4199}
    assert "ops 42 / 42 / 72, rss_kib 3599 / 4199 / 4199" in longrun.render(fig)
    assert fig.to_json()["footprint_peak"] == {"ops": 72, "rss_kib": 4199}


def test_node_patterns_are_runs_of_their_own_beside_a_plain_tree_of_the_survivors() -> None:
    opts = BenchOptions(workers=(3, 7), timeouts=(0.5,), policies=("static", "adaptive"), sweep_workers=(),
                          gloo=False, plain=False)
    runs, notes = plan(opts)
    node = {(r.world, r.node_faults) for r in runs if r.purpose == "node"}
    assert node == {(7, "crash 4 @8"), (7, "crash 1 @8"), (7, "crash 0 @8"), (7, "hang 2 @8..10"),
                    (3, "crash 2 @8"), (3, "crash 0 @8"), (3, "hang 2 @8..10")}
    assert all(r.policy == "adaptive" and not r.faults for r in runs if r.purpose == "node")
    assert sorted(r.world for r in runs if r.purpose == "survivors") == [2, 6]
    assert any("crash interior" in n and n.startswith("3 workers") for n in notes)
    hang = next(r for r in runs if r.node_faults.startswith("hang") and r.world == 7)
    assert hang.steps == 8 + HANG_STEPS + NODE_LATER
    assert hang.pattern_of(7) == "none"
    assert hang.pattern_of(10) == "hang"
    assert hang.pattern_of(11) == "after"


@pytest.mark.slow
def test_node_failure_pattern_runs_and_prints_its_columns(tmp_path: Path) -> None:
    """A worker process really killed: the run completes on the survivors and the table has the
    node-failure columns and the false-eviction count (no timing asserted)."""
    args = ["--workers", "4", "--timeouts", "0.5", "--policies", "adaptive", "--patterns", "none,1,crash-leaf",
            "--size", "256", "--sizes", "", "--no-gloo", "--clean-steps", "2", "--fig11-trials", "0",
            "--no-plots", "--strict", "--out", str(tmp_path)]
    out = CliRunner().invoke(bench_cmd, args)
    assert out.exit_code == 0, out.output
    for column in ("Node failures", "no fault", "faulted", "extra", "later/plain", "detection", "signal->view",
                   "crash leaf      crash 3 @8", "False evictions in the 1 link-fault runs (1 fault): 0"):
        assert column in out.output, column
    assert "crash leaf (crash 3 @8), 4 workers: faulted step" in out.output
    data = json.loads((tmp_path / "bench.json").read_text())
    (node,) = [r for r in data["runs"] if r["spec"]["purpose"] == "node"]
    assert node["ok"], node["error"]
    assert node["exit_codes"]["3"] == -9
    assert node["evictions"] == [[3, 1]]
    assert node["detection_s"] is not None
    assert node["signal_to_view_s"] is not None
    assert all(3 not in rec["ranks"] for step, recs in node["records"].items() if int(step) >= 8 for rec in recs)
    (link,) = [r for r in data["runs"] if r["spec"]["purpose"] == "matrix" and r["spec"]["kind"] == "fttree"]
    assert link["evictions"] == []


def _loopback_run(kind: str, size: int, step_s: float, cpu_s: float, trees: str = "rotated") -> RunResult:
    spec = RunSpec(kind=kind, world=7, size=size, steps=5, warmup=1, purpose="sweep", trees=trees)
    res = RunResult(spec=spec)
    for s in range(5):
        for r in range(7):
            res.records[s][r] = {"rank": r, "step": s, "duration_s": step_s, "cpu_s": cpu_s / 7, "exact": True,
                                 "error": "", "events": []}
    return res


def test_loopback_targets_are_issue_14s_step_time_and_cpu_against_gloo() -> None:
    opts = BenchOptions(workers=(), sweep_workers=(7,), sweep_sizes=(4_000_000, 25_000_000),
                          sweep_policies=("static",), trees=("rotated",))
    summary = Summary(opts=opts, notes=[], results=[
        _loopback_run("fttree", 4_000_000, 0.20, 0.33), _loopback_run("gloo", 4_000_000, 0.13, 0.15),
        _loopback_run("fttree", 25_000_000, 0.60, 0.72), _loopback_run("gloo", 25_000_000, 0.65, 0.80)])
    met = {text: m for m, text in summary.targets()}
    assert met == {
        "loopback, 7 workers, 16 MB, rotated trees: fttree/gloo 1.54 (target <= 1.00)": False,
        "loopback, 7 workers, 100 MB, rotated trees: fttree/gloo 0.92 (target <= 1.00)": True,
        "loopback, 7 workers, 100 MB, rotated trees: CPU fttree/gloo 0.90 (target <= 1.00)": True,
    }
