"""`fttree chaos`: goodput under a long random mix of real faults.

    fttree chaos -n 7 --duration 600 --fault-every 10 --seed 1

One invocation runs the same job twice: fault-free, then under a seeded random schedule
(chaos_schedule.py) of SIGKILLs with restarts, SIGSTOP/SIGCONT, iptables cuts and loss bursts of
random links, stragglers (SIGSTOP bursts), graceful leaves and new joins. The job is the thesis
MLP on fttree.ElasticJob (chaos_worker.py), every worker writing JSON records that the checks
(chaos_checks.py) read as they come. It prints goodput (samples committed per second under
chaos over the fault-free run's), the heal time of every restart and join (fault to the first
step the new process contributes to), the detection time of every fault (to the first step that
excludes the victim, names it late, or reports a relay around the link), and exits non-zero
with the reason on its last line on a wrong sum, wrong contributors, a sample committed twice
or missing, a hang (every wait has a deadline and says what it waited for), or memory growth.

--pairs alternates the two runs; --side-by-side (chaos_side.py) runs both jobs at the same
time, so that the machine's load meets both alike, and reports goodput per window too.

Cuts and loss bursts are iptables rules in a network namespace this creates (and always
deletes, with every process and rule in it); they need root. Without root the workers run on
the host's loopback and those kinds are skipped, which the output says.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import math
import operator
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ..errors import FTTreeError
from ..net.address import free_port, local_hosts, local_peers
from . import chaos_schedule as cs
from .chaos_checks import RSS_LIMIT_MB, ChaosFailure, Checks
from .chaos_files import EXIT_EVICTED, STOP_FILE
from .chaos_report import by_kind, kind_line

MAX_REAL_WORLD = 64  # worker processes one machine starts for a real run
POLL_S = 0.05  # how often the runner reads the records and the children's exits (files and pids: no event)
STRAGGLE_S = (0.4, 0.4)  # a straggler's SIGSTOP bursts: stopped, then running, seconds
DETECT_GRACE_S = 2.0  # a link or stop fault is detected by a step at most this long after its end


@dataclass
class Settings:
    world: int = 7
    duration_s: float = 60.0
    every_s: float = 10.0
    seed: int = 0
    kinds: tuple[str, ...] = cs.KINDS
    hidden: int = 512
    batch: int = 100
    startup_s: float = 180.0  # every worker's first step within this
    stall_s: float = 120.0  # some step committed within this, always
    heal_s: float = 180.0  # a restarted or new process contributes within this
    end_s: float = 120.0  # every worker ends within this after the stop step
    stop_margin: int = 20  # steps between the newest seen and the stop step
    rss_limit_mb: float = RSS_LIMIT_MB
    pairs: int = 1  # fault-free and chaos runs alternate this many times, duration_s / pairs each
    cpus: str = "share"  # side by side: "pin" gives each job its own half of the CPUs
    window_s: float = 60.0  # side by side: goodput also per window of this many seconds
    calibrate: bool = False  # side by side, both jobs fault-free: the set-up's own bias (an A/A run)
    keep: Path | None = None  # keep the records here (default: a temporary folder, deleted)
    echo: Callable[[str], None] = print


@dataclass
class Measure:
    """One fault's detection and heal, from the records."""

    fault: cs.Fault
    t_fault: float
    t_back: float | None = None  # kill/leave/eviction: when the new process started
    pid_back: int | None = None  # that process: only its steps heal this fault, not a later restart's
    t_end: float | None = None  # when the runner ended the fault
    detected_s: float | None = None
    healed_s: float | None = None
    up_s: float | None = None  # the new process has imported torch and fttree and loaded its data
    ready_s: float | None = None  # ... and built its model, optimizer and job: fttree's part begins

    def heal_parts(self) -> HealParts | None:
        """Where a heal went, in seconds from the fault, or None while a part is unknown."""
        if self.healed_s is None or self.t_back is None or self.up_s is None or self.ready_s is None:
            return None
        down = self.t_back - self.t_fault
        return HealParts(down=down, imports=self.up_s - down, setup=self.ready_s - self.up_s,
                         fttree=self.healed_s - self.ready_s)


HEAL_PART_NAMES = ("down", "imports", "setup", "fttree")


@dataclass(frozen=True)
class HealParts:
    """A heal (fault to the new process's first contribution) in its four parts. Only `fttree`
    is the library's: admission, the state transfer and the first step. `imports` (Python, torch,
    the data) and `setup` (model, optimizer, job) are the training script's own start-up, which
    on this 2-core machine shares the CPU with the other workers."""

    down: float  # the fault's hold: from the kill or leave to the new process's start
    imports: float
    setup: float
    fttree: float

    def __str__(self) -> str:
        return (f"down {self.down:.2f}, imports {self.imports:.2f}, set-up {self.setup:.2f}, "
                f"fttree {self.fttree:.2f}")


@dataclass
class RunResult:
    samples: int
    seconds: float
    steps: int
    epochs_once: int
    measures: list[Measure] = field(default_factory=list)
    evictions: int = 0
    # per segment: (samples per second, the machine's 5-minute load average at its end), so that a
    # goodput taken beside other work shows whether the load met both runs alike
    segments: list[tuple[float, float]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.samples / self.seconds

    def __add__(self, other: RunResult) -> RunResult:
        """Two segments of one run (the --pairs runs) as one."""
        return RunResult(self.samples + other.samples, self.seconds + other.seconds, self.steps + other.steps,
                         self.epochs_once + other.epochs_once, self.measures + other.measures,
                         self.evictions + other.evictions, self.segments + other.segments)


def die_with_parent() -> None:
    """In a worker, before it runs: SIGKILL it when the runner dies, however the runner ends (a
    test's deadline kills the runner with SIGKILL, which leaves it no time to end its workers).
    The runner starts every worker from its one thread, as Linux's PR_SET_PDEATHSIG requires."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def prepare_worker(cpus: frozenset[int] | None) -> None:
    """In a worker, before it runs: die with the runner and, when pinned, keep to `cpus` (a job
    side by side with another on its own cores: the other's faults cannot lend it CPU)."""
    die_with_parent()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def segment(faults: list[cs.Fault], start_s: float, length_s: float) -> list[cs.Fault]:
    """The faults drawn for [start_s, start_s + length_s), timed from the segment's start."""
    return [dataclasses.replace(f, at_s=f.at_s - start_s) for f in faults if start_s <= f.at_s < start_s + length_s]


def evicted_by(measures: list[Measure], rank: int) -> Measure | None:
    """The stop or straggler fault that got `rank` evicted: its newest one not yet healed (an older
    one ended without an eviction and must not be credited with this restart's heal)."""
    mine = [m for m in measures if rank in m.fault.ranks and m.fault.kind in (cs.STOP, cs.STRAGGLER)
            and m.healed_s is None and m.t_back is None]
    return max(mine, key=lambda m: m.t_fault, default=None)


class Cluster:
    """The worker processes of one run, by pid; every one ended on close."""

    def __init__(self, s: Settings, records: Path, peers: list[str], key: Path, prefix: list[str],
                 cpus: frozenset[int] | None = None) -> None:
        self.s, self.records, self.prefix, self.cpus = s, records, prefix, cpus
        self.env = {**os.environ, "FTTREE_PEERS": ",".join(peers), "FTTREE_AUTH_KEY_FILE": str(key),
                    "PYTHONUNBUFFERED": "1"}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.expected_exit: set[int] = set()  # pids we killed or asked to leave
        self.started: dict[int, float] = {}  # rank -> when its current process started
        self.contributed: dict[int, bool] = {}  # rank -> its current process has contributed

    def start(self, rank: int, join: bool) -> None:
        cmd = [*self.prefix, sys.executable, "-m", "fttree.tools.chaos_worker", "--records", str(self.records),
               "--hidden", str(self.s.hidden), "--batch", str(self.s.batch), "--seed", str(self.s.seed),
               *(["--join"] if join else [])]
        log = open(self.records / f"rank-{rank}.log", "ab")  # noqa: SIM115
        try:
            self.procs[rank] = subprocess.Popen(cmd, env={**self.env, "FTTREE_RANK": str(rank)}, stdout=log,
                                                stderr=subprocess.STDOUT,
                                                preexec_fn=functools.partial(prepare_worker, self.cpus))
        finally:
            log.close()
        self.started[rank] = time.time()
        self.contributed[rank] = False

    def signal(self, rank: int, sig: signal.Signals) -> None:
        proc = self.procs.get(rank)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    def kill(self, rank: int) -> None:
        proc = self.procs[rank]
        self.expected_exit.add(proc.pid)
        self.signal(rank, signal.SIGKILL)
        proc.wait(timeout=30)
        del self.procs[rank]

    def exits(self) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
        """Processes that ended since the last call (removed from the cluster)."""
        for rank, proc in list(self.procs.items()):
            if proc.poll() is not None:
                del self.procs[rank]
                yield rank, proc

    def log_tail(self, rank: int) -> str:
        path = self.records / f"rank-{rank}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return " / ".join(lines[-3:])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=30)
        self.procs.clear()


class Tail:
    """New whole lines of every records file in a folder (a torn last line waits for its end,
    which a killed process never writes)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.offsets = folder, dict[Path, int]()

    def read(self) -> Iterator[dict[str, Any]]:
        for path in sorted(self.folder.glob("rank-*-*.jsonl")):
            at = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(at)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self.offsets[path] = at + end
            for line in chunk[:end].splitlines():
                yield json.loads(line)


class Run:
    """One run of the job: start, faults (if any), stop, check."""

    def __init__(self, s: Settings, folder: Path, peers: list[str], key: Path, prefix: list[str], netns: str | None,
                 faults: list[cs.Fault], cpus: frozenset[int] | None = None) -> None:
        self.s, self.folder, self.netns = s, folder, netns
        folder.mkdir(parents=True)
        self.cluster = Cluster(s, folder, peers, key, prefix, cpus)
        self.tail = Tail(folder)
        self.checks = Checks(rss_limit_bytes=int(s.rss_limit_mb * 2**20))
        self.pending = list(faults)
        self.active: list[tuple[float, cs.Fault, Measure]] = []  # (ends at, fault, measure)
        self.measures: list[Measure] = []
        self.disturbed: set[int] = set()
        self.last_progress = time.monotonic()
        self.first_step: dict[int, float] = {}
        self.evictions = 0
        self.straggling: dict[int, tuple[float, bool]] = {}  # rank -> (next switch, stopped now)
        self.stopping = False  # the stop step is set: workers end with 0
        self.partners: list[Run] = []  # runs beside this one, whose records every wait reads too

    # ---- records -------------------------------------------------------------------------

    def poll(self) -> None:
        for rec in self.tail.read():
            self.checks.feed(rec)
            if rec["kind"] in ("up", "ready"):
                self._started(rec)
            if rec["kind"] == "end" and rec["why"] == "error":
                raise ChaosFailure(f"rank {rec['rank']} (pid {rec['pid']}) failed: {rec['error']}")
            if rec["kind"] != "step":
                continue
            self.last_progress = time.monotonic()
            rank, t, contributors = rec["rank"], rec["t"], rec["contributors"]
            self.first_step.setdefault(rank, t)
            proc = self.cluster.procs.get(rank)
            if proc is not None and proc.pid == rec["pid"] and rank in contributors and not rec["waiting"]:
                self.cluster.contributed[rank] = True  # its current process holds the state and takes part
            for m in self.measures:
                self._measure(m, rec)

    def _started(self, rec: dict[str, Any]) -> None:
        """A new process's start-up milestones, for the fault it heals."""
        for m in self.measures:
            if m.pid_back == rec["pid"]:
                since = rec["t"] - m.t_fault
                if rec["kind"] == "up":
                    m.up_s = since
                else:
                    m.ready_s = since

    def _measure(self, m: Measure, rec: dict[str, Any]) -> None:
        t, f = rec["t"], m.fault
        if t <= m.t_fault:
            return
        if m.t_end is not None and t > m.t_end + DETECT_GRACE_S and f.kind not in cs.REJOINS:
            return  # a step this late would be another fault's doing
        contributors, late = set(rec["contributors"]), set(rec["late"])
        if m.detected_s is None:
            victims = set(f.ranks)
            if f.kind in cs.LINK_KINDS:
                a, b = f.ranks
                named = any(n.endswith(f" {a}-{b}") or n.endswith(f" {b}-{a}") for n in rec["notes"])
                if named or not victims <= contributors:
                    m.detected_s = t - m.t_fault
            elif not victims <= contributors or victims & late:
                m.detected_s = t - m.t_fault
        if m.healed_s is None and m.pid_back == rec["pid"] and rec["rank"] == f.ranks[0] and t > (m.t_back or 0.0) \
                and not rec["waiting"] and f.ranks[0] in contributors:  # the new process takes part with state
            m.healed_s = t - m.t_fault

    # ---- waits -----------------------------------------------------------------------------

    def wait(self, what: str, done: Callable[[], bool], limit_s: float) -> None:
        """Poll records and exits until `done`; a hang past `limit_s` fails naming `what`."""
        end = time.monotonic() + limit_s
        while not done():
            self.step_once()
            for other in self.partners:
                other.step_once()
            if time.monotonic() > end:
                raise ChaosFailure(f"hang: waited {limit_s:g} s for {what}")
            time.sleep(POLL_S)

    def step_once(self) -> None:
        self.poll()
        for rank, proc in self.cluster.exits():
            if proc.pid in self.cluster.expected_exit or (self.stopping and proc.returncode == 0):
                continue
            if proc.returncode == EXIT_EVICTED:  # stopped too long: the group went on; come back
                self.evictions += 1
                self.s.echo(f"  rank {rank} was evicted while stopped: restarting it")
                self.cluster.start(rank, join=True)
                evicting = evicted_by(self.measures, rank)
                if evicting is not None:
                    self._back(evicting, rank)
                continue
            raise ChaosFailure(f"rank {rank} (pid {proc.pid}) exited with {proc.returncode}: "
                               f"{self.cluster.log_tail(rank)}")
        if self.first_step and time.monotonic() - self.last_progress > self.s.stall_s:
            raise ChaosFailure(f"hang: no step record from any rank for {self.s.stall_s:g} s")
        self._straggle()

    def healthy(self, rank: int) -> bool:
        return rank in self.cluster.procs and self.cluster.contributed.get(rank, False)

    # ---- faults ----------------------------------------------------------------------------

    def begin(self, f: cs.Fault) -> None:
        m = Measure(f, time.time())
        self.measures.append(m)
        self.disturbed |= set(f.ranks)
        r = f.ranks[0]
        match f.kind:
            case cs.KILL:
                self.cluster.kill(r)
            case cs.STOP:
                self.cluster.signal(r, signal.SIGSTOP)
            case cs.CUT:
                self._script("cut.sh", f.link())
            case cs.LOSS:
                self._script("loss.sh", f.link(), f"{f.percent:g}%")
            case cs.STRAGGLER:
                self.cluster.signal(r, signal.SIGSTOP)
                self.straggling[r] = (time.monotonic() + STRAGGLE_S[0], True)
            case cs.LEAVE:
                proc = self.cluster.procs[r]
                self.cluster.expected_exit.add(proc.pid)
                self.cluster.signal(r, signal.SIGUSR1)
        self.active.append((time.monotonic() + f.hold_s, f, m))
        self.s.echo(f"  {f}")
        with open(self.folder / "faults.jsonl", "a") as log:
            log.write(json.dumps({"t": m.t_fault, **f.to_dict()}) + "\n")

    def end(self, f: cs.Fault, m: Measure) -> None:
        r = f.ranks[0]
        m.t_end = time.time()
        match f.kind:
            case cs.KILL:
                self.cluster.start(r, join=True)
                self._back(m, r)
            case cs.STOP:
                self.cluster.signal(r, signal.SIGCONT)
            case cs.CUT:
                self._script("heal.sh", f.link())
            case cs.LOSS:
                self._script("loss.sh", "--remove", f.link())
            case cs.STRAGGLER:
                self.straggling.pop(r, None)
                self.cluster.signal(r, signal.SIGCONT)
            case cs.LEAVE:
                proc = self.cluster.procs.get(r)
                if proc is not None:
                    proc.wait(timeout=self.s.end_s)  # it left: its process ends
                    self.cluster.procs.pop(r)
                self.cluster.start(r, join=True)  # a new process in its place
                self._back(m, r)

    def _back(self, m: Measure, rank: int) -> None:
        """The fault's new process: the one whose first contributing step heals it."""
        m.t_back, m.pid_back = time.time(), self.cluster.procs[rank].pid

    def _straggle(self) -> None:
        now = time.monotonic()
        for r, (switch, stopped) in list(self.straggling.items()):
            if now >= switch:
                self.cluster.signal(r, signal.SIGCONT if stopped else signal.SIGSTOP)
                self.straggling[r] = (now + STRAGGLE_S[1 if stopped else 0], not stopped)

    def _script(self, name: str, *args: str) -> None:
        from .realfaults import run_script

        assert self.netns is not None
        run_script(name, "--netns", self.netns, *args)

    def _settle(self) -> None:
        """End faults whose hold is over; release ranks that are whole again."""
        now = time.monotonic()
        for item in [a for a in self.active if a[0] <= now]:
            self.active.remove(item)
            self.end(item[1], item[2])
        busy = {r for _, f, _ in self.active for r in f.ranks}
        self.disturbed = {r for r in self.disturbed if r in busy or not self.healthy(r)}

    # ---- the run ---------------------------------------------------------------------------

    def run(self, duration_s: float) -> RunResult:
        s = self.s
        try:
            self.launch()
            self.wait(f"the first step of all {s.world} workers", self.all_stepped, s.startup_s)
            t0 = math.ceil(max(self.first_step.values()))
            began = time.monotonic() - (time.time() - t0)
            while time.monotonic() < began + duration_s:
                self.tick(began)
                time.sleep(POLL_S)
            return self.finish(t0, duration_s)
        except ChaosFailure:
            self.show_measured()
            raise
        finally:
            self.cluster.close()

    def launch(self) -> None:
        for rank in range(self.s.world):
            self.cluster.start(rank, join=False)

    def all_stepped(self) -> bool:
        return len(self.first_step) == self.s.world

    def tick(self, began: float) -> None:
        """One round of the run: records and exits, faults over and due (timed from `began`, a
        monotonic time), restarts that take too long."""
        self.step_once()
        self._settle()
        due = time.monotonic() - began
        while self.pending and self.pending[0].at_s <= due:
            f = self.pending[0]
            if not cs.allowed(self.disturbed, f.ranks, self.s.world) or not all(self.healthy(r) for r in f.ranks):
                break  # waits (the runner's majority rule); a heal past heal_s fails below
            self.pending.pop(0)
            self.begin(f)
        self._overdue_heals()

    def show_measured(self) -> None:
        """What was measured before a failure: still worth seeing."""
        for m in self.measures:
            if m.healed_s is not None or m.detected_s is not None:
                self.s.echo(f"  before the failure: {m.fault}: detected "
                            + ("-" if m.detected_s is None else f"{m.detected_s:.2f} s")
                            + ("" if m.healed_s is None else f", healed {m.healed_s:.2f} s"))

    def _overdue_heals(self) -> None:
        now = time.time()
        for r in range(self.s.world):
            if r in self.cluster.procs and not self.cluster.contributed[r] and \
                    now - self.cluster.started[r] > self.s.heal_s:
                raise ChaosFailure(f"hang: rank {r}'s process started {self.s.heal_s:g} s ago and has not contributed "
                                   f"to a step")

    def finish(self, t0: float, duration_s: float) -> RunResult:
        """End the faults, wait for every rank to take part again, stop all at one step (so the
        checks see every rank's last step), and count the samples committed from t0 for duration_s."""
        s = self.s
        for item in list(self.active):  # end every fault now
            self.active.remove(item)
            self.end(item[1], item[2])
        self.wait("every rank to contribute again after the last faults",
                  lambda: all(self.healthy(r) for r in range(s.world)), s.heal_s)
        stop = self.checks.newest + s.stop_margin
        (self.folder / STOP_FILE).write_text(f"{stop}\n")
        self.stopping = True
        self.wait(f"every worker to stop after step {stop}", lambda: not self.cluster.procs, s.end_s)
        self.poll()
        if self.checks.newest != stop:
            raise ChaosFailure(f"the job should have stopped after step {stop}, but the newest step is "
                               f"{self.checks.newest}")
        samples = self.checks.committed_between(t0, t0 + duration_s)
        return RunResult(samples, duration_s, self.checks.newest + 1, self.checks.epochs_once, self.measures,
                         self.evictions, [(samples / duration_s, os.getloadavg()[1])])


# ---- one invocation: fault-free, then chaos ------------------------------------------------------


@contextmanager
def network(s: Settings, kinds: tuple[str, ...]) -> Iterator[tuple[str | None, list[str]]]:
    """A namespace for the workers when root (cuts and loss bursts), else the host's loopback."""
    if os.geteuid() == 0 and shutil.which("iptables") and shutil.which("ip"):
        from .realfaults import namespace

        with namespace(None, world=s.world) as ns:
            yield ns, ["ip", "netns", "exec", ns]
    else:
        yield None, []


def run_chaos(s: Settings) -> tuple[RunResult, RunResult, list[str]]:
    """(fault-free, chaos, kinds skipped)."""
    from ..net.credentials import write_key  # here: it pulls in numpy, which `fttree --help` need not pay

    with ExitStack() as stack:
        folder = s.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fttree-chaos-")))
        folder.mkdir(parents=True, exist_ok=True)
        key = write_key(folder / "job.key")
        ns, prefix = stack.enter_context(network(s, s.kinds))
        skipped = [k for k in s.kinds if k in cs.ROOT_KINDS and ns is None]
        kinds = tuple(k for k in s.kinds if k not in skipped) or (cs.KILL,)
        faults = cs.draw(s.world, s.duration_s, s.every_s, s.seed, kinds)

        def peers(port: int) -> list[str]:
            return local_peers(s.world, port=port)

        s.echo(f"{len(faults)} faults drawn (seed {s.seed}, one every {s.every_s:g} s on average)"
               + (f"; skipped without root: {', '.join(skipped)}" if skipped else ""))
        length = s.duration_s / s.pairs
        bases: list[RunResult] = []
        chaoses: list[RunResult] = []
        for i in range(s.pairs):  # alternating, so that a change in the machine's load hits both alike
            port = 29500 if ns else free_port(local_hosts(s.world))
            s.echo(f"fault-free run {i + 1}/{s.pairs}: {s.world} workers for {length:g} s")
            b = Run(s, folder / f"base-{i}", peers(port), key, prefix, ns, []).run(length)
            s.echo(f"  {b.samples} samples in {b.seconds:g} s: {b.rate:.1f}/s over {b.steps} steps "
                   f"(load {b.segments[0][1]:.1f})")
            port = 29600 if ns else free_port(local_hosts(s.world))
            mine = segment(faults, i * length, length)
            s.echo(f"chaos run {i + 1}/{s.pairs}: {len(mine)} faults for {length:g} s")
            c = Run(s, folder / f"chaos-{i}", peers(port), key, prefix, ns, mine).run(length)
            s.echo(f"  {c.samples} samples in {c.seconds:g} s: {c.rate:.1f}/s over {c.steps} steps "
                   f"(load {c.segments[0][1]:.1f}; this pair's goodput {c.rate / b.rate:.2f})")
            bases.append(b)
            chaoses.append(c)
        return functools.reduce(operator.add, bases), functools.reduce(operator.add, chaoses), skipped


def report(base: RunResult, chaos: RunResult, echo: Callable[[str], None]) -> float:
    goodput = chaos.rate / base.rate
    echo(f"chaos: {chaos.samples} samples in {chaos.seconds:g} s: {chaos.rate:.1f}/s over {chaos.steps} steps, "
         f"{chaos.epochs_once} epochs each once, {chaos.evictions} stopped ranks evicted and restarted")
    for kind, ms in by_kind(chaos.measures):
        echo(kind_line(kind, ms))
        parts = [p for p in (m.heal_parts() for m in ms) if p is not None]
        if parts:
            medians = (statistics.median(getattr(p, name) for p in parts) for name in HEAL_PART_NAMES)
            echo(f"  {'':9s} heal parts, median of {len(parts)}: {HealParts(*medians)}")
    for m in chaos.measures:
        if m.fault.kind in cs.REJOINS or m.healed_s is not None:
            split = m.heal_parts()
            echo(f"  heal {m.fault}: " + ("-" if m.healed_s is None else f"{m.healed_s:.2f} s")
                 + ("" if split is None else f" ({split})"))
    return goodput


SUMMARY = "summary.json"  # in the --keep folder: what the last lines say, as data


def summary(base: RunResult, chaos: RunResult, goodput: float, skipped: list[str]) -> dict[str, Any]:
    """The run's figures as data, for tests and scripts (never parse the printed lines)."""
    return {
        "goodput": goodput, "base_rate": base.rate, "chaos_rate": chaos.rate, "chaos_steps": chaos.steps,
        "epochs_once": chaos.epochs_once, "evictions": chaos.evictions, "skipped": skipped,
        "pairs": [{"base_rate": b[0], "base_load": b[1], "chaos_rate": c[0], "chaos_load": c[1]}
                  for b, c in zip(base.segments, chaos.segments, strict=True)],
        "faults": [{**m.fault.to_dict(), "detected_s": m.detected_s, "healed_s": m.healed_s,
                    "heal_parts": None if (p := m.heal_parts()) is None else dataclasses.asdict(p)}
                   for m in chaos.measures],
    }


@click.command()
@click.option("-n", "world", type=click.IntRange(3, 4096), default=7, show_default=True,
              help=f"Workers (a real run: at most {MAX_REAL_WORLD}).")
@click.option("--duration", type=click.FloatRange(min=1), default=60, show_default=True,
              help="Seconds of each run (fault-free, then chaos; simulated seconds with --simulate).")
@click.option("--fault-every", type=click.FloatRange(min=0.1), default=10, show_default=True,
              help="Mean seconds between faults (exponential gaps).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the fault schedule and the job.")
@click.option("--kinds", default=",".join(cs.KINDS), show_default=True, help="Fault kinds to mix.")
@click.option("--hidden", type=click.IntRange(1), default=512, show_default=True,
              help="Hidden units of the MLP (512: the thesis's 407,050 parameters).")
@click.option("--rss-limit-mb", type=click.FloatRange(min=1), default=RSS_LIMIT_MB, show_default=True,
              help="Fail if a worker's RSS grows by more than this after its first steps.")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the workers' records and logs in this new folder (default: deleted).")
@click.option("--pairs", type=click.IntRange(1), default=1, show_default=True,
              help="Alternate fault-free and chaos runs this many times (duration / pairs each), so that a "
                   "change in the machine's load meets both; goodput sums over all of them.")
@click.option("--side-by-side", is_flag=True,
              help="Run the fault-free job and the chaos job at the same time (each in its own namespace as "
                   "root), so that the machine's load meets both alike; goodput over one window, and per --window.")
@click.option("--cpus", type=click.Choice(["share", "pin"]), default="share", show_default=True,
              help="--side-by-side: both jobs share every CPU, or each keeps to its own half of them.")
@click.option("--window", "window_s", type=click.FloatRange(min=1), default=60, show_default=True,
              help="--side-by-side: also report goodput per window of this many seconds, to show its spread.")
@click.option("--calibrate", is_flag=True,
              help="--side-by-side with both jobs fault-free (an A/A run): the set-up's own bias and spread.")
@click.option("--heal-limit", type=click.FloatRange(min=1), default=180, show_default=True,
              help="Fail (a hang) if a restarted worker does not contribute within this many seconds.")
@click.option("--simulate", is_flag=True,
              help="Run the same schedule on the simulator (chaos_sim.py): every second simulated, up to "
                   "thousands of ranks; goodput in simulated time.")
@click.option("--step-s", type=click.FloatRange(min=0.001), default=0.1, show_default=True,
              help="--simulate: the simulated compute between two steps of every rank, seconds.")
def chaos(world: int, duration: float, fault_every: float, seed: int, kinds: str, hidden: int,
          rss_limit_mb: float, pairs: int, side_by_side: bool, cpus: str, window_s: float, calibrate: bool,
          heal_limit: float, keep: Path | None, simulate: bool, step_s: float) -> None:
    """Goodput under a seeded random mix of real faults, against a fault-free run of the same job."""
    began = time.monotonic()

    def echo(line: str) -> None:
        click.echo(f"[{time.monotonic() - began:6.1f} s] {line}")

    if calibrate and not side_by_side:
        raise click.BadParameter("an A/A calibration runs both jobs side by side: add --side-by-side",
                                 param_hint="--calibrate")
    if side_by_side and (pairs > 1 or simulate):
        raise click.BadParameter("--side-by-side runs both jobs at once: --pairs (one after the other) and "
                                 "--simulate do not go with it", param_hint="--side-by-side")
    if simulate:
        _simulate(world, duration, fault_every, seed, kinds, step_s, heal_limit, echo)
        return
    if world > MAX_REAL_WORLD:
        raise click.BadParameter(f"a real run starts at most {MAX_REAL_WORLD} workers on this machine, got {world}; "
                                 "--simulate runs more", param_hint="-n")
    try:
        s = Settings(world=world, duration_s=duration, every_s=fault_every, seed=seed, kinds=cs.parse_kinds(kinds),
                     hidden=hidden, rss_limit_mb=rss_limit_mb, pairs=pairs, cpus=cpus,
                     window_s=window_s, calibrate=calibrate, heal_s=heal_limit, keep=keep, echo=echo)
        side, spread = None, None
        if side_by_side:
            from .chaos_side import report_windows, run_side_by_side

            side = run_side_by_side(s)
            base, result, skipped = side.base, side.chaos, side.skipped
        else:
            base, result, skipped = run_chaos(s)
        goodput = report(base, result, echo)
        if side is not None:
            spread = report_windows(side, echo)
    except FTTreeError as exc:
        click.echo(f"FAILED: {exc}")
        sys.exit(1)
    if keep is not None:
        data = summary(base, result, goodput, skipped)
        if side is not None:
            data["side_by_side"] = side.summary(s)
        (keep / SUMMARY).write_text(json.dumps(data, indent=1) + "\n")
    how = "" if side is None else (f"; side by side, CPUs {'pinned' if cpus == 'pin' else 'shared'}"
                                   + ("" if spread is None else f"; windows {spread}")
                                   + ("; A/A calibration" if calibrate else ""))
    click.echo(f"goodput {goodput:.2f} ({result.rate:.1f} / {base.rate:.1f} samples/s, {len(result.measures)} faults"
               + (f"; skipped without root: {', '.join(skipped)}" if skipped else "") + how + ")")


def _simulate(world: int, duration: float, fault_every: float, seed: int, kinds: str, step_s: float,
              heal_limit: float, echo: Callable[[str], None]) -> None:
    from .chaos_sim import SimSettings, run_sim_chaos
    from .chaos_sim import report as sim_report

    try:
        s = SimSettings(world=world, duration_s=duration, every_s=fault_every, seed=seed, kinds=cs.parse_kinds(kinds),
                        step_s=step_s, heal_s=heal_limit, echo=echo)
        base, result = run_sim_chaos(s)
        goodput = sim_report(base, result, world, echo)
    except FTTreeError as exc:
        click.echo(f"FAILED: {exc}")
        sys.exit(1)
    click.echo(f"goodput {goodput:.2f} ({result.rate:.1f} / {base.rate:.1f} contributions per simulated s, "
               f"{len(result.measures)} faults, {world} simulated ranks)")
