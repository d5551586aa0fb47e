"""A joiner that goes silent right after its admission, as a process of its own: it joins a
running group of three over TCP, is admitted, and stops itself (SIGSTOP: its connections stay
open, no frame comes). The members evict it like any member and go on, every step exact."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np

from .conftest import cluster

SILENT_JOINER = """
import os, signal, sys
from fttree import FTTreeAllreduce
ar = FTTreeAllreduce(3, {3: sys.argv[1]}, join=sys.argv[2], startup_timeout_s=60).start()
ar.admit()
print("admitted", ar.joined_at, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_joiner_process_silent_after_its_admission_is_evicted_and_steps_go_on() -> None:
    with cluster(3, step_timeout_s=20) as handles:
        port = handles[0].peers[0].port
        joiner = subprocess.Popen([sys.executable, "-c", SILENT_JOINER, f"127.0.0.4:{port}", f"127.0.0.1:{port}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            durations: dict[int, float] = {}
            deadline = 0.0  # the largest node deadline any member held: it adapts to the machine's load
            joined_at: int | None = None
            after = 0
            step, end = 0, time.monotonic() + 120
            while after < 10:
                assert time.monotonic() < end, "the joiner was never admitted and evicted"
                data = [np.full(8, float(step + 10 * r)) for r in range(3)]
                began = time.monotonic()
                futures = [h.allreduce_async(d) for h, d in zip(handles, data, strict=True)]
                for h, fut in zip(handles, futures, strict=True):
                    out = fut.result(timeout=60)
                    assert h.last is not None
                    want = sum((data[c] for c in h.last.contributors), start=np.zeros(8))
                    assert np.array_equal(out, want), f"rank {h.rank} step {step}: not the sum of its contributors"
                    assert 3 not in h.last.contributors
                durations[step] = time.monotonic() - began
                deadline = max([deadline] + [h.node.membership.node_deadline_s for h in handles if h.node is not None])
                time.sleep(0.01)  # a step of compute: the joiner's process starts meanwhile
                if joined_at is None and any(h.node is not None and h.status().membership.evicted_total
                                             for h in handles):
                    joined_at = step  # admitted, silent, evicted: some more steps without it
                if joined_at is not None:
                    after += 1
                step += 1
            for h in handles:
                assert h.view.members == (0, 1, 2)
                assert h.node is not None
                (eviction,) = h.status().membership.evictions
                assert eviction.rank == 3
                assert "suspected by" in eviction.reason
            assert joiner.poll() is None  # stopped, not dead: its connections stayed open
            slowest = max(durations.values())
            print(f"silent joiner: slowest step {slowest:.3f} s (node deadline {deadline:.2f} s), "
                  f"evicted after {eviction.detected_after_s:.3f} s of suspicion")
            # Suspicion needs a silence past the deadline and then a ping unanswered for another, then
            # a ballot: the step the joiner stalled ends in about twice the slowest member's deadline,
            # never at the 20 s step timeout.
            assert slowest < 2 * deadline + 1.0, (deadline, durations)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(joiner.pid, signal.SIGCONT)
            joiner.kill()
            out, _ = joiner.communicate(timeout=30)
    assert "admitted" in out, out
