"""The in-process fault layer: a FaultSchedule applied to the frames of any transport.

Outgoing frames are dropped or delayed as the schedule says for (this rank, destination, step).
Incoming frames are dropped only by certain rules (cut, isolate, partition), so a cut injected on
one worker alone (POST /faults) still cuts both directions, while a lossy rule run by both ends
of a link is applied once per direction, by the sender. The schedule can be swapped at any time
(the control plane does) and applies from the next frame on.

Windows count the steps the user sees. A plain job's steps are its allreduce steps; a training
loop marks where each training step begins (`FTTreeAllreduce.mark_step`, which the optimizer
wrapper calls itself), and `StepMarks` maps every frame's allreduce step onto that training step,
so the setup collectives before the first mark are never hit and a training step's several
gradient buckets share its window.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from ..core.faults import FaultSchedule
from ..core.messages import VIEW_KINDS, Frame, Join, Message
from .address import Address
from .scheduler import Scheduler
from .transport import LinkHealth, LinkState, Transport, TransportEvents, TransportStatus


class StepMarks:
    """Which user step (a training step) each allreduce step belongs to.

    Marked from the caller's thread, read on the node's loop: the marks are an immutable tuple
    swapped whole, bounded to the newest `keep`. Without marks a step is its own user step."""

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._firsts: tuple[int, ...] = ()  # first allreduce step of each mark, increasing
        self._users: tuple[int | None, ...] = ()
        self.next_step = 0  # the allreduce step this rank will submit next

    def mark(self, first_step: int, user_step: int | None) -> None:
        """Allreduce steps from `first_step` on belong to `user_step` (None: to no user step, as
        setup collectives; no window ever hits them)."""
        firsts, users = list(self._firsts), list(self._users)
        while firsts and firsts[-1] >= first_step:  # a re-mark before any step was submitted
            firsts.pop()
            users.pop()
        firsts.append(first_step)
        users.append(user_step)
        self._firsts, self._users = tuple(firsts[-self.keep:]), tuple(users[-self.keep:])

    def user_step(self, step: int, *, inbound: bool = False) -> int | None:
        """The user step of allreduce `step`; None for steps before the first mark (setup), and
        for an incoming frame of a step this rank has not reached (its window is the sender's to
        decide)."""
        firsts, users = self._firsts, self._users
        if not firsts:
            return step
        if inbound and step >= self.next_step:
            return None
        i = bisect.bisect_right(firsts, step) - 1
        return users[i] if i >= 0 else None


class FaultyTransport:
    def __init__(self, inner: Transport, schedule: FaultSchedule, scheduler: Scheduler,
                 marks: StepMarks | None = None) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.schedule = schedule
        self.scheduler = scheduler
        self.marks = marks or StepMarks()
        self._events: TransportEvents | None = None
        self._drops: Counter[int] = Counter()
        self._lost_at: dict[int, float] = {}  # dst -> when the schedule last dropped a frame to it
        self._delayed: Counter[int] = Counter()  # dst -> bytes held back by a delay rule, not yet sent
        self._held = 0  # frames held back by a delay rule
        self._released = asyncio.Event()  # set whenever none is held
        self._released.set()

    # ---- as the inner transport's events ---------------------------------------------------

    def _step_of(self, msg: Frame, *, inbound: bool) -> int | None:
        """The user step a frame belongs to. Membership frames (pings, suspicions, the view
        agreement) carry no step of their own: they belong to the step this rank is in now, so a
        cut, an isolation or a partition silences them too, as a firewall would."""
        if msg.kind in VIEW_KINDS:
            current = self.marks.next_step - 1
            return self.marks.user_step(current) if current >= 0 else None
        step = msg.step if isinstance(msg, Message | Join) else -1  # STATE frames name a training step only
        return self.marks.user_step(step, inbound=inbound)

    def on_message(self, msg: Frame) -> None:
        assert self._events is not None
        if self.schedule:
            step = self._step_of(msg, inbound=True)
            if step is not None and self.schedule.blocks(msg.src, self.rank, step):
                self._drops[msg.src] += 1
                return
        self._events.on_message(msg)

    def on_link_down(self, peer: int, reason: str, refused: bool = False) -> None:
        assert self._events is not None
        self._events.on_link_down(peer, reason, refused)

    def is_stale(self, msg: Frame) -> bool:
        assert self._events is not None
        return self._events.is_stale(msg)

    def on_progress(self, peer: int) -> None:
        assert self._events is not None
        self._events.on_progress(peer)

    # ---- as a transport ----------------------------------------------------------------------

    def bind(self, events: TransportEvents) -> None:
        self._events = events
        self.inner.bind(self)

    async def start(self) -> None:
        await self.inner.start()

    async def wait_for_peers(self, peers: Sequence[int], deadline_s: float) -> None:
        await self.inner.wait_for_peers(peers, deadline_s)

    def send(self, dst: int, msg: Frame) -> None:
        step = self._step_of(msg, inbound=False) if self.schedule else None
        if step is not None:
            verdict = self.schedule.verdict(self.rank, dst, step)
            if verdict.drop:
                self._drops[dst] += 1
                self._lost_at[dst] = self.scheduler.now()
                return
            if verdict.delay_s:
                self._hold(dst, msg, verdict.delay_s)
                return
        self.inner.send(dst, msg)

    def _hold(self, dst: int, msg: Frame, delay_s: float) -> None:
        """Send `msg` after `delay_s`, as a far link would deliver it: held frames count as
        queued (link_state, backlog_bytes) and close() waits for them, as it does for a
        socket's unsent bytes."""
        size = 0 if msg.payload is None else len(msg.payload)
        self._delayed[dst] += size
        self._held += 1
        self._released.clear()

        def release() -> None:
            self._delayed[dst] -= size
            self._held -= 1
            if not self._held:
                self._released.set()
            self.inner.send(dst, msg)

        self.scheduler.call_later(delay_s, release)

    def add_peer(self, rank: int, address: Address) -> None:
        self.inner.add_peer(rank, address)

    def address_of(self, rank: int) -> str:
        return self.inner.address_of(rank)

    def backlog_bytes(self, dst: int | None = None) -> int:
        held = sum(self._delayed.values()) if dst is None else self._delayed.get(dst, 0)
        return self.inner.backlog_bytes(dst) + held

    def uplink_rate(self) -> float:
        return self.inner.uplink_rate()

    def retransmit_s(self, peer: int) -> float:
        return self.inner.retransmit_s(peer)


    def link_state(self, peer: int) -> LinkState:
        inner = self.inner.link_state(peer)
        return inner._replace(pending_bytes=inner.pending_bytes + self._delayed.get(peer, 0),
                              lost_at=max(inner.lost_at, self._lost_at.get(peer, -float("inf"))))

    def link_health(self, peer: int) -> LinkHealth:
        inner = self.inner.link_health(peer)
        drops = self._drops.get(peer, 0)
        return inner._replace(injected_drops=inner.injected_drops + drops) if drops else inner

    def status(self) -> TransportStatus:
        inner = self.inner.status()
        peers = {s.peer for s in inner.links} | set(self._drops)
        links = tuple(replace(inner.link(p), injected_drops=inner.link(p).injected_drops + self._drops[p])
                      for p in sorted(peers))
        return replace(inner, links=links, faults=str(self.schedule))

    async def close(self, flush_s: float = 2.0, *, abort: bool = False) -> None:
        if not abort and self._held:  # frames a delay rule holds are on their way, not lost
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), self.schedule.longest_delay_s() + flush_s)
        await self.inner.close(flush_s, abort=abort)
