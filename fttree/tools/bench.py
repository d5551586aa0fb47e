"""The measurement engine of `fttree bench`: the seed thesis's evaluation (chapter 7) with fttree,
beside torch.distributed's gloo allreduce and a plain (non-fault-tolerant) tree.

Every measurement is a *run*: N worker processes on this machine, rank r on 127.0.0.(r+1), each
doing timed allreduce steps of the same checked float32 tensor and printing one JSON record per
step (bench_worker.py for fttree and the plain tree, gloo_baseline.py for gloo). A step's time is
the slowest rank's time for it, the moment the step was done everywhere.

One fault-tolerant run covers every fault pattern of a (workers, timeout, policy) cell: the
in-process fault schedule opens one window per pattern, the first at steps 5-10 as in the
thesis's Figs. 14-17, with clean steps between windows. So startup is paid once per cell, and
the per-step trace of the run *is* the figure. No-fault times are the clean steps of that run.

Node failures are runs of their own (a dead worker does not come back): one per pattern (crash
of a leaf, of an interior rank, of the root; a hang), where the bench kills (SIGKILL) or stops
(SIGSTOP, later SIGCONT) one worker process by pid before step NODE_STEP (nodefaults.py), beside
a plain tree of the survivors. They report the faulted step minus the run's no-fault median,
the later steps against that plain tree, and how long detection and agreement took. The link
patterns' runs report their false evictions: ranks the group left out although none had died.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.config import Config
from ..core.trees import TREE_FAMILIES
from .bench_patterns import (
    FIGURE_OF_WORLD,
    FIRST_WINDOW,
    HANG_STEPS,
    LATER_TARGET,
    NODE_LATER,
    NODE_PATTERNS,
    NODE_STEP,
    NODE_TARGET_S,
    PATTERN_LINKS,
    PATTERN_NAMES,
    PATTERNS,
    POLICIES,
    THESIS,
    WARMUP_STEPS,
    node_rule,
    node_victim,
    node_window,
    pattern_links,
    thesis_figure,
)
from .bench_run import execute, machine_info, worker_commands
from .bench_spec import DEFAULT_TREES, RunResult, RunSpec
from .bench_uplinks import Uplinks
from .demo import THESIS_MLP_PARAMS
from .units import format_bytes, format_rate, parse_rate, parse_size, ring_bound_bytes

__all__ = [
    "DEFAULT_TREES", "FIGURE_OF_WORLD", "FIRST_WINDOW", "HANG_STEPS", "LATER_TARGET", "NODE_LATER", "NODE_PATTERNS",
    "NODE_STEP", "NODE_TARGET_S", "PATTERNS", "PATTERN_LINKS", "PATTERN_NAMES", "POLICIES", "THESIS", "WARMUP_STEPS",
    "BenchOptions", "NodeRow", "RunResult", "RunSpec", "Summary", "Uplinks", "execute", "fault_plan", "format_bytes",
    "format_rate", "machine_info", "node_rule", "node_runs", "node_victim", "node_window", "parse_rate", "parse_size",
    "pattern_links", "plan", "plot_node_failures", "plot_steps", "render", "render_false_events",
    "render_node_failures", "ring_bound_bytes", "sweep_steps", "thesis_figure", "uplink_timeouts", "worker_commands",
]


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions:
    workers: tuple[int, ...] = (3, 7)
    timeouts: tuple[float, ...] = (0.5, 1.0)
    patterns: tuple[str, ...] = PATTERNS
    policies: tuple[str, ...] = POLICIES
    size: int = THESIS_MLP_PARAMS
    sweep_sizes: tuple[int, ...] = (1000, THESIS_MLP_PARAMS, 4_000_000, 25_000_000)
    sweep_workers: tuple[int, ...] = (3, 7)
    window: int = 6  # steps per fault window (5..10 in the thesis)
    gap: int = 4  # clean steps after each window
    clean_steps: int = 10  # measured steps of a no-fault run
    gloo: bool = True
    plain: bool = True
    step_timeout_s: float = 30.0
    chunk_bytes: int | None = None
    link_memory: bool = True
    sweep_policies: tuple[str, ...] = ("static",)
    uplink: str = ""  # every rank's uplink (tc rate, e.g. 100mbit): runs in a namespace under uplink.sh
    compressions: tuple[str, ...] = ()  # extra fttree sweep runs with these wire compressions
    # the sweep also runs fttree on these tree families (besides the single tree); compressed runs
    # use the last of them
    trees: tuple[str, ...] = ("double", "rotated")
    tuned: bool = False  # under uplinks: also fttree with timeouts derived from the declared rate
    loss: float = 0.0  # under uplinks: percent of packets every rank's links drop

    @property
    def uplink_bps(self) -> float:
        return parse_rate(self.uplink) if self.uplink else 0.0

    @property
    def base_family(self) -> str:
        """The trees of the sweep's first fttree runs: the thesis's single tree on loopback,
        the library's default under uplinks (fttree as a user gets it)."""
        return DEFAULT_TREES if self.uplink else "single"

    @property
    def compression_trees(self) -> str:
        """The tree family compressed sweep runs use: the last of `trees` (single if none)."""
        return self.trees[-1] if self.trees else self.base_family

    node_patterns: tuple[str, ...] = NODE_PATTERNS

    @property
    def node_policy(self) -> str:
        """Node-failure runs use one policy: the API's default (adaptive) when it is measured."""
        return "adaptive" if "adaptive" in self.policies else self.policies[0]


def sweep_steps(size: int, uplink: bool = False) -> tuple[int, int]:
    """(warmup, measured) steps for a size-sweep point: fewer for big tensors. Without slow
    uplinks a big step is short against `linger_s` (2 s), for which finished steps hold their
    buffers, so fttree's buffer pools (core/buffers.py) fill over its first three steps; a long
    run only ever sees them full, so those steps are warm-up (gloo's as well)."""
    nbytes = size * 4
    if nbytes <= 4_000_000:
        return WARMUP_STEPS, 10
    if uplink:  # seconds a step: few are enough, and the noise is small against them
        return 1, 5 if nbytes <= 40_000_000 else 3
    # on loopback a big step is CPU-bound and short: medians of 3 steps swung from 1.3x to 2.2x
    # gloo's between runs minutes apart, so measure more of them
    return 3, 10 if nbytes <= 40_000_000 else 8


def fault_plan(world: int, patterns: Sequence[str], window: int, gap: int,
               clean_steps: int) -> tuple[int, str, tuple[tuple[str, int, int], ...], list[str]]:
    """(steps, schedule, windows, skipped patterns) of one fault-tolerant run of `world` workers."""
    faulted = [p for p in patterns if p != "none"]
    usable = [p for p in faulted if pattern_links(world, p) is not None]
    skipped = [p for p in faulted if p not in usable]
    if not usable:
        return WARMUP_STEPS + clean_steps, "", (), skipped
    windows, rules = [], []
    for i, p in enumerate(usable):
        first = FIRST_WINDOW + i * (window + gap)
        last = first + window - 1
        windows.append((p, first, last))
        rules += [f"cut {a}-{b} @{first}..{last}" for a, b in PATTERN_LINKS[p]]
    steps = FIRST_WINDOW + len(usable) * (window + gap)
    return steps, "; ".join(rules), tuple(windows), skipped


def uplink_timeouts(size: int, bps: float, compression: str, timeout_s: float,
                    step_timeout_s: float) -> tuple[float, float, tuple[tuple[str, str], ...]]:
    """(timeout_s, step_timeout_s, other settings) for fttree under uplinks of `bps`.

    The defaults suit a LAN: a backup watch allows 0.5 s plus queued bytes at 50 MB/s
    (timeouts.py), and a neighbour silent for 4 s at most is suspected. Behind a 100 Mbit/s
    uplink shared by three tree links, one 4 MiB chunk takes a second and a 100 MB step half a
    minute, so every watch would fire and relays would clog the backup links. Scaled to the
    expected step time T (an interior rank sends 3N): watches T, node deadlines up to 2T,
    and the step deadline 4T + 10 s. (Watches of T/2 still fired on healthy links with 16 MB
    in bf16 in 1 MiB chunks, 7 workers: mean bytes 0.70-0.85 of the bound where the data is
    0.50.) A fault then costs about T, which is what waiting for data queued behind a slow
    uplink costs anyway. Watches also allow queued bytes at the
    uplink's pace (`uplink_bytes_per_s`), not a LAN's."""
    nbytes = size * 4 * (0.5 if compression else 1.0)
    step_s = 3 * nbytes * 8 / bps
    watch = max(timeout_s, step_s)
    ceiling = max(2.0, step_s)
    return watch, max(step_timeout_s, 4 * step_s + 10), (("adaptive_ceiling_s", f"{ceiling:g}"),
                                                          ("uplink_bytes_per_s", f"{bps / 8:g}"))


def _sweep_run(opts: BenchOptions, world: int, size: int, policy: str, compression: str,
               trees: str = "single", tuned: bool = False) -> RunSpec:
    """One fttree point of the size sweep. Under uplinks at the library's defaults, as a user
    gets it (nothing derived from the declared rate); `tuned`: with the timeouts
    uplink_timeouts derives from it."""
    warmup, measured = sweep_steps(size, bool(opts.uplink))
    timeout_s, step_timeout_s = opts.timeouts[0], opts.step_timeout_s
    settings: tuple[tuple[str, str], ...] = ()
    if opts.uplink:
        timeout_s, step_timeout_s = Config().timeout_s, Config().step_timeout_s
    if tuned:
        timeout_s, step_timeout_s, settings = uplink_timeouts(size, opts.uplink_bps, compression, timeout_s,
                                                              step_timeout_s)
    return RunSpec(kind="fttree", world=world, size=size, steps=warmup + measured, warmup=warmup,
                   timeout_s=timeout_s, policy=policy, purpose="sweep", compression=compression,
                   step_timeout_s=step_timeout_s, chunk_bytes=opts.chunk_bytes, link_memory=opts.link_memory,
                   uplink_bps=opts.uplink_bps, settings=settings, trees=trees, tuned=tuned, loss=opts.loss)


def plan(opts: BenchOptions) -> tuple[list[RunSpec], list[str]]:
    """Every run the options ask for, and notes on what is left out and why."""
    notes: list[str] = []
    policies = list(opts.policies)
    runs: list[RunSpec] = []
    common = {"step_timeout_s": opts.step_timeout_s, "chunk_bytes": opts.chunk_bytes}
    bps = opts.uplink_bps
    ft_common = {**common, "link_memory": opts.link_memory}
    sweep_policies = [p for p in opts.sweep_policies if p in policies or p == "static"]
    for world in opts.workers:
        steps, faults, windows, skipped = fault_plan(world, opts.patterns, opts.window, opts.gap, opts.clean_steps)
        for p in skipped:
            notes.append(f"{world} workers: pattern {PATTERN_NAMES[p]!r} is n/a (links {PATTERN_LINKS[p]} "
                         f"missing or not bridgeable by one-hop backups)")
        for t in opts.timeouts:
            for pol in policies:
                runs.append(RunSpec(kind="fttree", world=world, size=opts.size, steps=steps, timeout_s=t,
                                    policy=pol, faults=faults, windows=windows, **ft_common,  # type: ignore[arg-type]
                                    uplink_bps=bps))
        baseline_steps = WARMUP_STEPS + opts.clean_steps
        if opts.plain:
            runs.append(RunSpec(kind="plain", world=world, size=opts.size, steps=baseline_steps,
                                timeout_s=opts.timeouts[0], **common, uplink_bps=bps))  # type: ignore[arg-type]
        if opts.gloo:
            runs.append(RunSpec(kind="gloo", world=world, size=opts.size, steps=baseline_steps, uplink_bps=bps))
    for world in opts.sweep_workers:
        for size in opts.sweep_sizes:
            warmup, measured = sweep_steps(size, bool(opts.uplink))
            for pol in sweep_policies:
                runs.append(_sweep_run(opts, world, size, pol, "", trees=opts.base_family))
            first_policy = (sweep_policies or ["static"])[0]
            for family in opts.trees:
                if family != opts.base_family:
                    runs.append(_sweep_run(opts, world, size, first_policy, "", trees=family))
            for comp in opts.compressions:
                runs.append(_sweep_run(opts, world, size, first_policy, comp, trees=opts.compression_trees))
            if opts.uplink and opts.tuned:
                runs.append(_sweep_run(opts, world, size, first_policy, "", trees=DEFAULT_TREES, tuned=True))
            if opts.gloo and not (size == opts.size and world in opts.workers):
                runs.append(RunSpec(kind="gloo", world=world, size=size, steps=warmup + measured, warmup=warmup,
                                    purpose="sweep", uplink_bps=bps, loss=opts.loss))
    if not opts.uplink:  # node failures are about timeouts, not bandwidth
        runs += node_runs(opts, notes)
    return runs, notes


def node_runs(opts: BenchOptions, notes: list[str]) -> list[RunSpec]:
    """One run per node pattern and worker count, and a plain tree of the survivors beside them."""
    runs: list[RunSpec] = []
    for world in opts.workers:
        usable = []
        for pattern in opts.node_patterns:
            rule = node_rule(world, pattern)
            if rule is None:
                notes.append(f"{world} workers: pattern {PATTERN_NAMES[pattern]!r} is n/a (no such rank, or the "
                             f"survivors would be no majority)")
                continue
            first, last = node_window(pattern)
            runs.append(RunSpec(kind="fttree", world=world, size=opts.size, steps=last + 1 + NODE_LATER,
                                timeout_s=opts.timeouts[0], policy=opts.node_policy, purpose="node", node_faults=rule,
                                windows=((pattern, first, last),), step_timeout_s=opts.step_timeout_s,
                                chunk_bytes=opts.chunk_bytes, link_memory=opts.link_memory))
            usable.append(pattern)
        if usable:
            runs.append(RunSpec(kind="plain", world=world - 1, size=opts.size, steps=WARMUP_STEPS + opts.clean_steps,
                                timeout_s=opts.timeouts[0], purpose="survivors", step_timeout_s=opts.step_timeout_s,
                                chunk_bytes=opts.chunk_bytes))
    return runs


@dataclass(frozen=True, slots=True)
class NodeRow:
    """What the bench reports for one node-failure run."""

    world: int
    pattern: str
    rule: str
    nofault_s: float | None  # the run's own no-fault median (steps before the fault)
    faulted_s: float | None  # the crash's step; for a hang the slowest step of its window
    later_s: float | None  # median of the steps after the fault (its window)
    plain_s: float | None  # a plain tree of the survivors (world - 1), no fault
    detection_s: float | None
    signal_to_view_s: float | None
    failed: tuple[int, ...]
    error: str

    @property
    def extra_s(self) -> float | None:
        return None if self.faulted_s is None or self.nofault_s is None else self.faulted_s - self.nofault_s

    @property
    def later_ratio(self) -> float | None:
        return None if self.later_s is None or not self.plain_s else self.later_s / self.plain_s


# ---- summary -----------------------------------------------------------------------------------


@dataclass
class Summary:
    opts: BenchOptions
    results: list[RunResult]
    notes: list[str]

    def find(self, kind: str, world: int, size: int, timeout_s: float | None = None,
             policy: str = "static", purposes: tuple[str, ...] = ("matrix", "sweep"),
             compression: str = "", trees: str = DEFAULT_TREES, tuned: bool = False) -> RunResult | None:
        for r in self.results:
            s = r.spec
            if (s.kind == kind and s.world == world and s.size == size and s.purpose in purposes
                    and s.compression == compression and (kind != "fttree" or s.trees == trees)
                    and s.tuned == tuned
                    and (timeout_s is None or kind != "fttree" or s.timeout_s == timeout_s
                         or bool(s.uplink_bps and s.purpose == "sweep"))  # timeouts scaled to the uplinks
                    and (kind != "fttree" or s.policy == policy)):
                return r
        return None

    def nofault(self, kind: str, world: int, size: int, policy: str = "static",
                compression: str = "", trees: str = DEFAULT_TREES) -> float | None:
        """No-fault median at `size`: fttree from its first-timeout run (a timeout fires only on a
        fault, or a spurious one on a big tensor), the baselines from their own runs."""
        r = self.find(kind, world, size, self.opts.timeouts[0] if kind == "fttree" else None, policy,
                      compression=compression, trees=trees)
        return None if r is None else r.median("none")

    def nofault_cpu(self, kind: str, world: int, size: int, policy: str = "static",
                    trees: str = DEFAULT_TREES) -> float | None:
        r = self.find(kind, world, size, self.opts.timeouts[0] if kind == "fttree" else None, policy, trees=trees)
        return None if r is None else r.cpu_median("none")

    def node_rows(self) -> list[NodeRow]:
        rows = []
        for r in self.results:
            if r.spec.purpose != "node":
                continue
            pattern, first, last = r.spec.windows[0]
            plain = self.find("plain", r.spec.world - 1, r.spec.size, purposes=("survivors", "matrix"))
            faulted = r.first_of_window(pattern) if first == last else r.worst_of_window(pattern)
            rows.append(NodeRow(world=r.spec.world, pattern=pattern, rule=r.spec.node_faults,
                                nofault_s=r.median("none"), faulted_s=faulted, later_s=r.median("after"),
                                plain_s=None if plain is None else plain.median("none"),
                                detection_s=r.detection_s(), signal_to_view_s=r.signal_to_view_s(),
                                failed=tuple(r.failed_steps()), error=r.error))
        return rows

    def false_evictions(self) -> tuple[int, list[str]]:
        """Evictions in the link-fault runs (nobody died there, so each one is false): (runs
        looked at, one line per eviction)."""
        runs = [r for r in self.results if r.spec.kind == "fttree" and r.spec.purpose == "matrix" and r.spec.windows]
        return len(runs), [f"{r.spec.label}: rank {rank} left out of view {epoch}" for r in runs
                           for rank, epoch in r.evictions()]

    def sweep_policies(self) -> list[str]:
        """Policies of the first (base family's) sweep runs."""
        ran = {r.spec.policy for r in self.results if r.spec.kind == "fttree" and r.spec.purpose == "sweep"
               and r.spec.trees == self.opts.base_family and not r.spec.compression and not r.spec.tuned}
        if not self.opts.uplink:
            ran.add("static")
        return sorted(ran, key=POLICIES.index) or [Config().timeout_policy]

    def sweep_systems(self) -> list[tuple[str, str, str, str]]:
        """The fttree variants of the size sweep, as (name, policy, compression, tree family):
        "fttree static" (the single tree), "fttree double", "fttree rotated", and each
        compression on the family it ran on ("fttree rotated bf16"), in that order; only those
        that ran (and the single tree's policies always)."""
        ran = {(r.spec.policy, r.spec.compression, r.spec.trees) for r in self.results
               if r.spec.kind == "fttree" and r.spec.purpose == "sweep"}
        first = (self.sweep_policies() or ["static"])[0]
        base, policies = self.opts.base_family, self.sweep_policies()
        out = [(f"fttree {p}" if base == "single" else f"fttree {base}" if len(policies) == 1
                else f"fttree {base} {p}", p, "", base) for p in policies]
        families = [f for f in TREE_FAMILIES if f != base]
        out += [(f"fttree {f}", first, "", f) for f in families if (first, "", f) in ran]
        for c in self.opts.compressions:
            for family in TREE_FAMILIES:
                if (first, c, family) in ran:
                    out.append((f"fttree {'' if family == 'single' else family + ' '}{c}", first, c, family))
        return out

    def targets(self) -> list[tuple[bool, str]]:
        """The issue's performance targets, each (met, sentence with the numbers)."""
        out: list[tuple[bool, str]] = []
        o = self.opts
        for world in o.workers:
            ft, gloo, plain = (self.nofault(k, world, o.size) for k in ("fttree", "gloo", "plain"))
            if world in (7, 15) and ft and gloo:
                out.append((ft <= gloo, f"no fault, {world} workers, {format_bytes(o.size)}: fttree/gloo "
                                        f"{ft / gloo:.2f} (target <= 1.00)"))
            if ft and plain:
                out.append((ft <= 1.15 * plain, f"no fault, {world} workers: fttree/plain tree {ft / plain:.2f} "
                                                f"(target <= 1.15)"))
            for t in o.timeouts:
                r = self.find("fttree", world, o.size, t)
                if r is None or (base := r.median("none")) is None:
                    continue
                for p, limit, name in (("1", t + 2 * base, f"t + 2 x no-fault = {t + 2 * base:.3f} s"),
                                       ("2s", base + 1.5 * t, f"no-fault + 1.5 t = {base + 1.5 * t:.3f} s")):
                    window = [w for w in r.spec.windows if w[0] == p]
                    if not window:
                        continue
                    _, first_step, last_step = window[0]
                    failed = [s for s in r.failed_steps() if first_step <= s <= last_step]
                    first, med = r.first_of_window(p), r.median(p)
                    what = f"{PATTERN_NAMES[p]}, {world} workers, t={t:g} s"
                    if failed or first is None or med is None:
                        out.append((False, f"{what}: steps {failed} failed (target {name})"))
                        continue
                    out.append((max(first, med) <= limit, f"{what}: first faulted step {first:.3f} s, median "
                                                          f"{med:.3f} s (target <= {name})"))
        for row in self.node_rows():
            name = f"{PATTERN_NAMES[row.pattern]} ({row.rule}), {row.world} workers"
            limit = NODE_TARGET_S[row.pattern]
            if row.extra_s is None or row.failed or row.error:
                out.append((False, f"{name}: failed steps {list(row.failed)} {row.error}".rstrip()))
                continue
            assert row.faulted_s is not None
            assert row.nofault_s is not None
            out.append((row.extra_s <= limit, f"{name}: faulted step {row.faulted_s:.3f} s - no fault "
                                              f"{row.nofault_s:.3f} s = {row.extra_s:.3f} s (target <= {limit:g} s)"))
            if row.later_ratio is not None:
                assert row.later_s is not None
                assert row.plain_s is not None
                out.append((row.later_ratio <= LATER_TARGET,
                            f"{name}: later steps {row.later_s:.3f} s / plain tree of {row.world - 1} "
                            f"{row.plain_s:.3f} s = {row.later_ratio:.2f} (target <= {LATER_TARGET:g})"))
        looked, false = self.false_evictions()
        if looked:
            out.append((not false, f"false evictions in the {looked} link-fault runs: {len(false)} (target 0)"
                        + (f": {'; '.join(false[:3])}" if false else "")))
        if 7 in o.sweep_workers and not o.uplink:
            out += self._loopback_targets()
        if o.uplink:
            out += self._slow_link_targets()
            for bwr in self.bandwidth_rows():
                if bwr["system"] == "gloo" or bwr["size"] * 4 < 16_000_000:
                    continue
                what = f"uplinks {o.uplink}, {bwr['workers']} workers, {format_bytes(bwr['size'])}, {bwr['system']}"
                gloo = self.nofault("gloo", bwr["workers"], bwr["size"])
                compressed = bwr["system"].endswith(("bf16", "fp16"))
                ratio = bwr["max_bytes"] / bwr["bound_bytes"]
                if not compressed:  # the bound is float32's; a compressed run is judged by its time
                    out.append((ratio <= 1.10, f"{what}: busiest rank sends {ratio:.2f}x the 2N(p-1)/p bound "
                                               f"(target <= 1.10)"))
                if gloo and bwr["median_s"] and compressed:
                    out.append((bwr["median_s"] <= 0.55 * gloo, f"{what}: step/gloo {bwr['median_s'] / gloo:.2f} "
                                                                f"(target <= 0.55)"))
        return out

    def default_runs(self) -> list[RunResult]:
        """fttree as a user gets it under the uplinks: every setting at its default (the rotated
        trees, adaptive watches, nothing derived from the declared rate)."""
        return [r for r in self.results if r.spec.kind == "fttree" and r.spec.purpose == "sweep" and r.spec.uplink_bps
                and not r.spec.tuned and not r.spec.compression and r.spec.trees == DEFAULT_TREES
                and r.spec.policy == Config().timeout_policy]

    def _slow_link_targets(self) -> list[tuple[bool, str]]:
        """Slow is not broken: at defaults behind healthy uplinks, every step exact, no false
        event, and a step of 1 MB or more within 1.15x gloo's in the same namespace."""
        out: list[tuple[bool, str]] = []
        for run in self.default_runs():
            spec = run.spec
            what = f"defaults, {spec.label.split(', ', 1)[1]}"
            events = run.false_events()
            false = {k: v for k, v in events.items() if v}
            out.append((run.ok and not run.failed_steps() and not false,
                        f"{what}: {len(run.complete_steps())}/{spec.steps} steps, failed {run.failed_steps()}, "
                        f"exact {'yes' if run.all_exact() else 'NO'}, false events "
                        + (", ".join(f"{k} {v}" for k, v in false.items()) if false else "0") + " (target: none)"))
            gloo = self.nofault("gloo", spec.world, spec.size)
            med = run.median("none")
            if spec.size * 4 >= 1_000_000 and gloo and med:
                out.append((med <= 1.15 * gloo, f"{what}: step/gloo {med / gloo:.2f} (target <= 1.15)"))
        return out

    def _loopback_targets(self) -> list[tuple[bool, str]]:
        """Issue 14's loopback targets, 7 workers: 16 MB and 100 MB at or under gloo's step time,
        100 MB at or under gloo's CPU too (issue 11 asked 1.5x of 100 MB; this is stricter)."""
        out: list[tuple[bool, str]] = []
        o = self.opts
        for size, with_cpu in ((4_000_000, False), (25_000_000, True)):
            gloo = self.nofault("gloo", 7, size)
            gloo_cpu = self.nofault_cpu("gloo", 7, size) if with_cpu else None
            if size not in o.sweep_sizes or not gloo:
                continue
            for _name, pol, comp, family in self.sweep_systems():
                run = self.find("fttree", 7, size, o.timeouts[0], pol, trees=family)
                if run is None or comp:
                    continue
                what = f"loopback, 7 workers, {format_bytes(size)}, {pol if family == 'single' else family + ' trees'}"
                ft, failed = run.median("none"), run.failed_steps()
                if ft is None:
                    out.append((False, f"{what}: no step finished exactly"))
                    continue
                note = f"; {len(failed)} failed steps left out" if failed else ""
                out.append((ft <= gloo and not failed, f"{what}: fttree/gloo {ft / gloo:.2f} (target <= 1.00){note}"))
                cpu = run.cpu_median("none")
                if cpu and gloo_cpu:
                    out.append((cpu <= gloo_cpu, f"{what}: CPU fttree/gloo {cpu / gloo_cpu:.2f} (target <= 1.00)"))
        return out

    def bandwidth_rows(self) -> list[dict[str, Any]]:
        """Per sweep point and system under --uplink: each rank's bytes per step against the
        2N(p-1)/p bound (the busiest rank and the mean), and the median step against the time
        the bound takes at the uplink rate."""
        o = self.opts
        rows: list[dict[str, Any]] = []
        for world in o.sweep_workers:
            for size in o.sweep_sizes:
                bound = ring_bound_bytes(size, world)
                systems = [(name, self.find("fttree", world, size, o.timeouts[0], p, compression=c, trees=d))
                           for name, p, c, d in self.sweep_systems()]
                if o.tuned:
                    systems.append(("fttree tuned", self.find("fttree", world, size, trees=DEFAULT_TREES,
                                                              policy=self.sweep_policies()[0], tuned=True)))
                systems.append(("gloo", self.find("gloo", world, size)))
                for name, run in systems:
                    if run is None or not run.sent_bytes:
                        continue
                    per = run.bytes_per_step()
                    med = run.median("none")
                    bound_s = bound * 8 / o.uplink_bps if o.uplink_bps else None
                    rows.append({"workers": world, "size": size, "system": name, "bound_bytes": bound,
                                 "max_bytes": max(per.values()), "mean_bytes": sum(per.values()) / len(per),
                                 "median_s": med, "bound_s": bound_s})
        return rows

    def to_json(self, machine: dict[str, Any], argv: Sequence[str]) -> dict[str, Any]:
        return {"command": list(argv), "bandwidth": self.bandwidth_rows(),
                "machine": machine, "options": asdict(self.opts), "notes": self.notes,
                "thesis": {str(t): rows for t, rows in THESIS.items()},
                "targets": [{"met": m, "text": s} for m, s in self.targets()],
                "runs": [r.to_json() for r in self.results]}


def _num(v: float | None, width: int = 7) -> str:
    return f"{v:>{width}.3f}" if v is not None else f"{'-':>{width}}"


def _cell(value: float | None, thesis: float | None, width: int = 7) -> str:
    return _num(value, width) + (f" [{thesis:.3f}]" if thesis is not None else " " * 8)


def render(summary: Summary) -> str:
    o = summary.opts
    out: list[str] = []
    policies = sorted({r.spec.policy for r in summary.results if r.spec.kind == "fttree"}, key=POLICIES.index)
    rows = [(world, t, pol, r) for world in o.workers for t in o.timeouts for pol in policies
            if (r := summary.find("fttree", world, o.size, t, pol)) is not None]
    if rows:
        out.append(f"Tables 1-2: step seconds, {o.size:,} float32 ({format_bytes(o.size)}), slowest rank per step; "
                   f"no fault: median; faults: first faulted step / median of the window; [thesis]")
    width = {p: (15 if p == "none" else 22) for p in o.patterns}
    if rows:
        out.append(f"{'workers':>7} {'timeout':>7} {'policy':>8}  " + "  ".join(f"{PATTERN_NAMES[p]:>{width[p]}}"
                                                                            for p in o.patterns) + "  failed steps")
    for world, t, pol, r in rows:
        cells = []
        for p in o.patterns:
            th = thesis_figure(t, world, p)
            if p == "none":
                cells.append(_cell(r.median(p), th))
            elif pattern_links(world, p) is None:
                cells.append("n/a")
            else:
                first, med = r.first_of_window(p), r.median(p)
                pair = "/".join(f"{v:.3f}" if v is not None else "-" for v in (first, med))
                cells.append(pair + (f" [{th:.3f}]" if th is not None else ""))
        failed = r.failed_steps()
        tail = f"  {len(failed)} {failed}" if failed else "  0"
        if r.error:
            tail += f"  ! {r.error}"
        out.append(f"{world:>7} {t:>7g} {pol:>8}  " + "  ".join(f"{c:>{width[p]}}" for c, p in
                                                                 zip(cells, o.patterns, strict=True)) + tail)
    faulted = [p for p in o.patterns if p != "none"]
    if faulted and rows:
        out.append("")
        out.append("Cost of faults in timeouts t: first faulted step / window median, minus the no-fault median; "
                   "[thesis]")
        out.append(f"{'workers':>7} {'timeout':>7} {'policy':>8}  " + "  ".join(f"{PATTERN_NAMES[p]:>22}"
                                                                                for p in faulted))
        for world, t, pol, r in rows:
            base = r.median("none")
            cells = []
            for p in faulted:
                first, med = r.first_of_window(p), r.median(p)
                th, th0 = thesis_figure(t, world, p), thesis_figure(t, world, "none")
                if p != "none" and pattern_links(world, p) is None:
                    cells.append("n/a")
                    continue
                mine = "/".join(f"{(v - base) / t:.2f}t" if v is not None and base is not None else "-"
                                for v in (first, med))
                cells.append(mine + (f" [{(th - th0) / t:.2f}t]" if th is not None and th0 is not None else ""))
            out.append(f"{world:>7} {t:>7g} {pol:>8}  " + "  ".join(f"{c:>22}" for c in cells))
    if (o.gloo or o.plain) and o.workers:
        out.append("")
        out.append(f"No fault, same worker count and tensor ({format_bytes(o.size)}): median step seconds, and CPU "
                   f"ms per step summed over ranks")
        out.append(f"{'workers':>7} {'fttree':>8} {'plain':>8} {'gloo':>8} {'fttree/gloo':>12} {'fttree/plain':>13}"
                   f" {'cpu fttree':>11} {'cpu plain':>10} {'cpu gloo':>9}")
        for world in o.workers:
            # fttree under the first policy that ran (static unless only adaptive was asked for)
            pol = next((p for p in o.policies if summary.nofault("fttree", world, o.size, p) is not None), "static")
            ft = summary.nofault("fttree", world, o.size, pol)
            plain, gloo = (summary.nofault(k, world, o.size) for k in ("plain", "gloo"))
            cpu = [summary.nofault_cpu("fttree", world, o.size, pol),
                   *(summary.nofault_cpu(k, world, o.size) for k in ("plain", "gloo"))]
            rg = f"{ft / gloo:.2f}" if ft and gloo else "-"
            rp = f"{ft / plain:.2f}" if ft and plain else "-"
            cpus = " ".join(f"{c * 1000:>{w}.1f}" if c is not None else f"{'-':>{w}}"
                            for c, w in zip(cpu, (11, 10, 9), strict=True))
            out.append(f"{world:>7} {_num(ft, 8)} {_num(plain, 8)} {_num(gloo, 8)} {rg:>12} {rp:>13} {cpus}")
    if o.sweep_workers and o.sweep_sizes:
        # the single tree under each policy ("static", ...) and the other tree families
        systems = [(name.removeprefix("fttree "), p, d) for name, p, c, d in summary.sweep_systems() if not c]
        out.append("")
        out.append("Size sweep, no fault: median step seconds (gloo's CPU allreduce is a ring), CPU ms per step; "
                   f"fttree at t={o.timeouts[0]:g} s (double: the double binary tree; rotated: p rotated trees; "
                   f"both from 2 chunks on)")
        out.append(f"{'workers':>7} {'size':>9} " + " ".join(f"{'ft ' + n:>11}" for n, _, _ in systems)
                   + f" {'gloo':>8} " + " ".join(f"{'ft/gloo ' + n[:3]:>12}" for n, _, _ in systems) + " "
                   + " ".join(f"{'cpu ' + n[:3]:>8}" for n, _, _ in systems) + f" {'cpu gloo':>8}  failed steps")
        for world in o.sweep_workers:
            for size in o.sweep_sizes:
                gloo = summary.nofault("gloo", world, size)
                fts = [summary.nofault("fttree", world, size, p, trees=d) for _, p, d in systems]
                ratios = [f"{ft / gloo:.2f}" if ft and gloo else "-" for ft in fts]
                ft_cpus = [_ms(summary.nofault_cpu("fttree", world, size, p, trees=d), 8) for _, p, d in systems]
                sweep_failed: list[str] = []
                for n, p, d in systems:
                    run = summary.find("fttree", world, size, o.timeouts[0], p, trees=d)
                    if run is not None and run.failed_steps():
                        sweep_failed.append(f"{n} {run.failed_steps()}")
                out.append(f"{world:>7} {format_bytes(size):>9} " + " ".join(_num(ft, 11) for ft in fts)
                           + f" {_num(gloo, 8)} " + " ".join(f"{r:>12}" for r in ratios) + " " + " ".join(ft_cpus)
                           + f" {_ms(summary.nofault_cpu('gloo', world, size), 8)}  "
                           + ("; ".join(sweep_failed) if sweep_failed else "0"))
    bw = summary.bandwidth_rows()
    if bw:
        out.append("")
        out.append(f"Bytes on the wire, uplinks {o.uplink} per rank: bytes each rank sent per step (uplink counters: "
                   f"IP headers, start-up and acks included) against float32's 2N(p-1)/p bound, and the median step "
                   f"against the bound's time at that rate")
        out.append(f"{'workers':>7} {'size':>9} {'system':>16} {'bound MB':>9} {'max MB':>8} {'max/bnd':>8} "
                   f"{'mean/bnd':>9} {'step s':>8} {'bound s':>8} {'step/bnd':>9}")
        for row in bw:
            med, bs = row["median_s"], row["bound_s"]
            out.append(f"{row['workers']:>7} {format_bytes(row['size']):>9} {row['system']:>16} "
                       f"{row['bound_bytes'] / 1e6:>9.2f} {row['max_bytes'] / 1e6:>8.2f} "
                       f"{row['max_bytes'] / row['bound_bytes']:>8.2f} {row['mean_bytes'] / row['bound_bytes']:>9.2f} "
                       f"{_num(med, 8)} {_num(bs, 8)} "
                       + (f"{med / bs:>9.2f}" if med and bs else f"{'-':>9}"))
    if o.uplink:
        out += render_false_events(summary)
    if o.compressions:
        out.append("")
        out.append("Wire compression (float32 accumulation at every hop): median step seconds and ratios to gloo "
                   "float32")
        pol = (summary.sweep_policies() or ["static"])[0]
        # float32 on the trees the compressed runs used
        tree = o.compression_trees
        out.append(f"{'workers':>7} {'size':>9} {'ft f32':>11} " + " ".join(f"{'ft ' + c:>9}" for c in
                                                                            o.compressions)
                   + f" {'gloo':>8} {'f32/gloo':>9} " + " ".join(f"{c + '/gloo':>10}" for c in o.compressions)
                   + f"  ({tree} trees)")
        for world in o.sweep_workers:
            for size in o.sweep_sizes:
                f32 = summary.nofault("fttree", world, size, pol, trees=tree)
                comp = [summary.nofault("fttree", world, size, pol, c, trees=tree) for c in o.compressions]
                gloo = summary.nofault("gloo", world, size)
                out.append(f"{world:>7} {format_bytes(size):>9} {_num(f32, 11)} " + " ".join(_num(c, 9) for c in comp)
                           + f" {_num(gloo, 8)} " + (f"{f32 / gloo:>9.2f}" if f32 and gloo else f"{'-':>9}") + " "
                           + " ".join(f"{c / gloo:>10.2f}" if c and gloo else f"{'-':>10}" for c in comp))
    out += render_node_failures(summary)
    targets = summary.targets()
    if targets:
        out.append("")
        out.append("Performance targets (issues 5, 11 and 14)")
        out.extend(f"  [{'met ' if met else 'MISS'}] {text}" for met, text in targets)
    bad = [r for r in summary.results if not r.ok]
    if bad:
        out.append("")
        out.append("Runs with problems (failed steps are left out of the medians):")
        for r in bad:
            failed = r.failed_steps()
            out.append(f"  {r.spec.label}: {r.error or 'inexact result'}; failed steps {failed}")
            for step in failed[:2]:
                reasons = sorted({rec["error"] for rec in r.records[step].values() if rec["error"]})
                if reasons:
                    out.append(f"    step {step}: {reasons[0][:300]}")
    if summary.notes:
        out.append("")
        out.extend(f"note: {n}" for n in summary.notes)
    return "\n".join(out)


def render_false_events(summary: Summary) -> list[str]:
    """Under uplinks: what the fault machinery did in each fttree run. Nothing was broken, so
    every watch expiry, relay, detour, suspicion, eviction or view change is a false event."""
    runs = [r for r in summary.results if r.spec.kind == "fttree" and r.spec.purpose == "sweep"]
    if not runs:
        return []
    keys = ("expiries", "relays", "detours", "suspicions", "evictions", "view_changes")
    out = ["", "False events on healthy links (summed over ranks; pace agreements are not view changes)",
           f"{'run':<58} " + " ".join(f"{k:>12}" for k in keys) + "  failed steps"]
    for r in runs:
        events = r.false_events()
        out.append(f"{r.spec.label:<58} " + " ".join(f"{events[k]:>12}" for k in keys)
                   + f"  {r.failed_steps() or 0}")
    return out


def render_node_failures(summary: Summary) -> list[str]:
    """The node-failure table: what a dead or hung worker costs, beside the link patterns."""
    rows = summary.node_rows()
    looked, false = summary.false_evictions()
    if not rows and not looked:
        return []
    o = summary.opts
    out = [""]
    if rows:
        out.append(f"Node failures: fttree t={o.timeouts[0]:g} s {o.node_policy}, {format_bytes(o.size)}; the bench "
                   f"kills (SIGKILL) or stops (SIGSTOP, SIGCONT {HANG_STEPS} steps later) one worker process before "
                   f"step {NODE_STEP}; seconds; [target]")
        out.append(f"{'workers':>7}  {'pattern':<15} {'fault':<12} {'no fault':>8} {'faulted':>8} {'extra':>16} "
                   f"{'later':>7} {'plain n-1':>9} {'later/plain':>14} {'detection':>9} {'signal->view':>12}  "
                   f"failed steps")
        for row in rows:
            extra = "-" if row.extra_s is None else f"{row.extra_s:.3f} [<= {NODE_TARGET_S[row.pattern]:g}]"
            ratio = "-" if row.later_ratio is None else f"{row.later_ratio:.2f} [<= {LATER_TARGET:g}]"
            tail = f"{len(row.failed)} {list(row.failed)}" if row.failed else "0"
            if row.error:
                tail += f"  ! {row.error}"
            out.append(f"{row.world:>7}  {PATTERN_NAMES[row.pattern]:<15} {row.rule:<12} {_num(row.nofault_s, 8)} "
                       f"{_num(row.faulted_s, 8)} {extra:>16} {_num(row.later_s, 7)} {_num(row.plain_s, 9)} "
                       f"{ratio:>14} {_num(row.detection_s, 9)} {_num(row.signal_to_view_s, 12)}  {tail}")
        out.append("  faulted: the crash's step, or the slowest step of the hang's window; extra: faulted - no fault;"
                   " later: median of the steps after it; detection: first suspicion to the new view (slowest "
                   "survivor); signal->view: the kill or stop to the last survivor's new view")
    if looked:
        names = ", ".join(PATTERN_NAMES[p] for p in o.patterns if p != "none")
        out.append(f"False evictions in the {looked} link-fault runs ({names or 'no fault windows'}): {len(false)} "
                   f"[target 0]")
        out.extend(f"  {line}" for line in false)
    return out


def _ms(v: float | None, width: int) -> str:
    return f"{v * 1000:>{width}.1f}" if v is not None else f"{'-':>{width}}"


# ---- figures -----------------------------------------------------------------------------------


def plot_steps(summary: Summary, out_dir: Path) -> list[Path]:
    """Figs. 14-17: time per step of each fault-tolerant matrix run, fault windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    o = summary.opts
    colours = {"1": "tab:red", "2p": "tab:orange", "2s": "tab:purple"}
    for world in o.workers:
        runs = [r for r in summary.results if r.spec.kind == "fttree" and r.spec.world == world
                and r.spec.purpose == "matrix"]
        if not runs:
            continue
        fig, axes = plt.subplots(1, len(o.timeouts), figsize=(8 * len(o.timeouts), 4), squeeze=False)
        for ax, t in zip(axes[0], o.timeouts, strict=True):
            shaded: set[str] = set()
            for r in runs:
                if r.spec.timeout_s != t:
                    continue
                steps = r.complete_steps()
                ax.plot(steps, [r.step_time(s) for s in steps], marker="o", ms=3, label=f"fttree ({r.spec.policy})")
                for p, first, last in r.spec.windows:
                    if p not in shaded:
                        ax.axvspan(first - 0.5, last + 0.5, color=colours.get(p, "grey"), alpha=0.12,
                                   label=f"{PATTERN_NAMES[p]} (steps {first}-{last})")
                        shaded.add(p)
            for kind, style in (("plain", ":"), ("gloo", "--")):
                m = summary.nofault(kind, world, o.size)
                if m is not None:
                    ax.axhline(m, linestyle=style, color="grey", lw=1, label=f"{kind} no-fault median")
            ax.set(xlabel="step (iteration)", ylabel="time per step (s)",
                   title=f"timeout {t * 1000:g} ms")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        n = FIGURE_OF_WORLD.get(world)
        fig.suptitle(f"{'Fig. ' + str(n) + ': ' if n else ''}time per iteration, fault-tolerant tree of {world} "
                     f"workers ({format_bytes(o.size)})")
        fig.tight_layout()
        path = out_dir / (f"fig{n}_{world}workers.png" if n else f"steps_{world}workers.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    paths += plot_node_failures(summary, out_dir, plt)
    if o.sweep_workers and o.sweep_sizes:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for world in o.sweep_workers:
            lines = [(name, "-^" if c else {"single": "-o", "double": "-D"}.get(d, "-v"), "fttree", p, c, d)
                     for name, p, c, d in summary.sweep_systems()]
            lines.append(("gloo", "--s", "gloo", "static", "", "single"))
            for name, style, kind, pol, comp, family in lines:
                pts = [(s * 4, m) for s in o.sweep_sizes
                       if (m := summary.nofault(kind, world, s, pol, comp, family)) is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, label=f"{name}, {world} workers")
        where = f", uplinks {o.uplink} per rank" if o.uplink else ", loopback"
        ax.set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="median step (s)",
               title=f"allreduce time by tensor size, no fault{where}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "size_sweep.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_node_failures(summary: Summary, out_dir: Path, plt: Any) -> list[Path]:
    """Time per step of each node-failure run, the fault marked, beside the plain tree of the
    survivors and the link patterns' no-fault median (log scale: a hang costs seconds)."""
    paths = []
    o = summary.opts
    for world in o.workers:
        runs = [r for r in summary.results if r.spec.purpose == "node" and r.spec.world == world]
        if not runs:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for r in runs:
            steps = r.complete_steps()
            pattern = r.spec.windows[0][0]
            ax.plot(steps, [r.step_time(s) for s in steps], marker="o", ms=3,
                    label=f"{PATTERN_NAMES[pattern]} ({r.spec.node_faults})")
        first, last = NODE_STEP, NODE_STEP + HANG_STEPS - 1
        ax.axvspan(first - 0.5, last + 0.5, color="tab:red", alpha=0.1, label=f"fault (steps {first}-{last})")
        plain = summary.find("plain", world - 1, o.size, purposes=("survivors", "matrix"))
        if plain is not None and (m := plain.median("none")) is not None:
            ax.axhline(m, linestyle=":", color="grey", lw=1, label=f"plain tree of {world - 1}, no fault")
        link = summary.nofault("fttree", world, o.size, o.node_policy)
        if link is not None:
            ax.axhline(link, linestyle="--", color="grey", lw=1, label=f"fttree {world}, no fault (link runs)")
        ax.set(yscale="log", xlabel="step", ylabel="time per step (s)",
               title=f"node failures, {world} workers ({format_bytes(o.size)}), t={o.timeouts[0]:g} s "
                     f"{o.node_policy}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = out_dir / f"node_failures_{world}workers.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
