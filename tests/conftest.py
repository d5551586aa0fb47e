"""Shared test helpers: free ports and a local cluster of in-process workers."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from fttree import FTTreeAllreduce
from fttree.net import address
from fttree.status.cli import HTTP_PORT_OFFSET


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 to 127.0.0.16: workers bind 127.0.0.(r+1) with
    the same port, and one free on 127.0.0.1 alone could be held on 127.0.0.3 by an earlier
    test's rank 2 (a connection it bound there, still closing), failing this test's rank 2.
    Its control-server twin (port + 1000, where `fttree worker` serves HTTP) is free too: a
    CI run once failed on "cannot serve HTTP on 127.0.0.1:38577: address already in use"."""
    return address.free_port(address.local_hosts(16), also=(HTTP_PORT_OFFSET,))


def local_peers(n: int, port: int | None = None) -> list[str]:
    port = port or free_port()
    return [f"127.0.0.{r + 1}:{port}" for r in range(n)]


def start_all(handles: list[FTTreeAllreduce], limit_s: float | None = None) -> list[BaseException]:
    """Start every handle at once (each waits for its neighbours); what each start raised."""
    errors: list[BaseException] = []

    def start(h: FTTreeAllreduce) -> None:
        try:
            h.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
    return errors


@contextlib.contextmanager
def cluster(n: int, *, listed: Callable[[int, str], str] | None = None,
            **kwargs: object) -> Iterator[list[FTTreeAllreduce]]:
    """n started FTTreeAllreduce handles in this process, closed on exit. Static timeouts
    unless asked otherwise: tests that assert which steps recover need them predictable.
    `listed(rank, address)` gives the peers-list entry of each rank ("-" for one nobody dials)."""
    kwargs.setdefault("timeout_policy", "static")
    peers = local_peers(n)
    if listed is not None:
        peers = [listed(r, p) for r, p in enumerate(peers)]
    handles = [FTTreeAllreduce(r, peers, **kwargs) for r in range(n)]  # type: ignore[arg-type]
    errors = start_all(handles)
    try:
        if errors:
            raise errors[0]
        yield handles
    finally:  # together: a rank's close may wait for its peers' (a cut link between them)
        closers = [threading.Thread(target=h.close) for h in handles]
        for t in closers:
            t.start()
        for t in closers:
            t.join()


@pytest.fixture
def port() -> int:
    return free_port()


def run_threads(targets: list[Callable[[], None]], limit_s: float = 120) -> None:
    """Run each target on a thread of its own; all must end within `limit_s` each."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
        assert not t.is_alive(), "a worker did not finish within its deadline"


def exact_steps(handles: list[FTTreeAllreduce], steps: int, size: int = 1000) -> None:
    """`steps` allreduce steps on every handle at once: each result the exact sum of every rank's
    contribution, with every rank among its contributors."""
    for step in range(steps):
        data = [np.full(size, float(step + r), np.float32) for r in range(len(handles))]
        futures = [h.allreduce_async(d) for h, d in zip(handles, data, strict=True)]
        for h, fut in zip(handles, futures, strict=True):
            assert np.array_equal(fut.result(timeout=30), sum(data)), f"rank {h.rank} step {step}"
            assert h.last is not None
            assert h.last.contributors == tuple(range(len(handles))), (h.rank, step, h.last.contributors)
