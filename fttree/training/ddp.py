"""fttree as a DistributedDataParallel communication hook.

    ddp = DistributedDataParallel(model)          # any process group, e.g. gloo, for setup
    ddp.register_comm_hook(ar, fttree.comm_hook)  # gradients now travel over fttree

DDP calls the hook once per gradient bucket, in bucket order, from the autograd thread. The
hook submits the bucket as one fttree step and returns a torch Future at once; the fttree loop
thread completes it with the averaged bucket. A CPU bucket travels as it is: DDP leaves it alone
until the future completes, the step writes the sum into it and the average is a division in
place. Any other bucket (on a GPU, bfloat16) is copied to a host array first and the average
copied back. Nothing on the loop thread blocks.

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

import numpy as np
import torch
from torch._C._distributed_c10d import GradBucket

from ..api import FTTreeAllreduce, _as_flat_array
from ..errors import FTTreeError
from ..net.node import StepResult
from .buckets import copy_divided, digest

__all__ = ["CommHookError", "HookState", "comm_hook"]

_IN_PLACE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64)


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


def _bucket_itself(buffer: torch.Tensor) -> np.ndarray | None:
    """The bucket as the flat array a step can run on in place, if it is one: on the CPU,
    contiguous, of a dtype fttree carries. A copy would cost a pass over the bucket, and the
    average another (a 100 MB model: two 100 MB memcpys per step)."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous() or buffer.dtype not in _IN_PLACE_DTYPES:
        return None
    return buffer.detach().view(-1).numpy()


def comm_hook(state: FTTreeAllreduce | HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP gradient bucket over all workers with fttree."""
    hs = state if isinstance(state, HookState) else None
    ar = hs.allreduce if hs is not None else state
    if not isinstance(ar, FTTreeAllreduce):
        raise TypeError(f"fttree.comm_hook needs an FTTreeAllreduce or HookState as state, not {type(state).__name__}")
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
        flat = _bucket_itself(buffer)
        in_place = flat is not None
        if flat is None:
            flat, sig, _ = _as_flat_array(buffer, ar.staging)
        else:
            sig = f"{str(buffer.dtype).removeprefix('torch.')}{list(buffer.shape)}"
        layout = digest(tuple(p.shape) for p in bucket.parameters())
        submitted = ar.submit_array(flat, f"ddp bucket {bucket.index()} {sig} #{layout}")
    except Exception as exc:  # not started, closed, unsupported dtype: report through the future
        fail(exc)
        return outer

    def done(f: Future[StepResult]) -> None:  # runs on the fttree loop thread
        try:
            res = f.result()
            # The average goes into DDP's own bucket buffer (as DDP's default allreduce does).
            # res.data is the bucket itself or our staging copy, never a buffer the protocol
            # still sends from (the node copies results out of those), so writing it is safe.
            divisor = len(res.contributors) if average else 1
            with torch.no_grad():
                if not in_place:
                    copy_divided(buffer, torch.from_numpy(res.data), divisor)
                elif divisor > 1:  # res.data is the bucket: the sum is in it already
                    buffer.div_(divisor)
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
comm_hook.__annotations__.update(bucket=GradBucket, state=FTTreeAllreduce | HookState,
                                 **{"return": torch.futures.Future[torch.Tensor]})
