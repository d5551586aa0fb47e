"""Bit-reproducible sums: the same contributions give the same bits on every run and every
rank, whatever order the subtree sums arrive in, whichever relay carried them, and after a
node failure at the same point. Float addition is not associative, so these contributions
(magnitudes from 1e-4 to 1e4) give other bits when added in another order: the first test
proves that, so the others could fail."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fttree.net.node import StepResult
from fttree.testing.sim import SimNetwork

from .conftest import cluster


def contributions(world: int, size: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + world)
    return [(rng.standard_normal(size) * 10.0 ** rng.uniform(-4, 4, size)).astype(np.float32)
            for _ in range(world)]


def test_these_contributions_give_other_bits_in_another_order() -> None:
    parts = contributions(7, 4096, 0)
    orders = {np.sum(np.stack([parts[i] for i in order]), axis=0, dtype=np.float32).tobytes()
              for order in itertools.islice(itertools.permutations(range(7)), 0, 5040, 97)}
    assert len(orders) > 1


def run_sim(world: int, seed: int, steps: int, faults: str | None = None,
            trees: str = "rotated", ordered_sums: bool = True) -> dict[tuple[int, int], StepResult]:
    """Every rank's results, steps of 5,000 float32 in 5 chunks; `seed` draws each frame's
    latency (1 ms plus up to 4 ms), so the subtree sums arrive in another order."""
    sim = SimNetwork(world, seed=seed, jitter_s=0.004, faults=faults, chunk_bytes=4096, trees=trees,
                     ordered_sums=ordered_sums)
    for step in range(steps):
        sim.submit_all(step, contributions(world, 5000, step))
        sim.run_until_finished(step)
    return {key: out for key, out in sim.results.items() if isinstance(out, StepResult)}


@pytest.mark.parametrize(("world", "trees"), [(7, "rotated"), (7, "single"), (15, "double")])
def test_every_arrival_order_gives_the_same_bits(world: int, trees: str) -> None:
    runs = [run_sim(world, seed, steps=3, trees=trees) for seed in (1, 2, 3)]
    for key in runs[0]:
        bits = {run[key].data.tobytes() for run in runs} | {runs[0][(r, key[1])].data.tobytes() for r in range(world)}
        assert len(bits) == 1, f"step {key[1]} rank {key[0]}: {len(bits)} different results"


def test_sums_added_as_they_come_differ_from_run_to_run() -> None:
    """ordered_sums=False (each subtree sum added as it arrives): what the fixed order buys."""
    runs = [run_sim(7, seed, steps=2, ordered_sums=False) for seed in (1, 2, 3)]
    assert any(len({run[key].data.tobytes() for run in runs}) > 1 for key in runs[0])


def test_relays_around_a_cut_link_give_the_same_bits() -> None:
    plain = run_sim(7, 1, steps=3)
    relayed = run_sim(7, 2, steps=3, faults="cut 1-3")  # rank 3's subtree sum goes around through a backup link
    for key, res in plain.items():
        assert relayed[key].contributors == res.contributors
        assert relayed[key].data.tobytes() == res.data.tobytes(), key


def test_after_a_crash_the_survivors_sum_is_the_same_given_the_same_failure_point() -> None:
    runs = [run_sim(7, seed, steps=4, faults="crash 5 @2") for seed in (1, 2)]
    survivors = [r for r in range(7) if r != 5]
    for step in range(4):
        first = runs[0][(0, step)]
        assert set(first.contributors) == (set(range(7)) if step < 2 else set(survivors))
        for run in runs:
            for rank in survivors:
                assert run[(rank, step)].contributors == first.contributors
                assert run[(rank, step)].data.tobytes() == first.data.tobytes(), (step, rank)


def test_real_workers_give_the_same_bits_on_every_run() -> None:
    """Two jobs of 7 workers in threads of this process, 1.63 MB steps cut into chunks over
    the rotated trees; in the first job rank 1's frames to the root come 300 ms late, in the
    second rank 2's, so the root gets its children's sums in the other order. Every step's
    result has the same bits in both jobs and on every rank."""
    size, steps = 407_050, 4
    results = []
    for late in (1, 2):
        with cluster(7, timeout_s=1.0, step_timeout_s=60.0, faults=f"delay {late}-0 300ms") as handles:
            futures = [[h.submit_array(contributions(7, size, step)[h.rank].copy(), "f32") for h in handles]
                       for step in range(steps)]
            results.append([[f.result(timeout=90).data.tobytes() for f in fs] for fs in futures])
    for step in range(steps):
        assert len({*results[0][step], *results[1][step]}) == 1, f"step {step}"
