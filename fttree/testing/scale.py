"""How detection and agreement grow with the world, in simulation: an interior rank (1)
crashes (its sockets refuse) or hangs (silent) at the start of a step; the simulated time
until rank 0 installs the view without it, and the frames each rank sent from the fault to
the end of that step, by message kind.

    python -m fttree.testing.scale --worlds 15,127,255,1023

prints one line per world and fault (docs/scale.md holds a table of them).
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import numpy as np

from ..core.messages import Kind
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="15,127,255,1023", help="comma-separated world sizes")
    parser.add_argument("--faults", default="crash,hang", help="crash, hang or both")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # a view change logs on every rank
    for fault in args.faults.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            run = measure(world, fault)
            top = ", ".join(f"{k.name} {v:.1f}" for k, v in sorted(run.by_kind.items(), key=lambda kv: -kv[1])[:4])
            print(f"{fault:5s} world {world:5d}: new view {run.to_view_s:.2f} s after the fault; "
                  f"{run.frames_per_rank:.1f} frames per rank ({top}); {run.wall_s:.0f} s to simulate", flush=True)


if __name__ == "__main__":
    main()
