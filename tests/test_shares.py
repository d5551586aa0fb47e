"""Shares that follow the uplinks (core/shares.py): a slow rank becomes a leaf of the trees that
carry a step, the busiest rank's time meets the bound, equal uplinks keep the even spread, and
sums stay exact with every member planning alike."""

from __future__ import annotations

import numpy as np
import pytest

from fttree.core.config import Config
from fttree.core.protocol import TreeMachine
from fttree.core.shares import bound_seconds, busiest_seconds, plan, rotated_loads
from fttree.core.trees import tree_of
from fttree.core.view import View
from fttree.errors import ConfigError
from fttree.testing.simulate import counted, simulate

FAST, SLOW = 12.5e6, 1.25e6  # 100 and 10 Mbit/s


def one_slow(world: int, slow: int = 3) -> tuple[float, ...]:
    return tuple(SLOW if r == slow else FAST for r in range(world))


@pytest.mark.parametrize(("world", "chunks"), [(7, 16), (7, 48), (15, 16), (15, 48)])
def test_one_slow_rank_becomes_a_leaf_and_the_step_meets_the_bound(world: int, chunks: int) -> None:
    rates = one_slow(world)
    counts = plan(rates, chunks)
    assert sum(counts) == chunks
    sends = rotated_loads(rates) * np.asarray(rates)[:, None]  # chunks sent per chunk, per member and tree
    assert all(sends[3, t] == 1 for t, n in enumerate(counts) if n), "the slow rank is interior in a used tree"
    nbytes = 16e6
    achieved = busiest_seconds(rates, counts, nbytes / chunks)
    assert achieved == pytest.approx(bound_seconds(nbytes, rates), rel=1e-9)
    assert bound_seconds(nbytes, rates) == pytest.approx(nbytes / SLOW)
    even = busiest_seconds(rates, [chunks // world + (t < chunks % world) for t in range(world)], nbytes / chunks)
    assert even > 1.7 * achieved  # what the even spread costs: the slow rank is interior in some trees


def test_two_slow_ranks_and_a_middle_one_stay_near_the_bound() -> None:
    rates = (FAST, SLOW, FAST, 6.25e6, FAST, SLOW, FAST)
    counts = plan(rates, 48)
    ratio = busiest_seconds(rates, counts, 1e6 / 48) / bound_seconds(1e6, rates)
    assert 1.0 - 1e-9 <= ratio < 1.15, counts


def test_the_bound_of_equal_uplinks_is_the_rings() -> None:
    assert bound_seconds(7e6, (FAST,) * 7) == pytest.approx(2 * 7e6 * 6 / 7 / FAST)
    assert bound_seconds(5.0, (FAST,)) == 0.0


def test_equal_uplinks_keep_the_even_spread_and_unequal_ones_follow_the_plan() -> None:
    view = View(0, tuple(range(7)))
    even = TreeMachine(0, view, Config())
    same = TreeMachine(0, view, Config(uplinks_by_rank={3: Config().uplink_bytes_per_s}))
    for machine in (even, same):
        assert [machine.tree_of(c, 24) for c in range(24)] == [tree_of("rotated", c, 24, 7) for c in range(24)]
    slow = TreeMachine(0, view, Config(uplink_bytes_per_s=FAST, uplinks_by_rank={3: SLOW}))
    trees = [slow.tree_of(c, 24) for c in range(24)]
    counts = plan(one_slow(7), 24)
    assert [trees.count(t) for t in range(7)] == list(counts)
    assert trees == sorted(trees)  # each tree's chunks consecutive
    assert slow.tree_of(0, 1) == 0  # a one-chunk step stays on tree 0
    double = TreeMachine(0, view, Config(trees="double", uplink_bytes_per_s=FAST, uplinks_by_rank={3: SLOW}))
    assert [double.tree_of(c, 8) for c in range(8)] == [c % 2 for c in range(8)]


def test_the_setting_reads_a_mapping_pairs_or_text_and_names_bad_input() -> None:
    assert Config(uplinks_by_rank={5: 2e6, 3: 1.25e6}).uplinks_by_rank == ((3, 1.25e6), (5, 2e6))
    assert Config.parse("uplinks_by_rank", " 3=1.25e6, 5=2e6 ") == ((3, 1.25e6), (5, 2e6))
    assert Config.from_env({"FTTREE_UPLINKS_BY_RANK": "2=1e6"}) == {"uplinks_by_rank": ((2, 1e6),)}
    assert Config(uplinks_by_rank={3: SLOW}).uplink_of(3) == SLOW
    assert Config(uplinks_by_rank={3: SLOW}).uplink_of(4) == Config().uplink_bytes_per_s
    for bad, says in (("3:1e6", "is not RANK=BYTES_PER_S"), ("x=1e6", "must be an integer"),
                      ("3=-1", "must be positive"), ("3=fast", "a number of bytes per second")):
        with pytest.raises(ConfigError, match=says):
            Config.parse("uplinks_by_rank", bad)


def sent_by(run: object, rank: int) -> int:
    from fttree.testing.simulate import Simulation

    assert isinstance(run, Simulation)
    return sum(c.bytes_sent for c in run.network.wire.transports[rank].counts.values())


def test_every_member_plans_alike_the_sums_stay_exact_and_the_slow_rank_sends_its_share_once() -> None:
    """7 simulated ranks, steps of 48 chunks: with rank 3 declared slow it sends each byte of
    its contribution once (a leaf everywhere); with equal shares it sends 2(p-1)/p of a ring."""
    size = 48 * 1024
    settings = {"chunk_bytes": 4096, "uplink_bytes_per_s": FAST}
    planned = simulate(7, None, 3, contribution=counted(size), uplinks_by_rank={3: SLOW}, **settings)
    planned.check()
    even = simulate(7, None, 3, contribution=counted(size), **settings)
    even.check()
    step_bytes = size * 8  # float64
    assert sent_by(planned, 3) == pytest.approx(3 * step_bytes, rel=0.02)
    assert sent_by(even, 3) == pytest.approx(3 * step_bytes * 2 * 6 / 7, rel=0.1)


def test_a_slow_rank_sends_its_sums_as_bf16_and_everyone_else_float32() -> None:
    """bf16_uplinks_below: rank 3 (declared slow) sends half the bytes; the others, and every
    result, stay float32. Small integers survive bf16, so the sums stay exact."""
    size = 48 * 1024

    def small(rank: int, step: int) -> np.ndarray:
        return np.full(size, rank + 1 + step, dtype=np.float32)

    settings = {"chunk_bytes": 4096, "uplink_bytes_per_s": FAST, "uplinks_by_rank": {3: SLOW}}
    mixed = simulate(7, None, 3, contribution=small, bf16_uplinks_below=FAST, **settings)
    mixed.check()
    plain = simulate(7, None, 3, contribution=small, **settings)
    plain.check()
    assert sent_by(mixed, 3) == pytest.approx(sent_by(plain, 3) / 2, rel=0.02)
    assert all(sent_by(mixed, r) == sent_by(plain, r) for r in range(7) if r != 3)
    with pytest.raises(ConfigError, match="bf16_uplinks_below must be a rate"):
        Config(bf16_uplinks_below=-1)


def test_the_plan_follows_a_view_change_and_every_member_agrees() -> None:
    """Rank 5 dies at step 1: the survivors plan over the new view (rank 3 still slow) and every
    step's sum stays exact and alike on every rank; steps of both views ran on several trees."""
    size = 48 * 1024
    run = simulate(7, "crash 5 @1", 5, contribution=counted(size), chunk_bytes=4096, uplink_bytes_per_s=FAST,
                   uplinks_by_rank={3: SLOW})
    run.check()
    assert all(5 not in res.contributors for res in run.results(4).values())
    survivors = tuple(r for r in range(7) if r != 5)
    machine = run.network.nodes[0].replica.machine
    assert machine.view.members == survivors
    trees = {machine.tree_of(c, 48) for c in range(48)}
    assert trees == {t for t, n in enumerate(plan(one_slow(6, slow=survivors.index(3)), 48)) if n}
    assert sent_by(run, 3) < 2 * 5 * size * 8  # about N a step: a leaf in both views' plans


def test_a_blocking_wait_allows_for_a_big_step_behind_the_slowest_declared_uplink() -> None:
    """The backstop that calls the event loop stuck must outlast the node's own deadline: a
    100 MB step behind a declared 10 Mbit/s uplink takes 80 s and more when healthy."""
    from fttree import FTTreeAllreduce

    from .conftest import local_peers

    peers = local_peers(7)
    lan = FTTreeAllreduce(0, peers)
    slow = FTTreeAllreduce(0, peers, uplink_bytes_per_s=FAST, uplinks_by_rank={3: SLOW})
    assert lan.outcome_limit_s(0) == lan.config.step_timeout_s + 10
    assert slow.outcome_limit_s(100_000_000) > 3 * 100_000_000 / SLOW  # the node allows 3x the bytes' time
    assert slow.outcome_limit_s(4096) < slow.config.step_timeout_s + 11
