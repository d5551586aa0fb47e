"""Frames of a view not installed here yet (its commit is on its way) are held until it is:
what one member can make another worker hold that way. A rank's frames take at most a
PEER_SHARE of the max_ops_ahead slots (before: one deque for all, whose flood pushed the other
members' frames out), and data frames count against the replica's early bytes (before: any
size, 4,096 of them). Deterministic: sans-IO replicas, no sockets."""

from __future__ import annotations

import numpy as np

from fttree.core.config import Config
from fttree.core.machine_base import PEER_SHARE
from fttree.core.messages import Kind, Message
from fttree.core.protocol import Note, Submit
from fttree.core.replica import Arrived, Connected, FirstStart, Replica
from fttree.core.view import View

AHEAD = 64  # max_ops_ahead here: a rank's share of later-view frames is AHEAD // PEER_SHARE


def _replica(cfg: Config) -> Replica:
    """Rank 0 of 3 in view 0, taking part, step 0 submitted."""
    replica = Replica(0, View.initial(3), cfg)
    replica.step(FirstStart(), 0.0)
    replica.step(Connected(), 0.0)
    replica.step(Submit(step=0, data=np.zeros(4, np.float32), signature="float32[4]"), 0.0)
    return replica


def _ask(src: int, step: int) -> Message:
    """A header-only frame of view 1, which rank 0 has not installed."""
    return Message(kind=Kind.META_BCAST_REQUEST, src=src, epoch=1, step=step, chunk=0, chunks=1, tree=0, target=2)


def _notes(out: list[object]) -> list[Note]:
    return [a for a in out if isinstance(a, Note)]


def test_one_members_flood_of_later_view_frames_takes_its_share_and_pushes_nobody_out() -> None:
    replica = _replica(Config(max_ops_ahead=AHEAD))
    machine = replica.machine
    honest = _ask(2, 1)
    replica.step(Arrived(msg=honest), 0.0)
    notes: list[Note] = []
    for step in range(1, 1 + 3 * AHEAD):
        notes += _notes(replica.step(Arrived(msg=_ask(1, step)), 0.0))
    held = list(machine._later)
    share = AHEAD // PEER_SHARE
    assert honest in held  # before: the flood's newest pushed it out of a deque of AHEAD
    assert sum(1 for m in held if m.src == 1) == share
    assert machine.ops_refused == 3 * AHEAD - share
    later = [n for n in notes if "later views" in n.text]
    assert len(later) == 1, [n.text for n in notes]
    assert "rank 1" in later[0].text
    assert "counted (ops_refused)" in later[0].text


def test_later_view_data_counts_against_the_early_bytes() -> None:
    """Big data frames of view 1 (a broadcast result, not a subtree sum: before, only those were
    counted) are held up to the replica's early limit, the rest dropped and counted; a frame
    for a step beyond max_ops_ahead is dropped at once (the tree would drop it on replay)."""
    replica = _replica(Config())
    limit = replica.early_limit()
    size = 2 << 20
    payload = np.zeros(size // 4, np.float32)  # one buffer for every frame: the test holds 2 MiB
    frames = limit // size + 10
    notes: list[Note] = []
    for step in range(1, 1 + frames):
        msg = Message(kind=Kind.DATA_BCAST, src=1, epoch=1, step=step, chunk=0, chunks=1, tree=0,
                      contributors=(0, 1, 2), dtype="<f4", numel=payload.size, signature=f"float32[{payload.size}]",
                      payload=payload.data.cast("B"))
        notes += _notes(replica.step(Arrived(msg=msg), 0.0))
    assert replica.early_bytes <= limit
    assert replica.early_dropped == 10
    assert replica.early_dropped_bytes == 10 * size
    assert len(replica.machine._later) == frames - 10
    dropped = [n for n in notes if "not installed here" in n.text]
    assert len(dropped) == 1, [n.text for n in notes]
    far = Message(kind=Kind.DATA_BCAST, src=2, epoch=1, step=replica.cfg.max_ops_ahead + 5, chunk=0, chunks=1,
                  tree=0, contributors=(0, 1, 2), dtype="<f4", numel=1, signature="float32[1]",
                  payload=np.zeros(1, np.float32).data.cast("B"))
    replica.step(Arrived(msg=far), 0.0)
    assert replica.early_dropped == 11
    assert far not in replica.machine._later
