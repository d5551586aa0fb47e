"""Running one RunSpec: start its worker processes (inside the uplinks' namespace if any), carry
out its node faults on them, gather their records into a RunResult, release them together and
clean up; and a description of the machine the runs ran on."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.faults import FaultKind
from ..errors import ConfigError
from ..net.address import free_port, local_peers
from . import SOURCE_ROOT
from .bench_spec import SLOW_BF16, RunResult, RunSpec
from .bench_uplinks import Uplinks
from .nodefaults import NodeFaultDriver


def worker_commands(spec: RunSpec, workdir: Path, bind: bool = False) -> list[list[str]]:
    """One command per rank. `bind`: gloo's ranks send from their own 127.0.0.(r+1), as fttree's
    always do (uplink limits match the source address)."""
    py = [sys.executable, "-m"]
    if spec.kind == "gloo":
        port = free_port()
        return [[*py, "fttree.tools.gloo_baseline", "--rank", str(r), "--world", str(spec.world), "--port", str(port),
                 "--steps", str(spec.steps), "--size", str(spec.size)]
                + (["--bind", f"127.0.0.{r + 1}"] if bind else []) for r in range(spec.world)]
    hosts = [f"127.0.0.{r + 1}" for r in range(spec.world)]
    peers = local_peers(spec.world, "127.0.0.1", free_port(hosts))
    peers_file = workdir / f"peers-{spec.world}.txt"
    peers_file.write_text("\n".join(peers) + "\n")
    args = ["--steps", str(spec.steps), "--size", str(spec.size), "--timeout", str(spec.timeout_s),
            "--step-timeout", str(spec.step_timeout_s)]
    if spec.faults:
        args += ["--faults", spec.faults]
    if spec.kind == "plain":
        args.append("--no-ft")
    if spec.kind == "fttree":  # always explicit: the API's default policy may change
        args += ["--timeout-policy", spec.policy]
    if spec.chunk_bytes:
        args += ["--chunk-bytes", str(spec.chunk_bytes)]
    if spec.kind == "fttree" and not spec.link_memory:
        args.append("--no-link-memory")
    if spec.kind == "fttree" and spec.compression and spec.compression != SLOW_BF16:  # that one is a --set
        args += ["--compression", spec.compression]
    if spec.kind == "fttree":  # always explicit: the API's default may change
        args += ["--trees", spec.trees]
    elif spec.kind == "plain":  # the thesis's baseline: one plain tree
        args += ["--trees", "single"]
    for field_name, value in spec.settings:
        args += ["--set", f"{field_name}={value}"]
    if spec.footprint_every:
        args += ["--footprint-every", str(spec.footprint_every)]
    return [[*py, "fttree.tools.bench_worker", "--rank", str(r), "--peers", str(peers_file), *args]
            for r in range(spec.world)]


def execute(spec: RunSpec, workdir: Path, on_step: Callable[[int], None] = lambda step: None,
            uplinks: Uplinks | None = None) -> RunResult:
    """Start the run's workers, gather their records, release them together, and clean up.

    Workers block after their last step until their stdin closes, so none tears down a link
    while a slower peer still needs it. A worker that dies early ends the run at once, unless
    it is the victim of the run's node faults (the bench kills or stops it by pid, and always
    continues a stopped one before the end). With
    `uplinks` the workers run in its namespace under fresh per-rank limits, and each rank's
    uplink counter is read once every rank is done (before the release)."""
    result = RunResult(spec=spec)
    cmds = worker_commands(spec, workdir, bind=uplinks is not None)
    if uplinks is not None:
        uplinks.apply(spec.world)  # zeroes the counters
        cmds = [uplinks.wrap(cmd) for cmd in cmds]
    struck = spec.struck()
    driver = NodeFaultDriver(struck, world=spec.world, gate_dir=Path(tempfile.mkdtemp(prefix="gates-", dir=workdir)),
                             echo=lambda line: None)
    killed = {f.rank for f in struck if f.kind is FaultKind.CRASH}
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    procs: dict[int, subprocess.Popen[str]] = {}
    stderr: dict[int, list[str]] = defaultdict(list)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    pumps: list[threading.Thread] = []

    def pump(rank: int, stream: Any, into: queue.Queue[tuple[int, str | None]] | None) -> None:
        for line in stream:
            if into is not None:
                into.put((rank, line))
            else:
                stderr[rank].append(line.rstrip())
                del stderr[rank][:-30]
        if into is not None:
            into.put((rank, None))

    t0 = time.monotonic()
    end = t0 + spec.deadline_s()
    ready: set[int] = set()
    done: set[int] = set()
    finishers = set(range(spec.world)) - killed  # every rank but the killed ones reports "done"
    interrupted = True  # until the loop ends by itself: Ctrl-C must not wait out every worker's step
    try:
        for rank, cmd in enumerate(cmds):
            proc = subprocess.Popen([*cmd, *driver.worker_args(rank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
            procs[rank] = proc
            for stream, into in ((proc.stdout, lines), (proc.stderr, None)):
                pumps.append(threading.Thread(target=pump, args=(rank, stream, into), daemon=True))
                pumps[-1].start()
        driver.start(procs)
        while not finishers <= done:
            try:
                rank, line = lines.get(timeout=max(0.05, end - time.monotonic()))
            except queue.Empty:
                steps = result.complete_steps()
                result.error = (f"gave up after {spec.deadline_s():.0f} s with {len(steps)} of {spec.steps} steps "
                                f"done on every rank; ranks not finished: {sorted(finishers - done)}")
                break
            if line is None:
                if rank not in done and rank not in killed:
                    result.error = f"rank {rank} exited before its last step"
                    break
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                stderr[rank].append(f"(stdout) {line.rstrip()}")
                continue
            kind = rec.get("kind")
            if kind == "ready":
                ready.add(rank)
                if len(ready) == spec.world:
                    result.startup_s = time.monotonic() - t0
            elif kind == "step":
                step = int(rec["step"])
                result.records[step][rank] = rec
                driver.note_step(rank, step)
                if rank in result.counted_ranks(step) and result.counted_ranks(step) <= set(result.records[step]):
                    on_step(step)
            elif kind == "membership":
                result.membership[rank] = rec
            elif kind == "footprint":
                result.footprints[rank].append((int(rec["step"]), {k: int(v) for k, v in rec["sizes"].items()}))
            elif kind == "done":
                done.add(rank)
                if uplinks is not None and len(done) == spec.world:
                    try:
                        result.sent_bytes = uplinks.counters()
                    except ConfigError as exc:
                        result.error = f"could not read the uplink counters: {exc}"
        interrupted = False
    finally:
        driver.close()  # a stopped worker is continued before anything else: it could not even die
        result.wall_s = time.monotonic() - t0
        for proc in procs.values():
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        if result.error or interrupted:
            for proc in procs.values():
                _kill_group(proc, 15)
        # a closing worker may wait up to its step timeout for a peer's word that it is done
        # (FTTreeAllreduce.close), then up to 10 s for late peers: let it, rather than kill it
        closing_s = spec.step_timeout_s + 15
        for rank, proc in procs.items():
            try:
                result.exit_codes[rank] = proc.wait(timeout=closing_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc, 9)
                result.exit_codes[rank] = proc.wait(timeout=10)
        for thread in pumps:
            thread.join(timeout=2)  # the streams end with the processes
    result.signalled = {rank: fired.at for rank, fired in driver.fired.items()}
    if driver.error is not None and not result.error:
        result.error = f"node fault injection failed: {driver.error}"
    victims = {f.rank for f in struck}
    for rank in procs:
        result.stderr_tail[rank] = stderr[rank][-12:]
        if result.exit_codes.get(rank) not in (0, None) and not result.error and rank not in victims:
            result.error = f"rank {rank} exited with code {result.exit_codes[rank]}"
    return result


def _kill_group(proc: subprocess.Popen[str], sig: int) -> None:
    """Signal the process group of one worker we started (each has its own session)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": model or platform.processor(), "cores": os.cpu_count(),
                            "python": platform.python_version(), "platform": platform.platform()}
    with contextlib.suppress(OSError):
        info["load_avg"] = os.getloadavg()
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:
        pass
    try:
        root = SOURCE_ROOT
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        info["git"] = rev + ("+dirty" if dirty else "") if rev else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return info
