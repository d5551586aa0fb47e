"""Join and leave figures: how fast a restarted worker is admitted and synced, and what that
costs the others.

    fttree bench --elastic            (or: python -m fttree.tools.bench_elastic -n 4 --steps 120)

n workers (threads of this process, each its own FTTreeAllreduce over TCP on 127.0.0.x) train
the thesis's MLP (784-512-10, 407,050 parameters, SGD with momentum 0.9, batch 100 of synthetic
data). Rank n-1 is killed at step 10 and started again when rank 0 reaches step 20; later, rank
n-2 leaves gracefully. Printed: steps from asking to admission, the state transfer's size and
time, the others' step times while the joiner syncs against their median, and the time of the
step in which a rank left against the median (a graceful leave pays no timeout).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..api import FTTreeAllreduce
from ..errors import GroupLeft
from ..training.elastic import TransferRecord
from ..training.optim import DistributedOptimizer


def thesis_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


@dataclass
class Seen:
    times: dict[int, float] = field(default_factory=dict)  # training step -> seconds
    asked_at_step: int | None = None
    admitted_at: int | None = None
    synced_at: int | None = None
    record: TransferRecord | None = None
    error: BaseException | None = None


def worker(rank: int, peers: list[str], seen: Seen, steps: int, *, crash_at: int | None = None,
           leave_at: int | None = None, on_step: object = None, asked_at: list[int] | None = None) -> None:
    ar = FTTreeAllreduce(rank, peers, timeout_s=0.2, step_timeout_s=15).start()
    try:
        model = thesis_mlp()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                          allreduce=ar)
        if ar.joined_at is not None:
            seen.admitted_at = ar.joined_at[1]
            seen.asked_at_step = asked_at[0] if asked_at else None
        step = opt.sync.rounds
        gen = torch.Generator().manual_seed(rank)
        while step < steps:
            if crash_at is not None and step == crash_at:
                ar.crash("bench: killed")
            if leave_at is not None and step == leave_at:
                ar.leave()
                return
            x, y = torch.randn(100, 784, generator=gen), torch.randint(0, 10, (100,), generator=gen)
            began = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            torch.autograd.backward(loss)
            opt.step()
            seen.times[step] = time.perf_counter() - began
            if seen.synced_at is None and ar.joined_at is not None and not opt.syncing:
                seen.synced_at, seen.record = step, opt.transfer.record
            if callable(on_step):
                on_step(step)
            step += 1
    except GroupLeft:
        pass
    except BaseException as exc:
        seen.error = exc
    finally:
        ar.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args(argv)
    run(args.workers, args.steps, parser.error)


def run(n: int, steps: int, error: Callable[[str], object] = print) -> None:
    """Run the pattern and print its figures."""
    if n < 3:
        error("-n must be at least 3 (one restarts, one leaves)")
        return
    if steps < 60:
        error("--steps must be at least 60")
        return
    with socket.socket() as probe:  # a port free now; every worker binds its own 127.0.0.x with it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    peers = [f"127.0.0.{r + 1}:{port}" for r in range(n)]
    seen = {r: Seen() for r in range(n)}
    rejoined = Seen()
    restart = threading.Event()
    asked_at: list[int] = []
    leave_step = steps - 20

    def watch(step: int) -> None:
        if step == 20:
            restart.set()

    def restarted() -> None:
        restart.wait(120)
        asked_at.append(max(seen[0].times, default=0) + 1)  # the step rank 0 is in when the new process starts
        worker(n - 1, peers, rejoined, steps, asked_at=asked_at)

    threads = [threading.Thread(target=worker, args=(r, peers, seen[r], steps),
                                kwargs={"crash_at": 10 if r == n - 1 else None, "on_step": watch if r == 0 else None,
                                        "leave_at": leave_step if r == n - 2 else None})
               for r in range(n)]
    threads.append(threading.Thread(target=restarted))
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    errors = {r: s.error for r, s in {**seen, n: rejoined}.items() if s.error is not None}
    if errors:
        raise SystemExit(f"workers failed: {errors}")
    base = seen[0].times
    median = statistics.median(base[s] for s in range(30, leave_step - 5) if s in base)
    print(f"{n} workers, thesis MLP (407,050 parameters, SGD momentum), threads of one process")
    if rejoined.admitted_at is not None and rejoined.asked_at_step is not None:
        print(f"rejoin: asked during step {rejoined.asked_at_step}, admitted from step {rejoined.admitted_at} "
              f"({rejoined.admitted_at - rejoined.asked_at_step} steps; target <= 2)")
    if rejoined.record is not None:
        rec = rejoined.record
        print(f"state transfer: {rec.nbytes:,} bytes from rank {rec.donor} as of step {rec.user_step}, "
              f"{rec.seconds * 1000:.0f} ms from asking to checked (target <= 1000 ms), {rec.replayed} steps replayed; "
              f"in sync from step {rejoined.synced_at}")
    if rejoined.admitted_at is not None and rejoined.synced_at is not None:
        during = [base[s] for s in range(rejoined.admitted_at, rejoined.synced_at + 1) if s in base]
        worst = max(during)
        print(f"rank 0 while the joiner synced: worst step {worst * 1000:.1f} ms vs median {median * 1000:.1f} ms "
              f"= {worst / median:.2f}x (target <= 1.5x)")
    if leave_step in base:
        print(f"graceful leave at step {leave_step}: rank 0's step took {base[leave_step] * 1000:.1f} ms "
              f"(median {median * 1000:.1f} ms, {base[leave_step] / median:.2f}x; a timeout would cost >= 1000 ms)")


if __name__ == "__main__":
    main()
