"""`fttree chaos --simulate`: the chaos run's schedules at hundreds or thousands of ranks.

    fttree chaos --simulate -n 255 --duration 120 --fault-every 2 --seed 1

The schedule is drawn by chaos_schedule.draw exactly as for the real run (same world,
duration, mean gap, seed and kinds give the same faults), but every second is simulated: the
ranks are real Nodes on SimNetwork's fake clock, each running the training loop of
testing/simulate.py (mark the step, allreduce its contribution, compute `step_s`, go on). The
kinds map onto the simulator as:

- kill: the rank's process crashes (sockets gone, timers dead); after the hold a new process of
  the rank starts and asks the running group to admit it (`SimNetwork.restart`).
- stop: `hang` (SIGSTOP: frames wait, timers wait) until the hold ends, then `resume`.
- cut: the link is cut until `heal`; loss: the link drops that share of frames until `heal`.
- straggler: `hang`/`resume` bursts of STRAGGLE_S, as the real run's SIGSTOP bursts: the rank
  really computes at half speed, and every step waits for it or closes without it.
- leave: the rank's loop leaves the group gracefully at its next step; after the hold a new
  process of the rank joins in its place.
A rank the group evicted (a stop past the deadline, a burst of loss) learns it when it runs
again, and its process is restarted, as the real runner restarts a worker that exits evicted.

Every result is held to simulate's oracle as it comes (StepCheck: the exact sum of the
contributions of the ranks it names, each once, the same on every rank), a restarted or new
process must be among the contributors within JOINED_WITHIN steps of its admission, a rank that
left is in no result until its new process is admitted, and nothing may hang: a failure raises
ChaosFailure with the reason, which the command prints as its last line.

Measured in simulated time: goodput (contributions summed per second, against a fault-free
simulation of the same world and duration), per kind the detection time (fault to the first
result without a victim, naming it late, or with a note about the link) and the heal time (fault
to the first result the new process is in), view-change times (fault to the first member
installing the view without the victim; a new process's start to the view with it) and the
frames each rank sent per fault beyond what the same steps cost without faults.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..core.effects import Note
from ..core.membership import Installed
from ..errors import GroupLeft
from ..net.node import Node
from ..net.steps import StepResult
from ..testing.sim import Outcome, SimNetwork
from ..testing.simulate import JOINED_WITHIN, Contribution, Simulation, StepCheck, counted, start
from . import chaos_schedule as cs
from .chaos_checks import ChaosFailure
from .chaos_report import by_kind, kind_line, stats

Tamper = Callable[[int, int, np.ndarray], np.ndarray]  # (rank, step, its true contribution) -> what it submits

POLL_S = 0.05  # a fault that waits for the majority rule, or a leaver's exit, is tried again this often
STRAGGLE_S = 0.4  # a straggler's hang and run bursts, simulated seconds (the real run's SIGSTOP bursts)
# A one-chunk step runs on tree 0 whatever the family, but "rotated" (the default) builds p trees
# at every view change on every rank: 32 ms a rank at 1,023, half a minute of one core a view
# change when one process holds them all. Simulated time does not count it either way.
TREES = "single"
DETECT_GRACE_S = 2.0  # a link or stop fault is detected by a step at most this long after its end


@dataclass
class SimSettings:
    world: int = 31
    duration_s: float = 120.0  # simulated
    every_s: float = 10.0  # simulated
    seed: int = 0
    kinds: tuple[str, ...] = cs.KINDS
    step_s: float = 0.1  # the compute between two steps of every rank, simulated seconds
    heal_s: float = 60.0  # a new process contributes within this (simulated), else it is a hang
    stall_s: float = 60.0  # some step finishes within this (simulated), always
    stop_margin: int = 3  # steps between the newest finished and the last one
    tamper: Tamper | None = None  # tests: what a rank really submits instead of its contribution
    echo: Callable[[str], None] = print


@dataclass
class SimMeasure:
    """One fault, in simulated seconds from its start."""

    fault: cs.Fault
    t_fault: float
    t_end: float | None = None
    t_back: float | None = None  # a new process of the victim started (kill, leave, eviction)
    detected_s: float | None = None
    healed_s: float | None = None
    view_s: float | None = None  # to the first member installing a view without the victim
    join_view_s: float | None = None  # from t_back to the first member installing the view with it


@dataclass
class SimResult:
    contributions: int  # summed over the steps that finished in the window
    seconds: float
    steps: int  # steps that finished in the window
    frames: int  # frames sent in the window
    by_kind: Counter[str]
    measures: list[SimMeasure] = field(default_factory=list)
    evictions: int = 0
    failed_steps: int = 0  # steps a live process got an error for (run again by its loop's next step)
    wall_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.contributions / self.seconds


class SimChaos:
    """One simulated run of `world` ranks for `duration_s` under `faults` (none: fault-free)."""

    def __init__(self, s: SimSettings, faults: list[cs.Fault]) -> None:
        self.s = s
        self.clean = counted()
        self.pending = list(faults)
        tamper = s.tamper
        submitted: Contribution = self.clean if tamper is None else (
            lambda rank, step: tamper(rank, step, self.clean(rank, step)))
        self.run: Simulation = start(s.world, None, 2**62, contribution=submitted, seed=s.seed,
                                     on_outcome=self._outcome, on_admitted=self._admitted, step_gap_s=s.step_s,
                                     wire=False, quick_start=True, trees=TREES)
        self.net: SimNetwork = self.run.network
        self.clock = self.net.clock
        self.checks: dict[int, StepCheck] = {}
        self.t0: float | None = None  # the window: from the first result of step 0, duration_s long
        self.window_over = False
        self.closing = False  # faults over, every rank must contribute again, then the last step is set
        self.contributions = self.steps = 0
        self.frames_at: list[int] = []
        self.kinds_at: list[Counter[str]] = []
        self.last_progress = 0.0
        self.newest = -1
        self.measures: list[SimMeasure] = []
        self.active: list[SimMeasure] = []
        self.disturbed: set[int] = set()
        self.contributed = dict.fromkeys(range(s.world), True)  # rank -> its current process takes part
        self.started = dict.fromkeys(range(s.world), 0.0)  # rank -> when its current process started
        self.admitted_at: dict[int, int] = {}  # rank -> its current (new) process's first step
        self.admissions: list[tuple[int, int, int]] = []  # (rank, first step, process) owed a result
        self.left_windows: list[list[int]] = []  # [rank, left at step, its new process's first step or -1]
        self.leaving: set[int] = set()
        self.restarting: set[int] = set()
        self.straggling: set[int] = set()
        self.evictions = self.failed_steps = 0
        self.installs: dict[int, tuple[float, float]] = {}  # view epoch -> (first, last install)
        self.net.note_listeners.append(self._note)
        for node in self.net.nodes:
            self._watch(node)

    # ---- what the processes report ----------------------------------------------------------

    def _watch(self, node: Node) -> None:
        node.view_listeners.append(self._installed)

    def _installed(self, inst: Installed) -> None:
        now = self.clock.now()
        epoch = inst.view.epoch
        if epoch in self.installs:
            first, _ = self.installs[epoch]
            self.installs[epoch] = (first, now)
            return
        self.installs[epoch] = (now, now)
        for r in inst.evicted:  # a fault that ended long ago did not cause it (then no fault's)
            m = self._newest(r, lambda m: m.view_s is None and m.t_back is None
                             and (m.t_end is None or now <= m.t_end + DETECT_GRACE_S))
            if m is not None:
                m.view_s = now - m.t_fault
        for r in inst.joined:
            m = self._newest(r, lambda m: m.t_back is not None and m.join_view_s is None)
            if m is not None and m.t_back is not None:
                m.join_view_s = now - m.t_back

    def _newest(self, rank: int, want: Callable[[SimMeasure], bool]) -> SimMeasure | None:
        mine = [m for m in self.measures if rank in m.fault.ranks and want(m)]
        return max(mine, key=lambda m: m.t_fault, default=None)

    def _note(self, _rank: int, note: Note) -> None:
        if note.link is None:
            return
        link = set(note.link)
        now = self.clock.now()
        for m in self.active:
            if m.fault.kind in cs.LINK_KINDS and m.detected_s is None and set(m.fault.ranks) == link:
                m.detected_s = now - m.t_fault

    def _admitted(self, run: Simulation, rank: int, first_step: int) -> None:
        self.admitted_at[rank] = first_step
        self.admissions.append((rank, first_step, self.net.process_of(rank)))
        for w in self.left_windows:
            if w[0] == rank and w[2] < 0:
                w[2] = first_step

    def _outcome(self, run: Simulation, rank: int, step: int, outcome: Outcome) -> None:
        run.outcomes.pop((rank, step), None)  # checked here: a long run keeps only what it needs
        self.net.forget(rank, step)
        if isinstance(outcome, GroupLeft):
            self._group_left(rank)
            return
        if not isinstance(outcome, StepResult):
            self.failed_steps += 1
            return
        check = self.checks.get(step)
        if check is None:
            check = self.checks[step] = StepCheck(step, self.clean)
            check.add(rank, outcome)
            self._first_result(step, outcome)
        else:
            check.add(rank, outcome)

    def _first_result(self, step: int, res: StepResult) -> None:
        now = self.clock.now()
        self.last_progress = now
        self.net.notes.clear()  # heard through note_listeners already
        self.newest = max(self.newest, step)
        for old in [s for s in self.checks if s < step - 64]:  # results of one step come within a few steps
            del self.checks[old]
        if step == 0 and self.t0 is None:
            self._open_window(now)
        if self.t0 is not None and not self.window_over:
            self.contributions += len(res.contributors)
            self.steps += 1
        contributors, late = set(res.contributors), set(res.late)
        for w in self.left_windows:
            if w[0] in contributors and w[1] <= step and (w[2] < 0 or step < w[2]):
                raise ChaosFailure(f"rank {w[0]} left before step {w[1]} but is in the result of step {step}")
        self.left_windows = [w for w in self.left_windows if w[2] < 0 or w[2] > step]
        owed = []
        for rank, first, process in self.admissions:
            if rank in contributors and first <= step:
                continue
            if step > first + JOINED_WITHIN:
                if self.net.process_of(rank) == process and rank not in self.restarting:
                    raise ChaosFailure(f"rank {rank}, admitted at step {first}, is in no result of steps "
                                       f"{first}..{first + JOINED_WITHIN}")
                continue  # left out again (evicted, or it crashed): taking part is not owed then
            owed.append((rank, first, process))
        self.admissions = owed
        for rank, first in list(self.admitted_at.items()):
            if first <= step and rank in contributors:
                del self.admitted_at[rank]
                self._healed(rank, now)
        for m in self.measures:
            self._detect(m, now, contributors, late)

    def _detect(self, m: SimMeasure, now: float, contributors: set[int], late: set[int]) -> None:
        if m.detected_s is not None or now <= m.t_fault:
            return
        if m.t_end is not None and now > m.t_end + DETECT_GRACE_S and m.fault.kind not in cs.REJOINS:
            return  # a step this late would be another fault's doing
        victims = set(m.fault.ranks)
        if not victims <= contributors or victims & late:
            m.detected_s = now - m.t_fault

    def _healed(self, rank: int, now: float) -> None:
        self.contributed[rank] = True
        m = self._newest(rank, lambda m: m.t_back is not None and m.healed_s is None)
        if m is not None:
            m.healed_s = now - m.t_fault

    def _group_left(self, rank: int) -> None:
        """The current process of `rank` is out of the group: it left (a leave fault ends with
        a new process), or the group evicted it (its process restarts at once, as the real
        runner restarts a worker that exits evicted)."""
        if rank in self.leaving or rank in self.restarting:
            return
        self.evictions += 1
        self.restarting.add(rank)
        m = self._newest(rank, lambda m: m.fault.kind in (cs.STOP, cs.STRAGGLER, cs.CUT, cs.LOSS)
                         and m.t_back is None and m.healed_s is None)
        self.clock.call_later(0.0, lambda: self._restart(rank, m))

    def _restart(self, rank: int, m: SimMeasure | None) -> None:
        self.restarting.discard(rank)
        self.straggling.discard(rank)
        self.contributed[rank] = False
        self.started[rank] = self.clock.now()
        self.admitted_at.pop(rank, None)
        self._watch(self.net.restart(rank))
        if m is not None:
            m.t_back = self.clock.now()

    # ---- faults -------------------------------------------------------------------------------

    def _open_window(self, now: float) -> None:
        self.t0 = now
        self._snapshot()
        self.clock.call_at(now + self.s.duration_s, self._close_window)
        for f in self.pending:
            self.clock.call_at(now + f.at_s, functools.partial(self._due, f))

    def _snapshot(self) -> None:
        stats = self.net.wire.stats
        self.frames_at.append(stats.sent)
        self.kinds_at.append(Counter({k.name: n for k, n in stats.by_kind.items()}))

    def healthy(self, rank: int) -> bool:
        return self.contributed[rank] and rank not in self.restarting

    def _due(self, f: cs.Fault) -> None:
        if self.closing:
            return
        busy = {r for m in self.active for r in m.fault.ranks}
        self.disturbed = {r for r in self.disturbed if r in busy or not self.healthy(r)}
        if not cs.allowed(self.disturbed, f.ranks, self.s.world) or not all(self.healthy(r) for r in f.ranks):
            self.clock.call_later(POLL_S, lambda: self._due(f))  # the runner's majority rule: it waits
            return
        self._begin(f)

    def _begin(self, f: cs.Fault) -> None:
        now = self.clock.now()
        m = SimMeasure(f, now)
        self.measures.append(m)
        self.active.append(m)
        self.disturbed |= set(f.ranks)
        r = f.ranks[0]
        match f.kind:
            case cs.KILL:
                self.net.crash(r)
                self.contributed[r] = False
            case cs.STOP:
                self.net.hang(r)
            case cs.CUT:
                self.net.cut(*f.ranks)
            case cs.LOSS:
                self.net.drop(f.ranks[0], f.ranks[1], f.percent / 100.0)
            case cs.STRAGGLER:
                self.straggling.add(r)
                self.net.hang(r)
                self.clock.call_later(STRAGGLE_S, lambda: self._straggle(r, stopped=True))
            case cs.LEAVE:
                self.leaving.add(r)
                self.contributed[r] = False
                self.net.leaves[r] = 0  # its loop leaves instead of taking its next step
        assert self.t0 is not None
        self.s.echo(f"  {cs.Fault(now - self.t0, f.kind, f.ranks, f.hold_s, f.percent)}")
        self.clock.call_later(f.hold_s, lambda: self._end(m))

    def _straggle(self, rank: int, *, stopped: bool) -> None:
        if rank not in self.straggling:
            return
        if stopped:
            self.net.resume(rank)
        else:
            self.net.hang(rank)
        self.clock.call_later(STRAGGLE_S, lambda: self._straggle(rank, stopped=not stopped))

    def _end(self, m: SimMeasure) -> None:
        if m not in self.active:
            return
        f, r = m.fault, m.fault.ranks[0]
        match f.kind:
            case cs.KILL:
                self._restart(r, m)
            case cs.STOP:
                self.net.resume(r)
            case cs.CUT | cs.LOSS:
                self.net.heal(*f.ranks)
            case cs.STRAGGLER:
                if r in self.straggling:
                    self.straggling.discard(r)
                    self.net.resume(r)
            case cs.LEAVE:
                if self.net.nodes[r].stopped is None:  # not out yet: its step, then the leave, take a while
                    if self.clock.now() - m.t_fault > self.s.heal_s:
                        raise ChaosFailure(f"hang: rank {r} asked to leave {self.s.heal_s:g} s ago (simulated) "
                                           "and is still in the group")
                    self.clock.call_later(POLL_S, lambda: self._end(m))
                    return
                self.leaving.discard(r)
                self.net.leaves.pop(r, None)
                self.left_windows.append([r, self.run.left[r], -1])
                self._restart(r, m)
        m.t_end = self.clock.now()
        self.active.remove(m)

    def _close_window(self) -> None:
        """The window is over: count no more, end every fault now, and once every rank takes
        part again, let every loop end a few steps on."""
        self.window_over = self.closing = True
        self._snapshot()
        for m in list(self.active):
            if m.fault.kind == cs.LEAVE and self.net.nodes[m.fault.ranks[0]].stopped is None:
                continue  # ends (with its new process) once the old one is out
            self._end(m)
        self._wait_whole()

    def _wait_whole(self) -> None:
        now = self.clock.now()
        if self.active or not all(self.healthy(r) for r in range(self.s.world)):
            for r in range(self.s.world):
                if not self.healthy(r) and now - self.started[r] > self.s.heal_s and r not in self.leaving:
                    raise ChaosFailure(f"hang: rank {r}'s process started {self.s.heal_s:g} s ago (simulated) and "
                                       "has not contributed to a step")
            self.clock.call_later(POLL_S, self._wait_whole)
            return
        self.run.steps = self.newest + self.s.stop_margin

    # ---- the run ------------------------------------------------------------------------------

    def go(self) -> SimResult:
        began = time.perf_counter()
        run, clock = self.run, self.clock
        s = self.s
        next_echo = s.duration_s / 4
        while (clock.busy or run.waiting()) and clock.next_at is not None:
            clock.run(until=clock.next_at)
            if run.hook_errors:
                error = run.hook_errors[0]
                raise error if isinstance(error, ChaosFailure) else ChaosFailure(str(error))
            now = clock.now()
            if now - self.last_progress > s.stall_s and (self.t0 is not None or now > s.stall_s + 60):
                raise ChaosFailure(f"hang: no step finished for {s.stall_s:g} s (simulated; ranks waiting: "
                                   f"{sorted(r for r, _ in run.waiting())[:8]})")
            if self.t0 is not None and now - self.t0 >= next_echo and not self.window_over:
                s.echo(f"  {now - self.t0:.0f} s simulated, {self.steps} steps, {time.perf_counter() - began:.0f} s "
                       "wall")
                next_echo += s.duration_s / 4
        if run.waiting():
            raise ChaosFailure(f"hang: steps without an outcome (rank, step): {sorted(run.waiting())[:8]}")
        if not self.window_over:
            raise ChaosFailure("the run ended before its window did (no step finished after the start)")
        if run.refused:
            raise ChaosFailure(f"processes kept out of the group: {run.refused}")
        self._check_leftovers()
        by_kind = self.kinds_at[1] - self.kinds_at[0]
        return SimResult(self.contributions, s.duration_s, self.steps, self.frames_at[1] - self.frames_at[0], by_kind,
                         self.measures, self.evictions, self.failed_steps, time.perf_counter() - began)

    def _check_leftovers(self) -> None:
        """Results of processes replaced before they ended (the hook hears only current ones)."""
        for (rank, step), outcome in sorted(self.run.outcomes.items()):
            if isinstance(outcome, StepResult):
                try:
                    self.checks.get(step, StepCheck(step, self.clean)).add(rank, outcome)
                except AssertionError as exc:
                    raise ChaosFailure(str(exc)) from exc


def run_sim_chaos(s: SimSettings) -> tuple[SimResult, SimResult]:
    """(fault-free, chaos): the same world, duration and step, simulated."""
    logging.disable(logging.ERROR)  # a view change logs on every rank, an eviction on its victim: the report says it
    try:
        faults = cs.draw(s.world, s.duration_s, s.every_s, s.seed, s.kinds)
        s.echo(f"fault-free simulation: {s.world} ranks for {s.duration_s:g} s (simulated)")
        base = SimChaos(s, []).go()
        s.echo(f"  {base.contributions} contributions in {base.seconds:g} s: {base.rate:.1f}/s over {base.steps} "
               f"steps ({base.wall_s:.0f} s wall)")
        s.echo(f"chaos simulation: {len(faults)} faults drawn (seed {s.seed}, one every {s.every_s:g} s on average)")
        chaos = SimChaos(s, faults).go()
    finally:
        logging.disable(logging.NOTSET)
    return base, chaos


def report(base: SimResult, chaos: SimResult, world: int, echo: Callable[[str], None]) -> float:
    goodput = chaos.rate / base.rate
    echo(f"chaos: {chaos.contributions} contributions in {chaos.seconds:g} s: {chaos.rate:.1f}/s over "
         f"{chaos.steps} steps, {chaos.evictions} evicted ranks restarted, {chaos.failed_steps} step errors "
         f"({chaos.wall_s:.0f} s wall)")
    for kind, ms in by_kind(chaos.measures):
        echo(kind_line(kind, ms))
    evict = [m.view_s for m in chaos.measures if m.view_s is not None]
    join = [m.join_view_s for m in chaos.measures if m.join_view_s is not None]
    echo(f"  view changes: {len(evict)} without a victim, fault to first install" + stats(evict)
         + f"; {len(join)} with a new process, its start to first install" + stats(join))
    faults = max(1, len(chaos.measures))
    per_step = chaos.steps / max(1, base.steps)  # the chaos run's steps over the fault-free run's
    extra = {k: n - base.by_kind.get(k, 0) * per_step for k, n in chaos.by_kind.items()}
    top = ", ".join(f"{k} {n / world / faults:.1f}" for k, n in sorted(extra.items(), key=lambda kv: -kv[1])[:4]
                    if n > 0)
    beyond = chaos.frames - base.frames * per_step  # beyond what the same steps cost without faults
    echo(f"  frames per rank per fault: {beyond / world / faults:.1f} beyond the fault-free run's per step "
         f"({chaos.frames / world:.0f} per rank in the window, fault-free {base.frames / world:.0f}; most: {top})")
    return goodput
