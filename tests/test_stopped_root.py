"""A root stopped (SIGSTOP) after it submitted a step, evicted while it was stopped, then
resumed: the group re-ran the step without it, and the root must not hand its caller a result
that holds every rank (the old view's op, completed from the frames that waited for it), or
the results disagree. Found by an hour of chaos (a stop of rank 6 at 1,940 s: "wrong
contributors: step 19714 has contributors [0..5] on rank 0 but [0..6] on rank 6"); the
simulator shows it deterministically. The rank notices its check timer came late, keeps its
results back and asks its neighbours (fttree/core/self_check.py): they answer from the view
that left it out, and it stops with GroupLeft instead."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fttree import FTTreeAllreduce, StepResult
from fttree.errors import GroupLeft
from fttree.testing.sim import SimNetwork

from .conftest import local_peers, start_all

WORLD = 7
FROZEN_ROOT = Path(__file__).with_name("frozen_root.py")


def step_one_submitted(net: SimNetwork) -> list[np.ndarray]:
    """Step 0 run by all; step 1 submitted by all (not run yet). Each rank's contribution."""
    data = [np.full(16, float(r + 1), np.float32) for r in range(WORLD)]
    net.submit_all(0, data)
    net.run_until_finished(0)
    for r in range(WORLD):
        net.submit(r, 1, data[r])
    return data


def test_a_root_evicted_while_stopped_hands_its_caller_no_result_the_group_does_not_hold() -> None:
    net = SimNetwork(WORLD, seed=7)
    root = 0  # tree 0's root: a one-chunk step's
    step_one_submitted(net)
    net.hang(root)
    others = [r for r in range(WORLD) if r != root]
    net.run_until_finished(1, limit_s=60, ranks=others)
    group = net.outcome(others[0], 1)
    assert isinstance(group, StepResult)
    assert root not in group.contributors  # the group evicted the root and re-ran the step
    net.resume(root)
    net.run(until=net.now + 30)
    out = net.outcome(root, 1)
    assert isinstance(out, GroupLeft), out  # not the old view's sum of all seven
    member = net.nodes[root].membership.status()
    assert (member.self_checks, member.self_check_stops) == (1, 0)  # the neighbours told it the decision
    assert member.state.value == "evicted"


def test_a_root_stopped_for_less_than_the_group_waits_confirms_and_hands_out_the_groups_sum() -> None:
    """A freeze the group does not act on (0.9 s against a node deadline of 1 s): the root doubts,
    a neighbour confirms, and its result (of all seven) goes out, the same as everyone's."""
    net = SimNetwork(WORLD, seed=3)
    root = 0
    data = step_one_submitted(net)
    net.hang(root)
    net.at(net.now + 0.9, lambda: net.resume(root))
    net.run_until_finished(1, limit_s=30)
    outcomes = [net.outcome(r, 1) for r in range(WORLD)]
    assert all(isinstance(o, StepResult) and o.contributors == tuple(range(WORLD)) for o in outcomes), outcomes
    assert all(np.array_equal(o.data, sum(data)) for o in outcomes if isinstance(o, StepResult))
    member = net.nodes[root].membership.status()
    assert (member.self_checks, member.self_check_stops) == (1, 0)
    assert all(net.nodes[r].view.epoch == 0 for r in range(WORLD))  # nobody was evicted


@pytest.mark.parametrize("seed", range(6))
def test_whichever_rank_stops_right_after_submitting_no_two_results_of_a_step_differ(seed: int) -> None:
    """Each rank in turn (the root of tree 0, interior ranks, leaves), stopped at a few moments
    after submitting and resumed once the others finished the step: it holds the group's
    result or none."""
    victim = seed % WORLD
    for delay in (0.0, 0.001, 0.003, 0.01):
        net = SimNetwork(WORLD, seed=seed)
        step_one_submitted(net)
        net.at(net.now + delay, functools.partial(net.hang, victim))
        others = [r for r in range(WORLD) if r != victim]
        net.run_until_finished(1, limit_s=60, ranks=others)
        group = net.outcome(others[0], 1)
        assert isinstance(group, StepResult)
        net.resume(victim)
        net.run(until=net.now + 30)
        out = net.outcome(victim, 1)
        assert isinstance(out, GroupLeft) or (isinstance(out, StepResult) and out.contributors == group.contributors
                                              and np.array_equal(out.data, group.data)), (delay, out)


def test_a_real_root_stopped_with_a_step_in_flight_and_evicted_gets_group_left(tmp_path: Path) -> None:
    """The same with processes over TCP: rank 0 (tree 0's root) in a process of its own submits
    step 1 and is stopped (SIGSTOP) before the others submit theirs; they evict it and run the
    step without it; it is continued and must hand its caller GroupLeft, not the sum of three."""
    peers = local_peers(3)
    root = subprocess.Popen([sys.executable, str(FROZEN_ROOT), "--peers", ",".join(peers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = False
    handles = [FTTreeAllreduce(r, peers, timeout_policy="static", timeout_s=0.3, step_timeout_s=30) for r in (1, 2)]
    try:
        errors = start_all(handles, limit_s=60)
        assert not errors, errors
        for fut in [h.allreduce_async(np.full(16, h.rank + 1.0, np.float32)) for h in handles]:
            assert np.array_equal(fut.result(timeout=60), np.full(16, 6.0, np.float32))
        assert root.stdout is not None
        assert root.stdout.readline().strip() == "submitted"
        os.kill(root.pid, signal.SIGSTOP)
        stopped = True
        futures = [h.allreduce_async(np.full(16, h.rank + 1.0, np.float32)) for h in handles]
        for h, fut in zip(handles, futures, strict=True):
            assert np.array_equal(fut.result(timeout=60), np.full(16, 5.0, np.float32))
            assert h.last is not None
            assert h.last.contributors == (1, 2)
        os.kill(root.pid, signal.SIGCONT)
        stopped = False
        out, err = root.communicate(timeout=60)
        outcome = json.loads(out.strip().splitlines()[-1])
        assert outcome["error"] == "GroupLeft", (outcome, err[-2000:])
        assert outcome["state"] == "evicted"
    finally:
        for h in handles:
            h.close()
        if stopped:
            os.kill(root.pid, signal.SIGCONT)
        if root.poll() is None:
            root.kill()
            root.wait(timeout=10)


def test_a_self_check_asks_the_tree_neighbours_that_may_answer_and_none_is_needed_alone() -> None:
    """The neighbours asked are the tree's, less those that finished their job (closed, they
    would never answer); with nobody to ask (a group of one) the rank is confirmed at once."""
    from fttree.core.member_events import Confirmed, Doubted
    from fttree.core.membership import Membership
    from fttree.core.view import View

    alone = Membership(0, View.initial(1))
    alone.detection.check_due = 8.5  # 1.5 s late at 10.0
    assert [type(a) for a in alone.froze(now=10.0)] == [Confirmed]
    assert not alone.doubting
    seven = Membership(0, View.initial(WORLD))
    neighbours = set(seven.detection.neighbours()) - {0}
    finished = min(neighbours)
    seven.joins.done[finished] = 5
    seven.detection.check_due = 8.5
    out = seven.froze(now=10.0)
    (doubted,) = [a for a in out if isinstance(a, Doubted)]
    assert set(doubted.asked) == neighbours - {finished}
    assert doubted.frozen_s == 1.5  # how late the check timer was
    assert seven.doubting
    assert seven.status().self_checks == 1
