"""Tree shape of the fault-tolerant tree: who is whose parent, child, brother and uncle.

Ranks are laid out as a binary heap rooted at rank 0, which works for any world size (not
only 2^k - 1). Primary links (parent/children) carry tensors; backup links (brother, uncle and
their mirror images, nephews) carry small metadata messages and relay data only on a fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True, slots=True, kw_only=True)
class Neighbours:
    """Everything one rank needs to know about the tree around it."""

    rank: int
    world: int
    parent: int | None
    children: tuple[int, ...]
    brother: int | None
    uncle: int | None
    nephews: tuple[int, ...]
    height: int  # 0 for leaves; the root has the largest height
    depth: int  # 0 for the root

    @property
    def primary(self) -> tuple[int, ...]:
        """Ranks this node exchanges tensors with on a fault-free step."""
        up = () if self.parent is None else (self.parent,)
        return up + self.children

    @property
    def backup(self) -> tuple[int, ...]:
        """Ranks this node exchanges metadata with (and relays data through on a fault)."""
        out = [r for r in (self.brother, self.uncle) if r is not None]
        return tuple(out) + self.nephews

    @property
    def all(self) -> tuple[int, ...]:
        return self.primary + self.backup


def check_rank(rank: int, world: int) -> None:
    if world < 1:
        raise ValueError(f"world size must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the world of {world} workers (0..{world - 1})")


def parent_of(rank: int) -> int | None:
    return None if rank == 0 else (rank - 1) // 2


def children_of(rank: int, world: int) -> tuple[int, ...]:
    return tuple(c for c in (2 * rank + 1, 2 * rank + 2) if c < world)


def brother_of(rank: int, world: int) -> int | None:
    if rank == 0:
        return None
    sib = rank + 1 if rank % 2 == 1 else rank - 1
    return sib if sib < world else None


def uncle_of(rank: int, world: int) -> int | None:
    parent = parent_of(rank)
    return None if parent is None else brother_of(parent, world)


def subtree_spans(rank: int, world: int) -> list[range]:
    """The subtree rooted at `rank`, one range per level: a heap's subtree holds consecutive
    ranks at each depth ((rank + 1) * 2^k - 1 to (rank + 2) * 2^k - 2, k levels down)."""
    out = []
    lo = hi = rank
    while lo < world:
        out.append(range(lo, min(hi + 1, world)))
        lo, hi = 2 * lo + 1, 2 * hi + 2
    return out


def subtree_of(rank: int, world: int) -> frozenset[int]:
    """All ranks in the subtree rooted at `rank` (itself included)."""
    return frozenset(r for span in subtree_spans(rank, world) for r in span)


def _height(rank: int, world: int) -> int:
    kids = children_of(rank, world)
    return 0 if not kids else 1 + max(_height(c, world) for c in kids)


def _depth(rank: int) -> int:
    d = 0
    while rank > 0:
        rank = (rank - 1) // 2
        d += 1
    return d


@cache
def neighbours(rank: int, world: int) -> Neighbours:
    check_rank(rank, world)
    brother = brother_of(rank, world)
    nephews = children_of(brother, world) if brother is not None else ()
    return Neighbours(
        rank=rank,
        world=world,
        parent=parent_of(rank),
        children=children_of(rank, world),
        brother=brother,
        uncle=uncle_of(rank, world),
        nephews=nephews,
        height=_height(rank, world),
        depth=_depth(rank),
    )


def tree_links(world: int) -> list[tuple[int, int]]:
    """Primary links as (child, parent) pairs."""
    return [(r, (r - 1) // 2) for r in range(1, world)]


def backup_links(world: int) -> list[tuple[int, int]]:
    """Backup links as sorted pairs, each once: brother-brother and nephew-uncle."""
    out: set[tuple[int, int]] = set()
    for r in range(world):
        n = neighbours(r, world)
        for other in (n.brother, n.uncle):
            if other is not None:
                out.add((min(r, other), max(r, other)))
    return sorted(out)


def render(world: int) -> str:
    """A text picture of the tree: one line per rank, indented by depth, with its backups."""
    lines = [f"fault-tolerant tree of {world} workers (primary: parent/children; backup: brother, uncle)"]

    def walk(rank: int, prefix: str, last: bool, top: bool) -> None:
        n = neighbours(rank, world)
        extra = []
        if n.brother is not None:
            extra.append(f"brother {n.brother}")
        if n.uncle is not None:
            extra.append(f"uncle {n.uncle}")
        label = f"rank {rank}" + (f"  [{', '.join(extra)}]" if extra else "")
        if top:
            lines.append(label)
            child_prefix = ""
        else:
            lines.append(prefix + ("└── " if last else "├── ") + label)
            child_prefix = prefix + ("    " if last else "│   ")
        for i, c in enumerate(n.children):
            walk(c, child_prefix, i == len(n.children) - 1, False)

    walk(0, "", True, True)
    return "\n".join(lines)
