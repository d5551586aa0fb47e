"""The baseline of `fttree bench`: torch.distributed's gloo all_reduce on the same tensor.

One process per rank, like the fttree workers, with the same checked payload and the same
records (see bench_worker.py), so both sides pay the same work outside the timed region:

    python -m fttree.tools.gloo_baseline --rank R --world N --port P --steps K --size ELEMENTS

Gloo's CPU allreduce is a ring: each rank sends and receives 2(N-1)/N of the tensor, which is
what a tree (the root moves 2x the tensor each way) loses to on large tensors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

from .bench_worker import Payload, emit, wait_for_release


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fttree.tools.gloo_baseline", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="TCP store port on --host")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--size", type=int, required=True, help="float32 elements")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per worker, as in the thesis
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{args.host}:{args.port}", rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=args.startup_timeout))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"gloo rank {args.rank}: init_process_group on {args.host}:{args.port} failed: {exc}", file=sys.stderr)
        return 1
    payload = Payload(args.rank, args.world, args.size)
    tensor = torch.from_numpy(payload.buf)  # shares memory: fill() writes the tensor in place
    emit({"kind": "ready", "rank": args.rank, "at": time.monotonic()})
    failed = False
    try:
        for step in range(args.steps):
            payload.fill(step)
            error, exact = "", False
            cpu, start = time.process_time(), time.monotonic()
            try:
                dist.all_reduce(tensor)
            except RuntimeError as exc:
                error = f"gloo all_reduce failed: {exc}"
            end, cpu = time.monotonic(), time.process_time() - cpu
            if not error:
                exact = payload.check(payload.buf, step)
            failed |= not exact
            emit({"kind": "step", "rank": args.rank, "step": step, "start": start, "end": end,
                  "duration_s": end - start, "cpu_s": cpu, "exact": exact, "error": error, "events": []})
        emit({"kind": "done", "rank": args.rank})
        wait_for_release()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
