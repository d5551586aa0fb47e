"""Worker processes in tests: their output read as it comes, waited for with deadlines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path


class Output:
    """Every line a worker process writes (stdout and stderr together), read as it comes so
    that the pipe never fills; `wait_for` waits for a line with a deadline, not a sleep."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines = proc, list[str]()
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # end of output
            self.changed.notify_all()

    def wait_for(self, needle: str, count: int = 1, limit_s: float = 120) -> None:
        """Until `count` lines hold `needle`."""
        deadline = time.monotonic() + limit_s
        seen = found = 0
        with self.changed:
            while True:
                for line in self.lines[seen:]:
                    found += needle in line
                    if found >= count:
                        return
                    if line == "":
                        raise AssertionError(f"the worker ended without {needle!r}: {''.join(self.lines[-10:])}")
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {needle!r} from the worker within {limit_s} s ({found} of {count}); "
                                         f"its last lines: {''.join(self.lines[-10:])}")
                self.changed.wait(left)

    def text_now(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def text(self) -> str:
        self.reader.join(60)
        return "".join(self.lines)


def run_all(commands: list[list[str]], env: dict[str, str], deadline_s: float,
            preload: Sequence[str] = ()) -> list[str]:
    """Start one process per command, wait for all of them until `deadline_s` from now, and
    return each one's output (stdout and stderr together); any still running then is killed.

    With `preload` (module names), every command is `[sys.executable, SCRIPT, *args]` and the
    processes are forked from one server that imported those modules once (tests/forked.py):
    for workers that each import torch and need no fresh interpreter."""
    if preload:
        return _run_forked(commands, env, deadline_s, preload)
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    end = time.monotonic() + deadline_s
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=max(1.0, end - time.monotonic()))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return logs


def _run_forked(commands: list[list[str]], env: dict[str, str], deadline_s: float,
                preload: Sequence[str]) -> list[str]:
    for cmd in commands:
        if cmd[0] != sys.executable or len(cmd) < 2:
            raise ValueError(f"run_all(preload=...) runs `python SCRIPT ARGS` commands, not {cmd}")
    with tempfile.TemporaryDirectory(prefix="fttree-forked-") as tmp:
        logs = [str(Path(tmp) / f"worker{i}.log") for i in range(len(commands))]
        spec = json.dumps({"preload": list(preload), "commands": [cmd[1:] for cmd in commands], "logs": logs})
        server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forked.py"))], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)  # its own group: the deadline ends every child
        try:
            out = server.communicate(spec, timeout=deadline_s)[0]
        except subprocess.TimeoutExpired:
            out = ""
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)  # children still running at the deadline, or orphaned
            server.wait()
        texts = [Path(log).read_text(errors="replace") if Path(log).exists() else "" for log in logs]
    if out or server.returncode not in (0, -signal.SIGKILL):
        texts = [f"{text}\n--- the fork server (exit {server.returncode}):\n{out}" for text in texts]
    return texts
