"""`fttree bench --long-run N`: does a step cost the same at the end of a long run as near its start?

Real training runs are tens of thousands of steps, and nothing fttree keeps may grow with them
(issue 10 found bookkeeping that did: it slowed every step and finally stalled the job). This
run is the issue's scenario: 3 workers, a 25,600-element float32 tensor cut into 4 KiB chunks
(25 ops per step), no faults, N steps. The figure is the median step time of the last 500 steps
over the median of steps 100-599 (past start-up); the target is at most 1.1.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from .bench import RunResult, RunSpec

WORLD = 3
SIZE = 25_600  # float32 elements
CHUNK_BYTES = 4096  # 25 chunks per step
EARLY = range(100, 600)
LATE_STEPS = 500
TARGET = 1.1


def spec(steps: int, *, step_timeout_s: float = 30.0) -> RunSpec:
    if steps < EARLY.stop + LATE_STEPS:
        raise ValueError(f"--long-run needs at least {EARLY.stop + LATE_STEPS} steps, got {steps}")
    return RunSpec(kind="fttree", world=WORLD, size=SIZE, steps=steps, warmup=0, policy="adaptive",
                   purpose="long-run", step_timeout_s=step_timeout_s, chunk_bytes=CHUNK_BYTES)


@dataclass(frozen=True, slots=True)
class LongRunFigure:
    steps: int  # steps finished on every worker
    failed: int  # steps that failed or were inexact somewhere
    early_median_s: float  # steps 100-599
    late_median_s: float  # the last 500 steps
    ratio: float

    @property
    def met(self) -> bool:
        return self.failed == 0 and self.ratio <= TARGET

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "target": TARGET, "met": self.met}


def figure(res: RunResult) -> LongRunFigure:
    """The figure from a finished run (step times are the slowest worker's)."""
    done = res.complete_steps()
    if len(done) < EARLY.stop + LATE_STEPS:
        raise ValueError(f"the long run finished only {len(done)} steps on every worker: {res.error or 'no error'}")
    times = {s: res.step_time(s) for s in done}
    early = statistics.median(times[s] for s in EARLY if s in times)
    late = statistics.median(times[s] for s in done[-LATE_STEPS:])
    return LongRunFigure(steps=len(done), failed=len(res.failed_steps()), early_median_s=early, late_median_s=late,
                         ratio=late / early)


def render(fig: LongRunFigure) -> str:
    verdict = "met" if fig.met else "MISSED"
    return (f"long run: {WORLD} workers, {SIZE:,} float32 in {CHUNK_BYTES} B chunks (25 per step), {fig.steps} steps, "
            f"{fig.failed} failed\n"
            f"  median step, steps {EARLY.start}-{EARLY.stop - 1}: {fig.early_median_s * 1000:.2f} ms; "
            f"last {LATE_STEPS} steps: {fig.late_median_s * 1000:.2f} ms; "
            f"ratio {fig.ratio:.3f} (target <= {TARGET}: {verdict})")
