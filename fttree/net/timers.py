"""The node's timers: the replica names them (TimerKey) and says when; the scheduler runs them.
Which ones keep a simulation going, and which are watches a peer may still need, is decided by
their kind here, so the node only sets, cancels and hears them fire."""

from __future__ import annotations

from collections.abc import Callable

from ..core.effects import TimerKey, TimerKind
from .scheduler import Handle, Scheduler

MEMBER_TIMERS = frozenset({TimerKind.MEMBER_CHECK, TimerKind.MEMBER_CONFIRM, TimerKind.MEMBER_ROUND,
                           TimerKind.MEMBER_STALL, TimerKind.MEMBER_DOUBT})
WATCH_TIMERS = frozenset({TimerKind.REDUCE_WATCH, TimerKind.BCAST_WATCH})  # a peer may still need us


class Timers:
    """The timers set and not yet fired or cancelled; `fire(key)` runs when one is due."""

    def __init__(self, scheduler: Scheduler, fire: Callable[[TimerKey], None]) -> None:
        self._scheduler = scheduler
        self._fire = fire
        self._handles: dict[TimerKey, Handle] = {}
        self._watches: set[TimerKey] = set()  # the backup watches among them (a peer may need us)

    def set(self, key: TimerKey, at: float) -> None:
        """Set `key` to fire at `at`, replacing an earlier setting of the same key."""
        old = self._handles.pop(key, None)
        if old is not None:
            old.cancel()
        # Probes and membership timers run while a node lives, but never keep a simulation
        # going on their own: steps in flight do (their deadlines), and end.
        background = key.kind is TimerKind.PROBE or key.kind in MEMBER_TIMERS
        self._handles[key] = self._scheduler.call_at(at, lambda: self._due(key), background=background)
        if key.kind in WATCH_TIMERS:
            self._watches.add(key)

    def cancel(self, key: TimerKey) -> None:
        handle = self._handles.pop(key, None)
        self._watches.discard(key)
        if handle is not None:
            handle.cancel()

    def clear(self) -> None:
        """Cancel every timer (the node stops)."""
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()
        self._watches.clear()

    @property
    def watching(self) -> bool:
        """Is a backup watch still set: a peer may yet need this rank's relay or result?"""
        return bool(self._watches)

    def footprint(self) -> dict[str, int]:
        return {"timers": len(self._handles), "watches": len(self._watches)}

    def _due(self, key: TimerKey) -> None:
        self._handles.pop(key, None)
        self._watches.discard(key)
        self._fire(key)
