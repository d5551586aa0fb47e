"""Shares that follow the uplinks: how many of a step's chunks each rotated tree carries when the
members' uplinks differ, and the least busiest-rank time any allreduce could reach.

In a heap a leaf sends a chunk once (its sum up), an interior rank 1 + its children's count
(its sum up, the result down) and the root its children's count. With equal shares over the p
rotated trees every rank holds every heap position once (trees.py), so a rank at 10 Mbit/s among
ranks at 100 Mbit/s is interior in about half the trees and sends like the others: its uplink
sets the step. Here each chunk goes, in turn, to the tree that keeps the busiest rank's time
(bytes sent / its uplink) lowest: slow ranks end up leaves of the trees that carry the step,
and the fast ranks share the interior work.

Every member computes the same plan from the same inputs (the view's members, the rates, the
chunk count), with integer chunk counts, so no message is needed to agree on it. The rates are
the declared ones (Config.uplinks_by_rank, the same on every worker) or else the measured ones
the view carries (View.uplinks: agreed in the membership's pace rounds, so they change only
with the view). A member without a figure is planned at the fastest figure: its link never held
back what it sent (a slow link fills its budget and is measured within a step; a fast one
sending little may never be). Measured rates count only when they differ by UNEVEN or more, and
are rounded to a grid of GRID steps per doubling: a few per cent of noise between equal links
keeps the even spread, and the plan the same from one round to the next.

The bound: every rank sends at least N bytes (its contribution, or the result it roots; nothing
smaller carries an N-value input), and all ranks together at least 2(p-1)N (each byte of the
result is reduced over p-1 edges and broadcast over p-1), so no allreduce of N bytes finishes
before max(N / slowest uplink, 2(p-1)N / sum of uplinks).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from . import topology as topo

UNEVEN = 2.0  # measured uplinks this far apart or more get planned shares; closer ones, even shares
GRID = 4  # measured rates are rounded to 2 ** (k / GRID) bytes per second before planning
LEXI_TOP = 4  # the plan compares trees by their members' few largest times (all would cost p log p a chunk)


def heap_sends(size: int) -> np.ndarray:
    """Chunks sent per chunk of the step by the rank in each heap slot: its sum up (not the
    root), then the result to each child."""
    return np.array([(0 if slot == 0 else 1) + len(topo.children_of(slot, size)) for slot in range(size)],
                    dtype=np.float64)


def rotated_loads(rates: Sequence[float]) -> np.ndarray:
    """loads[slot, t]: seconds per chunk byte the member in view slot `slot` spends sending in
    rotated tree t (tree t is the heap over the slot order rotated by t: view slot s holds heap
    slot (s - t) mod p)."""
    p = len(rates)
    sends = heap_sends(p)
    heap_slot = (np.arange(p)[:, None] - np.arange(p)[None, :]) % p
    loads: np.ndarray = sends[heap_slot] / np.asarray(rates, dtype=np.float64)[:, None]
    return loads


@lru_cache(maxsize=64)
def plan(rates: tuple[float, ...], chunks: int) -> tuple[int, ...]:
    """Chunks per rotated tree for a step of `chunks` chunks over members with these uplinks
    (slot order): each chunk, in turn, to the tree that leaves the busiest member's sending
    time lowest, then the next busiest (ties: the lower tree). For unequal rates only: equal
    ones keep trees.tree_of's even spread."""
    p = len(rates)
    loads = rotated_loads(rates)
    busy = np.zeros(p)
    counts = [0] * p
    top = min(p, LEXI_TOP)
    for _ in range(chunks):
        after = busy[:, None] + loads  # after[slot, t]: each member's time if this chunk went to tree t
        # the busiest times, largest first, per tree: the smallest wins, then the next ones decide
        worst = -np.sort(np.partition(-after, top - 1, axis=0)[:top], axis=0)
        best = int(np.lexsort((np.arange(p), *worst[::-1]))[0])
        counts[best] += 1
        busy += loads[:, best]
    return tuple(counts)


def uniform(rates: Sequence[float]) -> bool:
    return min(rates) == max(rates)


def measured_rates(rates: Sequence[int]) -> tuple[float, ...] | None:
    """The rates to plan shares on from the members' planned uplinks (slot order,
    View.planned_uplink), rounded to the grid; None for even shares: nothing measured, or all
    within a factor UNEVEN."""
    if not rates or min(rates) <= 0:
        return None
    if max(rates) < UNEVEN * min(rates):
        return None
    return tuple(float(2.0 ** (round(np.log2(rate) * GRID) / GRID)) for rate in rates)


def tree_of_planned(counts: Sequence[int], chunk: int) -> int:
    """The tree of chunk `chunk` when tree t carries counts[t] consecutive chunks."""
    end = 0
    for tree, count in enumerate(counts):
        end += count
        if chunk < end:
            return tree
    raise ValueError(f"chunk {chunk} is beyond the plan's {end} chunks")


def busiest_seconds(rates: Sequence[float], counts: Sequence[int], chunk_bytes: float) -> float:
    """The busiest member's sending time for a plan, chunks of `chunk_bytes`."""
    loads = rotated_loads(rates)
    return float((loads @ np.asarray(counts, dtype=np.float64)).max() * chunk_bytes)


def bound_seconds(nbytes: float, rates: Sequence[float]) -> float:
    """The least busiest-rank time of any allreduce of `nbytes` over uplinks `rates` (bytes/s)."""
    p = len(rates)
    if p < 2:
        return 0.0
    return max(nbytes / min(rates), 2 * (p - 1) * nbytes / sum(rates))
