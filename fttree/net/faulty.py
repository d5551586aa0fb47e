"""The in-process fault layer: a FaultSchedule applied to the frames of any transport.

Outgoing frames are dropped or delayed as the schedule says for (this rank, destination, step).
Incoming frames are dropped only by certain rules (cut, isolate, partition), so a cut injected on
one worker alone (POST /faults) still cuts both directions, while a lossy rule run by both ends
of a link is applied once per direction, by the sender. The schedule can be swapped at any time
(the control plane does) and applies from the next frame on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from ..core.faults import FaultSchedule
from ..core.messages import Message
from .scheduler import Scheduler
from .transport import Transport, TransportEvents, TransportStatus


class FaultyTransport:
    def __init__(self, inner: Transport, schedule: FaultSchedule, scheduler: Scheduler) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.schedule = schedule
        self.scheduler = scheduler
        self._events: TransportEvents | None = None
        self._drops: Counter[int] = Counter()

    # ---- as the inner transport's events ---------------------------------------------------

    def on_message(self, msg: Message) -> None:
        assert self._events is not None
        if self.schedule and self.schedule.blocks(msg.src, self.rank, msg.step):
            self._drops[msg.src] += 1
            return
        self._events.on_message(msg)

    def on_link_down(self, peer: int, reason: str) -> None:
        assert self._events is not None
        self._events.on_link_down(peer, reason)

    def is_stale(self, msg: Message) -> bool:
        assert self._events is not None
        return self._events.is_stale(msg)

    # ---- as a transport ----------------------------------------------------------------------

    def bind(self, events: TransportEvents) -> None:
        self._events = events
        self.inner.bind(self)

    async def start(self) -> None:
        await self.inner.start()

    async def wait_for_peers(self, peers: Sequence[int], deadline_s: float) -> None:
        await self.inner.wait_for_peers(peers, deadline_s)

    def send(self, dst: int, msg: Message) -> None:
        if self.schedule:
            verdict = self.schedule.verdict(self.rank, dst, msg.step)
            if verdict.drop:
                self._drops[dst] += 1
                return
            if verdict.delay_s:
                self.scheduler.call_later(verdict.delay_s, lambda: self.inner.send(dst, msg))
                return
        self.inner.send(dst, msg)

    def backlog_bytes(self, dst: int) -> int:
        return self.inner.backlog_bytes(dst)

    def status(self) -> TransportStatus:
        inner = self.inner.status()
        peers = {s.peer for s in inner.links} | set(self._drops)
        links = tuple(replace(inner.link(p), injected_drops=inner.link(p).injected_drops + self._drops[p])
                      for p in sorted(peers))
        return replace(inner, links=links, faults=str(self.schedule))

    async def close(self, flush_s: float = 2.0) -> None:
        await self.inner.close(flush_s)
