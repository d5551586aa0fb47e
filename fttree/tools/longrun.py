"""`fttree bench --long-run N`: does a step cost the same at the end of a long run as near its start?

Real training runs are tens of thousands of steps, and nothing fttree keeps may grow with them
(issue 10 found bookkeeping that did: it slowed every step and finally stalled the job). This
run is the issue's scenario: 3 workers, a 25,600-element float32 tensor cut into 4 KiB chunks
(25 ops per step), no faults, N steps. The figure is the median step time of the last 500 steps
over the median of steps 100-599 (past start-up); the target is at most 1.1.

Step times on a shared machine drift with other tenants' load (this 2-core box ran the same
code 1.5x faster or slower minutes apart), so the run also reports what would have to grow
for steps to slow down: every worker's bookkeeping sizes (`Node.footprint`) and resident
memory after every FOOTPRINT_EVERY steps, printed as the largest rank's at step 599 and at the
end, and as the largest over the whole run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .bench_spec import RunResult, RunSpec

WORLD = 3
SIZE = 25_600  # float32 elements
CHUNK_BYTES = 4096  # 25 chunks per step
EARLY = range(100, 600)
LATE_STEPS = 500
TARGET = 1.1
FOOTPRINT_EVERY = 100


def spec(steps: int, *, step_timeout_s: float = 30.0) -> RunSpec:
    if steps < EARLY.stop + LATE_STEPS:
        raise ValueError(f"--long-run needs at least {EARLY.stop + LATE_STEPS} steps, got {steps}")
    return RunSpec(kind="fttree", world=WORLD, size=SIZE, steps=steps, warmup=0, policy="adaptive",
                   purpose="long-run", step_timeout_s=step_timeout_s, chunk_bytes=CHUNK_BYTES,
                   footprint_every=FOOTPRINT_EVERY)


@dataclass(frozen=True, slots=True)
class LongRunFigure:
    steps: int  # steps finished on every worker
    failed: int  # steps that failed or were inexact somewhere
    early_median_s: float  # steps 100-599
    late_median_s: float  # the last 500 steps
    ratio: float
    #: bookkeeping sizes and rss_kib, each the largest rank's: at step 599, at the end, over the run
    footprint_early: dict[str, int] = field(default_factory=dict)
    footprint_late: dict[str, int] = field(default_factory=dict)
    footprint_peak: dict[str, int] = field(default_factory=dict)

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
                         ratio=late / early,
                         footprint_early=_largest(res, lambda got: [s for at, s in got if at == EARLY.stop - 1]),
                         footprint_late=_largest(res, lambda got: [s for _, s in got[-1:]]),
                         footprint_peak=_largest(res, lambda got: [s for _, s in got]))


Samples = list[tuple[int, dict[str, int]]]


def _largest(res: RunResult, pick: Callable[[Samples], list[dict[str, int]]]) -> dict[str, int]:
    """Each size's largest value over the ranks, in the samples `pick` takes from each rank's."""
    out: dict[str, int] = {}
    for samples in res.footprints.values():
        for sizes in pick(samples):
            for key, value in sizes.items():
                out[key] = max(out.get(key, value), value)
    return out


def render(fig: LongRunFigure) -> str:
    verdict = "met" if fig.met else "MISSED"
    return (f"long run: {WORLD} workers, {SIZE:,} float32 in {CHUNK_BYTES} B chunks (25 per step), {fig.steps} steps, "
            f"{fig.failed} failed\n"
            f"  median step, steps {EARLY.start}-{EARLY.stop - 1}: {fig.early_median_s * 1000:.2f} ms; "
            f"last {LATE_STEPS} steps: {fig.late_median_s * 1000:.2f} ms; "
            f"ratio {fig.ratio:.3f} (target <= {TARGET}: {verdict})" + _render_footprint(fig))


def _render_footprint(fig: LongRunFigure) -> str:
    if not fig.footprint_late:
        return ""
    early, late, peak = fig.footprint_early, fig.footprint_late, fig.footprint_peak
    cells = ", ".join(f"{k} {early.get(k, '-')} / {late[k]} / {peak.get(k, '-')}" for k in sorted(late))
    return f"\n  kept by the largest rank, at step {EARLY.stop - 1} / at the end / largest in the run: {cells}"
