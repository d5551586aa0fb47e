"""What one member's frames can make another worker hold (core/machine_base.py, PEER_SHARE): ops
made by a peer's frames for steps this rank has not submitted count against that peer's share
of max_live_ops, so a key holder's flood of frames for chunks no step has fills its own share
and never locks the other members' frames out. Deterministic: sans-IO replicas and the
simulator, no sockets (tests/test_op_share_real.py floods a real job from another process)."""

from __future__ import annotations

import tracemalloc

import numpy as np

from fttree.core.config import Config
from fttree.core.machine_base import PEER_SHARE, UNCLAIMED_STALE_STEPS
from fttree.core.messages import Kind, Message
from fttree.core.protocol import Complete, Note, Submit
from fttree.core.replica import Arrived, Connected, FirstStart, Replica
from fttree.core.view import View
from fttree.net.node import StepResult
from fttree.testing.sim import SimNetwork

LIVE = 400  # max_live_ops here: rank 1's share is LIVE // PEER_SHARE
CHUNKS = 64  # the chunk count the flood names (rank 0's steps have one chunk)


def _replica() -> Replica:
    """Rank 0 of 3, the root of tree 0 (children 1 and 2), taking part, step 0 submitted."""
    replica = Replica(0, View.initial(3), Config(max_live_ops=LIVE))
    replica.step(FirstStart(), 0.0)
    replica.step(Connected(), 0.0)
    replica.step(Submit(step=0, data=np.zeros(4, np.float32), signature="float32[4]"), 0.0)
    return replica


def _flood(replica: Replica, steps: range) -> list[Note]:
    """Rank 1 (rank 0's child in tree 0) asks rank 0, for every chunk of tree 0 of a 64-chunk
    step, whether its result to rank 2 gets through: a frame its role allows, for chunks no
    step of rank 0's has. The notes it drew."""
    machine = replica.machine
    bogus = [c for c in range(1, CHUNKS) if machine.tree_of(c, CHUNKS) == 0]
    assert bogus
    notes: list[Note] = []
    for step in steps:
        for chunk in bogus:
            msg = Message(kind=Kind.META_BCAST_REQUEST, src=1, step=step, chunk=chunk, chunks=CHUNKS, tree=0, target=2)
            notes += [a for a in replica.step(Arrived(msg=msg), 0.0) if isinstance(a, Note)]
    return notes


def _sum_of(src: int, step: int, value: float) -> Message:
    data = np.full(4, value, np.float32)
    return Message(kind=Kind.DATA_REDUCE, src=src, step=step, chunk=0, chunks=1, tree=0, origin=src,
                   contributors=(src,), dtype="<f4", numel=4, signature="float32[4]", payload=data.data.cast("B"))


def test_a_members_flood_of_chunks_no_step_has_fills_its_share_not_the_table() -> None:
    """Rank 1 floods rank 0 with over a thousand such frames (before: each made an op that never
    completes, the table filled at max_live_ops, and rank 2's sum for step 1 was dropped, a
    lock-out). It makes its share of ops and no more, the rest are dropped and counted, one
    note says so; rank 2's sum is taken and step 1 finishes exact."""
    replica = _replica()
    machine = replica.machine
    share = LIVE // PEER_SHARE
    notes = _flood(replica, range(100, 180))
    sent = 80 * len([c for c in range(1, CHUNKS) if machine.tree_of(c, CHUNKS) == 0])
    assert sent > LIVE
    assert machine.footprint()["unclaimed"] == share
    assert machine.footprint()["ops"] == share + 1  # and step 0's own
    assert machine.ops_refused == sent - share
    refusals = [n for n in notes if "share" in n.text]
    assert len(refusals) == 1, [n.text for n in notes]
    assert "rank 1" in refusals[0].text
    assert "counted (ops_refused)" in refusals[0].text
    # rank 2's sum for step 1, which rank 0 has not reached: taken (before: max_live_ops full)
    replica.step(Arrived(msg=_sum_of(2, 1, 2.0)), 0.0)
    assert (1, 0) in machine._ops
    assert 2 in machine._ops[(1, 0)].reduce.held
    out = replica.step(Submit(step=1, data=np.zeros(4, np.float32), signature="float32[4]"), 0.0)
    out += replica.step(Arrived(msg=_sum_of(1, 1, 1.0)), 0.0)
    done = [a for a in out if isinstance(a, Complete)]
    assert len(done) == 1
    assert np.array_equal(done[0].result, np.full(4, 3.0, np.float32))
    assert done[0].contributors == (0, 1, 2)
    assert machine.footprint()["unclaimed"] == share  # rank 2's op became rank 0's own at its submit


def test_a_members_flood_holds_its_share_in_bytes() -> None:
    """10,500 flood frames at max_live_ops=4,000: rank 0's memory grows by what its share of
    1,000 ops holds (printed per op; at most 5 KB each), not by a table of 4,000."""
    replica = Replica(0, View.initial(3), Config(max_live_ops=4000))
    replica.step(FirstStart(), 0.0)
    replica.step(Connected(), 0.0)
    replica.step(Submit(step=0, data=np.zeros(4, np.float32), signature="float32[4]"), 0.0)
    machine = replica.machine
    bogus = [c for c in range(1, CHUNKS) if machine.tree_of(c, CHUNKS) == 0]
    flood = [Message(kind=Kind.META_BCAST_REQUEST, src=1, step=step, chunk=chunk, chunks=CHUNKS, tree=0, target=2)
             for step in range(100, 600) for chunk in bogus]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for msg in flood:
            replica.step(Arrived(msg=msg), 0.0)
        grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    share = 4000 // PEER_SHARE
    print(f"{len(flood)} frames: {machine.footprint()['unclaimed']} ops made, {grown / 1e6:.2f} MB held, "
          f"{grown / share:.0f} bytes an op")
    assert machine.footprint()["unclaimed"] == share
    assert grown <= share * 5000, grown


def test_a_full_share_lets_go_of_ops_for_steps_long_past() -> None:
    """Once rank 0 has submitted steps UNCLAIMED_STALE_STEPS past some of the flood's (a late
    rank is closed at most CLOSE_AHEAD_STEPS ahead), the ops rank 1 made for those will never
    run: its next frame finds its share full, they are let go of and counted, and the frame is
    taken. The ops of the flood's newest step are kept (a late rank's chunks may still come)."""
    replica = _replica()
    machine = replica.machine
    share = LIVE // PEER_SHARE
    _flood(replica, range(1, 60))
    assert machine.footprint()["unclaimed"] == share
    last = max(op.step for op in machine._ops.values() if op.maker == 1)  # the share fills steps 1 to `last`
    kept = sum(op.maker == 1 and op.step == last for op in machine._ops.values())
    refused = machine.ops_refused
    newest = last + UNCLAIMED_STALE_STEPS
    for step in range(1, newest + 1):
        replica.step(Submit(step=step, data=np.zeros(4, np.float32), signature="float32[4]"), 1.0)
    assert machine.ops_refused == refused  # rank 0's own submits take no share
    notes = _flood(replica, range(newest + 1, newest + 2))  # a step rank 0 has not reached
    assert machine.ops_reclaimed == share - kept
    assert sum(op.maker == 1 and op.step == last for op in machine._ops.values()) == kept
    assert all(op.maker < 0 or op.step in (last, newest + 1) for op in machine._ops.values())
    per_step = len([c for c in range(1, CHUNKS) if machine.tree_of(c, CHUNKS) == 0])
    assert machine.footprint()["unclaimed"] == kept + per_step  # the new step's frames found room
    assert machine.ops_refused == refused
    assert not notes


def test_frames_cutting_a_step_this_rank_submitted_otherwise_make_no_op() -> None:
    """Rank 0 has submitted steps 1 to 10, each one chunk: rank 1's frames naming 64-chunk cuts
    of them are dropped before they make an op or spend its share, counted, and noted once
    (the chunk rule is the same on every worker, so an honest frame never names another cut);
    rank 2's sum for step 1 is taken as before."""
    replica = _replica()
    machine = replica.machine
    for step in range(1, 11):
        replica.step(Submit(step=step, data=np.zeros(4, np.float32), signature="float32[4]"), 0.0)
    ops = machine.footprint()["ops"]
    notes = _flood(replica, range(1, 11))
    assert machine.footprint()["ops"] == ops
    assert machine.footprint()["unclaimed"] == 0
    assert machine.ops_refused == 10 * len([c for c in range(1, CHUNKS) if machine.tree_of(c, CHUNKS) == 0])
    assert [n.text for n in notes if "cut into 1 chunks" in n.text] == [n.text for n in notes]
    assert len(notes) == 1
    replica.step(Arrived(msg=_sum_of(2, 1, 2.0)), 0.0)
    assert 2 in machine._ops[(1, 0)].reduce.held


def test_peers_running_steps_ahead_have_nothing_refused() -> None:
    """Rank 0 (the root of every chunk) starts 8 steps of 25 chunks 50 ms after its children
    submitted them, with max_live_ops at 1,000: the children's frames make 200 ops here before
    rank 0 submits, inside its share of 250. Nothing is refused and every step is exact."""
    net = SimNetwork(3, step_timeout_s=60, wire=False, trees="single", chunk_bytes=8, max_live_ops=1000)
    steps = 8
    data = {(r, s): np.arange(50, dtype=np.float32) + r + 10 * s for r in range(3) for s in range(steps)}
    for s in range(steps):
        for r in (1, 2):
            net.submit(r, s, data[(r, s)])
    net.run(until=net.now + 0.05)
    made = net.nodes[0].machine._made  # the first frame of an op makes it: a child's sum or a brother's word
    assert sum(made.values()) == steps * 25, made
    assert set(made) <= {1, 2}, made
    for s in range(steps):
        net.submit(0, s, data[(0, s)])
    for s in range(steps):
        net.run_until_finished(s)
    for s in range(steps):
        want = data[(0, s)] + data[(1, s)] + data[(2, s)]
        for r in range(3):
            res = net.outcome(r, s)
            assert isinstance(res, StepResult), res
            assert res.contributors == (0, 1, 2)
            assert np.array_equal(res.data, want)
    for node in net.nodes:
        assert node.machine.ops_refused == 0
        assert node.machine.footprint()["unclaimed"] == 0
