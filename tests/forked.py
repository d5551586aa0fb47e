"""A fork server for tests' worker processes: it imports the heavy modules once (torch: about
1.5 s of CPU per process), then forks one child per worker, each running its script as
__main__ as `python SCRIPT ARGS` would. Only for workers that do not depend on a fresh
interpreter: the children share the server's imported modules, and nothing but imports runs
before the fork (no thread, no event loop, no CUDA).

Run by tests/procs.py's run_all(preload=...): a JSON object on stdin with "preload" (module
names), "commands" ([script, arg, ...] each) and "logs" (a file per command for its stdout and
stderr together). The server waits for every child and exits; its caller kills the whole
process group at its deadline."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback


def run_child(command: list[str], log: str) -> None:
    """In the forked child: output to `log`, argv and sys.path as `python SCRIPT ...`; never returns."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    code = 1
    try:
        sys.argv = list(command)
        sys.path[0] = os.path.dirname(os.path.abspath(command[0]))
        runpy.run_path(command[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    spec = json.load(sys.stdin)
    for module in spec["preload"]:
        importlib.import_module(module)
    children = []
    for command, log in zip(spec["commands"], spec["logs"], strict=True):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(command, log)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
