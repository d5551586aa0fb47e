"""State from peers in real processes (fttree.tools.bench_peers): a restarted worker takes its
state from several donors; a donor SIGKILLed (by its own pid) mid-transfer costs it only the
pieces that donor still owed; a donor forging pieces is dropped and its pieces come from others.
Every worker ends with the same model, bit for bit."""

from __future__ import annotations

from fttree.tools import bench_peers

STATE_MB = 8.0  # about nine 1 MiB pieces beside the model's


def _same_model(out: bench_peers.Outcome, ranks: list[int]) -> None:
    finals = {r: out.members[r].events.get("model") for r in ranks}
    finals.update({r: s.events.get("model") for r, s in out.rejoined.items()})
    assert None not in finals.values(), finals
    assert len(set(finals.values())) == 1, finals


def test_a_restarted_worker_takes_its_state_from_its_donors() -> None:
    """Which donors share the pieces depends on which step each served at (only donors of the
    first manifest's step are used): the spread itself is tested in test_state_transfer."""
    out = bench_peers.run(4, 2000, state_mb=STATE_MB, port=34200)
    ev = out.rejoined[3].events
    assert "seconds" in ev, (out.codes, ev)
    assert set(ev["pieces"]) <= {"0", "1", "2"}, ev["pieces"]
    assert ev["refetched"] == 0
    assert ev["dropped"] == 0
    _same_model(out, [0, 1, 2])


def test_a_forged_piece_is_rejected_and_fetched_elsewhere() -> None:
    out = bench_peers.run(4, 2000, state_mb=STATE_MB, forge=True, port=34400)
    ev = out.rejoined[3].events
    assert "seconds" in ev, (out.codes, ev)
    assert "1" not in ev["pieces"], ev["pieces"]
    _same_model(out, [0, 1, 2])
