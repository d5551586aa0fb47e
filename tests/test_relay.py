"""Relays (fttree/net/relay.py) on their own: which rank relays for a pair, what a relay
forwards, what it refuses, and what it holds. A transport is stood in for by `Host`, which
records what would go out; the relays over real connections are in tests/test_nat.py."""

from __future__ import annotations

import pytest

from fttree.core.messages import PREFIX, Frame, Kind, Message, decode_header, encode
from fttree.errors import FrameError
from fttree.net.address import NOWHERE, Address, parse_address
from fttree.net.relay import ENVELOPE, RELAY_BACKLOG_BYTES, Relayed, Relays, is_envelope, relay_order

# 0, 1 public; 2, 3 behind site a; 4 behind site b; 5, 6 nobody can dial
ADDRESSES = {0: parse_address("10.0.0.1:1"), 1: parse_address("10.0.0.2:1"),
             2: parse_address("192.168.0.2:1 behind a"), 3: parse_address("192.168.0.3:1 behind a"),
             4: parse_address("192.168.0.2:1 behind b"), 5: NOWHERE, 6: NOWHERE}


class Host:
    """A transport as the relays see it: pushes and deliveries are recorded."""

    def __init__(self, rank: int, addresses: dict[int, Address] = ADDRESSES, up: tuple[int, ...] = ()) -> None:
        self.rank, self.addresses, self.me = rank, dict(addresses), addresses[rank]
        self.addresses_changed = 0
        self.up = set(up)
        self.backlog: dict[int, int] = {}
        self.pushed: list[tuple[int, Frame]] = []
        self.delivered: list[tuple[int, Frame]] = []

    def knows(self, rank: int) -> bool:
        return rank in self.addresses

    def link_up(self, peer: int) -> bool:
        return peer in self.up

    def backlog_bytes(self, dst: int | None = None) -> int:
        return self.backlog.get(-1 if dst is None else dst, 0)

    def push(self, dst: int, msg: Frame) -> None:
        self.pushed.append((dst, msg))

    def deliver(self, src: int, head: bytes, payload: bytearray | memoryview | None) -> None:
        msg = decode_header(head, payload)
        if msg.src != src:
            raise FrameError(f"frame says it is from rank {msg.src} on rank {src}'s connection")
        self.delivered.append((src, msg))


def frame(src: int, payload: bytes | None = None) -> Message:
    if payload is None:
        return Message(kind=Kind.META_REDUCE_SENT, src=src, step=3, origin=src, target=0)
    return Message(kind=Kind.DATA_REDUCE, src=src, step=3, origin=src, target=0, dtype="<f4",
                   numel=len(payload) // 4, payload=payload)


def on_wire(env: Relayed) -> tuple[bytes, memoryview | None]:
    """The envelope's header and payload as the next rank reads them."""
    bufs = env.bufs()
    return bytes(bufs[0][PREFIX.size:]), (memoryview(bufs[1]) if len(bufs) > 1 else None)


def test_the_relay_is_a_rank_both_reach_public_first_the_same_both_ways_spread_over_pairs() -> None:
    assert relay_order(ADDRESSES, 5, 6) == relay_order(ADDRESSES, 6, 5) == (1, 0)  # rotated by the pair
    assert relay_order(ADDRESSES, 2, 5) == (1, 0)  # site a and `-`: only the public ranks reach both
    assert relay_order(ADDRESSES, 4, 6) == (0, 1)
    assert relay_order(ADDRESSES, 2, 4) == (0, 1)  # two sites
    only_sited = {0: parse_address("192.168.0.1:1 behind a"), 1: parse_address("192.168.0.2:1 behind a"),
                  2: NOWHERE, 3: parse_address("10.0.0.9:1")}
    assert relay_order(only_sited, 0, 2) == (3,)
    assert relay_order({0: NOWHERE, 1: NOWHERE}, 0, 1) == ()
    pairs = [(a, b) for a in (2, 3, 4, 5, 6) for b in (2, 3, 4, 5, 6) if a < b]
    firsts = [relay_order(ADDRESSES, a, b)[0] for a, b in pairs]
    assert firsts.count(0)
    assert firsts.count(1)


def test_a_frame_goes_out_through_the_first_relay_whose_connection_is_up() -> None:
    host = Host(5, up=(0,))
    relays = Relays(host)
    assert relays.needed(6)
    assert relays.needed(2)
    assert not relays.needed(0)
    relays.send(6, frame(5))
    (to, env), = host.pushed
    assert to == 0  # rank 1 comes first for the pair (5, 6), but its connection is down
    assert isinstance(env, Relayed)
    assert env.dst == 6
    assert env.inner is not None
    head, _ = on_wire(env)
    assert is_envelope(head)
    assert ENVELOPE.unpack_from(head)[1:] == (5, 6)
    host.up = set()
    relays.send(6, frame(5))
    assert host.pushed[-1][0] == 1  # none up: the first, where the frame waits for the connection
    alone = Relays(Host(0, {0: NOWHERE, 1: NOWHERE}))
    alone.send(1, frame(0))
    assert alone.counters.dropped == 1
    assert "no rank of the job can reach both" in alone.counters.last_drop


def test_the_relay_forwards_unchanged_and_the_destination_takes_the_frame_out() -> None:
    payload = bytes(range(256)) * 16
    sender, relay, dest = Relays(Host(5, up=(0, 1))), Relays(Host(1)), Relays(Host(6))
    sender.send(6, frame(5, payload))
    (_, env), = sender.host.pushed  # type: ignore[attr-defined]
    assert isinstance(env, Relayed)
    relay.receive(5, *on_wire(env))
    (to, fwd), = relay.host.pushed  # type: ignore[attr-defined]
    assert to == 6
    assert isinstance(fwd, Relayed)
    assert fwd.inner is None
    assert fwd.bufs()[0] == env.bufs()[0]
    dest.receive(1, *on_wire(fwd))
    (src, got), = dest.host.delivered  # type: ignore[attr-defined]
    assert src == 5
    assert isinstance(got, Message)
    assert got.kind is Kind.DATA_REDUCE
    assert got.step == 3
    assert got.payload is not None
    assert bytes(got.payload) == payload
    assert relay.counters.forwarded_frames == 1
    assert dest.counters.received_frames == 1
    assert sender.counters.sent_bytes == relay.counters.forwarded_bytes == dest.counters.received_bytes


def envelope(origin: int, dst: int, msg: Frame) -> tuple[bytes, memoryview | None]:
    head = ENVELOPE.pack(b"\xc1", origin, dst) + bytes(encode(msg)[0][PREFIX.size:])
    return head, None if msg.payload is None else memoryview(msg.payload)


@pytest.mark.parametrize(("src", "origin", "dst", "inner_src", "error"), [
    (5, 2, 6, 2, "carries only the frames of the rank that sends them"),  # a member passing off another's frame
    (5, 5, 6, 2, "says it is from rank 2"),  # the inner frame claims someone else
    (9, 9, 6, 9, "not a rank of this job"),  # not a member (a joiner not admitted)
])
def test_a_relay_refuses_an_envelope_no_member_sends(src: int, origin: int, dst: int, inner_src: int,
                                                     error: str) -> None:
    relay = Relays(Host(1))
    with pytest.raises(FrameError, match=error):
        relay.receive(src, *envelope(origin, dst, frame(inner_src)))
    assert relay.host.pushed == []  # type: ignore[attr-defined]


def test_a_destination_takes_relayed_frames_only_from_ranks_it_cannot_reach() -> None:
    """Dropped and counted, the relay's connection kept: a member's address book may lag."""
    dest = Relays(Host(6))
    dest.receive(1, *envelope(0, 6, frame(0)))  # rank 0 has a connection to 6 of its own
    dest.receive(1, *envelope(9, 6, frame(9)))  # not a member
    assert dest.counters.dropped == 2
    assert "only reach through a relay" in dest.counters.last_drop
    with pytest.raises(FrameError, match="holds no frame"):
        dest.receive(1, ENVELOPE.pack(b"\xc1", 5, 6), None)
    assert dest.host.delivered == []  # type: ignore[attr-defined]


def test_what_a_relay_holds_is_bounded_and_it_never_relays_twice() -> None:
    host = Host(1)
    relay = Relays(host)
    big = bytes(1 << 20)
    host.backlog[6] = RELAY_BACKLOG_BYTES - 1000
    relay.receive(5, *envelope(5, 6, frame(5, big)))
    assert host.pushed == []
    assert relay.counters.dropped == 1
    assert "not acknowledged" in relay.counters.last_drop
    host.backlog[6] = 0  # nothing outstanding: one frame of any size goes
    relay.receive(5, *envelope(5, 6, frame(5, big)))
    assert len(host.pushed) == 1
    sited = Relays(Host(2))  # behind site a: it has no connection to rank 4 behind site b
    sited.receive(5, *envelope(5, 4, frame(5)))
    assert sited.host.pushed == []
    assert sited.counters.dropped == 1
