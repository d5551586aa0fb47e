"""Shares that follow the uplinks (core/shares.py): a slow rank becomes a leaf of the trees that
carry a step, the busiest rank's time meets the bound, equal uplinks keep the even spread, and
sums stay exact with every member planning alike."""

from __future__ import annotations

import numpy as np
import pytest

from fttree.core.config import Config
from fttree.core.protocol import TreeMachine
from fttree.core.shares import bound_seconds, busiest_seconds, measured_rates, plan, rotated_loads
from fttree.core.trees import tree_of
from fttree.core.view import View
from fttree.errors import ConfigError
from fttree.net.steps import StepResult
from fttree.testing.sim import SimNetwork
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
    # the node waits a step deadline, and up to submit_wait_s more for a slow caller
    assert lan.outcome_limit_s(0) == lan.config.step_timeout_s + lan.config.submit_wait_s + 10
    assert slow.outcome_limit_s(100_000_000) > 3 * 100_000_000 / SLOW  # the node allows 3x the bytes' time
    assert slow.outcome_limit_s(4096) < slow.config.step_timeout_s + slow.config.submit_wait_s + 11


# ---- measured uplinks, agreed through the view (joins.py "Pace", View.uplinks) ---------------

MLP = 407_050  # the thesis MLP's float32 parameters: 1.63 MB


def run_steps(net: SimNetwork, first: int, count: int) -> list[float]:
    """Steps `first` .. `first + count - 1`, one after another; each gives every rank the exact
    sum. The simulated seconds each took."""
    times = []
    for step in range(first, first + count):
        data = [np.full(MLP, float(r + 1 + step), dtype=np.float32) for r in range(net.world)]
        start = net.now
        net.submit_all(step, data)
        net.run_until_finished(step, limit_s=600)
        for r in range(net.world):
            out = net.outcome(r, step)
            assert isinstance(out, StepResult), (r, step, out)
            np.testing.assert_array_equal(out.data, sum(data))
        times.append(net.now - start)
    return times


def held_uplinks(net: SimNetwork) -> tuple[int, ...]:
    """The measured uplinks the view holds, the same on every member."""
    views = {n.view for n in net.nodes}
    assert len(views) == 1, views
    return views.pop().uplinks


def planned(net: SimNetwork, chunks: int) -> list[int]:
    """The tree of each chunk of a `chunks`-chunk step, the same on every member."""
    plans = {tuple(n.machine.tree_of(c, chunks) for c in range(chunks)) for n in net.nodes}
    assert len(plans) == 1, plans
    return list(plans.pop())


def test_measured_uplinks_give_the_shares_at_defaults_and_the_views_settle() -> None:
    """Nothing declared: one rank behind 10 Mbit/s among 100 Mbit/s ones. The pace rounds put
    the members' measured uplinks into the view; the shares follow them (the slow rank a leaf of
    every tree used) and the step meets the bound. Each member is compared with its own figure,
    so the fast ones stop asking for rounds: before, a fast member among slow ones was always
    beyond twice the pace and asked again in every view, one round a step for good."""
    world, slow = 7, 3
    rates = {r: SLOW if r == slow else FAST for r in range(world)}
    net = SimNetwork(world, uplink=rates, wire=False)
    times = run_steps(net, 0, 4)
    settled = net.nodes[0].view.epoch
    times += run_steps(net, 4, 10)
    assert net.nodes[0].view.epoch == settled, "a pace round after the figures were in"
    held = held_uplinks(net)
    view = net.nodes[0].view
    assert view.uplink_of(slow) == pytest.approx(SLOW, rel=0.05)
    # a fast member that never filled its budget has no figure, and is planned as the fastest
    fast = [view.uplink_of(r) for r in range(world) if r != slow]
    assert all(rate == 0 or rate == pytest.approx(FAST, rel=0.1) for rate in fast), held
    assert any(fast), held
    trees = planned(net, 48)
    for t in set(trees):
        assert not view.tree(t, "rotated").neighbours(slow).children, f"rank {slow} is interior in tree {t}"
    bound = bound_seconds(MLP * 4, tuple(rates.values()))
    assert times[-1] <= 1.1 * bound, (times, bound)
    assert times[0] > 1.5 * bound  # the even spread, before any figure: what the shares save


def test_a_rank_whose_uplink_slows_mid_run_becomes_a_leaf_and_one_that_recovers_gets_even_shares() -> None:
    """Rank 2's uplink drops from 100 to 10 Mbit/s mid-run, then comes back. The meter keeps the
    best rate of the last 30 s (net/uplink.py), so the drop shows after that window; then one
    pace round puts it into the view, every member plans alike and the step meets the bound. A
    recovery shows at the next step: the figure doubles past the view's, and the shares go back
    to even within a few steps. Every sum stays exact throughout."""
    world, slow = 7, 2
    net = SimNetwork(world, uplink=FAST, wire=False)
    run_steps(net, 0, 4)
    even = [tree_of("rotated", c, 48, world) for c in range(48)]
    assert planned(net, 48) == even
    net.reshape(slow, SLOW)
    dropped_at = net.now
    step, times = 4, []
    while net.nodes[0].view.uplink_of(slow) > 2 * SLOW:
        assert net.now - dropped_at < 45, "the slow uplink is not in the view 45 s after the drop"
        times += run_steps(net, step, 1)
        step += 1
    assert net.now - dropped_at >= 30 - 3  # not before the meter's window let go of the fast slices
    times += run_steps(net, step, 3)
    step += 3
    view = net.nodes[0].view
    for t in set(planned(net, 48)):
        assert not view.tree(t, "rotated").neighbours(slow).children, f"rank {slow} is interior in tree {t}"
    bound = bound_seconds(MLP * 4, tuple(SLOW if r == slow else FAST for r in range(world)))
    assert times[-1] <= 1.1 * bound < times[0] / 1.5, (times, bound)
    net.reshape(slow, FAST)
    recovered = run_steps(net, step, 5)
    assert planned(net, 48) == even, held_uplinks(net)
    assert recovered[-1] <= 1.1 * bound_seconds(MLP * 4, (FAST,) * world) + 0.05, recovered


def test_a_view_keeps_each_members_figure_through_trees_and_evictions() -> None:
    view = View(4, (0, 1, 2, 3, 4), 1_000, (5_000, 1_000, 5_000, 5_000, 4_000))
    assert [view.tree(t, "rotated").uplink_of(2) for t in range(5)] == [5_000] * 5
    assert view.tree(2, "rotated").tree(1, "rotated").uplink_of(1) == 1_000
    after = view.without([1], 5)
    assert {r: after.uplink_of(r) for r in after.members} == {0: 5_000, 2: 5_000, 3: 5_000, 4: 4_000}
    assert View(1, (0, 1), 0, (0, 0)).uplinks == ()
    assert view.uplink_of(9) == 0
    assert view != View(4, (0, 1, 2, 3, 4), 1_000)
    with pytest.raises(ConfigError, match="one rate >= 0 per member"):
        View(1, (0, 1, 2), 0, (1, 2))


def planned_rates(uplinks: tuple[int, ...]) -> tuple[float, ...] | None:
    view = View(1, tuple(range(len(uplinks))), 0, uplinks)
    return measured_rates([view.planned_uplink(r) for r in view.members])


def test_measured_rates_plan_only_when_they_differ_and_a_member_not_measured_counts_as_the_fastest() -> None:
    assert measured_rates(()) is None
    assert planned_rates((0, 0, 0)) is None  # nothing measured yet
    assert planned_rates((int(FAST), int(0.7 * FAST), int(FAST))) is None  # within a factor 2: even shares
    assert planned_rates((int(FAST), 0, int(0.9 * FAST))) is None  # equal links, one never backlogged
    assert planned_rates((0, 0, int(SLOW))) is None  # only the slow link filled its budget: nothing to go by
    unknown = planned_rates((0, int(FAST), int(SLOW)))
    assert unknown is not None
    assert unknown[0] == unknown[1] > 8 * unknown[2]
    rounded = planned_rates((int(FAST), int(0.98 * FAST), int(SLOW)))
    assert rounded is not None
    assert rounded[0] == rounded[1]
    assert rounded[2] < rounded[0] / 8


def test_per_link_bf16_error_on_real_gradients() -> None:
    """bf16 from the slow rank only, on the thesis MLP's pseudo-gradients (8 local SGD steps):
    the error against float32 is that of one rank's part rounded to bf16, far below bf16 on
    every link; every rank holds the same bits. `pytest -s` prints the figures."""
    from .test_compression import run_one_step
    from .test_int8 import _pseudo_gradients

    grads = _pseudo_gradients(7)
    base = {"chunk_bytes": 1 << 20, "uplink_bytes_per_s": FAST, "uplinks_by_rank": {3: SLOW}}
    _, ref = run_one_step(7, grads, **base)
    _, slow = run_one_step(7, grads, bf16_uplinks_below=FAST, **base)
    _, every = run_one_step(7, grads, compression="bf16", **base)
    f32 = ref[0].data.astype(np.float64)

    def rel(outs: list[StepResult]) -> float:
        assert all(np.array_equal(o.data, outs[0].data) for o in outs)
        return float(np.linalg.norm(outs[0].data.astype(np.float64) - f32) / np.linalg.norm(f32))

    slow_err, every_err = rel(slow), rel(every)
    print(f"\nper-link bf16 (rank 3 of 7 slow), thesis MLP pseudo-gradients: relative L2 error {slow_err:.2e}; "
          f"bf16 on every link {every_err:.2e}")
    assert 0 < slow_err < every_err / 2
    assert slow_err < 2 ** -8
