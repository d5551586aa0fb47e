"""The figures of a finished `fttree bench`: each system's medians at each point (Summary), the
node-failure rows (NodeRow), the bytes against the bound under uplinks, the issues'
performance targets met or missed, and bench.json's content."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..core.config import Config
from ..core.shares import bound_seconds
from ..core.trees import TREE_FAMILIES
from .bench_patterns import LATER_TARGET, NODE_TARGET_S, PATTERN_NAMES, POLICIES, THESIS
from .bench_plan import BenchOptions
from .bench_spec import DEFAULT_TREES, RunResult
from .units import format_bytes, parse_uplinks, ring_bound_bytes


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
        if o.uneven:
            out += self._uneven_targets()
        elif o.uplink:
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

    def _uneven_targets(self) -> list[tuple[bool, str]]:
        """Uplinks of unequal speed (issue 28): from 16 MB on, float32 fttree at most 0.65x
        gloo's step and within 15% of the bound; bf16 at most 0.35x gloo's step."""
        out: list[tuple[bool, str]] = []
        o = self.opts
        for bwr in self.bandwidth_rows():
            if bwr["system"] == "gloo" or bwr["size"] * 4 < 16_000_000 or not bwr["median_s"]:
                continue
            what = f"uplinks {o.uplink}, {bwr['workers']} workers, {format_bytes(bwr['size'])}, {bwr['system']}"
            gloo = self.nofault("gloo", bwr["workers"], bwr["size"])
            compressed = bwr["system"].endswith(("bf16", "fp16"))
            limit = 0.35 if compressed else 0.65
            if gloo:
                out.append((bwr["median_s"] <= limit * gloo, f"{what}: step/gloo {bwr['median_s'] / gloo:.2f} "
                                                             f"(target <= {limit:g})"))
            if not compressed and bwr["bound_s"]:
                ratio = bwr["median_s"] / bwr["bound_s"]
                out.append((ratio <= 1.15, f"{what}: step/bound {ratio:.2f} (target <= 1.15)"))
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
                    bound_s = (bound_seconds(size * 4, parse_uplinks(o.uplink).bytes_per_s(world)) if o.uplink
                               else None)
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
