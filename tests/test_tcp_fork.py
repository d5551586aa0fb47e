"""A process forked from a worker (a DataLoader worker) must not keep the worker's sockets:
otherwise a killed worker's address stays taken, and its connections stay up, for as long as
the children live."""

from __future__ import annotations

import multiprocessing
import os
import socket
import stat
from multiprocessing.connection import Connection

from tests.conftest import cluster


def socket_fds() -> list[int]:
    """This process's open file descriptors that are sockets."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                found.append(int(name))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return found


def child(report: Connection, release: Connection) -> None:
    """Say which sockets this forked process holds, then wait until told to exit."""
    report.send(socket_fds())
    release.poll(60)


def test_a_forked_child_releases_the_workers_sockets() -> None:
    ctx = multiprocessing.get_context("fork")
    report_r, report_w = ctx.Pipe(duplex=False)
    release_r, release_w = ctx.Pipe(duplex=False)
    with cluster(2) as (a, _b):  # started: each has connected to the other
        assert len(socket_fds()) >= 6  # each: listening, accepted from the other, opened to it
        address = a.peers[a.rank]
        proc = ctx.Process(target=child, args=(report_w, release_r), daemon=True)
        proc.start()
    try:
        assert report_r.poll(30), "the forked child did not report"
        assert report_r.recv() == []
        # The worker is gone, its child lives on: the address can be bound again at once.
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind((address.host, address.port))
            again.listen()
    finally:
        release_w.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
