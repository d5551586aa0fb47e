"""Join and leave figures: how fast a restarted worker is admitted and synced, and what that
costs the others.

    fttree bench --elastic 4        (or: python -m fttree.tools.bench_elastic -n 4 --steps 120)

n worker processes (each its own FTTreeAllreduce over TCP on 127.0.0.x, one torch thread) train
the thesis's MLP (784-512-10, 407,050 parameters, SGD with momentum 0.9, batch 100 of synthetic
data). Rank n-1 is killed at step 10 (its process exits as a killed one would) and started again
when rank 0 reaches step 20; near the end, rank n-2 leaves gracefully. Printed: steps from
starting the new process to its admission, the state transfer's size and time, the other
members' worst step while the joiner syncs against their own median, and the step in which a
rank left against the median (a graceful leave pays no timeout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..net.address import free_port, local_hosts, local_peers

START_AT = 12  # rank 0's step at which the killed rank's new process starts
CRASH_AT = 10
LEAVE_BEFORE_END = 20  # rank n-2 leaves this many steps before the last
STDERR_LINES = 12  # of a worker's stderr, shown when the pattern did not happen


def _worker(rank: int, peers: list[str], steps: int, crash_at: int | None, leave_at: int | None) -> None:
    """One worker process: a JSON line per training step on stdout."""
    import time

    import torch

    from ..api import FTTreeAllreduce
    from ..errors import GroupLeft
    from ..training.optim import DistributedOptimizer

    torch.set_num_threads(1)

    def say(**record: Any) -> None:
        print(json.dumps(record), flush=True)

    ar = FTTreeAllreduce(rank, peers, timeout_s=0.2, step_timeout_s=15).start()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, allreduce=ar)
        gen = torch.Generator().manual_seed(rank)
        synced = not ar.joining
        asked = time.time()  # a joiner is admitted inside its first backward (its first gradient hook)
        step: int | None = None if ar.joining else opt.sync.next_round()
        while step is None or step < steps:
            if crash_at is not None and step == crash_at:
                ar.crash("bench: killed")
            if leave_at is not None and step == leave_at:
                ar.leave()
                say(left=step)
                return
            x, y = torch.randn(100, 784, generator=gen), torch.randint(0, 10, (100,), generator=gen)
            began = time.perf_counter()
            opt.zero_grad()
            torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            done = opt.sync.rounds - 1
            if step is None and ar.joined_at is not None:
                say(joined=ar.joined_at[1], asked=asked)
            say(step=done, s=time.perf_counter() - began, syncing=opt.syncing, wall=time.time())
            if not synced and not opt.syncing:
                synced = True
                rec = opt.transfer.record
                if rec is not None:
                    say(synced=done, donor=rec.donor, as_of=rec.user_step, nbytes=rec.nbytes, seconds=rec.seconds,
                        replayed=rec.replayed)
            step = done + 1
    except GroupLeft:
        pass
    finally:
        ar.close()


@dataclass
class _Seen:
    times: dict[int, float] = field(default_factory=dict)
    walls: dict[int, float] = field(default_factory=dict)  # when each step ended (time.time())
    events: dict[str, Any] = field(default_factory=dict)
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_LINES))  # its last lines


def _spawn(rank: int, peers: list[str], steps: int, seen: _Seen, *, crash_at: int | None = None,
           leave_at: int | None = None, on_step: Callable[[int], None] | None = None) -> tuple[subprocess.Popen[str],
                                                                                                 threading.Thread]:
    cmd = [sys.executable, "-m", "fttree.tools.bench_elastic", "--worker", str(rank), "--peers", ",".join(peers),
           "--steps", str(steps)]
    if crash_at is not None:
        cmd += ["--crash-at", str(crash_at)]
    if leave_at is not None:
        cmd += ["--leave-at", str(leave_at)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.stderr.append(line.rstrip())

    threading.Thread(target=read_stderr, daemon=True).start()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            record = json.loads(line)
            if "step" in record:
                seen.times[record["step"]] = record["s"]
                seen.walls[record["step"]] = record["wall"]
                if on_step is not None:
                    on_step(record["step"])
            else:
                seen.events.update(record)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, reader


def run(n: int, steps: int, error: Callable[[str], object] = print) -> bool:
    """Run the pattern and print its figures. False (after saying why, with the workers' last
    words) when the pattern did not happen: a restart that never joined, a run cut short."""
    if n < 3:
        error("-n must be at least 3 (one restarts, one leaves)")
        return False
    if steps < 60:
        error("--steps must be at least 60")
        return False
    peers = local_peers(n, "127.0.0.1", free_port(local_hosts(n)))  # every worker on its own 127.0.0.x
    leave_step = steps - LEAVE_BEFORE_END
    seen = {r: _Seen() for r in range(n)}
    rejoined = _Seen()
    started_at: list[int] = []  # rank 0's step when the new process was started
    procs: list[tuple[subprocess.Popen[str], threading.Thread]] = []

    def watch(step: int) -> None:
        if step == START_AT and not started_at:
            started_at.append(step + 1)  # the step rank 0 begins as the new process starts
            procs.append(_spawn(n - 1, peers, steps, rejoined))

    for r in range(n):
        procs.append(_spawn(r, peers, steps, seen[r], crash_at=CRASH_AT if r == n - 1 else None,
                            leave_at=leave_step if r == n - 2 else None, on_step=watch if r == 0 else None))
    try:
        for proc, reader in list(procs):
            proc.wait(timeout=600)
            reader.join(10)
        for proc, reader in procs[n:]:
            proc.wait(timeout=600)
            reader.join(10)
    finally:
        for proc, _reader in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return report(n, steps, seen, rejoined)


def report(n: int, steps: int, seen: dict[int, _Seen], rejoined: _Seen) -> bool:
    """Print what the run of `n` workers and `steps` steps showed (`seen`: each first process;
    `rejoined`: the restarted one). False when the pattern did not happen, said with the
    last lines of the worker concerned."""
    leave_step = steps - LEAVE_BEFORE_END
    print(f"{n} worker processes, thesis MLP (407,050 parameters, SGD momentum), one torch thread each")
    ev = rejoined.events
    if "joined" in ev:
        walls = seen[0].walls
        asking = min((s for s, w in walls.items() if w >= ev["asked"]), default=-1)  # rank 0's step then
        print(f"rejoin: the new process asked while rank 0 was in step {asking}, admitted from step "
              f"{ev['joined']} ({ev['joined'] - asking} steps later; target <= 2)")
    if "synced" in ev:
        print(f"state transfer: {ev['nbytes']:,} bytes from rank {ev['donor']} as of step {ev['as_of']}, "
              f"{ev['seconds'] * 1000:.0f} ms from asking to checked (target <= 1000 ms), {ev['replayed']} steps "
              f"replayed; contributing from step {ev['synced'] + 1}")
        window = range(ev["joined"], ev["synced"] + 1)
        ratios = []
        for r in range(n - 1):
            times = seen[r].times
            median = statistics.median(times[s] for s in range(30, leave_step - 5) if s in times)
            worst = max(times[s] for s in window if s in times)
            ratios.append(worst / median)
            print(f"  rank {r}: worst step while the joiner synced {worst * 1000:.1f} ms, median "
                  f"{median * 1000:.1f} ms: {worst / median:.2f}x")
        print(f"other members while someone joins: at most {max(ratios):.2f}x their median (target <= 1.5x)")
        floor = _noise_floor([seen[r].times for r in range(n - 1)], len(window), range(30, leave_step - 5),
                             range(ev["joined"] - 3, ev["synced"] + 4))
        if floor is not None:
            print(f"  the same worst-of-{len(window)}-steps figure over the run's windows without a join: median "
                  f"{floor[0]:.2f}x, 90th percentile {floor[1]:.2f}x (the noise of this machine)")
    times = seen[0].times
    missing = []
    if "synced" not in ev:
        missing.append((f"the restarted rank {n - 1} never {'synced' if 'joined' in ev else 'joined'} "
                        f"(rank 0 ran to step {max(times, default=-1)} of {steps}; a restart needs its start-up "
                        f"time in steps: raise --steps)", rejoined))
    if leave_step not in times:
        missing.append((f"rank 0 never reached step {leave_step}, where rank {n - 2} leaves", seen[0]))
    for why, whose in missing:
        print(f"not measured: {why}; its last output:")
        for line in whose.stderr or ["(none)"]:
            print(f"    {line}")
    if leave_step in times:
        median = statistics.median(times[s] for s in range(30, leave_step - 5) if s in times)
        print(f"graceful leave at step {leave_step}: rank 0's step took {times[leave_step] * 1000:.1f} ms "
              f"(median {median * 1000:.1f} ms, {times[leave_step] / median:.2f}x; a timeout would cost >= 1000 ms)")
    return not missing


def _noise_floor(runs: list[dict[int, float]], length: int, steady: range, busy: range) -> tuple[float, float] | None:
    """The worst-step figure of every window of `length` steady steps that does not touch
    `busy` (the join), over all ranks: its median and 90th percentile. What a window with no
    join shows on this machine, so the join's figure can be told from the machine's noise."""
    ratios = []
    for times in runs:
        median = statistics.median(times[s] for s in steady if s in times)
        for start in steady:
            steps = range(start, start + length)
            if steps[-1] in steady and not set(steps) & set(busy) and all(s in times for s in steps):
                ratios.append(max(times[s] for s in steps) / median)
    if len(ratios) < 10:
        return None
    deciles = statistics.quantiles(ratios, n=10)
    return statistics.median(ratios), deciles[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peers", default="", help=argparse.SUPPRESS)
    parser.add_argument("--crash-at", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--leave-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker, args.peers.split(","), args.steps, args.crash_at, args.leave_at)
        return
    if not run(args.workers, args.steps, parser.error):
        sys.exit(1)


if __name__ == "__main__":
    main()
