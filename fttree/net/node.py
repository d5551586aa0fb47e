"""The asyncio driver of one rank: feeds events to the TreeMachine and carries out its actions.

I/O only: frames from the transport and fired timers go into `TreeMachine.handle`; the actions
that come back become frames, `loop.call_at` timers and completed steps. A step is split into
chunks (each its own op in the machine) and reassembled here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..core.faults import FaultSchedule
from ..core.messages import DEFAULT_MAX_PAYLOAD_BYTES, Kind, Message
from ..core.protocol import (
    AbortCode,
    Action,
    CancelTimer,
    Complete,
    Event,
    Fail,
    LinkDown,
    MachineConfig,
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
from ..core.topology import neighbours
from ..errors import StepAborted, TensorMismatch
from .tcp import Address, TcpTransport

log = logging.getLogger("fttree.net.node")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    rank: int
    peers: list[Address]
    timeout_s: float = 0.5
    step_timeout_s: float = 30.0
    root_timeout_s: float | None = None
    startup_timeout_s: float = 60.0
    connect_timeout_s: float = 2.0
    stall_timeout_s: float = 5.0
    fault_tolerant: bool = True
    timeout_policy: str = "adaptive"
    adaptive_floor_s: float = 0.08
    adaptive_ceiling_s: float = 2.0
    link_memory: bool = True
    chunk_bytes: int = 4 * 1024 * 1024
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    faults: FaultSchedule = field(default_factory=FaultSchedule)

    @property
    def world(self) -> int:
        return len(self.peers)


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one finished step gives back: the sum and who is in it."""

    step: int
    data: np.ndarray
    contributors: tuple[int, ...]
    duration_s: float


@dataclass(slots=True)
class _Step:
    step: int
    future: Future[StepResult]
    out: np.ndarray
    submitted: np.ndarray
    offsets: dict[int, int]
    remaining: set[int]
    started: float
    contributors: tuple[int, ...] | None = None


class Node:
    """One rank's protocol driver on an asyncio loop. Methods run on that loop only."""

    def __init__(self, config: NodeConfig) -> None:
        self.cfg = config
        self.rank = config.rank
        self.machine = TreeMachine(MachineConfig(
            rank=config.rank, world=config.world, timeout_s=config.timeout_s,
            step_timeout_s=config.step_timeout_s, root_timeout_s=config.root_timeout_s,
            fault_tolerant=config.fault_tolerant, timeout_policy=config.timeout_policy,
            adaptive_floor_s=config.adaptive_floor_s, adaptive_ceiling_s=config.adaptive_ceiling_s,
            link_memory=config.link_memory))
        self.transport = TcpTransport(
            config.rank, config.peers, on_message=self._on_message, is_stale=self._is_stale,
            on_link_down=self._on_link_down,
            faults=config.faults, connect_timeout_s=config.connect_timeout_s,
            stall_timeout_s=config.stall_timeout_s, max_payload_bytes=config.max_payload_bytes)
        self.neighbours = neighbours(config.rank, config.world)
        self._timers: dict[TimerKey, asyncio.TimerHandle] = {}
        self._steps: dict[int, _Step] = {}
        self.note_counts: Counter[NoteKind] = Counter()
        self.recent_notes: deque[str] = deque(maxlen=50)
        self.step_durations: deque[tuple[int, float]] = deque(maxlen=100)
        self.note_listeners: list[Callable[[Note], None]] = []  # called on the loop thread
        # (step, duration_s, error or None) when a step finishes here; called on the loop thread
        self.step_listeners: list[Callable[[int, float, str | None], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._quiet = asyncio.Event()  # set when we owe peers nothing (see quiesce)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.transport.start()
        peers = sorted(self.neighbours.all)
        log.info("rank %d listening on %s, waiting for peers %s", self.rank, self.cfg.peers[self.rank], peers)
        await self.transport.wait_for_peers(peers, self.cfg.startup_timeout_s)
        self._started = True

    def _owes_peers(self) -> bool:
        """Are we still watching a link for a peer (it may need our relay or result)?"""
        watches = (TimerKind.REDUCE_WATCH, TimerKind.BCAST_WATCH)
        return bool(self._steps) or any(key.kind in watches for key in self._timers)

    async def quiesce(self, limit_s: float) -> None:
        """Before closing: wait (bounded) until no peer can still need us for a finished step,
        so a rank that finishes first does not leave before relaying for a slower one."""
        assert self._loop is not None
        end = self._loop.time() + limit_s
        while self._owes_peers() and self._loop.time() < end:
            self._quiet.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), end - self._loop.time())

    async def close(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for st in self._steps.values():
            if not st.future.done():
                st.future.set_exception(StepAborted(st.step, f"rank {self.rank} was closed"))
        self._steps.clear()
        await self.transport.close()

    # ---- steps -------------------------------------------------------------------------

    def submit(self, step: int, data: np.ndarray, signature: str, future: Future[StepResult]) -> None:
        """Start allreduce step `step` on a flat array; `future` gets a StepResult or an error."""
        assert self._loop is not None
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
        # Results land in the submitted buffer itself where that is safe: below the root the
        # accumulator is no longer needed once the result exists (any copy of it still queued
        # is a duplicate the parent drops).
        st = _Step(step=step, future=future, out=data, submitted=data,
                   offsets=dict(enumerate(starts)), remaining=set(range(len(starts))),
                   started=time.perf_counter())  # loop.time() ticks in whole ms
        self._steps[step] = st
        for chunk, start in enumerate(starts):
            piece = data[start:start + per_chunk]
            self._handle(Submit(step=step, chunk=chunk, data=piece, signature=signature))

    def active_steps(self) -> list[int]:
        """Steps submitted here and not finished yet, oldest first."""
        return sorted(self._steps)

    def _on_message(self, msg: Message) -> None:
        self._handle(Received(msg=msg))

    def _is_stale(self, msg: Message) -> bool:
        if msg.kind in (Kind.HELLO, Kind.PROBE, Kind.PROBE_ACK):
            return False  # about links, not ops
        return self.machine._is_retired(msg.op)

    def _on_link_down(self, peer: int, reason: str) -> None:
        if self._started:  # refusals while peers start up are expected
            self._handle(LinkDown(peer=peer, reason=reason))

    def _fire(self, key: TimerKey) -> None:
        self._timers.pop(key, None)
        self._handle(TimerFired(key=key))

    def _handle(self, event: Event) -> None:
        assert self._loop is not None
        try:
            actions = self.machine.handle(event, self._loop.time())
        except Exception:
            log.exception("rank %d: protocol bug while handling %s", self.rank, type(event).__name__)
            raise
        for action in actions:
            self._do(action)
        if not self._owes_peers():
            self._quiet.set()

    def _do(self, action: Action) -> None:
        assert self._loop is not None
        match action:
            case Send(dst=dst, msg=msg):
                if msg.kind in (Kind.META_REDUCE_SENT, Kind.META_BCAST_SENT):
                    # tell observers how much was queued ahead, so adaptive deadlines scale with it
                    msg = dataclasses.replace(msg, numel=self.transport.backlog_bytes(msg.target))
                self.transport.send(dst, msg)
            case SetTimer(key=key, at=at):
                old = self._timers.pop(key, None)
                if old is not None:
                    old.cancel()
                self._timers[key] = self._loop.call_at(at, self._fire, key)
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
                if action.kind in (NoteKind.RECOVERY, NoteKind.TIMEOUT, NoteKind.PROTOCOL):
                    self.recent_notes.append(action.text)
                    log.info("rank %d: %s", self.rank, action.text)
                for listener in self.note_listeners:
                    listener(action)

    def _on_complete(self, done: Complete) -> None:
        st = self._steps.get(done.step)
        if st is None:
            return
        start = st.offsets[done.chunk]
        if np.may_share_memory(st.out, done.result) and st.out is st.submitted:
            # At the root a chunk's result is its accumulator, and that memory is still queued
            # for the children: the user gets a copy, never the buffer on the wire.
            st.out = np.empty_like(st.out)
        st.out[start:start + done.result.size] = done.result
        st.contributors = done.contributors if st.contributors is None else st.contributors
        st.remaining.discard(done.chunk)
        if not st.remaining:
            del self._steps[done.step]
            assert self._loop is not None
            duration = time.perf_counter() - st.started
            self.step_durations.append((done.step, duration))
            for step_listener in self.step_listeners:
                step_listener(done.step, duration, None)
            st.future.set_result(StepResult(step=done.step, data=st.out, contributors=st.contributors,
                                            duration_s=duration))

    def _on_fail(self, fail: Fail) -> None:
        st = self._steps.pop(fail.step, None)
        log.warning("rank %d: step %d chunk %d failed: %s", self.rank, fail.step, fail.chunk, fail.reason)
        if st is None or st.future.done():
            return
        assert self._loop is not None
        for step_listener in self.step_listeners:
            step_listener(fail.step, self._loop.time() - st.started, fail.reason)
        cls = TensorMismatch if fail.code == AbortCode.MISMATCH else StepAborted
        st.future.set_exception(cls(fail.step, fail.reason, peers=fail.peers))

