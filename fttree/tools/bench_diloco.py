"""`fttree bench --diloco`: data-parallel training against DiLoCo behind emulated edge uplinks.

Each configuration trains examples/train_mlp.py (a 784-1280-10 MLP, 1.02M parameters, on a
synthetic task of 10 Gaussian classes made on the fly, batch 100 per worker) inside a private
network namespace whose per-rank uplinks are shaped (bench_uplinks.Uplinks). Rank 0 reports the
held-out accuracy with a timestamp as it goes; the bench reads every rank's uplink byte counter
every POLL_S seconds. The target is the accuracy gloo DDP reaches in its step budget; for every
configuration the bench prints the training time and the busiest rank's bytes until it first
reached that target, and its final accuracy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import SOURCE_ROOT
from .bench_uplinks import Uplinks

HIDDEN = 1280  # 784-1280-10: 1,017,610 parameters
SAMPLES = 1_000_000  # no epoch ends within a budget: the bench times training, not the audit
DATA = ("--hidden", str(HIDDEN), "--synthetic", str(SAMPLES))  # the model and data of every run
POLL_S = 0.5  # how often the uplinks' byte counters are read
FAULT_SAMPLES = 50_000  # the kill-and-restart run: epochs of about 2 rounds of H=32, each audited


@dataclass(frozen=True)
class Config:
    label: str
    args: tuple[str, ...]
    local_steps: int  # the step budget in local steps (a DDP step is one)


def configs(budget: int) -> list[Config]:
    """gloo DDP and fttree DDP for `budget` steps; DiLoCo for 4x that in local steps (at
    least 4 rounds), H = 8, 32, 128, float32, int8 and sparse (fttree.Sparse's defaults: 1/16
    of the coordinates at 2 bits); H=32 int8 with the eager outer step (overlap="eager", the
    outer step behind the next round); and one DiLoCo run with a worker killed and started again,
    on a data set small enough that its epochs end and are audited."""
    out = [Config("gloo DDP", ("--comm", "gloo", "--gloo-bind"), budget), Config("fttree DDP", (), budget)]
    for h in (8, 32, 128):
        for wire in ("float32", "int8", "sparse"):
            extra = ("--compression", wire) if wire != "float32" else ()
            out.append(Config(f"fttree DiLoCo H={h} {wire}", ("--diloco", str(h), *extra), max(4 * budget, 4 * h)))
    out.append(Config("fttree DiLoCo H=32 int8, eager outer steps", ("--diloco", "32", "--compression", "int8",
                                                                     "--eager"), max(4 * budget, 4 * 32)))
    for wire in ("int8", "sparse"):
        out.append(Config(f"fttree DiLoCo H=32 {wire}, rank 3 killed in round 2 and restarted",
                          ("--diloco", "32", "--compression", wire, "--faults", "crash 3 @2", "--restart", "3",
                           "--synthetic", str(FAULT_SAMPLES)), max(4 * budget, 4 * 32)))
    return out


@dataclass
class Run:
    config: Config
    evals: list[dict[str, Any]] = field(default_factory=list)  # rank 0: t, at, step, local_steps, accuracy
    bytes_at: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), busiest rank's bytes)
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    def first_at(self, target: float) -> dict[str, Any] | None:
        return next((e for e in self.evals if e["accuracy"] >= target), None)

    def bytes_until(self, at: float) -> int:
        """The busiest rank's bytes by wall time `at`: the first reading at or after it (at most
        POLL_S of later traffic too, never less than was sent; a reading before it could miss a
        whole outer step sent just before the evaluation), else the last one."""
        after = [b for t, b in self.bytes_at if t >= at]
        if after:
            return after[0]
        return self.bytes_at[-1][1] if self.bytes_at else 0

    def restart_line(self) -> str:
        """For a run with --restart: whether the rank came back and every epoch it finished
        used each sample exactly once ('' for other runs)."""
        if "--restart" not in self.config.args:
            return ""
        rank = int(self.config.args[self.config.args.index("--restart") + 1])
        s = self.summary
        if not s:
            return f"{self.config.label}: no summary (the run failed)"
        back = rank in s.get("last_contributors", [])
        once = "each sample exactly once" if s.get("exactly_once") else "NOT exactly once"
        return (f"{self.config.label}: {s.get('steps')} rounds; rank {rank} "
                f"{'back among the contributors at the end' if back else 'NOT back'}; fewest contributors "
                f"{s.get('fewest_contributors')}; {s.get('epochs')} epochs audited (the last may be cut by the "
                f"end of the run): {once}")

    def straggler_line(self) -> str:
        """For a run with --straggler-policy: how often each rank was late, and whether every
        epoch it finished used each sample exactly once ('' for other runs)."""
        if "--straggler-policy" not in self.config.args:
            return ""
        s = self.summary
        if not s:
            return f"{self.config.label}: no summary (the run failed)"
        once = "each sample exactly once" if s.get("exactly_once") else "NOT exactly once"
        late = ", ".join(f"rank {r} in {n}" for r, n in s.get("late_steps", {}).items()) or "none"
        return (f"{self.config.label}: steps closed without a late rank: {late} of {s.get('steps')}; fewest "
                f"contributors {s.get('fewest_contributors')}; {s.get('epochs')} epochs audited (the last may be "
                f"cut by the end of the run): {once}")

    @property
    def final(self) -> float:
        return float(self.evals[-1]["accuracy"]) if self.evals else float("nan")


def run_one(up: Uplinks, world: int, config: Config, echo: Callable[[str], None],
            data: Sequence[str] = DATA) -> Run:
    up.apply(world)  # zeroes the counters
    evals_every = 1 if "--diloco" in config.args else max(1, config.local_steps // 10)
    steps = config.local_steps
    cmd = [sys.executable, str(SOURCE_ROOT / "examples" / "train_mlp.py"), "-n", str(world), "--steps", str(steps),
           *data, "--eval-every", str(evals_every), "--json",
           "--warmup", "0",
           "--step-timeout", "120", *config.args]
    run = Run(config)
    done = threading.Event()

    def poll() -> None:
        while not done.wait(POLL_S):
            counts = up.counters()
            run.bytes_at.append((time.time(), max(counts.values(), default=0)))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        out = subprocess.run(up.wrap(cmd), capture_output=True, text=True, timeout=3600, check=False)
    finally:
        done.set()
        poller.join()
    run.bytes_at.append((time.time(), max(up.counters().values(), default=0)))
    for line in out.stdout.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "eval" in doc:
            run.evals.append(doc["eval"])
        elif isinstance(doc, dict) and "median_step_s" in doc:
            run.summary = doc
    if out.returncode != 0 or not run.evals:
        run.error = (out.stderr or out.stdout)[-600:]
    echo(f"  {config.label}: {len(run.evals)} evaluations, final accuracy {run.final:.4f}"
         + (f" (FAILED: {run.error.strip().splitlines()[-1] if run.error.strip() else 'no output'})"
            if run.error else ""))
    return run


def render(rate: str, world: int, runs: Sequence[Run]) -> str:
    base = runs[0]
    target = base.final
    reached = base.first_at(target)
    base_t = reached["t"] if reached else float("nan")
    base_b = base.bytes_until(reached["at"]) if reached else 0
    lines = [f"### {rate} uplinks, {world} workers, target {target:.4f} (gloo DDP's accuracy after "
             f"{base.config.local_steps} steps)", "",
             "| run | time to target | vs gloo | busiest rank's bytes to target | vs gloo | final accuracy |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        hit = run.first_at(target)
        if hit is None:
            lines.append(f"| {run.config.label} | not reached in {run.config.local_steps} local steps | | | | "
                         f"{run.final:.4f} |")
            continue
        b = run.bytes_until(hit["at"])
        lines.append(f"| {run.config.label} | {hit['t']:.1f} s ({hit['local_steps']} local steps) | "
                     f"{hit['t'] / base_t:.3f} | {b / 1e6:.1f} MB | {b / base_b if base_b else float('nan'):.4f} | "
                     f"{run.final:.4f} |")
    notes = [line for run in runs for line in (run.restart_line(), run.straggler_line()) if line]
    return "\n".join(lines + (["", *notes] if notes else []))


def run(rates: Sequence[str], world: int, budget: int, echo: Callable[[str], None],
        make: Callable[[int], list[Config]] = configs, data: Sequence[str] = DATA) -> list[str]:
    """Every configuration (`make(budget)`, gloo's first: it sets the target) behind each rate;
    returns one markdown table per rate."""
    from .realfaults import sigterm_as_interrupt

    tables = []
    with sigterm_as_interrupt():  # a SIGTERM still takes the namespace and its workers down
        for rate in rates:
            table = _run_rate(rate, world, make(budget), echo, data)
            if table:
                tables.append(table)
    return tables


def _run_rate(rate: str, world: int, runs_of: Sequence[Config], echo: Callable[[str], None],
              data: Sequence[str]) -> str:
    """One rate's table ('' when gloo, which sets the target, failed)."""
    echo(f"{rate} uplinks, {world} workers:")
    with Uplinks(rate) as up:
        up.start(world)
        runs = [run_one(up, world, c, echo, data) for c in runs_of]
    if runs[0].error or not runs[0].evals:
        echo(f"gloo DDP failed behind {rate}: no target")
        return ""
    table = render(rate, world, runs)
    echo(table)
    return table
