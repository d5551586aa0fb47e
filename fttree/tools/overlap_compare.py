"""DiLoCo's outer step blocking, overlapped (overlap=True) and eager (overlap="eager"): wall time
to a held-out loss, and how much of the outer steps' time the local steps hid.

    python -m fttree.tools.overlap_compare --workers 7 --h 2 --rounds 60 --target 0.05

Every mode trains the same MLP on the synthetic task of fttree.tools.sparse_compare (10
Gaussian classes), its workers as threads of this process talking TCP from 127.0.0.(r+1), so
that `netem/uplink.sh` can shape each rank's uplink (run it inside a network namespace). After
every outer step rank 0 keeps a copy of the global parameters (on the thread that took the
step: with overlap, when the step lands, not when the caller next looks) and the time since
the workers started; the held-out loss of each copy is measured after the run, so evaluating
costs the run nothing. A mode's time to the target is the first outer step whose global
parameters reach it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field

import torch

from ..api import FTTreeAllreduce
from ..training.diloco import DiLoCo
from .sparse_compare import draw, free_port, model_of, run_workers, task

MODES: dict[str, bool | str] = {"sync": False, "overlap": True, "eager": "eager"}
_BUILD = threading.Lock()  # torch's seed is one for all threads: build one model at a time


@dataclass
class Result:
    mode: str
    points: list[tuple[float, list[torch.Tensor]]] = field(default_factory=list)  # (s, global parameters)
    losses: list[float] = field(default_factory=list)
    hidden: float = 0.0  # mean over the workers of OuterStats.hidden
    waited_s: float = 0.0  # ...and of the seconds they waited for outer steps
    seconds: float = 0.0

    def to_target(self, target: float) -> tuple[float, int] | None:
        """(seconds, outer steps) to the first global parameters at or below `target`."""
        for i, ((t, _), loss) in enumerate(zip(self.points, self.losses, strict=True)):
            if loss <= target:
                return t, i + 1
        return None


def run_mode(mode: str, args: argparse.Namespace) -> Result:
    port = free_port()
    peers = [f"127.0.0.{r + 1}:{port}" for r in range(args.workers)]
    means, noise = task(args.dim)
    held = draw(means, noise, 4000, torch.Generator().manual_seed(10**6))
    result = Result(mode)
    errors: list[BaseException] = []
    ready = threading.Barrier(args.workers)
    began = [0.0]
    stats: dict[int, tuple[float, float]] = {}

    def worker(rank: int) -> None:
        ar = FTTreeAllreduce(rank, peers, timeout_s=0.5, step_timeout_s=args.step_timeout).start()
        try:
            with _BUILD:
                model = model_of(args.dim, args.hidden)
            opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=args.lr), allreduce=ar, sync_every=args.h,
                         compression=args.compression, overlap=MODES[mode])
            if rank == 0:
                opt.outer_listeners.append(lambda o: result.points.append(
                    (time.perf_counter() - began[0], [g.clone() for _, g in o.global_parameters])))
            g = torch.Generator().manual_seed(rank + 1)  # each batch drawn when it is needed, as a loader would
            if ready.wait() == 0:
                began[0] = time.perf_counter()
            ready.wait()
            for _ in range(args.rounds * args.h):
                x, y = draw(means, noise, args.batch, g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                opt.step()
            opt.flush()
            stats[rank] = (opt.stats.hidden, opt.stats.waited_s)
        except BaseException as exc:
            errors.append(exc)
            ready.abort()
        finally:
            ar.close()

    run_workers(worker, args.workers, args.limit_s, mode, errors)
    result.seconds = time.perf_counter() - began[0]
    result.hidden = sum(h for h, _ in stats.values()) / len(stats)
    result.waited_s = sum(w for _, w in stats.values()) / len(stats)
    probe = model_of(args.dim, args.hidden)
    with torch.no_grad():
        for _, params in result.points:
            for p, v in zip(probe.parameters(), params, strict=True):
                p.copy_(v)
            result.losses.append(float(torch.nn.functional.cross_entropy(probe(held[0]), held[1])))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=7)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--h", type=int, default=2, help="local steps per outer step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compression", choices=["bf16", "fp16", "int8", "sparse"], default=None,
                   help="sparse: fttree.Sparse's defaults (1/16 of the coordinates at 2 bits)")
    p.add_argument("--target", type=float, default=0.05, help="held-out loss to reach")
    p.add_argument("--modes", default="sync,overlap,eager")
    p.add_argument("--step-timeout", type=float, default=120.0)
    p.add_argument("--limit-s", type=float, default=1800.0)
    p.add_argument("--json", action="store_true", help="also print each result as a JSON line")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: {unknown} are not among {sorted(MODES)}")
    torch.set_num_threads(1)
    lines = [f"| mode | time to loss {args.target} | outer steps | final loss | outer step hidden | "
             f"waited for outer steps | wall |", "|---|---|---|---|---|---|---|"]
    for mode in modes:
        r = run_mode(mode, args)
        hit = r.to_target(args.target)
        reached = f"{hit[0]:.1f} s" if hit else "not reached"
        print(f"{mode}: {reached}, final loss {r.losses[-1]:.4f}, {r.hidden:.0%} hidden, {r.seconds:.1f} s",
              flush=True)
        if args.json:
            print(json.dumps({"mode": mode, "losses": r.losses, "times": [t for t, _ in r.points],
                              "hidden": r.hidden, "waited_s": r.waited_s, "seconds": r.seconds}), flush=True)
        lines.append(f"| {mode} | {reached} | {hit[1] if hit else ''} | {r.losses[-1]:.4f} | {r.hidden:.0%} | "
                     f"{r.waited_s:.1f} s | {r.seconds:.1f} s |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
