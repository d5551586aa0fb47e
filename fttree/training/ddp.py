"""fttree as a DistributedDataParallel communication hook.

    ddp = DistributedDataParallel(model)          # any process group, e.g. gloo, for setup
    ddp.register_comm_hook(ar, fttree.comm_hook)  # gradients now travel over fttree

DDP calls the hook once per gradient bucket, in bucket order, from the autograd thread. The
hook copies the bucket to a flat host array, submits it as one fttree step and returns a
torch Future at once; the fttree loop thread completes it with the averaged bucket. Nothing on
the loop thread blocks: the only work there is copying the averaged sum back into the bucket.

Failures: a torch Future completed through `set_exception` hands DDP's C++ reducer a Python
object it tries to cast to a Tensor ("Unable to cast ... to Tensor"), which hides the cause.
So the hook returns a `then()`-child instead, whose callback raises the fttree error; torch
turns that into a proper future error and backward raises a RuntimeError whose message is the
fttree error (rank, bucket, class name, step, reason, peers). The exception object itself is
kept in `HookState.errors` for callers that want it by type.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket

from ..api import FTTreeAllreduce, _as_flat_array
from ..errors import FTTreeError
from ..net.node import StepResult
from .buckets import copy_divided, digest

__all__ = ["CommHookError", "HookState", "comm_hook"]


class CommHookError(FTTreeError):
    """An fttree allreduce under DDP failed; the message names rank, bucket, step and cause."""


class HookState:
    """Optional state for `comm_hook`: the allreduce handle plus a record of failures.
    Passing the FTTreeAllreduce itself as the state works too."""

    def __init__(self, allreduce: FTTreeAllreduce, *, average: bool = True) -> None:
        self.allreduce = allreduce
        self.average = average
        self.errors: deque[BaseException] = deque(maxlen=16)
        self.buckets_done = 0
        self._lock = threading.Lock()

    def _record(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)


def _raise_if_error(fut: torch.futures.Future[Any]) -> Any:
    value = fut.value()
    if isinstance(value, BaseException):
        context = "; ".join(getattr(value, "__notes__", ()))
        raise CommHookError(f"{context}: {type(value).__name__}: {value}" if context else str(value)) from value
    return value


def pending_future() -> tuple[torch.futures.Future[Any], torch.futures.Future[Any]]:
    """(inner, outer): complete `inner` with a value or an exception object (never through
    set_exception); `outer` is what C++ callers may wait on, and fails properly."""
    inner: torch.futures.Future[Any] = torch.futures.Future()
    return inner, inner.then(_raise_if_error)


def comm_hook(state: FTTreeAllreduce | HookState | None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP gradient bucket over the workers that contributed to it, with fttree.
    `state` None: the handle of the default process group, which must be the "fttree"
    backend's (DDP on that backend divides by the world size without this hook, a too small
    average once a rank has died)."""
    hs = state if isinstance(state, HookState) else None
    ar = hs.allreduce if hs is not None else state
    if ar is None:
        from .backend import allreduce_of  # the backend imports this module

        ar = allreduce_of()
    if not isinstance(ar, FTTreeAllreduce):
        raise TypeError(f"fttree.comm_hook needs an FTTreeAllreduce, a HookState or None as state, not "
                        f"{type(state).__name__}")
    average = hs.average if hs is not None else True
    buffer = bucket.buffer()
    inner, outer = pending_future()
    where = f"fttree rank {ar.rank}, DDP gradient bucket {bucket.index()} ({buffer.numel()} x {buffer.dtype})"

    def fail(exc: BaseException) -> None:
        exc.add_note(where)
        if hs is not None:
            hs._record(exc)
        inner.set_result(exc)

    try:
        flat, sig, _ = _as_flat_array(buffer, ar.staging)
        layout = digest(tuple(p.shape) for p in bucket.parameters())
        # closable: a late rank's gradients may be left out (straggler_policy="deadline"); the
        # average divides by the contributors
        submitted = ar.submit_array(flat, f"ddp bucket {bucket.index()} {sig} #{layout}", closable=True)
    except Exception as exc:  # not started, closed, unsupported dtype: report through the future
        fail(exc)
        return outer

    def done(f: Future[StepResult]) -> None:  # runs on the fttree loop thread
        try:
            res = f.result()
            # The average goes into DDP's own bucket buffer (as DDP's default allreduce does).
            # res.data is our staging copy, into which the node copied the sum out of the
            # protocol's buffers; it is only read here, and the staging pool reuses it after.
            with torch.no_grad():
                copy_divided(buffer, torch.from_numpy(res.data), len(res.contributors) if average else 1)
        except BaseException as exc:
            fail(exc)
            return
        if hs is not None:
            hs.buckets_done += 1
        inner.set_result(buffer)

    submitted.add_done_callback(done)
    return outer


# DDP compares the hook's annotations with the real classes; under `from __future__ import
# annotations` they would be strings and register_comm_hook would refuse the hook.
comm_hook.__annotations__.update(bucket=GradBucket, state=FTTreeAllreduce | HookState | None,
                                 **{"return": torch.futures.Future[torch.Tensor]})
