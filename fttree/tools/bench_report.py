"""The text `fttree bench` prints: Tables 1-2 beside the thesis's figures, the cost of faults in
timeouts, the no-fault comparison with the baselines, the size sweep, bytes on the wire and
false events under uplinks, wire compression, node failures, and the performance targets."""

from __future__ import annotations

from .bench_patterns import (
    HANG_STEPS,
    LATER_TARGET,
    NODE_STEP,
    NODE_TARGET_S,
    PATTERN_NAMES,
    POLICIES,
    pattern_links,
    thesis_figure,
)
from .bench_summary import Summary
from .units import format_bytes


def _num(v: float | None, width: int = 7) -> str:
    return f"{v:>{width}.3f}" if v is not None else f"{'-':>{width}}"


def _cell(value: float | None, thesis: float | None, width: int = 7) -> str:
    return _num(value, width) + (f" [{thesis:.3f}]" if thesis is not None else " " * 8)


def _ms(v: float | None, width: int) -> str:
    return f"{v * 1000:>{width}.1f}" if v is not None else f"{'-':>{width}}"


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
                   f"against the least time any allreduce could take over these uplinks (shares.bound_seconds: "
                   f"max(N / slowest, 2(p-1)N / sum of the uplinks))")
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
