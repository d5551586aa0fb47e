"""`fttree chaos --side-by-side`: the fault-free job and the chaos job at the same time.

    sudo fttree chaos -n 7 --duration 600 --fault-every 43 --seed 3 --side-by-side

Run one after the other (--pairs), the two jobs meet different loads: on the shared 2-core
machine an hour at one fault every 43 s gave pair goodputs from 0.40 to 1.73, far more than the
faults cost. Side by side, every swing of the machine's load meets both jobs in the same second.
Each job has its own network namespace (the chaos job's cuts and loss bursts touch only its
own loopback), its own ports and its own folder. With --cpus pin each job's workers keep to
their own half of the CPUs, so that a chaos worker stopped or killed cannot lend its CPU to the
fault-free job; with --cpus share they compete for all of them.

Goodput is the chaos job's samples committed per second over the fault-free job's, over one
wall-clock window; the same ratio per window of --window seconds shows its spread. --calibrate
runs both jobs fault-free (an A/A run): its ratio and spread are the set-up's own bias and noise.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..net.address import free_port, local_hosts, local_peers
from . import chaos_schedule as cs
from .chaos import POLL_S, Run, RunResult, Settings
from .chaos_checks import ChaosFailure

SHARE, PIN = "share", "pin"
CPU_MODES = (SHARE, PIN)


def split_cpus(cpus: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    """The CPUs this process may use, in two halves: the fault-free job's, then the chaos job's."""
    ordered = sorted(set(cpus))
    if len(ordered) < 2:
        raise ConfigError(f"--cpus pin gives each job its own CPUs, but this process may use only {ordered}")
    half = len(ordered) // 2
    return frozenset(ordered[:half]), frozenset(ordered[half:])


def window_bounds(t0: int, duration_s: float, window_s: float) -> list[tuple[int, int]]:
    """[start, end) in whole seconds (the checks count samples per whole second) covering
    t0 .. t0 + duration_s in windows of window_s; the last is shorter when the duration is not
    a multiple of it."""
    if not window_s >= 1:
        raise ConfigError(f"--window must be at least 1 s, got {window_s!r}")
    width, end = int(window_s), t0 + int(duration_s)
    if end <= t0:
        raise ConfigError(f"a run of {duration_s!r} s has no whole second to count")
    return [(start, min(start + width, end)) for start in range(t0, end, width)]


@dataclass(frozen=True)
class Window:
    """Samples both jobs committed in one wall-clock window, and the machine's load then."""

    start: int
    end: int
    base: int
    chaos: int
    load: float | None  # 1-minute load average at the window's last poll; None if never polled

    @property
    def ratio(self) -> float | None:
        return self.chaos / self.base if self.base else None

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "base": self.base, "chaos": self.chaos, "ratio": self.ratio,
                "load": self.load}


def windows(base: Mapping[int, int], chaos: Mapping[int, int], bounds: list[tuple[int, int]],
            loads: Mapping[int, float]) -> list[Window]:
    """Per-window sample counts of both jobs from their per-second counts; `loads` is keyed by
    the window's index."""
    def count(per_second: Mapping[int, int], start: int, end: int) -> int:
        return sum(n for sec, n in per_second.items() if start <= sec < end)

    return [Window(start, end, count(base, start, end), count(chaos, start, end), loads.get(i))
            for i, (start, end) in enumerate(bounds)]


@dataclass(frozen=True)
class Spread:
    """The per-window ratios in brief."""

    count: int
    low: float
    median: float
    high: float
    sd: float  # sample standard deviation; 0 for one window

    def __str__(self) -> str:
        return (f"median {self.median:.2f}, range {self.low:.2f}-{self.high:.2f}, sd {self.sd:.3f} over "
                f"{self.count} windows")


def spread(ws: list[Window]) -> Spread | None:
    """Of the windows where the fault-free job committed samples; None if there is none."""
    ratios = [r for r in (w.ratio for w in ws) if r is not None]
    if not ratios:
        return None
    return Spread(len(ratios), min(ratios), statistics.median(ratios), max(ratios),
                  statistics.stdev(ratios) if len(ratios) > 1 else 0.0)


@dataclass
class SideResult:
    base: RunResult
    chaos: RunResult
    windows: list[Window]
    skipped: list[str]
    t0: int

    def summary(self, s: Settings) -> dict[str, Any]:
        sp = spread(self.windows)
        return {"cpus": s.cpus, "calibration": s.calibrate, "window_s": s.window_s, "t0": self.t0,
                "seconds": s.duration_s, "base_samples": self.base.samples, "chaos_samples": self.chaos.samples,
                "windows": [w.to_dict() for w in self.windows],
                "spread": None if sp is None else {"count": sp.count, "low": sp.low, "median": sp.median,
                                                   "high": sp.high, "sd": sp.sd}}


JOBS = ("base", "chaos")


@contextmanager
def networks(s: Settings) -> Iterator[list[tuple[str | None, list[str]]]]:
    """(namespace, command prefix) for each job: a namespace of its own when root, else both on
    the host's loopback (on ports of their own)."""
    if os.geteuid() == 0 and shutil.which("iptables") and shutil.which("ip"):
        from .realfaults import namespace

        with ExitStack() as stack:
            names = [stack.enter_context(namespace(f"fttree-{os.getpid()}-{job}", world=s.world)) for job in JOBS]
            yield [(ns, ["ip", "netns", "exec", ns]) for ns in names]
    else:
        yield [(None, []), (None, [])]


def ports(s: Settings, netns: str | None) -> tuple[int, int]:
    """The two jobs' ports: in namespaces of their own any two do; on the host's loopback two
    free ones apart (each worker's control server listens at its port + 1000)."""
    if netns is not None:
        return 29500, 29600
    hosts = local_hosts(s.world)
    base = free_port(hosts, also=(1000,))
    for _ in range(50):
        chaos = free_port(hosts, also=(1000,))
        if abs(chaos - base) not in (0, 1000):
            return base, chaos
    raise ConfigError("no two free TCP ports for the two jobs")


def run_side_by_side(s: Settings) -> SideResult:
    """Both jobs at once over one window of s.duration_s; fails like run_chaos on any check."""
    from ..net.credentials import write_key  # here: it pulls in numpy, which `fttree --help` need not pay

    if s.cpus not in CPU_MODES:
        raise ConfigError(f"--cpus must be one of {', '.join(CPU_MODES)}, got {s.cpus!r}")
    window_bounds(0, s.duration_s, s.window_s)  # a bad --window or --duration is refused before the run
    with ExitStack() as stack:
        folder = s.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fttree-chaos-")))
        folder.mkdir(parents=True, exist_ok=True)
        key = write_key(folder / "job.key")
        (base_ns, base_prefix), (chaos_ns, chaos_prefix) = stack.enter_context(networks(s))
        skipped = [k for k in s.kinds if k in cs.ROOT_KINDS and chaos_ns is None]
        kinds = tuple(k for k in s.kinds if k not in skipped) or (cs.KILL,)
        faults = [] if s.calibrate else cs.draw(s.world, s.duration_s, s.every_s, s.seed, kinds)
        base_cpus, chaos_cpus = split_cpus(os.sched_getaffinity(0)) if s.cpus == PIN else (None, None)
        base_port, chaos_port = ports(s, chaos_ns)
        s.echo(("A/A calibration: both jobs fault-free" if s.calibrate else
                f"{len(faults)} faults drawn (seed {s.seed}, one every {s.every_s:g} s on average)")
               + (f"; skipped without root: {', '.join(skipped)}" if skipped and not s.calibrate else ""))
        s.echo(f"side by side for {s.duration_s:g} s: {s.world} fault-free workers "
               + ("" if base_cpus is None else f"on CPUs {sorted(base_cpus)} ")
               + f"beside {s.world} {'fault-free' if s.calibrate else 'chaos'} workers"
               + ("" if chaos_cpus is None else f" on CPUs {sorted(chaos_cpus)}")
               + ("" if chaos_cpus is not None else " (sharing every CPU)"))
        base = Run(s, folder / "base", local_peers(s.world, port=base_port), key, base_prefix, base_ns, [], base_cpus)
        chaos = Run(s, folder / "chaos", local_peers(s.world, port=chaos_port), key, chaos_prefix, chaos_ns, faults,
                    chaos_cpus)
        try:
            return _side_by_side(s, base, chaos, skipped)
        except ChaosFailure:
            chaos.show_measured()
            raise
        finally:
            chaos.cluster.close()
            base.cluster.close()


def _side_by_side(s: Settings, base: Run, chaos: Run, skipped: list[str]) -> SideResult:
    base.launch()
    chaos.launch()
    chaos.partners = [base]  # every wait of the chaos run reads the fault-free run's records too
    chaos.wait(f"the first step of all {s.world} workers of both jobs",  # twice the workers start at once
               lambda: base.all_stepped() and chaos.all_stepped(), 2 * s.startup_s)
    t0 = math.ceil(max(*base.first_step.values(), *chaos.first_step.values()))
    began = time.monotonic() - (time.time() - t0)
    s.echo(f"both jobs are stepping: the window is the {s.duration_s:g} s from the second after the last first step")
    width = int(s.window_s)
    loads: dict[int, float] = {}
    while time.monotonic() < began + s.duration_s:
        base.tick(began)
        chaos.tick(began)
        at = time.time() - t0
        if at >= 0:
            loads[int(at // width)] = os.getloadavg()[0]
        time.sleep(POLL_S)
    c = chaos.finish(t0, s.duration_s)  # the fault-free job runs on meanwhile: the waits read it
    chaos.partners = []
    b = base.finish(t0, s.duration_s)
    ws = windows(base.checks.per_second, chaos.checks.per_second, window_bounds(t0, s.duration_s, s.window_s), loads)
    return SideResult(b, c, ws, skipped, t0)


def report_windows(result: SideResult, echo: Callable[[str], None]) -> Spread | None:
    """One line per window, then their spread."""
    for w in result.windows:
        echo(f"  window {w.start - result.t0:5d}-{w.end - result.t0:<5d} s: {w.chaos} / {w.base} samples, ratio "
             + ("-" if w.ratio is None else f"{w.ratio:.2f}")
             + ("" if w.load is None else f" (load {w.load:.1f})"))
    sp = spread(result.windows)
    echo("per-window ratios: " + ("none (the fault-free job committed nothing)" if sp is None else str(sp)))
    return sp
