"""Node: one rank's driver. Feeds events to the TreeMachine and carries out its actions.

I/O only: frames from the transport and fired timers go into `TreeMachine.handle`; the actions
that come back become frames, timers and completed steps. A step is split into chunks (each its
own op in the machine) and reassembled here. The transport and the clock are injected (the
seam): `TcpTransport` on an asyncio loop for real runs, an in-memory transport on a fake clock
in the simulator (fttree.testing), so both run this same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..core.config import Config
from ..core.messages import Kind, Message
from ..core.protocol import (
    AbortCode,
    Action,
    CancelTimer,
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
)
from ..core.view import View
from ..errors import StepAborted, TensorMismatch
from .scheduler import Handle, Scheduler
from .transport import Transport, TransportStatus

log = logging.getLogger("fttree.net.node")

_LOGGED = (NoteKind.RECOVERY, NoteKind.TIMEOUT, NoteKind.PROTOCOL, NoteKind.LINK)


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one finished step gives back: the sum and who is in it."""

    step: int
    data: np.ndarray
    contributors: tuple[int, ...]
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStatus:
    """Everything status pages need about a node, frozen at one moment (see fttree.status)."""

    rank: int
    machine: MachineStatus
    transport: TransportStatus
    steps_in_flight: tuple[int, ...]
    last_steps: tuple[tuple[int, float], ...]  # (step, duration_s), oldest first
    note_counts: dict[NoteKind, int]


@dataclass(slots=True)
class _Step:
    step: int
    future: Future[StepResult]
    submitted: np.ndarray
    offsets: dict[int, int]
    remaining: set[int]
    started: float
    out: np.ndarray | None = None  # where results go: the submitted buffer, or a copy at the root
    contributors: tuple[int, ...] | None = None


class Node:
    """One rank's protocol driver. Every method runs on the scheduler's thread (the node's loop)."""

    def __init__(self, rank: int, view: View, config: Config, transport: Transport, scheduler: Scheduler) -> None:
        self.rank = rank
        self.cfg = config
        self.machine = TreeMachine(rank, view, config)
        self.transport = transport
        self.scheduler = scheduler
        self._timers: dict[TimerKey, Handle] = {}
        self._steps: dict[int, _Step] = {}
        self.note_counts: Counter[NoteKind] = Counter()
        self.step_durations: deque[tuple[int, float]] = deque(maxlen=100)
        self.note_listeners: list[Callable[[Note], None]] = []
        # (step, duration_s, error or None) when a step finishes here
        self.step_listeners: list[Callable[[int, float, str | None], None]] = []
        self.started = False  # hard failures before this are peers still starting up
        self._quiet = asyncio.Event()  # set when we owe peers nothing (see quiesce)
        transport.bind(self)

    @property
    def neighbours(self) -> tuple[int, ...]:
        return self.machine.me.all

    # ---- lifecycle (asyncio) ---------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.start()
        peers = sorted(self.neighbours)
        log.info("rank %d listening on %s, waiting for peers %s", self.rank, self.transport.status().address, peers)
        await self.transport.wait_for_peers(peers, self.cfg.startup_timeout_s)
        self.started = True

    def owes_peers(self) -> bool:
        """Are we still watching a link for a peer (it may need our relay or result)?"""
        watches = (TimerKind.REDUCE_WATCH, TimerKind.BCAST_WATCH)
        return bool(self._steps) or any(key.kind in watches for key in self._timers)

    async def quiesce(self, limit_s: float) -> None:
        """Before closing: wait (bounded) until no peer can still need us for a finished step,
        so a rank that finishes first does not leave before relaying for a slower one."""
        end = self.scheduler.now() + limit_s
        while self.owes_peers() and self.scheduler.now() < end:
            self._quiet.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), end - self.scheduler.now())

    def stop(self, reason: str) -> None:
        """Cancel every timer and fail every step still in flight with `reason`."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        steps, self._steps = self._steps, {}
        for st in steps.values():
            if not st.future.done():
                st.future.set_exception(StepAborted(st.step, reason))

    async def close(self) -> None:
        self.stop(f"rank {self.rank} was closed")
        await self.transport.close()

    # ---- steps -------------------------------------------------------------------------------

    def submit(self, step: int, data: np.ndarray, signature: str, future: Future[StepResult]) -> None:
        """Start allreduce step `step` on a flat array; `future` gets a StepResult or an error."""
        if future.cancelled() or not future.set_running_or_notify_cancel():
            return
        try:
            self._submit(step, data, signature, future)
        except Exception as exc:  # a bug or a misuse: the caller hears of it, never waits forever
            self._steps.pop(step, None)
            if not future.done():
                future.set_exception(exc)

    def _submit(self, step: int, data: np.ndarray, signature: str, future: Future[StepResult]) -> None:
        per_chunk = max(1, self.cfg.chunk_bytes // max(1, data.itemsize))
        starts = list(range(0, max(1, data.size), per_chunk))
        st = _Step(step=step, future=future, submitted=data, offsets=dict(enumerate(starts)),
                   remaining=set(range(len(starts))), started=self.scheduler.monotonic())
        self._steps[step] = st
        for chunk, start in enumerate(starts):
            piece = data[start:start + per_chunk]
            self._handle(Submit(step=step, chunk=chunk, data=piece, signature=signature), raise_errors=True)

    def active_steps(self) -> list[int]:
        """Steps submitted here and not finished yet, oldest first."""
        return sorted(self._steps)

    def status(self) -> NodeStatus:
        return NodeStatus(rank=self.rank, machine=self.machine.status(), transport=self.transport.status(),
                          steps_in_flight=tuple(sorted(self._steps)), last_steps=tuple(self.step_durations),
                          note_counts=dict(self.note_counts))

    def footprint(self) -> dict[str, int]:
        """Sizes of what the node and its machine keep: none may grow with the steps run."""
        return {**self.machine.footprint(), "steps": len(self._steps), "timers": len(self._timers)}

    # ---- transport events ------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        self._handle(Received(msg=msg))

    def is_stale(self, msg: Message) -> bool:
        if msg.kind in (Kind.HELLO, Kind.PROBE, Kind.PROBE_ACK):
            return False  # about links, not ops
        return self.machine.is_retired(msg.op)

    def on_link_down(self, peer: int, reason: str) -> None:
        if self.started:  # refusals while peers start up are expected
            self._handle(LinkDown(peer=peer, reason=reason))

    # ---- the machine's actions ---------------------------------------------------------------

    def _fire(self, key: TimerKey) -> None:
        self._timers.pop(key, None)
        self._handle(TimerFired(key=key))

    def _handle(self, event: Event, *, raise_errors: bool = False) -> None:
        try:
            actions = self.machine.handle(event, self.scheduler.now())
        except Exception:
            if raise_errors:
                raise
            # A bug: say so loudly, but keep serving the other steps and peers.
            log.exception("rank %d: protocol bug while handling %s", self.rank, type(event).__name__)
            return
        for action in actions:
            self._do(action)
        if not self.owes_peers():
            self._quiet.set()

    def _do(self, action: Action) -> None:
        match action:
            case Send(dst=dst, msg=msg):
                if msg.kind in (Kind.META_REDUCE_SENT, Kind.META_BCAST_SENT):
                    # tell observers how much was queued ahead, so their deadlines scale with it
                    msg = dataclasses.replace(msg, queued_bytes=self.transport.backlog_bytes(msg.target))
                self.transport.send(dst, msg)
            case SetTimer(key=key, at=at):
                old = self._timers.pop(key, None)
                if old is not None:
                    old.cancel()
                self._timers[key] = self.scheduler.call_at(at, lambda: self._fire(key),
                                                           background=key.kind is TimerKind.PROBE)
            case CancelTimer(key=key):
                handle = self._timers.pop(key, None)
                if handle is not None:
                    handle.cancel()
            case Complete():
                self._on_complete(action)
            case Fail():
                self._on_fail(action)
            case Note():
                self.note_counts[action.kind] += 1
                if action.kind in _LOGGED:
                    log.info("rank %d: %s", self.rank, action.text)
                for listener in self.note_listeners:
                    listener(action)

    def _on_complete(self, done: Complete) -> None:
        st = self._steps.get(done.step)
        if st is None:
            return
        if st.out is None:
            # At the root a chunk's result is its accumulator, and that memory is still queued
            # for the children: the user gets a copy, never the buffer on the wire. Below the
            # root the result lands in the submitted buffer itself.
            root = np.may_share_memory(st.submitted, done.result)
            st.out = np.empty_like(st.submitted) if root else st.submitted
        start = st.offsets[done.chunk]
        st.out[start:start + done.result.size] = done.result
        st.contributors = done.contributors if st.contributors is None else st.contributors
        st.remaining.discard(done.chunk)
        if st.remaining:
            return
        del self._steps[done.step]
        duration = self.scheduler.monotonic() - st.started
        self.step_durations.append((done.step, duration))
        for listener in self.step_listeners:
            listener(done.step, duration, None)
        if not st.future.done():
            st.future.set_result(StepResult(step=done.step, data=st.out, contributors=st.contributors,
                                            duration_s=duration))

    def _on_fail(self, fail: Fail) -> None:
        st = self._steps.pop(fail.step, None)
        log.warning("rank %d: step %d chunk %d failed: %s", self.rank, fail.step, fail.chunk, fail.reason)
        if st is None or st.future.done():
            return
        for listener in self.step_listeners:
            listener(fail.step, self.scheduler.monotonic() - st.started, fail.reason)
        cls = TensorMismatch if fail.code == AbortCode.MISMATCH else StepAborted
        st.future.set_exception(cls(fail.step, fail.reason, peers=fail.peers))
