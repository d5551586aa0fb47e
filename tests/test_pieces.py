"""The piece planner and ledger (fttree.training.pieces): split, weighted spread, a dead, late or
lying donor costing only its missing pieces, many joiners starting at different donors."""

from __future__ import annotations

from collections import Counter

import pytest

from fttree.training.pieces import Ledger, Manifest, Verdict, piece_digest, split, start_offset

DATA = bytes(range(256)) * 40  # 10,240 bytes


def _ledger(piece_bytes: int = 1024, joiner: int = 9, data: bytes = DATA) -> Ledger:
    return Ledger(manifest=split(data, piece_bytes), joiner=joiner)


def _piece(led: Ledger, i: int, data: bytes = DATA) -> bytes:
    start, end = led.manifest.span(i)
    return data[start:end]


def test_split_covers_the_bytes_with_a_short_last_piece() -> None:
    m = split(DATA, 3000)
    assert m.total == 4
    assert [m.span(i) for i in range(4)] == [(0, 3000), (3000, 6000), (6000, 9000), (9000, 10240)]
    assert m.digests[3] == piece_digest(DATA[9000:])


def test_an_empty_state_is_one_empty_piece() -> None:
    m = split(b"", 1024)
    assert m.total == 1
    assert m.span(0) == (0, 0)
    assert m.check(0, b"")


def test_split_rejects_a_nonpositive_piece_size() -> None:
    with pytest.raises(ValueError, match="piece_bytes must be positive"):
        split(DATA, 0)


def test_a_manifest_with_the_wrong_number_of_digests_is_refused() -> None:
    with pytest.raises(ValueError, match="has 10 pieces, got 9 digests"):
        Manifest(nbytes=10240, piece_bytes=1024, digests=("x",) * 9)


def test_check_rejects_a_wrong_length_a_wrong_byte_and_an_unknown_piece() -> None:
    m = split(DATA, 1024)
    assert m.check(2, DATA[2048:3072])
    assert not m.check(2, DATA[2048:3071])
    assert not m.check(2, b"\x01" + DATA[2049:3072])
    assert not m.check(10, DATA[:1024])
    assert not m.check(-1, DATA[:1024])


def test_span_names_a_piece_out_of_range() -> None:
    with pytest.raises(IndexError, match=r"piece 10 is not in 0\.\.9"):
        split(DATA, 1024).span(10)


def test_plan_spreads_pieces_evenly_over_equal_donors() -> None:
    led = _ledger()
    asked = led.plan([1, 2, 3, 4, 5], now=0.0)
    assert sorted(len(p) for p in asked.values()) == [2, 2, 2, 2, 2]
    assert sorted(p for ps in asked.values() for p in ps) == list(range(10))


def test_plan_follows_the_weights() -> None:
    led = _ledger(piece_bytes=256)  # 40 pieces
    asked = led.plan([1, 2], now=0.0, weights={1: 3.0, 2: 1.0})
    assert len(asked[1]) == 30
    assert len(asked[2]) == 10


def test_plan_interleaves_donors_so_the_front_arrives_first() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0)
    assert asked[1] == [0, 2, 4, 6, 8]
    assert asked[2] == [1, 3, 5, 7, 9]


def test_plan_never_asks_the_joiner_itself_or_a_lost_donor() -> None:
    led = _ledger(joiner=2)
    led.lost.add(3)
    asked = led.plan([1, 2, 3], now=0.0)
    assert set(asked) == {1}


def test_plan_with_no_live_donor_names_the_problem() -> None:
    led = _ledger()
    led.lose(1)
    with pytest.raises(ValueError, match="10 pieces to fetch and no live donor"):
        led.plan([1], now=0.0)


def test_plan_rejects_a_nonpositive_weight() -> None:
    with pytest.raises(ValueError, match="weights must be positive"):
        _ledger().plan([1, 2], now=0.0, weights={1: 0.0})


def test_joiners_of_consecutive_ranks_start_at_different_donors() -> None:
    donors = [1, 2, 3]
    firsts = []
    for joiner in (10, 11, 12):
        asked = Ledger(manifest=split(DATA, 1024), joiner=joiner).plan(donors, now=0.0)
        firsts.append(next(d for d, ps in asked.items() if 0 in ps))
    assert sorted(firsts) == donors
    assert [start_offset(j, 3) for j in (10, 11, 12)] == [1, 2, 0]


def test_three_joiners_load_three_donors_evenly() -> None:
    load: Counter[int] = Counter()
    for joiner in (10, 11, 12):
        for donor, ps in Ledger(manifest=split(DATA, 1024), joiner=joiner).plan([1, 2, 3], now=0.0).items():
            load[donor] += len(ps)
    assert sorted(load.values()) == [10, 10, 10]


def test_a_piece_asked_of_its_sender_is_accepted_once() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0)
    p = asked[1][0]
    assert led.receive(1, p, _piece(led, p)) is Verdict.ACCEPTED
    assert led.receive(1, p, _piece(led, p)) is Verdict.DUPLICATE
    assert p not in led.missing()


def test_a_piece_from_a_sender_not_asked_for_it_is_dropped() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0)
    p = asked[1][0]
    assert led.receive(2, p, _piece(led, p)) is Verdict.NOT_REQUESTED
    assert led.receive(7, p, _piece(led, p)) is Verdict.NOT_REQUESTED
    assert p in led.missing()
    assert led.owed[p] == 1


def test_a_wrong_piece_loses_its_donor_and_goes_to_another() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0)
    p = asked[1][0]
    assert led.receive(1, p, b"\x00" * len(_piece(led, p))) is Verdict.BAD_DIGEST
    assert 1 in led.lost
    assert not led.owed_by(1)
    again = led.plan([1, 2], now=1.0)
    assert set(again) == {2}
    assert sorted(again[2]) == sorted(asked[1])


def test_a_donor_lost_midway_costs_only_its_missing_pieces() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2, 3], now=0.0)
    for p in asked[1][:2]:
        assert led.receive(1, p, _piece(led, p)) is Verdict.ACCEPTED
    missing_from_1 = asked[1][2:]
    assert led.lose(1) == missing_from_1
    again = led.plan([1, 2, 3], now=1.0)
    assert sorted(p for ps in again.values() for p in ps) == missing_from_1
    assert led.refetched == len(missing_from_1)
    for donor, ps in [*asked.items(), *again.items()]:
        for p in ps:
            if donor != 1:
                led.receive(donor, p, _piece(led, p))
    assert led.done
    assert led.assemble() == DATA


def test_a_late_piece_from_a_lost_donor_is_dropped() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0)
    led.lose(1)
    p = asked[1][0]
    assert led.receive(1, p, _piece(led, p)) is Verdict.NOT_REQUESTED


def test_overdue_names_a_donor_silent_past_its_deadline() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0)
    p = asked[2][0]
    led.receive(2, p, _piece(led, p))
    led.progress(2, now=4.0)
    assert led.overdue(now=5.0, wait_s=2.0) == [1]
    assert led.overdue(now=1.0, wait_s=2.0) == []


def test_a_donor_that_owes_nothing_is_never_overdue() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0)
    for p in asked[1]:
        led.receive(1, p, _piece(led, p))
    assert led.overdue(now=100.0, wait_s=2.0) == [2]


def test_assemble_before_done_names_the_missing_pieces() -> None:
    led = _ledger()
    with pytest.raises(ValueError, match=r"missing pieces \[0, 1"):
        led.assemble()


def test_a_limit_keeps_a_window_per_donor_and_refills_it() -> None:
    led = _ledger(joiner=0)
    asked = led.plan([1, 2], now=0.0, limit=2)
    assert asked == {1: [0, 2], 2: [1, 3]}
    led.receive(2, 1, _piece(led, 1))
    assert led.plan([1, 2], now=1.0, limit=2) == {2: [5]}  # the next of its own share


def test_a_donor_not_dealt_a_share_takes_from_the_back_of_a_ready_ones() -> None:
    led = _ledger(joiner=0)
    led.plan([1], now=0.0, limit=3)
    asked = led.plan([1, 2], now=1.0, limit=3)
    assert asked == {2: [9, 8, 7]}


def test_a_share_waits_for_its_donor_however_fast_the_others_are() -> None:
    """Rank 3 has not answered yet: ranks 1 and 2 finish their shares and take none of its."""
    led = _ledger(joiner=0)
    assert led.deal([1, 2, 3]) == {1: [0, 3, 6, 9], 2: [1, 4, 7], 3: [2, 5, 8]}
    for _ in range(10):
        for donor, ps in led.plan([1, 2], now=0.0, limit=2).items():
            for p in ps:
                assert led.receive(donor, p, _piece(led, p)) is Verdict.ACCEPTED
    assert led.missing() == [2, 5, 8]
    assert led.plan([1, 2, 3], now=1.0, limit=2) == {3: [2, 5], 1: [8]}  # ready now: its share is stolen too


def test_a_lost_donor_s_share_is_dealt_to_the_others_and_not_counted_as_refetched() -> None:
    led = _ledger(joiner=0)
    led.deal([1, 2, 3])
    asked = led.plan([1, 2, 3], now=0.0, limit=1)
    assert asked == {1: [0], 2: [1], 3: [2]}
    assert led.lose(3) == [2]
    assert led.refetched == 1  # piece 2 was asked of rank 3; 5 and 8 never were
    again = led.plan([1, 2], now=1.0)
    assert sorted(p for ps in again.values() for p in ps) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert not led.share.get(3)
