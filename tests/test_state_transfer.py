"""The joiner's side of the state transfer, without a network: pieces in any order, the check
and decode of the whole off the training thread, a wrong digest or undecodable bytes named and
answered by asking the next donor."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fttree.core.membership import Installed
from fttree.core.messages import Frame, Kind, State
from fttree.core.view import View
from fttree.errors import PeerError
from fttree.training import elastic
from fttree.training.state import StateError, TrainingState, capture, decode, encode, state_digest


@dataclass
class FakeHandle:
    """What StateTransfer uses of an FTTreeAllreduce: rank, view, config, joining, node, send_frame."""

    rank: int = 3
    view: View = field(default_factory=lambda: View(epoch=0, members=(0, 1, 2, 3)))
    config: Any = field(default_factory=lambda: SimpleNamespace(step_timeout_s=5.0))
    joining: bool = False
    node: Any = field(default_factory=lambda: SimpleNamespace(elastic_listeners=[], view_listeners=[]))
    sent: list[tuple[int, Frame]] = field(default_factory=list)

    def send_frame(self, dst: int, msg: Frame) -> None:
        self.sent.append((dst, msg))


@pytest.fixture(autouse=True)
def checks_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The joiner's check of a whole state, on the polling thread: done by the next poll."""
    monkeypatch.setattr(elastic.StateTransfer, "_check_in_background", inline)


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


def donor_of(rank: int) -> tuple[FakeHandle, elastic.StateTransfer]:
    ar = FakeHandle(rank=rank)
    return ar, elastic.StateTransfer(ar, capture=a_state)  # type: ignore[arg-type]


def deliver(ar: FakeHandle, msg: Frame) -> None:
    ar.node.elastic_listeners[0](msg)


def serve_now(donor: elastic.StateTransfer, step: int) -> None:
    """The donor's step boundary, with its manifest sent on this thread."""
    with donor._lock:
        due = [j for j, first in donor._requests.items() if first <= step]
        for j in due:
            del donor._requests[j]
    donor._send_manifest(due, step, donor.capture().frozen())


def pump(joiner: FakeHandle, donors: dict[int, tuple[FakeHandle, elastic.StateTransfer]],
         dead: frozenset[int] = frozenset(), rounds: int = 10_000) -> None:
    """Carry frames both ways until none is left, dropping those to or from `dead` donors."""
    for _ in range(rounds):
        moved = False
        while joiner.sent:
            dst, msg = joiner.sent.pop(0)
            if dst in donors and dst not in dead:
                deliver(donors[dst][0], msg)
                moved = True
        for r, (ar, _) in donors.items():
            while ar.sent:
                _, msg = ar.sent.pop(0)
                if r not in dead:
                    deliver(joiner, msg)
                    moved = True
        if not moved:
            return
    raise AssertionError("frames still moving after many rounds")


def three_donors() -> dict[int, tuple[FakeHandle, elastic.StateTransfer]]:
    return {r: donor_of(r) for r in (0, 1, 2)}


def poll_until(transfer: elastic.StateTransfer, step: int, limit: int) -> tuple[int, TrainingState]:
    for _ in range(limit):
        got = transfer.poll(step)
        if got is not None:
            return got
    raise AssertionError(f"no state after {limit} polls")


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


def test_the_state_comes_in_shares_from_every_donor_and_is_decoded_after_its_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 64 << 10)
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state, window=1)  # type: ignore[arg-type]
    donors = three_donors()
    transfer.request(12)
    asked = sorted(dst for dst, msg in ar.sent if msg.kind is Kind.STATE_REQUEST)
    assert asked == [0, 1, 2]
    pump(ar, donors)
    for _, d in donors.values():
        serve_now(d, 12)
    pump(ar, donors)
    total = -(-len(encode(a_state()).data) // elastic.CHUNK_BYTES)
    step, state = poll_until(transfer, 12, total + 2)
    assert step == 12
    assert state.step_count == 7
    record = transfer.record
    assert record is not None
    assert record.nbytes == len(encode(a_state()).data)
    assert sum(record.pieces.values()) == total
    assert total >= 6
    assert set(record.pieces) == {0, 1, 2}, record.pieces
    assert record.refetched == 0


def test_the_training_thread_waits_for_the_check_of_the_whole_state_without_doing_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every piece is in, the digest and the decode run elsewhere: polls (one a training
    step) return nothing, however many, until that work is done, then the state at once."""
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 64 << 10)
    started: list[tuple[Any, tuple[Any, ...]]] = []
    monkeypatch.setattr(elastic.StateTransfer, "_check_in_background",
                        lambda _self, target, *args: started.append((target, args)))
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state)  # type: ignore[arg-type]
    donors = three_donors()
    transfer.request(12)
    pump(ar, donors)
    for _, d in donors.values():
        serve_now(d, 12)
    pump(ar, donors)
    total = -(-len(encode(a_state()).data) // elastic.CHUNK_BYTES)
    for _ in range(total + 5):
        assert transfer.poll(12) is None
    assert len(started) == 1  # started once, by the first poll with every piece in
    target, args = started[0]
    target(*args)
    got = transfer.poll(12)
    assert got is not None
    assert got[0] == 12
    assert got[1].step_count == 7
    record = transfer.record
    assert record is not None
    assert record.piece_bytes == record.nbytes == len(encode(a_state()).data)
    assert 0 <= record.manifest_s <= record.first_piece_s <= record.all_pieces_s <= record.checked_s <= record.seconds


def test_a_state_whose_whole_digest_does_not_match_is_asked_again_of_other_donors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every piece matches the manifest but the whole does not match the digest (a manifest
    made up to match forged pieces): the joiner asks again, its donors last."""
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state, max_donors=1)  # type: ignore[arg-type]
    donor_ar, donor = donor_of(0)
    transfer.request(12)
    pump(ar, {0: (donor_ar, donor)})
    with donor._lock:
        donor._requests.clear()
    real = encode(a_state())
    monkeypatch.setattr("fttree.training.elastic.encode",
                        lambda _s: SimpleNamespace(data=real.data, hexdigest=state_digest(b"another state")))
    donor._send_manifest([3], 12, a_state())
    pump(ar, {0: (donor_ar, donor)})
    ar.sent.clear()
    assert transfer.poll(12) is None
    assert transfer.record is None
    asked = [dst for dst, msg in ar.sent if msg.kind is Kind.STATE_REQUEST and msg.piece == elastic.MANIFEST]
    assert asked == [1]  # rank 0 (given up on) last, beyond max_donors


def test_a_donor_dead_mid_transfer_costs_only_its_missing_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 64 << 10)
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state, window=2)  # type: ignore[arg-type]
    donors = three_donors()
    transfer.request(12)
    pump(ar, donors)
    for _, d in donors.values():
        serve_now(d, 12)
    # the manifests and the first windows: then rank 1 dies with its window unsent
    for r in (0, 1, 2):
        for _, msg in donors[r][0].sent:
            deliver(ar, msg)
        donors[r][0].sent.clear()
    pump(ar, donors, dead=frozenset({1}))
    fetch = transfer._fetch
    assert fetch is not None
    total = fetch.ledger.manifest.total
    assert total >= 8
    owed = fetch.ledger.owed_by(1)
    assert owed, "rank 1 owed nothing when it died"
    assert not fetch.ledger.done
    transfer.wait_s = 0.0
    transfer.poll(12)  # rank 1 is overdue: its pieces go to ranks 0 and 2
    pump(ar, donors, dead=frozenset({1}))
    transfer.wait_s = 60.0
    step, _ = poll_until(transfer, 12, total + 2)
    assert step == 12
    record = transfer.record
    assert record is not None
    assert record.refetched == len(owed)
    assert 1 not in record.pieces
    assert sum(record.pieces.values()) == total


def test_a_piece_with_a_wrong_digest_loses_its_donor_and_comes_from_another(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 64 << 10)
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state)  # type: ignore[arg-type]
    donors = three_donors()
    hostile = donors[2][1]
    real_send = hostile._send_piece

    def lying(msg: State) -> None:
        real_send(msg)
        _, sent = donors[2][0].sent[-1]
        assert isinstance(sent, State)
        assert sent.payload is not None
        forged = bytearray(bytes(sent.payload))
        forged[0] ^= 1
        donors[2][0].sent[-1] = (ar.rank, State(kind=Kind.STATE, src=2, user_step=sent.user_step, piece=sent.piece,
                                                pieces=sent.pieces, digest=sent.digest, numel=len(forged),
                                                payload=bytes(forged)))

    hostile._send_piece = lying  # type: ignore[method-assign]
    transfer.window = 2  # 8 pieces: every donor gets some
    transfer.request(12)
    pump(ar, donors)
    for _, d in donors.values():
        serve_now(d, 12)
    pump(ar, donors)
    _, state = poll_until(transfer, 12, 64)
    assert state.step_count == 7
    record = transfer.record
    assert record is not None
    assert 2 not in record.pieces
    assert transfer.dropped["a piece that does not match its digest"] == 1, (transfer.dropped, record)


def test_a_piece_not_asked_for_is_dropped_counted_and_changes_nothing() -> None:
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state)  # type: ignore[arg-type]
    transfer.request(12)
    data = encode(a_state()).data
    for i in range(100):
        deliver(ar, State(kind=Kind.STATE, src=1, user_step=12, piece=i, pieces=100, digest="x" * 64,
                          numel=16, payload=data[:16]))
    assert transfer._fetch is None
    assert transfer.dropped["a piece of a state not being fetched"] == 100
    deliver(ar, State(kind=Kind.STATE, src=7, user_step=12, piece=elastic.MANIFEST, pieces=1, digest="x" * 64,
                      numel=8, payload=bytes(8)))
    assert transfer._fetch is None
    assert transfer.dropped["a manifest not asked for"] == 1


def test_a_donor_asked_for_a_piece_it_does_not_hold_drops_the_request() -> None:
    ar, donor = donor_of(0)
    deliver(ar, State(kind=Kind.STATE_REQUEST, src=3, user_step=12, piece=0, digest="x" * 64))
    assert ar.sent == []
    assert donor.dropped["a request for a piece of a state not held for it"] == 1


def test_three_joiners_at_once_start_at_different_donors() -> None:
    firsts = []
    for rank in (3, 4, 5):
        ar = FakeHandle(rank=rank, view=View(epoch=0, members=(0, 1, 2, 3, 4, 5)))
        elastic.StateTransfer(ar, capture=a_state, max_donors=1).request(12)  # type: ignore[arg-type]
        firsts.append(ar.sent[0][0])
    assert len(set(firsts)) == 3, firsts


def test_a_manifest_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="must be 72 bytes, got 40"):
        elastic.manifest_from(bytes(40), 2)


def test_undecodable_state_bytes_are_named() -> None:
    with pytest.raises(StateError, match="format version 0"):
        decode(b"FTTS" + b"\x00" * 40)
    with pytest.raises(StateError, match="not an fttree state"):
        decode(b"garbage garbage garbage")
    data = bytearray(encode(a_state()).data)
    data[20:40] = bytes(20)  # inside the header
    with pytest.raises(StateError, match="cannot be decoded"):
        decode(bytes(data))


def test_a_state_that_matches_its_digest_but_cannot_be_decoded_names_the_donor_and_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state, max_donors=1)  # type: ignore[arg-type]
    garbage = b"FTTS" + bytes(60)
    donor_ar, donor = donor_of(0)
    transfer.request(12)
    pump(ar, {0: (donor_ar, donor)})
    with donor._lock:
        donor._requests.clear()
    snap_state = a_state()
    monkeypatch.setattr("fttree.training.elastic.encode",
                        lambda _s: SimpleNamespace(data=garbage, hexdigest=state_digest(garbage)))
    donor._send_manifest([3], 12, snap_state)
    pump(ar, {0: (donor_ar, donor)})
    with pytest.raises(PeerError, match=r"from ranks \[0\] as of step 12 matched its digest but is unusable") as err:
        transfer.poll(12)
    assert err.value.peers == (0,)


def inline(_self: elastic.StateTransfer, target: Any, *args: Any) -> None:
    """A donor's encoding, on this thread: done in order."""
    target(*args)


def join_of(joiners: tuple[int, ...], at: int, members: tuple[int, ...]) -> Installed:
    view = View(epoch=1, members=members)
    return Installed(view=view, previous=view, committed=frozenset(), catch_up=(), evicted=(), reason="join",
                     joined=joiners, activate_at=at)


def test_donors_past_the_join_step_offer_the_state_they_held_for_it_and_each_serves_its_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44: a request reaches ranks 1 and 2 after they passed the step the join took effect
    at, and rank 0 before it. All three offer that step's state, and rank 0, answering last,
    still serves its share: the others, done with theirs, take none of it."""
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(elastic.StateTransfer, "_in_background", inline)
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state, window=1)  # type: ignore[arg-type]
    donors = three_donors()
    for donor_ar, _ in donors.values():
        donor_ar.node.view_listeners[0](join_of((3,), 12, (0, 1, 2, 3)))
    for r in (1, 2):
        donors[r][1].serve(12)
        donors[r][1].serve(13)
    transfer.request(12)
    pump(ar, donors)
    fetch = transfer._fetch
    assert fetch is not None
    assert fetch.donors == [1, 2]
    assert fetch.ledger.missing() == fetch.ledger.share[0], "ranks 1 and 2 took rank 0's share"
    donors[0][1].serve(12)
    pump(ar, donors)
    total = fetch.ledger.manifest.total
    step, _ = poll_until(transfer, 12, total + 2)
    assert step == 12
    record = transfer.record
    assert record is not None
    assert sorted(record.pieces) == [0, 1, 2], record.pieces
    assert sum(record.pieces.values()) == total  # each piece came once: once ready, rank 0's share is taken
    assert record.refetched == 0                # by the idle ones too (the faster, the more)


def test_a_joiner_asking_another_joiner_is_told_it_holds_no_state_and_takes_its_share_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(elastic.StateTransfer, "_in_background", inline)
    members = (0, 1, 2, 3, 4)
    ar = FakeHandle(rank=3, view=View(epoch=1, members=members), joining=True)
    transfer = elastic.StateTransfer(ar, capture=a_state, window=2)  # type: ignore[arg-type]
    donors = {r: (FakeHandle(rank=r, view=View(epoch=1, members=members), joining=r == 4), None) for r in (0, 1, 2, 4)}
    everyone = {r: (h, elastic.StateTransfer(h, capture=a_state)) for r, (h, _) in  # type: ignore[arg-type]
                donors.items()}
    for h, _ in everyone.values():
        h.node.view_listeners[0](join_of((3, 4), 12, members))
    for r in (0, 1, 2):
        everyone[r][1].serve(12)
    transfer.request(12)
    assert sorted(dst for dst, _ in ar.sent) == [0, 1, 2, 4]
    pump(ar, everyone)
    step, _ = poll_until(transfer, 12, 64)
    assert step == 12
    record = transfer.record
    assert record is not None
    assert sorted(record.pieces) == [0, 1, 2], record.pieces
    assert record.refetched == 0
    assert everyone[4][1].pieces_sent == 0


def test_a_joiner_asking_again_while_its_state_is_encoded_keeps_that_state_at_later_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A joiner whose first manifest was late (a loaded donor still encoding) asks again. The
    one state encoded answers both requests: at later step boundaries the donor neither
    encodes another for it nor drops its requests for pieces of the first."""
    encoded: list[tuple[Any, tuple[Any, ...]]] = []
    monkeypatch.setattr(elastic.StateTransfer, "_in_background",
                        lambda _self, target, *args: encoded.append((target, args)))
    donor_ar, donor = donor_of(0)
    donor_ar.node.view_listeners[0](join_of((3,), 12, (0, 1, 2, 3)))
    ask = State(kind=Kind.STATE_REQUEST, src=3, user_step=12, piece=elastic.MANIFEST)
    deliver(donor_ar, ask)
    donor.serve(12)  # captures the state as of 12 and starts encoding it
    deliver(donor_ar, ask)  # asked again before the encoding is done
    assert len(encoded) == 1
    target, args = encoded.pop()
    target(*args)
    manifests = [msg for _, msg in donor_ar.sent if msg.kind is Kind.STATE and msg.piece == elastic.MANIFEST]
    assert [(m.user_step, m.pieces != elastic.NO_STATE) for m in manifests] == [(12, True)]
    digest = manifests[0].digest
    donor_ar.sent.clear()
    for step in (13, 14):
        donor.serve(step)
    assert encoded == [], "a later state was captured for the joiner while it fetches the first"
    deliver(donor_ar, State(kind=Kind.STATE_REQUEST, src=3, user_step=12, piece=0, digest=digest))
    assert [(m.user_step, m.piece, m.digest) for _, m in donor_ar.sent] == [(12, 0, digest)]
    assert sum(donor.dropped.values()) == 0


def test_only_the_donors_a_joiner_will_ask_hold_a_state_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic.StateTransfer, "_in_background", inline)
    members = tuple(range(8))
    asked = elastic.donors_for(7, members, 3)
    assert asked == [0, 1, 2]  # rank 7 % 7 others: from the first
    assert elastic.donors_for(5, members, 3) == [6, 7, 0]
    holding = []
    for r in range(7):
        h = FakeHandle(rank=r, view=View(epoch=1, members=members))
        d = elastic.StateTransfer(h, capture=a_state, max_donors=3)  # type: ignore[arg-type]
        h.node.view_listeners[0](join_of((7,), 12, members))
        d.serve(12)
        if 7 in d._held:
            holding.append(r)
    assert holding == asked


def test_a_joiner_whose_donors_all_died_asks_again_and_fetches_only_the_pieces_it_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(elastic.StateTransfer, "_in_background", inline)
    ar = FakeHandle()
    transfer = elastic.StateTransfer(ar, capture=a_state, window=2)  # type: ignore[arg-type]
    donors = three_donors()
    for donor_ar, _ in donors.values():
        donor_ar.node.view_listeners[0](join_of((3,), 12, (0, 1, 2, 3)))
        donors[donor_ar.rank][1].serve(12)
    transfer.request(12)
    # the manifests, the first windows asked and delivered, the next windows asked: then all three stall
    for _ in range(3):
        for dst, msg in ar.sent:
            deliver(donors[dst][0], msg)
        ar.sent.clear()
        for donor_ar, _ in donors.values():
            for _, msg in donor_ar.sent:
                deliver(ar, msg)
            donor_ar.sent.clear()
    ar.sent.clear()  # the third windows' requests are lost
    fetch = transfer._fetch
    assert fetch is not None
    had = len(fetch.ledger.have)
    owed = len(fetch.ledger.owed)
    total = fetch.ledger.manifest.total
    assert (had, owed) == (12, 6)
    assert total > had + owed
    transfer.wait_s = 0.0
    assert transfer.poll(12) is None  # every donor overdue: asked again
    transfer.wait_s = 60.0
    assert sorted(dst for dst, msg in ar.sent if isinstance(msg, State) and msg.piece == elastic.MANIFEST) == [0, 1, 2]
    asked: list[int] = []
    real_send = ar.send_frame

    def counting(dst: int, msg: Frame) -> None:
        if isinstance(msg, State) and msg.kind is Kind.STATE_REQUEST and msg.piece >= 0:
            asked.append(msg.piece)
        real_send(dst, msg)

    ar.send_frame = counting  # type: ignore[method-assign]
    pump(ar, donors)
    step, _ = poll_until(transfer, 12, total + 2)
    assert step == 12
    assert len(asked) == total - had  # none of the pieces in hand again
    assert len(set(asked)) == len(asked)
    record = transfer.record
    assert record is not None
    assert record.refetched == owed
    assert sum(record.pieces.values()) == total
