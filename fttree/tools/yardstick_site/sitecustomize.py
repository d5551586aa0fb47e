"""Loaded by every worker that `fttree yardstick` starts (through PYTHONPATH), in this checkout's
runs and in the reference commit's alike: counts the process's CPU time from its first
`FTTreeAllreduce.submit_array` after FTTREE_YARDSTICK_WARMUP others (default 0) to its last, so
start-up (imports, connecting, a control server's import on a thread of its own) is left out, and
writes it at exit to FTTREE_YARDSTICK_DIR/cpu-PID as "seconds calls loop_seconds". The last is
the CPU time of the allreduce's event-loop thread over the same span: the transport and the
protocol alone, without the caller's work (the demo's data and checks are half a rank's CPU,
the same in both checkouts, and dilute a ratio of whole processes)."""

from __future__ import annotations

import atexit
import os
import sys
import time
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_OUT = os.environ.get("FTTREE_YARDSTICK_DIR", "")
_WARMUP = int(os.environ.get("FTTREE_YARDSTICK_WARMUP", "0") or 0)  # submits before the window opens
_marks: list[float] = []  # process CPU time at the first and the latest submit
_loop_marks: list[float] = []  # the event-loop thread's CPU time at the same moments
_calls = [0]


def _wrap(module: ModuleType) -> None:
    cls: Any = getattr(module, "FTTreeAllreduce", None)
    if cls is None or getattr(cls, "_yardstick", False):
        return
    inner = cls.submit_array

    def submit_array(self: Any, *args: Any, **kwargs: Any) -> Any:
        _calls[0] += 1
        if _calls[0] <= _WARMUP:
            return inner(self, *args, **kwargs)
        now, loop = time.process_time(), _thread_cpu(getattr(self, "_thread", None))
        if len(_marks) < 2:
            _marks.append(now)  # the first submit, then the latest
            _loop_marks.append(loop)
        else:
            _marks[1], _loop_marks[1] = now, loop
        return inner(self, *args, **kwargs)

    cls.submit_array = submit_array
    cls._yardstick = True


def _thread_cpu(thread: Any) -> float:
    """CPU seconds `thread` has used (0.0 where the platform cannot say)."""
    ident = getattr(thread, "ident", None)
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident)) if ident is not None else 0.0
    except (AttributeError, OSError):
        return 0.0


class _Finder(MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if name != "fttree.api":
            return None
        sys.meta_path.remove(self)
        try:
            from importlib.util import find_spec

            spec = find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        class _Wrapping(Loader):
            def create_module(self, spec: ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                _wrap(module)

        spec.loader = _Wrapping()
        return spec


def _write() -> None:
    if _OUT and len(_marks) == 2:
        with open(os.path.join(_OUT, f"cpu-{os.getpid()}"), "w") as f:
            f.write(f"{_marks[1] - _marks[0]} {_calls[0] - _WARMUP - 1} {_loop_marks[1] - _loop_marks[0]}\n")


if _OUT:
    sys.meta_path.insert(0, _Finder())
    atexit.register(_write)
