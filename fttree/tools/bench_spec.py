"""One run of `fttree bench`: what it is (RunSpec) and what it measured (RunResult).

A run is N worker processes on this machine, rank r on 127.0.0.(r+1), each doing timed
allreduce steps of the same checked float32 tensor and printing one JSON record per step
(bench_worker.py for fttree and the plain tree, gloo_baseline.py for gloo). A step's time is
the slowest rank's time for it, the moment the step was done everywhere. RunResult holds the
records and derives the figures from them: step times, medians, failed steps, evictions,
detection times and false events. Starting the processes is bench_run.py's job.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.config import Config
from ..core.faults import FaultSchedule
from .bench_patterns import PATTERNS, WARMUP_STEPS
from .nodefaults import NodeFault, node_faults
from .units import format_bytes, format_rate, parse_uplinks

DEFAULT_TREES = Config().trees  # the API's default: the matrix and node-failure runs use it
SLOW_BF16 = "slow-bf16"  # a sweep compression: only ranks below the default uplink send bf16 sums


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """One group of worker processes doing `steps` allreduce steps."""

    kind: str  # "fttree", "plain" (fttree without backups) or "gloo"
    world: int
    size: int  # float32 elements
    steps: int
    warmup: int = WARMUP_STEPS
    timeout_s: float = 0.5
    policy: str = "static"
    faults: str = ""
    windows: tuple[tuple[str, int, int], ...] = ()  # (pattern, first step, last step)
    purpose: str = "matrix"  # "matrix", "sweep", "node" (a node failure) or "survivors" (its plain baseline)
    step_timeout_s: float = 30.0
    chunk_bytes: int | None = None
    link_memory: bool = True
    uplink_bps: float = 0.0  # every rank's uplink, bits/s (0: loopback unshaped)
    uplinks: str = ""  # the --uplink spec when ranks differ ("100mbit,3=10mbit"), for the label
    compression: str = ""  # fttree wire compression ("" for none, "bf16", "fp16", SLOW_BF16)
    trees: str = DEFAULT_TREES  # fttree: the trees a step's chunks spread over (Config.trees)
    settings: tuple[tuple[str, str], ...] = ()  # other Config fields for fttree's workers (--set)
    node_faults: str = ""  # crash/hang rules the bench carries out on the worker processes
    footprint_every: int = 0  # fttree: each worker reports its bookkeeping sizes after every this many steps
    tuned: bool = False  # fttree under uplinks: timeouts derived from the declared rate (uplink_timeouts)
    loss: float = 0.0  # percent of packets every rank's links drop (netem/loss.sh), under uplinks

    def struck(self) -> list[NodeFault]:
        return node_faults(FaultSchedule(self.node_faults, world=self.world), self.steps) if self.node_faults else []

    @property
    def label(self) -> str:
        what = self.kind if self.kind != "fttree" else f"fttree t={self.timeout_s:g}s {self.policy}"
        if (self.kind == "fttree" and self.uplink_bps and not self.tuned and self.timeout_s == Config().timeout_s
                and self.policy == Config().timeout_policy
                and all(name in ("uplinks_by_rank", "bf16_uplinks_below") for name, _ in self.settings)):
            what = "fttree defaults"  # (told the ranks' uplinks, when they differ)
        if self.kind == "fttree" and not self.link_memory:
            what += " no-link-memory"
        if self.kind == "fttree" and self.trees != DEFAULT_TREES:
            what += f" {self.trees} trees"
        if self.compression:
            what += f" {self.compression}"
        if self.tuned:
            what += " tuned"
        where = f", uplinks {self.uplinks or format_rate(self.uplink_bps)}" if self.uplink_bps else ""
        if self.kind == "fttree" and self.uplinks and "uplinks_by_rank" not in dict(self.settings):
            where += " measured"  # not told the rates (bench --measured)
        if self.loss:
            where += f", {self.loss:g}% loss"
        return f"{what}, {self.world} workers, {format_bytes(self.size)}{where}"

    def deadline_s(self) -> float:
        per_step = 5.0 + 3 * self.timeout_s + self.size * 4 / 20e6  # generous: a 2-core box shared with others
        if self.uplink_bps:
            slowest = min(parse_uplinks(self.uplinks).bytes_per_s(self.world)) * 8 if self.uplinks else self.uplink_bps
            per_step += 3 * (self.size * 4 * 8) / slowest  # an interior rank sends 3N; a ring waits for the slowest
            per_step = max(per_step, self.step_timeout_s)  # a failed step still ends within the run
        return 120.0 + self.steps * per_step + len(self.windows) * self.step_timeout_s

    def pattern_of(self, step: int) -> str:
        """The pattern a step ran under: "none" for a clean step, "after" for the steps after a
        node failure (a smaller group: they are not no-fault steps of this run's world)."""
        for pattern, first, last in self.windows:
            if first <= step <= last:
                return pattern
            if self.purpose == "node" and step > last:
                return "after"
        return "none"


@dataclass
class RunResult:
    spec: RunSpec
    records: dict[int, dict[int, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    stderr_tail: dict[int, list[str]] = field(default_factory=dict)
    startup_s: float = 0.0
    wall_s: float = 0.0
    error: str = ""
    sent_bytes: dict[int, int] = field(default_factory=dict)  # rank -> bytes its uplink carried (--uplink)

    def bytes_per_step(self) -> dict[int, float]:
        """What each rank sent per step: its uplink counter (start-up, every step and the acks
        of what it received) over the steps run."""
        return {r: b / self.spec.steps for r, b in self.sent_bytes.items()} if self.spec.steps else {}

    membership: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its "membership" record
    #: rank -> (step, sizes) the worker reported every `spec.footprint_every` steps
    footprints: dict[int, list[tuple[int, dict[str, int]]]] = field(default_factory=lambda: defaultdict(list))
    signalled: dict[int, float] = field(default_factory=dict)  # victim -> monotonic time of its SIGKILL/SIGSTOP

    def counted_ranks(self, step: int) -> set[int]:
        """Ranks whose record of `step` counts: all but those a node fault took out by then."""
        return set(range(self.spec.world)) - {f.rank for f in self.spec.struck() if f.first <= step}

    def counted(self, step: int) -> list[dict[str, Any]]:
        want = self.counted_ranks(step)
        return [r for rank, r in self.records.get(step, {}).items() if rank in want]

    def complete_steps(self) -> list[int]:
        return sorted(s for s, recs in self.records.items() if self.counted_ranks(s) <= set(recs))

    def step_time(self, step: int) -> float:
        """The slowest rank's time for the step (how long until it was done everywhere)."""
        return max(float(r["duration_s"]) for r in self.counted(step))

    def step_cpu(self, step: int) -> float:
        """CPU seconds all ranks spent inside the step's allreduce call: what a loaded machine
        does not inflate (much), unlike wall time."""
        return sum(float(r.get("cpu_s", 0.0)) for r in self.counted(step))

    def step_ok(self, step: int) -> bool:
        return all(r["exact"] and not r["error"] for r in self.counted(step))

    def all_exact(self) -> bool:
        return all(r["exact"] for s in self.records for r in self.counted(s))

    def evictions(self) -> list[tuple[int, int]]:
        """(rank, epoch) of every eviction any worker reported: in a run without node faults,
        each is a false eviction."""
        return sorted({(int(e["rank"]), int(e["epoch"])) for m in self.membership.values() for e in m["evictions"]})

    def detection_s(self) -> float | None:
        """The slowest survivor's time from the first suspicion it heard to the commit of the
        view without the victim (the membership layer's `detected_after_s`)."""
        times = [float(e["detected_after_s"]) for m in self.membership.values() for e in m["evictions"]]
        return max(times) if times else None

    def false_events(self) -> dict[str, int]:
        """What the fault machinery did in this run, summed over the ranks: backup watches that
        expired, data or results sent around a link, detours link memory chose, suspicions,
        evictions and view changes other than the pace. In a run without faults each one is
        false: the fault tolerance took a healthy link or node for a broken one."""
        notes = [e for recs in self.records.values() for r in recs.values() for e in r.get("events", ())]
        views = dict(sorted({(int(v["epoch"]), tuple(v["members"])) for m in self.membership.values()
                             for v in m["views"]}))
        before, changed = tuple(range(self.spec.world)), 0
        for members in views.values():  # a pace change keeps the members: not a change here
            changed += sorted(members) != sorted(before)
            before = members
        return {"expiries": sum(e["kind"] == "timeout" for e in notes),
                "relays": sum(e["cause"] in ("data_relayed", "result_pushed") for e in notes),
                "detours": sum(e["kind"] == "detour" for e in notes),
                "suspicions": sum(int(m.get("suspicions", 0)) for m in self.membership.values()),
                "evictions": len(self.evictions()),
                "view_changes": changed}

    def signal_to_view_s(self) -> float | None:
        """From the SIGKILL or SIGSTOP to the last survivor installing the view without the
        victim: detection, agreement and the message delays, end to end."""
        if not self.signalled:
            return None
        at = min(self.signalled.values())
        installs = [float(v["at"]) for m in self.membership.values() for v in m["views"]
                    if set(v["evicted"]) & set(self.signalled)]
        return max(installs) - at if installs else None

    @property
    def ok(self) -> bool:
        return not self.error and len(self.complete_steps()) == self.spec.steps and self.all_exact()

    def measured(self, pattern: str = "none") -> list[int]:
        """Post-warmup steps under `pattern` that finished exactly on every rank (a failed step
        is counted in `failed_steps`, never in a median)."""
        return [s for s in self.complete_steps()
                if s >= self.spec.warmup and self.spec.pattern_of(s) == pattern and self.step_ok(s)]

    def failed_steps(self) -> list[int]:
        return [s for s in self.complete_steps() if not self.step_ok(s)]

    def times(self, pattern: str = "none") -> list[float]:
        return [self.step_time(s) for s in self.measured(pattern)]

    def median(self, pattern: str = "none") -> float | None:
        t = self.times(pattern)
        return statistics.median(t) if t else None

    def cpu_median(self, pattern: str = "none") -> float | None:
        c = [self.step_cpu(s) for s in self.measured(pattern)]
        return statistics.median(c) if c else None

    def first_of_window(self, pattern: str) -> float | None:
        """The first faulted step of the pattern's window: the one that pays for detection (later
        steps may route around a link already known broken)."""
        for p, first, _last in self.spec.windows:
            if p == pattern and first in self.complete_steps():
                return self.step_time(first) if self.step_ok(first) else None
        return None

    def worst_of_window(self, pattern: str) -> float | None:
        """The slowest step of the pattern's window (a hang's detection may land in any of them)."""
        for p, first, last in self.spec.windows:
            steps = [s for s in range(first, last + 1) if s in self.complete_steps()]
            if p == pattern and steps and all(self.step_ok(s) for s in steps):
                return max(self.step_time(s) for s in steps)
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": asdict(self.spec), "label": self.spec.label, "ok": self.ok, "error": self.error,
            "startup_s": self.startup_s, "wall_s": self.wall_s, "exit_codes": self.exit_codes,
            "stderr_tail": {r: t for r, t in self.stderr_tail.items() if t and self.exit_codes.get(r) != 0},
            "step_times_s": {s: self.step_time(s) for s in self.complete_steps()},
            "medians_s": {p: self.median(p) for p in PATTERNS if self.times(p)},
            "first_faulted_step_s": {p: self.first_of_window(p) for p, _, _ in self.spec.windows},
            "cpu_medians_s": {p: self.cpu_median(p) for p in PATTERNS if self.times(p)},
            "failed_steps": self.failed_steps(),
            "sent_bytes": self.sent_bytes,
            "evictions": self.evictions(), "detection_s": self.detection_s(),
            "signal_to_view_s": self.signal_to_view_s(), "signalled": self.signalled,
            "membership": self.membership,
            "records": {s: [recs[r] for r in sorted(recs)] for s, recs in sorted(self.records.items())},
        }
