"""Membership as data: a view is an epoch and the ranks that fill the tree's slots.

The tree is a binary heap of *slots* (topology.py); `View.members[slot]` is the rank in that
slot, so a rank is no longer its heap position and the group can shrink or grow by installing a
new view. Op ids and wire headers carry the epoch: a message of another view never mixes into
this one. The first view of a job is `View.initial(world)`: epoch 0, rank r in slot r.

The view also carries the group's pace: the uplink speed (bytes per second) that decides how a
step is cut into chunks (Config.chunk_bytes_for), so every member cuts the same step the same
way. It starts at `Config.uplink_bytes_per_s` and follows the members' measured uplinks through
agreed view changes (joins.py, "Pace"). The same rounds record each member's own measured
uplink (`uplinks`), which the rotated trees' shares follow (shares.py): figures every member
holds alike, changed only with the view.

Large steps spread their chunks over several trees (trees.py): tree 0 is the heap over
`members`, the others heaps over other orders of the same members (`View.tree(t, family)`), in
the same epoch. A tree's order is a permutation of the view's slots that is O(1) to apply
(trees.base_slot), so a tree's view shares the member order and slot index of the view it came
from and computes a rank's slot, neighbours and subtree when asked: the default family's p
trees cost O(p) per worker, not p orders and p indexes of p members each (docs/scale.md).

Where some members cannot be dialled (behind NATs), the view holds each rank's reachability
(`reach`, from the peers file that every rank holds alike: reach.py) and places its members
so that the public ones take the interior; the rotated trees rotate those only (`rotating`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError
from . import topology as topo
from .reach import BALANCE_MAX_MEMBERS, EVERYONE, Reach, busiest
from .topology import Neighbours
from .trees import base_slot, base_spans, check_tree, tree_count, tree_order, tree_slot


@dataclass(frozen=True, slots=True, init=False, repr=False, eq=False, match_args=False)
class View:
    """`View(epoch, members, pace, uplinks)`; two views are equal when those four are."""

    __match_args__ = ("epoch", "members", "pace")

    epoch: int
    pace: int  # bytes per second the group's steps are cut into chunks for (0: Config.uplink_bytes_per_s)
    uplinks: tuple[int, ...]  # members' measured uplinks, bytes/s, in tree 0's slot order (0: not known; (): none)
    _order: tuple[int, ...]  # the view's members in slot order (tree 0's); a tree's view shares it
    _slot: dict[int, int]  # rank -> its slot in _order; shared the same way
    _family: str  # this view is the heap of tree _tree of _family over _order (tree 0: the view's own)
    _tree: int
    _neighbours: dict[int, Neighbours]  # View.neighbours of the ranks asked (a worker asks of a few per tree)
    _trees: dict[tuple[str, int], View] | None  # View.tree, kept by tree 0 only
    _plan: tuple[tuple[int, ...], ...] | None  # the rotated trees' orders where some cannot be dialled
    reach: Reach  # who can connect with whom; the members are placed by it (reach.py)
    rotating: int  # the leading slots the rotated trees rotate (the public members'; all without reach)

    def __init__(self, epoch: int, members: tuple[int, ...], pace: int = 0, uplinks: tuple[int, ...] = (),
                 reach: Reach = EVERYONE) -> None:
        if pace < 0:
            raise ConfigError(f"view {epoch} pace must not be negative, got {pace}")
        if not members:
            raise ConfigError(f"view {epoch} has no members")
        if len(set(members)) != len(members) or min(members) < 0:
            raise ConfigError(f"view {epoch} members {list(members)} must be distinct ranks >= 0")
        if uplinks and (len(uplinks) != len(members) or min(uplinks) < 0):
            raise ConfigError(f"view {epoch} uplinks {list(uplinks)} must be one rate >= 0 per member "
                              f"({len(members)})")
        if reach:  # the public members first (reach.py); the uplinks follow their members
            placed = reach.place(members)
            if uplinks:
                rate = dict(zip(members, uplinks, strict=True))
                uplinks = tuple(rate[r] for r in placed)
            members = placed
        object.__setattr__(self, "reach", reach)
        object.__setattr__(self, "rotating", reach.rotating(members))
        self._fill(epoch, pace, tuple(uplinks) if any(uplinks) else (), members,
                   {rank: slot for slot, rank in enumerate(members)}, "single", 0)

    def _fill(self, epoch: int, pace: int, uplinks: tuple[int, ...], order: tuple[int, ...], slot: dict[int, int],
              family: str, tree: int) -> None:
        base = tree == 0
        for name, value in (("epoch", epoch), ("pace", pace), ("uplinks", uplinks), ("_order", order), ("_slot", slot),
                            ("_family", family), ("_tree", tree), ("_neighbours", {}),
                            ("_trees", {} if base else None), ("_plan", None)):
            object.__setattr__(self, name, value)

    @property
    def members(self) -> tuple[int, ...]:
        """members[slot] = rank; slot 0 is the root. Computed for a tree other than 0 (O(p))."""
        return tree_order(self._family, self._tree, self._order, self.rotating)

    @classmethod
    def initial(cls, world: int, reach: Reach = EVERYONE) -> View:
        topo.check_rank(0, world)
        return cls(0, tuple(range(world)), reach=reach)

    def tree_count(self, family: str) -> int:
        """How many trees `family` builds over this view (trees.tree_count)."""
        return tree_count(family, self.size, self.turn(family))

    @property
    def size(self) -> int:
        return len(self._order)

    @property
    def root(self) -> int:
        return self._at(0)

    def _at(self, slot: int) -> int:
        """The rank in slot `slot` of this view's heap."""
        return self._order[base_slot(self._family, self._tree, slot, len(self._order), self.rotating)]

    def __contains__(self, rank: object) -> bool:
        return rank in self._slot

    def slot_of(self, rank: int) -> int:
        slot = self._slot.get(rank)
        if slot is None:
            raise ConfigError(f"rank {rank} is not a member of view {self.epoch} ({list(self.members)})")
        return tree_slot(self._family, self._tree, slot, len(self._order), self.rotating)

    def neighbours(self, rank: int) -> Neighbours:
        """Parent, children, brother, uncle and nephews of `rank`, as ranks, kept once asked: the
        protocol asks for the same few ranks' neighbours (its own, its children's, its parent's)
        at every frame of every step, and computing them each time cost 18% of a 1.63 MB step.
        A worker asks of a few ranks per tree, so what is kept stays O(p)."""
        found = self._neighbours.get(rank)
        if found is None:
            slots = topo.neighbours(self.slot_of(rank), self.size)
            at = self._at

            def one(slot: int | None) -> int | None:
                return None if slot is None else at(slot)

            found = Neighbours(
                rank=rank, world=self.size, parent=one(slots.parent), children=tuple(at(s) for s in slots.children),
                brother=one(slots.brother), uncle=one(slots.uncle), nephews=tuple(at(s) for s in slots.nephews),
                height=slots.height, depth=slots.depth)
            self._neighbours[rank] = found
        return found

    def tree(self, tree: int, family: str) -> View:
        """The view whose heap is tree `tree` of `family` (trees.py): this one for tree 0, the
        same members in that tree's order (same epoch) for the others. It shares this view's
        member order and slot index: O(1) memory, whatever the size."""
        if tree == 0:
            return self
        if self._trees is None:  # a tree of a tree: over this one's order, which is computed
            members = self.members
            uplinks = tuple(self.uplink_of(r) for r in members) if self.uplinks else ()
            return View(self.epoch, members, self.pace, uplinks, self.reach).tree(tree, family)
        found = self._trees.get((family, tree))
        if found is None:
            check_tree(family, tree, self.size, self.turn(family))
            found = object.__new__(View)
            if family == "rotated" and self.reach:
                self._arranged(found, tree)
            else:
                object.__setattr__(found, "reach", self.reach)
                object.__setattr__(found, "rotating", self.rotating)
                found._fill(self.epoch, self.pace, self.uplinks, self._order, self._slot, family, tree)
            self._trees[(family, tree)] = found
        return found

    def _rotation(self, tree: int) -> tuple[int, ...]:
        """Rotated tree `tree`'s order before reachability: the view's order rotated by `tree`,
        the public ranks' turns rotating too."""
        turn = self.rotating
        rotated = self._order[tree:] + self._order[:tree]
        public = [r for r in rotated if r in self._slot and self._slot[r] < turn]  # (the placed order's prefix)
        lead = [public[(i + tree) % turn] for i in range(turn)]
        swap = dict(zip(public, lead, strict=True))
        return tuple(swap.get(r, r) for r in rotated)

    def _each_arranged(self, tree: int) -> tuple[int, ...]:
        """Rotated tree `tree` arranged on its own: its rotation where every parent reaches its
        children (Reach.arrange), else the public prefix rotated. O(p)."""
        turn = self.rotating
        fallback = self._order[tree % turn:turn] + self._order[:tree % turn] + self._order[turn:]
        return self.reach.arrange(self._rotation(tree)) or fallback

    def _rotated_orders(self) -> tuple[tuple[int, ...], ...]:
        """Every rotated tree's order, kept: each arranged on its own, or all of them balanced
        together (Reach.balance) where that makes the busiest rank send less."""
        if self._plan is None:
            alone = (self._order, *(self._each_arranged(t) for t in range(1, self.size)))
            together = self.reach.balance((self._order, *(self._rotation(t) for t in range(1, self.size))))
            plan = together if together is not None and busiest(together) < busiest(alone) else alone
            object.__setattr__(self, "_plan", plan)
        assert self._plan is not None
        return self._plan

    def _arranged(self, found: View, tree: int) -> None:
        """Rotated tree `tree` where some members cannot be dialled: an order of its own (reach.py).
        Up to BALANCE_MAX_MEMBERS members, all trees are planned together once per view so that
        every rank sends alike as far as reachability allows (O(p^2) orders kept, O(p^3) work at
        worst); above it, each tree is arranged on its own when asked, O(p) each."""
        order = self._rotated_orders()[tree] if self.size <= BALANCE_MAX_MEMBERS else self._each_arranged(tree)
        uplinks = tuple(self.uplink_of(r) for r in order) if self.uplinks else ()
        object.__setattr__(found, "reach", self.reach)
        object.__setattr__(found, "rotating", len(order))
        found._fill(self.epoch, self.pace, uplinks, order, {r: s for s, r in enumerate(order)}, "single", 0)
        object.__setattr__(found, "_trees", None)  # (a tree of it is built over its members)

    def turn(self, family: str) -> int | None:
        """The leading slots `family`'s trees permute (trees.py's `rotating`): the public members'
        for the double tree; every slot for the rotated trees (where some members cannot be
        dialled, each arranges its own order instead: `tree`)."""
        return self.rotating if family == "double" else None

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
        return View(epoch, tuple(members), self.pace, tuple(self.uplink_of(r) for r in members) if self.uplinks else (),
                    self.reach)

    def uplink_of(self, rank: int) -> int:
        """`rank`'s measured uplink as the view holds it, bytes per second (0: not known)."""
        if not self.uplinks:
            return 0
        slot = self._slot.get(rank)
        return 0 if slot is None else self.uplinks[slot]

    def planned_uplink(self, rank: int) -> int:
        """What the shares plan `rank`'s uplink at (shares.py): its figure, else the fastest the
        view holds (its link never held back what it sent); 0 while the view holds none."""
        return self.uplink_of(rank) or max(self.uplinks, default=0)

    def subtree(self, rank: int) -> frozenset[int]:
        """Every rank in the subtree rooted at `rank`, itself included."""
        size, order = self.size, self._order
        return frozenset(r for span in topo.subtree_spans(self.slot_of(rank), size)
                         for part in base_spans(self._family, self._tree, span, size, self.rotating)
                         for r in order[part.start:part.stop])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, View):
            return NotImplemented
        return self.epoch == other.epoch and self.pace == other.pace and self.members == other.members \
            and self.uplinks == other.uplinks

    def __hash__(self) -> int:
        return hash((self.epoch, self.members, self.pace, self.uplinks))

    def __repr__(self) -> str:
        uplinks = f", uplinks={self.uplinks!r}" if self.uplinks else ""
        return f"View(epoch={self.epoch!r}, members={self.members!r}, pace={self.pace!r}{uplinks})"

    def __str__(self) -> str:
        return f"view {self.epoch} {list(self.members)}"
