"""Benchmark of ElasticSampler; prints figures (not a test: nothing is asserted).

1. Movement and balance on 60,000 samples (MNIST's size), batch 100, for 7, 15 and 31
   workers whose loaders prefetch 4 batches (2 workers x prefetch 2), against the ideal:
   - a worker crashes a quarter into the epoch, during a step (so that step's batch is lost
     too): the fraction of the remaining samples that moved (ideal: its fair share 1/n), the
     heaviest survivor over the average, and how many survivors received some (spread);
   - a new worker joins two steps later: the fraction it takes (ideal 1/n);
   - in stable mode the dead worker restarts: how much of what it takes is its own;
   - between epochs with different member sets the placement is recomputed: the fraction
     that moves there, and what modulo placement (HVAC before FT-HVAC) would move.
2. Sampler overhead per step against one step of the thesis MLP (784-512-10, batch 100, SGD,
   forward + backward + update on this CPU), measured in the same run: one epoch of
   iteration and commits (commit_from a DistributedOptimizer step record) on the fast path,
   epoch start included; and the cost of one commit that moves samples (a death), which
   happens once per membership change.

    python examples/bench_sampler.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import BATCH, thesis_mlp

from fttree.data.hash_ring import HashRing, item_positions
from fttree.data.sampler import ElasticSampler, MoveEvent, loader_horizon
from fttree.training.optim import TrainingStep

SIZE = 60_000
HORIZON = loader_horizon(2, 2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[7, 15, 31], help="worker counts")
    p.add_argument("--mlp-iters", type=int, default=200, help="timed MLP steps")
    p.add_argument("--epochs", type=int, default=5, help="timed sampler epochs per worker count")
    return p.parse_args()


def run_steps(sampler: ElasticSampler, steps: int) -> None:
    """Commit `steps` steps on the fast path (everyone contributes, same view)."""
    for _ in range(steps):
        sampler.commit(sampler.next_step, sampler.members)


def movement(n: int) -> dict[str, float]:
    """Kill a worker a third into the epoch, then join a new one; stable mode for the restart."""
    s = ElasticSampler(SIZE, BATCH, rank=0, members=range(n), horizon=HORIZON, stable=True)
    start = s.stats().loads
    home = np.sort(s.pending(n - 1))
    run_steps(s, len(s) // 4)
    survivors = tuple(range(n - 1))
    death = s.commit(s.next_step, survivors, survivors)  # it crashed during the step: its batch is lost too
    run_steps(s, 2)
    join = s.commit(s.next_step, survivors, (*survivors, 1000))
    run_steps(s, 2)
    back = s.commit(s.next_step, s.members, (*s.members, n - 1))
    assert death is not None
    assert join is not None
    assert back is not None
    taken = s.pending(n - 1)
    return {
        "start_balance": max(start.values()) / (SIZE / n),
        "death_moved": death.moved_fraction, "death_ideal": death.ideal_fraction, "death_balance": death.balance,
        "receivers": len(death.received), "recv_min": min(death.received.values()),
        "recv_max": max(death.received.values()),
        "join_moved": join.moved_fraction, "join_ideal": join.ideal_fraction, "join_balance": join.balance,
        "givers": len(join.given),
        "restart_own": float(np.isin(taken, home).mean()),
    }


def between_epochs(n: int) -> tuple[float, float]:
    """Placement moved fraction when the member set loses a rank (worst of three ranks),
    and modulo placement's, both over the ideal 1/n."""
    pos = item_positions(SIZE, seed=0, salt="slots")
    full = HashRing(range(n)).place(pos)
    worst = 0.0
    for gone in (0, n // 2, n - 1):
        smaller = HashRing([r for r in range(n) if r != gone]).place(pos)
        worst = max(worst, np.count_nonzero(smaller != full) / SIZE * n)
    idx = np.arange(SIZE)
    survivors = np.array([r for r in range(n) if r != n // 2])
    modulo = np.count_nonzero(idx % n != survivors[idx % (n - 1)]) / SIZE * n
    return worst, modulo


def mlp_step_s(iters: int) -> float:
    """The faster of torch's default thread count and one thread: two threads on two busy
    cores can be many times slower, and a slower baseline would flatter the sampler."""
    default = torch.get_num_threads()
    try:
        return min(_mlp_step_s(iters, threads) for threads in sorted({default, 1}))
    finally:
        torch.set_num_threads(default)


def _mlp_step_s(iters: int, threads: int) -> float:
    torch.set_num_threads(threads)
    model = thesis_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
    times = []
    for i in range(iters + 20):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 20:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Optimizer:
    """What commit_from reads from a DistributedOptimizer: its record of the last step."""

    def __init__(self) -> None:
        self.last_step: TrainingStep | None = None
        self.rounds = 0

    def step(self, members: tuple[int, ...], batch: list[int]) -> None:
        self.last_step = TrainingStep(step=self.rounds, contributors=members, epoch=0, members_next=members,
                                      contributed=bool(batch))
        self.rounds += 1


def sampler_step_s(n: int, epochs: int) -> tuple[float, float, int]:
    """Per-step cost over whole epochs (set_epoch, every batch as a list, every commit as the
    training loop makes it: commit_from an optimizer's step record), the epoch start alone,
    and the steps per epoch, for rank 0 of n workers."""
    members = tuple(range(n))
    s = ElasticSampler(SIZE, BATCH, rank=0, members=members, horizon=HORIZON)  # placement, once per member set
    opt = _Optimizer()
    per_step, starts = [], []
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        s.set_epoch(epoch)
        it = iter(s)
        first = next(it)
        starts.append(time.perf_counter() - t0)
        steps = 1
        opt.step(members, first)
        s.commit_from(opt)
        for batch in it:
            opt.step(members, batch)
            s.commit_from(opt)
            steps += 1
        per_step.append((time.perf_counter() - t0) / steps)
        assert first is not None
    return statistics.median(per_step), statistics.median(starts), steps


def event_s(n: int) -> float:
    times = []
    for _ in range(3):
        s = ElasticSampler(SIZE, BATCH, rank=0, members=range(n), horizon=HORIZON)
        run_steps(s, 10)
        survivors = tuple(range(n - 1))
        t0 = time.perf_counter()
        ev: MoveEvent | None = s.commit(10, survivors, survivors)
        times.append(time.perf_counter() - t0)
        assert ev is not None
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; "
          f"torch threads {torch.get_num_threads()}")
    print(f"\n1. movement and balance: {SIZE} samples, batch {BATCH}, loader horizon {HORIZON} steps")
    print(f"{'n':>3} | {'start':>6} | {'death: moved/ideal':>18} {'balance':>7} {'receivers':>10} {'recv':>9} | "
          f"{'join: moved/ideal':>17} {'balance':>7} {'givers':>6} | {'restart own':>11} | "
          f"{'next epoch: ring':>16} {'modulo':>6}")
    for n in args.sizes:
        m = movement(n)
        ring_moved, modulo = between_epochs(n)
        print(f"{n:>3} | {m['start_balance']:6.3f} | "
              f"{m['death_moved']:.4f}/{m['death_ideal']:.4f} = {m['death_moved'] / m['death_ideal']:4.2f}x "
              f"{m['death_balance']:7.4f} {m['receivers']:>4}/{n - 1:<5} {m['recv_min']:>4}-{m['recv_max']:<4} | "
              f"{m['join_moved']:.4f}/{m['join_ideal']:.4f} = {m['join_moved'] / m['join_ideal']:4.2f}x "
              f"{m['join_balance']:7.4f} {m['givers']:>6} | {m['restart_own']:11.1%} | "
              f"{ring_moved:15.2f}x {modulo:5.1f}x")
    print("  (balance: heaviest worker's remaining samples over the average; moved/ideal: fraction of the remaining"
          " samples that moved, over the departed or joining worker's fair share)")

    print(f"\n2. overhead per step against the thesis MLP step (batch {BATCH}, CPU)")
    mlp_before = mlp_step_s(args.mlp_iters)
    rows = [(n, *sampler_step_s(n, args.epochs), event_s(n)) for n in args.sizes]
    mlp = statistics.median([mlp_before, mlp_step_s(args.mlp_iters)])
    print(f"MLP step (forward + backward + SGD): {mlp * 1e3:.2f} ms (median of two runs of {args.mlp_iters})")
    for n, per_step, start, steps, ev in rows:
        print(f"n={n:>2}: {per_step * 1e6:6.1f} us/step = {per_step / mlp:6.2%} of the MLP step "
              f"(over {steps} steps per epoch, epoch start {start * 1e3:.2f} ms included); "
              f"a commit that moves a dead worker's samples: {ev * 1e3:.1f} ms")
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
