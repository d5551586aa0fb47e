"""The TCP transport's receive path: pooled payload buffers, never reused while anything reads
them, and a send backlog kept as a running count instead of a walk of the queue."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fttree.core.buffers import BufferPool
from fttree.core.messages import Kind, Message
from fttree.net import tcp
from fttree.net.address import Address
from fttree.net.tcp import TcpTransport

from .conftest import free_port

BIG = BufferPool.MIN_BYTES * 4


def test_small_payloads_are_plain_bytearrays() -> None:
    pool = BufferPool()
    buf = pool.take(100)
    assert isinstance(buf, bytearray)
    assert len(buf) == 100
    assert not pool.lent


def test_a_buffer_comes_back_only_when_nothing_holds_it() -> None:
    pool = BufferPool()
    first = pool.take(BIG)
    assert len(first) == BIG
    owner = id(first.obj)  # an id: holding the object would keep it busy
    first[:4] = b"abcd"
    held = np.frombuffer(first, dtype=np.uint8)[:4]  # a result kept as a numpy view
    del first
    second = pool.take(BIG)
    assert id(second.obj) != owner  # still read through `held`: a new buffer
    del held
    third = pool.take(BIG)
    assert id(third.obj) == owner  # nobody reads it any more
    assert pool.reused == 1
    # views of views (a relay's payload, encode()'s cast) hold it as well
    view = memoryview(third).cast("B")[10:20]
    del third
    assert id(pool.take(BIG).obj) != owner
    del view
    assert id(pool.take(BIG).obj) == owner


def test_sizes_do_not_mix_and_the_pool_stays_bounded() -> None:
    pool = BufferPool(keep=3)
    a = pool.take(BIG)
    owner = id(a.obj)
    del a
    b = pool.take(BIG + 1)  # another size: a fresh buffer even though one is free
    assert id(b.obj) != owner
    assert len(b) == BIG + 1
    for _ in range(5):
        pool.take(BIG + 2)
    assert len(pool.lent) == 3


class _Events:
    def __init__(self) -> None:
        self.stale = False
        self.got: list[Message] = []
        self.ready = asyncio.Event()
        self.refused = asyncio.Event()
        self.progress = 0  # reports of a large payload's bytes arriving

    def on_message(self, msg: Message) -> None:
        self.got.append(msg)
        self.ready.set()

    def on_link_down(self, peer: int, reason: str, refused: bool = False) -> None:
        if refused:
            self.refused.set()

    def is_stale(self, msg: Message) -> bool:
        return self.stale

    def on_progress(self, peer: int) -> None:
        self.progress += 1


def _data(step: int, values: np.ndarray) -> Message:
    return Message(kind=Kind.DATA_BCAST, src=0, step=step, dtype="<f4", numel=int(values.size),
                   signature=f"float32[{values.size}]", payload=values.data.cast("B"))


def test_backlog_is_counted_as_frames_come_and_go() -> None:
    async def run() -> None:
        # rank 1 does not listen: frames wait in the queue
        addrs = [Address("127.0.0.1", free_port()), Address("127.0.0.1", free_port()),
                 Address("127.0.0.1", free_port())]
        t = TcpTransport(0, addrs, connect_timeout_s=0.2)
        events = _Events()
        t.bind(events)
        await t.start()
        try:
            for step in range(3):
                t.send(1, _data(step, np.zeros(1000, dtype=np.float32)))
            t.send(1, Message(kind=Kind.META_BCAST_RECEIVED, src=0, step=0))
            t.send(2, _data(0, np.zeros(500, dtype=np.float32)))
            assert t.backlog_bytes(1) == 3 * 4000
            assert t.backlog_bytes() == 3 * 4000 + 2000  # every link: they share one uplink
            events.stale = True
            t._out[1].control._drop_stale()
            assert t.backlog_bytes(1) == 0
        finally:
            await t.close(flush_s=0)

    asyncio.run(run())


def test_a_queue_behind_a_slow_link_holds_the_steps_in_flight_not_every_step() -> None:
    """A link that drains slower than steps finish (a loss burst; here a peer that does not
    listen, with no await between the sends, so the writer task never runs): frames of finished
    steps are dropped as the queue grows, so it holds the steps still in flight. Without that,
    200 steps of 1 MiB sat in the queue."""
    async def run() -> None:
        addrs = [Address("127.0.0.1", free_port()), Address("127.0.0.1", free_port())]
        t = TcpTransport(0, addrs, connect_timeout_s=0.2)
        newest = [0]

        class _InFlight(_Events):
            def is_stale(self, msg: Message) -> bool:
                return msg.step < newest[0] - 2  # the last three steps are in flight

        t.bind(_InFlight())
        await t.start()
        try:
            most = 0
            for step in range(200):
                newest[0] = step
                t.send(1, _data(step, np.zeros(1 << 18, dtype=np.float32)))  # 1 MiB
                most = max(most, t.backlog_bytes(1))
            assert most <= 24 << 20  # MiB; without dropping: 200
            assert t.status().link(1).stale_dropped >= 150
        finally:
            await t.close(flush_s=0)

    asyncio.run(run())


async def _started_pair() -> tuple[TcpTransport, TcpTransport, _Events]:
    """Rank 0 (the sender) and rank 1 on loopback, listening; rank 1's events record what came."""
    addrs = [Address("127.0.0.1", free_port()), Address("127.0.0.1", free_port())]
    sender, receiver = TcpTransport(0, addrs), TcpTransport(1, addrs)
    got = _Events()
    sender.bind(_Events())
    receiver.bind(got)
    await sender.start()
    await receiver.start()
    return sender, receiver, got


async def _until_received(got: _Events, count: int) -> None:
    while len(got.got) < count:
        got.ready.clear()
        await asyncio.wait_for(got.ready.wait(), 20)


def test_payloads_arrive_intact_while_earlier_ones_are_held() -> None:
    """Frames through a real connection: results kept (as the protocol keeps them) must not be
    overwritten by later frames, and released buffers are used again."""
    async def run() -> None:
        sender, receiver, got = await _started_pair()
        try:
            n = BIG // 4
            kept = []
            for step in range(12):
                sender.send(1, _data(step, np.full(n, float(step), dtype=np.float32)))
                await _until_received(got, step + 1)
                msg = got.got[step]
                assert msg.payload is not None
                values = np.frombuffer(msg.payload, dtype=np.float32)
                if step % 2 == 0:
                    kept.append((step, values))  # held like a result
                got.got[step] = msg.__class__(kind=msg.kind, src=msg.src)  # the rest let go
                del msg, values
            for step, values in kept:
                assert (values == float(step)).all(), step
            assert receiver.pool.reused >= 4
            # the counters a monitor reads every step are the ones the status reports
            link = sender.status().link(1)
            assert sender.link_health(1) == (link.frames_sent, link.errors, 0, link.last_error)
            assert sender.link_health(1).frames_sent == 12
            assert sender.link_health(5) == (0, 0, 0, "")  # a rank never heard of
        finally:
            await sender.close(flush_s=1)
            await receiver.close(flush_s=0)

    asyncio.run(run())


def test_a_link_in_redial_backoff_dials_at_once_when_the_peer_connects_to_us(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted or joining rank connects to its peers as it starts. A peer whose link to it
    is waiting out a redial backoff (its frames for the rank's last process were refused) must
    dial then, not at the end of the backoff: its first ops' frames were lost to that wait (the
    peer moved to a later view meanwhile and dropped them as stale). The backoff is made an
    hour here, so only the peer's connection can end it within the test."""
    monkeypatch.setattr(tcp, "REDIAL_FIRST_S", 3600.0)
    monkeypatch.setattr(tcp, "REDIAL_MAX_S", 3600.0)

    async def run() -> None:
        addrs = [Address("127.0.0.1", free_port()), Address("127.0.0.2", free_port())]
        sender = TcpTransport(0, addrs, connect_timeout_s=0.5)
        sent = _Events()
        sender.bind(sent)
        await sender.start()
        receiver = TcpTransport(1, addrs)
        got = _Events()
        receiver.bind(got)
        try:
            sender.send(1, _data(0, np.ones(10, dtype=np.float32)))
            await asyncio.wait_for(sent.refused.wait(), 20)  # rank 1 is not up: the link waits an hour
            await receiver.start()
            receiver.send(0, Message(kind=Kind.META_BCAST_RECEIVED, src=1, step=0))  # rank 1 dials us
            await asyncio.wait_for(got.ready.wait(), 20)
            assert got.got[0].kind is Kind.DATA_BCAST
        finally:
            await sender.close(flush_s=0)
            await receiver.close(flush_s=0)

    asyncio.run(run())


def test_frames_arrive_once_and_in_order_on_each_connection() -> None:
    """Small frames take the control connection (written at once on an idle link, queued
    behind a backed-up socket), large payloads the bulk one (written in slices as the in-flight
    budget allows). Mixed, in bursts, every frame must arrive once and in the order it was sent
    on its connection, and each path must have been taken."""
    async def run() -> None:
        sender, receiver, got = await _started_pair()
        try:
            await sender.wait_for_peers([1], 10)
            big = np.ones(1 << 20, dtype=np.float32)  # 4 MB: the bulk connection
            small = np.ones(tcp.CONTROL_MAX_PAYLOAD // 4, dtype=np.float32)  # the largest control payload
            queued = direct = seq = 0
            for _ in range(6):
                for _ in range(40):
                    frames_before = sender.link_health(1).frames_sent
                    msg = (_data(seq, big) if seq % 13 == 0 else _data(seq, small) if seq % 2 else
                           Message(kind=Kind.META_BCAST_RECEIVED, src=0, step=seq))
                    sender.send(1, msg)
                    if sender.link_health(1).frames_sent > frames_before:  # written at once
                        direct += 1
                    else:
                        queued += 1
                    seq += 1
                await _until_received(got, seq)  # let the link drain between bursts
            bulk = [m.step for m in got.got if m.payload is not None and len(m.payload) > tcp.CONTROL_MAX_PAYLOAD]
            control = [m.step for m in got.got if m.payload is None or len(m.payload) <= tcp.CONTROL_MAX_PAYLOAD]
            assert bulk == [s for s in range(seq) if s % 13 == 0]
            assert control == [s for s in range(seq) if s % 13]
            assert direct > 0
            assert queued > 0
            assert sender.link_health(1).frames_sent == seq
            assert got.progress > 0  # the 4 MB payloads were seen arriving before they were whole
        finally:
            await sender.close(flush_s=1)
            await receiver.close(flush_s=0)

    asyncio.run(run())


def test_close_waits_until_a_large_frame_is_acknowledged() -> None:
    """A 16 MB frame is still mostly queued when close() is called: close gives it time to go
    out and be acknowledged (what the kernel still holds once the loop stops is delivered
    anyway, but a frame's tail still queued here would be lost)."""
    async def run() -> None:
        sender, receiver, got = await _started_pair()
        try:
            await sender.wait_for_peers([1], 10)
            sender.send(1, _data(0, np.ones(4 << 20, dtype=np.float32)))  # 16 MB
            assert sender.backlog_bytes(1) > tcp.DRAIN_ABOVE_BYTES
            await sender.close(flush_s=20)
            assert sender.backlog_bytes(1) == 0
            await _until_received(got, 1)
            assert got.got[0].payload is not None
            assert len(got.got[0].payload) == 16 << 20
        finally:
            await sender.close(flush_s=0)
            await receiver.close(flush_s=0)

    asyncio.run(run())
