"""Sparse DiLoCo against dense float32 and int8 DiLoCo, on one machine without uplink shaping.

    python -m fttree.tools.sparse_compare --workers 4 --rounds 40

Every configuration trains the same MLP (--dim inputs, --hidden units, 10 classes) on a
synthetic task of 10 Gaussian classes with its workers as threads of this process, talking TCP
over loopback; each worker draws its own batches. After every outer step rank 0 measures the
global parameters' loss on a held-out set (with sparse, a worker's model also keeps its
progress not yet sent; the global parameters are what every worker agrees on). The bytes are
the busiest rank's transport counter (payload and frame headers, no IP headers) over the whole
run, divided by the rounds: what an uplink would carry per outer step. `fttree bench --diloco`
measures the same behind shaped uplinks (root only).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..api import FTTreeAllreduce
from ..training.diloco import DiLoCo
from ..training.sparse import Sparse

CLASSES = 10


@dataclass(frozen=True)
class Setup:
    label: str
    compression: str | Sparse | None


SETUPS = (Setup("float32", None), Setup("int8", "int8"),
          *(Setup(f"sparse {rule} 1/{d} {bits}-bit", Sparse(index=rule, density=1 / d, bits=bits))
            for d, bits in ((64, 2), (16, 2), (8, 2), (16, 4)) for rule in ("random", "momentum", "energy")))
_BUILD = threading.Lock()  # torch's seed is one for all threads: build one model at a time


@dataclass
class Result:
    setup: Setup
    losses: list[float] = field(default_factory=list)  # held-out loss after each outer step
    bytes_per_round: float = 0.0
    seconds: float = 0.0


def task(dim: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """The classes' means and the noise scale."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CLASSES, dim, generator=g) * 0.25, 1.0


def draw(means: torch.Tensor, noise: float, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return means[y] + noise * torch.randn(n, means.shape[1], generator=g), y


def run_workers(worker: Callable[[int], None], workers: int, limit_s: float, label: str,
                errors: list[BaseException]) -> None:
    """One thread per rank, each joined by `limit_s`; then the first error a worker recorded."""
    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
        if t.is_alive():
            raise TimeoutError(f"{label}: a worker did not finish within {limit_s} s")
    if errors:
        raise errors[0]


def model_of(dim: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_setup(setup: Setup, args: argparse.Namespace) -> Result:
    port = free_port()
    peers = [f"127.0.0.{r + 1}:{port}" for r in range(args.workers)]
    means, noise = task(args.dim)
    held = draw(means, noise, 4000, torch.Generator().manual_seed(10**6))
    result = Result(setup)
    sent: dict[int, int] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        ar = FTTreeAllreduce(rank, peers, timeout_s=0.5, step_timeout_s=60.0).start()
        try:
            with _BUILD:
                model = model_of(args.dim, args.hidden)
                probe = model_of(args.dim, args.hidden)  # holds the global parameters to evaluate them
            opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=args.lr), allreduce=ar,
                         sync_every=args.h, compression=setup.compression, outer_lr=args.outer_lr, overlap=args.overlap,
                         outer_momentum=args.outer_momentum, nesterov=args.outer_momentum > 0)
            g = torch.Generator().manual_seed(rank + 1)
            for _ in range(args.rounds * args.h):
                x, y = draw(means, noise, args.batch, g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                opt.step()
                last = opt.inner_steps == args.rounds * args.h
                if last:
                    opt.flush()  # overlap: take the outer step in flight in
                if rank == 0 and opt.inner_steps % args.h == 0 and (last or not args.overlap):
                    with torch.no_grad():
                        for p, (_, glob) in zip(probe.parameters(), opt.global_parameters, strict=True):
                            p.copy_(glob)
                        result.losses.append(float(torch.nn.functional.cross_entropy(probe(held[0]), held[1])))
            assert ar.transport is not None
            stats: Any = getattr(ar.transport.inner, "stats", {})
            sent[rank] = sum(st.bytes_sent for st in stats.values())
        except BaseException as exc:
            errors.append(exc)
        finally:
            ar.close()

    began = time.perf_counter()
    run_workers(worker, args.workers, args.limit_s, setup.label, errors)
    result.seconds = time.perf_counter() - began
    result.bytes_per_round = max(sent.values()) / args.rounds
    return result


def render(results: Sequence[Result], marks: Sequence[int], rounds: int) -> str:
    """`marks`: the rounds whose loss to show (their place in each result's losses)."""
    base = next((r for r in results if r.setup.compression == "int8"), results[0])
    head = " | ".join(f"loss after {m}" for m in marks) if len(marks) > 1 else f"loss after {rounds}"
    lines = [f"| run | busiest rank's bytes per round | vs int8 | {head} |",
             "|---|---|---|" + "---|" * len(marks)]
    for r in results:
        losses = " | ".join(f"{r.losses[m - 1]:.4f}" if m <= len(r.losses) else "" for m in marks)
        lines.append(f"| {r.setup.label} | {r.bytes_per_round / 1e3:.1f} kB | "
                     f"{r.bytes_per_round / base.bytes_per_round:.4f} | {losses} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--h", type=int, default=16, help="local steps per outer step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov when above 0")
    p.add_argument("--overlap", action="store_true",
                   help="outer steps behind the next round (only the last round's loss is measured: the "
                        "global parameters are in flight before)")
    p.add_argument("--only", default="", help="comma-separated labels' prefixes to run (default all)")
    p.add_argument("--limit-s", type=float, default=1800.0)
    p.add_argument("--json", action="store_true", help="also print each result as a JSON line")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    wanted = [s for s in SETUPS if not args.only or any(s.label.startswith(o) for o in args.only.split(","))]
    results = []
    for setup in wanted:
        r = run_setup(setup, args)
        print(f"{setup.label}: {r.seconds:.1f} s, {r.bytes_per_round / 1e3:.1f} kB per round, final loss "
              f"{r.losses[-1]:.4f}", flush=True)
        if args.json:
            print(json.dumps({"label": setup.label, "losses": r.losses, "bytes_per_round": r.bytes_per_round}))
        results.append(r)
    marks = [1] if args.overlap else sorted({m for m in (1, 2, 5, 10, 20, args.rounds) if m <= args.rounds})
    print(render(results, marks, args.rounds))


if __name__ == "__main__":
    main()
