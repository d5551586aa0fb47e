"""ElasticSampler: exactly once over an epoch whatever workers die, restart or join, with
prefetching loaders; minimal movement, balance and spread; stable mode; bad input."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fttree import ConfigError
from fttree.data.sampler import (
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
from fttree.data.sampler import ElasticSampler
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


# ---- joins followed from the steps' contributors (ElasticSampler.follow, commit_from) ------


@dataclass(frozen=True)
class Step:
    """The fields of fttree's TrainingStep that commit_from reads (no torch import here)."""

    step: int
    contributors: tuple[int, ...]
    members_next: tuple[int, ...]
    contributed: bool


class FakeOpt:
    """What ElasticSampler.follow and commit_from read of a DistributedOptimizer: its rank and
    view, whether it is a joiner waiting for its state, the extras it transfers, the last step."""

    def __init__(self, rank: int, members: Collection[int], *, syncing: bool) -> None:
        self.sync = SimpleNamespace(ar=SimpleNamespace(rank=rank, view=SimpleNamespace(members=tuple(members))))
        self.syncing = syncing
        self.contributes = not syncing  # sync.contribute: counted among the protocol's contributors
        self.extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.last_step: Step | None = None

    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        self.extra[name] = (get, set_)


@dataclass
class Worker:
    rank: int
    opt: FakeOpt
    sampler: ElasticSampler
    it: Iterator[list[int]] | None = None  # its loader, from the step it is a member on
    handed: dict[int, list[int]] = field(default_factory=dict)  # epoch step -> batch the loader got
    asked: int = 0
    state_at: int | None = None  # training step the donor serves its state at
    load_at: int | None = None  # training step the state is loaded in
    state: Any = None


class Group:
    """Ranks that each follow the group with ElasticSampler.follow and commit_from, as the
    training loop does with DistributedOptimizer: members, killed ranks, restarted ranks and
    new ranks that wait for their state, load it some steps later, take part with an empty
    batch and get their share. Loaders prefetch `horizon` steps ahead. Checks exactly once."""

    def __init__(self, n: int, size: int, batch: int, *, horizon: int, epochs: int = 1, seed: int = 0) -> None:
        self.size, self.batch, self.horizon, self.epochs, self.seed = size, batch, horizon, epochs, seed
        self.workers = {r: self._worker(r, range(n), syncing=False) for r in range(n)}
        self.dead: list[int] = []
        self.next_rank = n
        self.step = 0  # training step
        self.epoch = 0
        self.delivered: dict[int, dict[int, list[int]]] = {0: {}}  # epoch -> rank -> samples it trained
        self.audits: dict[int, dict[int, list[int]]] = {}  # epoch -> rank -> committed(rank), at its end

    def _worker(self, rank: int, members: Collection[int], *, syncing: bool) -> Worker:
        opt = FakeOpt(rank, members, syncing=syncing)
        sampler = ElasticSampler.follow(opt, self.size, self.batch, seed=self.seed, horizon=self.horizon)
        return Worker(rank=rank, opt=opt, sampler=sampler)

    def members(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.sampler.member]

    def arrive(self, rank: int, serve_after: int, load_after: int) -> None:
        """A restarted or new rank is admitted at this step; a donor serves it `serve_after`
        steps later, and it loads the state `load_after` steps after that."""
        w = self._worker(rank, [], syncing=True)
        w.state_at, w.load_at = self.step + serve_after, self.step + serve_after + load_after
        self.workers[rank] = w

    def _batches(self) -> dict[int, list[int]] | None:
        """Each member's batch at this step (None: the epoch ended for all)."""
        got, ended = {}, set()
        for w in self.members():
            if w.it is None:
                w.it, w.asked, w.handed = iter(w.sampler), w.sampler.next_step, {}
            while w.asked <= w.sampler.next_step + self.horizon:
                try:
                    w.handed[w.asked] = next(w.it)
                except StopIteration:
                    break
                w.asked += 1
            if w.sampler.next_step in w.handed:
                got[w.rank] = w.handed[w.sampler.next_step]
            else:
                ended.add(w.rank)
        assert not got or not ended, f"ranks {sorted(ended)} ended the epoch before {sorted(got)}"
        return got or None

    def run_step(self, die: Collection[int] = ()) -> bool:
        """One training step; False once the last epoch ended."""
        got = self._batches()
        if got is None:
            view = self.members()[0].sampler
            self.audits[self.epoch] = {r: view.committed(r).tolist() for r in range(self.next_rank)}
            self.epoch += 1
            if self.epoch == self.epochs:
                return False
            self.delivered[self.epoch] = {}
            for w in self.members():
                w.sampler.set_epoch(self.epoch)
                w.it = None
            got = self._batches()
            assert got is not None
        for r in die:
            del self.workers[r]
            self.dead.append(r)
        donor = min(w.rank for w in self.members() if w.rank not in die)
        for w in self.workers.values():
            if w.state_at == self.step:  # the donor's state before this step's commit
                w.state = self.workers[donor].opt.extra["sampler"][0]()
            if w.load_at == self.step:  # loaded inside opt.step(), before the joiner's commit_from
                w.opt.extra["sampler"][1](json.loads(json.dumps(w.state)))
                w.opt.syncing = False
        contributors = tuple(sorted(w.rank for w in self.workers.values() if w.opt.contributes))
        for r in contributors:
            self.delivered[self.epoch].setdefault(r, []).extend(got.get(r, []))
        for w in self.workers.values():
            w.opt.last_step = Step(self.step, contributors, contributors, bool(got.get(w.rank)) and w.opt.contributes)
            w.sampler.commit_from(w.opt)
            if not w.opt.syncing:
                w.opt.contributes = True
        self._check_agreement()
        self.step += 1
        return True

    def _check_agreement(self) -> None:
        known = [w for w in self.workers.values() if w.sampler._epoch_plan is not None]
        stats = [w.sampler.stats() for w in known]
        assert all((s.epoch, s.step, s.members, s.loads) == (stats[0].epoch, stats[0].step, stats[0].members,
                                                             stats[0].loads) for s in stats), stats
        for w in self.members():  # every batch a loader holds stays valid
            if w.it is not None:
                for s, b in w.handed.items():
                    if s >= w.sampler.next_step:
                        assert w.sampler.batch(s) == b, (w.rank, s)

    def run(self, script: dict[int, list[tuple[str, int, int, int]]]) -> None:
        while True:
            die: set[int] = set()
            for kind, who, serve_after, load_after in script.get(self.step, []):
                live = [w.rank for w in self.members() if w.rank not in die]
                if kind == "die" and len(live) > 1:
                    die.add(live[who % len(live)])
                elif kind == "join":
                    self.arrive(self.next_rank, serve_after, load_after)
                    self.next_rank += 1
                elif kind == "restart" and self.dead:
                    rank = self.dead.pop(who % len(self.dead))
                    self.arrive(rank, serve_after, load_after)
            if not self.run_step(die):
                return
            assert self.step < 10_000

    def check_exactly_once(self) -> None:
        for epoch, delivered in self.delivered.items():
            everything = sorted(i for got in delivered.values() for i in got)
            assert everything == list(range(self.size)), f"epoch {epoch}"
            for r, got in delivered.items():  # committed() is the audit of what was trained
                assert sorted(self.audits[epoch][r]) == sorted(got), (epoch, r)


def test_a_stranger_among_the_contributors_joins_from_the_next_step() -> None:
    members = [ElasticSampler(400, 5, rank=r, members=range(4), horizon=2) for r in range(4)]
    for step in range(3):
        for s in members:
            s.commit_from(SimpleNamespace(last_step=Step(step, (0, 1, 2, 3), (0, 1, 2, 3), True)))
    before = {r: members[0].pending(r) for r in range(4)}
    events = [s.commit_from(SimpleNamespace(last_step=Step(3, (0, 1, 2, 3, 9), (0, 1, 2, 3, 9), True)))
              for s in members]
    assert events[0] is not None
    assert all(e == events[0] for e in events)
    assert events[0].joined == (9,)
    assert events[0].departed == ()
    assert events[0].failed == ()
    view = members[0]
    assert view.members == (0, 1, 2, 3, 9)
    assert view.batch(3, 9) == []
    assert view.batch(4, 9) != []
    taken = view.pending(9)
    assert 0.8 * 380 / 5 <= len(taken) <= 1.05 * 380 / 5
    for r in range(4):  # it took only what no loader may hold yet: beyond steps 4 and 5 (horizon 2)
        mine = before[r][len(view.batch(3, r)):]
        assert np.array_equal(mine[:2 * 5], view.pending(r)[:2 * 5])
        assert np.isin(mine[~np.isin(mine, view.pending(r))], taken).all()


def test_a_departed_rank_that_restarts_has_both_stays_in_committed() -> None:
    s = ElasticSampler(300, 4, rank=0, members=range(3))
    s.commit_from(SimpleNamespace(last_step=Step(0, (0, 1, 2), (0, 1, 2), True)))
    first = s.committed(2)
    s.commit_from(SimpleNamespace(last_step=Step(1, (0, 1), (0, 1), True)))  # 2 dies at step 1
    assert s.members == (0, 1)
    s.commit_from(SimpleNamespace(last_step=Step(2, (0, 1, 2), (0, 1, 2), True)))  # and is back, empty-handed
    assert s.members == (0, 1, 2)
    for step in range(3, 6):
        s.commit_from(SimpleNamespace(last_step=Step(step, (0, 1, 2), (0, 1, 2), True)))
    again = s.committed(2)
    assert np.array_equal(again[:len(first)], first)
    assert len(again) == len(first) + 3 * 4


def test_a_joiner_replays_what_it_saw_while_syncing_and_computes_the_members_queues() -> None:
    g = Group(5, 500, 6, horizon=2)
    g.run({2: [("join", 0, 3, 2)], 4: [("die", 1, 0, 0)]})
    g.check_exactly_once()
    assert 5 in g.audits[0]
    assert len(g.audits[0][5]) > 0


def test_a_killed_rank_restarts_and_a_new_rank_joins_in_one_epoch_with_prefetch() -> None:
    g = Group(7, 7 * 4 * 9 + 5, 4, horizon=4)
    g.run({3: [("die", 4, 0, 0)], 5: [("restart", 0, 1, 2)], 6: [("join", 0, 0, 3)]})
    g.check_exactly_once()
    assert g.dead == []
    assert {w.rank for w in g.members()} == set(range(8))


def test_a_joiner_whose_history_ends_an_epoch_follows_the_group_into_the_next() -> None:
    """The state comes from the end of epoch 0 and the joiner replays into epoch 1 before it
    takes part: it enters epoch 1 with the view that epoch 0 ended with."""
    g = Group(3, 150, 5, horizon=1, epochs=2)  # epoch 0: training steps 0..10
    g.run({7: [("join", 0, 2, 3)]})  # state as of step 9 in epoch 0, loaded at step 12 in epoch 1
    g.check_exactly_once()
    assert g.workers[3].state["history"]["epoch"] == 0
    joiner = g.workers[3].sampler
    assert joiner.epoch == 1
    assert joiner.member
    assert g.audits[0][3] == []
    assert g.audits[1][3] != []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(20, 400), batch=st.integers(1, 9), horizon=st.integers(0, 4), epochs=st.integers(1, 2),
       events=st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["die", "join", "restart"]), st.integers(0, 99),
                                 st.integers(0, 4), st.integers(0, 4)), max_size=6))
def test_every_sample_is_committed_once_when_joiners_follow_the_steps(
        size: int, batch: int, horizon: int, epochs: int, events: list[tuple[int, str, int, int, int]]) -> None:
    script: dict[int, list[tuple[str, int, int, int]]] = {}
    for step, kind, who, serve_after, load_after in events:
        script.setdefault(step, []).append((kind, who, serve_after, load_after))
    g = Group(4, size, batch, horizon=horizon, epochs=epochs, seed=size)
    g.run(script)
    g.check_exactly_once()


def _waiting() -> tuple[FakeOpt, ElasticSampler]:
    opt = FakeOpt(5, (), syncing=True)
    return opt, ElasticSampler.follow(opt, 100, 4)


def test_a_waiting_joiner_has_no_batches_and_says_why() -> None:
    _, s = _waiting()
    assert not s.member
    with pytest.raises(ConfigError, match="rank 5 is joining and has no epoch history yet"):
        next(iter(s))


def test_a_joiner_that_contributes_samples_at_its_first_step_is_refused() -> None:
    opt, s = _waiting()
    donor = ElasticSampler(100, 4, rank=0, members=range(2))
    opt.last_step = Step(0, (0, 1), (0, 1), False)
    s.commit_from(opt)
    donor.commit(0, (0, 1))
    opt.extra["sampler"][1]({"history": donor.history().to_dict(), "step": 0})
    opt.last_step = Step(1, (0, 1, 5), (0, 1, 5), True)  # gradients, but it had no batch: it was no member
    with pytest.raises(ConfigError, match="rank 5 has no batch at step 1 of epoch 0 but contributed gradients"):
        s.commit_from(opt)


@pytest.mark.parametrize(("state", "needle"), [
    ({"history": ElasticSampler(100, 5, rank=0, members=[0]).history().to_dict(), "step": -1},
     "differs from the group's"),
    ({"history": ElasticSampler(100, 4, rank=0, members=[0]).history().to_dict(), "step": -1},
     r"runs through training step -1, but this worker recorded steps \[3\]"),
    ({"step": 2}, "not a sampler state"),
])
def test_a_sampler_state_that_does_not_fit_is_refused(state: dict[str, Any], needle: str) -> None:
    opt, s = _waiting()
    opt.last_step = Step(3, (0,), (0,), False)  # admitted at step 3
    s.commit_from(opt)
    with pytest.raises(ConfigError, match=needle):
        opt.extra["sampler"][1](state)


def test_a_member_refuses_a_second_state_and_a_stranger_outside_the_next_view() -> None:
    opt = FakeOpt(0, range(2), syncing=False)
    s = ElasticSampler.follow(opt, 100, 4)
    with pytest.raises(ConfigError, match="already has its epoch"):
        opt.extra["sampler"][1](opt.extra["sampler"][0]())
    opt.last_step = Step(0, (0, 1, 7), (0, 1), True)
    with pytest.raises(ConfigError, match=r"ranks \[7\] contributed to training step 0 but are neither"):
        s.commit_from(opt)
    assert s.next_step == 0


def test_a_joiner_whose_state_came_without_the_sampler_history_is_told_so() -> None:
    opt, s = _waiting()
    opt.syncing = False  # the state is in, but the donor registered no "sampler" extra
    opt.last_step = Step(3, (0,), (0,), False)
    with pytest.raises(ConfigError, match="no sampler history in it"):
        s.commit_from(opt)


def test_a_history_newer_than_the_joiners_records_skips_the_steps_it_holds() -> None:
    """Should a state arrive as of a step this joiner has not committed yet, the steps it
    holds are not committed twice."""
    opt, s = _waiting()
    donor = ElasticSampler(100, 4, rank=0, members=range(2))
    opt.last_step = Step(0, (0, 1), (0, 1), False)
    s.commit_from(opt)
    donor.commit(0, (0, 1))
    donor.commit(1, (0, 1))
    opt.extra["sampler"][1]({"history": donor.history().to_dict(), "step": 1})
    opt.last_step = Step(1, (0, 1), (0, 1), False)
    assert s.commit_from(opt) is None
    assert s.next_step == 2
    opt.last_step = Step(2, (0, 1, 5), (0, 1, 5), False)
    donor.commit(2, (0, 1), (0, 1, 5))
    s.commit_from(opt)
    assert s.member
    assert np.array_equal(s.pending(), donor.pending(5))


def test_a_donor_that_never_used_commit_from_cannot_hand_over_its_history() -> None:
    opt = FakeOpt(0, range(2), syncing=False)
    s = ElasticSampler.follow(opt, 100, 4)
    s.commit(0, (0, 1))
    with pytest.raises(ConfigError, match="none from commit_from"):
        opt.extra["sampler"][0]()
