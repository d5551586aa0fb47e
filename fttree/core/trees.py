"""Which tree each chunk of a step runs on, and the slot order of each tree.

A tree is a binary heap over an ordering of the view's members (topology.py). One heap makes
its interior ranks send 3N bytes of an N-byte allreduce (their sum up, the result to two
children) while a ring rank sends 2N(p-1)/p; spreading a step's chunks over several heaps
spreads that load. `Config.trees` picks the family:

- "single": every chunk on tree 0, the heap over the slot order.
- "double": the double binary tree. Chunk c on tree c mod 2; tree 1 is the heap over the
  reversed order, whose interior ranks are leaves of tree 0, so every rank is interior in at
  most one tree and sends at most 2N: 1.17x the bound for 7 workers, 1.07x for 15.
- "rotated" (the default): p trees for p members, tree r the heap over the slot order rotated
  by r. Over the p trees every rank holds every heap position once, so with equal shares it
  sends (p-1) sums up and (p-1) results down: 2N(p-1)/p, the ring's bound, at the tree's
  logarithmic depth. Chunk c of n runs on tree floor(c * p / n), so chunks spread evenly over
  the rotations and, when n is no multiple of p, the trees that carry one chunk more are evenly
  spaced: the busiest rank stays within 5% of the bound for 15 or more chunks (1.02x for 7
  workers and 16 or 24 chunks, 1.04x for 15 workers and 16; tests/test_trees.py).

Where some ranks cannot be dialled (reach.py), the rotated trees rotate only the first
`rotating` slots of the view (its public ranks), and the double tree reverses only those,
leaving the rest in place: `rotating` rotated trees, each of the other ranks a leaf in all.
Every function takes `rotating` (None: every slot).

Every rule here depends only on the chunk, the step's chunk count and the view, so a frame that
comes before the local submit is checked against the same rule. A one-chunk step runs on tree
0 in every family: small tensors keep the single tree's fault costs.
"""

from __future__ import annotations

from ..errors import ConfigError

TREE_FAMILIES = ("single", "double", "rotated")


def check_family(family: object) -> str:
    if family not in TREE_FAMILIES:
        raise ConfigError(f"trees must be one of {', '.join(repr(f) for f in TREE_FAMILIES)}, got {family!r}")
    return str(family)


def tree_count(family: str, size: int, rotating: int | None = None) -> int:
    """How many trees the family builds over a view of `size` members."""
    if family == "single":
        return 1
    return 2 if family == "double" else _turn(size, rotating)


def _turn(size: int, rotating: int | None) -> int:
    """How many leading slots the rotated trees rotate."""
    return size if rotating is None else max(1, min(rotating, size))


def tree_of(family: str, chunk: int, chunks: int, size: int, rotating: int | None = None) -> int:
    """The tree chunk `chunk` of a step of `chunks` chunks runs on, in a view of `size`."""
    if chunks < 2 or size < 2 or family == "single":
        return 0
    if family == "double":
        return chunk % 2
    return (chunk * _turn(size, rotating)) // chunks


def check_tree(family: str, tree: int, size: int, rotating: int | None = None) -> None:
    count = tree_count(family, size, rotating)
    if not 0 <= tree < count:
        raise ConfigError(f"tree {tree} does not exist: trees={family!r} builds {count} over "
                          f"{size} workers (0..{count - 1})")


def base_slot(family: str, tree: int, slot: int, size: int, rotating: int | None = None) -> int:
    """The slot of the view (tree 0) that holds the member in slot `slot` of tree `tree`.

    Every tree is a permutation of the view's slots that takes O(1) to apply either way, so a
    rank's place in any tree is computed from its slot rather than stored: the p rotated trees
    cost nothing per tree (view.py)."""
    if tree == 0:
        return slot
    turn = _turn(size, rotating)
    if slot >= turn:
        return slot
    if family == "double":
        return turn - 1 - slot
    return (slot + tree) % turn


def tree_slot(family: str, tree: int, base: int, size: int, rotating: int | None = None) -> int:
    """The slot of tree `tree` that the member in slot `base` of the view (tree 0) holds."""
    if tree == 0:
        return base
    turn = _turn(size, rotating)
    if base >= turn:
        return base
    if family == "double":
        return turn - 1 - base
    return (base - tree) % turn


def base_spans(family: str, tree: int, span: range, size: int, rotating: int | None = None) -> tuple[range, ...]:
    """The view's slots of tree `tree`'s slots `span` (consecutive, inside 0..size-1), as at
    most two ranges: a subtree's levels (topology.subtree_spans) are read off the view's order
    in slices rather than slot by slot."""
    if tree == 0 or not span:
        return (span,)
    turn = _turn(size, rotating)
    fixed = (range(max(span.start, turn), span.stop),) if span.stop > turn else ()
    if span.start >= turn:
        return fixed
    if family == "double":
        return (range(turn - min(span.stop, turn), turn - span.start), *fixed)
    lo, hi = span.start + tree % turn, min(span.stop, turn) + tree % turn
    if lo >= turn:
        return (range(lo - turn, hi - turn), *fixed)
    if hi <= turn:
        return (range(lo, hi), *fixed)
    return (range(lo, turn), range(0, hi - turn), *fixed)


def tree_order(family: str, tree: int, members: tuple[int, ...], rotating: int | None = None) -> tuple[int, ...]:
    """The members in tree `tree`'s slot order (its heap's slot s holds the s-th of them)."""
    check_tree(family, tree, len(members), rotating)
    if tree == 0:
        return members
    turn = _turn(len(members), rotating)
    if family == "double":
        return tuple(reversed(members[:turn])) + members[turn:]
    return members[tree:turn] + members[:tree] + members[turn:]
