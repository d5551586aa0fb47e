"""Detection and agreement do not grow with the world (simulation, fttree.testing.scale), and a
worker's trees grow with the world, not with its square."""

from __future__ import annotations

from fttree.core.messages import Kind
from fttree.testing.scale import measure, tree_cost


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


def test_a_workers_rotated_trees_grow_about_linearly_with_the_world() -> None:
    """The p rotated trees were p views, each with its own member order and slot index: 3.3 MB
    per worker at 255 ranks, 16.1 MB at 511 (4.8x for twice the world), 70 MB at 1,023. A tree's
    view now shares the view's order; what is left per tree is the rank's place in it and its
    children's subtrees (p log p ranks over all the trees)."""
    small, large = tree_cost(255), tree_cost(511)
    assert large.bytes < 2.5 * small.bytes, (small, large)  # p^2 would be 4x
    assert large.bytes < 2_500 * large.world, large  # bytes per member: it was 32 KB
