"""Workers nobody can dial (behind a NAT) train with the rest: a connection serves both
directions (issue 40, part 1). On loopback: a rank listed as `-` listens nowhere, dials every
peer, and they send to it on the connections it opened; ranks `behind` a site are dialled by
their site-mates only. The real NAT, in network namespaces, is tests/test_nat_netns.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fttree import FTTreeAllreduce
from fttree.core.messages import Kind, Message
from fttree.errors import ConfigError, FTTreeError, PeerError
from fttree.net import certs
from fttree.net import handshake as hs
from fttree.net.address import NOWHERE, Address, parse_address, parse_peers
from fttree.net.relay import wrap
from fttree.net.tcp import MEMBER_HOST_HANDSHAKES, PER_HOST_HANDSHAKES, TcpTransport

from .conftest import cluster, local_peers, run_threads, start_all
from .conftest import exact_steps as exact_sums
from .rawpeer import closed_by_peer, connect, read_frame_head

SIZE = 407_500  # float32: 1.63 MB a step


def exact_steps(handles: list[FTTreeAllreduce], steps: int, size: int = SIZE) -> None:
    """Every step exact on every rank, every rank in the sum, and still in view 0 (views only
    grow: no view change removed or re-admitted anyone)."""
    exact_sums(handles, steps, size)
    assert all(h.last is not None and h.last.epoch == 0 for h in handles), [h.last and h.last.epoch for h in handles]


def secured_settings(secured: str, tmp_path: Path) -> dict[str, object]:
    """A 4-rank cluster's settings for `secured`: "plain" (insecure), "key" (a job key) or "tls"."""
    out: dict[str, object] = {"timeout_s": 0.3, "step_timeout_s": 20, "insecure": secured == "plain"}
    if secured in ("key", "tls"):
        key = tmp_path / "job.key"
        key.write_bytes(b"k" * 32)
        out["auth_key_file"] = str(key)
    if secured == "tls":
        certs.make(tmp_path / "tls", range(4))
        out["tls_dir"] = str(tmp_path / "tls")
    return out


def links(h: FTTreeAllreduce) -> dict[int, tuple[int, int]]:
    """peer -> (connections dialled to it, connections it dialled that carry our frames)."""
    assert h.transport is not None
    return {s.peer: (s.connects, s.adopted) for s in h.status().transport.links}


def unlisted(*ranks: int) -> object:
    return lambda r, p: "-" if r in ranks else p


# ---- addresses --------------------------------------------------------------------------


def test_the_peers_file_says_who_can_be_dialled_by_whom() -> None:
    public = parse_address("10.0.0.1:29500")
    home_a, home_b = parse_address("192.168.1.5:29500 behind home"), parse_address("192.168.1.6:29500 behind home")
    office = parse_address("192.168.1.5:29500 behind office")
    nowhere = parse_address(" - ")
    assert nowhere == NOWHERE
    assert not nowhere.listed
    assert [str(a) for a in (public, home_a, nowhere)] == ["10.0.0.1:29500", "192.168.1.5:29500 behind home", "-"]
    assert parse_address(str(home_a)) == home_a
    assert public.dialable_from(home_a)
    assert public.dialable_from(nowhere)
    assert home_b.dialable_from(home_a)  # site-mates
    assert not home_a.dialable_from(public)
    assert not home_a.dialable_from(office)
    assert not home_a.dialable_from(nowhere)
    assert not nowhere.dialable_from(public)
    assert not nowhere.dialable_from(home_a)
    # the same private address at two sites is two machines; two `-` are no clash
    assert parse_peers(["10.0.0.1:1", "-", "-", "192.168.1.5:1 behind home", "192.168.1.5:1 behind office"]) \
        [1:3] == [NOWHERE, NOWHERE]
    with pytest.raises(ConfigError, match="share the address"):
        parse_peers(["10.0.0.1:1 behind home", "-", "10.0.0.1:1 behind home"])
    for bad in ("- behind home", "10.0.0.1:1 behind", "10.0.0.1:1 behind a/b", "10.0.0.1:1 beside home"):
        with pytest.raises(ConfigError, match="bad"):
            parse_address(bad)
    assert Address("h", 1).dialable_from(Address("h", 2, "x"))


# ---- on loopback ------------------------------------------------------------------------


@pytest.mark.parametrize("secured", ["plain", "key", "tls"])
def test_a_rank_nobody_can_dial_trains_with_the_others_on_the_connections_it_opened(
        secured: str, tmp_path: Path) -> None:
    """Rank 3 is `-`: it listens nowhere (nothing could be dialled) and every step is exact on
    every rank, rank 3 in every sum, in view 0. Nobody dialled it: its peers' frames went on
    the two connections it opened to each (control and bulk, adopted)."""
    with cluster(4, listed=unlisted(3), **secured_settings(secured, tmp_path)) as handles:
        exact_steps(handles, 4)
        for h in handles[:3]:
            dialled, adopted = links(h)[3]
            assert dialled == 0, f"rank {h.rank} dialled rank 3"
            assert adopted >= 2, f"rank {h.rank} sent to rank 3 on {adopted} of its connections"  # control + bulk
        to_public = links(handles[3])
        assert all(to_public[p][0] >= 2 and to_public[p][1] == 0 for p in range(3)), to_public
        assert all(h.status().transport.refusals == 0 for h in handles)


def test_a_lost_connection_of_a_rank_nobody_can_dial_comes_back_from_its_side() -> None:
    """Rank 0 drops the connections rank 2 (`-`) dialled: rank 2 dials them again at once
    (it has no frames to send: it keeps them up because they are its peers' only way to it),
    and the steps go on exact."""
    with cluster(3, listed=unlisted(2), insecure=True, timeout_s=0.3, step_timeout_s=20) as handles:
        exact_steps(handles, 2)
        node = handles[0].transport
        assert node is not None
        tcp = node.inner  # type: ignore[attr-defined]
        before = links(handles[0])[2][1]
        for ch in tcp._out[2].channels:
            assert ch.writer is not None
            assert ch.writer.inbound is not None
            ch.writer.transport.abort()
        deadline = time.monotonic() + 10
        while links(handles[0])[2][1] < before + 2:
            assert time.monotonic() < deadline, f"rank 2 did not dial again: {links(handles[0])}"
            time.sleep(0.05)
        assert links(handles[0])[2][0] == 0
        exact_steps(handles, 3)


def test_a_rank_nobody_can_dial_that_dies_is_evicted_without_waiting_for_a_steps_silence() -> None:
    """Rank 3 (`-`) is killed between steps. Its peers cannot dial it to learn that it is gone
    (a dialled peer's connection would be refused): its connections closed and it did not dial
    again within the grace, which counts as refused. The node deadline is two minutes and no
    step is in flight, so silence could not have evicted it within the test's deadline; through
    a NAT this cost a 2.4 s step (issue 40)."""
    with cluster(4, listed=unlisted(3), insecure=True, timeout_s=0.3, step_timeout_s=20,
                 node_deadline_s=120) as handles:
        exact_steps(handles, 2)
        handles[3].crash("test: rank 3 is killed")
        survivors = handles[:3]
        deadline = time.monotonic() + 30
        while not all(h.view.members is not None and 3 not in h.view.members for h in survivors):
            assert time.monotonic() < deadline, f"rank 3 not evicted within 30 s: {[h.view for h in survivors]}"
            time.sleep(0.05)
        evicted = [e for h in survivors if h.node is not None for e in h.status().membership.evictions
                   if e.rank == 3]
        assert len(evicted) == 3, evicted
        assert all(len(e.suspected_by) >= 2 for e in evicted), evicted


def test_ranks_behind_one_site_dial_each_other_and_the_public_ones_only_are_dialled_by_them() -> None:
    """Ranks 2 and 3 are behind site `home`: they dial each other at their site addresses;
    ranks 0 and 1 never dial them and send to them on their connections."""
    def behind(r: int, p: str) -> str:
        return f"{p} behind home" if r >= 2 else p

    with cluster(4, listed=behind, insecure=True, timeout_s=0.3, step_timeout_s=20) as handles:
        exact_steps(handles, 3)
        for h in handles[:2]:
            assert all(links(h)[p][0] == 0 and links(h)[p][1] >= 2 for p in (2, 3)), links(h)
        assert links(handles[2])[3][0] >= 1
        assert links(handles[2])[3][1] == 0
        assert links(handles[3])[2][0] >= 1
        assert links(handles[3])[2][1] == 0


@pytest.mark.parametrize("secured", ["plain", "tls"])
def test_two_ranks_nobody_can_dial_exchange_their_frames_through_a_relay(secured: str, tmp_path: Path) -> None:
    """Ranks 2 and 3 are both `-` (two NATs): no connection can join them, so their frames go
    through a rank both dialled (relay.py). Every step exact on every rank in view 0; the
    relay carried envelopes both ways, each end received some, none was dropped."""
    settings: dict[str, object] = {"timeout_s": 0.3, "step_timeout_s": 20, "insecure": secured == "plain"}
    if secured == "tls":
        key = tmp_path / "job.key"
        key.write_bytes(b"k" * 32)
        certs.make(tmp_path / "tls", range(4))
        settings.update(auth_key_file=str(key), tls_dir=str(tmp_path / "tls"))
    # (no hole punch: on loopback one would not connect, but the pair must stay on the relay here)
    with cluster(4, listed=unlisted(2, 3), hole_punch=False, **settings) as handles:
        exact_steps(handles, 4)
        status = [h.status().transport for h in handles if h.transport is not None]
        via = {st.rank: st.link(5 - st.rank).relay for st in status[2:]}
        assert via[2] == via[3] in (0, 1), via  # one relay for both directions, a rank both can reach
        assert all(st.link(p).relay == -1 for st in status for p in range(4) if {st.rank, p} != {2, 3})
        assert status[via[2]].relayed_forwarded_bytes > 0
        assert all(status[r].relayed_sent_bytes > 0 and status[r].relayed_received_bytes > 0 for r in (2, 3))
        assert all(st.relay_drops == 0 and st.refusals == 0 for st in status)


def test_two_ranks_no_rank_can_relay_for_are_named_at_the_start_not_waited_for() -> None:
    """Rank 1 is behind site `home`, rank 2 is `-`: neither can dial the other and rank 0, the
    only other rank, is behind `home` too, which rank 2 cannot reach. No relay exists: the
    start fails at once naming the pair, instead of waiting out its deadline."""
    peers = [f"{p} behind home" if r < 2 else "-" for r, p in enumerate(local_peers(3))]
    handles = [FTTreeAllreduce(r, peers, startup_timeout_s=60, timeout_s=0.3, insecure=True) for r in range(3)]
    began = time.monotonic()
    errors = start_all(handles, limit_s=90)
    took = time.monotonic() - began
    for h in handles:
        h.close()
    named = [str(e) for e in errors if isinstance(e, PeerError) and "cannot connect" in str(e)]
    assert named, [str(e) for e in errors]
    assert all("no rank of the job can reach both" in e for e in named), named
    assert took < 30, f"the start took {took:.1f} s"


def test_a_rank_listed_as_dash_listens_nowhere() -> None:
    """Its own entry `-`: no listening socket, so nothing could dial it even by mistake."""
    with cluster(2, listed=unlisted(1), insecure=True, timeout_s=0.3, step_timeout_s=20) as handles:
        tcp = handles[1].transport.inner  # type: ignore[union-attr]
        assert tcp._server is None
        assert tcp._tls_listener is None
        exact_steps(handles, 2, size=1000)


def test_without_a_key_a_rank_behind_a_nat_is_refused_naming_the_options() -> None:
    """Its connections come from the NAT's address: only a key can tell it from anyone else."""
    for entry in ("-", "127.0.0.9:1 behind home"):
        peers = [*local_peers(2), entry]
        with pytest.raises(ConfigError, match=r"dial from behind a NAT.*--auth-key-file.*--insecure"):
            FTTreeAllreduce(0, peers)


def test_an_outsider_claiming_the_rank_nobody_can_dial_is_not_sent_its_frames(tmp_path: Path) -> None:
    """Rank 2 is `-`. A connection that claims rank 2 without the key is refused at its
    proof: rank 0 keeps sending on rank 2's own connections (none adopted from the outsider),
    and the steps stay exact."""
    key = tmp_path / "job.key"
    key.write_bytes(b"k" * 32)
    with cluster(3, listed=unlisted(2), auth_key_file=str(key), handshake_timeout_s=2.0, timeout_s=0.3,
                 step_timeout_s=20) as handles:
        exact_steps(handles, 2)
        before = links(handles[0])[2]
        addr = handles[0].peers[0]
        for channel in (hs.CONTROL, hs.BULK):
            with connect(addr.host, addr.port) as sock:  # this job's id, a proof made with another key
                hello = hs.Hello(src=2, dst=0, world=3, channel=channel, address="-", job=handles[0].credentials.job,
                                 nonce=hs.new_nonce())
                sock.sendall(hs.encode(hello))
                head = read_frame_head(sock)
                assert head is not None
                challenge = hs.decode(head)
                assert isinstance(challenge, hs.Challenge)
                sock.sendall(hs.encode(hs.Proof(src=2, mac=hs.dial_mac(b"x" * 32, hello, challenge.nonce))))
                assert closed_by_peer(sock)
        assert links(handles[0])[2] == before
        assert handles[0].transport is not None
        assert handles[0].status().transport.refusals >= 2
        exact_steps(handles, 2)
        assert links(handles[0])[2] == before


def test_the_ranks_of_a_site_dialling_at_once_are_not_refused_as_one_outsiders_flood() -> None:
    """Ranks behind a NAT all dial from its one address. Before any has proven the key, an
    unknown address may have two more connections in their handshake per such rank; once one
    has, that address counts as a member's (MEMBER_HOST_HANDSHAKES each)."""
    addresses = {0: Address("127.0.0.1", 1), 1: Address("127.0.0.2", 1), 2: NOWHERE, 3: NOWHERE}
    t = TcpTransport(0, addresses)
    assert t.handshake_cap("198.51.100.7") == PER_HOST_HANDSHAKES + 4
    assert t.handshake_cap("127.0.0.2") == MEMBER_HOST_HANDSHAKES
    t.learn_nat_host(2, "198.51.100.7")
    assert t.handshake_cap("198.51.100.7") == MEMBER_HOST_HANDSHAKES
    assert t.handshake_cap("203.0.113.9") == PER_HOST_HANDSHAKES + 2  # rank 3 not seen yet
    t.learn_nat_host(3, "198.51.100.7")
    assert t.handshake_cap("198.51.100.7") == 2 * MEMBER_HOST_HANDSHAKES
    assert t.handshake_cap("203.0.113.9") == PER_HOST_HANDSHAKES
    assert "-" not in t.member_hosts()


def test_a_restarted_rank_nobody_can_dial_rejoins_and_takes_the_global_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 (`-`) dies in round 1 of an outer-step job; a new process of it joins with the
    peers file (join=True): it dials every member, they answer on its connections, and it
    takes the global parameters and trains on (test_diloco's restart, with rank 2 behind a NAT)."""
    from . import test_diloco as td

    monkeypatch.setitem(td.SETTINGS, "insecure", True)
    peers = [*local_peers(2), "-"]
    runs = [td.Run() for _ in range(3)]
    rejoined = td.Run()
    killed = threading.Event()

    def member(rank: int) -> None:
        td.train(rank, peers, runs[rank], rounds=3, joiner_rounds=2)

    def victim() -> None:
        td.train(2, peers, runs[2], rounds=100, crash_in=1)
        killed.set()

    def restarted() -> None:
        assert killed.wait(60)
        td.train(2, peers, rejoined, rounds=0, join=True, joiner_rounds=2)

    run_threads([lambda: member(0), lambda: member(1), victim, restarted])
    assert [runs[0].error, runs[1].error, rejoined.error] == [None, None, None]
    assert rejoined.synced_from is not None


def test_joining_through_a_contact_from_behind_a_nat_is_refused_naming_the_way_that_works() -> None:
    with pytest.raises(ConfigError, match=r"join with every rank's address"):
        FTTreeAllreduce(4, {4: "-"}, join="127.0.0.2:29500", insecure=True)


def test_when_the_relay_dies_its_pair_goes_through_another_and_only_the_dead_rank_leaves() -> None:
    """Ranks 3 and 4 are `-` (brothers in the tree: their backup link is relayed). The rank
    that relays between them is killed: the others' failure detector removes it alone, the
    pair's frames take the next relay, and neither of the pair, whom nobody can dial, is
    suspected: every later step is exact with the four survivors in the sum."""
    with cluster(5, listed=unlisted(3, 4), insecure=True, timeout_s=0.3, step_timeout_s=20,
                 hole_punch=False) as handles:  # (the pair stays on its relays)
        exact_steps(handles, 2)
        assert handles[3].transport is not None
        relay = handles[3].status().transport.link(4).relay
        assert relay in (0, 1, 2)
        handles[relay].crash("test: the relay dies")
        survivors = [h for h in handles if h.rank != relay]
        ranks = tuple(h.rank for h in survivors)
        good, deadline, step = 0, time.monotonic() + 60, 100
        while good < 3:
            assert time.monotonic() < deadline, f"no 3 exact steps of {ranks} within 60 s"
            step += 1
            data = {h.rank: np.full(1000, float(step + h.rank), np.float32) for h in survivors}
            futures = [(h, h.allreduce_async(data[h.rank])) for h in survivors]
            outcomes = []
            for h, fut in futures:
                try:
                    outcomes.append((h, fut.result(timeout=30)))
                except FTTreeError:
                    outcomes.append((h, None))
            if all(out is not None and h.last is not None and h.last.contributors == ranks
                   and np.array_equal(out, sum(data.values())) for h, out in outcomes):
                good += 1
        for h in survivors:
            assert h.view.members is not None
            assert sorted(h.view.members) == list(ranks), (h.rank, h.view)
        after = handles[3].status().transport.link(4).relay
        assert after in (0, 1, 2)
        assert after != relay


def test_an_envelope_from_an_outsider_is_refused_before_anything_is_relayed(tmp_path: Path) -> None:
    """Ranks 2 and 3 are `-` and reach each other through a relay. An outsider who connects to
    the relay and sends an envelope for rank 3 (instead of a HELLO, or after a HELLO with a
    proof made with another key) is refused at the handshake: the relay forwards nothing, and
    the steps stay exact."""
    key = tmp_path / "job.key"
    key.write_bytes(b"k" * 32)
    with cluster(4, listed=unlisted(2, 3), auth_key_file=str(key), handshake_timeout_s=2.0, timeout_s=0.3,
                 step_timeout_s=20, hole_punch=False) as handles:  # (the pair stays on the relay)
        exact_steps(handles, 2)
        assert handles[2].transport is not None
        relay = handles[2].status().transport.link(3).relay
        status = handles[relay].status().transport  # type: ignore[union-attr]
        forwarded, refusals = status.relayed_forwarded_bytes, status.refusals
        addr = handles[relay].peers[relay]
        forged = Message(kind=Kind.DATA_REDUCE, src=2, step=5, origin=2, target=3, dtype="<f4", numel=4,
                         payload=bytes(16))
        envelope = b"".join(bytes(b) for b in wrap(forged, 2, 3).bufs())
        with connect(addr.host, addr.port) as sock:  # an envelope instead of a HELLO
            sock.sendall(envelope)
            assert closed_by_peer(sock)
        with connect(addr.host, addr.port) as sock:  # a HELLO, a proof made with another key, an envelope
            hello = hs.Hello(src=2, dst=relay, world=4, channel=hs.CONTROL, address="-",
                             job=handles[0].credentials.job, nonce=hs.new_nonce())
            sock.sendall(hs.encode(hello))
            head = read_frame_head(sock)
            assert head is not None
            challenge = hs.decode(head)
            assert isinstance(challenge, hs.Challenge)
            sock.sendall(hs.encode(hs.Proof(src=2, mac=hs.dial_mac(b"x" * 32, hello, challenge.nonce))) + envelope)
            assert closed_by_peer(sock)
        exact_steps(handles, 2)
        after = handles[relay].status().transport  # type: ignore[union-attr]
        assert after.refusals >= refusals + 2
        received = handles[3].status().transport.relayed_received_bytes  # type: ignore[union-attr]
        assert received > 0  # (the pair's own frames still pass)
        assert after.relayed_forwarded_bytes > forwarded  # the pair's frames of the steps since
        assert all(h.last is not None and h.last.contributors == (0, 1, 2, 3) for h in handles)
