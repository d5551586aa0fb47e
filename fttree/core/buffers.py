"""BufferPool: large scratch buffers used again once nobody holds them, instead of fresh ones.

A fresh multi-megabyte numpy array is not free: numpy asks the kernel to back it with huge
pages, and the kernel zeroes every page on its first touch. On a 7-worker loopback allreduce of
100 MB that zeroing (`clear_page_erms` in `perf`) was 40% of all CPU time: a receive buffer per
chunk, a sum buffer per chunk, a private copy of every submitted tensor. A pooled buffer was
zeroed once, when it was first made.

Nothing is ever reused while read. Every view of a buffer (memoryviews of memoryviews, numpy
arrays on it, a torch tensor from `torch.from_numpy`, a write still queued in the event loop)
references the numpy array that owns the memory, so a buffer that only this pool references is
free, whatever its holders did with it. Only the newest `keep` buffers are tracked; older ones
are left to the allocator once their holders let go, so the pool holds at most `keep` buffers
that nobody else does.
"""

from __future__ import annotations

import contextlib
import sys
from collections import deque
from contextlib import AbstractContextManager
from typing import Any

import numpy as np


def _first_free(lent: deque[np.ndarray], nbytes: int, only_the_pool: int) -> int:
    """The index of the oldest buffer of `nbytes` with at most `only_the_pool` references, or -1.
    One pass over the deque (indexing one is a walk of its blocks); the references are counted
    in this same loop for the baseline and the checks, as how many a bare call shows differs
    between Python versions."""
    for i, buf in enumerate(lent):
        if buf.size == nbytes and sys.getrefcount(buf) <= only_the_pool:
            return i
    return -1


def _references_in_scan() -> int:
    """What a buffer that only the pool references shows in `_first_free`'s loop."""
    lent = deque([np.empty(1, dtype=np.uint8)])
    for bound in range(1, 64):
        if _first_free(lent, 1, bound) == 0:
            return bound
    raise RuntimeError("cannot calibrate the buffer pool's reference count")


# what a buffer that only the pool references shows: anything more is a holder
_ONLY_THE_POOL = _references_in_scan()


class BufferPool:
    """Buffers of `MIN_BYTES` or more, handed out again once only the pool references them.
    Pass a `lock` (a threading.Lock) when takes come from several threads, as the API's
    staging pool's do; the transport and the protocol take on their event loop only."""

    MIN_BYTES = 64 * 1024  # smaller buffers are cheap to allocate

    def __init__(self, keep: int = 24, lock: AbstractContextManager[Any] | None = None,
                 keep_bytes: int | None = None) -> None:
        self.keep = keep
        self.keep_bytes = keep_bytes  # and at most this many bytes of them (None: any)
        self.lent: deque[np.ndarray] = deque()
        self.tracked_bytes = 0
        self.reused = 0  # buffers handed out again
        self.allocated = 0  # fresh ones handed out, small (untracked) ones included
        self._lock: AbstractContextManager[Any] = lock if lock is not None else contextlib.nullcontext()

    def _owner(self, nbytes: int) -> np.ndarray:
        """A uint8 array of `nbytes` that nobody else holds: a free tracked one, or a new one."""
        with self._lock:
            lent = self.lent
            i = _first_free(lent, nbytes, _ONLY_THE_POOL)
            if i >= 0:
                buf = lent[i]
                del lent[i]
                lent.append(buf)
                self.reused += 1
                return buf
            self.allocated += 1
            fresh = np.empty(nbytes, dtype=np.uint8)
            lent.append(fresh)
            self.tracked_bytes += nbytes
            # the oldest go: once their holders let go, their memory goes back to the system
            while len(lent) > self.keep or (self.keep_bytes is not None and self.tracked_bytes > self.keep_bytes
                                            and len(lent) > 1):
                self.tracked_bytes -= lent.popleft().size
            return fresh

    def take(self, nbytes: int) -> bytearray | memoryview:
        """A writable byte buffer of `nbytes` (contents undefined), e.g. to receive a payload into."""
        if nbytes < self.MIN_BYTES:
            with self._lock:
                self.allocated += 1
            return bytearray(nbytes)
        return self._owner(nbytes).data

    def array(self, count: int, dtype: np.dtype | str) -> np.ndarray:
        """A writable 1-D array of `count` elements of `dtype` (contents undefined)."""
        kind = np.dtype(dtype)
        nbytes = count * kind.itemsize
        if nbytes < self.MIN_BYTES:
            with self._lock:
                self.allocated += 1
            return np.empty(count, dtype=kind)
        return self._owner(nbytes).view(kind)
