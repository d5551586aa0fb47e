"""simulate(): a whole schedule of faults, restarts and joins, run as training loops on the simulator.

Every rank runs what a training loop does (mark the training step, allreduce its contribution,
wait for the outcome, go on) on SimNetwork's fake clock, while the schedule strikes: link faults,
`crash`, `hang`, the two that start processes, `restart R @S[..E]` (a new process of rank R
rejoins) and `join R @S` (a new rank asks in), and `leave R @S` (rank R's loop leaves the group
instead of taking step S). The result holds every process's outcome of every
step it took part in, and `check()` is the oracle the property tests hold every run to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GroupLeft, PeerError
from ..net.node import Node, StepResult
from .sim import Outcome, SimNetwork

Contribution = Callable[[int, int], np.ndarray]
OutcomeHook = Callable[["Simulation", int, int, Outcome], None]  # (run, rank, step, outcome)
AdmittedHook = Callable[["Simulation", int, int], None]  # (run, rank, its first step)

STEP_GAP_S = 0.01  # the compute between two steps of a training loop, in simulated seconds
JOINED_WITHIN = 3  # steps after its admission by which a new process's contribution is in a result


def counted(size: int = 8) -> Contribution:
    """The default contributions: small integers, so any order of adding gives the exact sum, and
    different for every rank and step, so a contribution added twice or missed shows."""

    def contribution(rank: int, step: int) -> np.ndarray:
        return np.arange(size, dtype=np.float64) + (rank + 1) * 1000.0 + step * 7.0

    return contribution


@dataclass(slots=True)
class Simulation:
    """What a simulated run gave. `outcomes[(rank, step)]` is the StepResult or the exception
    that rank's process got; a process that crashed has none for the step it died in."""

    world: int
    steps: int
    contribution: Contribution
    network: SimNetwork
    outcomes: dict[tuple[int, int], Outcome] = field(default_factory=dict)
    admitted: dict[int, int] = field(default_factory=dict)  # restarted or new rank -> its first step
    refused: dict[int, PeerError] = field(default_factory=dict)  # a process kept out, and why
    pending: set[tuple[int, int]] = field(default_factory=set)  # submitted, no outcome (yet)
    submitted_by: dict[tuple[int, int], int] = field(default_factory=dict)  # pending step -> its process
    left: dict[int, int] = field(default_factory=dict)  # a rank that left -> the step it did not take
    on_outcome: OutcomeHook | None = None  # told each outcome before the loop goes on (a layer above steps)
    on_admitted: AdmittedHook | None = None  # told a restarted or new process's first step before it submits
    hook_errors: list[Exception] = field(default_factory=list)  # raised by the hooks (simulate() raises the first)
    step_gap_s: float = STEP_GAP_S  # the compute between two steps of every loop, simulated seconds

    def results(self, step: int) -> dict[int, StepResult]:
        """Every rank's StepResult of `step` (ranks that failed it are left out)."""
        return {r: o for (r, s), o in self.outcomes.items() if s == step and isinstance(o, StepResult)}

    def waiting(self) -> set[tuple[int, int]]:
        """Pending steps of live processes: not crashed, not hung, not replaced by a restart."""
        net = self.network
        gone = net.wire.crashed | net.hung
        return {(r, s) for r, s in self.pending if r not in gone and self.submitted_by[(r, s)] == net.process_of(r)}

    def results_held(self) -> list[tuple[int, int]]:
        """(rank, step) of every StepResult."""
        return [key for key, o in self.outcomes.items() if isinstance(o, StepResult)]

    def check(self) -> None:
        """The oracle; raises AssertionError naming the step and ranks. Every result is the sum
        of the contributions of the ranks it names, each once; every rank that holds a result of
        a step holds the same one; every step of a live process has an outcome (nothing hangs);
        while the group runs on, a restarted or new process is admitted and, unless the group
        leaves it out again, is among the contributors within JOINED_WITHIN steps of its first; a
        rank that left is in no result of the step it left at or later, and the group's view no
        longer holds it."""
        if self.pending:
            raise AssertionError(f"steps without an outcome (rank, step): {sorted(self.pending)}")
        by_step: dict[int, dict[int, StepResult]] = {}
        for (rank, step), outcome in self.outcomes.items():
            if isinstance(outcome, StepResult):
                by_step.setdefault(step, {})[rank] = outcome
        for step, results in sorted(by_step.items()):
            same = StepCheck(step, self.contribution)
            for rank, res in sorted(results.items()):
                same.add(rank, res)
        last = self.steps - 1
        # a join decided for a training step after the last is no process kept out: the job ended first
        decided = {r for node in self.network.nodes if node.stopped is None
                   for join in node.replica.pending for r in join.joined}
        kept_out = {r: e for r, e in self.refused.items() if r not in decided}
        if kept_out and any(s == last for _r, s in self.results_held()):  # the group ran on without them
            raise AssertionError(f"processes kept out of the group: {kept_out}")
        for rank, at in self.left.items():
            late = sorted(s for (_r, s), o in self.outcomes.items()
                          if s >= at and isinstance(o, StepResult) and rank in o.contributors)
            if late:
                raise AssertionError(f"rank {rank} left before step {at} but is in the results of steps {late}")
            if any(s == last for _r, s in self.results_held()) and self.network.nodes[rank].stopped is None:
                raise AssertionError(f"rank {rank} left before step {at}, and the group ran on, yet it never "
                                     "saw the view without it")
        for rank, start in self.admitted.items():
            if any(isinstance(o, GroupLeft) for (r, s), o in self.outcomes.items() if r == rank and s >= start):
                continue  # left out again (its links failed too): taking part is not owed then
            window = range(start, min(start + JOINED_WITHIN + 1, self.steps))
            held = [res for s in window for res in self.results(s).values()]
            if held and not any(rank in res.contributors for res in held):  # (none: the group stopped)
                raise AssertionError(f"rank {rank}, admitted at step {start}, is in no result of steps "
                                     f"{window.start}..{window.stop - 1}")


class StepCheck:
    """The oracle for one step, fed its results as they come: the first must be the sum of the
    contributions of the ranks it names, each once, and every later one the same result. The
    expected sum is computed once (a step of 1,023 ranks, checked on every rank, stays linear)."""

    def __init__(self, step: int, contribution: Contribution) -> None:
        self.step, self.contribution = step, contribution
        self.first: tuple[int, StepResult] | None = None
        self.want = np.zeros(0)  # the first result's expected sum

    def add(self, rank: int, res: StepResult) -> None:
        """Raises AssertionError naming the step and ranks at the first wrong result."""
        first = None if self.first is None else self.first[1]
        same = first is not None and res.contributors == first.contributors
        want = self.want if same else self._sum(res.contributors, res.data)
        if len(set(res.contributors)) != len(res.contributors) or not np.array_equal(res.data, want):
            raise AssertionError(f"step {self.step}: rank {rank}'s result is not the sum over the "
                                 f"contributors it names {list(res.contributors)}")
        if first is None:
            self.first, self.want = (rank, res), want
        elif not same or not np.array_equal(res.data, first.data):
            raise AssertionError(f"step {self.step}: ranks hold different results: contributors "
                                 f"{list(first.contributors)} and rank {rank}'s {list(res.contributors)}")

    def _sum(self, contributors: tuple[int, ...], like: np.ndarray) -> np.ndarray:
        return sum((self.contribution(c, self.step) for c in contributors), start=np.zeros_like(like))


class _Loop:
    """One process's training loop: mark the step, submit, and on its outcome go on."""

    def __init__(self, run: Simulation, node: Node, process: int, first_user_step: int, first_step: int) -> None:
        self.run, self.node, self.process = run, node, process
        self.offset = first_step - first_user_step  # allreduce step = training step + offset

    def step(self, user_step: int) -> None:
        run, node = self.run, self.node
        if user_step >= run.steps:
            return
        step = user_step + self.offset
        if step >= run.network.leaves.get(node.rank, run.steps):  # `leave R @S`: the loop leaves instead
            run.left[node.rank] = step
            node.depart(lambda _: None)
            return
        node.boundary(user_step, step)
        run.pending.add((node.rank, step))
        run.submitted_by[(node.rank, step)] = self.process
        future = run.network.submit(node.rank, step, run.contribution(node.rank, step))
        future.add_done_callback(functools.partial(self._done, user_step))

    def _done(self, user_step: int, future: Future[StepResult]) -> None:
        run, rank = self.run, self.node.rank
        step = user_step + self.offset
        run.pending.discard((rank, step))
        run.submitted_by.pop((rank, step), None)
        error = future.exception()
        run.outcomes[(rank, step)] = outcome = error if error is not None else future.result()
        if run.on_outcome is not None and self.process == run.network.process_of(rank):
            try:
                run.on_outcome(run, rank, step, outcome)
            except Exception as exc:  # a future's callback would only log it: simulate() raises it
                run.hook_errors.append(exc)
        if isinstance(error, GroupLeft):
            return  # out of the group: a training loop stops here
        clock = run.network.clock
        clock.call_later(run.step_gap_s, lambda: run.network.run_as(rank, lambda: self.step(user_step + 1),
                                                                  process=self.process))


def simulate(world: int, faults: str | None = None, steps: int = 10, *, contribution: Contribution | None = None,
             seed: int = 0, limit_s: float = 600.0, on_outcome: OutcomeHook | None = None,
             on_admitted: AdmittedHook | None = None, **settings: Any) -> Simulation:
    """Run `steps` training steps on `world` simulated ranks under the fault schedule `faults`
    (the fault language, plus `restart R @S[..E]`, `join R @S` and `leave R @S`), every rank contributing
    `contribution(rank, step)` (default: `counted()`). Settings are SimNetwork's and Config's
    (latency_s, jitter_s, step_timeout_s, ...); links keep their frames in order, as TCP does,
    unless `fifo=False`. `on_outcome` and `on_admitted` let a layer above the steps (an outer
    optimizer, a sampler) keep each process's state. Returns every outcome; `check()` is the oracle."""
    run = start(world, faults, steps, contribution=contribution, seed=seed, on_outcome=on_outcome,
                on_admitted=on_admitted, **settings)
    drive(run, limit_s)
    return run


def start(world: int, faults: str | None = None, steps: int = 10, *, contribution: Contribution | None = None,
          seed: int = 0, on_outcome: OutcomeHook | None = None, on_admitted: AdmittedHook | None = None,
          step_gap_s: float = STEP_GAP_S, **settings: Any) -> Simulation:
    """simulate()'s first half: the network started and every rank's loop submitting step 0.
    A caller that strikes by simulated time (`fttree chaos --simulate`) sets its timers on
    `run.network` before `drive(run, limit_s)` runs the rest."""
    network = SimNetwork(world, faults=faults, seed=seed, **{"fifo": True, **settings})
    run = Simulation(world=world, steps=steps, contribution=contribution or counted(), network=network,
                     on_outcome=on_outcome, on_admitted=on_admitted, step_gap_s=step_gap_s)

    def settled(rank: int, node: Node, error: PeerError | None) -> None:
        if error is not None:
            run.refused[rank] = error
            return
        assert node.joined_at is not None
        first_step, first_user_step = node.joined_at
        run.admitted[rank] = first_step
        if run.on_admitted is not None:
            run.on_admitted(run, rank, first_step)
        loop = _Loop(run, node, network.process_of(rank), first_user_step, first_step)
        loop.step(first_user_step)

    network.process_listeners.append(settled)
    for rank in range(world):
        _Loop(run, network.nodes[rank], 0, 0, 0).step(0)
    return run


def drive(run: Simulation, limit_s: float = 600.0) -> None:
    """simulate()'s second half: run events until nothing but background timers is left."""
    clock = run.network.clock
    # Events run until nothing but a live node's background timers is left (probes of failed
    # links go on forever, as in a real node) and no live process waits for a step.
    while (clock.busy or run.waiting()) and clock.next_at is not None and clock.next_at <= limit_s:
        clock.run(until=clock.next_at)
        if run.hook_errors:  # at once: the run went wrong, what follows would only bury why
            raise run.hook_errors[0]
    # a crashed or hung process's step has no outcome, nor has the step a restart cut short
    run.pending = run.waiting()
    if run.hook_errors:
        raise run.hook_errors[0]
