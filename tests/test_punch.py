"""Hole punching between ranks that meet through a relay (net/punch.py), on loopback.

Loopback has no NAT, and a SYN to a port nobody listens on is refused at once, so the two
dials of a simultaneous open never meet here: `LoopbackPunch` stands in for them (the only
part not run), handing each side one end of a loopback connection when both dial the port
the coordinator saw the other probe from. Everything else is the real thing: the probes and
their handshakes, the coordinator's notes, the handshake on the punched connections, the
switch off the relay and back. Through real Linux NATs: tests/test_punch_netns.py."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fttree import FTTreeAllreduce
from fttree.errors import FrameError
from fttree.net import handshake as hs
from fttree.net import punch
from fttree.net.address import parse_address
from fttree.net.holepunch import PunchResult
from fttree.net.punch import Punches, coordinators, note, read_note
from fttree.net.relay import Relayed
from fttree.net.tcp import TcpTransport
from fttree.net.transport import TransportStatus
from fttree.status.metrics import render as render_metrics
from fttree.status.monitor import Snapshot

from .conftest import cluster
from .conftest import exact_steps as exact_sums
from .rawpeer import read_frame_head
from .test_nat import secured_settings as settings

WAIT_S = 60.0  # for a punch to connect (or give up), under load


def exact_steps(handles: list[FTTreeAllreduce], steps: int) -> None:
    exact_sums(handles, steps, 20_000)  # 80 KB: the bulk connections carry a part
    assert all(h.last is not None and h.last.epoch == 0 for h in handles)


def status(h: FTTreeAllreduce) -> TransportStatus:
    assert h.transport is not None
    return h.status().transport


def tcp(h: FTTreeAllreduce) -> TcpTransport:
    inner = getattr(h.transport, "inner", None)
    assert isinstance(inner, TcpTransport)
    return inner


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(0.02)


def unlisted(*ranks: int) -> Callable[[int, str], str]:
    return lambda r, p: "-" if r in ranks else p


class LoopbackPunch:
    """A simultaneous open without NATs: the side that dials (local port P -> remote port Q)
    first makes a loopback connection and keeps one end for the side that dials Q -> P. A
    side that dials a port nobody dials back from gets nothing, as through a real NAT."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.lock = threading.Lock()
        self.waiting: dict[tuple[int, int], socket.socket] = {}
        self.calls: list[tuple[tuple[str, int], tuple[str, int]]] = []

    async def __call__(self, local: tuple[str, int], remote: tuple[str, int], deadline_s: float) -> PunchResult:
        with self.lock:
            self.calls.append((local, remote))
            if self.fail:
                return PunchResult(None, 1, 0.0, self.fail)
            mine = self.waiting.pop((remote[1], local[1]), None)
            if mine is None:
                with socket.create_server(("127.0.0.1", 0)) as server:
                    mine = socket.create_connection(server.getsockname())
                    other, _ = server.accept()
                self.waiting[(local[1], remote[1])] = other
        mine.setblocking(False)
        return PunchResult(mine, 1, 0.0)


@pytest.fixture
def fast_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(punch, "PUNCH_RETRY_S", 0.2)


@pytest.fixture
def opener(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackPunch]:
    fake = LoopbackPunch()
    monkeypatch.setattr(punch, "simultaneous_open", fake)
    yield fake
    with fake.lock:
        for sock in fake.waiting.values():
            sock.close()


def punched(h: FTTreeAllreduce, peer: int, times: int = 1) -> bool:
    link = status(h).link(peer)
    return link.punch == "connected" and link.punch_connected >= times and link.relay == -1


PAIRS = ((1, 2), (1, 3), (2, 3))  # rank 0 is public, 1, 2 and 3 are `-`: rank 0 relays for all three pairs


def relayed(st: TransportStatus) -> int:
    return st.relayed_sent_bytes + st.relayed_forwarded_bytes


@pytest.mark.parametrize("secured", ["key", "tls"])
def test_a_punch_connects_each_pair_and_their_frames_stop_taking_the_relay(
        secured: str, tmp_path: Path, opener: LoopbackPunch) -> None:
    """Rank 0 is public, 1, 2 and 3 are `-`: rank 1 is interior and its child's tensors start
    through rank 0. Rank 0 coordinates a punch for each pair: each side dials the other's
    port as rank 0 saw it, both connections prove the key, and from then on not one byte
    takes the relay, while the pairs' direct connections carry tensors and every step stays
    exact."""
    with cluster(4, listed=unlisted(1, 2, 3), **settings(secured, tmp_path)) as handles:
        exact_steps(handles, 2)
        wait_for("the punches", lambda: all(punched(handles[a], b) and punched(handles[b], a) for a, b in PAIRS))
        for a, b in PAIRS:
            link = status(handles[a]).link(b)
            assert link.punch_via == 0, link
            assert (link.punch_tries, link.punch_error) == (1, ""), link
        # each dialled, from the port it probed from, the port the coordinator saw the other's
        # probe from: every dial has its mirror (control and bulk, both sides of each pair)
        ports = [(local[1], remote[1]) for local, remote in opener.calls]
        assert len(ports) == 4 * len(PAIRS), opener.calls
        assert all((q, p) in ports for p, q in ports), ports
        before = [status(h) for h in handles]
        exact_steps(handles, 4)
        after = [status(h) for h in handles]
        assert [relayed(st) for st in after] == [relayed(st) for st in before]  # nothing relayed
        direct = sum(after[a].link(b).bytes_sent - before[a].link(b).bytes_sent for a, b in PAIRS)
        assert direct > 4 * 20_000 * 4, direct  # tensors went on the punched connections
        assert all(st.refusals == 0 and st.relay_drops == 0 for st in after)
        doc, metrics = status_and_metrics(handles[1])
        assert [(p["peer"], p["state"], p["tries"], p["connected"], p["via"]) for p in doc["hole_punches"]] \
            == [(2, "connected", 1, 1, 0), (3, "connected", 1, 1, 0)]
        assert 'fttree_hole_punch_state{peer="2",state="connected"} 1' in metrics
        assert 'fttree_hole_punch_connected_total{peer="3"} 1' in metrics


def status_and_metrics(h: FTTreeAllreduce) -> tuple[dict[str, Any], str]:
    """The worker's /status document and /metrics text, taken on its loop."""
    async def take() -> Snapshot:
        assert h.monitor is not None
        return h.monitor.snapshot()

    loop = h._loop
    assert loop is not None
    snap = asyncio.run_coroutine_threadsafe(take(), loop).result(timeout=30)
    return snap.to_dict(), render_metrics(snap)


def test_a_punched_connection_that_breaks_puts_the_pair_back_on_the_relay_and_is_punched_again(
        tmp_path: Path, opener: LoopbackPunch, fast_retry: None) -> None:
    """Rank 2's punched control connection to rank 3 is reset: both put the pair back on the
    relay (what was queued with it), the steps stay exact, and rank 2 (the lower) punches
    again, which connects."""
    with cluster(4, listed=unlisted(2, 3), **settings("key", tmp_path)) as handles:
        wait_for("the first punch", lambda: punched(handles[2], 3) and punched(handles[3], 2))
        exact_steps(handles, 1)
        t2 = tcp(handles[2])
        ch = t2._out[3].control
        loop = t2._loop
        assert loop is not None
        assert ch.writer is not None
        loop.call_soon_threadsafe(ch.writer.transport.abort)
        exact_steps(handles, 3)
        wait_for("the second punch", lambda: punched(handles[2], 3, times=2) and punched(handles[3], 2, times=2))
        link = status(handles[2]).link(3)
        assert link.punch_tries == 2, link
        exact_steps(handles, 2)


def test_a_punch_that_fails_leaves_the_relay_carrying_the_pair_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_retry: None, caplog: pytest.LogCaptureFixture) -> None:
    """No SYN gets through (as behind a NAT that maps every connection to a new port): every
    try fails within its deadline, the relay carries the pairs' tensors throughout, every step
    is exact, the status says why, and each rank logs it once per peer."""
    fake = LoopbackPunch(fail="no connection to 127.0.0.1:9 within 5 s")
    monkeypatch.setattr(punch, "simultaneous_open", fake)
    caplog.set_level(logging.WARNING, logger="fttree.net.punch")
    with cluster(4, listed=unlisted(1, 2, 3), **settings("key", tmp_path)) as handles:
        exact_steps(handles, 2)
        # the lower rank of each pair leads: three tries; the other follows those it is not busy with
        wait_for("three failed tries", lambda: all(
            status(handles[a]).link(b).punch_tries == 3 and status(handles[a]).link(b).punch == "failed"
            and status(handles[b]).link(a).punch == "failed" for a, b in PAIRS))
        before = [status(h) for h in handles]
        exact_steps(handles, 4)
        after = [status(h) for h in handles]
        for a, b in PAIRS:
            link = after[a].link(b)
            assert link.relay == 0, link
            assert link.punch_connected == 0, link
            assert "within 5 s" in link.punch_error, link
        doc, metrics = status_and_metrics(handles[1])
        punches = [(p["peer"], p["state"], p["tries"]) for p in doc["hole_punches"]]
        assert punches == [(2, "failed", 3), (3, "failed", 3)]
        assert "within 5 s" in doc["hole_punches"][0]["error"]
        assert 'fttree_hole_punch_state{peer="2",state="failed"} 1' in metrics
        assert 'fttree_hole_punch_connected_total{peer="2"} 0' in metrics
        assert sum(relayed(st) for st in after) - sum(relayed(st) for st in before) > 4 * 20_000 * 4
    logged = [rec.getMessage() for rec in caplog.records if "no hole punch" in rec.getMessage()]
    assert len(logged) == 2 * len(PAIRS), logged  # one line per rank and peer, not one per try


class Outsider:
    """In place of the other end of a punch: a socket without the job's key. To a worker that
    opens the handshake it answers a CHALLENGE it cannot prove; to one that waits for a HELLO
    it sends nothing (a HELLO it could not prove: test_tls.py and test_nat.py)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.proofs: list[bytes] = []  # what a dialler sent after our bad CHALLENGE (nothing, if it refused)

    async def __call__(self, local: tuple[str, int], remote: tuple[str, int], deadline_s: float) -> PunchResult:
        with socket.create_server(("127.0.0.1", 0)) as server:
            mine = socket.create_connection(server.getsockname())
            other, _ = server.accept()
        thread = threading.Thread(target=self._play, args=(other,), daemon=True)
        thread.start()
        self.threads.append(thread)
        mine.setblocking(False)
        return PunchResult(mine, 1, 0.0)

    def _play(self, sock: socket.socket) -> None:
        with sock:
            sock.settimeout(30)
            head = read_frame_head(sock)  # the acceptor closes after its handshake deadline: None
            if head is None:
                return
            hello = hs.decode(head)
            assert isinstance(hello, hs.Hello)
            sock.sendall(hs.encode(hs.Challenge(src=hello.dst, nonce=hs.new_nonce(), mac=b"\0" * hs.MAC_BYTES)))
            proof = read_frame_head(sock)
            if proof is not None:
                self.proofs.append(proof)


def test_a_punched_connection_is_no_way_in_without_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a GO named, a punched connection proves the key like any other: here the other
    end is an outsider. Rank 2 (which opens the handshake) refuses an acceptor that cannot
    prove the key and sends it no proof; rank 3 (which waits for a HELLO) gets none and closes
    it. The pair stays on the relay, every step exact."""
    outsider = Outsider()
    monkeypatch.setattr(punch, "simultaneous_open", outsider)
    monkeypatch.setattr(punch, "PUNCH_TRIES", 1)
    with cluster(4, listed=unlisted(2, 3), handshake_timeout_s=2.0, **settings("key", tmp_path)) as handles:
        wait_for("the refused punch", lambda: all(status(h).link(5 - h.rank).punch == "failed" for h in handles[2:]))
        exact_steps(handles, 2)
        for h in handles[2:]:
            link = status(h).link(5 - h.rank)
            assert link.relay in (0, 1), link
            assert link.punch_connected == 0, link
            assert status(h).refusals >= 1, h.rank
        assert "did not prove the job's key" in status(handles[2]).link(3).punch_error
    for thread in outsider.threads:
        thread.join(timeout=30)
    assert outsider.proofs == []


# ---- the notes, against a transport's stand-in --------------------------------------------


ADDRESSES = {0: parse_address("10.0.0.1:1"), 1: parse_address("10.0.0.2:1"), 2: parse_address("-"),
             3: parse_address("-"), 4: parse_address("192.168.0.5:1 behind home")}


class Host:
    closed = False

    def __init__(self, rank: int) -> None:
        self.rank, self.addresses, self.me = rank, dict(ADDRESSES), ADDRESSES[rank]
        self.pushed: list[tuple[int, dict[str, object]]] = []

    def knows(self, rank: int) -> bool:
        return rank in self.addresses

    def link_up(self, peer: int) -> bool:
        return True

    def push(self, dst: int, msg: object) -> None:
        assert isinstance(msg, Relayed)
        self.pushed.append((dst, read_note(msg.head)))

    async def probe(self, coordinator: int, channel: int, sock: socket.socket) -> tuple[str, int]:
        raise AssertionError("not probed here")

    async def take_punched(self, peer: int, channel: int, sock: socket.socket) -> str:
        raise AssertionError("not punched here")

    def punched(self, peer: int) -> bool:
        return False

    async def connected(self, peer: int, timeout_s: float) -> bool:
        return True

    def punch_lost(self, peer: int, why: str) -> None:
        raise AssertionError("not punched here")


def head(body: dict[str, object]) -> bytes:
    return bytes(note(0, 0, body).head)


def test_only_public_relays_of_the_pair_coordinate() -> None:
    assert set(coordinators(ADDRESSES, 2, 3)) == {0, 1}
    assert coordinators(ADDRESSES, 2, 4) in ((0, 1), (1, 0))


def test_a_coordinator_answers_only_a_pair_it_coordinates_once_both_probed() -> None:
    async def run() -> None:
        c = Punches(Host(0))  # type: ignore[arg-type]
        host = c.host
        assert isinstance(host, Host)
        net = "198.51.100.1"
        for rank, port in ((2, 4000), (3, 5000)):
            c.seen(rank, hs.PROBE_CONTROL, (net, port))
            c.seen(rank, hs.PROBE_BULK, (net, port + 1))
        maps = {2: {"ctl": f"{net}:4000", "bulk": f"{net}:4001"}, 3: {"ctl": f"{net}:5000", "bulk": f"{net}:5001"}}
        c.receive(2, head({"t": "ask", "peer": 1, **maps[2]}))  # 2 and 1 connect: not a pair to punch
        c.receive(3, head({"t": "ask", "peer": 2, **maps[3]}))  # the higher rank does not ask
        c.receive(2, head({"t": "ready", "peer": 3, **maps[2]}))  # ready for an ask nobody made
        c.receive(2, head({"t": "ask", "peer": 3, **maps[3]}))  # mappings not seen from rank 2
        c.receive(2, head({"t": "ask", "peer": 3}))  # none
        assert host.pushed == []
        c.receive(2, head({"t": "ask", "peer": 3, **maps[2]}))
        assert host.pushed == [(3, {"t": "offer", "peer": 2})]
        c.receive(3, head({"t": "ready", "peer": 2, "ctl": f"{net}:4000", "bulk": f"{net}:5001"}))  # one not its own
        assert len(host.pushed) == 1
        c.receive(3, head({"t": "ready", "peer": 2, **maps[3]}))
        assert host.pushed[1:] == [(2, {"t": "go", "peer": 3, **maps[3]}), (3, {"t": "go", "peer": 2, **maps[2]})]
        c.receive(3, head({"t": "ready", "peer": 2, **maps[3]}))  # once: the ask is used up
        assert len(host.pushed) == 3

    asyncio.run(run())


def test_a_rank_takes_go_only_from_a_coordinator_of_the_pair_and_only_when_waiting() -> None:
    async def run() -> None:
        p = Punches(Host(3))  # type: ignore[arg-type]
        go = p._go[2] = asyncio.get_running_loop().create_future()
        p.receive(4, head({"t": "go", "peer": 2, "ctl": "1.2.3.4:5", "bulk": "1.2.3.4:6"}))  # not a coordinator
        p.receive(0, head({"t": "go", "peer": 1, "ctl": "1.2.3.4:5", "bulk": "1.2.3.4:6"}))  # not waited for
        assert not go.done()
        p.receive(0, head({"t": "go", "peer": 2, "ctl": "1.2.3.4:5", "bulk": "1.2.3.4:6"}))
        assert go.done()
        assert go.result()["ctl"] == "1.2.3.4:5"
        p.receive(1, head({"t": "offer", "peer": 4}))  # 4 is higher: 3 leads that pair, it does not follow
        assert 4 not in p._tasks

    asyncio.run(run())


@pytest.mark.parametrize(("raw", "match"), [
    (punch.PUNCH_MARK + b"\xff\xff", "not msgpack"),
    (punch.PUNCH_MARK + b"\x90", "without its type"),
    (head({"t": "ask", "peer": "2"}), "not a rank"),
    (punch.PUNCH_MARK + bytes(600), "at most"),
])
def test_a_note_no_member_sends_is_a_frame_error(raw: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        Punches(Host(0)).receive(2, raw)  # type: ignore[arg-type]


def test_a_mapping_is_host_and_port() -> None:
    assert punch.parse_mapping("[::1]:80") == ("::1", 80)
    for bad in ("1.2.3.4", "1.2.3.4:0", ":80", 5):
        with pytest.raises(FrameError):
            punch.parse_mapping(bad)
