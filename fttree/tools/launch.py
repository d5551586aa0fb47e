"""`fttree launch`: N local workers, each a process on its own 127.0.0.x address, running the
demo job; their per-step JSON lines are gathered into one table."""

from __future__ import annotations

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

from ..errors import ConfigError
from .demo import StepRecord


def local_peers(n: int, host_base: str = "127.0.0.1", port: int = 29500) -> list[str]:
    """Rank r at host_base + r (127.0.0.1, 127.0.0.2, ...), all on the same port."""
    parts = host_base.split(".")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--host-base must be an IPv4 address like 127.0.0.1, got {host_base!r}")
    last = int(parts[3])
    if last + n - 1 > 254:
        raise ConfigError(f"{n} workers from {host_base} run past .254: pick a lower --host-base")
    return [".".join([*parts[:3], str(last + r)]) + f":{port}" for r in range(n)]


@dataclass
class LaunchResult:
    world: int
    records: dict[int, dict[int, StepRecord]] = field(default_factory=lambda: defaultdict(dict))
    exit_codes: dict[int, int] = field(default_factory=dict)
    stderr_tail: dict[int, list[str]] = field(default_factory=dict)

    def step_time(self, step: int) -> float:
        """Slowest worker's time for a step: when the step was done everywhere."""
        return max(r.duration_s for r in self.records[step].values())

    def all_exact(self) -> bool:
        return all(len(recs) == self.world and all(r.exact for r in recs.values())
                   for recs in self.records.values())

    @property
    def ok(self) -> bool:
        return self.all_exact() and all(code == 0 for code in self.exit_codes.values())


def worker_command(rank: int, peers_file: Path, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "fttree", "worker", "--rank", str(rank), "--peers", str(peers_file),
            "--json", *args]


#: what a step line shows: data that went around a link, lost or by plan (link memory)
_SHOWN = frozenset({"data_came_around", "detour"})


def format_step(step: int, recs: dict[int, StepRecord], world: int) -> str:
    slowest = max(r.duration_s for r in recs.values())
    exact = sum(r.exact for r in recs.values())
    events = sorted({e["text"] for r in recs.values() for e in r.events if e["cause"] in _SHOWN})
    errors = sorted({f"rank {r.rank}: {r.error}" for r in recs.values() if r.error})
    line = f"step {step:3d}  {slowest * 1000:8.1f} ms  exact {exact}/{world}"
    if events:
        line += "  | " + "; ".join(events)
    if errors:
        line += "  | " + "; ".join(errors)
    return line


def launch(n: int, worker_args: Sequence[str], *, steps: int, host_base: str = "127.0.0.1", port: int = 29500,
           launch_dir: Path | None = None, deadline_s: float = 600.0,
           echo: Callable[[str], None] = print, prefix: Sequence[str] = ()) -> LaunchResult:
    """Start n workers, stream their step lines, and return everything they reported.

    `prefix` is put before each worker command (for example `ip netns exec NAME`)."""
    if n < 1:
        raise ConfigError(f"-n must be at least 1, got {n}")
    workdir = launch_dir or Path(tempfile.mkdtemp(prefix="fttree-launch-"))
    workdir.mkdir(parents=True, exist_ok=True)
    peers = local_peers(n, host_base, port)
    peers_file = workdir / "peers.txt"
    peers_file.write_text("\n".join(peers) + "\n")
    echo(f"launching {n} workers ({peers[0]} .. {peers[-1]}), peers in {peers_file}")
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    procs: dict[int, subprocess.Popen[str]] = {}
    result = LaunchResult(world=n)
    stderr_lines: dict[int, list[str]] = defaultdict(list)

    def pump(rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((rank, line))
        lines.put((rank, None))

    def pump_err(rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            stderr_lines[rank].append(line.rstrip())
            del stderr_lines[rank][:-20]

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        for rank in range(n):
            cmd = [*prefix, *worker_command(rank, peers_file, worker_args)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
            procs[rank] = proc
            threading.Thread(target=pump, args=(rank, proc), daemon=True).start()
            threading.Thread(target=pump_err, args=(rank, proc), daemon=True).start()
        open_streams, printed = set(procs), 0
        end = time.monotonic() + deadline_s
        while open_streams:
            try:
                rank, line = lines.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                echo(f"launch: gave up after {deadline_s:g} s; workers still running: {sorted(open_streams)}")
                break
            if line is None:
                open_streams.discard(rank)
                continue
            try:
                rec = StepRecord(**json.loads(line))
            except (ValueError, TypeError):
                echo(f"[rank {rank}] {line.rstrip()}")
                continue
            result.records[rec.step][rec.rank] = rec
            while printed in result.records and len(result.records[printed]) == n:
                echo(format_step(printed, result.records[printed], n))
                printed += 1
        for step in sorted(s for s in result.records if s >= printed):
            echo(format_step(step, result.records[step], n) + f"  (only {len(result.records[step])} workers)")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for rank, proc in procs.items():
            try:
                result.exit_codes[rank] = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                result.exit_codes[rank] = proc.wait()
    for rank, code in sorted(result.exit_codes.items()):
        if code != 0:
            result.stderr_tail[rank] = stderr_lines[rank]
            echo(f"worker {rank} exited with code {code}:")
            for line in stderr_lines[rank][-8:]:
                echo(f"  [rank {rank}] {line}")
    if result.records:
        times = [result.step_time(s) for s in sorted(result.records) if len(result.records[s]) == n]
        if times:
            echo(f"{len(times)} steps done on all {n} workers; median {statistics.median(times) * 1000:.1f} ms, "
                 f"max {max(times) * 1000:.1f} ms; all exact: {'yes' if result.all_exact() else 'NO'}")
    return result
