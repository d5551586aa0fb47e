"""`fttree bench --straggler`: one worker computes twice as slowly; gloo DDP waits for it at every
step, fttree with straggler_policy="deadline" closes steps without it.

Each run trains examples/train_mlp.py (the thesis MLP, 784-512-10, on a synthetic task of 10
Gaussian classes small enough that epochs end and are audited, batch 100 per worker) behind
shaped uplinks (bench_diloco's harness). Every worker's compute is emulated: COMPUTE_S of device
time a step (one machine's two cores cannot run many real devices side by side), and rank SLOW
takes twice as long. The target is gloo DDP's held-out accuracy after the step budget; the bench
prints the time each run took to first reach it, and for fttree's deadline runs how often the
straggler was left out and whether every finished epoch used each sample exactly once.
"""

from __future__ import annotations

from .bench_diloco import Config

SLOW = 3  # the straggler's rank
FACTOR = 2.0  # ... and how many times as long its compute takes
COMPUTE_S = 0.5  # every worker's emulated device time a step
SAMPLES = 20_000  # a few epochs within the budget: each one audited
DATA = ("--hidden", "512", "--synthetic", str(SAMPLES), "--compute-s", str(COMPUTE_S),
        "--slow", f"{SLOW}:{FACTOR:g}")


def configs(budget: int) -> list[Config]:
    """gloo DDP (the target), fttree waiting for the straggler, and fttree closing without it;
    every run for `budget` steps (the deadline runs' steps are shorter: they also reach the
    target sooner in time, which is what is compared)."""
    return [Config("gloo DDP", ("--comm", "gloo", "--gloo-bind"), budget),
            Config("fttree DDP, straggler_policy wait", (), budget),
            Config("fttree DDP, straggler_policy deadline", ("--straggler-policy", "deadline"), budget)]
