"""`fttree chaos --simulate`: the real run's seeded schedule on the simulator, held to simulate's
oracle. A short run of every kind passes and heals every kill and leave; a wrong sum fails it
with the reason."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from fttree.testing.simulate import simulate
from fttree.tools import chaos_schedule as cs
from fttree.tools.chaos import chaos
from fttree.tools.chaos_checks import ChaosFailure
from fttree.tools.chaos_sim import SimChaos, SimSettings, report, run_sim_chaos

# 15 ranks, 90 simulated seconds, a fault every 3 s: seed 4 draws every kind, stops included
SHORT = {"world": 15, "duration_s": 90.0, "every_s": 3.0, "seed": 4, "step_s": 0.5}


def test_a_short_simulated_chaos_run_of_every_kind_passes_the_oracle_and_heals_every_rejoin() -> None:
    lines: list[str] = []
    s = SimSettings(**SHORT, echo=lines.append)  # type: ignore[arg-type]
    faults = cs.draw(s.world, s.duration_s, s.every_s, s.seed, s.kinds)
    assert {f.kind for f in faults} == set(cs.KINDS)
    base, result = run_sim_chaos(s)  # raises ChaosFailure at any wrong sum, missing contributor or hang
    assert base.steps > 0
    assert result.steps > 0
    assert len(result.measures) == len(faults)  # every drawn fault struck (the majority rule only delays)
    goodput = report(base, result, s.world, lines.append)
    assert 0 < goodput <= 1
    rejoins = [m for m in result.measures if m.fault.kind in cs.REJOINS]
    # healed: the new process (started after the hold, or when the window closed) is in a result
    assert rejoins
    assert all(m.t_back is not None and m.healed_s is not None and m.healed_s >= m.t_back - m.t_fault
                           for m in rejoins)
    kills = [m for m in result.measures if m.fault.kind == cs.KILL]
    assert kills
    assert all(m.detected_s is not None for m in kills)
    assert any(line.lstrip().startswith("view changes:") for line in lines)


def test_a_wrong_sum_fails_the_run_with_the_step_and_rank() -> None:
    def tamper(rank: int, step: int, data: np.ndarray) -> np.ndarray:
        return data + 1.0 if (rank, step) == (3, 5) else data  # as a contribution added twice would

    s = SimSettings(world=7, duration_s=5.0, step_s=0.2, tamper=tamper, echo=lambda _line: None)
    with pytest.raises(ChaosFailure, match=r"step 5: rank \d+'s result is not the sum over the contributors"):
        SimChaos(s, []).go()


def test_the_command_prints_goodput_last() -> None:
    out = CliRunner().invoke(chaos, ["--simulate", "-n", "7", "--duration", "20", "--fault-every", "5",
                                     "--seed", "2", "--step-s", "0.5", "--kinds", "kill,stop"])
    assert out.exit_code == 0, out.output
    last = out.output.strip().splitlines()[-1]
    assert last.startswith("goodput 0.") or last.startswith("goodput 1.00"), out.output


def test_a_real_run_refuses_more_workers_than_one_machine_starts() -> None:
    out = CliRunner().invoke(chaos, ["-n", "255", "--duration", "5"])
    assert out.exit_code != 0
    assert "--simulate" in out.output


def test_a_quick_start_reaches_the_same_first_steps_as_asking_every_peer() -> None:
    asked = simulate(7, "crash 3 @2", 5, wire=False)
    quick = simulate(7, "crash 3 @2", 5, wire=False, quick_start=True)
    asked.check()
    quick.check()
    assert quick.network.nodes[0].replica.phase is asked.network.nodes[0].replica.phase
    assert {s: r.contributors for s, r in quick.results(0).items()} == \
        {s: r.contributors for s, r in asked.results(0).items()}
    assert [quick.results(s)[0].contributors for s in range(5)] == [asked.results(s)[0].contributors for s in range(5)]
    assert quick.network.now < asked.network.now  # it skipped the questions
