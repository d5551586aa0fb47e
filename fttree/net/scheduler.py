"""Time for the driver: the Node sets timers and reads clocks only through a Scheduler, so the
same Node runs on an asyncio loop (`AsyncioScheduler`) and on the simulator's fake clock
(fttree.testing.SimClock)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Handle(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    def now(self) -> float:
        """The clock timers are set on (seconds)."""

    def monotonic(self) -> float:
        """A fine-grained clock for measuring durations (seconds)."""

    def call_at(self, when: float, fn: Callable[[], None], *, background: bool = False) -> Handle:
        """Run `fn` at `now() == when`. Background timers (link probes) do not keep a
        simulation running on their own."""

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Handle: ...


class AsyncioScheduler:
    """The node's own event loop. Durations use perf_counter: uvloop's clock ticks in whole ms."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def now(self) -> float:
        return self.loop.time()

    def monotonic(self) -> float:
        return time.perf_counter()

    def call_at(self, when: float, fn: Callable[[], None], *, background: bool = False) -> Handle:
        return self.loop.call_at(when, fn)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Handle:
        return self.loop.call_later(delay_s, fn)
