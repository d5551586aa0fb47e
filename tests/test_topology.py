"""Tree shape for any world size: heap order, brothers, uncles, and symmetry of backup links."""

import pytest

from fttree.core import topology as topo


def test_seven_worker_tree_matches_thesis_figure() -> None:
    n = topo.neighbours(3, 7)
    assert (n.parent, n.children, n.brother, n.uncle) == (1, (), 4, 2)
    root = topo.neighbours(0, 7)
    assert (root.parent, root.children, root.brother, root.uncle) == (None, (1, 2), None, None)
    assert topo.neighbours(2, 7).nephews == (3, 4)
    assert root.height == 2
    assert n.depth == 2


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 10, 15, 16, 31, 33])
def test_every_world_size_is_a_consistent_tree(world: int) -> None:
    seen_children = []
    for r in range(world):
        n = topo.neighbours(r, world)
        for c in n.children:
            assert topo.neighbours(c, world).parent == r
        seen_children.extend(n.children)
        if n.brother is not None:
            assert topo.neighbours(n.brother, world).brother == r
            assert topo.neighbours(n.brother, world).parent == n.parent
        if n.uncle is not None:
            assert r in topo.neighbours(n.uncle, world).nephews
            assert n.uncle == topo.neighbours(n.parent, world).brother  # type: ignore[arg-type]
        assert r not in n.all
        assert len(set(n.all)) == len(n.all)
    assert sorted(seen_children) == list(range(1, world))  # every non-root rank has exactly one parent
    assert len(topo.tree_links(world)) == world - 1


def test_odd_sizes_have_missing_brothers_and_uncles() -> None:
    n = topo.neighbours(1, 2)
    assert (n.brother, n.uncle) == (None, None)  # world 2: the only link has no backup
    last = topo.neighbours(9, 10)  # parent 4, whose brother is 3
    assert (last.parent, last.brother, last.uncle) == (4, None, 3)


def test_subtree_and_backup_links() -> None:
    assert topo.subtree_of(1, 7) == {1, 3, 4}
    assert topo.backup_links(7) == [(1, 2), (1, 5), (1, 6), (2, 3), (2, 4), (3, 4), (5, 6)]


@pytest.mark.parametrize(("rank", "world"), [(-1, 4), (4, 4), (0, 0)])
def test_bad_rank_is_named(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"rank|world"):
        topo.neighbours(rank, world)


def test_render_shows_every_rank_with_backups() -> None:
    text = topo.render(7)
    for r in range(7):
        assert f"rank {r}" in text
    assert "rank 3  [brother 4, uncle 2]" in text


@pytest.mark.parametrize("world", [*range(1, 34), 64, 100, 127, 128])
def test_a_subtree_is_one_run_of_consecutive_ranks_per_level(world: int) -> None:
    for rank in range(world):
        below, stack = set(), [rank]  # the walk down, child by child
        while stack:
            r = stack.pop()
            below.add(r)
            stack.extend(topo.children_of(r, world))
        spans = topo.subtree_spans(rank, world)
        assert [r for span in spans for r in span] == sorted(below)
        assert [topo.neighbours(span[0], world).depth for span in spans] == list(
            range(topo.neighbours(rank, world).depth, topo.neighbours(rank, world).depth + len(spans)))
        assert topo.subtree_of(rank, world) == below
