"""Node: one rank's driver. Feeds events to the TreeMachine and the Membership machine and
carries out their actions.

I/O only: frames from the transport and fired timers go into the machines; the actions that
come back become frames, timers and completed steps. A step is split into chunks (each its own
op in the TreeMachine) and reassembled here. The transport and the clock are injected (the
seam): `TcpTransport` on an asyncio loop for real runs, an in-memory transport on a fake clock
in the simulator (fttree.testing), so both run this same code.

Node failures (core/membership.py) reach the tree through the node: a view change being agreed
fences the tree (no results taken or produced) and holds new submits back; once a view is
installed, the steps that some member finished keep that result (a holder sends it to those who
lack it), and every other step in flight runs again in the new view with the contribution the
caller handed over (which nothing writes to before the step completes), is aborted, or is handed
back as StepRetry, by `on_node_failure`. A rank on the minority side, or left out, stops: every
step, queued or later, fails with GroupLeft naming the view.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..core.config import Config
from ..core.lifecycle import RUNNING_PHASES, Life, Lifecycle, Phase
from ..core.membership import (
    Busy,
    ControlReceived,
    Hold,
    Installed,
    MemberEvent,
    Membership,
    MemberState,
    MemberStatus,
    MemberTimer,
    PeerDown,
    Stopped,
    Suspected,
    Uplink,
)
from ..core.messages import ELASTIC_KINDS, LINK_QUERY_KINDS, SENDER_RULES, VIEW_KINDS, Kind, Message, Sender
from ..core.protocol import (
    AbortCode,
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
    Submit,
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
    JoinInEffect,
    Replica,
    ReplicaAction,
    ReplicaEvent,
    StaleSender,
    StepBoundary,
    ViewApplied,
)
from ..core.view import View
from ..errors import ConfigError, GroupLeft, PeerError, StepAborted, StepRetry, TensorMismatch
from . import handshake as hs
from .address import Address, parse_address
from .scheduler import Handle, Scheduler
from .transport import Transport, TransportStatus

log = logging.getLogger("fttree.net.node")

CONTACT = hs.CONTACT  # the transport's key for a joiner's contact, whose rank it does not know yet
CONTACT_WAIT_S = 5.0  # a joiner's contact must take its connection this soon (the dials retry meanwhile)
FIND_POLL_S = 0.25  # a starting process asks its peers again this often whether a group runs
FIND_GRACE_S = 2.0  # a start that a majority answered "starting too" waits this long for the rest
ADMIT_POLL_S = 0.5  # a joiner asks again this often to be admitted
_LOGGED = (NoteKind.RECOVERY, NoteKind.TIMEOUT, NoteKind.PROTOCOL, NoteKind.LINK, NoteKind.NONFINITE)
PROTOCOL_NOTES_LOGGED = 20  # protocol violations logged one by one; later ones are counted
_MEMBER_TIMERS = frozenset({TimerKind.MEMBER_CHECK, TimerKind.MEMBER_CONFIRM, TimerKind.MEMBER_ROUND,
                            TimerKind.MEMBER_STALL})
_WATCH_TIMERS = frozenset({TimerKind.REDUCE_WATCH, TimerKind.BCAST_WATCH})  # a peer may still need us
_STEP_DEADLINES = frozenset({TimerKind.DEADLINE, TimerKind.ROOT_DEADLINE})


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one finished step gives back: the sum and who is in it."""

    step: int
    data: np.ndarray
    contributors: tuple[int, ...]
    duration_s: float
    epoch: int = 0  # the view the step ran in


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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Request:
    """A step as the caller submitted it: what a view change holds back and runs later."""

    step: int
    data: np.ndarray  # the caller's contribution: read, never written, until the step completes
    signature: str
    future: Future[StepResult]
    contribute: bool = True  # False: zeros that take part without counting (a joiner awaiting its state)
    abort: str = ""  # fail the step everywhere for this reason (a NaN in our contribution, nonfinite="abort")
    reduce: str = "sum"  # how contributions meet (core/reduce_ops.py)


@dataclass(slots=True)
class _Step:
    step: int
    future: Future[StepResult]
    submitted: np.ndarray  # the caller's contribution: read, never written, until the step completes
    signature: str
    offsets: dict[int, int]
    per_chunk: int  # elements a chunk (the last may be shorter): the same when the step runs again
    started: float  # monotonic, for the duration
    began: float  # the scheduler's clock, for the membership's silence checks
    results: dict[int, np.ndarray] = field(default_factory=dict)
    contributors: tuple[int, ...] | None = None
    epoch: int = 0
    contribute: bool = True  # False: zeros that take part without counting (a joiner awaiting its state)
    abort: str = ""  # fail the step everywhere for this reason (a NaN in our contribution, nonfinite="abort")
    reduce: str = "sum"  # how contributions meet (core/reduce_ops.py)


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
        self._steps: dict[int, _Step] = {}
        # steps submitted during a view change, run once it is agreed
        self._held_back: list[_Request] = []
        self.stopped: str | None = None  # why this rank produces no more results
        self.reruns = 0
        self._evicted: tuple[int, ...] = ()  # left out by the last view change
        self.note_counts: Counter[NoteKind] = Counter()
        self.step_durations: deque[tuple[int, float]] = deque(maxlen=100)
        self.note_listeners: list[Callable[[Note], None]] = []
        # (step, duration_s, error or None) when a step finishes here
        self.step_listeners: list[Callable[[int, float, str | None], None]] = []
        self.view_listeners: list[Callable[[Installed], None]] = []
        self._quiet = asyncio.Event()  # set when we owe peers nothing (see quiesce)
        # joins and leaves (docs/failures.md, "Elastic jobs")
        self.incarnation = incarnation if incarnation is not None else secrets.randbits(62) + 1
        self.joining = join or contact is not None  # this process asks a running group to admit it
        # what this worker decides (core/replica.py): the tree, the membership, the life cycle
        self.replica = Replica(rank, view, config, join=self.joining)
        self.contact = contact  # a member's address to ask first (a joiner that knows no other rank)
        if contact is not None:
            transport.add_peer(CONTACT, contact)
        self.joined_at: tuple[int, int] | None = None  # a joiner's (first allreduce step, first training step)
        self.foreign_frames = 0  # frames dropped because their sender may not send them (SENDER_RULES)
        self._foreign_logged: set[int] = set()
        self._incarnations: dict[int, int] = {}  # rank -> the process we take to be that rank
        self._candidates: dict[int, int] = {}  # rank -> the process that asked to join as it
        self._group: tuple[int, tuple[int, ...]] | None = None  # (epoch, members) of a running group found
        self._starting_replies: set[int] = set()  # peers that said they are starting up too
        self._on_answer: Callable[[], None] | None = None  # find_group's or ask_admission's next look
        self._asking_timer: Handle | None = None
        self._answer_event = asyncio.Event()  # leave() waits for its view on this
        self._early: list[Message] = []  # a joiner's frames from before its admission
        self._holding = False  # a join is being agreed: boundaries and submits wait in _hold_queue
        self._hold_queue: list[Callable[[], None]] = []
        self._marked = False  # the caller marks training steps (boundary); else each step is one
        self._last_submitted = -1  # the newest step submitted here (DONE names it)
        self._retransmit_s = 0.0  # the membership was last told this retransmission timeout
        self._owed_done_acks: dict[int, int] = {}  # a finished peer -> its last step, which we still run
        self._done_acked: dict[int, int] = {}  # peer -> the newest step it says it has an outcome of
        self._data_at: dict[int, float] = {}  # peer -> when tensor data from it last arrived
        self.elastic_listeners: list[Callable[[Message], None]] = []  # STATE and STATE_REQUEST frames
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
    def view(self) -> View:
        return self.replica.machine.view

    @property
    def neighbours(self) -> tuple[int, ...]:
        """The ranks this one exchanges frames with, in every tree (Config.trees)."""
        return self.replica.machine.peers

    # ---- lifecycle (asyncio) ---------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.start()
        end = self.scheduler.now() + self.cfg.startup_timeout_s  # one deadline for all of the start
        if not self.joining:
            await _until(functools.partial(self.find_group, end))
        if self.joining:
            return  # admit() asks to be let in, once the caller is ready to take part (its first step)
        await self._connect_neighbours(end)

    async def admit(self) -> None:
        """A joiner: ask the group to admit this rank, then connect to its tree neighbours. Called
        at the caller's first step, so nobody waits for a joiner still building its model."""
        if self.joined_at is not None or not self.joining:
            return
        end = self.scheduler.now() + self.cfg.startup_timeout_s
        if self.contact is not None and self._group is None:
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

    def _query(self, code: int, ranks: Iterable[int]) -> None:
        msg = Message(kind=Kind.JOIN, src=self.rank, code=code, incarnation=self.incarnation,
                      reason=self.transport.status().address)
        for r in ranks:
            if r != self.rank:
                self.transport.send(r, msg)

    def find_group(self, end: float, done: Callable[[bool], None]) -> None:
        """Ask every peer whether a group is already running (this process is a restart, or came
        late), again every FIND_POLL_S: `done(True)` once one says so, `done(False)` once all say
        they are starting up too, or at `end`. Timers, not awaits: the simulator runs it too."""
        peers = [r for r in self.view.members if r != self.rank]
        since = self.scheduler.now()

        def settled() -> bool:
            # A running group has a majority of members answering "running"; once a majority
            # of the world said "starting" for a while, a peer that stays silent (its link cut,
            # or it starts late) cannot be one: go on without waiting for it.
            now = self.scheduler.now()
            majority = 2 * (len(self._starting_replies) + 1) > len(peers) + 1
            return (self._group is not None or set(peers) <= self._starting_replies or now >= end
                    or (majority and now - since >= FIND_GRACE_S))

        def check() -> None:  # after every answer
            if settled():
                self._stop_asking()
                running = self._group is not None
                self.joining = self.joining or running
                self.life.on(Life.GROUP_FOUND if running else Life.FIRST_START)
                done(running)

        def ask() -> None:
            if settled():
                check()
                return
            self._query(0, (r for r in peers if r not in self._starting_replies))
            self._asking_timer = self.scheduler.call_later(FIND_POLL_S, ask)

        self._on_answer = check
        ask()

    def ask_admission(self, end: float, done: Callable[[PeerError | None], None]) -> None:
        """Ask the members to admit this rank (again every ADMIT_POLL_S, and at once after each
        answer) until one says from which step (JOIN_REPLY 1): then `done(None)`; at `end`,
        `done` with the error that names whom it asked."""

        def ask() -> None:
            if self.joined_at is not None:
                self._stop_asking()
                log.info("rank %d joined view %d from step %d (training step %d)", self.rank, self.view.epoch,
                         *self.joined_at)
                done(None)
                return
            if self.scheduler.now() >= end:
                self._stop_asking()
                self.life.on(Life.STOP)
                asked = [] if self._group is None else list(self._group[1])
                done(PeerError(f"rank {self.rank} was not admitted to the running group within "
                               f"{self.cfg.startup_timeout_s:g} s (asked ranks {asked})", peers=tuple(asked)))
                return
            if self._group is None:  # find the group first: through the contact, or any rank we know
                self._query(0, [CONTACT] if self.contact is not None else self.view.members)
            else:
                self._query(1, self._group[1])
            if self._asking_timer is not None:
                self._asking_timer.cancel()
            self._asking_timer = self.scheduler.call_later(ADMIT_POLL_S, ask)

        self._on_answer = ask
        ask()

    def _stop_asking(self) -> None:
        self._on_answer = None
        if self._asking_timer is not None:
            self._asking_timer.cancel()
            self._asking_timer = None

    def _answered(self) -> None:
        """A JOIN_REPLY, or the view that ends a leave, came: whoever asks looks again now."""
        if self._on_answer is not None:
            self._on_answer()
        self._answer_event.set()

    async def finish(self, limit_s: float) -> None:
        """The job is over here: tell every member (DONE, with the last step submitted), then stay
        until each of them is done too or has an outcome of that step (DONE_ACK), has left the
        view, or `limit_s` passed. A member that is done is not a dead one: its peers stop
        watching it instead of evicting it, and nobody closes while a slower peer may still
        need its relay or result."""
        if self.life.phase not in RUNNING_PHASES:
            return
        self._replica_step(Finish(step=self._last_submitted))
        end = self.scheduler.now() + limit_s
        while self.stopped is None and self.scheduler.now() < end:
            waiting = self._not_done()
            if not waiting:
                return
            self._quiet.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), min(0.1, max(0.0, end - self.scheduler.now())))
        if self.stopped is None:
            log.warning("rank %d: closing after %.0f s without hearing that ranks %s are done with step %d",
                        self.rank, limit_s, self._not_done(), self._last_submitted)

    def _not_done(self) -> list[int]:
        """Members that may still need this rank for its last step: not finished themselves, and
        without an outcome of that step yet."""
        last = self._last_submitted
        return [r for r in self.membership.view.members
                if r != self.rank and r not in self.membership.done and self._done_acked.get(r, -1) < last]

    def _ack_done(self) -> None:
        """Tell finished peers, whose last step we have an outcome of now, that we need
        nothing more of them for it: they may close."""
        for peer, step in list(self._owed_done_acks.items()):
            if self.stopped is not None or (step <= self._last_submitted and step not in self._steps
                                            and not any(h.step == step for h in self._held_back)):
                del self._owed_done_acks[peer]
                self.transport.send(peer, Message(kind=Kind.DONE_ACK, src=self.rank, epoch=self.view.epoch,
                                                  step=step))

    def owes_peers(self) -> bool:
        """Are we still watching a link for a peer (it may need our relay or result)?"""
        return bool(self._steps) or bool(self._watches)

    async def quiesce(self, limit_s: float) -> None:
        """Before closing: wait (bounded) until no peer can still need us for a finished step,
        so a rank that finishes first does not leave before relaying for a slower one."""
        end = self.scheduler.now() + limit_s
        while self.owes_peers() and self.scheduler.now() < end:
            self._quiet.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), end - self.scheduler.now())

    def stop(self, reason: str) -> None:
        """Cancel every timer and fail every step still in flight or held back with `reason`."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        self._watches.clear()
        self._fail_all(lambda step: StepAborted(step, reason))

    def _fail_all(self, error: Callable[[int], StepAborted]) -> None:
        steps, self._steps = self._steps, {}
        held, self._held_back = self._held_back, []
        for st in steps.values():
            if not st.future.done():
                st.future.set_exception(error(st.step))
        for req in held:
            if not req.future.done():
                req.future.set_exception(error(req.step))

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
        req = _Request(step=step, data=data, signature=signature, future=future, contribute=contribute, abort=abort,
                       reduce=reduce)
        if self.replica.membership.state is MemberState.CHANGING:
            self._held_back.append(req)  # run in the view being agreed
            return
        self._start(req)

    def _start(self, req: _Request) -> None:
        try:
            self._submit(req)
        except Exception as exc:  # a bug or a misuse: the caller hears of it, never waits forever
            self._steps.pop(req.step, None)
            if not req.future.done():
                req.future.set_exception(exc)

    def _submit(self, req: _Request) -> None:
        step, data, future = req.step, req.data, req.future
        # cut as every member cuts it: at the view's pace (view.py)
        # (never by the number of members: a step re-run after an eviction keeps its chunks)
        per_chunk = max(1, self.cfg.chunk_bytes_for(data.nbytes, self.view.pace) // max(1, data.itemsize))
        starts = list(range(0, max(1, data.size), per_chunk))
        idle = not self._steps
        st = _Step(step=step, future=future, submitted=data, signature=req.signature, offsets=dict(enumerate(starts)),
                   per_chunk=per_chunk, started=self.scheduler.monotonic(), began=self.scheduler.now(),
                   contribute=req.contribute, abort=req.abort, reduce=req.reduce)
        self._steps[step] = st
        self._last_submitted = max(self._last_submitted, step)
        if idle:
            self._member(Busy(since=st.began, step=step))
        elif self.replica.membership.done:
            self._member(Busy(since=self.replica.membership.busy_since, step=step))
        self._run(st)

    def _run(self, st: _Step) -> None:
        """Submit every chunk of a step to the machine, in the current view."""
        st.results.clear()
        st.contributors = None
        st.epoch = self.view.epoch
        for chunk, start in st.offsets.items():
            piece = st.submitted[start:start + st.per_chunk]
            self._handle(Submit(step=st.step, chunk=chunk, chunks=len(st.offsets), data=piece, signature=st.signature,
                                contribute=st.contribute, abort=st.abort, reduce=st.reduce), raise_errors=True)

    def skipped_nonfinite(self, step: int) -> None:
        """Our contribution to `step` held NaN or Inf and was left out (nonfinite="skip"): a
        note names this rank and step; the result's contributors show it to everyone."""
        text = f"rank {self.rank}'s contribution to step {step} holds NaN or Inf: left out of that step"
        self._do_all([Note(step=step, cause=Cause.NONFINITE_SKIPPED, peer=self.rank, text=text)])

    def active_steps(self) -> list[int]:
        """Steps submitted here and not finished yet, oldest first."""
        return sorted(self._steps)

    def status(self) -> NodeStatus:
        return NodeStatus(rank=self.rank, machine=self.machine.status(), membership=self.membership.status(),
                          transport=self.transport.status(), steps_in_flight=tuple(sorted(self._steps)),
                          last_steps=tuple(self.step_durations), note_counts=dict(self.note_counts),
                          reruns=self.reruns, foreign_frames=self.foreign_frames)

    def footprint(self) -> dict[str, int]:
        """Sizes of what the node and its machine keep: none may grow with the steps run."""
        return {**self.machine.footprint(), "steps": len(self._steps), "timers": len(self._timers),
                "watches": len(self._watches), "held_back": len(self._held_back)}

    # ---- transport events ------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        rule = SENDER_RULES[msg.kind]
        if rule is Sender.PROVEN:
            self._on_join_message(msg)
            return
        if rule is not Sender.MEMBER or not self._may_send(msg.src):
            self._foreign(msg, rule)
            return
        if self.replica.life.early:
            # Not in the group yet (a joiner), or not sure yet whether a group runs (a start
            # asking its peers): keep what comes early. A restarted process may be handed frames
            # its previous incarnation's peers had queued (probes of its children, relays): they
            # must not be answered from view 0 as if this were the first start, or the answer,
            # stale to the members, draws the view that left this rank out.
            if msg.kind not in VIEW_KINDS and len(self._early) < self.cfg.max_ops_ahead:
                self._early.append(msg)
            return
        if msg.kind in ELASTIC_KINDS:
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
        if msg.kind is Kind.DONE_ACK:
            self._done_acked[msg.src] = max(self._done_acked.get(msg.src, -1), msg.step)
            self._quiet.set()
            return
        if msg.kind is Kind.JOIN_ASK:
            self._on_join_ask(msg)
            return
        if msg.kind in VIEW_KINDS:
            self._member(ControlReceived(msg=msg))
            if msg.kind is Kind.DONE:
                self._owed_done_acks[msg.src] = msg.step
                self._ack_done()
            return
        if msg.epoch < self.replica.membership.view.epoch and self.stopped is None:
            self._replica_step(StaleSender(msg=msg))
        if msg.kind in LINK_QUERY_KINDS:  # a backup node asks whether our frames to `target` get through
            self._handle(Received(msg=msg, link=self.transport.link_state(msg.target)))
        else:
            self._handle(Received(msg=msg))

    def _may_send(self, rank: int) -> bool:
        """Is `rank` one whose frames this node takes (SENDER_RULES' MEMBER)? A member of its
        view or of a view decided and not yet in effect, a rank it is admitting, or, while
        this process joins, a member of the group it asked."""
        if rank in self.replica.membership.view or rank in self._candidates:
            return True
        if any(rank in p.view for p in self.replica.pending):
            return True
        if self.life.phase is Phase.ASKING:
            return self._group is None or rank in self._group[1]
        return False

    def _foreign(self, msg: Message, rule: Sender) -> None:
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

    def is_stale(self, msg: Message) -> bool:
        if (msg.kind in (Kind.HELLO, Kind.PROBE, Kind.PROBE_ACK, Kind.CATCHUP, Kind.META_STALLED) or msg.answer
                or msg.kind in VIEW_KINDS or msg.kind in ELASTIC_KINDS or msg.kind is Kind.JOIN_REPLY):
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

    # ---- joins and leaves -------------------------------------------------------------------

    def _on_join_message(self, msg: Message) -> None:
        """A member's side of a join. Code 0 (is a group running?): yes if the asker is a new
        process of a rank we knew (its incarnation changed), came after steps were done, or is
        not in the view; otherwise we are all starting. Code 1 (admit me): to the membership,
        unless it is a repeat from the process already admitted."""
        if msg.kind is Kind.JOIN_REPLY:
            self._on_join_reply(msg)
            return
        if self.life.phase is Phase.ASKING:
            return  # not a member yet: nothing to tell
        known = self._incarnations.get(msg.src)
        if msg.code == 0:
            self._learn_address(msg)
            if known is None and not (self.replica.completed or self.view.epoch):
                self._incarnations[msg.src] = msg.incarnation  # a peer of the first start
            restarted = known is not None and known != msg.incarnation
            late = known is None and bool(self.replica.completed or self.view.epoch)
            running = self.stopped is None and (restarted or late or msg.src not in self.membership.view)
            members = self.membership.view.members
            reply = Message(kind=Kind.JOIN_REPLY, src=self.rank, code=0 if running else 2,
                            epoch=self.membership.view.epoch, members=members,
                            reason=self._addresses(members))
            self.transport.send(msg.src, reply)
            return
        self._join_request(msg.src, msg)

    def _on_join_ask(self, msg: Message) -> None:
        """A member passes on rank `target`'s request to be admitted (its own frames to us may be
        lost): taken as if the joiner had asked us."""
        if 0 <= msg.target != self.rank:
            self._join_request(msg.target, msg)

    def _join_request(self, joiner: int, msg: Message) -> None:
        """Process `msg.incarnation` of rank `joiner`, listening at `msg.reason`, asks to be
        admitted (JOIN code 1, or a member's JOIN_ASK): to the membership, unless it is a
        repeat from the process already admitted."""
        if self.stopped is not None:
            return
        known = self._incarnations.get(joiner)
        if joiner in self.membership.view and (known in (None, msg.incarnation)
                                               or self._candidates.get(joiner) == msg.incarnation):
            return  # a member's own late or repeated request: it is in already
        self._candidates[joiner] = msg.incarnation
        with contextlib.suppress(ValueError, ConfigError):
            self.transport.add_peer(joiner, parse_address(msg.reason))
        self._member(ControlReceived(msg=msg))

    def _addresses(self, ranks: Iterable[int]) -> str:
        """Where `ranks` listen, as JOIN_REPLY carries it: "rank=host:port,..." ("" if unknown)."""
        return ",".join(f"{r}={self.transport.address_of(r)}" for r in ranks)

    def _learn_addresses(self, text: str) -> None:
        for item in text.split(","):  # where the members listen
            rank, _, address = item.partition("=")
            with contextlib.suppress(ValueError, ConfigError):
                if int(rank) != self.rank and address:
                    self.transport.add_peer(int(rank), parse_address(address))

    def _learn_address(self, msg: Message) -> None:
        """A rank that was not in the first peers list is reachable at the address it sent."""
        with contextlib.suppress(ValueError, ConfigError):
            self.transport.add_peer(msg.src, parse_address(msg.reason))

    def _on_join_reply(self, msg: Message) -> None:
        """A starting or joining process hears: the group is starting too (2), is running in
        this view with these addresses (0), or admits this rank from this step (1)."""
        if self.life.phase is not Phase.ASKING:
            if msg.code == 2:
                self._starting_replies.add(msg.src)
            elif msg.code == 0 and self._group is None and self.life.phase is Phase.STARTING:
                self._group = (msg.epoch, msg.members)
            self._answered()
            return
        if msg.code == 0:
            self._group = (msg.epoch, msg.members)
            self._learn_addresses(msg.reason)
        elif msg.code == 1 and self.rank in msg.members:
            # the admitting member's address book: ranks that joined with us (other trees link them)
            self._learn_addresses(msg.reason)
            self.replica.admitted(View(msg.epoch, msg.members, msg.pace), msg.step, msg.user_step)
            view = self.view
            self.joined_at = (msg.step, msg.user_step)
            self.life.on(Life.ADMITTED)
            for r in view.members:
                self._incarnations.setdefault(r, 0)
        self._answered()

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
        self._do_all(self.replica.step(StepBoundary(user_step=user_step, first_step=first_step),
                                       self.scheduler.now()))

    def _join_in_effect(self, inst: Installed, first_step: int) -> None:
        """A decided join took effect here: tell the joiners from which step they take part."""
        log.warning("rank %d: view %d takes effect at step %d: %s", self.rank, inst.view.epoch, first_step,
                    inst.reason)
        for r in inst.joined:
            self.transport.send(r, Message(kind=Kind.JOIN_REPLY, src=self.rank, code=1, epoch=inst.view.epoch,
                                           members=inst.view.members, step=first_step, user_step=inst.activate_at,
                                           pace=inst.view.pace, reason=self._addresses(inst.view.members)))
        for listener in self.view_listeners:
            listener(inst)

    def _hold(self, on: bool) -> None:
        self._holding = on
        while not self._holding and self._hold_queue:
            self._hold_queue.pop(0)()

    async def leave(self) -> None:
        """Leave the group after the steps submitted here: tell every member, who drop this
        rank from the next view at once (no detection, no timeout), and wait for that view."""
        self.life.on(Life.LEAVE)
        end = self.scheduler.now() + max(3 * self.membership.node_deadline_s, 2.0)
        while self._steps and self.scheduler.now() < end:  # the steps already submitted finish first
            self._quiet.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), 0.1)
        while self.stopped is None and self.scheduler.now() < end:
            msg = Message(kind=Kind.LEAVE, src=self.rank, epoch=self.membership.view.epoch)
            for r in self.membership.view.members:
                if r != self.rank:
                    self.transport.send(r, msg)
            self._answer_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._answer_event.wait(), 0.25)

    # ---- the tree machine's actions --------------------------------------------------------

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

    def _do_all(self, actions: list[ReplicaAction]) -> None:
        if not actions:  # most frames from members: nothing changed, nothing to carry out
            return
        voided: set[int] = set()  # steps a new view voided: run again (or failed) once it is applied
        self._stamped = None  # the backlog may have drained since the last batch
        for action in actions:
            self._do(action, voided)
        for step in sorted(voided):
            self._voided(step)
        if not self.owes_peers():
            self._quiet.set()

    def _stamp_backlog(self, msg: Message) -> Message:
        """`msg` saying how much this worker had queued ahead of it and not yet acknowledged, and
        how fast its uplink sends, so observers' deadlines scale with both: every link counts,
        as they all leave through this worker's one uplink (the rotated trees keep several
        links busy at once). Only sends with a payload change the first number,
        so it is counted once per run of metadata frames, and a frame the protocol sends to
        several observers is copied once."""
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

    def _send(self, dst: int, msg: Message) -> None:
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
                if msg.kind in (Kind.META_REDUCE_SENT, Kind.META_BCAST_SENT):
                    msg = self._stamp_backlog(msg)
                self._send(dst, msg)
                if msg.payload is not None:
                    self._stamped = None  # the backlog just grew
            case SetTimer(key=key, at=at):
                self._set_timer(key, at)
            case CancelTimer(key=key):
                self._cancel_timer(key)
            case Complete():
                self._on_complete(action)
            case Fail():
                self._on_fail(action)
            case Note():
                self.note_counts[action.kind] += 1
                if action.kind is NoteKind.PROTOCOL and self.note_counts[action.kind] > PROTOCOL_NOTES_LOGGED:
                    pass  # a peer that breaks the protocol in a flood must not flood the log: counted only
                elif action.kind in _LOGGED:
                    log.info("rank %d: %s%s", self.rank, action.text,
                             " (further protocol violations are counted, not logged)"
                             if self.note_counts[action.kind] == PROTOCOL_NOTES_LOGGED
                             and action.kind is NoteKind.PROTOCOL else "")
                for listener in self.note_listeners:
                    listener(action)
            case Void(step=step):
                voided.add(step)
            case ViewApplied():
                self._view_applied(action, sorted(voided))
                voided.clear()
            case _:
                self._do_member(action)

    def _on_complete(self, done: Complete) -> None:
        st = self._steps.get(done.step)
        if st is None:
            return
        st.results[done.chunk] = done.result
        st.contributors = done.contributors if st.contributors is None else st.contributors
        if len(st.results) < len(st.offsets):
            return
        # Every chunk is in: only now does the result replace the contribution (a step may have
        # had to run again on it until here). Root results are buffers of their own.
        for chunk, result in st.results.items():
            start = st.offsets[chunk]
            st.submitted[start:start + result.size] = result
        del self._steps[done.step]
        self.replica.completed.append(done.step)
        self._report_uplink()
        duration = self.scheduler.monotonic() - st.started
        self.step_durations.append((done.step, duration))
        for listener in self.step_listeners:
            listener(done.step, duration, None)
        self._maybe_idle()
        if not st.future.done():
            st.future.set_result(StepResult(step=done.step, data=st.submitted, contributors=st.contributors,
                                            duration_s=duration, epoch=st.epoch))

    def _on_fail(self, fail: Fail) -> None:
        st = self._steps.pop(fail.step, None)
        log.warning("rank %d: step %d chunk %d failed: %s", self.rank, fail.step, fail.chunk, fail.reason)
        if st is None or st.future.done():
            return
        self._maybe_idle()
        for listener in self.step_listeners:
            listener(fail.step, self.scheduler.monotonic() - st.started, fail.reason)
        cls = TensorMismatch if fail.code == AbortCode.MISMATCH else StepAborted
        st.future.set_exception(cls(fail.step, fail.reason, peers=fail.peers))

    def _maybe_idle(self) -> None:
        """A step finished here: a finished peer waiting for it may go; idle, the membership
        stops looking for silent neighbours."""
        if self._owed_done_acks:
            self._ack_done()
        if not self._steps:
            self._member(Busy(since=None))

    # ---- membership ---------------------------------------------------------------------------

    def _member(self, event: MemberEvent) -> None:
        if self.stopped is not None:
            return
        self._replica_step(event)

    def _replica_step(self, event: ReplicaEvent) -> None:
        self._do_all(self.replica.step(event, self.scheduler.now()))

    def _do_member(self, action: ReplicaAction) -> None:
        """The actions only the membership and the replica's hand-offs produce."""
        match action:
            case Admit(installed=inst):
                self._evicted = ()
                for r in inst.joined:  # this process is that rank now: its repeated asks are not a restart
                    if r in self._candidates:
                        self._incarnations[r] = self._candidates.pop(r)
            case JoinInEffect(installed=inst, first_step=first_step):
                self._join_in_effect(inst, first_step)
            case Hold(on=on):
                self._hold(on)
            case Stopped(state=state, reason=reason):
                self._stopped(state, reason)
            case Suspected(peer=peer, reason=reason):
                log.info("rank %d suspects rank %d: %s", self.rank, peer, reason)

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
            self._voided(step)
        held, self._held_back = self._held_back, []
        for req in held:
            self._start(req)
        for listener in self.view_listeners:
            listener(inst)
        if self._steps:
            self._member(Busy(since=min(st.began for st in self._steps.values()), step=max(self._steps)))

    def _voided(self, step: int) -> None:
        """A step in flight had no result anywhere when the view changed: by policy, run it
        again in the new view, abort it, or hand it back to the caller to run again."""
        st = self._steps.get(step)
        if st is None or st.future.done():
            return
        view = self.view
        evicted = self._evicted
        what = (f"ranks {list(evicted)} failed during step {step}; the group went on without them in view "
                f"{view.epoch} ({len(view.members)} workers)")
        policy = self.cfg.on_node_failure
        if policy == "forward":
            self.reruns += 1
            self._run(st)
            return
        del self._steps[step]
        self._maybe_idle()
        if policy == "rollback":
            st.future.set_exception(StepRetry(step, f"{what}: run this step again (on_node_failure='rollback')",
                                              peers=evicted, epoch=view.epoch, members=view.members))
        else:
            st.future.set_exception(StepAborted(step, f"{what}: the step was aborted (on_node_failure='abort')",
                                                peers=evicted))

    def _stopped(self, state: MemberState, reason: str) -> None:
        left = self.leaving
        if left:
            reason = f"rank {self.rank} left the group (view {self.membership.view.epoch} goes on without it)"
        log.log(logging.INFO if left else logging.ERROR, "rank %d: %s", self.rank, reason)
        self.stopped = reason
        self.life.on(Life.STOP)
        self._answered()  # a leave() waits for this
        self._fail_all(lambda step: GroupLeft(step, reason))
        self._ack_done()
        self._hold(False)  # what waited for a join runs into GroupLeft now
