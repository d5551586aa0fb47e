"""The old names of `fttree bench`'s engine, kept for tests/test_bench.py and test_bench_uplink.py,
which reach everything through one namespace (`from fttree.tools import bench as b`). New code
imports from the module that does the job:

    units.py           sizes and rates (parse_size, format_bytes, parse_rate, format_rate, ring_bound_bytes)
    bench_patterns.py  the thesis's fault patterns and figures, the node-failure patterns, the targets
    bench_spec.py      one run: what it is (RunSpec) and what it measured (RunResult)
    bench_run.py       running one: worker processes, node faults, records (execute); machine_info
    bench_uplinks.py   emulated per-rank uplinks in a network namespace (Uplinks)
    bench_plan.py      the options and every run they ask for (BenchOptions, plan)
    bench_summary.py   the figures of a finished bench and its targets (Summary, NodeRow)
    bench_report.py    the text it prints (render)
    bench_plots.py     its PNG figures (plot_steps)
"""

from __future__ import annotations

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
from .bench_plan import BenchOptions, fault_plan, node_runs, plan, sweep_steps, uplink_timeouts
from .bench_plots import plot_node_failures, plot_steps
from .bench_report import render, render_false_events, render_node_failures
from .bench_run import execute, machine_info, worker_commands
from .bench_spec import DEFAULT_TREES, RunResult, RunSpec
from .bench_summary import NodeRow, Summary
from .bench_uplinks import Uplinks
from .units import format_bytes, format_rate, parse_rate, parse_size, ring_bound_bytes

__all__ = [
    "DEFAULT_TREES", "FIGURE_OF_WORLD", "FIRST_WINDOW", "HANG_STEPS", "LATER_TARGET", "NODE_LATER", "NODE_PATTERNS",
    "NODE_STEP", "NODE_TARGET_S", "PATTERNS", "PATTERN_LINKS", "PATTERN_NAMES", "POLICIES", "THESIS", "WARMUP_STEPS",
    "BenchOptions", "NodeRow", "RunResult", "RunSpec", "Summary", "Uplinks", "execute", "fault_plan", "format_bytes",
    "format_rate", "machine_info", "node_rule", "node_runs", "node_victim", "node_window", "parse_rate", "parse_size",
    "pattern_links", "plan", "plot_node_failures", "plot_steps", "render", "render_false_events",
    "render_node_failures", "ring_bound_bytes", "sweep_steps", "thesis_figure", "uplink_timeouts", "worker_commands",
]
