"""Membership as data: a view is an epoch and the ranks that fill the tree's slots.

The tree is a binary heap of *slots* (topology.py); `View.members[slot]` is the rank in that
slot, so a rank is no longer its heap position and the group can shrink or grow by installing a
new view. Op ids and wire headers carry the epoch: a message of another view never mixes into
this one. The first view of a job is `View.initial(world)`: epoch 0, rank r in slot r.

The view also carries the group's pace: the uplink speed (bytes per second) that decides how a
step is cut into chunks (Config.chunk_bytes_for), so every member cuts the same step the same
way. It starts at `Config.uplink_bytes_per_s` and follows the members' measured uplinks through
agreed view changes (membership.py, "Pace").

Large steps spread their chunks over several trees (trees.py): tree 0 is the heap over
`members`, the others heaps over other orders of the same members (`View.tree(t, family)`), in
the same epoch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import ConfigError
from . import topology as topo
from .topology import Neighbours
from .trees import tree_order


@dataclass(frozen=True, slots=True)
class View:
    epoch: int
    members: tuple[int, ...]  # members[slot] = rank; slot 0 is the root
    pace: int = 0  # bytes per second the group's steps are cut into chunks for (0: Config.uplink_bytes_per_s)
    _slot: dict[int, int] = field(init=False, repr=False, compare=False)
    _neighbours: dict[int, Neighbours] = field(init=False, repr=False, compare=False)
    _trees: dict[tuple[str, int], View] = field(init=False, repr=False, compare=False)  # View.tree, built once

    def __post_init__(self) -> None:
        if self.pace < 0:
            raise ConfigError(f"view {self.epoch} pace must not be negative, got {self.pace}")
        if not self.members:
            raise ConfigError(f"view {self.epoch} has no members")
        if len(set(self.members)) != len(self.members) or min(self.members) < 0:
            raise ConfigError(f"view {self.epoch} members {list(self.members)} must be distinct ranks >= 0")
        object.__setattr__(self, "_slot", {rank: slot for slot, rank in enumerate(self.members)})
        object.__setattr__(self, "_neighbours", {})
        object.__setattr__(self, "_trees", {})

    @classmethod
    def initial(cls, world: int) -> View:
        topo.check_rank(0, world)
        return cls(0, tuple(range(world)))

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def root(self) -> int:
        return self.members[0]

    def __contains__(self, rank: object) -> bool:
        return rank in self._slot

    def slot_of(self, rank: int) -> int:
        slot = self._slot.get(rank)
        if slot is None:
            raise ConfigError(f"rank {rank} is not a member of view {self.epoch} ({list(self.members)})")
        return slot

    def neighbours(self, rank: int) -> Neighbours:
        """Parent, children, brother, uncle and nephews of `rank`, as ranks."""
        found = self._neighbours.get(rank)
        if found is None:
            slots = topo.neighbours(self.slot_of(rank), self.size)
            at = self.members

            def one(slot: int | None) -> int | None:
                return None if slot is None else at[slot]

            found = self._neighbours[rank] = Neighbours(
                rank=rank, world=self.size, parent=one(slots.parent), children=tuple(at[s] for s in slots.children),
                brother=one(slots.brother), uncle=one(slots.uncle), nephews=tuple(at[s] for s in slots.nephews),
                height=slots.height, depth=slots.depth)
        return found

    def tree(self, tree: int, family: str) -> View:
        """The view whose heap is tree `tree` of `family` (trees.py): this one for tree 0, the
        same members in that tree's order (same epoch) for the others."""
        if tree == 0:
            return self
        found = self._trees.get((family, tree))
        if found is None:
            found = self._trees[(family, tree)] = View(self.epoch, tree_order(family, tree, self.members), self.pace)
        return found

    def without(self, dead: Iterable[int], epoch: int) -> View:
        """The next view: `dead` removed, each hole filled by the member in the last slot (a heap
        deletion), so only the links around the holes and of the moved members change."""
        gone = set(dead)
        members = list(self.members)
        slot = 0
        while slot < len(members):
            if members[slot] in gone:
                last = members.pop()
                if slot < len(members):
                    members[slot] = last
                continue  # the member moved here may be gone too
            slot += 1
        return View(epoch, tuple(members), self.pace)

    def subtree(self, rank: int) -> frozenset[int]:
        """Every rank in the subtree rooted at `rank`, itself included."""
        return frozenset(self.members[s] for s in topo.subtree_of(self.slot_of(rank), self.size))

    def __str__(self) -> str:
        return f"view {self.epoch} {list(self.members)}"
