"""The trust boundary: only the job's own workers reach its sums, its membership and its model.

The attacker is a separate process (tests/attacker.py) that reaches every worker's port but
holds no key. While it tries everything it can, the job runs steps: every one exact with
every member in it, nobody evicted, nothing it sent read past the handshake, and the
workers' memory bounded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fttree import ConfigError, FTTreeAllreduce
from fttree.net.credentials import Credentials, write_key

from .conftest import cluster, local_peers, start_all
from .rawpeer import closed_by_peer, connect, handshake

ATTACKER = Path(__file__).resolve().parent / "attacker.py"


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


def test_an_outsider_without_the_key_changes_nothing(tmp_path: Path) -> None:
    key = write_key(tmp_path / "job.key")
    with cluster(3, auth_key_file=str(key), handshake_timeout_s=1.0, timeout_s=0.3, step_timeout_s=20) as handles:
        for _ in range(20):  # warm up (steps of 4 KB hold no pooled buffers: what grows is the attack)
            for fut in [h.allreduce_async(np.zeros(1000, np.float32)) for h in handles]:
                fut.result(timeout=30)
        before = rss_mb()
        targets = ",".join(str(a) for a in handles[0].peers)
        attacker = subprocess.Popen([sys.executable, str(ATTACKER), "--targets", targets, "--job",
                                     handles[0].credentials.job],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        step = 0
        while attacker.poll() is None or step < 10:
            data = [np.full(1000, float(step + r), np.float32) for r in range(3)]
            futures = [h.allreduce_async(d) for h, d in zip(handles, data, strict=True)]
            for h, fut in zip(handles, futures, strict=True):
                out = fut.result(timeout=30)
                assert np.array_equal(out, sum(data)), f"rank {h.rank} step {step}: not the members' exact sum"
                assert h.last is not None
                assert h.last.contributors == (0, 1, 2), (step, h.last.contributors)
            step += 1
        out, err = attacker.communicate(timeout=60)
        assert attacker.returncode == 0, err
        report = json.loads(out)
        after = rss_mb()
        assert report["not_closed"] == [], report
        assert report["answered_after_handshake"] == 0, report
        assert report["challenges"] > 0, report  # the job id travels in clear: the key is the secret
        assert sum(report["tried"].values()) > 300, report
        for h in handles:
            assert h.node is not None
            member = h.status().membership
            assert member.evicted_total == 0
            assert member.suspicions_total == 0
            assert h.view.members == (0, 1, 2)
            assert h.status().transport.refusals > 0
        assert after - before < 50, (before, after)


def test_a_worker_of_another_job_is_named_and_refused(tmp_path: Path) -> None:
    ours, theirs = write_key(tmp_path / "ours.key"), write_key(tmp_path / "theirs.key")
    with cluster(3, auth_key_file=str(ours), handshake_timeout_s=1.0) as handles:
        addr = handles[0].peers[0]
        stranger = Credentials.from_key_file(theirs)
        with connect(addr.host, addr.port, source="127.0.0.2") as sock:
            handshake(sock, 1, key=stranger.key)
            assert closed_by_peer(sock)
        status = handles[0].status().transport if handles[0].node else None
        assert status is not None
        assert f"a worker of job {stranger.job} connected; this is job {handles[0].credentials.job}" \
            in status.last_frame_error
        with connect(addr.host, addr.port, source="127.0.0.2") as sock:  # the right job id, no key
            from fttree.net import handshake as hs

            hello = hs.Hello(src=1, dst=0, world=3, channel=hs.CONTROL, address="", job=handles[0].credentials.job,
                             nonce=hs.new_nonce())
            sock.sendall(hs.encode(hello))
            sock.sendall(hs.encode(hs.Proof(src=1, mac=b"\0" * hs.MAC_BYTES)))
            assert closed_by_peer(sock)
        assert "did not prove the job's key" in handles[0].status().transport.last_frame_error  # type: ignore[union-attr]


def test_a_worker_with_a_wrong_key_cannot_start_and_says_why(tmp_path: Path) -> None:
    ours, theirs = write_key(tmp_path / "ours.key"), write_key(tmp_path / "theirs.key")
    peers = local_peers(2)
    good = FTTreeAllreduce(0, peers, auth_key_file=str(ours), startup_timeout_s=3)
    bad = FTTreeAllreduce(1, peers, auth_key_file=str(theirs), startup_timeout_s=3)
    errors = start_all([good, bad])
    try:
        assert len(errors) == 2, errors
        assert any("closed the connection during the handshake" in str(e) or "did not prove" in str(e)
                   for e in errors), errors
    finally:
        good.close()
        bad.close()


def test_no_credential_off_loopback_refuses_to_start_naming_the_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auth_key_file=") as info:
        FTTreeAllreduce(0, ["10.1.2.3:29500", "10.1.2.4:29500"])
    assert "insecure=True" in str(info.value)
    with pytest.raises(ConfigError, match="auth_key_file"):
        FTTreeAllreduce(0, ["worker0.example:29500", "127.0.0.2:29500"])
    FTTreeAllreduce(0, ["10.1.2.3:29500", "10.1.2.4:29500"], insecure=True)  # said plainly: allowed
    FTTreeAllreduce(0, ["10.1.2.3:29500", "10.1.2.4:29500"], auth_key_file=str(write_key(tmp_path / "k")))
    short = tmp_path / "short.key"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="holds 3 bytes"):
        FTTreeAllreduce(0, ["127.0.0.1:1", "127.0.0.2:1"], auth_key_file=str(short))


def test_membership_frames_from_a_rank_outside_the_view_change_nothing() -> None:
    """Without a key (loopback) a process can complete the handshake as a rank the job does not
    have. Its commit, minority, suspicion, "still computing", leave and passed-on join are dropped by the
    sender rules before they change anything (before: one such frame evicted a healthy rank or stopped every rank)."""
    from fttree.core.messages import Agreement, Detection, Join, Kind, Notice, State

    from .rawpeer import message_frame

    with cluster(3, timeout_s=0.3, step_timeout_s=20) as handles:
        addr = handles[0].peers[0]
        forged = [Agreement(kind=Kind.VIEW_COMMIT, src=1000, epoch=0, proposed=1, members=(0, 1), ballot=1 << 30),
                  Agreement(kind=Kind.MINORITY, src=1000, promised=(1000,), view_size=3),
                  Detection(kind=Kind.SUSPECT, src=1000, target=2, gone=True),
                  Detection(kind=Kind.COMPUTING, src=1000, step=0),  # would put off step deadlines
                  Notice(kind=Kind.LEAVE, src=1000),
                  State(kind=Kind.STATE_REQUEST, src=1000, user_step=0),
                  # passed on "for" rank 2 with a new process: taken, it would evict rank 2 as restarted
                  Join(kind=Kind.JOIN_ASK, src=1000, target=2, incarnation=7, addresses=((2, "127.0.0.9:1"),))]
        for target in handles:
            a = target.peers[target.rank]
            with connect(a.host, a.port) as sock:
                assert handshake(sock, 1000, dst=target.rank, world=2000)
                for msg in forged:
                    sock.sendall(message_frame(msg))
                sock.settimeout(1.0)
                closed_by_peer(sock)  # (the worker keeps a proven connection open: wait a moment)
        for step in range(5):
            futures = [h.allreduce_async(np.full(8, float(h.rank + step))) for h in handles]
            for h, fut in zip(handles, futures, strict=True):
                assert np.array_equal(fut.result(timeout=30), np.full(8, 3.0 + 3 * step))
                assert h.last is not None
                assert h.last.contributors == (0, 1, 2)
        for h in handles:
            assert h.node is not None
            assert h.view.members == (0, 1, 2)
            assert h.status().membership.evicted_total == 0
            assert h.node.foreign_frames >= len(forged), (h.rank, h.node.foreign_frames)
        assert addr.port > 0


def test_a_flood_of_made_up_chunks_from_a_member_makes_bounded_state() -> None:
    """A member's connection (here: a keyless handshake as rank 1) sending frames for chunks a
    step cannot have, and then for more ops than may be in flight: the first make no op, the
    second no more than max_live_ops (before: 200,000 such frames grew a worker to 493 MB and
    stalled its loop). A payload larger than max_payload_bytes is refused outright."""
    from fttree.core.messages import PREFIX, VERSION, Kind, Message
    from fttree.net.handshake import BULK

    from .rawpeer import message_frame

    with cluster(3, timeout_s=0.3, step_timeout_s=20, max_live_ops=500, max_payload_bytes=8 << 20) as handles:
        addr = handles[0].peers[0]
        before = rss_mb()
        with connect(addr.host, addr.port, source="127.0.0.2") as sock:
            assert handshake(sock, 1, channel=BULK)
            burst = b"".join(message_frame(Message(kind=Kind.META_REDUCE_SENT, src=1, step=3, chunk=c, chunks=1 << 30,
                                                   origin=1, target=0)) for c in range(20_000))
            burst += b"".join(message_frame(Message(kind=Kind.META_REDUCE_SENT, src=1, step=s, chunk=c, chunks=1000,
                                                    origin=1, target=0))
                              for s in range(1000, 1003) for c in range(1000))
            sock.sendall(burst)
            sock.sendall(PREFIX.pack(b"FT", VERSION, 16, 300 << 20) + bytes(16))
            sock.settimeout(60)  # a deadline: the worker reads the 23,000 frames before the bad prefix
            assert closed_by_peer(sock)
        assert "exceeds the limit" in handles[0].status().transport.last_frame_error
        assert handles[0].status().machine.footprint["ops"] <= 500
        for _step in range(3):
            futures = [h.allreduce_async(np.full(8, float(h.rank))) for h in handles]
            for fut in futures:
                assert np.array_equal(fut.result(timeout=30), np.full(8, 3.0))
        assert rss_mb() - before < 50


# ---- bad numbers from a member -----------------------------------------------------------------


def _steps_with_a_nan(policy: str) -> list[list[object]]:
    """Three steps on 3 ranks; rank 1's contribution to step 1 holds a NaN. Each rank's outcome
    of each step: (result, contributors) or the exception."""
    from fttree.core.protocol import NoteKind

    outcomes: list[list[object]] = [[], [], []]
    with cluster(3, timeout_s=0.3, step_timeout_s=20, nonfinite=policy) as handles:
        notes: list[object] = []
        assert handles[1].node is not None
        handles[1].node.note_listeners.append(lambda n: notes.append(n) if n.kind is NoteKind.NONFINITE else None)
        for step in range(3):
            data = [np.full(4, float(r + 1)) for r in range(3)]
            if step == 1:
                data[1][2] = np.nan
            futures = [h.allreduce_async(d) for h, d in zip(handles, data, strict=True)]
            for h, fut in zip(handles, futures, strict=True):
                try:
                    out = fut.result(timeout=30)
                    assert h.last is not None
                    outcomes[h.rank].append((out, h.last.contributors))
                except Exception as exc:
                    outcomes[h.rank].append(exc)
        outcomes.append(notes)
    return outcomes


def test_a_nan_is_left_out_by_default_and_the_result_says_so() -> None:
    *ranks, notes = _steps_with_a_nan("skip")
    for outcome in ranks:
        out, contributors = outcome[1]  # type: ignore[misc]
        assert np.array_equal(out, np.full(4, 1.0 + 3.0))  # ranks 0 and 2 only
        assert contributors == (0, 2)
        assert outcome[2][1] == (0, 1, 2)  # type: ignore[index]  # the next step has everyone again
    (note,) = notes  # type: ignore[misc]
    assert note.step == 1
    assert note.peer == 1
    assert "NaN or Inf" in note.text


def test_a_nan_aborts_the_step_everywhere_naming_the_rank_under_abort() -> None:
    *ranks, _notes = _steps_with_a_nan("abort")
    from fttree import StepAborted

    for outcome in ranks:
        assert isinstance(outcome[1], StepAborted), outcome[1]
        assert "rank 1's contribution to step 1 holds NaN or Inf" in str(outcome[1])
        assert 1 in outcome[1].peers
        assert outcome[2][1] == (0, 1, 2)  # type: ignore[index]


def test_allow_adds_a_nan_as_it_is() -> None:
    *ranks, _notes = _steps_with_a_nan("allow")
    for outcome in ranks:
        out, contributors = outcome[1]  # type: ignore[misc]
        assert np.isnan(out[2])
        assert contributors == (0, 1, 2)
