"""`fttree launch`: N local workers, each a process on its own 127.0.0.x address, running the
demo job; their per-step JSON lines are gathered into one table."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..core.faults import FaultKind, FaultRule, FaultSchedule
from ..errors import ConfigError
from ..net.address import local_peers
from .demo import StepRecord
from .nodefaults import NodeFault, NodeFaultDriver, node_faults

if TYPE_CHECKING:
    from .rank_uplinks import UplinkCounter


@dataclass(frozen=True, slots=True)
class Shortfall:
    """One way one rank's record of one step fell short of a clean run (LaunchResult.shortfalls)."""

    step: int
    rank: int
    what: Literal["no report", "not exact", "not everybody in the sum", "another view"]
    detail: str = ""  # the error, the contributors, the view


@dataclass
class LaunchResult:
    """Everything the workers of one launch reported, and what fault injection did to them.

    A rank's records count from step 0 up to the step a fault took it out of the group (a crash
    or hang of its process, or the minority side of a partition or an isolation that the
    schedule asked for); a survivor's count to the end. The run is ok when every counted record
    is exact (the sum over the contributors it reports), the survivors agree bit for bit, and
    every survivor exited with 0."""

    world: int
    steps: int = 0
    records: dict[int, dict[int, StepRecord]] = field(default_factory=lambda: defaultdict(dict))
    exit_codes: dict[int, int] = field(default_factory=dict)
    stderr_tail: dict[int, list[str]] = field(default_factory=dict)
    node_faults: list[NodeFault] = field(default_factory=list)
    fates: dict[int, str] = field(default_factory=dict)  # rank -> what fault injection did to it
    rules: list[FaultRule] = field(default_factory=list)  # the whole schedule, to explain who left the group
    # restarted rank -> the newest step any rank had reported when its new process was up (its
    # Python and imports done, fttree about to start): what follows is fttree's part of the heal
    up_after: dict[int, int] = field(default_factory=dict)
    # rank -> what its shaped uplink carried (`--shape-uplink`, rank_uplinks.py); empty when unshaped
    uplinks: dict[int, UplinkCounter] = field(default_factory=dict)

    def struck_at(self, rank: int) -> int | None:
        """The step from which a node fault took `rank` out (None: no node fault)."""
        return next((f.first for f in self.node_faults if f.rank == rank), None)

    def left_at(self, rank: int) -> int | None:
        """The first step `rank` failed with GroupLeft, if the schedule explains it (a partition
        left its side in the minority, an isolation cut it off); None otherwise."""
        for step in sorted(self.records):
            rec = self.records[step].get(rank)
            if rec is not None and rec.error_kind == "GroupLeft":
                return step if self.cut_off_by(rank) else None
        return None

    def cut_off_by(self, rank: int) -> list[str]:
        """The rules of the schedule that can leave `rank` out of the group."""
        return [str(rule) for rule in self.rules if cut_off(rule, rank, self.world)]

    def out_from(self, rank: int) -> int | None:
        """The step from which `rank`'s records do not count, if a fault took it out."""
        steps = [s for s in (self.struck_at(rank), self.left_at(rank)) if s is not None]
        return min(steps) if steps else None

    def counted(self, step: int) -> dict[int, StepRecord]:
        """The records of `step` that count: every rank not taken out by then."""
        return {r: rec for r, rec in self.records.get(step, {}).items()
                if (out := self.out_from(r)) is None or step < out}

    def expected(self, step: int) -> set[int]:
        return {r for r in range(self.world) if (out := self.out_from(r)) is None or step < out}

    @property
    def survivors(self) -> list[int]:
        return [r for r in range(self.world) if self.out_from(r) is None]

    def all_steps(self) -> list[int]:
        return list(range(self.steps)) if self.steps else sorted(self.records)

    def step_time(self, step: int) -> float:
        """Slowest counted worker's time for a step: when the step was done everywhere it counts."""
        recs = self.counted(step) or self.records[step]
        return max(r.duration_s for r in recs.values())

    def back_at(self, rank: int) -> int | None:
        """The first step after `rank` was killed whose sum (as the others report it) has it
        among the contributors again: a restarted rank rejoined there."""
        out = self.struck_at(rank)
        if out is None:
            return None
        for step in sorted(s for s in self.records if s > out):
            others = [rec for r, rec in self.records[step].items() if r != rank and not rec.error]
            if others and all(rank in rec.ranks for rec in others):
                return step
        return None

    def heal_line(self, rank: int) -> str:
        """Where a restarted rank came back, and how many steps of that were fttree's: from its
        new process being up (its interpreter and imports take seconds on a loaded machine)."""
        back = self.back_at(rank)
        if back is None:
            return "never among the contributors again"
        up = self.up_after.get(rank)
        if up is None:
            return f"among the contributors again from step {back}"
        return (f"among the contributors again from step {back}, {back - up} steps after its new process was up "
                f"(after step {up})")

    def relayed_per_step(self) -> float:
        """Envelope bytes sent and carried through relays per step, over all ranks, from step
        1 (the first step's includes the start's membership frames) to each rank's last."""
        steps = sorted(self.records)
        if len(steps) < 2:
            return 0.0
        first, last = self.records[steps[0]], self.records[steps[-1]]
        total = sum(rec.relayed_bytes - first[r].relayed_bytes for r, rec in last.items() if r in first)
        return total / (len(steps) - 1)

    def all_exact(self) -> bool:
        """Every rank that counts reported every step, exactly."""
        for step in self.all_steps():
            recs = self.counted(step)
            if set(recs) != self.expected(step) or not all(r.exact for r in recs.values()):
                return False
        return True

    def shortfalls(self, view: int | None = 0) -> list[Shortfall]:
        """Where this run was not clean: every step reported by every rank of the world, exact,
        with every rank in the sum, in `view` (0: no view change; None: any). Empty when clean.
        For runs without faults, where any of these is a failure; `ok` judges runs with them."""
        everyone = tuple(range(self.world))
        out: list[Shortfall] = []
        for step in self.all_steps():
            recs = self.records.get(step, {})
            for rank in everyone:
                rec = recs.get(rank)
                if rec is None:
                    out.append(Shortfall(step, rank, "no report"))
                    continue
                if not rec.exact:
                    out.append(Shortfall(step, rank, "not exact", rec.error or "wrong sum"))
                if tuple(rec.ranks) != everyone:
                    out.append(Shortfall(step, rank, "not everybody in the sum", f"sum of {list(rec.ranks)}"))
                if view is not None and rec.epoch != view:
                    out.append(Shortfall(step, rank, "another view", f"view {rec.epoch}: {rec.members}"))
        return out

    def deciding_members(self, step: int) -> set[int]:
        """The members of the view that settled `step`: the newest view any counted worker
        delivered the step in (a view change that reruns a step moves it to a later epoch)."""
        done = [r for r in self.counted(step).values() if not r.error]
        if not done:
            return set()
        newest = max(done, key=lambda r: r.epoch)
        return set(newest.members)

    def agree(self) -> bool:
        """The guarantee: every member of the view that settled a step delivered the same
        result for it, with the same contributors."""
        for s in self.all_steps():
            members = self.deciding_members(s)
            if len({(r.digest, tuple(r.ranks)) for rank, r in self.counted(s).items()
                    if not r.error and rank in members}) > 1:
                return False
        return True

    def departures(self) -> list[tuple[int, int]]:
        """(rank, step) of every worker that delivered a step and is not in the view that
        settled it, though no fault the schedule names explains it: the group left it out
        (it may have delivered a result the group did not settle on)."""
        return [(rank, s) for s in self.all_steps() if (members := self.deciding_members(s))
                for rank, r in sorted(self.counted(s).items()) if not r.error and rank not in members]

    @property
    def ok(self) -> bool:
        return (self.all_exact() and self.agree() and not self.departures()
                and all(self.exit_codes.get(r, 0) == 0 for r in self.survivors))


def cut_off(rule: FaultRule, rank: int, world: int) -> bool:
    """Can `rule` leave `rank` out of the group (so its GroupLeft is the fault's doing)?"""
    if rule.kind is FaultKind.ISOLATE:
        return rank == rule.a
    if rule.kind is FaultKind.PARTITION:
        inside = rank in rule.group
        side = len(rule.group) if inside else world - len(rule.group)
        return 2 * side <= world  # the side without a majority stops
    return False


def worker_command(rank: int, peers_file: Path, args: Sequence[str], verbose: int = 0) -> list[str]:
    return [sys.executable, "-m", "fttree", *["-v"] * verbose, "worker", "--rank", str(rank), "--peers",
            str(peers_file), "--json", *args]


#: what a step line shows: data that went around a link, lost or by plan (link memory)
_SHOWN = frozenset({"data_came_around", "detour"})


def format_step(step: int, recs: dict[int, StepRecord], world: int, *, previous_epoch: int | None = None,
                struck: Sequence[str] = ()) -> str:
    """One line of the launch table: the slowest time, how many results were exact, who is in
    the sum when not everybody is, a new view, and what went around or failed."""
    slowest = max(r.duration_s for r in recs.values())
    exact = sum(r.exact for r in recs.values())
    done = [r for r in recs.values() if not r.error]
    events = sorted({e["text"] for r in recs.values() for e in r.events if e["cause"] in _SHOWN})
    errors = sorted({f"rank {r.rank}: {r.error}" for r in recs.values() if r.error})
    line = f"step {step:3d}  {slowest * 1000:8.1f} ms  exact {exact}/{len(recs)}"
    sums = {tuple(r.ranks) for r in done}
    if len(sums) == 1:
        (ranks,) = sums
        if len(ranks) < world:
            missing = sorted(set(range(world)) - set(ranks))
            line += f"  sum of {len(ranks)}/{world} (without {', '.join(map(str, missing))})"
    elif len(sums) > 1:
        line += "  CONTRIBUTORS DIFFER: " + "; ".join(f"rank {r.rank} {r.ranks}" for r in done)
    if len({r.digest for r in done}) > 1:
        line += "  RESULTS DIFFER"
    tail: list[str] = list(struck)
    epochs = sorted({r.epoch for r in done})
    if epochs and previous_epoch is not None and epochs[-1] > previous_epoch:
        newest = next(r for r in done if r.epoch == epochs[-1])
        tail.append(f"view {newest.epoch}: {newest.members}")
    tail += events + errors
    if tail:
        line += "  | " + "; ".join(tail)
    return line


class _Table:
    """Prints the step lines in order, each once the ranks that count for it have reported."""

    def __init__(self, result: LaunchResult, driver: NodeFaultDriver | None, echo: Callable[[str], None]) -> None:
        self.result, self.driver, self.echo = result, driver, echo
        self.printed = 0
        self.epoch = 0

    def _waiting_for(self, step: int) -> set[int]:
        absent = self.driver.absent(step) if self.driver is not None else set()
        return set(range(self.result.world)) - absent - self._left(step)

    def _left(self, step: int) -> set[int]:
        return {r for r in range(self.result.world) if (s := self.result.left_at(r)) is not None and s <= step}

    def _line(self, step: int, note: str = "") -> None:
        recs = {r: rec for r, rec in self.result.records[step].items() if r in self._waiting_for(step)} \
            or self.result.records[step]
        done = {FaultKind.CRASH: "killed", FaultKind.HANG: "stopped", FaultKind.RESTART: "restarted"}
        struck = [f"rank {f.rank} {done.get(f.kind, f.kind.value)} ({f.rule})"
                  for f in self.result.node_faults if f.first == step]
        self.echo(format_step(step, recs, self.result.world, previous_epoch=self.epoch, struck=struck) + note)
        self.epoch = max([self.epoch, *(r.epoch for r in recs.values() if not r.error)])

    def flush(self) -> None:
        records = self.result.records
        while self.printed in records and self._waiting_for(self.printed) <= set(records[self.printed]):
            self._line(self.printed)
            self.printed += 1

    def finish(self) -> None:
        self.flush()
        for step in sorted(s for s in self.result.records if s >= self.printed):
            have, want = set(self.result.records[step]), self._waiting_for(step)
            self._line(step, f"  (no report from ranks {sorted(want - have)})" if want - have else "")
        self.printed = max(self.result.records, default=-1) + 1


def _explain_exits(result: LaunchResult, stderr_lines: dict[int, list[str]], echo: Callable[[str], None]) -> None:
    """Say what happened to each worker that did not end normally: fault injection and its
    consequences are reported as such, anything else as a failure with its last words."""
    for rank, code in sorted(result.exit_codes.items()):
        fate = result.fates.get(rank)
        left = result.left_at(rank)
        if fate is not None:
            struck = result.struck_at(rank)
            after = [rec for s, recs in sorted(result.records.items()) if struck is not None and s >= struck
                     for r, rec in recs.items() if r == rank]
            then = f"; then {after[0].error_kind or 'step'}: {after[0].error}" if after and after[0].error else ""
            echo(f"worker {rank}: {fate} (exit code {code}){then}")
        elif left is not None:
            rec = result.records[left][rank]
            echo(f"worker {rank}: left the group at step {left}, cut off by {'; '.join(result.cut_off_by(rank))} "
                 f"(exit code {code}): {rec.error}")
        elif code != 0:
            result.stderr_tail[rank] = stderr_lines[rank]
            failed = [rec for _, recs in sorted(result.records.items()) for r, rec in recs.items()
                      if r == rank and rec.error]
            echo(f"worker {rank} exited with code {code}" + (f" after {len(failed)} failed steps, the first: "
                                                              f"{failed[0].error}" if failed else ":"))
            for line in [] if failed else stderr_lines[rank][-8:]:
                echo(f"  [rank {rank}] {line}")


def launch(n: int, worker_args: Sequence[str], *, steps: int, host_base: str = "127.0.0.1", port: int = 29500,
           launch_dir: Path | None = None, deadline_s: float = 600.0,
           echo: Callable[[str], None] = print, prefix: Sequence[str] = (),
           schedule: FaultSchedule | None = None, driver: NodeFaultDriver | None = None,
           verbose: int = 0, peers: Sequence[str] | None = None,
           rank_prefix: Callable[[int], Sequence[str]] | None = None) -> LaunchResult:
    """Start n workers, stream their step lines, and return everything they reported. Each
    worker's log (stderr; `verbose` as -v gives the workers) goes to worker-R.log in the launch
    directory.

    `prefix` is put before each worker command (for example `ip netns exec NAME`), and after it
    `rank_prefix(rank)` (for example `netem/nat.sh exec NAME RANK --`). `peers` replaces the
    local peers file (rank r on host_base + r), for ranks in namespaces of their own. The crash and
    hang rules of `schedule` are carried out on the worker processes (SIGKILL, SIGSTOP/SIGCONT;
    see nodefaults.py) by `driver`, made here unless given; the caller leaves them out of the
    workers' own `--faults`. The other rules only explain who may leave the group."""
    if n < 1:
        raise ConfigError(f"-n must be at least 1, got {n}")
    workdir = launch_dir or Path(tempfile.mkdtemp(prefix="fttree-launch-"))
    workdir.mkdir(parents=True, exist_ok=True)
    schedule = FaultSchedule() if schedule is None else schedule
    if driver is None:
        driver = NodeFaultDriver(node_faults(schedule, steps), world=n,
                                 gate_dir=Path(tempfile.mkdtemp(prefix="gates-", dir=workdir)), echo=echo)
    peers = list(peers) if peers is not None else local_peers(n, host_base, port)
    if len(peers) != n:
        raise ConfigError(f"{len(peers)} peers for {n} workers")
    peers_file = workdir / "peers.txt"
    peers_file.write_text("\n".join(peers) + "\n")
    echo(f"launching {n} workers ({peers[0]} .. {peers[-1]}), peers in {peers_file}")
    for f in driver.faults:
        if f.kind is FaultKind.RESTART:
            echo(f"node fault: {f.rule}: a new process of rank {f.rank} once the others finished step {f.first - 1}")
            continue
        echo(f"node fault: {f.rule}: {f.signal_name} of rank {f.rank}'s process when it reaches step {f.first}"
             + (f", SIGCONT once the others finished step {f.last}" if f.kind is FaultKind.HANG else ""))
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    procs: dict[int, subprocess.Popen[str]] = {}
    old_procs: list[subprocess.Popen[str]] = []  # processes a restart replaced (ended with the others)
    result = LaunchResult(world=n, steps=steps, node_faults=list(driver.faults), rules=list(schedule.rules))
    stderr_lines: dict[int, list[str]] = defaultdict(list)
    table = _Table(result, driver, echo)

    def pump(rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((rank, line))
        lines.put((-1 - proc.pid, None))  # this process's output ended (a rank may have had two)

    def pump_err(rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        name = f"worker-{rank}-restarted.log" if rank in restarted else f"worker-{rank}.log"
        with open(workdir / name, "w") as log:
            for line in proc.stderr:
                log.write(line)
                stderr_lines[rank].append(line.rstrip())
                del stderr_lines[rank][:-20]

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    open_streams: set[int] = set()  # pids whose output is still open
    restarted: set[int] = set()

    def start(rank: int, gates: bool = True) -> subprocess.Popen[str]:
        """Start rank `rank`'s worker; a restart's new process (gates=False) finds the running
        group by itself and joins it, through its NAT where it is behind one."""
        cmd = [*prefix, *(rank_prefix(rank) if rank_prefix is not None else ()),
               *worker_command(rank, peers_file, [*worker_args, *(driver.worker_args(rank) if gates else [])],
                               verbose)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        open_streams.add(proc.pid)
        threading.Thread(target=pump, args=(rank, proc), daemon=True).start()
        threading.Thread(target=pump_err, args=(rank, proc), daemon=True).start()
        return proc

    def restart(rank: int) -> subprocess.Popen[str]:
        restarted.add(rank)
        old_procs.append(procs[rank])
        procs[rank] = start(rank, gates=False)
        return procs[rank]

    driver.spawn = restart
    try:
        for rank in range(n):
            procs[rank] = start(rank)
        driver.start(procs)
        end = time.monotonic() + deadline_s
        while open_streams:
            if time.monotonic() > end:
                echo(f"launch: gave up after {deadline_s:g} s; workers still running: {sorted(open_streams)}")
                break
            try:
                rank, line = lines.get(timeout=0.1)  # also wakes up to print steps a kill completed
            except queue.Empty:
                table.flush()
                continue
            if line is None:
                open_streams.discard(-1 - rank)
                continue
            try:
                said = json.loads(line)
                if isinstance(said, dict) and said.keys() == {"up"}:  # a (re)started worker is up
                    if rank in restarted and rank not in result.up_after:
                        result.up_after[rank] = max(result.records, default=-1)
                    continue
                rec = StepRecord(**said)
            except (ValueError, TypeError):
                echo(f"[rank {rank}] {line.rstrip()}")
                continue
            result.records[rec.step][rec.rank] = rec
            driver.note_step(rec.rank, rec.step)
            table.flush()
        table.finish()
    finally:
        driver.close()  # continue stopped victims first: a stopped process cannot even handle SIGTERM
        for proc in [*procs.values(), *old_procs]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for rank, proc in procs.items():
            try:
                result.exit_codes[rank] = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                result.exit_codes[rank] = proc.wait()
        for proc in old_procs:  # killed by fault injection: reaped here
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    if driver.error is not None:
        echo(f"node fault injection failed: {driver.error}")
    result.fates = {r: fate for r in range(n) if (fate := driver.fate(r)) is not None}
    for rank in sorted(restarted):
        echo(f"rank {rank} restarted: {result.heal_line(rank)}")
    _explain_exits(result, stderr_lines, echo)
    if result.records:
        survivors = result.survivors
        times = [result.step_time(s) for s in sorted(result.records) if set(result.counted(s)) == result.expected(s)]
        who = f"all {n} workers" if len(survivors) == n else f"every worker that counts (survivors {survivors})"
        if times:
            echo(f"{len(times)} steps done on {who}; median {statistics.median(times) * 1000:.1f} ms, "
                 f"max {max(times) * 1000:.1f} ms; all exact: {'yes' if result.all_exact() else 'NO'}"
                 + ("" if result.agree() else "; RESULTS DIFFER between members")
                 + "".join(f"; rank {r} left out of the group in step {s}" for r, s in result.departures()[:5]))
        relayed = result.relayed_per_step()
        if relayed:
            echo(f"relayed (ranks that cannot connect, net/relay.py): {relayed:,.0f} bytes a step, sent and "
                 f"carried, all ranks together (from step 1)")
    return result
