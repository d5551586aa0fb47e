"""Calls that wait while a join is being agreed."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class HoldQueue:
    """While the replica holds (a join is being agreed), a submit or a training-step boundary
    may be the one the join starts at, so it waits here; once the hold is lifted the waiting
    calls run in the order they came."""

    def __init__(self) -> None:
        self.on = False
        self._waiting: deque[Callable[[], None]] = deque()

    def defer(self, call: Callable[[], None]) -> bool:
        """Keep `call` for later if the hold is on (True); False: run it now."""
        if self.on:
            self._waiting.append(call)
        return self.on

    def set(self, on: bool) -> None:
        """The replica holds, or lifts its hold: then what waited runs, unless a call holds again."""
        self.on = on
        while not self.on and self._waiting:
            self._waiting.popleft()()

    def __len__(self) -> int:
        return len(self._waiting)
