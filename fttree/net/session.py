"""The asyncio waits of one node's life: start, be admitted, leave, finish, quiesce. Each is a
deadline-bounded wait over the node's timer-driven procedures (which the simulator runs
without asyncio); a wait that ends unmet says what it waited for."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

from ..errors import PeerError
from .joining import CONTACT
from .node import Node

log = logging.getLogger("fttree.net.node")

CONTACT_WAIT_S = 5.0  # a joiner's contact must take its connection this soon (the dials retry meanwhile)

T = TypeVar("T")


async def _until(begin: Callable[[Callable[[T], None]], None]) -> T:
    """Await a timer-driven procedure of the node: `begin(done)` starts it, `done(value)` ends it."""
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def done(value: T) -> None:
        if not future.done():
            future.set_result(value)

    begin(done)
    return await future


class Session:
    """One node's life on an asyncio loop (the node's own thread)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._quiet = asyncio.Event()  # set when the node may owe peers nothing more (look again)
        node.quiet_listeners.append(self._quiet.set)

    async def start(self) -> None:
        """Listen, learn whether a group runs already, and if not (a first start) connect to the
        tree neighbours. A joiner stops after listening: `admit` lets it in at its first step."""
        node = self.node
        await node.transport.start()
        end = node.scheduler.now() + node.cfg.startup_timeout_s  # one deadline for all of the start
        if not node.joining:
            await _until(functools.partial(node.find_group, end))
        if not node.joining:
            await self._connect_neighbours(end)

    async def admit(self) -> None:
        """A joiner: ask the group to admit this rank, then connect to its tree neighbours. Called
        at the caller's first step, so nobody waits for a joiner still building its model."""
        node = self.node
        if node.joined_at is not None or not node.joining:
            return
        end = node.scheduler.now() + node.cfg.startup_timeout_s
        if node.contact is not None and node.replica.admission.group is None:
            await self._reach_contact(end)
        refused: PeerError | None = await _until(functools.partial(node.ask_admission, end))
        if refused is not None:
            raise refused
        await self._connect_neighbours(end)

    async def _reach_contact(self, end: float) -> None:
        """A contact that refuses or never answers is named now, not at the admission deadline."""
        node = self.node
        wait_s = max(0.5, min(end - node.scheduler.now(), CONTACT_WAIT_S))
        try:
            await node.transport.wait_for_peers([CONTACT], wait_s)
        except PeerError:
            why = node.transport.link_health(CONTACT).last_error or "no answer"
            raise PeerError(f"rank {node.rank} cannot reach its contact {node.contact} within {wait_s:g} s: "
                            f"{why} (is a worker of the job listening there?)", peers=()) from None

    async def _connect_neighbours(self, end: float) -> None:
        # Tree 0's neighbours, as always; the other trees' too where their address is
        # known, so a first big step finds them listening. A joiner may not know a rank that
        # joined with it: that link connects when first used, once the address is learnt.
        node = self.node
        tree0 = set(node.machine.me.all)
        peers = sorted(r for r in node.neighbours if r in tree0 or node.transport.address_of(r))
        log.info("rank %d listening on %s, waiting for peers %s", node.rank, node.transport.status().address, peers)
        await node.transport.wait_for_peers(peers, max(0.5, end - node.scheduler.now()))
        node.connected()

    async def leave(self) -> None:
        """Leave the group after the steps submitted here (Node.depart)."""
        await _until(self.node.depart)

    async def finish(self, limit_s: float) -> None:
        """The job is over here: tell every member (DONE, with the last step submitted), then stay
        until each of them is done too or has an outcome of that step, has left the view, or
        `limit_s` passed (core/farewell.py)."""
        node = self.node
        if not node.finish():
            return
        end = node.scheduler.now() + limit_s
        while node.stopped is None and node.scheduler.now() < end:
            if not node.not_done():
                return
            await self._settle(min(0.1, max(0.0, end - node.scheduler.now())))
        if node.stopped is None:
            log.warning("rank %d: closing after %.0f s without hearing that ranks %s are done with step %d",
                        node.rank, limit_s, node.not_done(), node.steps.last_submitted)

    async def quiesce(self, limit_s: float) -> None:
        """Before closing: wait (bounded) until no peer can still need us for a finished step,
        so a rank that finishes first does not leave before relaying for a slower one."""
        node = self.node
        end = node.scheduler.now() + limit_s
        while node.owes_peers() and node.scheduler.now() < end:
            await self._settle(end - node.scheduler.now())

    async def close(self) -> None:
        await self.node.close()

    async def _settle(self, limit_s: float) -> None:
        """Wait up to `limit_s` for the node to say it may be quiet (the caller looks again)."""
        self._quiet.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._quiet.wait(), limit_s)
