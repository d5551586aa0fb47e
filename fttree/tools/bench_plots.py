"""The PNG figures of `fttree bench` (matplotlib, imported only when plotting): time per step of
the fault runs (the thesis's Figs. 14-17), of the node-failure runs, and the size sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .bench_patterns import FIGURE_OF_WORLD, HANG_STEPS, NODE_STEP, PATTERN_NAMES
from .bench_summary import Summary
from .units import format_bytes


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
