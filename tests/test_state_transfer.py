"""The joiner's side of the state transfer, without a network: pieces in any order, the work
on them spread over training steps, a wrong digest or undecodable bytes named and answered
by asking the next donor."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fttree.core.messages import Frame, Kind, State
from fttree.core.view import View
from fttree.errors import PeerError
from fttree.training import elastic
from fttree.training.state import StateError, TrainingState, capture, decode, encode, state_digest


@dataclass
class FakeHandle:
    """What StateTransfer uses of an FTTreeAllreduce: rank, view, config, node, send_frame."""

    rank: int = 3
    view: View = field(default_factory=lambda: View(epoch=0, members=(0, 1, 2, 3)))
    config: Any = field(default_factory=lambda: SimpleNamespace(step_timeout_s=5.0))
    node: Any = field(default_factory=lambda: SimpleNamespace(elastic_listeners=[]))
    sent: list[tuple[int, Frame]] = field(default_factory=list)

    def send_frame(self, dst: int, msg: Frame) -> None:
        self.sent.append((dst, msg))


def a_state() -> TrainingState:
    torch.manual_seed(1)
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    rng = torch.get_rng_state()
    extra = {"betas": (lambda: (0.9, 0.99), print), "rng": (lambda: rng, print)}
    return capture(model, opt, extra=extra, step_count=7)


def a_snapshot() -> tuple[bytes, str]:
    snap = encode(a_state())
    return snap.data, snap.hexdigest


def pieces_of(data: bytes, size: int, digest: str, donor: int = 0, user_step: int = 12) -> list[State]:
    total = -(-len(data) // size)
    return [State(kind=Kind.STATE, src=donor, user_step=user_step, piece=i, pieces=total, digest=digest,
                  numel=len(data[i * size:(i + 1) * size]), payload=data[i * size:(i + 1) * size])
            for i in range(total)]


def test_a_state_round_trips_bit_for_bit() -> None:
    state = a_state()
    back = decode(encode(state).data)
    assert back.step_count == 7
    assert back.extra["betas"] == (0.9, 0.99)
    assert list(back.model) == list(state.model)
    for name, t in state.model.items():
        assert torch.equal(back.model[name], t)
    assert set(back.optimizer["state"]) == set(state.optimizer["state"])  # integer keys survive
    assert torch.equal(back.extra["rng"], state.extra["rng"])
    assert encode(state).data == encode(a_state()).data  # deterministic


def test_a_frozen_state_keeps_its_values_while_training_goes_on() -> None:
    """The donor encodes on another thread: what it captured must not move with training."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    frozen = capture(model, opt).frozen()
    before = encode(frozen).data
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # in place: parameters and momentum buffers
    assert encode(frozen).data == before
    assert encode(capture(model, opt)).data != before


def test_the_received_state_is_checked_and_decoded_a_piece_per_step() -> None:
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state)  # type: ignore[arg-type]
    transfer.request(12)
    assert ar.sent[-1][0] == 0
    assert ar.sent[-1][1].kind is Kind.STATE_REQUEST
    data, digest = a_snapshot()
    frames = pieces_of(data, 64 << 10, digest)
    assert len(frames) >= 4
    for msg in reversed(frames):  # any order
        ar.node.elastic_listeners[0](msg)
    polls = 0
    got = None
    while got is None:
        polls += 1
        assert polls <= len(frames) + 1, "the state was not ready after one step per piece plus one to decode"
        got = transfer.poll(12)
    # One piece hashed per step and the decode in a step of its own: no step carries it all.
    assert polls == len(frames) + 1
    step, state = got
    assert step == 12
    assert state.step_count == 7
    assert transfer.record is not None
    assert transfer.record.nbytes == len(data)
    assert transfer.record.donor == 0


def test_a_state_that_fails_its_digest_is_dropped_and_the_next_donor_asked() -> None:
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state)  # type: ignore[arg-type]
    transfer.request(12)
    data, digest = a_snapshot()
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 1
    for msg in pieces_of(bytes(bad), 1 << 20, digest):
        ar.node.elastic_listeners[0](msg)
    for _ in range(10):
        assert transfer.poll(12) is None
    asked = [dst for dst, msg in ar.sent if msg.kind is Kind.STATE_REQUEST]
    assert asked[:2] == [0, 1], asked


def test_undecodable_state_bytes_are_named() -> None:
    with pytest.raises(StateError, match="format version 0"):
        decode(b"FTTS" + b"\x00" * 40)
    with pytest.raises(StateError, match="not an fttree state"):
        decode(b"garbage garbage garbage")
    data = bytearray(encode(a_state()).data)
    data[20:40] = bytes(20)  # inside the header
    with pytest.raises(StateError, match="cannot be decoded"):
        decode(bytes(data))


def test_a_state_that_matches_its_digest_but_cannot_be_decoded_names_the_donor_and_step() -> None:
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state)  # type: ignore[arg-type]
    transfer.request(12)
    garbage = b"FTTS" + bytes(60)
    for msg in pieces_of(garbage, 1 << 20, state_digest(garbage)):
        ar.node.elastic_listeners[0](msg)
    assert transfer.poll(12) is None  # the digest, checked
    with pytest.raises(PeerError, match="from rank 0 as of step 12 matched its digest but is unusable") as err:
        transfer.poll(12)
    assert err.value.peers == (0,)
