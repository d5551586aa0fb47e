"""`fttree yardstick`: this checkout against a fixed reference commit, in alternating pairs.

A performance claim made only against the previous commit hides a loss taken in steps that
each look like noise (b577911 -> a962cb3 lost 2.5x on loopback that way). This runs the same
`fttree launch` command from this checkout and from a git worktree of the reference commit,
A B A B ..., and prints each pair's median step and CPU per step, then the median ratio of
the pairs: the machine's drift between pairs cancels out of a ratio taken within one pair.

CPU per step is each worker's process CPU time (every thread) from its first step's submit after
the warm-up to its last, over the steps between, summed over ranks: start-up is left out, and
with it what a worker does once while its first steps run (the control server's import on a
thread of its own takes about 0.15 s of CPU a worker, 7 ms a step over 150 steps of 7 workers).
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from . import SOURCE_ROOT

MEDIAN_LINE = re.compile(r"(\d+) steps done on all (\d+) workers; median ([0-9.]+) ms")
DEFAULT_REFERENCE = "b577911"  # the code before the slow-link work (issue 39's yardstick)
DEFAULT_WARMUP = 20  # steps, in both checkouts: what a worker does once is not a step's cost


@dataclass(frozen=True, slots=True)
class Sample:
    """One launch: its median step, and the workers' CPU time per step, summed over ranks."""

    median_ms: float
    cpu_ms_per_step: float
    wall_s: float
    loop_cpu_ms_per_step: float = 0.0  # of the allreduce's event-loop threads alone


def parse_launch(output: str) -> tuple[int, int, float]:
    """(steps, workers, median ms) from a launch's closing line; ValueError if it has none."""
    found = MEDIAN_LINE.findall(output)
    if not found:
        tail = output.strip().splitlines()[-3:]
        raise ValueError(f"the launch printed no closing 'N steps done ... median X ms' line; its last lines: {tail}")
    steps, workers, median = found[-1]
    return int(steps), int(workers), float(median)


def run_once(source: Path, args: Sequence[str], timeout_s: float, warmup: int = 0) -> Sample:
    """`python -m fttree launch ARGS` with the package taken from `source`; its workers count
    their CPU time from their first step after `warmup` to their last (yardstick_site/sitecustomize.py)."""
    with tempfile.TemporaryDirectory(prefix="fttree-cpu-") as cpu_dir:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "fttree", "launch", *args], cwd=source, capture_output=True,
                              text=True, timeout=timeout_s, env=_env(source, cpu_dir, warmup))
        wall = time.monotonic() - start
        _steps, workers, median = parse_launch(proc.stdout + proc.stderr)
        counts = [line.split() for f in Path(cpu_dir).glob("cpu-*") for line in f.read_text().splitlines()]
    if len(counts) < workers:
        raise ValueError(f"{len(counts)} of {workers} workers reported their CPU time (a worker reports none "
                         f"when it ran fewer than the warm-up's {warmup} steps and two more)")
    cpu_s = sum(float(row[0]) for row in counts)
    loop_s = sum(float(row[2]) for row in counts if len(row) > 2)
    steps = max(statistics.median(int(row[1]) for row in counts), 1)
    return Sample(median_ms=median, cpu_ms_per_step=cpu_s * 1000 / steps, wall_s=wall,
                  loop_cpu_ms_per_step=loop_s * 1000 / steps)


def _env(source: Path, cpu_dir: str, warmup: int) -> dict[str, str]:
    site = Path(__file__).resolve().parent / "yardstick_site"
    return dict(os.environ, PYTHONPATH=os.pathsep.join((str(site), str(source))), FTTREE_YARDSTICK_DIR=cpu_dir,
                FTTREE_YARDSTICK_WARMUP=str(warmup), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """A detached worktree of `commit` in a temporary folder, removed afterwards."""
    root = SOURCE_ROOT
    if subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode:
        raise click.ClickException(f"{commit!r} is not a commit of the checkout at {root}")
    path = Path(tempfile.mkdtemp(prefix="fttree-ref-")) / "ref"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-f", str(path), commit], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(path)], capture_output=True)


def ratio_line(name: str, ours: list[float], theirs: list[float]) -> str:
    ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]
    return (f"{name}: this {statistics.median(ours):.1f}, reference {statistics.median(theirs):.1f}, "
            f"ratio median {statistics.median(ratios):.2f} (pairs {', '.join(f'{r:.2f}' for r in ratios)})")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--ref", "reference", default=DEFAULT_REFERENCE, show_default=True,
              help="The reference commit to run against (a fixed one, never just the previous commit).")
@click.option("--pairs", type=click.IntRange(1, 50), default=4, show_default=True, help="Alternating pairs to run.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Give up on one launch after this many seconds.")
@click.option("--warmup", type=click.IntRange(min=0), default=DEFAULT_WARMUP, show_default=True,
              help="Steps of each worker left out of the CPU figures (their median step is the launch's).")
@click.argument("launch_args", nargs=-1, type=click.UNPROCESSED)
def yardstick(reference: str, pairs: int, timeout_s: float, warmup: int, launch_args: tuple[str, ...]) -> None:
    """Run `fttree launch LAUNCH_ARGS` from this checkout and from the reference commit in
    alternating pairs; print each pair and the median ratios (this / reference) of the median
    step and of the CPU per step. Example: fttree yardstick --pairs 4 -- -n 7 --steps 60"""
    args = list(launch_args) or ["-n", "7", "--steps", "60", "--size", "407050"]
    ours: list[Sample] = []
    theirs: list[Sample] = []
    with worktree(reference) as ref_path:
        click.echo(f"launch {' '.join(args)}: this checkout ({SOURCE_ROOT}) against {reference}, {pairs} pairs")
        for i in range(pairs):
            try:
                a = run_once(SOURCE_ROOT, args, timeout_s, warmup)
                b = run_once(ref_path, args, timeout_s, warmup)
            except (ValueError, subprocess.TimeoutExpired) as exc:
                raise click.ClickException(f"pair {i + 1}: {exc}") from None
            ours.append(a)
            theirs.append(b)
            click.echo(f"pair {i + 1}: step {a.median_ms:.1f} / {b.median_ms:.1f} ms, "
                       f"cpu {a.cpu_ms_per_step:.1f} / {b.cpu_ms_per_step:.1f} ms a step, "
                       f"event-loop threads {a.loop_cpu_ms_per_step:.1f} / {b.loop_cpu_ms_per_step:.1f}")
    click.echo(ratio_line("median step (ms)", [s.median_ms for s in ours], [s.median_ms for s in theirs]))
    click.echo(ratio_line("cpu per step, all ranks (ms)", [s.cpu_ms_per_step for s in ours],
                          [s.cpu_ms_per_step for s in theirs]))
    click.echo(ratio_line("event-loop threads' cpu per step, all ranks (ms)",
                          [s.loop_cpu_ms_per_step for s in ours], [s.loop_cpu_ms_per_step for s in theirs]))
