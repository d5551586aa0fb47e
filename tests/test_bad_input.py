"""Bad input gets a clear error naming the problem, and the node keeps serving."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from fttree import ConfigError, FTTreeAllreduce, PeerError, StepAborted, TensorMismatch
from fttree.core.messages import PREFIX, VERSION, Kind
from fttree.errors import GroupLeft
from fttree.net.address import parse_peers
from fttree.net.handshake import BULK

from .conftest import cluster, free_port, local_peers
from .rawpeer import closed_by_peer, connect, handshake, hello_frame


def _send_and_wait_closed(host: str, port: int, data: bytes, *, source: str = "127.0.0.100") -> None:
    """Send raw bytes, then block until the node closes the connection (its verdict is in)."""
    with socket.create_connection((host, port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(data)
        sock.settimeout(10)
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass


def _hello(rank: int, world: int, dst: int = 0, key: bytes = b"") -> bytes:
    return hello_frame(rank, dst, world, key=key)[1]


def _raw(header: dict[str, object], payload_len: int = 0) -> bytes:
    head = msgpack.packb(header)
    return PREFIX.pack(b"FT", VERSION, len(head), payload_len) + head


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: b"GET / HTTP/1.1\r\n\r\n", "bad frame magic"),
    (lambda: PREFIX.pack(b"FT", VERSION, 5, 1 << 40), "exceeds the limit"),
    (lambda: PREFIX.pack(b"FT", VERSION, 5, 1 << 20), "before the handshake finished"),  # a payload, unproven
    (lambda: _hello(1, 3)[:-1] + b"\xc1", "not valid msgpack"),
    (lambda: _raw({"k": int(Kind.DATA_REDUCE), "f": 1}), "before the handshake finished"),
    (lambda: _hello(1, 3, dst=2), "dialled rank 2, but this is rank 0"),
    (lambda: _hello(1, 3, key=b"another job's key 0123"), "a worker of job"),
    # a peer of a job of another size: its world may be a grown group's, but the address is wrong
    (lambda: _hello(1, 9), "claims rank 1, whose address is 127.0.0.2"),
    (lambda: _hello(-1, 3), "claims rank -1"),
    # a rank beyond any job's (a joiner's rank above the group's world is fine: it may be one)
    (lambda: _hello(70_000, 3), "claims rank 70000"),
    (lambda: _hello(1, 3), "claims rank 1, whose address is 127.0.0.2"),  # sent from 127.0.0.100
])
def test_garbage_on_the_wire_is_named_and_the_node_keeps_serving(make, needle: str) -> None:  # type: ignore[no-untyped-def]
    """Before the handshake is done nothing but a handshake frame is read: anything else is
    refused, named and counted, and the connection closed."""
    with cluster(3, timeout_s=0.3) as handles:
        node = handles[0].node
        assert node is not None
        addr = handles[0].peers[0]
        _send_and_wait_closed(addr.host, addr.port, make())
        status = handles[0].status().transport
        assert status.refusals == 1
        assert status.frame_errors == 0
        assert needle in status.last_frame_error
        futures = [h.allreduce_async(np.full(3, h.rank + 1.0)) for h in handles]
        assert all(np.array_equal(f.result(timeout=30), np.full(3, 6.0)) for f in futures)


def test_unknown_kind_after_a_valid_handshake_is_refused() -> None:
    with cluster(3, timeout_s=0.3) as handles:
        node = handles[0].node
        assert node is not None
        addr = handles[0].peers[0]
        with connect(addr.host, addr.port, source="127.0.0.2") as sock:
            # as rank 1's bulk connection, which the real rank 1 has not opened (a newer proven
            # connection of a rank and channel replaces the older)
            assert handshake(sock, 1, channel=BULK)
            sock.sendall(_raw({"k": 77, "f": 1}))
            assert closed_by_peer(sock)
        assert handles[0].status().transport.frame_errors == 1
        last = handles[0].status().transport.last_frame_error
        assert "unknown message kind 77" in last
        assert "rank 1" in last


@pytest.mark.parametrize(("shapes", "dtypes", "needle"), [
    ([(4,), (4,), (5,)], ["float32"] * 3, "float32[5]"),
    ([(4,), (2, 2), (4,)], ["float32"] * 3, "float32[2, 2]"),
    ([(4,), (4,), (4,)], ["float32", "float64", "float32"], "float64[4]"),
])
def test_mismatched_tensors_fail_on_every_worker(shapes, dtypes, needle: str) -> None:  # type: ignore[no-untyped-def]
    with cluster(3, timeout_s=0.3, step_timeout_s=20) as handles:
        futures = [h.allreduce_async(np.ones(s, dtype=d)) for h, s, d in zip(handles, shapes, dtypes, strict=True)]
        for h, fut in zip(handles, futures, strict=True):
            with pytest.raises(TensorMismatch, match="tensor mismatch") as info:
                fut.result(timeout=30)
            assert needle in str(info.value), f"rank {h.rank}: {info.value}"
        # the next, matching step works again
        futures = [h.allreduce_async(np.ones(4, np.float32)) for h in handles]
        assert all(np.array_equal(f.result(timeout=30), np.full(4, 3.0)) for f in futures)


def test_a_dead_peer_is_left_out_and_the_step_finishes_without_it() -> None:
    with cluster(3, timeout_s=0.2, step_timeout_s=10.0) as handles:
        handles[2].close()
        futures = [h.allreduce_async(np.full(3, h.rank + 1.0)) for h in handles[:2]]
        for h, fut in zip(handles[:2], futures, strict=True):
            assert np.array_equal(fut.result(timeout=20), np.full(3, 3.0))
            assert h.last is not None
            assert h.last.contributors == (0, 1)


def test_a_dead_peer_aborts_the_step_naming_it_under_the_abort_policy() -> None:
    with cluster(3, timeout_s=0.2, step_timeout_s=10.0, on_node_failure="abort") as handles:
        handles[2].close()
        futures = [h.allreduce_async(np.ones(3)) for h in handles[:2]]
        for fut in futures:
            with pytest.raises(StepAborted) as info:
                fut.result(timeout=20)
            assert info.value.peers == (2,), str(info.value)
            assert "ranks [2] failed during step 0" in str(info.value)


def test_the_last_of_two_workers_stops_with_a_clear_error() -> None:
    """Two workers and one dies: one of two is no majority, so the survivor produces no results
    (it cannot tell a dead peer from a partition) and says so, naming the view."""
    with cluster(2, timeout_s=0.2, step_timeout_s=10.0) as handles:
        handles[1].close()
        with pytest.raises(GroupLeft, match=r"minority 1 of 2: view 0"):
            handles[0].allreduce_async(np.ones(3)).result(timeout=20)
        with pytest.raises(GroupLeft):  # and every later step says the same, at once
            handles[0].allreduce_async(np.ones(3)).result(timeout=5)


def test_rank_outside_world_and_bad_peers_are_config_errors() -> None:
    peers = local_peers(3)
    with pytest.raises(ConfigError, match="rank 3 is outside the world of 3"):
        FTTreeAllreduce(3, peers)
    with pytest.raises(ConfigError, match="share the address"):
        FTTreeAllreduce(0, [peers[0], peers[1], peers[0]])
    with pytest.raises(ConfigError, match="expected host:port"):
        parse_peers(["127.0.0.1"])
    with pytest.raises(ConfigError, match="timeout_s must be a positive number of seconds, got 0"):
        FTTreeAllreduce(0, peers, timeout_s=0)
    with pytest.raises(ConfigError, match="unknown fault"):
        FTTreeAllreduce(0, peers, faults="snip 0-1")
    with pytest.raises(ConfigError, match="unknown setting timeout; known: "):
        FTTreeAllreduce(0, peers, timeout=0.5)  # every duration ends in _s
    with pytest.raises(ConfigError, match="timeout_policy must be 'static' or 'adaptive'"):
        FTTreeAllreduce(0, peers, timeout_policy="fast")
    with pytest.raises(ConfigError, match=r"partition 0,1,2.*every rank on one side"):
        FTTreeAllreduce(0, peers, faults="partition 0,1,2")
    with pytest.raises(ConfigError, match="crash happens at one step"):
        FTTreeAllreduce(0, peers, faults="crash 1 @2..4")


def test_unreachable_peers_are_named_after_the_startup_deadline() -> None:
    peers = local_peers(3)
    ar = FTTreeAllreduce(0, peers, startup_timeout_s=1.0)
    with pytest.raises(PeerError, match="could not reach peers") as info:
        ar.start()
    assert info.value.peers == (1, 2)
    assert "127.0.0.2" in str(info.value)
    assert "127.0.0.3" in str(info.value)


def test_a_second_worker_with_the_same_rank_is_refused() -> None:
    with cluster(2, timeout_s=0.3) as handles:
        twin = FTTreeAllreduce(0, [str(a) for a in handles[0].peers], startup_timeout_s=1.0)
        with pytest.raises(PeerError, match="already running as this rank"):
            twin.start()


def _fttree(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fttree", *args], capture_output=True, text=True, timeout=60)


def test_cli_rejects_bad_flags_with_a_message(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("\n".join(local_peers(3, free_port())) + "\n")
    cases = [
        (["launch", "-n", "0"], "0 is not in the range"),
        (["launch", "-n", "3", "--faults", "snip 1-0"], "unknown fault 'snip'"),
        (["launch", "-n", "3", "--faults", "cut 9-0"], "outside the world of 3"),
        (["worker", "--rank", "9", "--peers", str(peers)], "rank 9 is outside the world of 3"),
        (["worker", "--rank", "0", "--peers", str(tmp_path / "missing.txt")], "does not exist"),
        (["launch", "--timeout", "-1"], "-1"),
        (["topology", "-n", "x"], "not a valid integer"),
        (["launch", "-n", "3", "--uplink", "fast"], "Invalid value for --uplink: bad rate 'fast'"),
        (["worker", "--rank", "0", "--peers", str(peers), "--uplink", "100xyz"], "bad rate '100xyz'"),
    ]
    for args, needle in cases:
        proc = _fttree(*args)
        assert proc.returncode != 0, args
        assert needle in proc.stderr, (args, proc.stderr)


@pytest.mark.parametrize(("flat", "needle"), [
    (np.zeros((2, 3), np.float32), "1-D"),
    (np.zeros(4, np.complex64), "complex64"),
    (np.zeros(8, np.float32)[::2], "contiguous"),
    ([1.0, 2.0], "numpy array"),
])
def test_a_misused_submit_raises_at_once_and_the_next_step_works(flat: object, needle: str) -> None:
    """Issue 10: a 2-D array raised inside the loop thread and the Future stayed pending forever
    (and the rank had used up a step number its peers were waiting for)."""
    with cluster(3, step_timeout_s=5) as handles:
        with pytest.raises((TypeError, ValueError)) as bad:
            handles[0].submit_array(flat, "bad")  # type: ignore[arg-type]
        assert needle in str(bad.value)
        futures = [h.allreduce_async(np.full(3, h.rank + 1.0)) for h in handles]
        assert all(np.array_equal(f.result(timeout=30), np.full(3, 6.0)) for f in futures)


def test_an_error_on_the_loop_thread_completes_the_callers_future() -> None:
    """Whatever goes wrong inside the node while it handles a submit reaches the caller."""
    with cluster(1) as handles:
        node = handles[0].node
        assert node is not None

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected failure inside the protocol")

        node.machine.handle = broken  # type: ignore[method-assign]
        future = handles[0].submit_array(np.ones(3, np.float32), "float32[3]")
        with pytest.raises(RuntimeError, match="injected failure"):
            future.result(timeout=10)
