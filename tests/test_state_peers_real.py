"""State from peers in real processes (fttree.tools.bench_peers): a restarted worker takes its
state from several donors; a donor SIGKILLed (by its own pid) mid-transfer costs it only the
pieces that donor still owed; a donor forging pieces is dropped and its pieces come from others.
Every worker ends with the same model, bit for bit."""

from __future__ import annotations

import signal

from fttree.tools import bench_peers

from .conftest import free_port

STATE_MB = 8.0  # about nine 1 MiB pieces beside the model's


def _same_model(out: bench_peers.Outcome, ranks: list[int]) -> None:
    finals = {r: out.members[r].events.get("model") for r in ranks}
    finals.update({r: s.events.get("model") for r, s in out.rejoined.items()})
    assert None not in finals.values(), finals
    assert len(set(finals.values())) == 1, finals


def test_a_restarted_worker_takes_its_state_from_every_live_donor() -> None:
    """Every donor holds the state as of the step the join took effect and is dealt a share of
    its pieces, however late its answer: each of the three delivers some."""
    out = bench_peers.run(4, 2000, state_mb=STATE_MB, port=free_port())
    ev = out.rejoined[3].events
    assert "seconds" in ev, (out.codes, ev)
    assert sorted(ev["pieces"]) == ["0", "1", "2"], ev["pieces"]
    assert min(ev["pieces"].values()) >= 1, ev["pieces"]
    assert ev["refetched"] == 0
    assert ev["dropped"] == 0
    _same_model(out, [0, 1, 2])


def test_a_donor_killed_mid_transfer_costs_only_its_missing_pieces() -> None:
    """Rank 0 is dealt a share and asked a window of it at once, so it is always asked twice and
    dies after its first piece; its owed pieces and the rest of its share come from ranks 1
    and 2."""
    out = bench_peers.run(4, 2000, state_mb=STATE_MB, die_after=1, port=free_port())
    assert out.codes[0] == -signal.SIGKILL, out.codes
    assert out.members[0].events.get("dying") == 1
    ev = out.rejoined[3].events
    assert "seconds" in ev, (out.codes, ev)
    assert ev["pieces"].get("0", 0) <= 1  # the piece it sent may die with it in its socket
    assert sorted(ev["pieces"])[-2:] == ["1", "2"], ev["pieces"]
    assert sum(ev["pieces"].values()) == -(-ev["nbytes"] // (1 << 20))  # every piece came once
    assert 1 <= ev["refetched"] <= 4  # at most the window rank 0 owed
    _same_model(out, [1, 2])


def test_a_forged_piece_is_rejected_and_fetched_elsewhere() -> None:
    out = bench_peers.run(4, 2000, state_mb=STATE_MB, forge=True, port=free_port())
    ev = out.rejoined[3].events
    assert "seconds" in ev, (out.codes, ev)
    assert "1" not in ev["pieces"], ev["pieces"]
    _same_model(out, [0, 1, 2])
