"""Node faults for real: `crash R @S` is a SIGKILL and `hang R @S..T` a SIGSTOP, then a SIGCONT,
of a worker process, carried out by whoever started the workers (`fttree launch`, `fttree bench`).

In-process, `crash` can only be emulated (FTTreeAllreduce.crash resets the rank's sockets) and a
hang cannot be done at all: a process cannot freeze itself and wake up again. Here the kernel
does both, to a process we started, by its pid.

Steps and signals are tied together by a per-rank gate (StepGate with a tag): before step S the
victim drops `node-ready-S-R` and waits for `node-go-S-R`. The driver fires once the victim is
there *and* every other live rank has reported step S-1, so the fault hits step S and no earlier
one: the victim never submits step S, as with the in-process crash. The other ranks do not wait;
they run into step S and find the victim dead (reset connections) or frozen (silence).

A hung victim is continued once every other live rank has reported step T (the others finished
the window without it), and always before the run ends, even when it fails: a stopped process
would otherwise outlive us, and it cannot even handle SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.faults import FaultKind, FaultRule, FaultSchedule
from ..errors import ConfigError, FTTreeError

GATE_POLL_S = 0.005
NODE_TAG = "node-"


class RealFaultError(FTTreeError):
    """Real fault injection failed: a netem script failed, the machine cannot inject real faults
    (not root, no iptables), a signal could not be sent, or a worker waited too long at a gate."""


class StepGate:
    """Called by a worker before each step; at gated steps it waits for the runner (the real-fault
    runner, or the node-fault driver). Untagged gates are shared by every rank (`go-S`); a tagged
    gate is this rank's own (`{tag}go-S-R`), so one rank can be held without holding the others."""

    def __init__(self, directory: Path, steps: Sequence[int], rank: int, timeout_s: float, *, tag: str = "") -> None:
        self.dir, self.steps, self.rank, self.timeout_s, self.tag = directory, frozenset(steps), rank, timeout_s, tag

    @staticmethod
    def parse_steps(text: str) -> list[int]:
        try:
            return [int(s) for s in text.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(f"gate steps must be comma-separated step numbers, got {text!r}") from None

    def go_file(self, step: int) -> Path:
        return self.dir / (f"{self.tag}go-{step}-{self.rank}" if self.tag else f"go-{step}")

    def __call__(self, step: int) -> None:
        if step not in self.steps:
            return
        (self.dir / f"{self.tag}ready-{step}-{self.rank}").touch()
        go, abort = self.go_file(step), self.dir / "abort"
        end = time.monotonic() + self.timeout_s
        while not go.exists():  # checked first: a process continued after SIGSTOP finds it there at once
            if abort.exists():
                raise RealFaultError(f"rank {self.rank}: the fault runner gave up before step {step}: "
                                f"{abort.read_text().strip()}")
            if time.monotonic() > end:
                raise RealFaultError(f"rank {self.rank} waited {self.timeout_s:g} s before step {step} for the fault "
                                f"runner ({go} never appeared)")
            time.sleep(GATE_POLL_S)


def chain(*gates: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """One before-step hook that calls each given gate in order (None when there is none)."""
    present = [g for g in gates if g is not None]
    if not present:
        return None

    def before(step: int) -> None:
        for gate in present:
            gate(step)

    return before


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeFault:
    """One crash or hang of one rank: it strikes before step `first`; a hang ends once the others
    have finished step `last`."""

    rank: int
    kind: FaultKind  # CRASH, HANG, or RESTART (a new process of a rank killed before)
    first: int
    last: int
    rule: str

    @property
    def signal_name(self) -> str:
        if self.kind is FaultKind.RESTART:
            return "a new process"
        return "SIGKILL" if self.kind is FaultKind.CRASH else "SIGSTOP"


def node_faults(schedule: FaultSchedule, steps: int) -> list[NodeFault]:
    """The schedule's crash and hang rules as faults to carry out in a run of `steps` steps."""
    out: list[NodeFault] = []
    restarts: list[NodeFault] = []
    seen: dict[int, str] = {}
    for rule in schedule.node_faults():
        assert rule.first_step is not None  # the parser insists on @S for node faults
        if rule.kind is FaultKind.RESTART:
            if rule.first_step >= steps:
                raise ConfigError(f"fault {str(rule)!r} starts at step {rule.first_step}, but the run has only "
                                  f"{steps} steps (0..{steps - 1})")
            restarts.append(NodeFault(rank=rule.a, kind=rule.kind, first=rule.first_step, last=rule.first_step,
                                      rule=str(rule)))
            continue
        if rule.a in seen:
            raise ConfigError(f"faults {seen[rule.a]!r} and {str(rule)!r} both strike rank {rule.a}: a process can "
                              f"be killed or stopped once per run")
        seen[rule.a] = str(rule)
        if rule.first_step >= steps:
            raise ConfigError(f"fault {str(rule)!r} strikes at step {rule.first_step}, but the run has only {steps} "
                              f"steps (0..{steps - 1})")
        last = rule.first_step if rule.kind is FaultKind.CRASH else min(
            steps - 1, rule.last_step if rule.last_step is not None else steps - 1)
        out.append(NodeFault(rank=rule.a, kind=rule.kind, first=rule.first_step, last=last, rule=str(rule)))
    if len({f.rank for f in restarts}) < len(restarts):
        raise ConfigError("a rank is restarted once per run")
    for f in restarts:  # (the crash may come after the restart in the schedule's text)
        crash = next((c for c in out if c.rank == f.rank and c.kind is FaultKind.CRASH), None)
        if crash is None or crash.first >= f.first:
            raise ConfigError(f"fault {f.rule!r} restarts rank {f.rank}, which no earlier crash kills (write "
                              f"'crash {f.rank} @S; restart {f.rank} @T' with S < T)")
    return sorted(out + restarts, key=lambda f: (f.first, f.rank))


def link_rules(schedule: FaultSchedule) -> list[FaultRule]:
    """The rules the workers' in-process fault layer (or the firewall) applies: all but crash, hang
    and restart."""
    kinds = {FaultKind.CRASH, FaultKind.HANG, FaultKind.RESTART}
    return [r for r in schedule.rules if r.kind not in kinds]


def link_schedule_text(schedule: FaultSchedule) -> str:
    return "; ".join(str(r) for r in link_rules(schedule))


# ---- the driver (launcher side) ----------------------------------------------------------------


@dataclass(slots=True)
class Fired:
    fault: NodeFault
    pid: int
    at: float  # time.monotonic() of the signal
    resumed_at: float | None = None  # a hang's SIGCONT


class NodeFaultDriver:
    """Carries out crash and hang faults on worker processes this program started.

    `note_step(rank, step)` is called for every step record a worker reports; the driver's thread
    watches the victims' gate files and signals them by pid. `close()` continues every stopped
    victim; call it before ending the workers."""

    def __init__(self, faults: Sequence[NodeFault], *, world: int, gate_dir: Path,
                 echo: Callable[[str], None] = print) -> None:
        for f in faults:
            if not 0 <= f.rank < world:
                raise ConfigError(f"fault {f.rule!r} names rank {f.rank}, outside the world of {world}")
        self.faults = list(faults)
        self.world = world
        self.gate_dir = gate_dir
        self.echo = echo
        self.fired: dict[int, Fired] = {}  # rank -> what was done to it
        self.error: BaseException | None = None
        self._procs: dict[int, subprocess.Popen[str]] = {}
        self._reported: dict[int, set[int]] = {}  # step -> ranks that reported it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fttree-node-faults", daemon=True)
        # starts a new process of a rank (a restart), set by the launcher that starts the workers
        self.spawn: Callable[[int], subprocess.Popen[str]] | None = None
        self._closed = False

    def __bool__(self) -> bool:
        return bool(self.faults)

    def gate_steps(self, rank: int) -> list[int]:
        return [f.first for f in self.faults if f.rank == rank and f.kind is not FaultKind.RESTART]

    def worker_args(self, rank: int) -> list[str]:
        """The gate flags of one worker (none for a rank no fault strikes)."""
        steps = self.gate_steps(rank)
        if not steps:
            return []
        return ["--gate-dir", str(self.gate_dir), "--node-gate-steps", ",".join(map(str, steps))]

    # ---- what the launcher tells us, and asks ------------------------------------------------

    def start(self, procs: Mapping[int, subprocess.Popen[str]]) -> None:
        if not self.faults:
            return
        self.gate_dir.mkdir(parents=True, exist_ok=True)
        self._procs = dict(procs)
        self._thread.start()

    def note_step(self, rank: int, step: int) -> None:
        with self._lock:
            self._reported.setdefault(step, set()).add(rank)

    def absent(self, step: int) -> set[int]:
        """Ranks that will not report `step` in time: killed at or before it (a restarted one
        reports the steps after it is admitted, not counted), or hung from it on (a hung rank
        reports its steps only when continued, after the others)."""
        return {f.rank for f in self.faults if f.first <= step and f.kind is not FaultKind.RESTART}

    def gone_now(self) -> set[int]:
        """Ranks dead or stopped right now (nobody should wait for them at a gate)."""
        with self._lock:
            return {r for r, fired in self.fired.items()
                    if fired.fault.kind is FaultKind.CRASH or fired.resumed_at is None}

    def fate(self, rank: int) -> str | None:
        """What fault injection did to `rank`, in words; None if nothing (yet)."""
        with self._lock:
            fired = self.fired.get(rank)
        if fired is None:
            return None
        f = fired.fault
        if f.kind is FaultKind.RESTART:
            return f"killed and restarted by fault injection ({f.rule}): pid {fired.pid} started before step {f.first}"
        if f.kind is FaultKind.CRASH:
            return f"killed by fault injection ({f.rule}): SIGKILL of pid {fired.pid} before step {f.first}"
        resumed = (f"SIGCONT after the others finished step {f.last}" if fired.resumed_at is not None
                   else "never continued")
        return f"hung by fault injection ({f.rule}): SIGSTOP of pid {fired.pid} before step {f.first}, {resumed}"

    # ---- the thread ---------------------------------------------------------------------------

    def _live_others(self, victim: int) -> set[int]:
        """Ranks whose reports the victim's signal waits for: all but the victim and the ranks
        already killed or stopped (they report nothing)."""
        gone = {r for r, fired in self.fired.items() if fired.fault.kind is FaultKind.CRASH or fired.resumed_at is None}
        restarted = {f.rank for f in self.faults if f.kind is FaultKind.RESTART}  # reports only once admitted
        return set(range(self.world)) - gone - restarted - {victim}

    def _reported_by(self, step: int, ranks: Iterable[int]) -> bool:
        return step < 0 or set(ranks) <= self._reported.get(step, set())

    def _signal(self, rank: int, sig: signal.Signals) -> int:
        proc = self._procs[rank]
        if proc.poll() is not None:  # already gone (and reaped: its pid may belong to another process now)
            raise ProcessLookupError(f"rank {rank} (pid {proc.pid}) had already exited with code {proc.returncode}")
        os.kill(proc.pid, sig)
        return proc.pid

    def _run(self) -> None:
        pending = list(self.faults)
        try:
            while (pending or self._stopped_hangs()) and not self._stop.wait(GATE_POLL_S):
                for f in list(pending):
                    if f.kind is FaultKind.RESTART:  # its process is dead: no gate, only the others' steps
                        if f.rank not in self.fired:
                            continue
                    elif not (self.gate_dir / f"{NODE_TAG}ready-{f.first}-{f.rank}").exists():
                        continue
                    with self._lock:
                        if not self._reported_by(f.first - 1, self._live_others(f.rank)):
                            continue
                    self._fire(f)
                    pending.remove(f)
                for rank in self._stopped_hangs():
                    f = self.fired[rank].fault
                    with self._lock:
                        if not self._reported_by(f.last, self._live_others(rank)):
                            continue
                    self._resume(rank, f"the others finished step {f.last}")
        except BaseException as exc:
            self.error = exc
            (self.gate_dir / "abort").write_text(f"node fault injection failed: {exc}")

    def _stopped_hangs(self) -> list[int]:
        with self._lock:
            return [r for r, fired in self.fired.items()
                    if fired.fault.kind is FaultKind.HANG and fired.resumed_at is None]

    def _fire(self, f: NodeFault) -> None:
        if f.kind is FaultKind.RESTART:
            if self.spawn is None:
                raise RealFaultError(f"{f.rule}: this launcher cannot start processes")
            proc = self.spawn(f.rank)
            with self._lock:
                self._procs[f.rank] = proc
                self.fired[f.rank] = Fired(fault=f, pid=proc.pid, at=time.monotonic())
            self.echo(f"fault injection: restarted rank {f.rank} (pid {proc.pid}) after the others finished step "
                      f"{f.first - 1} ({f.rule})")
            return
        if f.kind is FaultKind.CRASH:
            pid = self._signal(f.rank, signal.SIGKILL)
        else:
            pid = self._signal(f.rank, signal.SIGSTOP)
            # Written now, read only when continued: the gate checks for it before anything else.
            (self.gate_dir / f"{NODE_TAG}go-{f.first}-{f.rank}").touch()
        with self._lock:
            self.fired[f.rank] = Fired(fault=f, pid=pid, at=time.monotonic())
        self.echo(f"fault injection: {f.signal_name} rank {f.rank} (pid {pid}) before step {f.first} ({f.rule})")

    def _resume(self, rank: int, why: str) -> None:
        fired = self.fired[rank]
        proc = self._procs[rank]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        with self._lock:
            fired.resumed_at = time.monotonic()
        self.echo(f"fault injection: SIGCONT rank {rank} (pid {fired.pid}): {why}")

    def close(self) -> None:
        """Stop watching and continue every victim still stopped. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for rank in self._stopped_hangs():
            self._resume(rank, "the run is ending")

    def __enter__(self) -> NodeFaultDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
