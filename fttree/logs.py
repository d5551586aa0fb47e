"""Logging setup: every record carries the rank and step it concerns, as text or as JSON lines.

Modules keep their own `logging.getLogger("fttree.<module>")`. A filter on our handler adds
`record.rank` and `record.step`: each node's loop thread is bound to its rank and a function
that reads its current step (several nodes may share a process in tests), and the worker binds
the process-wide default used by other threads (by default: the process's only node, as in a
worker).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

StepGetter = Callable[[], "int | None"]

_HANDLER_NAME = "fttree"


@dataclass(frozen=True, slots=True)
class _Context:
    rank: int | None
    step: StepGetter | None


_threads: dict[int, _Context] = {}
_NO_CONTEXT = _Context(None, None)


def bind_thread(rank: int, step: StepGetter | None = None) -> None:
    """Records logged on the calling thread (a node's loop thread) name this rank and step."""
    _threads[threading.get_ident()] = _Context(rank, step)


def unbind_thread() -> None:
    _threads.pop(threading.get_ident(), None)


def _fallback() -> _Context:
    """Threads with no node of their own: the process's only node, if it has one."""
    bound = list(_threads.values())
    return bound[0] if len(bound) == 1 else _NO_CONTEXT


class ContextFilter(logging.Filter):
    """Adds `rank` and `step` to every record ('-' when unknown); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _threads.get(record.thread or 0) or _fallback()
        if not hasattr(record, "rank"):
            record.rank = "-" if ctx.rank is None else ctx.rank
        if not hasattr(record, "step"):
            step = None
            if ctx.step is not None:
                try:
                    step = ctx.step()
                except Exception:  # a step getter read from another thread mid-update: leave it out
                    step = None
            record.step = "-" if step is None else step
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, rank, step, msg (and exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        rank, step = getattr(record, "rank", "-"), getattr(record, "step", "-")
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "rank": None if rank == "-" else rank,
            "step": None if step == "-" else step,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [rank %(rank)s step %(step)s] %(message)s"


def setup(level: int | None = logging.WARNING, *, json_lines: bool = False, stream: TextIO | None = None) -> None:
    """(Re)install fttree's handler on the root logger; `level=None` keeps the current level.

    Calling it again swaps the format (the worker turns on --log-json after the group set -v)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(ContextFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    if level is not None:
        root.setLevel(level)
