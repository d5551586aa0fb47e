"""The demo job that `fttree worker` and `fttree launch` run: allreduce steps of a tensor whose
exact sum is known, so every step can be checked bit for bit on every worker."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..api import FTTreeAllreduce
from ..core.protocol import Note, NoteKind
from ..errors import FTTreeError

THESIS_MLP_PARAMS = 407_050  # 784-512-10 MLP of the seed thesis


def contribution(rank: int, step: int, size: int) -> np.ndarray:
    """Integer-valued float32, so the float sum is exact whatever the order of addition."""
    return (np.arange(size, dtype=np.float32) % 5) + np.float32((rank + 1) * (step + 1))


def expected_sum(world: int, step: int, size: int) -> np.ndarray:
    base = np.float32((step + 1) * world * (world + 1) // 2)
    return (np.arange(size, dtype=np.float32) % 5) * np.float32(world) + base


@dataclass
class StepRecord:
    rank: int
    step: int
    duration_s: float
    exact: bool
    contributors: int
    error: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)  # Note.as_record() of its recoveries and detours

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class StepNotes:
    """The notes a run's step records show, collected per step on the node's loop: everything
    that says a link was in trouble or routed around, as JSON-ready records."""

    KINDS = (NoteKind.RECOVERY, NoteKind.TIMEOUT, NoteKind.DETOUR)

    def __init__(self, ar: FTTreeAllreduce) -> None:
        assert ar.node is not None
        self._by_step: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        ar.node.note_listeners.append(self._on_note)

    def _on_note(self, note: Note) -> None:
        if note.kind in self.KINDS:
            self._by_step[note.step].append(note.as_record())

    def pop(self, step: int) -> list[dict[str, Any]]:
        """The records of `step`, forgetting those of older steps (late notes must not pile up)."""
        for old in [s for s in self._by_step if s < step]:
            del self._by_step[old]
        return self._by_step.pop(step, [])


def run_steps(ar: FTTreeAllreduce, steps: int, size: int,
              before_step: Callable[[int], None] | None = None) -> Iterator[StepRecord]:
    """Run `steps` checked allreduce steps and yield one record per step. `before_step(step)`
    runs before each step's clock starts (the real-fault gate waits there)."""
    notes = StepNotes(ar)
    for step in range(steps):
        data = contribution(ar.rank, step, size)
        if before_step is not None:
            before_step(step)
        t0 = time.perf_counter()
        try:
            out = ar.allreduce(data)
        except FTTreeError as exc:
            yield StepRecord(rank=ar.rank, step=step, duration_s=time.perf_counter() - t0, exact=False,
                             contributors=0, error=str(exc), events=notes.pop(step))
            continue
        duration = time.perf_counter() - t0
        exact = bool(np.array_equal(out, expected_sum(ar.world, step, size)))
        contributors = len(ar.last.contributors) if ar.last is not None else 0
        yield StepRecord(rank=ar.rank, step=step, duration_s=duration, exact=exact,
                         contributors=contributors, events=notes.pop(step))
