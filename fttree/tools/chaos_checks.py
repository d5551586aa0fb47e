"""What `fttree chaos` checks in the workers' records, as they come: fed one record at a time,
it raises ChaosFailure with the reason at the first wrong sum, wrong contributors, sample
committed twice or missing, or growing memory.

- Same step, same parameters: every rank that reports training step S (not waiting for state)
  must hold the same parameter digest after it. A rank whose digest differs has a wrong sum.
- Same step, same contributors: every report of step S names the same contributors; none of
  them reported the step skipped (closed without it); a rank that trained samples in it is
  one. (A joiner waiting for state and a rank with no batch left are contributors with an
  empty contribution, counted in no average: that is by design.)
- Every finished epoch committed each sample exactly once, and every rank's audit of an epoch
  says the same; an epoch the job stopped inside committed none twice.
- RSS: a process's resident memory after its first `warm_steps` steps may not grow by more than
  `rss_limit_bytes` by its last.

Memory here is bounded by the run's length in seconds, not its steps: per-step tables keep
only the newest WINDOW steps, per-process RSS two numbers, committed samples one count per
second.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..errors import FTTreeError

WINDOW = 256  # steps kept for cross-rank comparison (ranks are never that far apart)
SUMMARY_FIELDS = ("complete", "samples", "committed", "distinct", "repeated", "missing", "once")

# What a worker may hold beyond its first steps without growing with the steps run: a rank that
# takes over a tree's root when the root dies keeps the results of its last linger_s (the root's
# sum is its result; about 50 steps of 1.63 MB, 80 MB, at 12 steps a second here), and a rank
# watching results over a lossy link keeps those ops until the watch ends. Both are bounded by
# time, not steps; at 64 MiB the first kill of rank 0 in a chaos run failed the check.
RSS_LIMIT_MB = 160



class ChaosFailure(FTTreeError):
    """The chaos run found a wrong result; the message is the reason."""


@dataclass
class _Rss:
    steps: int = 0
    base: int = 0  # the most it held over its first warm steps
    peak: int = 0  # the most it held after them


@dataclass
class Checks:
    """The running checks over every record of one run."""

    warm_steps: int = 30
    rss_limit_bytes: int = RSS_LIMIT_MB << 20
    digests: dict[int, tuple[str, int]] = field(default_factory=dict)  # step -> (digest, first rank)
    contributors: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    absent: dict[int, dict[int, str]] = field(default_factory=dict)  # step -> rank -> "waiting"/"skipped"
    epochs: dict[int, tuple[dict[str, Any], int]] = field(default_factory=dict)
    per_second: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # int(time) -> samples
    rss: dict[int, _Rss] = field(default_factory=dict)  # pid -> growth
    newest: int = -1
    steps_seen: int = 0
    epochs_once: int = 0

    def feed(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == "step":
            self._step(rec)
        elif kind == "epoch":
            self._epoch(rec)

    def _step(self, rec: dict[str, Any]) -> None:
        step, rank = int(rec["step"]), int(rec["rank"])
        self.steps_seen += 1
        self.per_second[int(rec["t"])] += int(rec["trained"])
        contributors = tuple(rec["contributors"])
        # a waiting joiner or a rank with no batch left is a contributor with an empty
        # contribution (counted in no average); a skipped straggler must not be one at all
        if rank in contributors and rec["skipped"]:
            raise ChaosFailure(f"wrong contributors: step {step} lists rank {rank}, which reported it as skipped "
                               f"(the group closed the step without it)")
        if rec["trained"] and rank not in contributors:
            raise ChaosFailure(f"wrong contributors: rank {rank} trained {rec['trained']} samples in step {step} "
                               f"but is not among its contributors {list(contributors)}")
        if rec["skipped"]:
            self.absent.setdefault(step, {})[rank] = "skipped"
        seen = self.contributors.setdefault(step, (contributors, rank))
        if seen[0] != contributors:
            raise ChaosFailure(f"wrong contributors: step {step} has contributors {list(seen[0])} on rank {seen[1]} "
                               f"but {list(contributors)} on rank {rank}")
        for r in contributors:
            if r in self.absent.get(step, {}):
                raise ChaosFailure(f"wrong contributors: step {step} lists rank {r}, which reported it as skipped")
        if rec.get("digest") is not None:
            first = self.digests.setdefault(step, (rec["digest"], rank))
            if first[0] != rec["digest"]:
                raise ChaosFailure(f"wrong sum: after step {step} rank {first[1]} holds parameters {first[0]} but "
                                   f"rank {rank} holds {rec['digest']}")
        self._rss(int(rec["pid"]), int(rec["rss"]))
        if step > self.newest:
            self.newest = step
            for table in (self.digests, self.contributors, self.absent):
                for old in [s for s in table if s < step - WINDOW]:
                    del table[old]

    def _rss(self, pid: int, rss: int) -> None:
        r = self.rss.setdefault(pid, _Rss())
        r.steps += 1
        if r.steps <= self.warm_steps:
            r.base = max(r.base, rss)
            return
        r.peak = max(r.peak, rss)
        if r.peak - r.base > self.rss_limit_bytes:
            raise ChaosFailure(f"memory growth: process {pid} grew from {r.base / 2**20:.0f} MiB (first "
                               f"{self.warm_steps} steps) to {r.peak / 2**20:.0f} MiB after {r.steps} steps")

    def _epoch(self, rec: dict[str, Any]) -> None:
        number, rank = int(rec["epoch"]), int(rec["rank"])
        if rec["complete"] and not rec["once"]:
            raise ChaosFailure(f"epoch {number} finished but not exactly once (rank {rank}'s audit): "
                               f"{rec['repeated']} samples committed twice or more, {rec['missing']} missing")
        if rec["repeated"]:
            raise ChaosFailure(f"epoch {number} (stopped early) committed {rec['repeated']} samples twice "
                               f"(rank {rank}'s audit)")
        summary = {k: rec[k] for k in SUMMARY_FIELDS}
        first = self.epochs.setdefault(number, (summary, rank))
        if first[0] != summary:
            raise ChaosFailure(f"epoch {number}: rank {first[1]} audited {first[0]} but rank {rank} {summary}")
        if first[1] == rank and rec["once"]:
            self.epochs_once += 1
        for old in [e for e in self.epochs if e < number - 8]:
            del self.epochs[old]

    def committed_between(self, t0: float, t1: float) -> int:
        """Samples committed (summed over ranks) in the whole seconds from t0 to t1."""
        return sum(n for sec, n in self.per_second.items() if int(t0) <= sec < int(t1))
