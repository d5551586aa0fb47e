"""Planning `fttree bench`, the seed thesis's evaluation (chapter 7) with fttree beside
torch.distributed's gloo allreduce and a plain tree: the options (BenchOptions) and every run
they ask for (`plan`), with notes on what is left out and why.

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
from dataclasses import dataclass

from ..core.config import Config
from .bench_patterns import (
    FIRST_WINDOW,
    NODE_LATER,
    NODE_PATTERNS,
    PATTERN_LINKS,
    PATTERN_NAMES,
    PATTERNS,
    POLICIES,
    WARMUP_STEPS,
    node_rule,
    node_window,
    pattern_links,
)
from .bench_spec import DEFAULT_TREES, SLOW_BF16, RunSpec
from .sizes import THESIS_MLP_PARAMS
from .units import parse_uplinks


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
    uplink: str = ""  # every rank's uplink (tc rate, e.g. 100mbit; 100mbit,3=10mbit: rank 3's its own), shaped
    # in a namespace by uplink.sh
    compressions: tuple[str, ...] = ()  # extra fttree sweep runs with these wire compressions
    # the sweep also runs fttree on these tree families (besides the single tree); compressed runs
    # use the last of them
    trees: tuple[str, ...] = ("double", "rotated")
    tuned: bool = False  # under uplinks: also fttree with timeouts derived from the declared rate
    loss: float = 0.0  # under uplinks: percent of packets every rank's links drop
    measured: bool = False  # under uneven uplinks: fttree is not told the rates, its workers measure them

    @property
    def uplink_bps(self) -> float:
        """The default uplink, bits per second (0: loopback unshaped)."""
        return parse_uplinks(self.uplink).bps if self.uplink else 0.0

    @property
    def uneven(self) -> str:
        """The --uplink spec when some rank has a rate of its own ('' otherwise)."""
        return self.uplink if self.uplink and parse_uplinks(self.uplink).by_rank else ""

    def declared(self, world: int) -> tuple[tuple[str, str], ...]:
        """fttree's setting for unequal uplinks: each rank's, declared (none when all are equal)."""
        text = parse_uplinks(self.uplink).declared(world) if self.uplink and not self.measured else ""
        return (("uplinks_by_rank", text),) if text else ()

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


# --measured: steps before the view holds every worker's uplink (the pace rounds after the
# first steps), which run on even shares; they are warm-up
MEASURING_STEPS = 3


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
    if opts.measured and opts.uneven:
        warmup += MEASURING_STEPS
    timeout_s, step_timeout_s = opts.timeouts[0], opts.step_timeout_s
    settings: tuple[tuple[str, str], ...] = ()
    if opts.uplink:
        timeout_s, step_timeout_s = Config().timeout_s, Config().step_timeout_s
    if tuned:
        timeout_s, step_timeout_s, settings = uplink_timeouts(size, opts.uplink_bps, compression, timeout_s,
                                                              step_timeout_s)
    settings += opts.declared(world)
    if compression == SLOW_BF16:  # ranks below the default uplink send their sums up as bf16
        settings += (("bf16_uplinks_below", f"{opts.uplink_bps / 8:g}"),)
    return RunSpec(kind="fttree", world=world, size=size, steps=warmup + measured, warmup=warmup,
                   timeout_s=timeout_s, policy=policy, purpose="sweep", compression=compression,
                   step_timeout_s=step_timeout_s, chunk_bytes=opts.chunk_bytes, link_memory=opts.link_memory,
                   uplink_bps=opts.uplink_bps, uplinks=opts.uneven, settings=settings, trees=trees, tuned=tuned,
                   loss=opts.loss)


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
                                    purpose="sweep", uplink_bps=bps, uplinks=opts.uneven, loss=opts.loss))
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
