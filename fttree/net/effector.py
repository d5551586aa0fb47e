"""Effector: carries out the replica's actions for the node. Frames go out on the transport,
timers are set and cancelled, steps complete or fail, notes are kept, a new view is applied,
and the rare actions of joins and leaves reach the parts that wait for them.

It is a module apart from node.py (which turns frames and fired timers into the replica's
events) because carrying out is a job of its own. The node binds `do_all` once, so the hot
path (every frame of every step) costs what it did when this was the node's own method.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..core.admission import Handshake
from ..core.effects import CancelTimer, Complete, Fail, Note, Send, SetTimer, Void
from ..core.member_events import Busy, Confirmed, Doubted, Hold, Installed, Stopped, Suspected
from ..core.messages import Frame, Kind, Message, State
from ..core.replica import (
    Admit,
    Deliver,
    Farewells,
    Foreign,
    JoinInEffect,
    Redeliver,
    ReplicaAction,
    ReplicaEvent,
    ViewApplied,
)
from .holds import HoldQueue
from .joining import Asker
from .notes import ForeignLog, NoteLog
from .scheduler import Scheduler
from .senses import Senses
from .steps import StepBook
from .timers import Timers
from .transport import Transport

log = logging.getLogger("fttree.net.node")  # the node's voice: one logger to configure


class Effector:
    """Carries out each batch of one rank's replica actions, on the scheduler's thread.

    `deliver`: a frame for this rank itself (the node's entrance for frames); `member`: tell
    the membership an event, unless the rank stopped; `stopped`: the replica stopped this rank,
    with the reason; `ack_done`: a finished peer may wait for our acknowledgement."""

    def __init__(self, rank: int, transport: Transport, scheduler: Scheduler, *, senses: Senses, timers: Timers,
                 steps: StepBook, notes: NoteLog, foreign: ForeignLog, holds: HoldQueue, asker: Asker,
                 deliver: Callable[[Frame], None], member: Callable[[ReplicaEvent], None],
                 stopped: Callable[[str], None], ack_done: Callable[[], None]) -> None:
        self.rank = rank
        self.transport = transport
        self.scheduler = scheduler
        self.senses = senses
        self.timers = timers
        self.steps = steps
        self.notes = notes
        self.foreign = foreign
        self.holds = holds
        self.asker = asker
        self._deliver = deliver
        self._member = member
        self._stopped = stopped
        self._ack_done = ack_done
        self.evicted: tuple[int, ...] = ()  # left out by the last view change
        self.view_listeners: list[Callable[[Installed], None]] = []
        self.elastic_listeners: list[Callable[[State], None]] = []  # STATE and STATE_REQUEST frames
        self.quiet_listeners: list[Callable[[], None]] = []  # told when the node may owe peers nothing

    def owes_peers(self) -> bool:
        """Are we still watching a link for a peer (it may need our relay or result)?"""
        return bool(self.steps) or self.timers.watching

    def tell_quiet(self) -> None:
        for listener in self.quiet_listeners:
            listener()

    def do_all(self, actions: list[ReplicaAction]) -> None:
        if not actions:  # most frames from members: nothing changed, nothing to carry out
            return
        voided: set[int] = set()  # steps a new view voided: run again (or failed) once it is applied
        self.senses.forget_stamp()  # the backlog may have drained since the last batch
        for action in actions:
            try:
                self._do(action, voided)
            except Exception:  # a bug in carrying out one action must not drop the rest of the batch
                log.exception("rank %d: error while carrying out %s", self.rank, type(action).__name__)
        for step in sorted(voided):
            self.steps.voided(step, self.evicted)
        if not self.owes_peers():
            self.tell_quiet()

    def _do(self, action: ReplicaAction, voided: set[int]) -> None:
        match action:
            case Send(dst=dst, msg=msg):
                if msg.kind in (Kind.META_REDUCE_SENT, Kind.META_BCAST_SENT) and isinstance(msg, Message):
                    msg = self.senses.stamp(msg)
                if dst == self.rank:  # a message to ourselves (a coordinator is a member too)
                    self.scheduler.call_later(0.0, lambda: self._deliver(msg))
                else:
                    self.transport.send(dst, msg)
                if msg.payload is not None:
                    self.senses.forget_stamp()  # the backlog just grew
            case SetTimer(key=key, at=at):
                self.timers.set(key, at)
            case CancelTimer(key=key):
                self.timers.cancel(key)
            case Complete():
                self.steps.complete(action)
            case Fail():
                log.warning("rank %d: step %d chunk %d failed: %s", self.rank, action.step, action.chunk,
                            action.reason)
                self.steps.fail(action)
            case Note():
                self.notes.record(action)
            case Void(step=step):
                voided.add(step)
            case ViewApplied():
                self._view_applied(action, sorted(voided))
                voided.clear()
            case _:
                self._do_rare(action)

    def _do_rare(self, action: ReplicaAction) -> None:
        """The actions of view changes and the join handshake."""
        match action:
            case Admit():
                self.evicted = ()
            case JoinInEffect(installed=inst, first_step=first_step):
                log.warning("rank %d: view %d takes effect at step %d: %s", self.rank, inst.view.epoch,
                            first_step, inst.reason)
                for listener in self.view_listeners:
                    listener(inst)
            case Hold(on=on):
                self.holds.set(on)
            case Stopped(reason=reason):
                self._stopped(reason)
            case Suspected(peer=peer, reason=reason):
                log.info("rank %d suspects rank %d: %s", self.rank, peer, reason)
            case Doubted(frozen_s=frozen_s, asked=asked):
                log.warning("rank %d: did not run for %.2f s; its results wait until one of "
                            "%s confirms it is still a member", self.rank, frozen_s, list(asked))
            case Confirmed(frozen_s=frozen_s, by=by):
                log.warning("rank %d: rank %d confirmed it is still a member after %.2f s without running; its "
                            "results go out", self.rank, by, frozen_s)
            case Handshake():
                self.asker.carry(action)
            case Redeliver(frames=frames):  # frames that came before this rank took part
                for msg in frames:
                    self._deliver(msg)
            case Foreign(msg=msg, rule=rule):
                self.foreign.dropped(msg, rule)
            case Deliver(msg=msg):
                for hear in self.elastic_listeners:
                    hear(msg)
            case Farewells():
                self._ack_done()
                self.tell_quiet()

    def _view_applied(self, applied: ViewApplied, voided: list[int]) -> None:
        """A new view is in effect: the steps it voided run again (or fail, by policy), then
        the steps held back during the change start in it."""
        inst = applied.installed
        # what changed, not the member list (a line of 255 numbers on every rank of a big job)
        log.warning("rank %d: view %d installed: %d members; evicted %s (%s)", self.rank, inst.view.epoch,
                    inst.view.size, list(inst.evicted), inst.reason)
        self.evicted = inst.evicted
        if applied.superseded:
            log.warning("rank %d: view %d supersedes the joins of views %s not yet in effect", self.rank,
                        inst.view.epoch, list(applied.superseded))
        for step in voided:
            self.steps.voided(step, self.evicted)
        self.steps.start_held()
        for listener in self.view_listeners:
            listener(inst)
        if self.steps:
            self._member(Busy(since=self.steps.oldest_began(), step=max(self.steps.running)))
