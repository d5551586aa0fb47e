"""Detection and agreement do not grow with the world (simulation, fttree.testing.scale)."""

from __future__ import annotations

from fttree.core.messages import Kind
from fttree.testing.scale import measure


def test_a_crash_costs_each_rank_a_few_frames_whatever_the_world() -> None:
    """Agreement messages were relayed through the first member not suspected here, which
    after a crash was often the dead rank: every member's relay was refused, and each refusal
    became a suspicion sent to every member (62 SUSPECT frames per rank at 63 ranks)."""
    small, large = measure(15, "crash"), measure(63, "crash")
    for run in (small, large):
        assert run.by_kind.get(Kind.SUSPECT, 0) < 8, (run.world, run.by_kind)
        assert run.to_view_s < 1.0, run
    assert large.frames_per_rank < 1.5 * small.frames_per_rank, (small.frames_per_rank, large.frames_per_rank)


def test_a_hang_is_found_by_pings_within_two_node_deadlines() -> None:
    run = measure(63, "hang")
    assert run.to_view_s < 2.5, run
    assert run.frames_per_rank < 80, run.by_kind
