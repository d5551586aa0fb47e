"""One fttree worker of `fttree bench`: timed allreduce steps of a checked tensor, one JSON line each.

Separate from `fttree worker` for two reasons. The work outside the timed region (one fill, one
exactness check) is the same as in the gloo baseline (gloo_baseline.py), so both pay the same
CPU tax on a shared machine. And the worker does not close until the bench tells it to (stdin
EOF): closing right after its last step could abort frames still queued for a slower peer.

    python -m fttree.tools.bench_worker --rank R --peers FILE --steps K --size N [--faults ...]

Records (stdout, one JSON object per line): {"kind": "ready"}, then per step {"kind": "step",
"rank", "step", "start", "end", "duration_s", "exact", "error", "events", "ranks", "epoch"}, then
{"kind": "membership", "views", "evictions", "suspicions"} (the views installed here with the time each was,
and what the membership layer says about each eviction) and {"kind": "done"}. `start`, `end` and
the install times are time.monotonic(), one clock for every process on the machine, so they can
be set against the moment the bench killed or stopped a worker (--node-gate-steps).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


class Payload:
    """Integer-valued float32 contributions whose sum is exact in any order of addition, so
    every step is checked bit for bit, at the cost of one fill and one compare per step (into
    preallocated buffers: fresh 100 MB arrays would cost page faults on every step)."""

    def __init__(self, rank: int, world: int, size: int, rtol: float = 0.0) -> None:
        self.rank, self.world, self.size = rank, world, size
        self.rtol = rtol  # wire compression rounds: accept this relative error (the contributions are positive)
        self.base = (np.arange(size, dtype=np.float32) % 5).astype(np.float32)
        self.base_sum = self.base * np.float32(world)
        self.buf = np.empty(size, dtype=np.float32)
        self._scratch = np.empty(size, dtype=np.float32)

    def fill(self, step: int) -> np.ndarray:
        np.add(self.base, np.float32((self.rank + 1) * (step + 1)), out=self.buf)
        return self.buf

    def check(self, out: np.ndarray, step: int, contributors: Sequence[int] | None = None) -> bool:
        """Is `out` the exact sum over `contributors` (default: every rank) for `step`?"""
        ranks = range(self.world) if contributors is None else contributors
        total = np.float32((step + 1) * sum(r + 1 for r in ranks))
        flat = np.asarray(out).reshape(-1)
        if flat.shape != self.base.shape or flat.dtype != self.base.dtype:
            return False
        np.subtract(flat, total, out=self._scratch)
        want = self.base_sum if len(ranks) == self.world else self.base * np.float32(len(ranks))  # a death: rare
        if self.rtol:
            np.subtract(self._scratch, want, out=self._scratch)
            return bool(np.abs(self._scratch).max() <= self.rtol * (float(want.max()) + float(total)))
        # equal exactly when the difference is all zeros (NaN is not): no 100 MB mask
        np.subtract(self._scratch, want, out=self._scratch)
        return not self._scratch.any()


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def wait_for_release() -> None:
    """Block until the bench closes our stdin: every rank has reported, so closing now loses nothing."""
    try:
        while sys.stdin.readline():
            pass
    except (OSError, ValueError):
        pass


def _start_profile(ar: Any) -> Any:
    """cProfile the loop thread, where the transport, node and protocol run (3.11: per thread)."""
    import asyncio
    import cProfile

    profiler = cProfile.Profile(time.thread_time)  # CPU time: a shared machine inflates wall time
    asyncio.run_coroutine_threadsafe(_call(profiler.enable), ar._loop).result(timeout=10)
    return profiler


def _stop_profile(ar: Any, profiler: Any, path: Path) -> None:
    import asyncio

    asyncio.run_coroutine_threadsafe(_call(profiler.disable), ar._loop).result(timeout=10)
    profiler.dump_stats(str(path))


async def _call(fn: Any) -> Any:
    return fn()


def _membership(ar: Any) -> dict[str, Any]:
    """What this rank's membership layer knows of each eviction, and how many neighbours it
    suspected (read on the node's loop)."""
    status = ar.status().membership
    return {"evictions": [{"rank": e.rank, "epoch": e.epoch, "reason": e.reason,
                           "detected_after_s": e.detected_after_s, "suspected_by": list(e.suspected_by)}
                          for e in status.evictions],
            "suspicions": status.suspicions_total}


def _footprint(ar: Any) -> dict[str, int]:
    """What the node keeps (read on its loop) and this process's resident memory, in KiB."""
    import asyncio

    sizes: dict[str, int] = asyncio.run_coroutine_threadsafe(_call(ar.node.footprint), ar._loop).result(timeout=10)
    with open("/proc/self/statm") as statm:  # Linux: pages resident, second field
        sizes["rss_kib"] = int(statm.read().split()[1]) * resource.getpagesize() // 1024
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fttree.tools.bench_worker", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--peers", type=Path, required=True, help="file with one host:port per line")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--size", type=int, required=True, help="float32 elements")
    p.add_argument("--timeout", type=float, default=0.5)
    p.add_argument("--step-timeout", type=float, default=30.0)
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--chunk-bytes", type=int, default=None)
    p.add_argument("--faults", default="")
    p.add_argument("--no-ft", action="store_true", help="plain tree (no backup links)")
    p.add_argument("--timeout-policy", default=None, help="static or adaptive (needs API support)")
    p.add_argument("--no-link-memory", action="store_true", help="re-detect a broken link in every step")
    p.add_argument("--compression", choices=["bf16", "fp16"], default=None,
                   help="wire compression (the check then allows its rounding)")
    p.add_argument("--trees", choices=["single", "double", "rotated"], default=None,
                   help="the trees a step's chunks spread over (Config.trees; default: the API's)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other Config field (numbers as numbers), e.g. adaptive_ceiling_s=8")
    p.add_argument("--footprint-every", type=int, default=0, metavar="N",
                   help="after every N steps, report the node's bookkeeping sizes and the RSS (0: never)")
    p.add_argument("--profile", type=Path, default=None, help="cProfile the event-loop thread into this file")
    p.add_argument("--gate-dir", type=Path, default=None, help="where the node-fault driver's gate files are")
    p.add_argument("--node-gate-steps", default="", help="steps before which to wait for the node-fault driver")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from ..api import FTTreeAllreduce
    from ..core.config import Config
    from ..errors import FTTreeError
    from ..net.address import parse_peers
    from .demo import StepNotes

    peers = parse_peers(args.peers.read_text().splitlines())
    kwargs: dict[str, Any] = {}
    if args.chunk_bytes:
        kwargs["chunk_bytes"] = args.chunk_bytes
    if args.timeout_policy:
        kwargs["timeout_policy"] = args.timeout_policy
    if args.no_link_memory:
        kwargs["link_memory"] = False
    if args.compression:
        kwargs["compression"] = args.compression
    if args.trees:
        kwargs["trees"] = args.trees
    for item in args.settings:
        field, _, text = item.partition("=")
        kwargs[field] = Config.parse(field, text)  # by the field's type: "false" is False, not a string
    try:
        ar = FTTreeAllreduce(args.rank, peers, timeout_s=args.timeout, step_timeout_s=args.step_timeout,
                             startup_timeout_s=args.startup_timeout, faults=args.faults,
                             fault_tolerant=not args.no_ft, **kwargs)
        ar.start()
    except FTTreeError as exc:
        print(f"rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    notes = StepNotes(ar)
    # a rounding per hop (leaf to root, and the result): depth + 2 unit roundoffs of the sum
    wire = args.compression or ("bf16" if ar.config.bf16_uplinks_below > 0 else "")  # slow ranks' sums in bf16
    rtol = {"bf16": 2.0**-8, "fp16": 2.0**-11}.get(wire, 0.0) * (ar.world.bit_length() + 2)
    payload = Payload(args.rank, ar.world, args.size, rtol)
    views: list[dict[str, Any]] = []  # appended on the loop thread, read after the steps
    assert ar.node is not None
    ar.node.view_listeners.append(lambda inst: views.append(
        {"epoch": inst.view.epoch, "members": list(inst.view.members), "evicted": list(inst.evicted),
         "at": time.monotonic()}))
    gate = None
    if args.gate_dir is not None and args.node_gate_steps:
        from .nodefaults import NODE_TAG, StepGate

        gate = StepGate(args.gate_dir, StepGate.parse_steps(args.node_gate_steps), args.rank,
                        args.startup_timeout + args.step_timeout + 30, tag=NODE_TAG)
    profiler = _start_profile(ar) if args.profile else None
    emit({"kind": "ready", "rank": args.rank, "at": time.monotonic()})
    failed = False
    try:
        for step in range(args.steps):
            data = payload.fill(step)
            if gate is not None:
                gate(step)  # a victim waits here to be killed or stopped, outside the step's time
            error, exact, ranks, epoch = "", False, list(range(ar.world)), ar.view.epoch
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu, start = time.process_time(), time.monotonic()
            try:
                out = ar.allreduce(data)
            except FTTreeError as exc:
                error = str(exc)
            end, cpu = time.monotonic(), time.process_time() - cpu
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if not error:
                if ar.last is not None:
                    ranks, epoch = sorted(ar.last.contributors), ar.last.epoch
                exact = payload.check(out, step, ranks)
            failed |= not exact
            emit({"kind": "step", "rank": args.rank, "step": step, "start": start, "end": end,
                  "duration_s": end - start, "cpu_s": cpu, "page_faults": faults, "exact": exact, "error": error,
                  "events": notes.pop(step), "ranks": ranks, "epoch": epoch})
            if args.footprint_every and (step + 1) % args.footprint_every == 0:
                emit({"kind": "footprint", "rank": args.rank, "step": step, "sizes": _footprint(ar)})
        emit({"kind": "membership", "rank": args.rank, "views": list(views), **_membership(ar)})
        emit({"kind": "done", "rank": args.rank})
        if profiler is not None:
            _stop_profile(ar, profiler, args.profile)
        wait_for_release()
    finally:
        ar.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
