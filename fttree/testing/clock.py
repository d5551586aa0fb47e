"""A fake clock for simulations: callbacks run in time order, instantly, and deterministically."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class SimHandle:
    __slots__ = ("background", "cancelled", "fn", "when")

    def __init__(self, when: float, fn: Callable[[], None], background: bool) -> None:
        self.when, self.fn, self.background, self.cancelled = when, fn, background, False

    def cancel(self) -> None:
        self.cancelled = True


class SimClock:
    """A discrete-event scheduler (the `Scheduler` of fttree.net.scheduler). `run()` processes
    events until only background ones (link probes, which a real node runs forever) are left."""

    def __init__(self) -> None:
        self.t = 0.0
        self._queue: list[tuple[float, int, SimHandle]] = []
        self._seq = itertools.count()
        self._essential = 0  # queued events that are not background

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def call_at(self, when: float, fn: Callable[[], None], *, background: bool = False) -> SimHandle:
        handle = SimHandle(max(when, self.t), fn, background)
        heapq.heappush(self._queue, (handle.when, next(self._seq), handle))
        self._essential += not background
        return handle

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> SimHandle:
        return self.call_at(self.t + delay_s, fn)

    @property
    def busy(self) -> bool:
        """Is anything but background events (probes, watches a real node keeps up) queued?"""
        return self._essential > 0

    @property
    def next_at(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def run(self, until: float | None = None, *, while_busy: bool = False) -> None:
        """Run events in order until only background ones are left, or (with `until`) until the
        clock would pass it; then the clock stands at `until`. With both, whichever comes first
        (and the clock stays where the last event left it)."""
        while self._queue and (self._essential or (until is not None and not while_busy)):
            when, _, handle = self._queue[0]
            if until is not None and when > until:
                break
            heapq.heappop(self._queue)
            self._essential -= not handle.background
            self.t = max(self.t, when)
            if not handle.cancelled:
                handle.fn()
        if until is not None and not while_busy:
            self.t = max(self.t, until)
