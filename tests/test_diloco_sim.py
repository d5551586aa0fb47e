"""DiLoCo's outer steps on the simulator: failures and joins at and between outer steps.

Each simulated process keeps what a DiLoCo worker keeps across outer steps (the global
parameters and the outer Nesterov momentum) and contributes, per outer step, its
pseudo-gradient plus a count slot, as GradientSync does: 1 once it holds the group's state,
0 while it is a joiner waiting for it. A joiner keeps the results it takes part in, takes a
member's state a step after its admission (the state transfer) and replays the results that
state does not hold yet, so it ends where the others are. The simulator's fault language
strikes a rank as it starts an outer step's sync (`crash R @S`: it died in its local steps),
and the tests strike mid-sync too.

The oracle, on top of simulate()'s (exact sums over the labelled contributors, one result per
step, no hang, admission): every process that took an outer step holds, bit for bit, what a
serial replay of the group's results gives; each result's count is the number of its
contributors that held the state; a process that joined is counted from the step after it
took the state, and ends equal to the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from fttree.net.node import StepResult
from fttree.testing.sim import Outcome
from fttree.testing.simulate import Simulation, simulate
from tests.test_simulate import STEPS, schedules

SIZE = 6
SCALE = 2.0**10  # pseudo-gradients travel as integers / SCALE: sums are exact in any order
OUTER_LR, MOMENTUM = 0.7, 0.9


def outer_step(g: np.ndarray, m: np.ndarray, result: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """torch.optim.SGD(lr=OUTER_LR, momentum=MOMENTUM, nesterov=True) on the averaged
    pseudo-gradient (the sum over the counted contributors, divided by their count)."""
    count = result[-1]
    if count == 0:
        return g, m
    grad = result[:-1] / SCALE / count
    m = MOMENTUM * m + grad
    return g - OUTER_LR * (grad + MOMENTUM * m), m


@dataclass
class Worker:
    """One process's outer state. `history[s]`: its global parameters after outer step s."""

    first_step: int
    g: np.ndarray | None = None  # None: a joiner without the group's state yet
    m: np.ndarray = field(default_factory=lambda: np.zeros(SIZE))
    through: int = -1  # the newest outer step applied
    kept: dict[int, np.ndarray] = field(default_factory=dict)  # a joiner's results before its state
    history: dict[int, np.ndarray] = field(default_factory=dict)
    counted_from: int | None = None  # the first step it contributed with count 1


@dataclass
class OuterModel:
    """The DiLoCo layer for simulate(): `contribution`, `on_outcome` and `on_admitted`."""

    world: int
    workers: dict[int, Worker] = field(default_factory=dict)  # rank -> its current process
    everyone: list[tuple[int, Worker]] = field(default_factory=list)  # every process that ever ran
    sent: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (rank, step) -> contribution
    crash_mid_sync: dict[int, int] = field(default_factory=dict)  # rank -> the outer step it dies in

    def __post_init__(self) -> None:
        for rank in range(self.world):
            self._add(rank, Worker(first_step=0, g=np.zeros(SIZE)))

    def _add(self, rank: int, worker: Worker) -> None:
        self.workers[rank] = worker
        self.everyone.append((rank, worker))

    def contribution(self, rank: int, step: int) -> np.ndarray:
        """The round's pseudo-gradient: where this worker's local steps took it from the global
        parameters (a pull toward a target of its own), as integers over SCALE; zeros and
        count 0 for a joiner without the state."""
        key = (rank, step)
        if key not in self.sent:  # the oracle asks again later: the same bytes
            w = self.workers[rank]
            if w.g is None:
                self.sent[key] = np.zeros(SIZE + 1)
            else:
                target = np.random.default_rng(rank * 1_000_003 + step).standard_normal(SIZE)
                pseudo = np.round(0.3 * (w.g - target) * SCALE)
                self.sent[key] = np.append(pseudo, 1.0)
                if w.counted_from is None:
                    w.counted_from = step
        return self.sent[key]

    def on_admitted(self, run: Simulation, rank: int, first_step: int) -> None:
        self._add(rank, Worker(first_step=first_step))

    def on_outcome(self, run: Simulation, rank: int, step: int, outcome: Outcome) -> None:
        w = self.workers[rank]
        if self.crash_mid_sync.get(rank) == step + 1:  # dies while its next sync is under way
            net = run.network
            net.at(net.now + 0.0105, lambda: net.crash(rank))  # the loop submits 0.01 s after this
        if not isinstance(outcome, StepResult):
            return  # an aborted outer step changes nobody's parameters
        if w.g is None:
            w.kept[step] = outcome.data
            self._take_state(rank, w)
            return
        if step > w.through:
            self._apply(w, step, outcome.data)

    def _apply(self, w: Worker, step: int, data: np.ndarray) -> None:
        assert w.g is not None
        w.g, w.m = outer_step(w.g, w.m, data)
        w.through = step
        w.history[step] = w.g.copy()

    def _take_state(self, rank: int, w: Worker) -> None:
        """From the member with the newest state that holds the step before this joiner's
        first (the donor), then replay the kept results it does not hold."""
        donors = [d for r, d in self.workers.items() if r != rank and d.g is not None and d.through >= w.first_step - 1]
        if not donors:
            return
        donor = max(donors, key=lambda d: d.through)
        assert donor.g is not None
        w.g, w.m, w.through = donor.g.copy(), donor.m.copy(), donor.through
        for step in sorted(s for s in w.kept if s > w.through):
            self._apply(w, step, w.kept[step])
        w.kept.clear()

    def check(self, run: Simulation) -> None:
        """Bit for bit the serial replay; counts are the contributors holding the state."""
        g, m = np.zeros(SIZE), np.zeros(SIZE)
        reference: dict[int, np.ndarray] = {}
        for step in range(run.steps):
            results = list(run.results(step).values())
            if not results:
                continue
            res = results[0]
            counted = [c for c in res.contributors if self.sent[(c, step)][-1] == 1.0]
            assert res.data[-1] == len(counted), f"outer step {step}: count {res.data[-1]}, counted {counted}"
            g, m = outer_step(g, m, res.data)
            reference[step] = g.copy()
        for rank, w in self.everyone:
            for step, mine in w.history.items():
                assert np.array_equal(mine, reference[step]), \
                    f"rank {rank} (from step {w.first_step}) differs from the replay after outer step {step}"
            if w.counted_from is not None and w.first_step > 0:
                assert w.counted_from > w.first_step, f"rank {rank} counted before it held the state"


def run_outer(world: int, faults: str | None, steps: int = STEPS, *, seed: int = 0,
              crash_mid_sync: dict[int, int] | None = None) -> tuple[Simulation, OuterModel]:
    model = OuterModel(world, crash_mid_sync=crash_mid_sync or {})
    run = simulate(world, faults, steps, seed=seed, jitter_s=0.002, contribution=model.contribution,
                   on_outcome=model.on_outcome, on_admitted=model.on_admitted)
    run.check()
    model.check(run)
    return run, model


def test_all_outer_steps_alike_without_faults() -> None:
    run, model = run_outer(5, None, 8)
    assert all(w.through == 7 for w in model.workers.values())
    assert {tuple(res.contributors) for res in run.results(7).values()} == {(0, 1, 2, 3, 4)}
    assert len({w.g.tobytes() for w in model.workers.values() if w.g is not None}) == 1


def test_a_worker_dead_in_its_local_steps_is_missing_from_that_outer_average() -> None:
    run, model = run_outer(5, "crash 2 @4", 10)
    assert all(2 in res.contributors for res in run.results(3).values())
    assert all(2 not in res.contributors for s in range(4, 10) for res in run.results(s).values())
    assert model.workers[2].through == 3  # its last outer step


def test_a_worker_dead_during_an_outer_sync_is_missing_from_it_or_holds_it_like_the_others() -> None:
    run, model = run_outer(5, None, 10, crash_mid_sync={3: 4})
    assert 3 in run.network.wire.crashed
    assert all(3 not in res.contributors for s in range(5, 10) for res in run.results(s).values())
    assert model.workers[3].through in (3, 4)  # what it held when it died is the group's


def test_a_restarted_worker_waits_for_the_state_then_counts_and_matches() -> None:
    run, model = run_outer(5, "restart 1 @3", STEPS)
    new = model.workers[1]
    assert new.first_step == run.admitted[1]
    assert new.counted_from is not None
    assert new.counted_from > new.first_step
    assert new.history[STEPS - 1].tobytes() == model.workers[0].history[STEPS - 1].tobytes()


def test_a_new_rank_and_a_restart_in_the_middle_of_a_sync_come_in() -> None:
    run, model = run_outer(6, "join 6 @3; restart 4 @5", STEPS, crash_mid_sync={2: 6})
    for rank in (4, 6):
        assert model.workers[rank].history[STEPS - 1].tobytes() == model.workers[0].history[STEPS - 1].tobytes()
    assert all(2 not in res.contributors for res in run.results(STEPS - 1).values())


def test_the_oracle_catches_a_joiner_that_counts_before_its_state() -> None:
    model = OuterModel(3)
    run = simulate(3, "restart 2 @2", 8, contribution=model.contribution, on_outcome=model.on_outcome,
                   on_admitted=model.on_admitted)
    first = run.admitted[2]
    model.sent[(2, first)] = np.append(np.ones(SIZE), 1.0)  # as if it had counted at once
    with pytest.raises(AssertionError, match=f"outer step {first}: count"):
        model.check(run)


EXAMPLES = int(os.environ.get("FTTREE_SIM_EXAMPLES", "300")) // 3


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_random_schedules_hold_the_outer_oracle(case: tuple[int, str, int]) -> None:
    world, faults, seed = case
    try:
        run_outer(world, faults, seed=seed)
    except AssertionError as exc:
        raise AssertionError(f"run_outer({world}, {faults!r}, seed={seed}): {exc}") from None
