"""`fttree bench --diloco`: data-parallel training against DiLoCo behind emulated edge uplinks.

Each configuration trains examples/train_mlp.py (a 784-1280-10 MLP, 1.02M parameters, or as wide
as --hidden asks, on a synthetic task of 10 Gaussian classes made on the fly, batch 100 per
worker) inside a private
network namespace whose per-rank uplinks are shaped (bench_uplinks.Uplinks). Rank 0 reports the
held-out accuracy (DiLoCo: of the global parameters, as of each outer step when it lands) with
a timestamp as it goes; the bench reads every rank's uplink byte counter
every POLL_S seconds. The target is the accuracy gloo DDP reaches in its step budget; for every
configuration the bench prints the training time and the busiest rank's bytes until it first
reached that target (less the time rank 0 spent evaluating), its final accuracy, and rank 0's
compute share (forward and backward time, with any emulated device time, over wall time).

A DDP step of a large model behind a slow uplink takes a minute, so `ddp_steps` can stand in for
the DDP runs' budget behind the uplinks: each DDP configuration then runs twice, unshaped for the
budget (its steps to the target) and shaped for `ddp_steps` steps (its step time and bytes); its
time to the target is the product, and the table says so.
"""

from __future__ import annotations

import json
import statistics
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
DATA = ("--hidden", str(HIDDEN), "--synthetic", str(SAMPLES))  # the model and data of every run, unless --hidden
SYNC_EVERY = (8, 32, 128)  # DiLoCo's local steps per outer step, one run of each
POLL_S = 0.5  # how often the uplinks' byte counters are read
# DiLoCo runs evaluate the global parameters, the group's model: rank 0's own holds its eager correction and,
# with sparse, its progress not yet sent (after sparse's first round, which sends nothing, 0.94 against the
# start's 0.10 on the 10M model)
GLOBAL = ("--eval-global",)
FAULT_SAMPLES = 50_000  # the kill-and-restart run: epochs of about 2 rounds of H=32, each audited


def data_args(hidden: int) -> tuple[str, ...]:
    """train_mlp.py's model and data arguments for an MLP of `hidden` units (DATA's otherwise)."""
    return ("--hidden", str(hidden), "--synthetic", str(SAMPLES))


@dataclass(frozen=True)
class Config:
    label: str
    args: tuple[str, ...]
    local_steps: int  # the step budget in local steps (a DDP step is one)
    shaped_steps: int = 0  # DDP: steps run behind the uplinks, when fewer than the budget (derived)

    def value(self, flag: str) -> int | None:
        """The integer after `flag` in train_mlp.py's arguments, or None without it."""
        return int(self.args[self.args.index(flag) + 1]) if flag in self.args else None


def configs(budget: int, sync_every: Sequence[int] = SYNC_EVERY, ddp_steps: int = 0, rounds: int = 4) -> list[Config]:
    """gloo DDP and fttree DDP for `budget` steps (behind the uplinks, or `ddp_steps` of them
    there and the budget unshaped); DiLoCo for 4x that in local steps (at least `rounds`), each H
    of `sync_every`, float32, int8 and sparse (fttree.Sparse's defaults: 1/16 of the coordinates
    at 2 bits); int8 and sparse with the eager outer step (overlap="eager", the outer step behind
    the next round); and DiLoCo runs with a worker killed and started again, on a data set small
    enough that its epochs end and are audited. The eager and restart runs use H=32, or the first
    H asked for when 32 is not."""
    shaped = ddp_steps if 0 < ddp_steps < budget else 0
    out = [Config("gloo DDP", ("--comm", "gloo", "--gloo-bind"), budget, shaped),
           Config("fttree DDP", (), budget, shaped)]
    for h in sync_every:
        for wire in ("float32", "int8", "sparse"):
            extra = ("--compression", wire) if wire != "float32" else ()
            out.append(Config(f"fttree DiLoCo H={h} {wire}", ("--diloco", str(h), *extra, *GLOBAL),
                              max(4 * budget, rounds * h)))
    h = 32 if 32 in sync_every else sync_every[0]
    for wire in ("int8", "sparse"):
        out.append(Config(f"fttree DiLoCo H={h} {wire}, eager outer steps",
                          ("--diloco", str(h), "--compression", wire, "--eager", *GLOBAL),
                          max(4 * budget, rounds * h)))
    for wire in ("int8", "sparse"):
        out.append(Config(f"fttree DiLoCo H={h} {wire}, rank 3 killed in round 2 and restarted",
                          ("--diloco", str(h), "--compression", wire, "--faults", "crash 3 @2", "--restart", "3",
                           "--synthetic", str(FAULT_SAMPLES), *GLOBAL), max(4 * budget, rounds * h)))
    return out


@dataclass
class Run:
    config: Config
    evals: list[dict[str, Any]] = field(default_factory=list)  # rank 0: t, at, step, local_steps, accuracy
    bytes_at: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), busiest rank's bytes)
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    step_s: float = 0.0  # derived DDP: the median step behind the uplinks
    step_bytes: float = 0.0  # derived DDP: the busiest rank's bytes per step behind the uplinks

    def bytes_per_step(self) -> float:
        """The busiest rank's bytes per step after the first (which carries the start's traffic:
        connecting, DDP's broadcast of the model), from the evaluations' times; all of them over
        the steps when there are fewer than two evaluations."""
        if len(self.evals) >= 2:
            first, last = self.evals[0], self.evals[-1]
            steps = int(last["local_steps"]) - int(first["local_steps"])
            return (self.bytes_until(last["at"]) - self.bytes_until(first["at"])) / max(1, steps)
        steps = int(self.summary.get("steps") or self.config.shaped_steps or 1)
        return self.bytes_at[-1][1] / steps if self.bytes_at else 0.0

    @property
    def step_bytes_text(self) -> str:
        """The busiest rank's bytes per step as the table shows them: a DDP step (derived: from
        its shaped run), or a DiLoCo outer step (its local steps' share times H), first one
        left out ('' without the readings)."""
        h = self.config.value("--diloco")
        per = self.step_bytes if self.derived else self.bytes_per_step() * (h or 1)
        if not per or (len(self.evals) < 2 and not self.derived):
            return ""
        return f"{per / 1e6:.2f} MB"

    @property
    def derived(self) -> bool:
        return self.step_s > 0

    def to_target(self, target: float) -> tuple[float, int, str] | None:
        """(seconds, the busiest rank's bytes, how) until the first evaluation at `target`, or
        None when the run never reached it. A derived run multiplies its steps to the target
        (unshaped) by its step time and bytes behind the uplinks."""
        hit = self.first_at(target)
        if hit is None:
            return None
        if self.derived:
            n = int(hit["local_steps"])
            return n * self.step_s, round(n * self.step_bytes), f"{n} steps x {self.step_s:.2f} s, derived"
        return float(hit["t"]), self.bytes_until(hit["at"]), f"{hit['local_steps']} local steps"

    @property
    def steady_share(self) -> str:
        """DiLoCo: rank 0's compute per round over the median time between its outer steps'
        reports, the last gap left out (the end's flush brings the last reports together): the
        compute share once the start is behind ('' without two such gaps' worth of reports)."""
        s = self.summary
        h = self.config.value("--diloco")
        if h is None or not s.get("compute_s") or len(self.evals) < 3:
            return ""
        per_round = s["compute_s"] / max(1, int(self.evals[-1]["local_steps"])) * h
        gap = statistics.median(b["t"] - a["t"] for a, b in zip(self.evals[:-2], self.evals[1:-1], strict=True))
        return f"{per_round / gap:.2f}" if gap > 0 else ""

    @property
    def waiting_share(self) -> str:
        """DiLoCo: the share of rank 0's wall time (less its evaluations) its caller waited for
        outer steps, building the messages included ('' for other runs)."""
        s = self.summary
        if not s.get("wall_s") or "outer_waited_s" not in s:
            return ""
        return f"{s['outer_waited_s'] / s['wall_s']:.2f}"

    @property
    def compute_share(self) -> str:
        """Rank 0's forward and backward time (with its emulated device time) over its training's
        wall time less its evaluations ('' when not reported)."""
        s = self.summary
        if not s.get("wall_s"):
            return ""
        return f"{s['compute_s'] / s['wall_s']:.2f}"

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
        rank = self.config.value("--restart")
        if rank is None:
            return ""
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
    """One configuration behind the uplinks; a derived DDP one (`shaped_steps`) first for its
    budget with the limits lifted, then for `shaped_steps` behind them."""
    if not config.shaped_steps:
        return _train(up, world, config, echo, data, config.local_steps, shaped=True)
    run = _train(up, world, config, echo, data, config.local_steps, shaped=False)
    timed = _train(up, world, config, echo, data, config.shaped_steps, shaped=True)
    run.step_s = float(timed.summary.get("median_step_s", 0.0))
    run.step_bytes = timed.bytes_per_step()
    for key in ("compute_s", "wall_s"):  # the compute share is the run's behind the uplinks
        run.summary.pop(key, None)
        if key in timed.summary:
            run.summary[key] = timed.summary[key]
    run.error = run.error or timed.error
    return run


def _train(up: Uplinks, world: int, config: Config, echo: Callable[[str], None], data: Sequence[str],
           steps: int, shaped: bool) -> Run:
    if shaped:
        up.apply(world)  # zeroes the counters
    else:
        up.lift()
    evals_every = 1 if "--diloco" in config.args else max(1, steps // 10)
    timed = shaped and config.shaped_steps > 0  # only the step time counts: the first step (connecting) left out
    cmd = [sys.executable, str(SOURCE_ROOT / "examples" / "train_mlp.py"), "-n", str(world), "--steps", str(steps),
           *data, "--eval-every", str(1 if timed else evals_every), "--json",
           "--warmup", "1" if timed else "0",
           "--step-timeout", "600" if timed else "120", *config.args]
    run = Run(config)
    done = threading.Event()

    def poll() -> None:
        while not done.wait(POLL_S):
            counts = up.counters()
            run.bytes_at.append((time.time(), max(counts.values(), default=0)))

    poller = threading.Thread(target=poll, daemon=True)
    if shaped:  # with the limits lifted there are no counters, and the bytes are not this run's figure
        poller.start()
    try:
        out = subprocess.run(up.wrap(cmd), capture_output=True, text=True, timeout=3600, check=False)
    finally:
        done.set()
        if shaped:
            poller.join()
    if shaped:
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
    if out.returncode != 0 or not (run.evals or timed):
        run.error = (out.stderr or out.stdout)[-600:]
    what = (f"{steps} steps behind the uplinks, median step {run.summary.get('median_step_s', float('nan')):.2f} s, "
            f"{run.bytes_per_step() / 1e6:.1f} MB a step through the busiest uplink"
            if timed else f"{len(run.evals)} evaluations, final accuracy {run.final:.4f}"
            + ("" if shaped else " (limits lifted)"))
    echo(f"  {config.label}: {what}"
         + (f" (FAILED: {run.error.strip().splitlines()[-1] if run.error.strip() else 'no output'})"
            if run.error else ""))
    return run


def render(rate: str, world: int, runs: Sequence[Run]) -> str:
    base = runs[0]
    target = base.final
    reached = base.to_target(target)
    base_t, base_b = (reached[0], reached[1]) if reached else (float("nan"), 0)
    lines = [f"### {rate} uplinks, {world} workers, target {target:.4f} (gloo DDP's accuracy after "
             f"{base.config.local_steps} steps)", "",
             "| run | time to target | vs gloo | busiest rank's bytes to target | vs gloo | per step "
             "| final accuracy | compute share | steady | outer-step wait |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        hit = run.to_target(target)
        shares = f"{run.compute_share} | {run.steady_share} | {run.waiting_share}"
        if hit is None:
            lines.append(f"| {run.config.label} | not reached in {run.config.local_steps} local steps | | | | "
                         f"{run.step_bytes_text} | {run.final:.4f} | {shares} |")
            continue
        t, b, how = hit
        lines.append(f"| {run.config.label} | {t:.1f} s ({how}) | "
                     f"{t / base_t:.3f} | {b / 1e6:.1f} MB | {b / base_b if base_b else float('nan'):.4f} | "
                     f"{run.step_bytes_text} | {run.final:.4f} | {shares} |")
    notes = [line for run in runs for line in (run.restart_line(), run.straggler_line()) if line]
    if any(run.derived for run in runs):
        notes.append("Derived rows: the steps to the target come from a run with the uplink limits lifted, the "
                     "step time (median, the first step left out) and bytes per step from a short run behind them.")
    notes.append("Per step: the busiest rank's bytes per DDP step, or per DiLoCo outer step, between the first "
                 "and the last report (the start's traffic left out).")
    if any(run.compute_share for run in runs):
        notes.append("Compute share: rank 0's forward and backward time (with --compute-s, its device time) "
                     "over its training's wall time (to its last step's report: the audit of the epoch the run "
                     "stops in, one allreduce of a count per sample, left out); steady: its compute per round over "
                     "the median time between outer steps' reports (the last gap, the end's flush, left out); "
                     "outer-step wait: the share of the wall time its training loop waited for outer steps "
                     "(building its messages included). Times leave out rank 0's evaluations.")
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
