"""`fttree bench --uplink RATE`: runs under per-rank uplink limits, bytes against the 2N(p-1)/p bound.

The kernel tests (marked realnet) need root, ip and tc and skip with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fttree.core.config import Config
from fttree.errors import ConfigError
from fttree.tools.bench_plan import BenchOptions, plan, uplink_timeouts
from fttree.tools.bench_plots import plot_steps
from fttree.tools.bench_report import render
from fttree.tools.bench_run import execute, worker_commands
from fttree.tools.bench_spec import RunResult, RunSpec
from fttree.tools.bench_summary import Summary
from fttree.tools.bench_uplinks import Uplinks
from fttree.tools.units import format_rate, parse_rate, parse_uplinks, ring_bound_bytes, split_uplink_list

from .test_realnet import realnet_missing
from .test_uplink import tc_missing


def test_rates_parse_to_bits_per_second() -> None:
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("10mbps") == 80e6
    assert format_rate(100e6) == "100 Mbit/s"
    for bad in ("", "fast", "10xbit", "0bit"):
        with pytest.raises(ConfigError):
            parse_rate(bad)


def test_uneven_uplinks_parse_to_a_default_and_ranks_of_their_own() -> None:
    spec = parse_uplinks(" 100mbit, 3=10mbit,1=50mbit ")
    assert spec.default == "100mbit"
    assert spec.by_rank == ((1, "50mbit"), (3, "10mbit"))
    assert str(spec) == "100mbit,1=50mbit,3=10mbit"
    assert spec.bytes_per_s(4) == (12.5e6, 6.25e6, 12.5e6, 1.25e6)
    assert spec.declared(4) == "0=1.25e+07,1=6.25e+06,2=1.25e+07,3=1.25e+06"
    assert parse_uplinks("100mbit").declared(7) == ""
    assert parse_uplinks("100mbit,9=1mbit").declared(7) == ""  # nobody of 7 workers differs
    assert Config(uplinks_by_rank=spec.declared(4)).uplink_of(3) == 1.25e6  # the workers read it back
    for bad, says in (("3=10mbit", "start with the default rate"), ("100mbit,x=1mbit", "is not RANK=RATE"),
                      ("100mbit,3=fast", "bad rate 'fast'"), ("", "start with the default rate")):
        with pytest.raises(ConfigError, match=says):
            parse_uplinks(bad)
    assert split_uplink_list("10mbit,3=1mbit,100mbit") == ["10mbit,3=1mbit", "100mbit"]


def test_uneven_uplinks_are_declared_to_fttree_and_judged_against_their_bound(tmp_path: Path) -> None:
    world, size, steps = 7, 4_000_000, 4
    opts = BenchOptions(workers=(), sweep_workers=(world,), sweep_sizes=(size,), uplink="100mbit,3=10mbit",
                        sweep_policies=("adaptive",), trees=())
    runs, _ = plan(opts)
    fttree_run = next(r for r in runs if r.kind == "fttree")
    cmd = worker_commands(fttree_run, tmp_path)[0]
    assert cmd[cmd.index("--set") + 1] == "uplinks_by_rank=" + parse_uplinks(opts.uplink).declared(world)
    assert fttree_run.label.startswith("fttree defaults")
    assert "--set" not in worker_commands(next(r for r in runs if r.kind == "gloo"), tmp_path, bind=True)[0]
    slow_step = size * 4 / 1.25e6  # the bound: rank 3 sends its N once
    even = {r: steps * size * 4 for r in range(world)}
    summary = Summary(opts=opts, results=[_fake("fttree", world, size, 1.1 * slow_step, even, policy="adaptive"),
                                          _fake("gloo", world, size, 1.71 * slow_step, even)], notes=[])
    rows = {r["system"]: r for r in summary.bandwidth_rows()}
    assert rows["gloo"]["bound_s"] == pytest.approx(slow_step)
    targets = {text: met for met, text in summary.targets()}
    assert targets[f"uplinks 100mbit,3=10mbit, {world} workers, 16 MB, fttree rotated: step/gloo 0.64 "
                   f"(target <= 0.65)"]
    assert targets[f"uplinks 100mbit,3=10mbit, {world} workers, 16 MB, fttree rotated: step/bound 1.10 "
                   f"(target <= 1.15)"]


def test_the_bound_is_the_rings_bytes_per_rank() -> None:
    assert ring_bound_bytes(1000, 7) == pytest.approx(2 * 4000 * 6 / 7)
    assert ring_bound_bytes(1000, 1) == 0


def test_uplink_plan_shapes_every_run_and_binds_gloo(tmp_path: Path) -> None:
    opts = BenchOptions(workers=(), sweep_workers=(3,), sweep_sizes=(1000,), uplink="100mbit",
                          compressions=("bf16",), sweep_policies=("static",))
    runs, _ = plan(opts)
    assert {r.kind for r in runs} == {"fttree", "gloo"}
    assert all(r.uplink_bps == 100e6 for r in runs)
    # the defaults (rotated trees), the double tree, and bf16 on the rotated trees
    assert [(r.compression, r.trees) for r in runs if r.kind == "fttree"] == [
        ("", "rotated"), ("", "double"), ("bf16", "rotated")]
    for run, family in zip(runs, ("rotated", "double"), strict=False):
        cmd = worker_commands(run, tmp_path)[0]
        assert cmd[cmd.index("--trees") + 1] == family
        assert "--set" not in cmd  # nothing derived from the declared rate
    assert "double trees" in runs[1].label
    gloo = next(r for r in runs if r.kind == "gloo")
    cmds = worker_commands(gloo, tmp_path, bind=True)
    assert [c[c.index("--bind") + 1] for c in cmds] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert "--bind" not in worker_commands(gloo, tmp_path)[0]
    comp = next(r for r in runs if r.compression)
    assert "--compression" in worker_commands(comp, tmp_path)[0]
    assert "uplinks 100 Mbit/s" in comp.label
    assert "bf16" in comp.label
    assert comp.deadline_s() > RunSpec(kind="fttree", world=3, size=1000, steps=comp.steps).deadline_s()
    lossy = plan(BenchOptions(workers=(), sweep_workers=(3,), sweep_sizes=(1000,), uplink="100mbit", loss=2.0,
                                  trees=()))[0]
    assert all(r.loss == 2.0 for r in lossy)
    assert "2% loss" in lossy[0].label
    assert Uplinks("100mbit", name="x").wrap(["true"]) == ["ip", "netns", "exec", "x", "true"]


def test_fttree_timeouts_scale_with_the_uplinks(tmp_path: Path) -> None:
    # 100 MB behind 100 Mbit/s: an interior rank sends 300 MB, 24 s
    watch, step, settings = uplink_timeouts(25_000_000, 100e6, "", 0.5, 30.0)
    assert watch == pytest.approx(24.0)
    assert step == pytest.approx(106.0)
    assert settings == (("adaptive_ceiling_s", "24"), ("uplink_bytes_per_s", "1.25e+07"))
    assert uplink_timeouts(25_000_000, 100e6, "bf16", 0.5, 30.0)[0] == pytest.approx(12.0)
    assert uplink_timeouts(1000, 1e9, "", 0.5, 30.0) == (0.5, 30.0, (("adaptive_ceiling_s", "2"),
                                                                        ("uplink_bytes_per_s", "1.25e+08")))
    opts = BenchOptions(workers=(), sweep_workers=(7,), sweep_sizes=(25_000_000,), uplink="100mbit",
                          sweep_policies=("adaptive",), trees=(), tuned=True)
    default, tuned = [r for r in plan(opts)[0] if r.kind == "fttree"]
    assert (default.tuned, tuned.tuned) == (False, True)
    assert default.label.startswith("fttree defaults")
    cmd = worker_commands(default, tmp_path)[0]
    assert "--set" not in cmd
    assert cmd[cmd.index("--step-timeout") + 1] == str(Config().step_timeout_s)
    cmd = worker_commands(tuned, tmp_path)[0]
    sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
    assert sets == ["adaptive_ceiling_s=24", "uplink_bytes_per_s=1.25e+07"]
    assert cmd[cmd.index("--step-timeout") + 1] == "106.0"
    assert tuned.deadline_s() > tuned.steps * 106
    summary = Summary(opts=opts, results=[RunResult(spec=default), RunResult(spec=tuned)], notes=[])
    assert summary.find("fttree", 7, 25_000_000, 0.5, "adaptive", trees="rotated") is summary.results[0]
    assert summary.find("fttree", 7, 25_000_000, None, "adaptive", trees="rotated", tuned=True) is summary.results[1]


def _fake(kind: str, world: int, size: int, step_s: float, sent: dict[int, int], steps: int = 4,
          compression: str = "", trees: str = "rotated", policy: str = "static") -> RunResult:
    spec = RunSpec(kind=kind, world=world, size=size, steps=steps, warmup=1, purpose="sweep",
                     uplink_bps=100e6, compression=compression, trees=trees, policy=policy)
    res = RunResult(spec=spec, sent_bytes=sent)
    for s in range(steps):
        for r in range(world):
            res.records[s][r] = {"rank": r, "step": s, "duration_s": step_s, "exact": True, "error": "", "events": []}
    return res


def test_bandwidth_table_and_targets(tmp_path: Path) -> None:
    world, size, steps = 7, 4_000_000, 4
    bound = ring_bound_bytes(size, world)
    opts = BenchOptions(workers=(), sweep_workers=(world,), sweep_sizes=(size,), uplink="100mbit",
                          compressions=("bf16",), sweep_policies=("static",), trees=())
    tree = {r: int(steps * (3 if r in (1, 2) else 2 if r == 0 else 1) * size * 4) for r in range(world)}
    ring = {r: int(steps * bound * 1.01) for r in range(world)}
    half = {r: v // 2 for r, v in tree.items()}
    summary = Summary(opts=opts, results=[_fake("fttree", world, size, 4.0, tree),
                                            _fake("fttree", world, size, 2.0, half, compression="bf16"),
                                            _fake("gloo", world, size, 2.3, ring)], notes=[])
    rows = {r["system"]: r for r in summary.bandwidth_rows()}
    assert rows["fttree rotated"]["max_bytes"] / bound == pytest.approx(1.75)
    assert rows["gloo"]["max_bytes"] / bound == pytest.approx(1.01, abs=1e-3)
    assert rows["gloo"]["bound_s"] == pytest.approx(bound * 8 / 100e6)
    targets = {text: met for met, text in summary.targets()}
    assert any("fttree rotated: busiest rank sends 1.75x" in t and not met for t, met in targets.items())
    assert any("fttree rotated bf16: step/gloo 0.87 (target <= 0.55)" in t and not met for t, met in targets.items())
    table = render(summary)
    assert "Bytes on the wire, uplinks 100mbit" in table
    assert "Wire compression" in table
    assert "Tables 1-2" not in table  # no matrix under --uplink
    data = json.loads(json.dumps(summary.to_json({}, ["fttree", "bench"]), default=str))
    assert len(data["bandwidth"]) == 3
    pytest.importorskip("matplotlib")
    assert [p.name for p in plot_steps(summary, tmp_path)] == ["size_sweep.png"]


def test_each_tree_family_is_a_system_of_its_own_in_tables_and_plot(tmp_path: Path) -> None:
    world, size, steps = 7, 4_000_000, 4
    n, bound = size * 4, ring_bound_bytes(size, world)
    opts = BenchOptions(workers=(), sweep_workers=(world,), sweep_sizes=(size,), uplink="100mbit",
                          compressions=("bf16",), sweep_policies=("static",), trees=("single", "double", "rotated"))
    single = {r: steps * (3 if r in (1, 2) else 2 if r == 0 else 1) * n for r in range(world)}
    # chunks alternate: interior in one tree 3 x N/2 + N/2 as a leaf of the other
    double = {r: steps * (2 * n if r in (1, 2, 4, 5) else 3 * n // 2 if r in (0, 6) else n) for r in range(world)}
    rotated = {r: int(steps * bound) for r in range(world)}  # every rank at the bound
    summary = Summary(opts=opts, results=[
        _fake("fttree", world, size, 4.0, single, trees="single"),
        _fake("fttree", world, size, 2.6, double, trees="double"),
        _fake("fttree", world, size, 2.2, rotated, trees="rotated"),
        _fake("fttree", world, size, 1.1, {r: v // 2 for r, v in rotated.items()}, compression="bf16",
              trees="rotated"),
        _fake("gloo", world, size, 2.3, {r: int(steps * bound) for r in range(world)})], notes=[])
    assert [name for name, *_ in summary.sweep_systems()] == ["fttree rotated", "fttree single", "fttree double",
                                                              "fttree rotated bf16"]
    rows = {r["system"]: r for r in summary.bandwidth_rows()}
    assert rows["fttree double"]["max_bytes"] / bound == pytest.approx(7 / 6)  # the double tree's floor, 2N
    assert rows["fttree single"]["max_bytes"] / bound == pytest.approx(1.75)
    assert rows["fttree rotated"]["max_bytes"] / bound == pytest.approx(1.0, abs=1e-6)
    table = render(summary)
    assert "ft double" in table
    assert "ft rotated" in table
    assert "(rotated trees)" in table  # the compression table compares bf16 with float32 on the same trees
    targets = {text: met for met, text in summary.targets()}
    assert any("fttree double: busiest rank sends 1.17x" in t and not met for t, met in targets.items())
    assert any("fttree rotated: busiest rank sends 1.00x" in t and met for t, met in targets.items())
    pytest.importorskip("matplotlib")
    assert [p.name for p in plot_steps(summary, tmp_path)] == ["size_sweep.png"]


def test_false_events_on_healthy_links_are_counted_and_fail_the_target() -> None:
    """Under uplinks nothing is broken: a watch expiry, a relay, a detour, a suspicion, an
    eviction or a change of members is a false event, and fttree at its defaults must show none
    and stay within 1.15x gloo's step."""
    world, size, steps = 7, 407_050, 4
    opts = BenchOptions(workers=(), sweep_workers=(world,), sweep_sizes=(size,), uplink="100mbit",
                          sweep_policies=("adaptive",), trees=())
    sent = {r: steps * size * 8 for r in range(world)}
    clean = _fake("fttree", world, size, 0.25, sent, policy="adaptive")
    noisy = _fake("fttree", world, size, 0.30, sent, policy="adaptive")
    noisy.records[2][3]["events"] = [{"kind": "timeout", "cause": "watch_expired"},
                                     {"kind": "recovery", "cause": "data_relayed"},
                                     {"kind": "recovery", "cause": "data_came_around"}]
    noisy.records[3][1]["events"] = [{"kind": "detour", "cause": "detour"}]
    views = [{"epoch": 1, "members": list(range(world)), "evicted": []},  # a pace agreement: no change
             {"epoch": 2, "members": [0, 1, 2, 3, 4, 6], "evicted": [5]}]
    noisy.membership = {r: {"views": views, "evictions": [{"rank": 5, "epoch": 2}] if r == 0 else [],
                            "suspicions": 1 if r in (2, 6) else 0} for r in range(world)}
    assert clean.false_events() == dict.fromkeys(("expiries", "relays", "detours", "suspicions", "evictions",
                                                  "view_changes"), 0)
    assert noisy.false_events() == {"expiries": 1, "relays": 1, "detours": 1, "suspicions": 2, "evictions": 1,
                                    "view_changes": 1}
    gloo = _fake("gloo", world, size, 0.24, sent)
    for run, met in ((clean, True), (noisy, False)):
        summary = Summary(opts=opts, results=[run, gloo], notes=[])
        targets = [(ok, text) for ok, text in summary.targets() if text.startswith("defaults")]
        assert [ok for ok, _ in targets] == [met, met], targets
        assert "False events on healthy links" in render(summary)
    assert "expiries 1, relays 1, detours 1, suspicions 2, evictions 1, view_changes 1" in " ".join(
        text for _, text in Summary(opts=opts, results=[noisy, gloo], notes=[]).targets())


# ---- against the kernel -------------------------------------------------------------------


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def uplinks() -> Uplinks:
    missing = realnet_missing() or tc_missing() or Uplinks.missing()
    if missing:
        pytest.skip(missing)
    return Uplinks("1gbit", name=f"fttree-test-bench-{os.getpid()}")


@pytest.mark.realnet
def test_uplinks_go_away_when_the_bench_fails(uplinks: Uplinks) -> None:
    def failing_run() -> None:
        with uplinks:
            uplinks.start(3)
            assert uplinks.name in _namespaces()
            uplinks.apply(3)
            raise RuntimeError("a run blew up")

    with pytest.raises(RuntimeError):
        failing_run()
    assert uplinks.name not in _namespaces()
    uplinks.close()  # twice is fine


@pytest.mark.realnet
def test_a_run_under_uplinks_reads_every_ranks_counter(uplinks: Uplinks, tmp_path: Path) -> None:
    size, world, steps = 50_000, 3, 3
    spec = RunSpec(kind="fttree", world=world, size=size, steps=steps, warmup=1, uplink_bps=uplinks.bps)
    with uplinks:
        uplinks.start(world)
        res = execute(spec, tmp_path, uplinks=uplinks)
    assert res.ok, (res.error, res.stderr_tail)
    assert sorted(res.sent_bytes) == [0, 1, 2]
    per = res.bytes_per_step()
    # A tree of 3: the root sends the result to 2 children (2N), each leaf its own N up.
    assert 1.9 * size * 4 < per[0] < 2.6 * size * 4, per
    assert all(0.9 * size * 4 < per[r] < 1.6 * size * 4 for r in (1, 2)), per
    assert uplinks.name not in _namespaces()
