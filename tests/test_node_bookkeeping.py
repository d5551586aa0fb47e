"""The Node's per-event bookkeeping that must stay cheap: whether it still owes peers a relay
(kept as a set of pending watches, not a scan of every timer) and the backlog stamped on
metadata frames (counted once per run of metadata frames, not once per frame)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fttree.core.messages import Kind, Message
from fttree.net.transport import Transport
from fttree.testing.sim import SimNetwork

from .test_protocol_sim import contributions


def test_a_rank_owes_peers_while_it_still_watches_a_link_after_its_own_step() -> None:
    # 3 ranks: root 0, brothers 1 and 2. Rank 2 watches that rank 1 gets the result, and rank
    # 1's confirmation is slow to reach it: rank 2 is done with its step but not with rank 1.
    sim = SimNetwork(3, wire=False, timeout_s=2.0)
    sim.delay(1, 2, 0.3)
    sim.submit_all(0, contributions(3, 64))
    sim.run_until_finished(0, ranks=[2])
    assert sim.outcome(2, 0) is not None
    assert not sim.nodes[2].active_steps()
    assert sim.nodes[2].owes_peers()  # its watch of rank 1's result is pending
    sim.run()
    assert all(not node.owes_peers() for node in sim.nodes)
    assert not any(note.kind.name == "TIMEOUT" for _, note in sim.notes)  # no watch fired


class _Queueing:
    """A transport that never drains: its backlog is every payload byte sent so far. Records
    what each metadata frame said was queued ahead of it."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.queued = 0
        self.backlog_reads = 0
        self.stamps: list[tuple[Kind, int, int]] = []  # (kind, queued ahead when sent, what it said)

    def send(self, dst: int, msg: Message) -> None:
        if msg.kind in (Kind.META_REDUCE_SENT, Kind.META_BCAST_SENT):
            self.stamps.append((msg.kind, self.queued, msg.queued_bytes))
        if msg.payload is not None:
            self.queued += len(memoryview(msg.payload).cast("B"))
        self.inner.send(dst, msg)

    def backlog_bytes(self, dst: int | None = None) -> int:
        self.backlog_reads += 1
        return self.queued

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_metadata_frames_say_what_was_queued_ahead_of_them() -> None:
    sim = SimNetwork(7, wire=False)
    spies = []
    for node in sim.nodes:
        spy = _Queueing(node.transport)
        node.transport = node.senses.transport = node.effector.transport = spy  # type: ignore[assignment]
        spies.append(spy)
    for step in range(3):
        sim.submit_all(step, [np.full(1000, r + step, np.float32) for r in range(7)])
        sim.run_until_finished(step)
    for rank, spy in enumerate(spies):
        assert spy.stamps, f"rank {rank} sent no metadata"
        # every frame carries the backlog as it was when it went out, the data sent just
        # before it included, even where the backlog was read once for several frames
        assert all(said == queued for _, queued, said in spy.stamps), (rank, spy.stamps)
        assert any(queued for _, queued, _ in spy.stamps)
    # read once per run of metadata frames (a result confirmed to several observers is one)
    assert sum(s.backlog_reads for s in spies) < sum(len(s.stamps) for s in spies)


def test_link_health_gives_the_counters_the_status_gives_with_injected_drops() -> None:
    """The monitor reads `link_health` after every step instead of the whole status: both must
    say the same, the fault layer's drops included."""
    sim = SimNetwork(3, faults="cut 1-0 @1")
    for step in range(3):
        sim.submit_all(step, [np.full(4, r + 1.0, np.float32) for r in range(3)])
        sim.run_until_finished(step)
    dropped = 0
    for node in sim.nodes:
        status = node.transport.status()
        for peer in range(3):
            link = status.link(peer)
            health = node.transport.link_health(peer)
            assert health == (link.frames_sent, link.errors, link.injected_drops, link.last_error)
            dropped += health.injected_drops
    assert sim.nodes[0].transport.link_health(1).injected_drops > 0
    assert dropped > 0
