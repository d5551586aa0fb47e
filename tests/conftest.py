"""Shared test helpers: free ports and a local cluster of in-process workers; and how the suite
runs in parallel (pytest-xdist), with the tests that change the kernel's network kept apart."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fttree import FTTreeAllreduce
from fttree.net import address
from fttree.status.cli import HTTP_PORT_OFFSET

# ---- parallel by default ----------------------------------------------------------------------

# Most tests wait on real processes, sockets and deadlines rather than on the CPU, so the suite
# runs on this many xdist workers unless the command line says otherwise (`-n 0` runs in this
# process; `-p no:xdist` leaves xdist out altogether).
WORKERS = 3

# Tests that create network namespaces, iptables rules or tc qdiscs run one at a time, on one
# worker, so that no two of them contend for the kernel's xtables lock or measure each other's
# shaped links: whole modules by file name, and single tests by file::name. The scheduler sees
# only node ids (it collects nothing), hence lists rather than markers; a test marked `realnet`
# that they miss stops the collection (see pytest_collection_modifyitems).
NETNS_MODULES = frozenset({
    "test_realnet.py", "test_nat_netns.py", "test_nat_restart.py", "test_uplink.py", "test_bench_uplink.py",
    "test_punch_netns.py", "test_downlink.py", "test_nat_uplink_netns.py",
})
NETNS_TESTS = frozenset({
    "test_chaos.py::test_a_short_seeded_chaos_run",  # as root it cuts links in a namespace of its own
    "test_chaos_side.py::test_a_short_side_by_side_run",  # as root, two namespaces: a job in each
    "test_double_tree.py::test_launch_real_cut_of_a_tree_1_link_with_the_double_tree",
    "test_node_failures_real.py::test_partition_majority_goes_on_minority_stops",
    "test_slow_links_real.py::test_launch_at_defaults_behind_real_slow_uplinks",
    "test_torchrun.py::test_ddp_on_the_fttree_backend_across_two_hosts_with_a_link_cut_mid_run",
    "test_torchrun.py::test_from_env_across_two_hosts_survives_a_killed_worker_under_the_guard",
})
NETNS_UNIT = "kernel network (namespaces, iptables, tc)"


def kernel_network_test(nodeid: str) -> bool:
    """Whether the test with this node id changes the kernel's network."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1]
    return module in NETNS_MODULES or f"{module}::{name.split('[')[0]}" in NETNS_TESTS


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`python -m pytest` alone runs on WORKERS workers; not when -n was given, nor under --pdb,
    nor in a worker (which parses the command line afresh and would start workers of its own)."""
    if (config.pluginmanager.has_plugin("xdist") and not hasattr(config, "workerinput")
            and config.option.numprocesses is None and not config.getoption("usepdb", False)):
        config.option.numprocesses = WORKERS


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own choice
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under --dist load (what -n gives) or loadgroup: tests one by one to whichever worker is
    free, except the kernel-network tests, which go to one worker as one unit, first (the
    scheduler hands out the largest unit first). Not xdist_group: with pytest 9.2, xdist 3.8's
    worker renames grouped tests through an attribute pytest no longer reads, so no group formed."""
    from xdist.scheduler import LoadGroupScheduling

    class KernelNetworkApart(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return NETNS_UNIT if kernel_network_test(nodeid) else super()._split_scope(nodeid)

    if config.getvalue("dist") in ("load", "loadgroup"):
        return KernelNetworkApart(config, log)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked `realnet` that the lists above miss would run beside the others: refuse."""
    missed = [item.nodeid for item in items
              if item.get_closest_marker("realnet") is not None and not kernel_network_test(item.nodeid)]
    if missed:
        raise pytest.UsageError("tests marked realnet are missing from NETNS_MODULES or NETNS_TESTS in "
                                f"tests/conftest.py (they would run beside the other namespace tests): {missed}")


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


@pytest.fixture
def key(tmp_path: Path) -> Path:
    """A job key file (32 random bytes, mode 600) for launches that prove one (`--auth-key-file`)."""
    path = tmp_path / "job.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path
