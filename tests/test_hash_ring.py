"""The hash ring: balance, movement, spread, joins, determinism across processes, stability."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fttree import ConfigError
from fttree.data.hash_ring import (
    HashRing,
    drain,
    fill_up,
    item_positions,
    permute_index,
    rebalance,
)

N = 60_000  # MNIST's training set
SIZES = (7, 15, 31)
ROOT = Path(__file__).resolve().parents[1]


def _loads(owners: np.ndarray, ranks: tuple[int, ...]) -> np.ndarray:
    return np.bincount(np.searchsorted(ranks, owners), minlength=len(ranks))


@pytest.fixture(scope="module")
def placed() -> dict[int, tuple[HashRing, np.ndarray, np.ndarray]]:
    pos = item_positions(N, seed=0)
    out = {}
    for n in SIZES:
        ring = HashRing(range(n))
        out[n] = (ring, pos, ring.place(pos))
    return out


@pytest.mark.parametrize("n", SIZES)
def test_placement_is_balanced_within_one_item(placed, n: int) -> None:  # type: ignore[no-untyped-def]
    ring, _, owners = placed[n]
    loads = _loads(owners, ring.ranks)
    assert loads.sum() == N
    assert loads.max() <= math.ceil(N / n)  # the default load factor 1.0 is an exact cap
    assert loads.max() / (N / n) <= 1.05


def test_a_looser_cap_bounds_the_heaviest_rank() -> None:
    pos = item_positions(5000, seed=3)
    ring = HashRing(range(15), vnodes=50)  # few points: first choices are far from even
    plain = _loads(ring.owner(pos), ring.ranks)
    capped = _loads(ring.place(pos, load_factor=1.05), ring.ranks)
    assert plain.max() > math.ceil(1.05 * 5000 / 15)  # the cap has work to do
    assert capped.max() <= math.ceil(1.05 * 5000 / 15)


@pytest.mark.parametrize("n", SIZES)
def test_placement_without_a_rank_moves_little_more_than_its_items(placed, n: int) -> None:  # type: ignore[no-untyped-def]
    """Between epochs with different member sets the placement is recomputed: bounded loads
    cascade a little, but the moved fraction stays within 1.35x the ideal 1/n."""
    ring, pos, owners = placed[n]
    for gone in (0, n // 2, n - 1):
        smaller = HashRing([r for r in ring.ranks if r != gone]).place(pos)
        moved = np.count_nonzero(smaller != owners) / N
        assert np.all(smaller[owners == gone] != gone)
        assert moved <= 1.35 / n, (gone, moved * n)


@pytest.mark.parametrize("n", SIZES)
def test_a_departure_moves_only_the_departed_items_spread_over_all_survivors(placed, n: int) -> None:  # type: ignore[no-untyped-def]
    ring, pos, owners = placed[n]
    gone = n // 2
    survivors = HashRing([r for r in ring.ranks if r != gone])
    pool = owners == gone
    moves = rebalance(survivors, pos, owners, pool=pool, free=np.ones(N, dtype=bool))
    assert np.array_equal(moves.owners[~pool], owners[~pool])  # nothing else moves
    assert moves.moved == np.count_nonzero(pool) <= 1.05 * N / n
    assert set(moves.received) == set(survivors.ranks)  # spread: every survivor takes some
    loads = _loads(moves.owners, survivors.ranks)
    assert loads.max() - loads.min() <= 1
    before = _loads(owners[~pool], survivors.ranks)
    received = list(moves.received.values())
    assert max(received) - min(received) <= before.max() - before.min() + 1  # an even share each


@pytest.mark.parametrize("n", SIZES)
def test_a_join_moves_only_the_joiners_share(placed, n: int) -> None:  # type: ignore[no-untyped-def]
    ring, pos, owners = placed[n]
    bigger = HashRing([*ring.ranks, 1000])
    moves = rebalance(bigger, pos, owners, pool=np.zeros(N, dtype=bool), free=np.ones(N, dtype=bool),
                      joiners=[1000])
    changed = moves.owners != owners
    assert np.all(moves.owners[changed] == 1000)  # every move is the joiner's take
    assert moves.taken == {1000: np.count_nonzero(changed)}
    assert np.count_nonzero(changed) / N <= 1.35 / (n + 1)
    loads = _loads(moves.owners, bigger.ranks)
    assert loads.max() / (N / (n + 1)) <= 1.05
    assert loads.max() - loads.min() <= 1
    assert len(moves.given) >= n // 2  # the joiner's share comes from many members, not one


def test_joiners_take_only_free_items() -> None:
    pos = item_positions(3000, seed=1)
    ring = HashRing(range(5))
    owners = ring.place(pos)
    free = np.arange(3000) % 3 == 0  # a third of every queue may move
    moves = rebalance(HashRing([*range(5), 9]), pos, owners, pool=np.zeros(3000, dtype=bool), free=free,
                      joiners=[9])
    changed = moves.owners != owners
    assert changed.any()
    assert not np.any(changed & ~free)


def test_joiners_stop_where_free_items_run_out() -> None:
    owners = np.repeat(np.arange(3), 100)
    pos = item_positions(300, seed=2)
    free = np.zeros(300, dtype=bool)
    free[:10] = True  # only rank 0 has anything to give, and only 10 items
    moves = rebalance(HashRing([0, 1, 2, 7]), pos, owners, pool=np.zeros(300, dtype=bool), free=free, joiners=[7])
    assert moves.taken == {7: 10}
    assert moves.given == {0: 10}


def test_a_departure_and_a_join_together_move_only_the_departed_items() -> None:
    pos = item_positions(7000, seed=4)
    ring = HashRing(range(7))
    owners = ring.place(pos)
    after = HashRing([0, 1, 2, 4, 5, 6, 7])  # 3 leaves, 7 joins
    moves = rebalance(after, pos, owners, pool=owners == 3, free=np.ones(7000, dtype=bool), joiners=[7])
    assert moves.moved == np.count_nonzero(owners == 3)
    assert moves.given == {}
    assert np.array_equal(moves.owners[owners != 3], owners[owners != 3])
    assert abs(np.count_nonzero(moves.owners == 7) - 1000) <= 1


def test_a_restarted_rank_gets_most_of_its_items_back() -> None:
    pos = item_positions(N, seed=0)
    ring = HashRing(range(7))
    owners = ring.place(pos)
    ones = np.ones(N, dtype=bool)
    without = rebalance(HashRing([0, 1, 2, 4, 5, 6]), pos, owners, pool=owners == 3, free=ones).owners
    back = rebalance(ring, pos, without, pool=np.zeros(N, dtype=bool), free=ones, joiners=[3]).owners
    mine = owners == 3
    assert np.count_nonzero(back[mine] == 3) >= 0.9 * np.count_nonzero(mine)


def test_placement_depends_on_the_member_set_and_seed_only() -> None:
    pos = item_positions(2000, seed=5)
    assert np.array_equal(HashRing([4, 1, 9]).place(pos), HashRing([1, 9, 4]).place(pos))
    assert np.array_equal(item_positions(2000, seed=5), pos)
    assert not np.array_equal(item_positions(2000, seed=5, salt=1), pos)
    assert not np.array_equal(HashRing([1, 4, 9], seed=1).place(pos), HashRing([1, 4, 9]).place(pos))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 256, 1000, 4097])
def test_permute_index_is_a_permutation(n: int) -> None:
    out = permute_index(np.arange(n, dtype=np.int64), n, key=11)
    assert np.array_equal(np.sort(out), np.arange(n))
    assert np.array_equal(permute_index(np.arange(n, dtype=np.int64)[::-1], n, key=11), out[::-1])
    if n >= 256:
        assert not np.array_equal(out, permute_index(np.arange(n, dtype=np.int64), n, key=12))
        assert abs(np.corrcoef(np.arange(n), out)[0, 1]) < 0.2


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(0, 100))
@settings(max_examples=200, deadline=None)
def test_fill_up_adds_to_the_lowest(levels: list[int], amount: int) -> None:
    out = fill_up(levels, amount)
    assert sum(out) == sum(levels) + amount
    assert all(o >= lv for o, lv in zip(out, levels, strict=True))
    raised = [o for o, lv in zip(out, levels, strict=True) if o > lv]
    assert not raised or max(raised) <= min(out) + 1  # nobody raised above the lowest + 1


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=8), st.data())
@settings(max_examples=200, deadline=None)
def test_drain_takes_from_the_highest_within_their_free_units(pairs: list[tuple[int, int]],
                                                              data: st.DataObject) -> None:
    levels = [a + b for a, b in pairs]
    free = [b for _, b in pairs]
    amount = data.draw(st.integers(0, sum(free)))
    out = drain(levels, free, amount)
    assert sum(out) == sum(levels) - amount
    assert all(lv - f <= o <= lv for o, lv, f in zip(out, levels, free, strict=True))
    lowered = [o for o, lv in zip(out, levels, strict=True) if o < lv]
    can_still_give = [o for o, lv, f in zip(out, levels, free, strict=True) if o > lv - f]
    assert not lowered or not can_still_give or min(lowered) >= max(can_still_give) - 1


_DIGEST = """
import hashlib, numpy as np
from fttree.data.hash_ring import HashRing, item_positions, permute_index, rebalance
pos = item_positions(20000, seed=7, salt=3)
owners = HashRing(range(9), seed=7).place(pos)
moves = rebalance(HashRing([0, 1, 2, 3, 5, 6, 7, 8, 12], seed=7), pos, owners, pool=owners == 4,
                  free=np.ones(20000, dtype=bool), joiners=[12])
h = hashlib.blake2b(owners.tobytes() + moves.owners.tobytes()
                    + permute_index(np.arange(20000), 20000, 5).tobytes(), digest_size=16)
print(h.hexdigest())
"""


def test_every_process_computes_the_same_assignment() -> None:
    """Python's hash() is salted per process (PYTHONHASHSEED): the ring must not depend on it."""
    digests = set()
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, check=True,
                             timeout=60)
        digests.add(out.stdout.strip())
    here: dict[str, object] = {}
    exec(_DIGEST.replace("print(h.hexdigest())", "result = h.hexdigest()"), here)
    digests.add(str(here["result"]))
    assert len(digests) == 1


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: HashRing([]), "at least one rank"),
    (lambda: HashRing([1, 1]), "lists a rank twice"),
    (lambda: HashRing([-1]), "ranks >= 0"),
    (lambda: HashRing(["a"]), "integer ranks"),  # type: ignore[list-item]
    (lambda: HashRing([0], vnodes=0), "vnodes must be at least 1"),
    (lambda: HashRing([0]).place(item_positions(3, seed=0), load_factor=0.9), "load_factor"),
    (lambda: HashRing([0, 1]).fill(item_positions(3, seed=0), {0: 1, 1: 1}), "fewer than the 3 items"),
    (lambda: HashRing([0, 1]).fill(item_positions(1, seed=0), {5: 1}), "not on the ring"),
    (lambda: rebalance(HashRing([0, 1]), item_positions(2, seed=0), np.array([0, 3]),
                       pool=np.zeros(2, dtype=bool), free=np.ones(2, dtype=bool)), "not members"),
    (lambda: rebalance(HashRing([0, 1]), item_positions(2, seed=0), np.array([0, 1]),
                       pool=np.zeros(2, dtype=bool), free=np.ones(2, dtype=bool), joiners=[1]), "already hold"),
    (lambda: item_positions(-1, seed=0), "at least 0"),
])
def test_bad_input_is_named(call, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=needle):
        call()


def test_the_data_layer_imports_without_torch() -> None:
    """ring and sampler are pure numpy; the cache imports torch only where it stores samples."""
    code = ("import sys, fttree.data.hash_ring, fttree.data.sampler, fttree.data.cache; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'asyncio', 'socket'}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
