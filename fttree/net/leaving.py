"""How a process leaves its group: it tells every member, again on a timer until the view that
leaves it out arrives. Timers, not awaits, so the simulator runs it as the real loop does."""

from __future__ import annotations

from collections.abc import Callable

from ..core.messages import Kind, Notice
from ..core.replica import Replica
from .scheduler import Handle, Scheduler
from .transport import Transport

LEAVE_POLL_S = 0.25  # a leaving rank tells the members again this often until the view leaves it out


class Leaver:
    """One process's leave. `busy()`: steps submitted here still run (they finish first);
    `stopped()`: this rank produces no more results (the view left it out, or it died)."""

    def __init__(self, rank: int, scheduler: Scheduler, transport: Transport, replica: Replica, *,
                 busy: Callable[[], bool], stopped: Callable[[], bool]) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.transport = transport
        self.replica = replica
        self._busy = busy
        self._stopped = stopped
        self._timer: Handle | None = None
        self._next: Callable[[], None] | None = None  # the running leave's next look

    def depart(self, done: Callable[[None], None]) -> None:
        """Tell every member this rank leaves, every LEAVE_POLL_S; `done(None)` once this rank
        stopped (the view left it out), or after three node deadlines (at least 2 s)."""
        end = self.scheduler.now() + max(3 * self.replica.membership.node_deadline_s, 2.0)

        def tell() -> None:
            self._next = None
            if self._stopped() or self.scheduler.now() >= end:
                done(None)
                return
            if self._busy():  # the steps already submitted finish first
                self._timer = self.scheduler.call_later(LEAVE_POLL_S / 2, tell)
                self._next = tell
                return
            view = self.replica.membership.view
            msg = Notice(kind=Kind.LEAVE, src=self.rank, epoch=view.epoch)
            for r in view.members:
                if r != self.rank:
                    self.transport.send(r, msg)
            self._timer = self.scheduler.call_later(LEAVE_POLL_S, tell)
            self._next = tell

        tell()

    def stopped(self) -> None:
        """This rank stopped: a leave in progress looks now, not at its next poll."""
        step, self._next = self._next, None
        if step is not None:
            if self._timer is not None:
                self._timer.cancel()
            step()
