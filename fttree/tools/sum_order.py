"""What adding subtree sums in a fixed order costs (Config.ordered_sums): 7 worker processes on
this machine, steps of the thesis MLP's 1.63 MB and of 16 MB, run in alternating pairs (fixed
order, then as they come, then the other way round) so that the machine's noise falls on both.

    python -m fttree.tools.sum_order [--pairs 3] [--steps 30]

Prints each pair's median step times and the ratio fixed / as-they-come, then the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .bench_run import execute
from .bench_spec import RunSpec

SIZES = {"1.63MB": 407_050, "16MB": 4_000_000}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fttree.tools.sum_order", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=7)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="sum-order-"))
    for label, size in SIZES.items():
        ratios = []
        for pair in range(args.pairs):
            medians: dict[bool, float] = {}
            order = (True, False) if pair % 2 == 0 else (False, True)
            for ordered in order:
                spec = RunSpec(kind="fttree", world=args.workers, size=size, steps=args.steps, purpose="sweep",
                               policy="adaptive", settings=(("ordered_sums", str(ordered).lower()),))
                result = execute(spec, work)
                if result.error:
                    print(f"{label} ordered_sums={ordered}: {result.error}")
                    return 1
                median = result.median()
                assert median is not None
                medians[ordered] = median
            ratios.append(medians[True] / medians[False])
            print(f"{label} pair {pair + 1}: fixed order {medians[True] * 1000:.1f} ms, as they come "
                  f"{medians[False] * 1000:.1f} ms, ratio {ratios[-1]:.3f}", flush=True)
        print(f"{label}: median ratio fixed / as they come {statistics.median(ratios):.3f} over {args.pairs} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
