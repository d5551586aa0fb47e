"""How detection and agreement grow with the world, in simulation: an interior rank (1)
crashes (its sockets refuse) or hangs (silent) at the start of a step; the simulated time
until rank 0 installs the view without it, and the frames each rank sent from the fault to
the end of that step, by message kind.

    python -m fttree.testing.scale --worlds 15,127,255,1023

prints one line per world and fault (docs/scale.md holds a table of them). With --tree-cost,
what one worker holds of its view and trees after a view change, and how long it takes to
build them, instead:

    python -m fttree.testing.scale --tree-cost --worlds 127,255,511,1023
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from ..core.config import Config
from ..core.messages import Kind
from ..core.protocol import TreeMachine
from ..core.view import View
from .memory import MemoryNetwork
from .sim import SimNetwork

ELEMENTS = 256  # a small step: what is measured is membership, not data


@dataclass(frozen=True)
class ScaleRun:
    world: int
    fault: str  # "crash" or "hang"
    to_view_s: float  # simulated seconds from the fault to rank 0's new view
    frames_per_rank: float  # every frame sent from the fault to the end of the step, over the world
    by_kind: dict[Kind, float]  # the same, by message kind
    wall_s: float


def measure(world: int, fault: str) -> ScaleRun:
    began = time.perf_counter()
    net = SimNetwork(world, wire=False)
    assert isinstance(net.wire, MemoryNetwork)
    data = [np.full(ELEMENTS, float(r + 1), np.float32) for r in range(world)]
    for step in range(3):
        net.submit_all(step, data)
        net.run_until_finished(step, limit_s=60)
    installed: list[float] = []
    net.nodes[0].view_listeners.append(lambda inst: installed.append(net.now))
    before = dict(net.wire.stats.by_kind)
    struck = net.now
    (net.crash if fault == "crash" else net.hang)(1)
    for r in range(world):
        if r != 1:
            net.submit(r, 3, data[r])
    net.run_until_finished(3, limit_s=120, ranks=[r for r in range(world) if r != 1])
    if not installed:
        raise RuntimeError(f"world {world}, {fault}: rank 0 never installed a view without rank 1")
    sent = {k: (n - before.get(k, 0)) / world for k, n in net.wire.stats.by_kind.items() if n > before.get(k, 0)}
    return ScaleRun(world=world, fault=fault, to_view_s=installed[0] - struck,
                    frames_per_rank=sum(sent.values()), by_kind=sent, wall_s=time.perf_counter() - began)


@dataclass(frozen=True)
class TreeCost:
    world: int
    family: str  # Config.trees
    bytes: int  # what a worker holds of a new view and its trees (the tree machine of one rank)
    seconds: float  # the fastest of three builds


def tree_cost(world: int, family: str = "rotated") -> TreeCost:
    """Build the view of `world` members and rank 1's tree machine over it, as a worker does at
    every view change; what is shared by every worker of a process (the heap shapes of one size,
    topology.neighbours) is built first and not counted."""
    cfg = Config(trees=family)
    rank = min(1, world - 1)

    def build() -> TreeMachine:
        return TreeMachine(rank, View(1, tuple(range(world))), cfg)

    build()
    gc.collect()
    tracemalloc.start()
    try:
        machine = build()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del machine
    times = []
    for _ in range(3):
        began = time.perf_counter()
        build()
        times.append(time.perf_counter() - began)
    return TreeCost(world=world, family=family, bytes=held, seconds=min(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="15,127,255,1023", help="comma-separated world sizes")
    parser.add_argument("--faults", default="crash,hang", help="crash, hang or both")
    parser.add_argument("--tree-cost", action="store_true",
                        help="instead: what one worker holds of its view and trees, and the time to build them")
    args = parser.parse_args()
    if args.tree_cost:
        for world in (int(w) for w in args.worlds.split(",")):
            for family in ("rotated", "single"):
                cost = tree_cost(world, family)
                print(f"{family:7s} world {world:5d}: {cost.bytes / 1e6:.2f} MB per worker, "
                      f"{cost.seconds * 1e3:.0f} ms to build", flush=True)
        return
    logging.disable(logging.WARNING)  # a view change logs on every rank
    for fault in args.faults.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            run = measure(world, fault)
            top = ", ".join(f"{k.name} {v:.1f}" for k, v in sorted(run.by_kind.items(), key=lambda kv: -kv[1])[:4])
            print(f"{fault:5s} world {world:5d}: new view {run.to_view_s:.2f} s after the fault; "
                  f"{run.frames_per_rank:.1f} frames per rank ({top}); {run.wall_s:.0f} s to simulate", flush=True)


if __name__ == "__main__":
    main()
