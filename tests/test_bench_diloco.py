"""`fttree bench --diloco`'s arithmetic, without a network: the target, the time and the bytes
until a run first reached it, and the configurations it runs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fttree.tools.bench_cli import bench
from fttree.tools.bench_diloco import Config, Run, configs, render


def _run(label: str, evals: list[tuple[float, int, float]], bytes_at: list[tuple[float, int]]) -> Run:
    run = Run(Config(label, (), 30))
    run.evals = [{"t": t, "at": 1000 + t, "step": s, "local_steps": s, "accuracy": a} for t, s, a in evals]
    run.bytes_at = [(1000 + t, b) for t, b in bytes_at]
    return run


def test_time_and_bytes_until_the_first_evaluation_at_the_target() -> None:
    gloo = _run("gloo DDP", [(10, 10, 0.5), (20, 20, 0.8), (30, 30, 0.9)], [(5, 10**6), (29, 9 * 10**6), (31, 10**7)])
    diloco = _run("DiLoCo", [(1, 8, 0.85), (2, 16, 0.91), (3, 24, 0.95)], [(0.5, 10**4), (1.9, 10**5), (3, 10**6)])
    never = _run("never", [(5, 5, 0.2)], [(5, 100)])
    assert diloco.first_at(0.9) == diloco.evals[1]
    assert diloco.bytes_until(1002) == 10**6  # the first reading after it: never less than was sent
    assert diloco.bytes_until(1001.9) == 10**5
    assert gloo.bytes_until(1040) == 10**7  # none after: the last one
    table = render("10mbit", 7, [gloo, diloco, never])
    assert "target 0.9000" in table
    # per step: gloo 1 MB over the 20 steps between its first and last report; DiLoCo (no H given: a
    # local step) 0.9 MB over 16
    assert "| gloo DDP | 30.0 s (30 local steps) | 1.000 | 10.0 MB | 1.0000 | 0.05 MB | 0.9000 |  |  |  |" in table
    assert "| DiLoCo | 2.0 s (16 local steps) | 0.067 | 1.0 MB | 0.1000 | 0.06 MB | 0.9500 |  |  |  |" in table
    assert "| never | not reached in 30 local steps | | | |  | 0.2000 |" in table
    assert "restart" not in table
    assert "derived" not in table


def test_a_derived_ddp_row_multiplies_its_steps_to_the_target_by_its_step_behind_the_uplinks() -> None:
    """--ddp-steps: the steps to the target come from the unshaped run, the time and bytes per
    step from the short shaped one; the DiLoCo rows keep their measured time and show their
    compute share."""
    gloo = _run("gloo DDP", [(3, 3, 0.5), (6, 6, 0.85), (9, 9, 0.9)], [(9, 10**9)])  # unshaped: its bytes unused
    gloo.step_s, gloo.step_bytes = 40.0, 5e7
    diloco = _run("DiLoCo", [(50, 32, 0.8), (100, 64, 0.93)], [(99, 10**6), (101, 2 * 10**6)])
    diloco.summary = {"compute_s": 90.0, "wall_s": 100.0, "outer_waited_s": 4.0}
    table = render("10mbit", 7, [gloo, diloco])
    assert ("| gloo DDP | 360.0 s (9 steps x 40.00 s, derived) | 1.000 | 450.0 MB | 1.0000 | 50.00 MB | 0.9000 "
            "|  |  |  |") in table
    assert ("| DiLoCo | 100.0 s (64 local steps) | 0.278 | 2.0 MB | 0.0044 | 0.03 MB | 0.9300 | 0.90 |  | 0.04 "
            "|") in table
    assert "Derived rows:" in table
    rounds = Run(Config("DiLoCo H=32", ("--diloco", "32"), 128))  # rounds of 10 s, 32 local steps of 0.3 s each
    rounds.evals = [{"t": t, "at": 1000 + t, "step": i + 1, "local_steps": 32 * (i + 1), "accuracy": 0.9}
                    for i, t in enumerate((14.0, 24.0, 36.0, 36.5))]
    rounds.summary = {"compute_s": 38.4, "wall_s": 40.0, "outer_waited_s": 2.0}
    rounds.bytes_at = [(1013.0, 10**6), (1014.5, 2 * 10**6), (1036.6, 5 * 10**6)]
    assert rounds.step_bytes_text == "1.00 MB"  # 3 MB over the 3 rounds between the first and last report
    assert rounds.steady_share == "0.87"  # 9.6 s of compute a round over the gaps 10 and 12 (the flush's left out)
    timed = _run("gloo DDP", [(60, 1, 0.1), (120, 2, 0.2), (180, 3, 0.3)],
                 [(1, 4 * 10**7), (61, 10**8), (121, 1.6 * 10**8), (181, 2.2 * 10**8)])
    assert timed.bytes_per_step() == pytest.approx(6e7)  # the first step's start-up traffic left out
    assert "Compute share:" in table


def test_the_restart_run_says_whether_the_rank_came_back_and_every_sample_was_used_once() -> None:
    fault = next(c for c in configs(30) if "--restart" in c.args)
    run = Run(fault)
    run.summary = {"steps": 9, "last_contributors": [0, 1, 2, 3, 4, 5, 6], "fewest_contributors": 6, "epochs": 4,
                   "exactly_once": True}
    assert run.restart_line().endswith("9 rounds; rank 3 back among the contributors at the end; fewest "
                                       "contributors 6; 4 epochs audited (the last may be cut by the end of the "
                                       "run): each sample exactly once")
    run.summary = {**run.summary, "last_contributors": [0, 1, 2], "exactly_once": False}
    assert "rank 3 NOT back" in run.restart_line()
    assert "NOT exactly once" in run.restart_line()


def test_the_configurations_and_the_dry_run() -> None:
    labels = [c.label for c in configs(30)]
    assert labels[:2] == ["gloo DDP", "fttree DDP"]
    assert "fttree DiLoCo H=128 int8" in labels
    assert "fttree DiLoCo H=32 sparse" in labels
    eager = next(c for c in configs(30) if "--eager" in c.args)
    assert eager.args[:4] == ("--diloco", "32", "--compression", "int8"), eager
    assert "fttree DiLoCo H=32 sparse, rank 3 killed in round 2 and restarted" in labels
    assert all(c.local_steps >= 4 * int(c.args[1]) for c in configs(30) if "--diloco" in c.args)
    out = CliRunner().invoke(bench, ["--diloco", "7", "--uplink", "10mbit", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "10mbit: fttree DiLoCo H=8 float32: 120 local steps" in out.output
    bad = CliRunner().invoke(bench, ["--diloco", "7", "--uplink", "fast", "--dry-run"])
    assert bad.exit_code != 0
    assert "--uplink" in bad.output


def test_a_large_model_s_runs_one_h_and_derived_ddp() -> None:
    """--sync-every picks the H values (the eager and restart runs take 32, else the first), and
    --ddp-steps runs DDP that many steps behind the uplinks, the budget with the limits lifted."""
    made = configs(30, sync_every=(16,), ddp_steps=3)
    assert [c.shaped_steps for c in made[:2]] == [3, 3]
    assert all(c.shaped_steps == 0 for c in made[2:])
    assert {c.args[1] for c in made if "--diloco" in c.args} == {"16"}
    assert [c.label for c in made if "--eager" in c.args] == ["fttree DiLoCo H=16 int8, eager outer steps",
                                                             "fttree DiLoCo H=16 sparse, eager outer steps"]
    longer = configs(30, sync_every=(32,), rounds=8)  # --rounds: the DiLoCo runs train 8 rounds, DDP its budget
    assert [c.local_steps for c in longer if "--diloco" in c.args] == [256] * (len(longer) - 2)
    assert [c.local_steps for c in longer[:2]] == [30, 30]
    assert configs(30, ddp_steps=30)[0].shaped_steps == 0  # not fewer than the budget: measured whole
    out = CliRunner().invoke(bench, ["--diloco", "7", "--uplink", "10mbit", "--sync-every", "32", "--ddp-steps", "3",
                                     "--hidden", "12800", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "10mbit: gloo DDP: 30 local steps with the limits lifted, then 3 behind the uplinks (derived)" in out.output
    assert "H=8" not in out.output
    bad = CliRunner().invoke(bench, ["--diloco", "7", "--sync-every", "0", "--dry-run"])
    assert bad.exit_code != 0
    assert "--sync-every" in bad.output
