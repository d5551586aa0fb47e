"""ElasticSampler: exactly once over an epoch whatever workers die, restart or join, with
prefetching loaders; minimal movement, balance and spread; stable mode; bad input."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fttree import ConfigError
from fttree.training.sampler import (
    CollateOrNone,
    ElasticSampler,
    EpochHistory,
    MoveEvent,
    loader_horizon,
)

ROOT = Path(__file__).resolve().parents[1]
Event = tuple[int, str, int]  # (step, kind, who)


class Cluster:
    """Ranks that each own a sampler, as separate processes would, and a loader that asks for
    batches up to `horizon` steps ahead of the commits. Checks the guarantees at every step."""

    def __init__(self, n: int, size: int, batch: int, *, horizon: int, seed: int = 0, stable: bool = False) -> None:
        self.size, self.batch, self.horizon = size, batch, horizon
        self.samplers: dict[int, ElasticSampler] = {}
        self.iters: dict[int, Iterator[list[int]]] = {}
        self.handed: dict[int, dict[int, list[int]]] = {}  # rank -> step -> batch its loader got
        self.asked: dict[int, int] = {}  # rank -> next step its loader asks for
        self.ended: set[int] = set()
        self.delivered: dict[int, list[int]] = {}  # rank -> samples of its contributed batches
        self.dead: list[int] = []
        self.next_rank = n
        self.step = 0
        self.events: list[MoveEvent] = []
        for r in range(n):
            self._add(r, ElasticSampler(size, batch, rank=r, members=range(n), seed=seed, stable=stable,
                                        horizon=horizon))

    def _add(self, rank: int, sampler: ElasticSampler) -> None:
        self.samplers[rank], self.iters[rank] = sampler, iter(sampler)
        self.handed[rank] = {}  # a restarted rank's loader starts afresh
        self.asked[rank] = sampler.next_step
        self.ended.discard(rank)

    @property
    def view(self) -> ElasticSampler:
        return self.samplers[min(self.samplers)]

    def prefetch(self) -> None:
        for r, it in self.iters.items():
            while r not in self.ended and self.asked[r] <= self.step + self.horizon:
                try:
                    self.handed[r][self.asked[r]] = next(it)
                    self.asked[r] += 1
                except StopIteration:
                    self.ended.add(r)

    def done(self) -> bool:
        self.prefetch()
        finished = {r for r in self.samplers if self.step not in self.handed[r]}
        assert finished in (set(), set(self.samplers)), f"ranks {sorted(finished)} ended early at {self.step}"
        return bool(finished)

    def run_step(self, die: Collection[int] = (), lose: Collection[int] = (), join: Collection[int] = ()) -> None:
        die = set(die)
        t, alive = self.step, sorted(self.samplers)
        contributors = [r for r in alive if r not in die and r not in lose]
        nxt = sorted((set(alive) - die) | set(join))
        pending = {r: self.view.pending(r) for r in alive}
        loads = self.view.stats().loads
        for r in contributors:
            self.delivered.setdefault(r, []).extend(self.handed[r][t])
        outcomes = [self.samplers[r].commit(t, contributors, nxt) for r in alive if r not in die]
        assert all(o == outcomes[0] for o in outcomes)  # every member computed the same move
        for r in die:
            del self.samplers[r], self.iters[r]
            self.dead.append(r)
        history = EpochHistory.from_dict(json.loads(json.dumps(self.view.history().to_dict())))
        for j in join:
            self._add(j, ElasticSampler.from_history(history, rank=j))
        self.step += 1
        self._check_handed_batches_stand(alive, die)
        if outcomes and outcomes[0] is not None:
            self._check_move(outcomes[0], pending, loads, t)

    def _check_handed_batches_stand(self, alive: list[int], die: set[int]) -> None:
        for r in alive:
            if r not in die:
                for s, b in self.handed[r].items():
                    if s >= self.step:
                        assert self.samplers[r].batch(s) == b, (r, s)

    def _check_move(self, ev: MoveEvent, pending: dict[int, np.ndarray], loads: dict[int, int], t: int) -> None:
        self.events.append(ev)
        assert ev.step == t
        survivors = [r for r in pending if r not in ev.departed]
        for r in survivors:
            before = pending[r][len(self.view.batch(t, r)):]
            after = self.view.pending(r)
            if not ev.joined:  # a departure moves nothing of a survivor's own queue
                assert np.array_equal(after[:len(before)], before)
            else:  # joiners take only from the tail, and what left went to a joiner
                kept = np.isin(before, after)
                assert np.array_equal(after[:kept.sum()], before[kept])
                gone = before[~kept]
                assert np.isin(gone, np.concatenate([self.view.pending(j) for j in ev.joined])).all()
        if not ev.joined and set(ev.failed) <= set(ev.departed) and survivors:
            left = {r: loads[r] - len(self.view.batch(t, r)) for r in survivors}
            level = math.ceil((sum(left.values()) + ev.pool) / len(survivors))
            assert max(ev.loads.values()) <= max(max(left.values()), level)  # balance never worsens

    def run(self, events: list[Event]) -> None:
        by_step: dict[int, list[tuple[str, int]]] = {}
        for step, kind, who in events:
            by_step.setdefault(step, []).append((kind, who))
        while not self.done():
            die: set[int] = set()
            lose: set[int] = set()
            join: list[int] = []
            for kind, who in by_step.get(self.step, []):
                live = [r for r in sorted(self.samplers) if r not in die]
                if kind == "die" and len(live) > 1:
                    die.add(live[who % len(live)])
                elif kind == "lose":
                    lose.add(live[who % len(live)])
                elif kind == "join":
                    join.append(self.next_rank)
                    self.next_rank += 1
                elif kind == "restart" and self.dead:
                    join.append(self.dead.pop(who % len(self.dead)))
            self.run_step(die, lose, join)
            assert self.step < 10_000

    def check_exactly_once(self) -> None:
        everything = [i for batch in self.delivered.values() for i in batch]
        assert sorted(everything) == list(range(self.size))
        for r, got in self.delivered.items():  # committed() is the audit of what was delivered
            assert self.view.committed(r).tolist() == got
        assert self.view.finished
        stats = [s.stats() for s in self.samplers.values()]
        assert all(s.loads == stats[0].loads and s.steps == stats[0].steps for s in stats)
        assert stats[0].committed == self.size


events_st = st.lists(st.tuples(st.integers(0, 25), st.sampled_from(["die", "lose", "join", "restart"]),
                               st.integers(0, 99)), max_size=8)


@given(size=st.integers(1, 240), batch=st.integers(1, 12), horizon=st.sampled_from([0, 1, 3]),
       stable=st.booleans(), seed=st.integers(0, 3), events=events_st)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_sample_is_committed_once_whatever_dies_restarts_or_joins(size: int, batch: int, horizon: int,
                                                                        stable: bool, seed: int,
                                                                        events: list[Event]) -> None:
    cluster = Cluster(7, size, batch, horizon=horizon, seed=seed, stable=stable)
    cluster.run(events)
    cluster.check_exactly_once()


def test_a_scripted_history_with_every_kind_of_change() -> None:
    """A fixed history that hypothesis may or may not reach: deaths with prefetched batches in
    flight, a restart, a join, a lost contribution, a death and a join in one commit."""
    cluster = Cluster(7, 500, 8, horizon=3)
    cluster.run([(2, "die", 3), (2, "die", 4), (4, "lose", 1), (5, "restart", 0), (6, "join", 0),
                 (7, "die", 0), (7, "join", 0)])
    cluster.check_exactly_once()
    kinds = [(bool(e.departed), bool(e.joined), bool(set(e.failed) - set(e.departed))) for e in cluster.events]
    assert (True, False, False) in kinds  # deaths
    assert (False, True, False) in kinds  # a join
    assert (False, False, True) in kinds  # a lost contribution
    assert (True, True, False) in kinds  # both at once


def test_every_member_stops_after_the_same_trailing_empty_steps() -> None:
    cluster = Cluster(7, 20, 2, horizon=2)  # loads of 2 or 3: one or two batches, then empty steps
    cluster.run([])
    cluster.check_exactly_once()
    steps = {r: len(h) for r, h in cluster.handed.items()}
    assert set(steps.values()) == {2 + 2}  # two batches (some empty), then horizon empty steps
    assert all(h[2] == h[3] == [] for h in cluster.handed.values())
    assert any(h[1] == [] for h in cluster.handed.values())  # lighter ranks take part with nothing
    assert len(cluster.view) == 4


def test_a_departure_moves_only_its_share_balanced_and_spread() -> None:
    n, size = 7, 7000
    cluster = Cluster(n, size, 10, horizon=4)
    for _ in range(30):
        cluster.prefetch()
        cluster.run_step()
    cluster.prefetch()
    cluster.run_step(die={3})
    ev = cluster.events[-1]
    assert ev.moved == ev.pool  # exactly the departed rank's samples
    assert ev.moved_fraction <= 1.35 * ev.ideal_fraction
    assert ev.balance <= 1.05
    assert set(ev.received) == {0, 1, 2, 4, 5, 6}  # spread over every survivor
    assert max(ev.received.values()) - min(ev.received.values()) <= 1
    cluster.prefetch()
    cluster.run_step(join=[7])
    ev = cluster.events[-1]
    assert ev.moved == ev.received[7]  # only what the joiner takes
    assert ev.moved_fraction <= 1.35 * ev.ideal_fraction
    assert ev.balance <= 1.05
    cluster.run([])
    cluster.check_exactly_once()


def test_stable_mode_keeps_each_sample_on_its_worker_across_epochs() -> None:
    s = ElasticSampler(3000, 10, rank=0, members=range(7), stable=True)
    first = {r: s.pending(r) for r in range(7)}
    s.set_epoch(1)
    for r in range(7):
        again = s.pending(r)
        assert np.array_equal(np.sort(again), np.sort(first[r]))
        assert not np.array_equal(again, first[r])  # a fresh order within the worker
    shuffled = ElasticSampler(3000, 10, rank=0, members=range(7))
    before = np.sort(shuffled.pending(0))
    shuffled.set_epoch(1)
    assert not np.array_equal(np.sort(shuffled.pending(0)), before)  # without stable mode samples move


def test_stable_mode_gives_a_restarted_rank_its_samples_back() -> None:
    s = ElasticSampler(6000, 10, rank=0, members=range(7), stable=True)
    home = np.sort(s.pending(3))
    for step in range(10):
        s.commit(step, range(7))
    s.commit(10, [0, 1, 2, 4, 5, 6], [0, 1, 2, 4, 5, 6])  # 3 dies
    for step in range(11, 20):
        s.commit(step, s.members)
    s.commit(20, s.members, range(7))  # 3 restarts mid-epoch: it takes a fair share of what is left...
    back = s.pending(3)
    assert np.isin(back, home).mean() >= 0.8  # ...mostly its own samples
    s.set_epoch(1, range(7))  # and from the next epoch on exactly its own
    assert np.array_equal(np.sort(s.pending(3)), home)


def test_a_joiner_computes_the_same_assignment_from_the_history() -> None:
    s = ElasticSampler(900, 7, rank=0, members=range(5), horizon=2)
    for step in range(4):
        s.commit(step, range(5))
    s.commit(4, [0, 1, 3, 4], [0, 1, 3, 4])
    s.commit(5, [0, 1, 3, 4], [0, 1, 3, 4, 8])
    s.commit(6, [0, 1, 3, 4, 8])
    joiner = ElasticSampler.from_history(s.history(), rank=8)
    assert joiner.next_step == 7
    for r in (0, 1, 3, 4, 8):
        assert np.array_equal(joiner.pending(r), s.pending(r))
    assert next(iter(joiner)) == s.batch(7, 8)
    assert len(s.history().commits) == 2  # only the commits that changed something travel


_SAMPLER_DIGEST = """
import hashlib, numpy as np
from fttree.training.sampler import ElasticSampler
s = ElasticSampler(5000, 16, rank=0, members=range(7), seed=3, epoch=2, horizon=2)
for step in range(5):
    s.commit(step, range(7))
s.commit(5, [0, 1, 2, 3, 5, 6], [0, 1, 2, 3, 5, 6, 9])
print(hashlib.blake2b(b"".join(s.pending(r).tobytes() for r in (0, 1, 2, 3, 5, 6, 9))).hexdigest())
"""


def test_every_process_computes_the_same_queues() -> None:
    outs = set()
    for hashseed in ("3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
        outs.add(subprocess.run([sys.executable, "-c", _SAMPLER_DIGEST], env=env, capture_output=True, text=True,
                                check=True, timeout=60).stdout.strip())
    assert len(outs) == 1


def test_the_dataloader_path_with_worker_processes_and_prefetching() -> None:
    """Seven ranks, each with a real DataLoader (2 worker processes, prefetch 2): one dies
    mid-epoch with batches in flight, it restarts, a new rank joins, one contribution is
    lost. The samples in the batches the loaders delivered to contributors are the dataset,
    once each; empty batches arrive as None."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    size, batch, workers, prefetch = 150, 4, 2, 2
    horizon = loader_horizon(workers, prefetch)
    dataset = TensorDataset(torch.arange(size))

    def loader(sampler: ElasticSampler) -> Iterator[object]:
        return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=workers, prefetch_factor=prefetch,
                               collate_fn=CollateOrNone()))

    samplers = {r: ElasticSampler(size, batch, rank=r, members=range(7), seed=1, horizon=horizon) for r in range(7)}
    loaders = {r: loader(s) for r, s in samplers.items()}
    script = {3: ("die", 2), 5: ("restart", 2), 6: ("join", 7), 8: ("lose", 4)}
    seen: list[int] = []
    empties, step = 0, 0
    while True:
        got = {}
        for r, it in loaders.items():
            with contextlib.suppress(StopIteration):
                got[r] = next(it)
        if not got:
            break
        assert set(got) == set(loaders), f"only {sorted(got)} had a batch at step {step}"
        kind, who = script.get(step, ("", -1))
        alive = sorted(loaders)
        die = {who} if kind == "die" else set()
        contributors = [r for r in alive if r not in die and not (kind == "lose" and r == who)]
        nxt = sorted((set(alive) - die) | ({who} if kind in ("restart", "join") else set()))
        for r in contributors:
            if got[r] is None:
                empties += 1
            else:
                (x,) = got[r]  # type: ignore[misc]
                seen.extend(x.tolist())
        for r in alive:
            if r not in die:
                samplers[r].commit(step, contributors, nxt)
        for r in die:
            del loaders[r], samplers[r]
        if kind in ("restart", "join"):
            samplers[who] = ElasticSampler.from_history(samplers[0].history(), rank=who)
            loaders[who] = loader(samplers[who])
        step += 1
    assert sorted(seen) == list(range(size))
    assert empties >= horizon * len(samplers)  # the trailing steps of the epoch are empty for all
    assert all(s.finished for s in samplers.values())
    assert {tuple(s.stats().loads.items()) for s in samplers.values()} == {tuple(samplers[0].stats().loads.items())}


def test_a_loader_running_ahead_of_the_horizon_is_told_so() -> None:
    s = ElasticSampler(100, 5, rank=0, members=range(2), horizon=1)
    it = iter(s)
    next(it)
    next(it)  # step 1 may be fetched before step 0 commits
    with pytest.raises(ConfigError, match="horizon=1"):
        next(it)


def test_len_is_the_number_of_batches_when_nothing_changes() -> None:
    s = ElasticSampler(1001, 10, rank=2, members=range(7), horizon=3)
    n = len(s)
    batches = []
    for step, b in enumerate(s):
        batches.append(b)
        s.commit(step, range(7))
    assert len(batches) == n == math.ceil(math.ceil(1001 / 7) / 10) + 3
    assert batches[-3:] == [[], [], []]


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: ElasticSampler(10, 0, rank=0, members=[0]), "batch_size must be at least 1"),
    (lambda: ElasticSampler(0, 1, rank=0, members=[0]), "dataset_size must be at least 1"),
    (lambda: ElasticSampler(10, 1, rank=5, members=[0, 1]), "rank 5 is not in members"),
    (lambda: ElasticSampler(10, 1, rank=0, members=[0, 0]), "lists a rank twice"),
    (lambda: ElasticSampler(10, 1, rank=0, members=[0], horizon=-1), "horizon must be at least 0"),
    (lambda: ElasticSampler(10, 1, rank=0, members=5), "collection of ranks"),  # type: ignore[arg-type]
    (lambda: ElasticSampler(10, 1, rank=0, members=[0]).commit(1, [0]), "next step to commit in epoch 0 is 0"),
    (lambda: ElasticSampler(10, 1, rank=0, members=[0, 1]).commit(0, [0, 2]), r"contributors \[2\]"),
    (lambda: ElasticSampler(10, 1, rank=0, members=[0, 1]).commit(0, [0, 1], []), "no members"),
    (lambda: ElasticSampler(10, 1, rank=0, members=[0, 1]).set_epoch(1, [1]), "rank 0 is not in members"),
    (lambda: ElasticSampler.from_history(ElasticSampler(10, 1, rank=0, members=[0, 1]).history(), rank=4),
     "rank 4 is not in the view"),
    (lambda: EpochHistory.from_dict({"epoch": 1}), "not an epoch history"),
    (lambda: loader_horizon(-1), "num_workers"),
])
def test_bad_input_is_named(call, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=needle):
        call()


def test_a_commit_beyond_the_end_of_the_epoch_is_refused() -> None:
    s = ElasticSampler(4, 2, rank=0, members=[0, 1])
    s.commit(0, [0, 1])
    assert s.finished
    with pytest.raises(ConfigError, match="beyond epoch 0"):
        s.commit(1, [0, 1])
