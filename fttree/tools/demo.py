"""The demo job that `fttree worker` and `fttree launch` run: allreduce steps of a tensor whose
exact sum is known, so every step can be checked bit for bit on every worker."""

from __future__ import annotations

import json
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.effects import Note, NoteKind
from ..errors import FTTreeError, StepRetry

if TYPE_CHECKING:  # the API (numpy, uvloop, the transport) loads with the first worker, not with `fttree --help`
    from ..api import FTTreeAllreduce

from .sizes import THESIS_MLP_PARAMS as THESIS_MLP_PARAMS  # re-exported: its old home


def contribution(rank: int, step: int, size: int) -> np.ndarray:
    """Integer-valued float32, so the float sum is exact whatever the order of addition."""
    return (np.arange(size, dtype=np.float32) % 5) + np.float32((rank + 1) * (step + 1))


def expected_sum(world: int, step: int, size: int) -> np.ndarray:
    base = np.float32((step + 1) * world * (world + 1) // 2)
    return (np.arange(size, dtype=np.float32) % 5) * np.float32(world) + base


def sum_of(ranks: tuple[int, ...] | list[int], step: int, size: int) -> np.ndarray:
    """The exact sum of the contributions of `ranks` to `step`: what a step that lost a worker
    must give (the sum over the contributors it reports), bit for bit."""
    base = np.float32((step + 1) * sum(r + 1 for r in ranks))
    return (np.arange(size, dtype=np.float32) % 5) * np.float32(len(ranks)) + base


def digest(data: np.ndarray) -> str:
    """A short checksum of a result, so workers' results can be compared without shipping them."""
    return f"{zlib.crc32(np.ascontiguousarray(data).tobytes()):08x}"


@dataclass
class StepRecord:
    rank: int
    step: int
    duration_s: float
    exact: bool
    contributors: int
    error: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)  # Note.as_record() of its recoveries and detours
    ranks: list[int] = field(default_factory=list)  # who is in the sum (StepResult.contributors)
    epoch: int = 0  # the view the step ran in
    members: list[int] = field(default_factory=list)  # that view's ranks in slot order (as this rank knows it)
    digest: str = ""  # crc32 of the result: equal on every worker of a step, or something is wrong
    error_kind: str = ""  # the exception's class: StepAborted, GroupLeft, StepRetry, ...
    retries: int = 0  # times the step was run again after a StepRetry (on_node_failure="rollback")
    relayed_bytes: int = 0  # envelope bytes this rank sent or carried through relays so far (net/relay.py)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def relayed_bytes(ar: FTTreeAllreduce) -> int:
    """What this rank sent and carried through relays so far (read off the counters: building
    the transport's status after every step costs more than a small step's send)."""
    relays = getattr(getattr(ar.transport, "inner", None), "relays", None)
    return 0 if relays is None else int(relays.counters.sent_bytes + relays.counters.forwarded_bytes)


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
              before_step: Callable[[int], None] | None = None, max_retries: int = 3) -> Iterator[StepRecord]:
    """Run `steps` checked allreduce steps and yield one record per step. `before_step(step)`
    runs before each step's clock starts (the real-fault gates wait there). A step is exact when
    its result equals the sum over the contributors it reports (all ranks, unless a worker died).
    A StepRetry (on_node_failure="rollback") runs the step again with the same contribution."""
    notes = StepNotes(ar)
    ar.admit()  # a joiner is let in now, ready to run its first step
    first = 0 if ar.joined_at is None else ar.joined_at[1]  # a joiner starts at the group's step
    for step in range(first, steps):
        data = contribution(ar.rank, step, size)
        if before_step is not None:
            before_step(step)
        ar.mark_step(step)  # fault windows count these steps, also when one is run again
        t0 = time.perf_counter()
        retries = 0
        while True:
            try:
                res = ar.submit_array(data, f"float32[{size}]").result(timeout=ar.config.step_timeout_s + 10)
            except StepRetry:
                if retries < max_retries:
                    retries += 1
                    continue
                raise
            except FTTreeError as exc:
                yield StepRecord(rank=ar.rank, step=step, duration_s=time.perf_counter() - t0, exact=False,
                                 contributors=0, error=str(exc), events=notes.pop(step), epoch=ar.view.epoch,
                                 members=list(ar.view.members), error_kind=type(exc).__name__, retries=retries)
                break
            except TimeoutError:
                yield StepRecord(rank=ar.rank, step=step, duration_s=time.perf_counter() - t0, exact=False,
                                 contributors=0, error=f"step {step}: no outcome (event loop stuck?)",
                                 events=notes.pop(step), error_kind="TimeoutError", retries=retries)
                break
            duration = time.perf_counter() - t0
            ranks = sorted(res.contributors)
            exact = bool(np.array_equal(res.data, sum_of(ranks, step, size)))
            yield StepRecord(rank=ar.rank, step=step, duration_s=duration, exact=exact, contributors=len(ranks),
                             events=notes.pop(step), ranks=ranks, epoch=res.epoch, members=list(ar.view.members),
                             digest=digest(res.data), retries=retries, relayed_bytes=relayed_bytes(ar))
            break
