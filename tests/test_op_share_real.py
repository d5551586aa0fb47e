"""A key holder's flood of step frames for chunks no step has, from a process of its own
(tests/op_flooder.py), against a real 3-worker job on loopback: the worker it floods makes its
share of ops for them and no more (core/machine_base.py, PEER_SHARE), drops and counts the
rest, logs the reason once, and every step of the job stays exact (docs/security.md)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import pytest

from fttree import FTTreeAllreduce
from fttree.core.effects import Note
from fttree.core.machine_base import PEER_SHARE
from fttree.net.credentials import write_key
from fttree.net.node_status import NodeStatus

from .conftest import cluster, exact_steps

T = TypeVar("T")
FLOODER = Path(__file__).resolve().parent / "op_flooder.py"
LIVE = 1000  # max_live_ops: the flooder's share is LIVE // PEER_SHARE
FLOOD_STEPS = 200  # a flood's steps, of 21 made-up chunks each (those of a 64-chunk step on tree 0)


def on_loop(handle: FTTreeAllreduce, read: Callable[[], T]) -> T:
    """`read()` run on the handle's event loop, where its node's state changes (a deadline)."""
    loop = handle._loop
    assert loop is not None
    done: Future[T] = Future()
    loop.call_soon_threadsafe(lambda: done.set_result(read()))
    return done.result(timeout=30)


def test_a_key_holders_flood_of_chunks_no_step_has_locks_no_member_out(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The flooder proves the key as rank 1 and sends rank 0 4,200 frames that rank 1's role
    allows, each for an op no step will have, while the job is idle, then 4,200 more while it
    trains (before: they filled max_live_ops, and from then on every frame that would make an op
    was dropped, a real step's too). Rank 0 makes its share of ops for them and no more, counts
    the rest in its status (`ops_refused`), drops no frame as "ops in flight already", and logs
    the reason once; every step is exact throughout and after. (With a key alone the flooder is
    rank 1 to the worker: the share it spends is rank 1's, so rank 1's own frames that would
    make an op before rank 0 reaches their step are refused too, and the backups bring them.)"""
    caplog.set_level(logging.INFO, logger="fttree.net.node")
    key = write_key(tmp_path / "job.key")
    share = LIVE // PEER_SHARE
    with cluster(3, auth_key_file=str(key), timeout_s=0.3, step_timeout_s=20, max_live_ops=LIVE) as handles:
        exact_steps(handles, 3)
        victim = handles[0].node
        assert victim is not None
        notes: list[Note] = []
        victim.note_listeners.append(notes.append)
        flooder = subprocess.Popen([sys.executable, str(FLOODER), "--target", str(handles[0].peers[0]), "--key-file",
                                    str(key)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        assert flooder.stdin is not None
        assert flooder.stdout is not None

        def read_through(floods: int, step: bool) -> NodeStatus:
            """Rank 0's status once it has handled `floods` floods (each ends in a foreign frame),
            running steps meanwhile if `step`; the most ops it held on the way."""
            deadline = time.monotonic() + 120  # what it waits for: rank 0 to have read every frame
            while on_loop(handles[0], lambda: victim.foreign_frames) < floods:
                assert time.monotonic() < deadline, f"rank 0 read {floods} floods' frames"
                if step:
                    exact_steps(handles, 1)
                    peaks.append(on_loop(handles[0], victim.status).machine.footprint)
                else:
                    time.sleep(0.05)
            return on_loop(handles[0], victim.status)

        peaks: list[dict[str, int]] = []
        try:
            # 1. while the job is idle: the flood makes exactly its share of ops
            flooder.stdin.write(f"100 {FLOOD_STEPS}\n")
            flooder.stdin.flush()
            sent = json.loads(flooder.stdout.readline())["sent"]
            assert sent > LIVE
            idle = read_through(1, step=False)
            # 2. while the job trains: as many again, for steps 300 to 499
            flooder.stdin.write(f"300 {FLOOD_STEPS}\n")
            flooder.stdin.flush()
            busy = read_through(2, step=True)
            total = json.loads(flooder.stdout.readline())["sent"]
            exact_steps(handles, 3)
            after = on_loop(handles[0], victim.status)
        finally:
            flooder.communicate(input="", timeout=30)
        assert flooder.returncode == 0, flooder.stderr
    most = {name: max(p[name] for p in [*peaks, after.machine.footprint]) for name in ("ops", "unclaimed")}
    print(f"{total} frames: rank 0 refused {after.ops_refused}, held at most {most['ops']} ops, "
          f"{most['unclaimed']} of them made by peers' frames (share {share}, max_live_ops {LIVE})")
    assert idle.ops_refused == sent - share
    assert idle.machine.footprint["unclaimed"] == share
    assert busy.ops_refused >= total - share
    assert after.machine.footprint["unclaimed"] == share  # the real steps' ops were all taken
    assert most["unclaimed"] <= share + 4, most  # and a real step's few, made by rank 2's frames
    assert not [n.text for n in notes if "max_live_ops)" in n.text]  # no frame met a full table
    logged = [r.getMessage() for r in caplog.records if "share of max_live_ops" in r.getMessage()]
    assert len(logged) == 1, logged
    assert "rank 1" in logged[0]
