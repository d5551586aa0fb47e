"""Reachability: which ranks can connect, and where the trees put the ranks few can reach.

A rank is public (everybody can dial it), behind a site (its site-mates can dial it, the rest
only reach it on connections it dials out), or reachable by nobody (`-`: net/address.py). Two
ranks can connect when one can dial the other: any pair with a public rank, and the ranks of
one site; every other pair needs a relay (net/relay.py), which costs a second hop through a
public rank's uplink.

So the view places its members (View, `reach`): the public ranks first. In tree 0's heap the
first slots are the interior, so the public ranks take it as far as they go. The slots after
them form subtrees hanging off public parents: a subtree of two or more slots (where there are
too few public ranks for the interior) is filled by one site's ranks, who reach each other;
single leaves take the rest, site-mates side by side as brothers, the `-` ranks where their
parent is public (`_site_slots`). tests/test_nat_trees.py checks against every order of small
jobs that wherever an order with the public ranks first puts no unreachable pair on a primary
link, this one does not either.

The rotated trees (trees.py) spread the interior's sending over everybody: tree t is the heap
over the order rotated by t, so each rank is interior in some. Keeping the ranks behind NATs
leaves in every tree instead (rotating the public ones only) made the public ranks send up to
3N of an N-byte step instead of 2N(p-1)/p: 121 ms against 78 ms all-public for 7 ranks with 3
public (docs/nat.md). So each rotated tree keeps its rotation as far as reachability allows
(`arrange`): slot by slot, the first rank of the rotated order that can connect with the slot's
parent. A rank behind a site roots a tree with its site-mates and public ranks below it; a rank
nobody can dial is interior only where nothing else fits. Where that finds no order, the tree is
tree 0's placement with its public prefix rotated. Arranged each on its own, the trees still
gave the public ranks more than their share: with public 0, 1, 2 and sites {3, 4}, {5, 6} they
sent 16/7 chunks per chunk of the step against 12/7 all public, and behind 100 Mbit/s uplinks,
where the busiest uplink sets the step, the step took 1.34x the all-public one. So up to
BALANCE_MAX_MEMBERS members the view plans all its rotated trees together once (`balance`):
the same rotations, each tree's interior given to the ranks that have sent least in the trees
planned before it, kept where that makes the busiest rank send less (there: 12/7 for every
rank). Larger views arrange each tree when asked, O(p) each (O(p) in all without NATs); the
double tree reverses the public prefix only; the uplink shares (shares.py) are off where any
rank is behind a NAT.

Every rank derives the same placement from the same peers file and the same members, so no
message carries it; the view's members are agreed as always, and each rank places them alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PUBLIC = ""  # the class of a rank everybody can dial
NOBODY = "-"  # ... of a rank nobody can dial


@dataclass(frozen=True, slots=True)
class Reach:
    """Each rank's class: PUBLIC, NOBODY, or the name of its site. Ranks not listed (joiners
    whose address the peers file does not hold) count as public."""

    classes: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(cls, classes: Mapping[int, str]) -> Reach:
        return cls(tuple(sorted((r, c) for r, c in classes.items() if c != PUBLIC)))

    def __bool__(self) -> bool:
        """Does anyone need placing (is any rank not public)?"""
        return bool(self.classes)

    def class_of(self, rank: int) -> str:
        for r, c in self.classes:
            if r == rank:
                return c
        return PUBLIC

    def can_connect(self, a: int, b: int) -> bool:
        ca, cb = self.class_of(a), self.class_of(b)
        return ca == PUBLIC or cb == PUBLIC or (ca == cb != NOBODY)

    def place(self, members: Sequence[int]) -> tuple[int, ...]:
        """`members` in placement order (see the module's docstring and `_site_slots`). Within
        a class the order given is kept, so placing twice changes nothing, and every rank
        places the same members alike."""
        if not self:
            return tuple(members)
        queues: dict[str, list[int]] = {}
        for r in members:
            queues.setdefault(self.class_of(r), []).append(r)
        public = queues.pop(PUBLIC, [])
        counts = {c: len(q) for c, q in queues.items()}
        return (*public, *(queues[c].pop(0) for c in _site_slots(len(public), len(members), counts)))

    def arrange(self, order: Sequence[int]) -> tuple[int, ...] | None:
        """A heap order close to `order` in which every parent reaches its children: slot by
        slot, the first rank left in `order` that can connect with the slot's parent, and with
        its brother and uncle where one can (for a slot with children, a `-` rank only if
        nothing else can). So the ranks early in
        `order` still take the interior, as a rotated tree means them to. None where this
        finds no rank for some slot."""
        left = list(order)
        out: list[int] = []
        size = len(left)
        kind = {r: self.class_of(r) for r in order}  # (class_of scans the classes: once per rank)
        for slot in range(size):
            parent = out[(slot - 1) // 2] if slot else None
            fits = [r for r in left if parent is None or _reaches(kind, r, parent)]
            if 2 * slot + 1 < size:
                fits = [r for r in fits if kind[r] != NOBODY] or fits
            backups = [out[s] for s in _backup_slots(slot)]  # brother and uncle, placed already
            fits = [r for r in fits if all(_reaches(kind, r, b) for b in backups)] or fits
            if not fits:
                return None
            out.append(fits[0])
            left.remove(fits[0])
        return tuple(out)

    def balance(self, orders: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...] | None:
        """The rotated trees again, arranged so that every rank sends alike: `orders[t]` is tree
        t's order as rotated (tree 0 is kept). Each tree is arranged in turn, those whose root is
        not public first (their interior must be its site-mates or public ranks), then the rest;
        in each, the interior slots go to the ranks that have sent least in the trees arranged so
        far, each leaf to the rank with the fewest places left (not public first), the parent
        always reaching its child (a search, `_fill_heap`). None where a tree has no such order
        within the search's budget. With public 0, 1, 2 and sites {3, 4}, {5, 6} every rank
        then sends 12/7 chunks per chunk of the step, as with all public, where `arrange`'s
        trees made the public ranks send 16/7 (docs/nat.md)."""
        size = len(orders[0])
        sent = dict.fromkeys(orders[0], 0)
        out: dict[int, tuple[int, ...]] = {0: tuple(orders[0])}
        for slot, rank in enumerate(orders[0]):
            sent[rank] += slot_sends(slot, size)
        for t in sorted(range(1, len(orders)), key=lambda t: (self.class_of(orders[t][0]) == PUBLIC, t)):
            tree = self._fill_heap(orders[t], sent)
            if tree is None:
                return None
            for slot, rank in enumerate(tree):
                sent[rank] += slot_sends(slot, size)
            out[t] = tree
        return tuple(out[t] for t in range(len(orders)))

    def _fill_heap(self, order: Sequence[int], sent: Mapping[int, int]) -> tuple[int, ...] | None:
        """A heap order of `order`'s ranks, `order[0]` its root, in which every parent reaches
        its children: a depth-first search, slot by slot, trying for an interior slot the ranks
        that sent least so far (a `-` rank last), for a leaf those whose brother and uncle reach
        them, not public first (a public rank fits under any parent, so it is kept for the
        slots only it fits); then the order given. Gives up after BALANCE_BUDGET * p tries."""
        size = len(order)
        position = {r: i for i, r in enumerate(order)}
        kind = {r: self.class_of(r) for r in order}  # (class_of scans the classes: once per rank)

        def reaches(a: int, b: int) -> bool:
            return _reaches(kind, a, b)

        out: list[int] = [order[0]]
        left = set(order[1:])
        budget = BALANCE_BUDGET * size

        def preference(slot: int, rank: int) -> tuple[int, ...]:
            apart = sum(not reaches(rank, out[s]) for s in _backup_slots(slot))
            if 2 * slot + 1 < size:
                return (kind[rank] == NOBODY, sent[rank], apart, position[rank])
            return (apart, kind[rank] == PUBLIC, position[rank])

        def fill(slot: int) -> bool:
            nonlocal budget
            if slot == size:
                return True
            budget -= 1
            if budget < 0:
                return False
            parent = out[(slot - 1) // 2]
            for rank in sorted((r for r in left if reaches(r, parent)), key=lambda r: preference(slot, r)):
                out.append(rank)
                left.discard(rank)
                if fill(slot + 1):
                    return True
                out.pop()
                left.add(rank)
                if budget < 0:
                    return False
            return False

        return tuple(out) if fill(1) else None

    def rotating(self, placed: Sequence[int]) -> int:
        """How many leading slots of a placed order the rotated trees rotate: the public ranks'
        (every slot where everybody is public; at least one)."""
        if not self:
            return len(placed)
        return max(1, sum(1 for r in placed if self.class_of(r) == PUBLIC))


EVERYONE = Reach()  # every rank public: no placing, every slot rotates
BALANCE_BUDGET = 20  # Reach._fill_heap's search tries at most this many times p slots
BALANCE_MAX_MEMBERS = 64  # larger views keep `arrange`'s trees: balancing all is O(p^3 log p)


def slot_sends(slot: int, size: int) -> int:
    """Chunks the rank in heap slot `slot` of `size` sends per chunk of its tree: one up (not
    the root) and one to each child."""
    return (slot > 0) + sum(1 for child in (2 * slot + 1, 2 * slot + 2) if child < size)


def busiest(orders: Sequence[Sequence[int]]) -> int:
    """The most chunks any rank sends over these trees, one chunk on each."""
    sent: dict[int, int] = {}
    for order in orders:
        for slot, rank in enumerate(order):
            sent[rank] = sent.get(rank, 0) + slot_sends(slot, len(order))
    return max(sent.values(), default=0)


def _reaches(kind: Mapping[int, str], a: int, b: int) -> bool:
    """Reach.can_connect over a map of the ranks' classes."""
    ca, cb = kind[a], kind[b]
    return ca == PUBLIC or cb == PUBLIC or (ca == cb != NOBODY)


def _backup_slots(slot: int) -> list[int]:
    """The slots before `slot` that back it up: its left brother, and its uncle."""
    out = [slot - 1] if slot and slot % 2 == 0 else []
    parent = (slot - 1) // 2 if slot else 0
    if parent:
        out.append(parent + 1 if parent % 2 == 1 else parent - 1)
    return [s for s in out if s < slot]


def _site_slots(first: int, size: int, counts: Mapping[str, int]) -> list[str]:
    """The class of each heap slot from `first` (the slots before hold the public ranks) to
    `size`. The slots after the public ones form subtrees, each hanging off a public parent;
    a subtree of two or more slots is all of one site where a site has ranks enough (its ranks
    reach each other), the largest subtree first, each taking the site that fits it most
    tightly; single slots (leaves under a public parent) take the rest, a site's rank beside
    its site-mate where one is left (brothers reach each other), the `-` ranks last."""
    left = dict(counts)
    groups: dict[int, list[int]] = {}
    for slot in range(first, size):
        root = slot
        while root and (root - 1) // 2 >= first:
            root = (root - 1) // 2
        groups.setdefault(root, []).append(slot)
    out: dict[int, str] = {}
    sites = sorted(c for c in left if c != NOBODY)
    for _root, slots in sorted(groups.items(), key=lambda g: (-len(g[1]), g[0])):
        if len(slots) < 2:
            continue
        fits = [c for c in sites if left[c] >= len(slots)]
        if not fits:
            continue
        site = min(fits, key=lambda c: (left[c], c))
        left[site] -= len(slots)
        out.update(dict.fromkeys(slots, site))
    for slot in range(first, size):  # singles, and subtrees no site could fill alone
        if slot in out:
            continue
        near = [out.get(s) for s in ((slot - 1) // 2, slot - 1 if slot % 2 == 0 else -1)]
        mate = next((c for c in near if c is not None and c != NOBODY and left.get(c)), None)
        spare = [c for c in sites if left[c]]
        pick = mate or (max(spare, key=lambda c: left[c]) if spare else NOBODY)  # (ties: the first by name)
        left[pick] -= 1
        out[slot] = pick
    return [out[slot] for slot in range(first, size)]
