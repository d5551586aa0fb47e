"""`fttree bench` and `fttree analyze`: the seed thesis's evaluation, reproduced
(the engine: bench_plan.py, bench_run.py, bench_summary.py, bench_report.py and bench_plots.py)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from ..core.config import Config
from ..errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


def _checked_uplinks(text: str) -> str:
    """An --uplink spec, or a usage error naming the flag."""
    from .units import parse_uplinks

    try:
        return str(parse_uplinks(text))
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--uplink") from None


def _split(text: str, convert: Callable[[str], Any], what: str) -> tuple[Any, ...]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return tuple(convert(p) for p in items)
    except (ValueError, ConfigError) as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint=what) from None


def _positive_list(what: str, text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, or a usage error naming the flag."""
    def one(part: str) -> int:
        n = int(part)
        if n < 1:
            raise ValueError(f"{n} is not positive")
        return n

    items = _split(text, one, what)
    if not items:
        raise click.BadParameter(f"{text!r}: give at least one", param_hint=what)
    return items


def _out_option(f: F) -> F:
    return click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"),
                        show_default=True, help="Where the JSON and PNG files go.")(f)


def _straggler(world: int, uplink: str, budget: int, dry_run: bool, out_dir: Path) -> None:
    """--straggler: the slow-compute pattern behind each rate; straggler.md in out_dir."""
    from .bench_diloco import run as run_training
    from .bench_straggler import DATA, configs
    from .units import split_uplink_list

    rates = [_checked_uplinks(spec) for spec in split_uplink_list(uplink)]
    if dry_run:
        for rate in rates:
            for c in configs(budget):
                click.echo(f"{rate}: {c.label}: {c.local_steps} steps")
        return
    tables = run_training(rates, world, budget, click.echo, configs, DATA)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "straggler.md").write_text("\n\n".join(tables) + "\n")
    if len(tables) < len(rates):
        sys.exit(1)


def _long_run(steps: int, step_timeout: float, out_dir: Path, dry_run: bool) -> None:
    from . import longrun
    from .bench_run import execute, machine_info

    spec = longrun.spec(steps, step_timeout_s=step_timeout)
    click.echo(f"fttree bench --long-run: {spec.label}, {steps} steps; output in {out_dir}/", err=True)
    if dry_run:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="fttree-bench-") as tmp, \
            click.progressbar(length=steps, label="long run", file=sys.stderr, show_eta=True) as bar:
        res = execute(spec, Path(tmp), on_step=lambda step: bar.update(1))
    machine["load_avg_after"] = _loadavg()
    try:
        fig = longrun.figure(res)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(longrun.render(fig))
    times = [res.step_time(s) for s in res.complete_steps()]
    (out_dir / "long_run.json").write_text(json.dumps({"machine": machine, "argv": sys.argv, "figure": fig.to_json(),
                                                      "step_times_s": times}, indent=1))
    if not fig.met:
        sys.exit(1)


@click.command()
@click.option("--workers", default="3,7", show_default=True, help="Worker counts of the Table 1-2 matrix (3,7,15,31).")
@click.option("--timeouts", default="0.5,1.0", show_default=True,
              help="Backup timeouts in seconds (Table 1: 0.5, Table 2: 1).")
@click.option("--patterns", default="none,1,2p,2s,crash-leaf,crash-interior,crash-root,hang", show_default=True,
              help="Fault patterns: none, 1 (cut 1-0), 2p (cut 3-1 and 5-2), 2s (cut 3-1 and 1-0); node failures, "
                   "each a run of its own with a worker process killed or stopped before step 8: crash-leaf, "
                   "crash-interior (rank 1), crash-root, hang (rank 2, 3 steps).")
@click.option("--policies", default="static,adaptive", show_default=True,
              help="Timeout policies; adaptive is skipped while fttree has no timeout_policy.")
@click.option("--size", "size_text", default="mlp", show_default=True,
              help="Tensor of the matrix: mlp (the thesis's 407,050 float32), 1.6MB, or an element count.")
@click.option("--sizes", "sizes_text", default="4KB,mlp,16MB,100MB", show_default=True,
              help="Size sweep against gloo ('' to skip).")
@click.option("--sweep-workers", default="3,7", show_default=True, help="Worker counts of the size sweep.")
@click.option("--sweep-policies", default="static,adaptive", show_default=True,
              help="Timeout policies of the size sweep (big tensors are where static timeouts misfire).")
@click.option("--link-memory/--no-link-memory", default=True, show_default=True,
              help="Let fttree route later steps around a link found broken (off: every faulted step re-detects, "
                   "as in the thesis).")
@click.option("--window", type=click.IntRange(1, 50), default=6, show_default=True,
              help="Steps per fault window (the thesis: steps 5-10).")
@click.option("--gap", type=click.IntRange(1, 50), default=4, show_default=True, help="Clean steps after each window.")
@click.option("--clean-steps", type=click.IntRange(1, 500), default=10, show_default=True,
              help="Measured steps of each no-fault baseline run.")
@click.option("--gloo/--no-gloo", default=True, show_default=True, help="Measure torch.distributed gloo.")
@click.option("--plain/--no-plain", default=True, show_default=True, help="Measure the plain tree (no backups).")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Write Figs. 14-17 and the sweep as PNG.")
@click.option("--fig11-trials", type=click.IntRange(min=0), default=2000, show_default=True,
              help="Monte Carlo trials per height for Fig. 11 (0: skip).")
@click.option("--step-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="A worker gives up on a step after this many seconds.")
@click.option("--chunk-bytes", type=click.IntRange(min=1), default=None, help="fttree chunk size (default: the API's).")
@click.option("--long-run", type=click.IntRange(min=1100), default=None, metavar="STEPS",
              help="Instead of the matrix: STEPS steps of 3 workers, 25 chunks a step, and the median of the last "
                   "500 step times over steps 100-599 (target <= 1.1: nothing may grow with the steps run).")
@click.option("--uplink", default="", metavar="RATE",
              help="Give every rank its own uplink of RATE (tc units: 100mbit, 1gbit; 100mbit,3=10mbit: rank 3 at "
                   "10 Mbit/s, which fttree's workers are told, so their trees' shares follow it): the runs go into "
                   "a private network namespace under netem/uplink.sh, gloo's ranks bound to their own addresses "
                   "like fttree's; prints each rank's bytes per step and each step against the least any allreduce "
                   "could take over those uplinks, and each fttree run's false "
                   "events. fttree runs at its defaults (the sweep's policy: adaptive unless --sweep-policies says "
                   "otherwise). Only the size sweep runs (--sizes, --sweep-workers). Needs root, ip and tc.")
@click.option("--tuned", is_flag=True,
              help="With --uplink: also run fttree with the timeouts derived from the declared rate, beside its "
                   "defaults.")
@click.option("--measured", is_flag=True,
              help="With uneven --uplink: do not tell fttree's workers the rates; they measure their uplinks and "
                   "the shares follow once the view holds the figures (the first steps run on even shares).")
@click.option("--loss", type=click.FloatRange(min=0, max=50), default=0.0, metavar="PERCENT",
              help="With --uplink: every rank's links drop this share of packets (netem/loss.sh), for gloo too.")
@click.option("--compression", "compression_text", default="", metavar="LIST",
              help="Also run the size sweep's fttree with these wire compressions (bf16, fp16; slow-bf16: with "
                   "uneven --uplink, only the ranks slower than the default rate send their sums as bf16).")
@click.option("--trees", "trees_text", default="double,rotated", show_default=True, metavar="LIST",
              help="Also run the size sweep's fttree on these tree families (double, rotated; '' for none) beside "
                   "the single tree (\"fttree static\"); the --compression runs use the last of them.")
@click.option("--elastic", type=click.IntRange(min=3), default=None, metavar="WORKERS",
              help="Instead of the matrix: the join/leave pattern with WORKERS workers (a killed rank restarted "
                   "and synced from a peer, then a graceful leave; the thesis MLP).")
@click.option("--diloco", type=click.IntRange(min=2), default=None, metavar="WORKERS",
              help="Instead of the matrix: gloo DDP, fttree DDP and fttree DiLoCo (each H of --sync-every; "
                   "float32, int8 and sparse; eager; a worker killed and restarted) training to gloo's accuracy "
                   "behind each --uplink rate (default 10mbit,100mbit).")
@click.option("--straggler", type=click.IntRange(min=3), default=None, metavar="WORKERS",
              help="Instead of the matrix: one worker's compute twice as slow (emulated device time), gloo DDP "
                   "against fttree waiting and fttree with straggler_policy=deadline, training the thesis MLP to "
                   "gloo's accuracy behind each --uplink rate (default 100mbit); audits each epoch's samples.")
@click.option("--budget", type=click.IntRange(min=1), default=30, show_default=True,
              help="--diloco, --straggler: gloo DDP's training steps (its final accuracy is the target).")
@click.option("--hidden", type=click.IntRange(min=1), default=None, metavar="UNITS",
              help="--diloco: the MLP's hidden units (default 1280, 1.02M parameters; 12800 is 10.2M).")
@click.option("--sync-every", "sync_every_text", default="8,32,128", show_default=True, metavar="LIST",
              help="--diloco: DiLoCo's local steps per outer step, one run each.")
@click.option("--compute-s", type=click.FloatRange(min=0), default=0.0, metavar="S",
              help="--diloco: every worker also spends S seconds per local step as its device would (7 workers "
                   "on a few cores cannot compute side by side), so the compute share is the device's.")
@click.option("--ddp-steps", type=click.IntRange(min=2), default=None, metavar="K",
              help="--diloco: run DDP behind the uplinks for K steps only (its step time and bytes) and for "
                   "--budget with the limits lifted (its steps to the target); the time to the target is the "
                   "product, labelled derived. For models whose DDP step takes minutes.")
@click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True, metavar="R",
              help="--diloco: DiLoCo runs train max(4 x --budget, R x H) local steps: more rounds for "
                   "the steady figures (compute share, bytes per outer step) of a long run.")
@click.option("--dry-run", is_flag=True, help="Print the runs and exit.")
@click.option("--strict", is_flag=True, help="Exit 1 if any step failed or gave an inexact sum (default: report only).")
@_out_option
def bench(workers: str, timeouts: str, patterns: str, policies: str, size_text: str, sizes_text: str,
          sweep_workers: str, sweep_policies: str, link_memory: bool, window: int, gap: int, clean_steps: int,
          gloo: bool, plain: bool, plots: bool,
          fig11_trials: int, step_timeout: float, chunk_bytes: int | None, long_run: int | None,
          elastic: int | None, uplink: str, tuned: bool, measured: bool, loss: float, compression_text: str,
          trees_text: str,
          diloco: int | None, straggler: int | None, budget: int, hidden: int | None, sync_every_text: str,
          compute_s: float, ddp_steps: int | None, rounds: int, dry_run: bool, strict: bool,
          out_dir: Path) -> None:
    """Reproduce the thesis's evaluation (Tables 1-2, Figures 11 and 14-17) against gloo and a plain tree,
    and measure node failures (a worker killed or stopped) beside the link patterns.

    Prints the tables and the issue's performance targets, and writes bench.json (every raw
    step time of every rank) and the PNG figures to --out."""
    from .bench_patterns import NODE_PATTERNS, PATTERNS, POLICIES
    from .bench_plan import BenchOptions, plan
    from .bench_plots import plot_steps
    from .bench_report import render
    from .bench_run import execute, machine_info
    from .bench_summary import Summary
    from .bench_uplinks import Uplinks
    from .units import parse_size, split_uplink_list

    if long_run is not None:
        _long_run(long_run, step_timeout, out_dir, dry_run)
        return
    if diloco is not None:
        from functools import partial

        from .bench_diloco import DATA, configs, data_args
        from .bench_diloco import run as run_diloco

        rates = [_checked_uplinks(spec) for spec in split_uplink_list(uplink or "10mbit,100mbit")]
        make = partial(configs, sync_every=_positive_list("--sync-every", sync_every_text), ddp_steps=ddp_steps or 0,
                       rounds=rounds)
        if dry_run:
            for rate in rates:
                for c in make(budget):
                    shaped = (f" with the limits lifted, then {c.shaped_steps} behind the uplinks (derived)"
                              if c.shaped_steps else "")
                    click.echo(f"{rate}: {c.label}: {c.local_steps} local steps{shaped}")
            return
        model_data = (data_args(hidden) if hidden else DATA) + (("--compute-s", f"{compute_s:g}") if compute_s else ())
        tables = run_diloco(rates, diloco, budget, click.echo, make, model_data)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "diloco.md").write_text("\n\n".join(tables) + "\n")
        if len(tables) < len(rates):
            sys.exit(1)
        return
    if straggler is not None:
        _straggler(straggler, uplink or "100mbit", budget, dry_run, out_dir)
        return
    if elastic is not None:
        from .bench_elastic import run as run_elastic

        if not run_elastic(elastic, 600, error=lambda why: click.echo(why, err=True)):
            sys.exit(1)
        return

    def positive(text: str) -> int:
        n = int(text)
        if not 1 <= n <= 254:
            raise ValueError("worker counts must be 1..254")
        return n

    def pattern(text: str) -> str:
        if text not in PATTERNS + NODE_PATTERNS:
            raise ValueError(f"unknown pattern {text!r}; known: {', '.join(PATTERNS + NODE_PATTERNS)}")
        return text

    def policy(text: str) -> str:
        if text not in POLICIES:
            raise ValueError(f"unknown policy {text!r}; known: {', '.join(POLICIES)}")
        return text

    def timeout(text: str) -> float:
        t = float(text)
        if not t > 0:
            raise ValueError("timeouts must be positive")
        return t

    try:
        matrix_size = parse_size(size_text)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--size") from None
    if uplink:
        _checked_uplinks(uplink)
        # the Table 1-2 matrix (fault windows, the plain tree) is about timeouts, not bandwidth
        workers, plain, fig11_trials = "", False, 0
        ctx = click.get_current_context()
        if ctx.get_parameter_source("sweep_policies") is ParameterSource.DEFAULT:
            sweep_policies = Config().timeout_policy  # what a user gets
    elif tuned or loss:
        raise click.UsageError("--tuned and --loss need --uplink")
    if measured and not (uplink and "=" in uplink):
        raise click.UsageError("--measured needs uneven uplinks (--uplink 100mbit,3=10mbit)")

    def family(text: str) -> str:
        if text not in ("double", "rotated", *(("single",) if uplink else ())):
            raise ValueError(f"unknown tree family {text!r}; the sweep adds double or rotated to the single tree")
        return text

    def compression(text: str) -> str:
        if text == "slow-bf16" and not (uplink and "=" in uplink):
            raise ValueError("slow-bf16 needs uneven uplinks (--uplink 100mbit,3=10mbit)")
        if text not in ("bf16", "fp16", "slow-bf16"):
            raise ValueError("compressions are bf16, fp16 and slow-bf16")
        return text

    chosen = _split(patterns, pattern, "--patterns")
    opts = BenchOptions(
        workers=_split(workers, positive, "--workers"), timeouts=_split(timeouts, timeout, "--timeouts"),
        patterns=tuple(p for p in chosen if p in PATTERNS) or ("none",),
        node_patterns=tuple(p for p in chosen if p in NODE_PATTERNS), policies=_split(policies, policy, "--policies"),
        size=matrix_size, sweep_sizes=_split(sizes_text, parse_size, "--sizes"),
        sweep_workers=_split(sweep_workers, positive, "--sweep-workers"), window=window, gap=gap,
        clean_steps=clean_steps, gloo=gloo, plain=plain, step_timeout_s=step_timeout, chunk_bytes=chunk_bytes,
        link_memory=link_memory, sweep_policies=_split(sweep_policies, policy, "--sweep-policies"), uplink=uplink,
        compressions=_split(compression_text, compression, "--compression"),
        trees=_split(trees_text, family, "--trees"), tuned=tuned, loss=loss, measured=measured)
    if not opts.timeouts or not opts.policies:
        raise click.UsageError("--timeouts and --policies need at least one value")
    runs, notes = plan(opts)
    total = sum(r.steps for r in runs)
    click.echo(f"fttree bench: {len(runs)} runs, {total} steps; output in {out_dir}/", err=True)
    for n in notes:
        click.echo(f"note: {n}", err=True)
    if dry_run:
        for r in runs:
            click.echo(f"{r.label}: {r.steps} steps" + (f", faults {r.faults!r}" if r.faults else "")
                       + (f", node fault {r.node_faults!r} on the worker processes" if r.node_faults else "")
                       + (" (plain tree of the survivors)" if r.purpose == "survivors" else ""))
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    if uplink:
        machine["uplink"] = uplink
    started = time.monotonic()
    uplinks = Uplinks(uplink, loss=loss) if uplink else None
    from .realfaults import signals_raise

    exit_on_kill = signals_raise(lambda signum: SystemExit(128 + signum))  # tc limits, namespace, workers go
    with tempfile.TemporaryDirectory(prefix="fttree-bench-") as tmp, exit_on_kill, \
            click.progressbar(length=total, label="benchmark", file=sys.stderr, show_eta=True,
                              item_show_func=_show_label) as bar:
        results = []
        try:
            if uplinks is not None:
                uplinks.start(max(r.world for r in runs))
            for spec in runs:
                bar.update(0, spec.label)
                res = execute(spec, Path(tmp), on_step=_advance(bar, spec.label), uplinks=uplinks)
                missing = spec.steps - len(res.complete_steps())
                if missing > 0:
                    bar.update(missing, spec.label)  # a failed run still moves the bar to its end
                results.append(res)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        finally:
            if uplinks is not None:
                uplinks.close()  # the limits and the namespace go, whatever happened
    machine["load_avg_after"] = _loadavg()
    machine["bench_wall_s"] = time.monotonic() - started
    summary = Summary(opts=opts, results=results, notes=notes)
    click.echo(render(summary))
    data = summary.to_json(machine, sys.argv)
    fig11 = None
    if fig11_trials:
        from . import analyze as a

        fig11 = a.monte_carlo(list(range(1, 6)), fig11_trials)
        data["fig11"] = a.as_json(fig11, 0)
        click.echo("")
        click.echo(a.render(fig11))
    (out_dir / "bench.json").write_text(json.dumps(data, indent=1, default=str))  # before plotting can fail
    pngs: list[Path] = []
    if plots:
        try:
            pngs = plot_steps(summary, out_dir)
            if fig11 is not None:
                pngs.append(a.plot(fig11, out_dir / "fig11.png"))
        except ImportError as exc:
            click.echo(f"no plots: {exc} (pip install matplotlib)", err=True)
    click.echo(f"\n{len(results)} runs in {machine['bench_wall_s']:.0f} s on {machine.get('cpu', '?')} "
               f"({machine.get('cores')} cores, load {_fmt_load(machine.get('load_avg'))} -> "
               f"{_fmt_load(machine['load_avg_after'])}); raw figures in {out_dir / 'bench.json'}"
               + (f", plots: {', '.join(p.name for p in pngs)}" if pngs else ""))
    bad = [r for r in results if not r.ok]
    if bad:
        click.echo(f"{len(bad)} of {len(results)} runs had failed or inexact steps (see above)", err=True)
        if strict:
            sys.exit(1)


def _advance(bar: Any, label: str) -> Callable[[int], None]:
    """Move the progress bar one step for each step done on every rank of a run."""
    def on_step(step: int) -> None:
        bar.update(1, label)

    return on_step


def _show_label(label: str | None) -> str | None:
    return label


def _loadavg() -> tuple[float, float, float] | None:
    try:
        import os

        return os.getloadavg()
    except OSError:
        return None


def _fmt_load(load: Any) -> str:
    return "?" if not load else f"{load[0]:.1f}"


@click.command()
@click.option("--heights", default="1,2,3,4,5,6", show_default=True, help="Tree heights (height h: 2^(h+1)-1 workers).")
@click.option("--trials", type=click.IntRange(min=1), default=5000, show_default=True, help="Random orders per height.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--plots/--no-plots", default=True, show_default=True)
@_out_option
def analyze(heights: str, trials: int, seed: int, plots: bool, out_dir: Path) -> None:
    """Random link failures tolerated until some node is isolated, by tree height (thesis Figure 11)."""
    from . import analyze as a

    def height(text: str) -> int:
        h = int(text)
        if not 1 <= h <= 9:
            raise ValueError("heights must be 1..9")
        return h

    results = a.monte_carlo(list(_split(heights, height, "--heights")), trials, seed)
    click.echo(a.render(results))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fig11.json").write_text(json.dumps(a.as_json(results, seed), indent=1))
    written = [out_dir / "fig11.json"]
    if plots:
        try:
            written.append(a.plot(results, out_dir / "fig11.png"))
        except ImportError as exc:
            click.echo(f"no plot: {exc} (pip install matplotlib)", err=True)
    click.echo(f"wrote {', '.join(str(p) for p in written)}")
