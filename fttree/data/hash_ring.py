"""Consistent hashing with virtual nodes and bounded loads, plus the fair, minimal moves that
follow a membership change. Pure: numpy and hashlib, no torch, no clock, no I/O.

Placement (a function of the member set alone, used at the start of an epoch):
- Every item and every virtual node gets a 64-bit position on a ring. Item positions come
  from `item_positions(n, seed=, salt=)`; a rank's `vnodes` points from (seed, rank). An
  item's *preference list* is the order in which distinct ranks appear clockwise from it, so
  its first choice is plain consistent hashing (FT-HVAC, seed 003) and its k-th choice is where
  it goes if the first k-1 are gone or full.
- Bounded loads: no rank holds more than ceil(load_factor * n / members). Items propose to
  their first choice; a full rank keeps the proposers nearest to it on the ring (the items of
  its own arcs) and the others try their next choice, round after round (`HashRing.place`).

Moves (a function of the current assignment, used when membership changes mid-epoch):
plain bounded-load hashing re-places everything and its overflow cascades move items of ranks
that did not leave. `rebalance` never re-places: it moves only the items that must move (the
departed ranks' items and any other "pool" items) and then only what joiners take:
1. the pool is water-filled over the new members, lightest first, so loads even out and a
   departed rank's items spread over all survivors, not onto one neighbour; each item goes to
   its most preferred rank that still has quota (`HashRing.fill`), so items follow the ring;
2. each joiner is water-filled up to the level of the heaviest members, taking only items
   those members mark as free (the sampler pins items that may already be prefetched), and
   first the items whose preference puts the joiner ahead of their owner (a restarted rank
   gets its own arcs back first).
A departure therefore moves exactly the departed ranks' items, and a join exactly the
joiner's share: the least possible.

Defaults, and why:
- `DEFAULT_VNODES = 1000` virtual nodes per rank: arc shares then vary by about
  1/sqrt(1000) = 3 %, so the load cap rarely binds and few items leave their first choice.
  FT-HVAC used 100 for spread alone; here spread comes from water-filling, and more points
  buy a placement that moves less when membership differs between epochs (with 100 points,
  31 ranks and an exact cap, removing a rank moved 1.5x the ideal 1/n of 60,000 items; with
  1000, 1.2x). 1000 points per rank cost one sorted array of 8 bytes per point.
- `DEFAULT_LOAD_FACTOR = 1.0`: the cap is ceil(items / members), so no rank holds more than
  one item above the average. A synchronous step waits for the heaviest worker, so every percent of slack is paid
  in every epoch, while the tighter cap costs only placement movement between epochs whose
  member sets differ (mid-epoch moves never use the cap).

Positions and keys come from blake2b and a splitmix64 finaliser over numpy uint64 arrays:
every process computes the same placement (Python's per-process `hash()` is never used).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError

DEFAULT_VNODES = 1000
DEFAULT_LOAD_FACTOR = 1.0

Positions = npt.NDArray[np.uint64]
Ranks = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]


def stable_key(*parts: object) -> int:
    """A 64-bit key that every process derives alike from `parts` (ints and strings)."""
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def mix64(x: npt.NDArray[np.uint64]) -> Positions:
    """splitmix64's finaliser, elementwise: a bijection that scatters consecutive keys."""
    return _mix64_inplace(x.astype(np.uint64, copy=True))


def _mix64_inplace(z: npt.NDArray[np.uint64]) -> Positions:
    z ^= z >> _S30  # array arithmetic wraps modulo 2^64 without warnings
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def _keyed(count: int, key: int) -> Positions:
    return mix64(np.arange(count, dtype=np.uint64) * _GOLDEN + np.uint64(key))


def item_positions(n_items: int, *, seed: int, salt: int | str = 0) -> Positions:
    """Ring positions of items 0..n_items-1. The same (seed, salt) gives the same positions
    in every process; a different salt (e.g. the epoch) gives an independent placement."""
    if n_items < 0:
        raise ConfigError(f"the number of items must be at least 0, got {n_items}")
    return _keyed(n_items, stable_key("items", seed, salt))


def permute_index(x: Ranks, n: int, key: int) -> Ranks:
    """A keyed pseudorandom permutation of range(n) applied to x (values in range(n)): a
    four-round Feistel network on the smallest even-bit domain holding n, walking cycles back
    into range. Vectorised, and only for the indices asked: no O(n) table per epoch."""
    if n <= 1:
        return x.astype(np.int64, copy=True)
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    rounds = _feistel_keys(key)
    y = x.astype(np.uint64, copy=True)
    todo = np.arange(len(y))
    while len(todo):
        y[todo] = _feistel(y[todo], rounds, half)
        todo = todo[y[todo] >= n]
    return y.astype(np.int64)


@lru_cache(maxsize=256)
def _feistel_keys(key: int) -> tuple[np.uint64, ...]:
    return tuple(np.uint64(stable_key("feistel", key, i)) for i in range(4))


def _feistel(y: npt.NDArray[np.uint64], rounds: Sequence[np.uint64], half: int) -> npt.NDArray[np.uint64]:
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = y >> shift, y & mask
    for k in rounds:
        f = _mix64_inplace(right ^ k)
        f &= mask
        f ^= left
        left, right = right, f
    return (left << shift) | right


@lru_cache(maxsize=1024)  # 8 KB each at 1000 points
def _vnode_points(seed: int, rank: int, vnodes: int) -> Positions:
    points = np.sort(_keyed(vnodes, stable_key("vnode", seed, rank)))
    points.flags.writeable = False
    return points


def check_ranks(ranks: Iterable[int], what: str = "members") -> tuple[int, ...]:
    """Sorted unique ranks, or a ConfigError naming the problem."""
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int | np.integer):
            raise ConfigError(f"{what} must be integer ranks, got {r!r}")
        if r < 0:
            raise ConfigError(f"{what} must be ranks >= 0, got {r}")
        out.append(int(r))
    if len(set(out)) != len(out):
        raise ConfigError(f"{what} lists a rank twice: {sorted(out)}")
    return tuple(sorted(out))


class HashRing:
    """The ring of `ranks`, each with `vnodes` points derived from (seed, rank). Immutable."""

    __slots__ = ("_owner_of_point", "_points", "ranks", "seed", "vnodes")

    def __init__(self, ranks: Iterable[int], *, seed: int = 0, vnodes: int = DEFAULT_VNODES) -> None:
        self.ranks = check_ranks(ranks)
        if not self.ranks:
            raise ConfigError("a hash ring needs at least one rank")
        if vnodes < 1:
            raise ConfigError(f"vnodes must be at least 1, got {vnodes}")
        self.seed, self.vnodes = seed, vnodes
        points = np.concatenate([_vnode_points(seed, r, vnodes) for r in self.ranks])
        owners = np.repeat(np.asarray(self.ranks, dtype=np.int64), vnodes)
        order = np.lexsort((owners, points))
        self._points: Positions = points[order]
        self._owner_of_point: Ranks = owners[order]

    def __repr__(self) -> str:
        return f"HashRing(ranks={self.ranks}, seed={self.seed}, vnodes={self.vnodes})"

    def owner(self, positions: Positions) -> Ranks:
        """Plain consistent hashing: the rank of the first point clockwise from each item."""
        at = np.searchsorted(self._points, positions) % len(self._points)
        return self._owner_of_point[at]

    def distance(self, positions: Positions, rank: int) -> Positions:
        """Clockwise distance from each item to `rank`'s nearest point (wrapping at 2^64).
        Smaller means more preferred: the order of these distances is the preference list."""
        points = _vnode_points(self.seed, rank, self.vnodes)
        at = np.searchsorted(points, positions) % len(points)
        return points[at] - positions

    def distances(self, positions: Positions, ranks: Sequence[int]) -> npt.NDArray[np.uint64]:
        """(items, ranks) matrix of `distance`."""
        out = np.empty((len(positions), len(ranks)), dtype=np.uint64)
        for j, r in enumerate(ranks):
            out[:, j] = self.distance(positions, r)
        return out

    def place(self, positions: Positions, *, load_factor: float = DEFAULT_LOAD_FACTOR) -> Ranks:
        """Bounded-load placement: each item at its most preferred rank with room, no rank
        above ceil(load_factor * items / ranks)."""
        if not load_factor >= 1.0:
            raise ConfigError(f"load_factor must be at least 1.0, got {load_factor}")
        n, ranks = len(positions), np.asarray(self.ranks, dtype=np.int64)
        cap = max(-(-n // len(ranks)), math.ceil(load_factor * n / len(ranks) - 1e-9))  # never below ceil(n/k)
        at = np.searchsorted(self._points, positions) % max(1, len(self._points))
        first = np.searchsorted(ranks, self._owner_of_point[at])
        dist = self._points[at] - positions
        room = np.full(len(ranks), cap, dtype=np.int64)
        accepted = _accept(first, dist, room)
        owners = np.full(n, -1, dtype=np.int64)
        owners[accepted] = ranks[first[accepted]]
        room -= np.bincount(first[accepted], minlength=len(ranks))
        rest = np.flatnonzero(owners < 0)
        if len(rest):
            quotas = {int(r): int(q) for r, q in zip(ranks, room, strict=True) if q > 0}
            owners[rest] = self.fill(positions[rest], quotas)
        return owners

    def fill(self, positions: Positions, quotas: Mapping[int, int]) -> Ranks:
        """Each item to its most preferred rank among `quotas` that has quota left; a rank
        keeps the proposers nearest to it. Needs sum(quotas) >= items."""
        cands = [r for r in sorted(quotas) if quotas[r] > 0]
        unknown = sorted(set(cands) - set(self.ranks))
        if unknown:
            raise ConfigError(f"quotas name ranks {unknown} that are not on the ring {self.ranks}")
        n = len(positions)
        if sum(quotas[r] for r in cands) < n:
            raise ConfigError(f"quotas {dict(quotas)} hold fewer than the {n} items to place")
        owners = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return owners
        dist = self.distances(positions, cands)
        pref = np.argsort(dist, axis=1, kind="stable")
        room = np.asarray([quotas[r] for r in cands], dtype=np.int64)
        left = np.arange(n, dtype=np.int64)
        for k in range(len(cands)):
            choice = pref[left, k]
            ok = _accept(choice, dist[left, choice], room)
            owners[left[ok]] = choice[ok]
            room -= np.bincount(choice[ok], minlength=len(cands))
            left = left[~ok]
            if not len(left):
                break
        return np.asarray(cands, dtype=np.int64)[owners]


def _accept(choice: Ranks, priority: Positions, room: Ranks) -> Mask:
    """One proposal round: every rank accepts its `room` proposers of lowest priority value
    (ties: earlier proposals first). Returns the mask of accepted proposals."""
    over = np.bincount(choice, minlength=len(room)) > room
    ok = ~over[choice]
    if ok.all():
        return ok
    contested = np.flatnonzero(~ok)
    order = contested[np.lexsort((priority[contested], choice[contested]))]
    by_choice = choice[order]
    starts = np.searchsorted(by_choice, np.arange(len(room)))
    ok[order] = np.arange(len(order)) - starts[by_choice] < room[by_choice]
    return ok


# ---- water-filling: how many items each rank gives or receives ------------------------------


def fill_up(levels: Sequence[int], amount: int) -> list[int]:
    """Add `amount` units to `levels`, always to the lowest (ties: earlier entries first)."""
    lv = np.asarray(levels, dtype=np.int64)
    if amount <= 0 or not len(lv):
        return [int(x) for x in lv]
    lo, hi = int(lv.min()), int(lv.max()) + amount
    while lo < hi:  # the highest level L with sum(max(0, L - lv)) <= amount
        mid = (lo + hi + 1) // 2
        if int(np.maximum(0, mid - lv).sum()) <= amount:
            lo = mid
        else:
            hi = mid - 1
    out = np.maximum(lv, lo)
    extra = amount - int((out - lv).sum())
    at_level = np.flatnonzero(out == lo)[:extra]
    out[at_level] += 1
    return [int(x) for x in out]


def drain(levels: Sequence[int], free: Sequence[int], amount: int) -> list[int]:
    """Take `amount` units from `levels`, always from the highest that still has some of its
    `free` units (ties: earlier entries first). Needs amount <= sum(free)."""
    lv, fr = np.asarray(levels, dtype=np.int64), np.asarray(free, dtype=np.int64)
    floor = lv - fr
    if amount <= 0 or not len(lv):
        return [int(x) for x in lv]
    lo, hi = int(floor.min()), int(lv.max())
    while lo < hi:  # the lowest level L with sum(clip(lv - L, 0, free)) <= amount
        mid = (lo + hi) // 2
        if int(np.clip(lv - mid, 0, fr).sum()) <= amount:
            hi = mid
        else:
            lo = mid + 1
    out = np.maximum(floor, np.minimum(lv, lo))
    extra = amount - int((lv - out).sum())
    can = np.flatnonzero((out == lo) & (floor < lo))[:extra]
    out[can] -= 1
    return [int(x) for x in out]


def _join_transfer(survivors: Sequence[int], free: Sequence[int], joiners: Sequence[int]) -> int:
    """How many units joiners take: as long as the heaviest member with free units holds at
    least two more than the lightest joiner (the greedy that ends balanced)."""
    total_free = int(sum(free))

    def worth(k: int) -> bool:  # is the k-th transfer (1-based) still worth making?
        have, got = drain(survivors, free, k - 1), fill_up(joiners, k - 1)
        movable = [h for h, s, f in zip(have, survivors, free, strict=True) if h > s - f]
        return bool(movable) and max(movable) > min(got) + 1

    lo, hi = 0, total_free
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if worth(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True, kw_only=True)
class Moves:
    """The outcome of `rebalance`: new owners and, per rank, what moved."""

    owners: Ranks
    received: dict[int, int]  # pool items each rank received
    given: dict[int, int]  # items each member handed to joiners
    taken: dict[int, int]  # items each joiner took from members

    @property
    def moved(self) -> int:
        return sum(self.received.values()) + sum(self.given.values())


def rebalance(ring: HashRing, positions: Positions, owners: Ranks, *, pool: Mask, free: Mask,
              joiners: Collection[int] = ()) -> Moves:
    """Move only what must move after a membership change. `ring.ranks` are the new members;
    `pool` marks items that must find a new owner (a departed rank's, a failed batch's);
    every other item stays with its owner in `owners` unless it is `free` and a joiner takes
    it. Joiners hold nothing yet. See the module docstring for the rules."""
    members, joined = ring.ranks, check_ranks(joiners, "joiners")
    _check_rebalance(members, joined, positions, owners, pool, free)
    stay = ~pool
    survivors = [r for r in members if r not in joined]
    index = {r: i for i, r in enumerate(members)}
    held = np.bincount(np.searchsorted(members, owners[stay]), minlength=len(members))
    new = owners.copy()
    # 1. the pool, lightest first
    after_pool = fill_up([int(held[index[r]]) for r in members], int(pool.sum()))
    received = {r: after_pool[i] - int(held[i]) for i, r in enumerate(members)}
    if pool.any():
        new[pool] = ring.fill(positions[pool], received)
    # 2. joiners take free items of the heaviest members
    given: dict[int, int] = {}
    taken: dict[int, int] = {}
    if joined and survivors:
        movable = free & stay
        have = [after_pool[index[r]] for r in survivors]
        spare = [int(np.count_nonzero(movable & (owners == r))) for r in survivors]
        got = [after_pool[index[j]] for j in joined]
        k = _join_transfer(have, spare, got)
        left = drain(have, spare, k)
        given = {r: h - a for r, h, a in zip(survivors, have, left, strict=True) if h > a}
        taken = {j: b - a for j, a, b in zip(joined, got, fill_up(got, k), strict=True) if b > a}
        gifts = _pick_gifts(ring, positions, owners, movable, given, joined)
        if len(gifts):
            new[gifts] = ring.fill(positions[gifts], taken)
    return Moves(owners=new, received={r: q for r, q in received.items() if q}, given=given, taken=taken)


def _check_rebalance(members: tuple[int, ...], joined: tuple[int, ...], positions: Positions, owners: Ranks,
                     pool: Mask, free: Mask) -> None:
    n = len(positions)
    if not (len(owners) == len(pool) == len(free) == n):
        raise ConfigError(f"positions, owners, pool and free differ in length: "
                          f"{n}, {len(owners)}, {len(pool)}, {len(free)}")
    outside = sorted(set(joined) - set(members))
    if outside:
        raise ConfigError(f"joiners {outside} are not on the ring {members}")
    owned = set(np.unique(owners[~pool]).tolist())
    strays = sorted(owned - set(members))
    if strays:
        raise ConfigError(f"items outside the pool belong to ranks {strays} that are not members {members}")
    if owned & set(joined):
        raise ConfigError(f"joiners {sorted(owned & set(joined))} already hold items outside the pool")


def _pick_gifts(ring: HashRing, positions: Positions, owners: Ranks, movable: Mask, given: Mapping[int, int],
                joiners: Sequence[int]) -> Ranks:
    """Indices of the items each giver hands over: first those for which a joiner comes
    before their owner on the ring, then the ones nearest a joiner."""
    picked = []
    for r, count in sorted(given.items()):
        cand = np.flatnonzero(movable & (owners == r))
        near = ring.distances(positions[cand], joiners).min(axis=1)
        behind = near >= ring.distance(positions[cand], r)
        picked.append(cand[np.lexsort((cand, near, behind))[:count]])
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)
