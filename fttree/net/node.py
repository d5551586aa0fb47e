"""Node: one rank's driver. What the worker decides is the replica's (core/replica.py); the
node turns frames and fired timers into its events, and its effector (effector.py) turns its
actions into frames, timers and completed futures.

The transport and the clock are injected (the seam): `TcpTransport` on an asyncio loop for
real runs, an in-memory transport on a fake clock in the simulator (fttree.testing), so both
run this same code. The node's parts: effector.py (carrying out the replica's actions),
steps.py (the caller's steps, cut into chunks and put together), timers.py, senses.py (what
the transport measures, for the replica), notes.py (counting and logging), joining.py and
leaving.py (the polls of joining and leaving), and core/farewell.py (when a finished rank may
close). session.py awaits its procedures on asyncio.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from ..core.config import Config
from ..core.effects import Cause, Note, TimerKey, TimerKind
from ..core.events import TimerFired
from ..core.member_events import Busy, MemberTimer
from ..core.messages import LINK_QUERY_KINDS, Frame, Message
from ..core.replica import (
    AckDue,
    Arrived,
    Connected,
    Finish,
    FirstStart,
    Heard,
    Leave,
    LinkLost,
    Replica,
    ReplicaEvent,
    StepBoundary,
    Stop,
)
from ..core.view import View
from ..errors import GroupLeft, PeerError, StepAborted
from .address import Address
from .effector import Effector
from .holds import HoldQueue
from .joining import CONTACT, Asker
from .leaving import Leaver
from .node_status import NodeStatus, node_status
from .notes import ForeignLog, NoteLog
from .scheduler import Scheduler
from .senses import Senses
from .steps import Request, StepBook, StepResult
from .timers import MEMBER_TIMERS, Timers
from .transport import Transport

if TYPE_CHECKING:  # the replica's machines, for reading (status pages, tests): the driver never steps them
    from ..core.membership import Membership
    from ..core.protocol import TreeMachine

__all__ = ["Node", "NodeStatus", "StepResult"]

log = logging.getLogger("fttree.net.node")

_STEP_DEADLINES = frozenset({TimerKind.DEADLINE, TimerKind.ROOT_DEADLINE})


class Node:
    """One rank's protocol driver. Every method runs on the scheduler's thread (the node's loop)."""

    def __init__(self, rank: int, view: View, config: Config, transport: Transport, scheduler: Scheduler, *,
                 join: bool = False, incarnation: int | None = None, contact: Address | None = None) -> None:
        self.rank = rank
        self.cfg = config
        self.transport = transport
        self.scheduler = scheduler
        self.stopped: str | None = None  # why this rank produces no more results
        self.joining = join or contact is not None  # this process asks a running group to admit it
        # what this worker decides (core/replica.py): the tree, the membership, the life cycle, joins
        self.replica = Replica(rank, view, config, join=self.joining)
        self.timers = Timers(scheduler, self._fire)
        self.senses = Senses(rank, transport)
        self.notes = NoteLog(rank)
        self.foreign = ForeignLog(rank)
        self.note_counts = self.notes.counts
        self.note_listeners = self.notes.listeners
        self.steps = StepBook(config, scheduler, self.replica, run_chunk=self._run_chunk,
                              member=self._member, tell=self._replica_step, settled=self._step_settled)
        self.step_durations = self.steps.durations
        self.step_listeners = self.steps.listeners
        self.incarnation = incarnation if incarnation is not None else secrets.randbits(62) + 1
        self.contact = contact  # a member's address to ask first (a joiner that knows no other rank)
        if contact is not None:
            transport.add_peer(CONTACT, contact)
        self.asker = Asker(rank, config, transport, scheduler, self.replica, tell=self._replica_step,
                           incarnation=self.incarnation, contact=contact is not None)
        self.leaver = Leaver(rank, scheduler, transport, self.replica, busy=lambda: bool(self.steps),
                             stopped=lambda: self.stopped is not None)
        self.holds = HoldQueue()  # a join is being agreed: boundaries and submits wait
        # carrying out the replica's actions (effector.py); its do_all bound once: the hot path
        self.effector = Effector(rank, transport, scheduler, senses=self.senses, timers=self.timers,
                                steps=self.steps, notes=self.notes, foreign=self.foreign, holds=self.holds,
                                asker=self.asker, deliver=self.on_message, member=self._member,
                                stopped=self._stopped, ack_done=self._ack_done)
        self._do_all = self.effector.do_all
        self.view_listeners = self.effector.view_listeners
        self.elastic_listeners = self.effector.elastic_listeners  # STATE and STATE_REQUEST frames
        self.quiet_listeners = self.effector.quiet_listeners  # told when the node may owe peers nothing
        self._marked = False  # the caller marks training steps (boundary); else each step is one
        transport.bind(self)

    @property
    def machine(self) -> TreeMachine:
        return self.replica.machine

    @property
    def membership(self) -> Membership:
        return self.replica.membership

    @property
    def view(self) -> View:
        return self.replica.machine.view

    @property
    def reruns(self) -> int:
        """Steps run again in a new view after a node failure."""
        return self.steps.reruns

    @property
    def foreign_frames(self) -> int:
        """Frames dropped because their sender may not send them (SENDER_RULES)."""
        return self.foreign.count

    @property
    def joined_at(self) -> tuple[int, int] | None:
        """A joiner's (first allreduce step, first training step), once admitted."""
        return self.asker.joined_at

    @property
    def started(self) -> bool:
        """Taking part (or leaving): a hard failure of a link is news, not a peer still starting."""
        return self.replica.running

    @property
    def neighbours(self) -> tuple[int, ...]:
        """The ranks this one exchanges frames with, in every tree (Config.trees)."""
        return self.replica.machine.peers

    # ---- starting, joining, leaving, finishing (timer-driven: session.py awaits them) ----------

    def first_start(self) -> None:
        """Take part at once as one of the first processes, as after every peer said it is
        starting too (the simulator's quick start, which skips asking)."""
        self._replica_step(FirstStart())

    def find_group(self, end: float, done: Callable[[bool], None]) -> None:
        """Is a group running already? `done(True)` if so (this process joins it)."""

        def found(running: bool) -> None:
            self.joining = self.joining or running
            done(running)

        self.asker.find_group(end, found)

    def ask_admission(self, end: float, done: Callable[[PeerError | None], None]) -> None:
        """Ask the group to admit this rank: `done(None)` once it did, else with the error."""
        self.asker.ask_admission(end, done)

    def connected(self) -> None:
        """The tree neighbours are reachable: take part from now on (frames that came early are
        handled now). The simulator, whose links need no connecting, calls this directly."""
        self._replica_step(Connected())

    def depart(self, done: Callable[[None], None]) -> None:
        """Leave the group after the steps submitted here: the members drop this rank from the
        next view at once (no detection, no timeout); `done(None)` once that view left it out."""
        self._replica_step(Leave())
        self.leaver.depart(done)

    def finish(self) -> bool:
        """The job is over here: tell every member (DONE, with the last step submitted). False if
        this rank is not taking part (nothing to tell)."""
        if not self.replica.running:
            return False
        self._replica_step(Finish(step=self.steps.last_submitted))
        return True

    def not_done(self) -> list[int]:
        """The members this finished rank still waits for (core/farewell.py)."""
        return self.replica.waiting_for(self.steps.last_submitted)

    def owes_peers(self) -> bool:
        """Are we still watching a link for a peer (it may need our relay or result)?"""
        return self.effector.owes_peers()

    def stop(self, reason: str) -> None:
        """Cancel every timer and fail every step still in flight or held back with `reason`."""
        self.timers.clear()
        self.steps.fail_all(lambda step: StepAborted(step, reason))

    async def close(self) -> None:
        self._replica_step(Stop())
        self.stop(f"rank {self.rank} was closed")
        await self.transport.close()

    async def crash(self, reason: str) -> None:
        """Die as a killed process would, for fault injection: every connection reset, the
        listener gone, nothing more sent; every step here fails with `reason`."""
        self.stopped = reason
        self._replica_step(Stop())
        self.stop(reason)
        self.holds.set(False)  # what waited for a join's decision runs into GroupLeft now
        await self.transport.close(abort=True)

    # ---- steps -------------------------------------------------------------------------------

    def submit(self, step: int, data: np.ndarray, signature: str, future: Future[StepResult], *,
               contribute: bool = True, abort: str = "", reduce: str = "sum", compression: str | None = None,
               closable: bool = False) -> None:
        """Start allreduce step `step` on a flat array; `future` gets a StepResult or an error.
        The array is read, never written, until the step completes (it may run again).
        `abort`: fail the step on every rank for this reason, naming this one."""
        if self.holds.defer(lambda: self.submit(step, data, signature, future, contribute=contribute, abort=abort,
                                                reduce=reduce, compression=compression, closable=closable)):
            return  # a join is being agreed: this step may be the one it starts at
        if not self._marked:  # without training-step marks, every allreduce step is one
            self._at_boundary(step, step)
        if future.cancelled() or not future.set_running_or_notify_cancel():
            return
        if self.stopped is not None:
            future.set_exception(GroupLeft(step, self.stopped))
            return
        req = Request(step=step, data=data, signature=signature, future=future, contribute=contribute, abort=abort,
                      reduce=reduce, compression=compression, closable=closable)
        self.steps.submit(req, hold=self.replica.changing_view)

    def boundary(self, user_step: int | None, first_step: int) -> None:
        """The caller begins training step `user_step` with allreduce step `first_step`: a
        decided join takes effect here, and a join being agreed makes it wait."""
        self._marked = True
        self._at_boundary(user_step, first_step)

    def _at_boundary(self, user_step: int | None, first_step: int) -> None:
        if self.holds.defer(lambda: self._at_boundary(user_step, first_step)):
            return
        if user_step is not None and self.stopped is None:
            self._replica_step(StepBoundary(user_step=user_step, first_step=first_step))

    def _run_chunk(self, submit: ReplicaEvent) -> None:
        self._handle(submit, raise_errors=True)

    def _step_settled(self, completed: bool) -> None:
        """A step finished here: a finished peer waiting for it may go; idle, the membership
        stops looking for silent neighbours."""
        if completed:
            self._report_uplink()
        if self.replica.owes_acks:
            self._ack_done()
        if not self.steps:
            self._member(Busy(since=None))

    def _ack_done(self) -> None:
        self._replica_step(AckDue(last_submitted=self.steps.last_submitted, pending=self.steps.pending(),
                                  stopped=self.stopped is not None))

    def skipped_nonfinite(self, step: int) -> None:
        """Our contribution to `step` held NaN or Inf and was left out (nonfinite="skip"): a
        note names this rank and step; the result's contributors show it to everyone."""
        text = f"rank {self.rank}'s contribution to step {step} holds NaN or Inf: left out of that step"
        self._do_all([Note(step=step, cause=Cause.NONFINITE_SKIPPED, peer=self.rank, text=text)])

    def active_steps(self) -> list[int]:
        """Steps submitted here and not finished yet, oldest first."""
        return sorted(self.steps.running)

    def status(self) -> NodeStatus:
        return node_status(self)

    def footprint(self) -> dict[str, int]:
        """Sizes of what the node and its machine keep: none may grow with the steps run."""
        return {**self.machine.footprint(), "steps": len(self.steps.running), **self.timers.footprint(),
                "held_back": len(self.steps.held_back), "early_bytes": self.replica.early_bytes}

    # ---- transport events ------------------------------------------------------------------

    def on_message(self, msg: Frame) -> None:
        # a backup node asks whether our frames to `target` get through: the transport knows
        link = self.transport.link_state(msg.target) if msg.kind in LINK_QUERY_KINDS and isinstance(msg, Message) \
            else None
        self._handle(Arrived(msg=msg, link=link))

    def on_progress(self, peer: int) -> None:
        """Bytes of a large frame from `peer` are arriving: it is alive, whatever the frame."""
        self._replica_step(Heard(peer=peer))

    def is_stale(self, msg: Frame) -> bool:
        return self.replica.is_stale(msg)

    def on_link_down(self, peer: int, reason: str, refused: bool = False) -> None:
        self._handle(LinkLost(peer=peer, reason=reason, refused=refused))

    def _report_uplink(self) -> None:
        """After a step, and while one runs (a first step behind a slow uplink takes long)."""
        news = self.senses.uplink_news(self.replica.membership)
        if news is not None:
            self._member(news)

    def _fire(self, key: TimerKey) -> None:
        if key.kind in MEMBER_TIMERS:
            if key.kind is TimerKind.MEMBER_CHECK:
                self._report_uplink()
            self._member(MemberTimer(key=key))
        elif key.kind in _STEP_DEADLINES:  # put off while the peers it waits for send bytes or compute
            membership = self.replica.membership
            now = self.scheduler.now()
            self._handle(TimerFired(key=key, alive=self.replica.alive(now), uplink=self.senses.uplink(membership),
                                    computing=membership.computing(now)))
        else:
            self._handle(TimerFired(key=key))

    # ---- stepping the replica (its actions go to the effector) ---------------------------------

    def _handle(self, event: ReplicaEvent, *, raise_errors: bool = False) -> None:
        try:
            actions = self.replica.step(event, self.scheduler.now())
        except Exception:
            if raise_errors:
                raise
            # A bug: say so loudly, but keep serving the other steps and peers.
            log.exception("rank %d: protocol bug while handling %s", self.rank, type(event).__name__)
            return
        self._do_all(actions)

    def _member(self, event: ReplicaEvent) -> None:
        if self.stopped is None:
            self._replica_step(event)

    def _replica_step(self, event: ReplicaEvent) -> None:
        self._do_all(self.replica.step(event, self.scheduler.now()))

    def _stopped(self, reason: str) -> None:
        """This rank produces no more results (evicted, left, or on a minority side): fail what waits."""
        left = self.replica.leaving
        if left:
            reason = f"rank {self.rank} left the group (the others go on without it)"
        log.log(logging.INFO if left else logging.ERROR, "rank %d: %s", self.rank, reason)
        self.stopped = reason
        self._replica_step(Stop())
        self.asker.answered()
        self.leaver.stopped()  # a leave waits for this
        self.steps.fail_all(lambda step: GroupLeft(step, reason))
        self._ack_done()
        self.holds.set(False)  # what waited for a join runs into GroupLeft now
