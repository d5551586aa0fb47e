"""Rank 0 of tests/test_stopped_root.py's real job, in a process of its own so that the test
can stop it (SIGSTOP) with a step in flight: two steps of 16 elements, each rank contributing
rank + 1. After submitting step 1 it prints `submitted` and waits for the step's outcome; then
one JSON line: the outcome ("result" with its contributors, or the error's type and text) and
what the membership saw (self-checks, and whether this rank stopped)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from fttree import FTTreeAllreduce


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peers", required=True)
    args = p.parse_args()
    ar = FTTreeAllreduce(0, args.peers.split(","), timeout_policy="static", timeout_s=0.3, step_timeout_s=30).start()
    try:
        ar.allreduce_async(np.full(16, 1.0, np.float32)).result(timeout=60)
        future = ar.allreduce_async(np.full(16, 1.0, np.float32))
        print("submitted", flush=True)
        try:
            out = future.result(timeout=60)
            outcome = {"result": list(ar.last.contributors) if ar.last else None, "sum": float(out[0])}
        except Exception as exc:  # the outcome to report: GroupLeft is the one expected
            outcome = {"error": type(exc).__name__, "text": str(exc)}
        member = ar.status().membership
        outcome |= {"self_checks": member.self_checks, "self_check_stops": member.self_check_stops,
                    "state": member.state.value}
        print(json.dumps(outcome), flush=True)
    finally:
        ar.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
