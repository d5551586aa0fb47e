"""Node: one rank's driver. What the worker decides is the replica's (core/replica.py); the
node turns frames and fired timers into its events and its actions into frames, timers and
completed futures.

The transport and the clock are injected (the seam): `TcpTransport` on an asyncio loop for
real runs, an in-memory transport on a fake clock in the simulator (fttree.testing), so both
run this same code. The node's other parts: steps.py (the caller's steps, cut into chunks and
put together), joining.py (finding the group and asking to be admitted), core/farewell.py
(when a finished rank may close).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..core.admission import Answer, Answered, Joined, LearnAddress, Reply
from ..core.config import Config
from ..core.farewell import Farewell
from ..core.lifecycle import RUNNING_PHASES, Life, Lifecycle, Phase
from ..core.membership import (
    Busy,
    ControlReceived,
    Hold,
    Installed,
    MemberEvent,
    MemberFrame,
    Membership,
    MemberState,
    MemberStatus,
    MemberTimer,
    PeerDown,
    Stopped,
    Suspected,
    Uplink,
)
from ..core.messages import (
    LINK_QUERY_KINDS,
    SENDER_RULES,
    Agreement,
    Detection,
    Frame,
    Join,
    Kind,
    Message,
    Notice,
    Sender,
    State,
)
from ..core.protocol import (
    CancelTimer,
    Cause,
    Complete,
    Event,
    Fail,
    LinkDown,
    MachineStatus,
    Note,
    NoteKind,
    Received,
    Send,
    SetTimer,
    TimerFired,
    TimerKey,
    TimerKind,
    TreeMachine,
    Void,
)
from ..core.replica import (
    Admit,
    Finish,
    Heard,
    JoinFrame,
    JoinInEffect,
    Replica,
    ReplicaAction,
    ReplicaEvent,
    StaleSender,
    StepBoundary,
    ViewApplied,
)
from ..core.view import View
from ..errors import ConfigError, GroupLeft, PeerError, StepAborted
from .address import Address, parse_address
from .joining import CONTACT, Asker
from .scheduler import Handle, Scheduler
from .steps import Request, StepBook, StepResult
from .transport import Transport, TransportStatus

__all__ = ["Node", "NodeStatus", "StepResult"]

log = logging.getLogger("fttree.net.node")

LEAVE_POLL_S = 0.25  # a leaving rank tells the members again this often until the view leaves it out
CONTACT_WAIT_S = 5.0  # a joiner's contact must take its connection this soon (the dials retry meanwhile)
_LOGGED = (NoteKind.RECOVERY, NoteKind.TIMEOUT, NoteKind.PROTOCOL, NoteKind.LINK, NoteKind.NONFINITE)
PROTOCOL_NOTES_LOGGED = 20  # protocol violations logged one by one; later ones are counted
_MEMBER_TIMERS = frozenset({TimerKind.MEMBER_CHECK, TimerKind.MEMBER_CONFIRM, TimerKind.MEMBER_ROUND,
                            TimerKind.MEMBER_STALL})
_WATCH_TIMERS = frozenset({TimerKind.REDUCE_WATCH, TimerKind.BCAST_WATCH})  # a peer may still need us
_STEP_DEADLINES = frozenset({TimerKind.DEADLINE, TimerKind.ROOT_DEADLINE})
#: a step's frames about links or committed results: never stale (is_stale)
_NEVER_STALE = frozenset({Kind.PROBE, Kind.PROBE_ACK, Kind.CATCHUP, Kind.META_STALLED})


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStatus:
    """Everything status pages need about a node, frozen at one moment (see fttree.status)."""

    rank: int
    machine: MachineStatus
    membership: MemberStatus
    transport: TransportStatus
    steps_in_flight: tuple[int, ...]
    last_steps: tuple[tuple[int, float], ...]  # (step, duration_s), oldest first
    note_counts: dict[NoteKind, int]
    reruns: int  # steps run again in a new view after a node failure
    foreign_frames: int = 0  # frames dropped because their sender may not send them (SENDER_RULES)


T = TypeVar("T")


async def _until(begin: Callable[[Callable[[T], None]], None]) -> T:
    """Await a timer-driven procedure of the node: `begin(done)` starts it, `done(value)` ends it."""
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def done(value: T) -> None:
        if not future.done():
            future.set_result(value)

    begin(done)
    return await future


class Node:
    """One rank's protocol driver. Every method runs on the scheduler's thread (the node's loop)."""

    def __init__(self, rank: int, view: View, config: Config, transport: Transport, scheduler: Scheduler, *,
                 join: bool = False, incarnation: int | None = None, contact: Address | None = None) -> None:
        self.rank = rank
        self.cfg = config
        self.transport = transport
        self.scheduler = scheduler
        self._timers: dict[TimerKey, Handle] = {}
        self._watches: set[TimerKey] = set()  # the backup watches among them (owes_peers, per event)
        self._stamped: tuple[Message, Message] | None = None  # the last metadata frame stamped (_stamp_backlog)
        self.stopped: str | None = None  # why this rank produces no more results
        self._evicted: tuple[int, ...] = ()  # left out by the last view change
        self.note_counts: Counter[NoteKind] = Counter()
        self.note_listeners: list[Callable[[Note], None]] = []
        self.view_listeners: list[Callable[[Installed], None]] = []
        self.elastic_listeners: list[Callable[[State], None]] = []  # STATE and STATE_REQUEST frames
        self.foreign_frames = 0  # frames dropped because their sender may not send them (SENDER_RULES)
        self._foreign_logged: set[int] = set()
        self._quiet = asyncio.Event()  # set when we owe peers nothing (see quiesce)
        self._on_left: Callable[[], None] | None = None  # depart's next look, at once when this rank stops
        self.joining = join or contact is not None  # this process asks a running group to admit it
        # what this worker decides (core/replica.py): the tree, the membership, the life cycle, joins
        self.replica = Replica(rank, view, config, join=self.joining)
        self.steps = StepBook(config, scheduler, self.replica, run_chunk=self._run_chunk,
                              member=self._member, settled=self._step_settled)
        self.step_durations = self.steps.durations
        self.step_listeners = self.steps.listeners
        self.farewell = Farewell()
        self.incarnation = incarnation if incarnation is not None else secrets.randbits(62) + 1
        self.contact = contact  # a member's address to ask first (a joiner that knows no other rank)
        if contact is not None:
            transport.add_peer(CONTACT, contact)
        self.asker = Asker(rank, config, transport, scheduler, self.replica, incarnation=self.incarnation,
                           contact=contact is not None)
        self._early: list[Frame] = []  # a joiner's frames from before its admission
        self._holding = False  # a join is being agreed: boundaries and submits wait in _hold_queue
        self._hold_queue: list[Callable[[], None]] = []
        self._marked = False  # the caller marks training steps (boundary); else each step is one
        self._retransmit_s = 0.0  # the membership was last told this retransmission timeout
        self._data_at: dict[int, float] = {}  # peer -> when tensor data from it last arrived
        transport.bind(self)

    @property
    def machine(self) -> TreeMachine:
        return self.replica.machine

    @property
    def membership(self) -> Membership:
        return self.replica.membership

    @property
    def life(self) -> Lifecycle:
        return self.replica.life

    @property
    def started(self) -> bool:
        """Taking part (or leaving): a hard failure of a link is news, not a peer still starting."""
        return self.replica.life.running

    @property
    def leaving(self) -> bool:
        return self.life.phase is Phase.LEAVING

    @property
    def joined_at(self) -> tuple[int, int] | None:
        """A joiner's (first allreduce step, first training step), once admitted."""
        return self.asker.joined_at

    @property
    def reruns(self) -> int:
        return self.steps.reruns

    @property
    def view(self) -> View:
        return self.replica.machine.view

    @property
    def neighbours(self) -> tuple[int, ...]:
        """The ranks this one exchanges frames with, in every tree (Config.trees)."""
        return self.replica.machine.peers

    # ---- starting, joining, leaving (asyncio waits over the timer-driven procedures) --------------

    async def start(self) -> None:
        await self.transport.start()
        end = self.scheduler.now() + self.cfg.startup_timeout_s  # one deadline for all of the start
        if not self.joining:
            await _until(functools.partial(self.find_group, end))
        if self.joining:
            return  # admit() asks to be let in, once the caller is ready to take part (its first step)
        await self._connect_neighbours(end)

    def find_group(self, end: float, done: Callable[[bool], None]) -> None:
        """Is a group running already? `done(True)` if so (this process joins it)."""

        def found(running: bool) -> None:
            self.joining = self.joining or running
            done(running)

        self.asker.find_group(end, found)

    def ask_admission(self, end: float, done: Callable[[PeerError | None], None]) -> None:
        """Ask the group to admit this rank: `done(None)` once it did, else with the error."""
        self.asker.ask_admission(end, done)

    async def admit(self) -> None:
        """A joiner: ask the group to admit this rank, then connect to its tree neighbours. Called
        at the caller's first step, so nobody waits for a joiner still building its model."""
        if self.joined_at is not None or not self.joining:
            return
        end = self.scheduler.now() + self.cfg.startup_timeout_s
        if self.contact is not None and self.replica.admission.group is None:
            await self._reach_contact(end)
        refused: PeerError | None = await _until(functools.partial(self.ask_admission, end))
        if refused is not None:
            raise refused
        await self._connect_neighbours(end)

    async def _reach_contact(self, end: float) -> None:
        """A contact that refuses or never answers is named now, not at the admission deadline."""
        wait_s = max(0.5, min(end - self.scheduler.now(), CONTACT_WAIT_S))
        try:
            await self.transport.wait_for_peers([CONTACT], wait_s)
        except PeerError:
            why = self.transport.link_health(CONTACT).last_error or "no answer"
            raise PeerError(f"rank {self.rank} cannot reach its contact {self.contact} within {wait_s:g} s: "
                            f"{why} (is a worker of the job listening there?)", peers=()) from None

    async def _connect_neighbours(self, end: float) -> None:
        # Tree 0's neighbours, as always; the other trees' too where their address is
        # known, so a first big step finds them listening. A joiner may not know a rank that
        # joined with it: that link connects when first used, once the address is learnt.
        tree0 = set(self.machine.me.all)
        peers = sorted(r for r in self.neighbours if r in tree0 or self.transport.address_of(r))
        log.info("rank %d listening on %s, waiting for peers %s", self.rank, self.transport.status().address, peers)
        await self.transport.wait_for_peers(peers, max(0.5, end - self.scheduler.now()))
        self.connected()

    def connected(self) -> None:
        """The tree neighbours are reachable: take part from now on (frames that came early are
        handled now). The simulator, whose links need no connecting, calls this directly."""
        self.life.on(Life.CONNECTED)
        early, self._early = self._early, []
        for msg in early:
            self.on_message(msg)

    async def leave(self) -> None:
        """Leave the group after the steps submitted here (see `depart`)."""
        await _until(self.depart)

    def depart(self, done: Callable[[None], None]) -> None:
        """Leave the group after the steps submitted here: tell every member (again every
        LEAVE_POLL_S), who drop this rank from the next view at once (no detection, no
        timeout); `done(None)` once that view left this rank out, or after three node deadlines
        (at least 2 s). Timers, not awaits: the simulator runs it too."""
        self.life.on(Life.LEAVE)
        end = self.scheduler.now() + max(3 * self.membership.node_deadline_s, 2.0)

        def tell() -> None:
            self._on_left = None
            if self.stopped is not None or self.scheduler.now() >= end:
                done(None)
                return
            if self.steps:  # the steps already submitted finish first
                self.scheduler.call_later(LEAVE_POLL_S / 2, tell)
                return
            msg = Notice(kind=Kind.LEAVE, src=self.rank, epoch=self.membership.view.epoch)
            for r in self.membership.view.members:
                if r != self.rank:
                    self.transport.send(r, msg)
            timer = self.scheduler.call_later(LEAVE_POLL_S, tell)

            def at_once() -> None:
                timer.cancel()
                tell()

            self._on_left = at_once

        tell()

    async def finish(self, limit_s: float) -> None:
        """The job is over here: tell every member (DONE, with the last step submitted), then stay
        until each of them is done too or has an outcome of that step, has left the view, or
        `limit_s` passed (core/farewell.py)."""
        if self.life.phase not in RUNNING_PHASES:
            return
        self._replica_step(Finish(step=self.steps.last_submitted))
        end = self.scheduler.now() + limit_s
        while self.stopped is None and self.scheduler.now() < end:
            if not self._not_done():
                return
            await self._settle(self._quiet, min(0.1, max(0.0, end - self.scheduler.now())))
        if self.stopped is None:
            log.warning("rank %d: closing after %.0f s without hearing that ranks %s are done with step %d",
                        self.rank, limit_s, self._not_done(), self.steps.last_submitted)

    def _not_done(self) -> list[int]:
        return self.farewell.waiting_for(self.membership.view.members, me=self.rank, done=self.membership.done,
                                         last=self.steps.last_submitted)

    def owes_peers(self) -> bool:
        """Are we still watching a link for a peer (it may need our relay or result)?"""
        return bool(self.steps) or bool(self._watches)

    async def quiesce(self, limit_s: float) -> None:
        """Before closing: wait (bounded) until no peer can still need us for a finished step,
        so a rank that finishes first does not leave before relaying for a slower one."""
        end = self.scheduler.now() + limit_s
        while self.owes_peers() and self.scheduler.now() < end:
            await self._settle(self._quiet, end - self.scheduler.now())

    @staticmethod
    async def _settle(event: asyncio.Event, limit_s: float) -> None:
        """Wait up to `limit_s` for `event` to be set anew (the caller looks again either way)."""
        event.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), limit_s)

    def stop(self, reason: str) -> None:
        """Cancel every timer and fail every step still in flight or held back with `reason`."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        self._watches.clear()
        self.steps.fail_all(lambda step: StepAborted(step, reason))

    async def close(self) -> None:
        self.life.on(Life.STOP)
        self.stop(f"rank {self.rank} was closed")
        await self.transport.close()

    async def crash(self, reason: str) -> None:
        """Die as a killed process would, for fault injection: every connection reset, the
        listener gone, nothing more sent; every step here fails with `reason`."""
        self.stopped = reason
        self.life.on(Life.STOP)
        self.stop(reason)
        await self.transport.close(abort=True)

    # ---- steps -------------------------------------------------------------------------------

    def submit(self, step: int, data: np.ndarray, signature: str, future: Future[StepResult], *,
               contribute: bool = True, abort: str = "", reduce: str = "sum") -> None:
        """Start allreduce step `step` on a flat array; `future` gets a StepResult or an error.
        The array is read, never written, until the step completes (it may run again).
        `abort`: fail the step on every rank for this reason, naming this one."""
        if self._holding:  # a join is being agreed: this step may be the one it starts at
            self._hold_queue.append(lambda: self.submit(step, data, signature, future, contribute=contribute,
                                                        abort=abort, reduce=reduce))
            return
        if not self._marked:  # without training-step marks, every allreduce step is one
            self._at_boundary(step, step)
        if future.cancelled() or not future.set_running_or_notify_cancel():
            return
        if self.stopped is not None:
            future.set_exception(GroupLeft(step, self.stopped))
            return
        req = Request(step=step, data=data, signature=signature, future=future, contribute=contribute, abort=abort,
                      reduce=reduce)
        self.steps.submit(req, hold=self.replica.membership.state is MemberState.CHANGING)

    def boundary(self, user_step: int | None, first_step: int) -> None:
        """The caller begins training step `user_step` with allreduce step `first_step`: a
        decided join takes effect here, and a join being agreed makes it wait."""
        self._marked = True
        self._at_boundary(user_step, first_step)

    def _at_boundary(self, user_step: int | None, first_step: int) -> None:
        if self._holding:
            self._hold_queue.append(lambda: self._at_boundary(user_step, first_step))
            return
        if user_step is None or self.stopped is not None:
            return
        self._replica_step(StepBoundary(user_step=user_step, first_step=first_step))

    def _run_chunk(self, submit: Event) -> None:
        self._handle(submit, raise_errors=True)

    def _step_settled(self, completed: bool) -> None:
        """A step finished here: a finished peer waiting for it may go; idle, the membership
        stops looking for silent neighbours."""
        if completed:
            self._report_uplink()
        if self.farewell.owed:
            self._ack_done()
        if not self.steps:
            self._member(Busy(since=None))

    def _ack_done(self) -> None:
        for peer, step in self.farewell.due(last_submitted=self.steps.last_submitted,
                                            pending=self.steps.__contains__, stopped=self.stopped is not None):
            self.transport.send(peer, Notice(kind=Kind.DONE_ACK, src=self.rank, epoch=self.view.epoch, step=step))

    def skipped_nonfinite(self, step: int) -> None:
        """Our contribution to `step` held NaN or Inf and was left out (nonfinite="skip"): a
        note names this rank and step; the result's contributors show it to everyone."""
        text = f"rank {self.rank}'s contribution to step {step} holds NaN or Inf: left out of that step"
        self._do_all([Note(step=step, cause=Cause.NONFINITE_SKIPPED, peer=self.rank, text=text)])

    def active_steps(self) -> list[int]:
        """Steps submitted here and not finished yet, oldest first."""
        return sorted(self.steps.running)

    def status(self) -> NodeStatus:
        return NodeStatus(rank=self.rank, machine=self.machine.status(), membership=self.membership.status(),
                          transport=self.transport.status(), steps_in_flight=tuple(self.active_steps()),
                          last_steps=tuple(self.step_durations), note_counts=dict(self.note_counts),
                          reruns=self.reruns, foreign_frames=self.foreign_frames)

    def footprint(self) -> dict[str, int]:
        """Sizes of what the node and its machine keep: none may grow with the steps run."""
        return {**self.machine.footprint(), "steps": len(self.steps.running), "timers": len(self._timers),
                "watches": len(self._watches), "held_back": len(self.steps.held_back)}

    # ---- transport events ------------------------------------------------------------------

    def on_message(self, msg: Frame) -> None:
        rule = SENDER_RULES[msg.kind]
        if rule is Sender.PROVEN and isinstance(msg, Join):
            self._replica_step(JoinFrame(msg=msg))
            return
        if rule is not Sender.MEMBER or not self.replica.may_send(msg.src):
            self._foreign(msg, rule)
            return
        if self.replica.life.early:
            # Not sure yet whether this process is in a group, or in which view: keep what comes
            # early. A restarted process may be handed frames its previous incarnation's peers
            # had queued (probes, relays): answered from view 0 as if this were the first start,
            # the stale answer would draw the view that leaves this rank out.
            if isinstance(msg, Message | State) and len(self._early) < self.cfg.max_ops_ahead:
                self._early.append(msg)
            return
        if isinstance(msg, State):
            for listener in self.elastic_listeners:
                listener(msg)
            return
        now = self.scheduler.now()
        if self.stopped is None:
            heard = self.replica.step(Heard(peer=msg.src), now)
            if heard:
                self._do_all(heard)
        if msg.payload is not None:
            self._data_at[msg.src] = now
        if not isinstance(msg, Message):
            if isinstance(msg, Agreement | Detection | Join | Notice):
                self._view_frame(msg)
            return
        if msg.epoch < self.replica.membership.view.epoch and self.stopped is None:
            self._replica_step(StaleSender(msg=msg))
        if msg.kind in LINK_QUERY_KINDS:  # a backup node asks whether our frames to `target` get through
            self._handle(Received(msg=msg, link=self.transport.link_state(msg.target)))
        else:
            self._handle(Received(msg=msg))

    def _view_frame(self, msg: MemberFrame) -> None:
        if isinstance(msg, Notice) and msg.kind is Kind.DONE_ACK:
            self.farewell.peer_has(msg.src, msg.step)
            self._quiet.set()
        elif isinstance(msg, Join):
            self._replica_step(JoinFrame(msg=msg))
        else:
            self._member(ControlReceived(msg=msg))
            if isinstance(msg, Notice) and msg.kind is Kind.DONE:
                self.farewell.peer_done(msg.src, msg.step)
                self._ack_done()

    def _foreign(self, msg: Frame, rule: Sender) -> None:
        """A frame its sender may not send: dropped before it changes anything, counted, and
        logged once per sender. A rank the group left out is told so (it may not know)."""
        self.foreign_frames += 1
        if msg.epoch < self.membership.view.epoch and self.stopped is None and rule is Sender.MEMBER:
            self._replica_step(StaleSender(msg=msg))
        if msg.src not in self._foreign_logged and len(self._foreign_logged) < 64:
            self._foreign_logged.add(msg.src)
            log.warning("rank %d: dropped %s from rank %d, which may not send it (%s); further frames of that "
                        "rank are dropped and counted, not logged", self.rank, msg.kind.name, msg.src, rule.value)

    def on_progress(self, peer: int) -> None:
        """Bytes of a large frame from `peer` are arriving: it is alive, whatever the frame."""
        if self.replica.life.running:
            now = self.scheduler.now()
            self._data_at[peer] = now
            heard = self.replica.step(Heard(peer=peer), now)
            if heard:
                self._do_all(heard)

    def is_stale(self, msg: Frame) -> bool:
        if type(msg) is not Message or msg.kind in _NEVER_STALE or msg.answer:
            return False  # about links, views or committed results; or answers about an op we let go of
        # A frame of an op that finished here is still owed to its peer: behind a slow uplink a
        # child's share of the result waits in the bulk queue for longer than the op lingers.
        # Only a view change (its ops voided, run again under new ids) makes a frame worthless.
        return self.replica.machine.is_past_epoch(msg.epoch)

    def on_link_down(self, peer: int, reason: str, refused: bool = False) -> None:
        if self.life.phase not in RUNNING_PHASES or peer in self.membership.done:  # starting, or finished
            return
        self._handle(LinkDown(peer=peer, reason=reason))
        if refused:
            self._member(PeerDown(peer=peer, reason=reason))

    def _alive(self) -> frozenset[int]:
        """Peers whose tensor data arrived within the node deadline (a frame or part of one):
        their part of a step is on its way, slowly. A peer that only answers pings is alive
        but not sending (it may have left the step)."""
        recent = self.scheduler.now() - self.replica.membership.node_deadline_s
        return frozenset(peer for peer, at in self._data_at.items() if at >= recent)

    def _report_uplink(self) -> None:
        """Tell the membership what the transport measured of the uplink: if it is far from the
        view's pace, a pace round follows (after a step, and while one runs: a first step behind
        a slow uplink takes long)."""
        rate = self.transport.uplink_rate()
        membership = self.replica.membership
        neighbours = membership.view.neighbours(self.rank).all if self.rank in membership.view else ()
        retransmit = round(max((self.transport.retransmit_s(p) for p in neighbours), default=0.0), 3)
        if (rate and rate != membership.rate) or retransmit != self._retransmit_s:
            self._retransmit_s = retransmit
            self._member(Uplink(rate=rate or membership.rate, retransmit_s=retransmit))

    def _fire(self, key: TimerKey) -> None:
        self._timers.pop(key, None)
        self._watches.discard(key)
        if key.kind in _MEMBER_TIMERS:
            if key.kind is TimerKind.MEMBER_CHECK:
                self._report_uplink()
            self._member(MemberTimer(key=key))
        elif key.kind in _STEP_DEADLINES:  # put off while the peers it waits for send bytes
            rates = [r for r in (self.transport.uplink_rate(), self.replica.membership.slowest_uplink) if r > 0]
            self._handle(TimerFired(key=key, alive=self._alive(), uplink=min(rates, default=0.0)))
        else:
            self._handle(TimerFired(key=key))

    # ---- carrying out the replica's actions ------------------------------------------------------

    def _handle(self, event: Event, *, raise_errors: bool = False) -> None:
        try:
            actions = self.replica.step(event, self.scheduler.now())
        except Exception:
            if raise_errors:
                raise
            # A bug: say so loudly, but keep serving the other steps and peers.
            log.exception("rank %d: protocol bug while handling %s", self.rank, type(event).__name__)
            return
        self._do_all(actions)

    def _member(self, event: MemberEvent) -> None:
        if self.stopped is None:
            self._replica_step(event)

    def _replica_step(self, event: ReplicaEvent) -> None:
        self._do_all(self.replica.step(event, self.scheduler.now()))

    def _do_all(self, actions: list[ReplicaAction]) -> None:
        if not actions:  # most frames from members: nothing changed, nothing to carry out
            return
        voided: set[int] = set()  # steps a new view voided: run again (or failed) once it is applied
        self._stamped = None  # the backlog may have drained since the last batch
        for action in actions:
            try:
                self._do(action, voided)
            except Exception:  # a bug in carrying out one action must not drop the rest of the batch
                log.exception("rank %d: error while carrying out %s", self.rank, type(action).__name__)
        for step in sorted(voided):
            self.steps.voided(step, self._evicted)
        if not self.owes_peers():
            self._quiet.set()

    def _stamp_backlog(self, msg: Message) -> Message:
        """`msg` saying how much this worker had queued ahead of it and not yet acknowledged, and
        how fast its uplink sends, so observers' deadlines scale with both: every link counts,
        as they all leave through this worker's one uplink. Only sends with a payload change
        the first number, so it is counted once per run of metadata frames, and a frame the
        protocol sends to several observers is copied once."""
        stamped = self._stamped
        if stamped is not None and stamped[0] is msg:
            return stamped[1]
        if stamped is None:
            queued, rate = self.transport.backlog_bytes(), int(self.transport.uplink_rate())
        else:
            queued, rate = stamped[1].queued_bytes, stamped[1].rate
        out = msg.but(queued_bytes=msg.queued_bytes if msg.answer else queued, rate=rate)
        self._stamped = (msg, out)
        return out

    def _send(self, dst: int, msg: Frame) -> None:
        if dst == self.rank:  # a message to ourselves (a coordinator is a member too)
            self.scheduler.call_later(0.0, lambda: self.on_message(msg))
        else:
            self.transport.send(dst, msg)

    def _set_timer(self, key: TimerKey, at: float) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        # Probes and membership timers run while a node lives, but never keep a simulation
        # going on their own: steps in flight do (their deadlines), and end.
        background = key.kind is TimerKind.PROBE or key.kind in _MEMBER_TIMERS
        self._timers[key] = self.scheduler.call_at(at, lambda: self._fire(key), background=background)
        if key.kind in _WATCH_TIMERS:
            self._watches.add(key)

    def _cancel_timer(self, key: TimerKey) -> None:
        handle = self._timers.pop(key, None)
        self._watches.discard(key)
        if handle is not None:
            handle.cancel()

    def _do(self, action: ReplicaAction, voided: set[int]) -> None:
        match action:
            case Send(dst=dst, msg=msg):
                if msg.kind in (Kind.META_REDUCE_SENT, Kind.META_BCAST_SENT) and isinstance(msg, Message):
                    msg = self._stamp_backlog(msg)
                self._send(dst, msg)
                if msg.payload is not None:
                    self._stamped = None  # the backlog just grew
            case SetTimer(key=key, at=at):
                self._set_timer(key, at)
            case CancelTimer(key=key):
                self._cancel_timer(key)
            case Complete():
                self.steps.complete(action)
            case Fail():
                log.warning("rank %d: step %d chunk %d failed: %s", self.rank, action.step, action.chunk,
                            action.reason)
                self.steps.fail(action)
            case Note():
                self._note(action)
            case Void(step=step):
                voided.add(step)
            case ViewApplied():
                self._view_applied(action, sorted(voided))
                voided.clear()
            case _:
                self._do_rare(action)

    def _note(self, note: Note) -> None:
        self.note_counts[note.kind] += 1
        count = self.note_counts[note.kind]
        if note.kind is NoteKind.PROTOCOL and count > PROTOCOL_NOTES_LOGGED:
            pass  # a peer that breaks the protocol in a flood must not flood the log: counted only
        elif note.kind in _LOGGED:
            last = note.kind is NoteKind.PROTOCOL and count == PROTOCOL_NOTES_LOGGED
            log.info("rank %d: %s%s", self.rank, note.text,
                     " (further protocol violations are counted, not logged)" if last else "")
        for listener in self.note_listeners:
            listener(note)

    def _do_rare(self, action: ReplicaAction) -> None:
        """The actions of view changes and the join handshake."""
        match action:
            case Admit():
                self._evicted = ()
            case JoinInEffect(installed=inst, first_step=first_step):
                log.warning("rank %d: view %d takes effect at step %d: %s", self.rank, inst.view.epoch,
                            first_step, inst.reason)
                for r in inst.joined:
                    self._reply(Reply(dst=r, answer=Answer.ADMITTED, view=inst.view, first_step=first_step,
                                      user_step=inst.activate_at))
                for listener in self.view_listeners:
                    listener(inst)
            case Hold(on=on):
                self._holding = on
                while not self._holding and self._hold_queue:
                    self._hold_queue.pop(0)()
            case Stopped(reason=reason):
                self._stopped(reason)
            case Suspected(peer=peer, reason=reason):
                log.info("rank %d suspects rank %d: %s", self.rank, peer, reason)
            case Reply():
                self._reply(action)
            case LearnAddress(rank=rank, address=address) if rank != self.rank:
                with contextlib.suppress(ValueError, ConfigError):
                    self.transport.add_peer(rank, parse_address(address))
            case Joined(first_step=first_step, user_step=user_step):
                self.asker.joined_at = (first_step, user_step)
            case Answered():
                self.asker.answered()

    def _reply(self, reply: Reply) -> None:
        """A JOIN_REPLY; RUNNING and ADMITTED name the view's members and where they listen (as far
        as this rank knows). STARTING names nobody: at a first start every rank answers every
        other, again every poll, and p answers of p addresses each would be p^2 per poll."""
        view = reply.view
        members = () if reply.answer is Answer.STARTING else view.members
        addresses = tuple((r, a) for r in members if (a := self.transport.address_of(r)))
        self.transport.send(reply.dst, Join(kind=Kind.JOIN_REPLY, src=self.rank, code=reply.answer,
                                            epoch=view.epoch, members=members, step=reply.first_step,
                                            user_step=reply.user_step, pace=view.pace, addresses=addresses))

    def _view_applied(self, applied: ViewApplied, voided: list[int]) -> None:
        """A new view is in effect: the steps it voided run again (or fail, by policy), then
        the steps held back during the change start in it."""
        inst = applied.installed
        # what changed, not the member list (a line of 255 numbers on every rank of a big job)
        log.warning("rank %d: view %d installed: %d members; evicted %s (%s)", self.rank, inst.view.epoch,
                    inst.view.size, list(inst.evicted), inst.reason)
        self._evicted = inst.evicted
        if applied.superseded:
            log.warning("rank %d: view %d supersedes the joins of views %s not yet in effect", self.rank,
                        inst.view.epoch, list(applied.superseded))
        for step in voided:
            self.steps.voided(step, self._evicted)
        self.steps.start_held()
        for listener in self.view_listeners:
            listener(inst)
        if self.steps:
            self._member(Busy(since=self.steps.oldest_began(), step=max(self.steps.running)))

    def _stopped(self, reason: str) -> None:
        left = self.leaving
        if left:
            reason = f"rank {self.rank} left the group (the others go on without it)"
        log.log(logging.INFO if left else logging.ERROR, "rank %d: %s", self.rank, reason)
        self.stopped = reason
        self.life.on(Life.STOP)
        self.asker.answered()
        if self._on_left is not None:  # a leave waits for this
            self._on_left()
        self.steps.fail_all(lambda step: GroupLeft(step, reason))
        self._ack_done()
        self._do_rare(Hold(on=False))  # what waited for a join runs into GroupLeft now
