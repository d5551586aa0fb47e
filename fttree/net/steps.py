"""Steps in flight on one rank: the caller's futures, the chunks, and what a view change does.

A step is cut into chunks, each its own op in the tree machine (at the view's pace, so every
member cuts it alike, and the same when it runs again), and put together here when every chunk
has its result: only then does the result replace the caller's contribution, which may have to
run again until that moment. A step submitted while a view change is agreed waits (held back)
and starts in the new view; one the new view voided runs again, fails, or goes back to the
caller, as `Config.on_node_failure` says.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..core.chunking import plan_chunks
from ..core.config import Config
from ..core.effects import AbortCode, Complete, Fail
from ..core.membership import Busy, MemberEvent
from ..core.protocol import Submit
from ..core.replica import Replica, ReplicaEvent, StepDone
from ..errors import StepAborted, StepRetry, TensorMismatch
from .scheduler import Scheduler


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one finished step gives back: the sum and who is in it."""

    step: int
    data: np.ndarray
    contributors: tuple[int, ...]
    duration_s: float
    epoch: int = 0  # the view the step ran in
    # members that were late (Config.straggler_policy = "deadline"): in the step with zeros, not
    # counted, still members. This rank, if it is among them, got the others' result.
    late: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """A step as the caller submitted it: what a view change holds back and runs later."""

    step: int
    data: np.ndarray  # the caller's contribution: read, never written, until the step completes
    signature: str
    future: Future[StepResult]
    contribute: bool = True  # False: zeros that take part without counting (a joiner awaiting its state)
    abort: str = ""  # fail the step everywhere for this reason (a NaN in our contribution, nonfinite="abort")
    reduce: str = "sum"  # how contributions meet (core/reduce_ops.py)
    compression: str | None = None  # float32 data travels as this (None: Config.compression)
    closable: bool = False  # under straggler_policy="deadline", the step may close without late ranks


@dataclass(slots=True)
class _Running:
    request: Request
    offsets: dict[int, int]  # chunk -> its first element
    per_chunk: int  # elements a chunk (the last may be shorter): the same when the step runs again
    started: float  # monotonic, for the duration
    began: float  # the scheduler's clock, for the membership's silence checks
    results: dict[int, np.ndarray] = field(default_factory=dict)
    contributors: tuple[int, ...] | None = None
    late: set[int] = field(default_factory=set)  # late in some chunk (a late rank is late in all)
    epoch: int = 0


class StepBook:
    """The steps submitted on one rank and not finished yet. `run_chunk` hands a chunk to the
    replica, `member` tells the membership when the rank is busy, `tell` hands the replica other
    news (a step done), `settled` runs after a step finished or failed here (`True`: with a result)."""

    def __init__(self, config: Config, scheduler: Scheduler, replica: Replica, *,
                 run_chunk: Callable[[Submit], None], member: Callable[[MemberEvent], None],
                 tell: Callable[[ReplicaEvent], None], settled: Callable[[bool], None]) -> None:
        self.cfg = config
        self.scheduler = scheduler
        self.replica = replica  # the view steps are cut in; it hears of each whole result (StepDone)
        self._run_chunk = run_chunk
        self._member = member
        self._tell = tell
        self._settled = settled
        self.running: dict[int, _Running] = {}
        self.held_back: list[Request] = []  # submitted during a view change: run once it is agreed
        self.last_submitted = -1  # the newest step submitted here (DONE names it)
        self.reruns = 0  # steps run again in a new view after a node failure
        self.durations: deque[tuple[int, float]] = deque(maxlen=100)
        # (step, duration_s, error or None) when a step finishes here
        self.listeners: list[Callable[[int, float, str | None], None]] = []
        self.late_streak: dict[int, int] = {}  # member -> steps in a row it was late in (stragglers.py)
        self.late_total: dict[int, int] = {}  # member -> steps it was late in

    def __contains__(self, step: int) -> bool:
        return step in self.running or any(r.step == step for r in self.held_back)

    def pending(self) -> frozenset[int]:
        """The steps submitted here without an outcome yet: running or held back."""
        return frozenset(self.running).union(r.step for r in self.held_back)

    def __bool__(self) -> bool:
        return bool(self.running)

    def oldest_began(self) -> float:
        return min(run.began for run in self.running.values())

    def submit(self, req: Request, *, hold: bool) -> None:
        """Start `req` now, or once the view being agreed is in effect (`hold`)."""
        if hold:
            self.held_back.append(req)
        else:
            self._start(req)

    def start_held(self) -> None:
        """The view is in effect: the steps held back during its change start in it."""
        held, self.held_back = self.held_back, []
        for req in held:
            self._start(req)

    def _start(self, req: Request) -> None:
        try:
            self._cut(req)
        except Exception as exc:  # a bug or a misuse: the caller hears of it, never waits forever
            self.running.pop(req.step, None)
            if not req.future.done():
                req.future.set_exception(exc)

    def _cut(self, req: Request) -> None:
        replica = self.replica
        data = req.data
        # cut as every member cuts it: at the view's pace (view.py), never by the number of
        # members (a step run again after an eviction keeps its chunks)
        cut = plan_chunks(self.cfg, data.size, data.itemsize, replica.machine.view.pace)
        idle = not self.running
        run = _Running(request=req, offsets=cut.offsets, per_chunk=cut.per_chunk,
                       started=self.scheduler.monotonic(), began=self.scheduler.now())
        self.running[req.step] = run
        self.last_submitted = max(self.last_submitted, req.step)
        # the membership learns every submitted step: members done before it leave the view, and
        # a rank pinged for a step it has submitted must not say it is still computing it
        self._member(Busy(since=run.began if idle else replica.membership.busy_since, step=req.step))
        self._run(run)

    def _run(self, run: _Running) -> None:
        """Hand every chunk of a step to the replica, in the current view."""
        req = run.request
        run.results.clear()
        run.contributors = None
        run.late.clear()
        run.epoch = self.replica.machine.view.epoch
        for chunk, start in run.offsets.items():
            self._run_chunk(Submit(step=req.step, chunk=chunk, chunks=len(run.offsets),
                                   data=req.data[start:start + run.per_chunk], signature=req.signature,
                                   contribute=req.contribute, abort=req.abort, reduce=req.reduce,
                                   compression=req.compression, closable=req.closable))

    def complete(self, done: Complete) -> None:
        run = self.running.get(done.step)
        if run is None:
            return
        run.results[done.chunk] = done.result
        run.contributors = done.contributors if run.contributors is None else run.contributors
        run.late.update(done.late)
        if len(run.results) < len(run.offsets):
            return
        # Every chunk is in: only now does the result replace the contribution (a step may have
        # had to run again on it until here). Root results are buffers of their own.
        data = run.request.data
        for chunk, result in run.results.items():
            start = run.offsets[chunk]
            data[start:start + result.size] = result
        del self.running[done.step]
        self._tell(StepDone(step=done.step))
        late = tuple(sorted(run.late))
        self._count_late(late, run.contributors)
        duration = self.scheduler.monotonic() - run.started
        self.durations.append((done.step, duration))
        for listener in self.listeners:
            listener(done.step, duration, None)
        self._settled(True)
        future = run.request.future
        if not future.done():
            future.set_result(StepResult(step=done.step, data=data, contributors=run.contributors,
                                         duration_s=duration, epoch=run.epoch, late=late))

    def _count_late(self, late: tuple[int, ...], contributors: tuple[int, ...]) -> None:
        """Who was late in a finished step, and for how many steps in a row (status, metrics)."""
        for rank in late:
            self.late_streak[rank] = self.late_streak.get(rank, 0) + 1
            self.late_total[rank] = self.late_total.get(rank, 0) + 1
        for rank in contributors:
            self.late_streak.pop(rank, None)

    def fail(self, fail: Fail) -> None:
        run = self.running.pop(fail.step, None)
        if run is None or run.request.future.done():
            return
        self._settled(False)
        for listener in self.listeners:
            listener(fail.step, self.scheduler.monotonic() - run.started, fail.reason)
        cls = TensorMismatch if fail.code == AbortCode.MISMATCH else StepAborted
        run.request.future.set_exception(cls(fail.step, fail.reason, peers=fail.peers))

    def voided(self, step: int, evicted: tuple[int, ...]) -> None:
        """A step in flight had no result anywhere when the view changed (`evicted` left it):
        by policy, run it again in the new view, abort it, or hand it back to the caller."""
        run = self.running.get(step)
        if run is None or run.request.future.done():
            return
        view = self.replica.machine.view
        what = (f"ranks {list(evicted)} failed during step {step}; the group went on without them in view "
                f"{view.epoch} ({len(view.members)} workers)")
        policy = self.cfg.on_node_failure
        if policy == "forward":
            self.reruns += 1
            self._run(run)
            return
        del self.running[step]
        self._settled(False)
        if policy == "rollback":
            error: StepAborted = StepRetry(step, f"{what}: run this step again (on_node_failure='rollback')",
                                           peers=evicted, epoch=view.epoch, members=view.members)
        else:
            error = StepAborted(step, f"{what}: the step was aborted (on_node_failure='abort')", peers=evicted)
        run.request.future.set_exception(error)

    def fail_all(self, error: Callable[[int], StepAborted]) -> None:
        """Every step in flight or held back fails with `error(step)`."""
        running, self.running = self.running, {}
        held, self.held_back = self.held_back, []
        for req in [run.request for run in running.values()] + held:
            if not req.future.done():
                req.future.set_exception(error(req.step))
