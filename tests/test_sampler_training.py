"""ElasticSampler driven by DistributedOptimizer: seven in-process workers train over loopback
TCP, one dies mid-epoch, and the samples the workers trained on in steps that committed them
are the dataset, each once. The sampler learns every commit from `opt.last_step` alone
(`commit_from`), so this is the integration the data layer's unit tests leave out."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import fttree
from fttree import ConfigError, FTTreeAllreduce, StepAborted
from fttree.data.sampler import CollateOrNone, ElasticSampler, loader_horizon
from fttree.training.optim import TrainingStep

from .conftest import local_peers
from .test_torch_optim import assert_params_close, mlp, ok, run_ranks

WORLD = 7
SIZE = 7 * 4 * 9 + 5  # not a multiple of the global batch: the last batches are partial or empty
BATCH = 4


class Indexed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Features, a label and the sample's own index, so a worker can say what it trained on."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(size, 12, generator=g), torch.randint(0, 4, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


DATA = Indexed(SIZE)


@dataclass
class Outcome:
    rank: int
    died_at: int | None = None  # training step at which opt.step() raised GroupLeft
    trained: list[int] = field(default_factory=list)  # samples of batches whose step lists this rank
    own_committed: list[int] = field(default_factory=list)  # this rank's sampler.committed()
    committed: dict[int, list[int]] = field(default_factory=dict)  # what this rank's sampler says each rank committed
    loads: tuple[tuple[int, int], ...] = ()
    finished: bool = False
    steps: list[TrainingStep] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)




def train_on(model: nn.Module, opt: fttree.DistributedOptimizer, batch: Any) -> None:
    """One training step on `batch`; None (nothing left for this rank) takes part with an
    empty contribution."""
    opt.zero_grad()
    if batch is None:
        opt.step(contribute=False)
    else:
        x, y, _ = batch
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()

def record_step(out: Outcome, opt: fttree.DistributedOptimizer, sampler: ElasticSampler, batch: Any) -> None:
    """What a worker saw of the step it just took, then its commit: the samples it trained
    count only if its rank is among the step's contributors."""
    step = opt.last_step
    assert step is not None
    out.steps.append(step)
    if batch is not None and out.rank in step.contributors:
        out.trained.extend(batch[2].tolist())
    sampler.commit_from(opt)


def finish(out: Outcome, sampler: ElasticSampler, model: nn.Module, ranks: int) -> None:
    """The epoch's outcome as this worker computed it, for every rank below `ranks`."""
    out.own_committed = sampler.committed().tolist()
    out.committed = {r: sampler.committed(r).tolist() for r in range(ranks)}
    out.loads = tuple(sorted(sampler.stats().loads.items()))
    out.finished = sampler.finished
    out.params = [p.detach().clone() for p in model.parameters()]

def train(rank: int, ar: FTTreeAllreduce, *, loader_workers: int, epochs: int = 1,
          before_optimizer: Callable[[int, FTTreeAllreduce, nn.Module], None] | None = None) -> Outcome:
    """One worker's loop, as a user writes it: the sampler feeds the loader, commit_from(opt)
    after each step, an empty contribution when the batch is None."""
    out = Outcome(rank=rank)
    model = mlp(0)
    if before_optimizer is not None:
        before_optimizer(rank, ar, model)
    opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, allreduce=ar,
                                      bucket_mb=0.0005)  # several buckets per step
    assert len(opt.sync.buckets) > 1
    sampler = ElasticSampler(SIZE, BATCH, rank=rank, members=ar.view.members, seed=3,
                             horizon=loader_horizon(loader_workers, 2))
    loader = DataLoader(DATA, batch_sampler=sampler, num_workers=loader_workers, collate_fn=CollateOrNone(),
                        prefetch_factor=2 if loader_workers else None, timeout=60 if loader_workers else 0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.trained = []
        for batch in loader:
            try:
                train_on(model, opt, batch)
            except StepAborted:  # GroupLeft, or the steps in flight when this rank was killed
                assert ar.node is not None
                if ar.node.stopped is None:
                    raise  # a survivor's step failed: a real error
                out.died_at = opt.sync.rounds - 1
                out.own_committed = sampler.committed().tolist()
                return out
            record_step(out, opt, sampler, batch)
    finish(out, sampler, model, WORLD)
    return out


def check_exactly_once(outcomes: list[Outcome], dead: int) -> None:
    """Survivors' trained samples plus the dead rank's commits (as the survivors' samplers tell
    them) are the dataset, each once; every survivor computed the same assignment and the same
    model."""
    gone = outcomes[dead]
    assert gone.died_at is not None, f"rank {dead} did not die"
    survivors = [o for o in outcomes if o.rank != dead]
    for o in survivors:
        assert o.died_at is None, f"rank {o.rank} died"
        assert o.finished, f"rank {o.rank} did not finish the epoch"
        assert sorted(o.trained) == sorted(o.own_committed), f"rank {o.rank}: trained != committed()"
    first = survivors[0]
    for o in survivors[1:]:
        assert o.committed == first.committed, f"rank {o.rank} disagrees with rank {first.rank} on the commits"
        assert o.loads == first.loads
        assert [(s.step, s.contributors) for s in o.steps] == [(s.step, s.contributors) for s in first.steps]
        for a, b in zip(o.params, first.params, strict=True):
            assert torch.equal(a, b), f"rank {o.rank}'s model differs from rank {first.rank}'s"
    # What the dead rank committed before it died: its own record and the survivors' agree.
    assert sorted(first.committed[dead]) == sorted(gone.own_committed)
    everything = [i for o in survivors for i in o.trained] + first.committed[dead]
    assert len(everything) == SIZE, f"{len(everything) - len(set(everything))} repeats, " \
                                    f"{SIZE - len(set(everything))} missing"
    assert sorted(everything) == list(range(SIZE))
    assert dead not in first.steps[-1].contributors
    assert any(dead in s.contributors for s in first.steps), "the victim never trained"


@pytest.mark.parametrize("loader_workers", [0, 2], ids=["in-process loader", "num_workers=2"])
def test_a_worker_killed_mid_epoch_loses_and_repeats_nothing(loader_workers: int) -> None:
    """Rank 4 dies at training step 3 (`crash 4 @3`: its sockets reset as with a SIGKILL) with
    batches prefetched; the survivors take over its uncommitted samples."""
    outcomes = ok(run_ranks(WORLD, lambda r, ar: train(r, ar, loader_workers=loader_workers), deadline_s=120,
                            faults="crash 4 @3"))
    assert outcomes[4].died_at == 3
    check_exactly_once(outcomes, dead=4)


def test_a_worker_dying_between_its_gradient_buckets_has_its_batch_retrained() -> None:
    """Rank 2 dies during backward of step 4, after its first buckets were sent: it may be in
    the first buckets' results and not in the last ones'. Its batch of that step is then not
    committed (it is missing from the step's contributors) and a survivor trains it again."""
    def crash_in_backward(rank: int, ar: FTTreeAllreduce, model: nn.Module) -> None:
        if rank != 2:
            return
        # The first layer's weight is in the last bucket; this hook runs before the optimizer's
        # (registered first), so the earlier buckets are sent and the last one never is.
        first_layer = next(iter(model.parameters()))
        rounds = {"n": 0}

        def hook(_p: torch.Tensor) -> None:
            rounds["n"] += 1
            if rounds["n"] == 5:
                ar.crash("rank 2 killed during backward (test)")
        first_layer.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    outcomes = ok(run_ranks(WORLD, lambda r, ar: train(r, ar, loader_workers=0, before_optimizer=crash_in_backward),
                            deadline_s=120))
    assert outcomes[2].died_at == 4
    check_exactly_once(outcomes, dead=2)


def test_two_epochs_after_a_death_the_second_deals_the_dataset_to_the_survivors() -> None:
    outcomes = ok(run_ranks(WORLD, lambda r, ar: train(r, ar, loader_workers=0, epochs=2), deadline_s=120,
                            faults="crash 6 @2"))
    survivors = [o for o in outcomes if o.rank != 6]
    assert outcomes[6].died_at == 2
    everything = sorted(i for o in survivors for i in o.trained)  # epoch 1 only: `trained` restarts per epoch
    assert everything == list(range(SIZE))
    assert all(o.committed[6] == [] for o in survivors)  # not a member of epoch 1
    assert {o.steps[-1].step for o in survivors} == {survivors[0].steps[-1].step}


# ---- the optimizer's side: empty contributions and the step record --------------------------


def test_an_empty_contribution_is_counted_in_no_average() -> None:
    """Rank 2 has no batch: the average is over ranks 0 and 1 only, as one process training on
    their two batches would compute it."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2 * BATCH, 12, generator=g), torch.randint(0, 4, (2 * BATCH,), generator=g)
    ref = mlp(0)
    nn.functional.cross_entropy(ref(x), y).backward()  # type: ignore[no-untyped-call]
    torch.optim.SGD(ref.parameters(), lr=0.5).step()

    def body(rank: int, ar: FTTreeAllreduce) -> tuple[list[torch.Tensor], TrainingStep | None]:
        model = mlp(0)
        opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, allreduce=ar,
                                          bucket_mb=0.0005)
        opt.zero_grad()
        if rank == 2:
            opt.step(contribute=False)
        else:
            sl = slice(rank * BATCH, (rank + 1) * BATCH)
            nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt.last_step

    results = ok(run_ranks(3, body))
    want = [p.detach() for p in ref.parameters()]
    for rank, (params, step) in enumerate(results):
        assert_params_close(params, want, f"rank {rank}")
        assert step is not None
        assert (step.step, step.contributors, step.members_next, step.contributed) == (0, (0, 1, 2), (0, 1, 2),
                                                                                       rank != 2)


def test_a_step_where_nobody_has_data_changes_nothing() -> None:
    def body(rank: int, ar: FTTreeAllreduce) -> list[bool]:
        model = mlp(0)
        opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model,
                                          allreduce=ar)
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            opt.zero_grad()
            opt.step(contribute=False)
        assert opt.sync.rounds == 2  # each empty step ran: nobody skipped a step number
        assert all(p.grad is None for p in model.parameters())
        return [torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True)]

    assert all(all(same) for same in ok(run_ranks(3, body)))


def test_misuses_of_commit_from_and_contribute_are_named() -> None:
    def body(rank: int, ar: FTTreeAllreduce) -> list[str]:
        model = mlp(0)
        opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, allreduce=ar)
        sampler = ElasticSampler(30, 5, rank=rank, members=ar.view.members)
        errors = []
        with pytest.raises(ConfigError) as exc:
            sampler.commit_from(opt)
        errors.append(str(exc.value))
        batch = next(iter(sampler))
        opt.zero_grad()
        nn.functional.cross_entropy(model(DATA.x[batch]), DATA.y[batch]).backward()  # type: ignore[no-untyped-call]
        with pytest.raises(ConfigError) as exc:
            opt.synchronize(contribute=False)
        errors.append(str(exc.value))
        opt.step()
        sampler.commit_from(opt)
        with pytest.raises(ConfigError) as exc:
            sampler.commit_from(opt)
        errors.append(str(exc.value))
        opt.zero_grad()
        opt.step(contribute=False)  # rank has a batch at step 1: skipping it would lose samples
        with pytest.raises(ConfigError) as exc:
            sampler.commit_from(opt)
        errors.append(str(exc.value))
        with pytest.raises(ConfigError) as exc:
            sampler.commit_from(object())
        errors.append(str(exc.value))
        return errors

    for errors in ok(run_ranks(3, body)):
        assert "has finished no training step yet" in errors[0]
        assert "after backward produced gradients in training step 0" in errors[1]
        assert "training step 0 is already committed" in errors[2]
        assert "stepped with contribute=False at step 1" in errors[3]
        assert "not object" in errors[4]


def test_commit_from_a_plain_allreduce_loop() -> None:
    """One allreduce per step (no optimizer): commit_from(ar) reads ar.last."""
    def body(rank: int, ar: FTTreeAllreduce) -> tuple[list[int], bool]:
        sampler = ElasticSampler(40, 3, rank=rank, members=ar.view.members, seed=1)
        mine = []
        for batch in sampler:
            ar.allreduce(np.ones(2, dtype=np.float32))
            mine.extend(batch)
            sampler.commit_from(ar)
        return mine, sampler.finished

    results = ok(run_ranks(3, body))
    assert all(done for _, done in results)
    assert sorted(i for mine, _ in results for i in mine) == list(range(40))



def test_train_mlp_audits_every_epoch_through_a_crash() -> None:
    """The example: a worker dies mid-epoch and every complete epoch is still trained once."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "train_mlp.py"
    proc = subprocess.run([sys.executable, str(script), "-n", "3", "--steps", "7", "--faults", "crash 2 @2",
                           "--json", "--warmup", "0"], capture_output=True, text=True, timeout=240, check=False)
    # the crashed rank ends as the run asked it to (exit 0); the audits below say it departed
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    *_, audits_line, summary_line = proc.stdout.strip().splitlines()
    audits, summary = json.loads(audits_line)["audits"], json.loads(summary_line)
    assert summary["steps"] == 7
    assert summary["exactly_once"] is True
    complete = [a for a in audits if a["complete"]]
    assert complete, audits
    assert all(a["once"] and a["committed"] == a["distinct"] for a in complete)
    assert any(a["departed"] == [2] for a in complete), "the crash was not in a complete epoch"
    assert all(a["repeated"] == 0 for a in audits)




# ---- a death, a restart and a new rank in one epoch (ElasticSampler.follow) -----------------

JOIN_SIZE = 8 * 4 * 40 + 5  # about 47 steps for 7 workers: room for the state transfers after the joins
RESTART_AT, JOIN_AT = 5, 7  # training steps at which the members wait for the late worker's admission


@dataclass
class Gates:
    """What the test synchronises on, each waited for with a deadline. The members pause at
    RESTART_AT and JOIN_AT until the late worker is built and about to take its first step, so
    its join lands mid-epoch however slow the machine is. The new rank starts once the
    restarted one is built, so the two joins may be decided in either order or overlap."""

    crashed: threading.Event = field(default_factory=threading.Event)  # the killed rank closed its handle
    ready: dict[int, threading.Event] = field(default_factory=lambda: {4: threading.Event(), 7: threading.Event()})
    failed: threading.Event = field(default_factory=threading.Event)  # a worker failed: nobody waits any more

    def wait(self, event: threading.Event, what: str) -> None:
        assert event.wait(60), f"{what} did not happen within 60 s"


def follow_and_train(rank: int, ar: FTTreeAllreduce, *, loader_workers: int, gates: Gates,
                     crash_at: int | None = None) -> Outcome:
    """The user's loop with joins: every rank builds its sampler with follow(opt); a joiner
    takes part with no batch until its sampler deals to it, then trains like the others."""
    out = Outcome(rank=rank)
    model = mlp(0)
    opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, allreduce=ar,
                                      bucket_mb=0.0005)
    sampler = ElasticSampler.follow(opt, JOIN_SIZE, BATCH, seed=5, horizon=loader_horizon(loader_workers, 2))
    # Forked loader processes do not keep the ranks' sockets (tcp.py releases them at fork), so
    # the restarted rank 4 listens on its address again at once.
    loader = DataLoader(Indexed(JOIN_SIZE), batch_sampler=sampler, num_workers=loader_workers,
                        collate_fn=CollateOrNone(), prefetch_factor=2 if loader_workers else None,
                        timeout=60 if loader_workers else 0)
    if opt.syncing:
        gates.ready[rank].set()  # the members may go on: this worker's first step admits it
    while not sampler.member:  # a joiner: no batch until the sampler deals to it
        opt.zero_grad()
        opt.step(contribute=False)
        assert opt.last_step is not None
        out.steps.append(opt.last_step)
        sampler.commit_from(opt)
    for epoch in range(sampler.epoch, 1):
        if epoch > sampler.epoch:
            sampler.set_epoch(epoch)
        for batch in loader:
            step = opt.sync.rounds  # the training step this batch is for
            if step == crash_at:
                ar.crash(f"test: rank {rank} killed at training step {step}")
            # view 1 evicts the killed rank 4, view 2 admits it again, view 3 admits rank 7
            for gate, late in ((RESTART_AT, 4), (JOIN_AT, 7)):
                if step == gate and rank != late:
                    gates.wait(gates.ready[late], f"rank {late}'s start (rank {rank} waits at step {step})")
            try:
                train_on(model, opt, batch)
            except StepAborted:
                if ar.node is None or ar.node.stopped is None:
                    raise
                out.died_at = step
                out.own_committed = sampler.committed().tolist()
                return out
            record_step(out, opt, sampler, batch)
    finish(out, sampler, model, 8)
    return out


def check_with_joins(res: dict[str, Outcome]) -> None:
    """Exactly once over the epoch, with the killed rank's part before its death, and every
    live worker (the restarted and the new one included) computed the same commits."""
    killed, restarted, joiner = res["rank 4"], res["rank 4 restarted"], res["rank 7 joining"]
    assert killed.died_at == 3
    live = [res[f"rank {r}"] for r in (0, 1, 2, 3, 5, 6)] + [restarted, joiner]
    first = live[0]
    contributors = {s.step: s.contributors for o in live for s in o.steps}
    for o in live:
        assert o.died_at is None, f"rank {o.rank} died at {o.died_at}"
        assert o.finished, f"rank {o.rank} did not finish the epoch"
        assert o.committed == first.committed, f"rank {o.rank} disagrees with rank {first.rank} on the commits"
        assert o.loads == first.loads
        assert all(contributors[s.step] == s.contributors for s in o.steps), f"rank {o.rank} saw other steps"
        for a, b in zip(o.params, first.params, strict=True):
            assert torch.equal(a, b), f"rank {o.rank}'s model differs from rank {first.rank}'s"
        assert sorted(o.trained + (killed.trained if o is restarted else [])) == sorted(first.committed[o.rank])
        assert sorted(o.own_committed) == sorted(first.committed[o.rank])
    assert sorted(killed.own_committed) == sorted(killed.trained)
    assert restarted.trained, "the restarted rank trained nothing: it was not dealt to mid-epoch"
    assert joiner.trained, "the new rank trained nothing: it was not dealt to mid-epoch"
    # each late worker's first counted step had no batch: it joined the view there
    for late in (restarted, joiner):
        entry = next(s for s in late.steps if late.rank in s.contributors)
        assert not entry.contributed
        assert RESTART_AT <= entry.step < first.steps[-1].step
    everything = [i for o in live for i in o.trained] + killed.trained
    assert len(everything) == JOIN_SIZE, f"{len(everything) - len(set(everything))} repeats, " \
                                         f"{JOIN_SIZE - len(set(everything))} missing"
    assert sorted(everything) == list(range(JOIN_SIZE))
    assert sorted(i for got in first.committed.values() for i in got) == list(range(JOIN_SIZE))


@pytest.mark.parametrize("loader_workers", [0, 2], ids=["in-process loader", "num_workers=2"])
def test_a_death_a_restart_and_a_join_in_one_epoch_lose_and_repeat_nothing(loader_workers: int) -> None:
    """Seven workers; rank 4 is killed at step 3 with batches prefetched and restarted (same
    rank, same address); rank 7, new, joins through rank 1. Every rank builds its sampler with
    ElasticSampler.follow(opt): the history travels with the training state and each member
    takes the late workers in from the steps' contributors. The samples trained in committed
    steps are the dataset, each once, and every worker agrees on who committed what."""
    peers = local_peers(8)
    first = peers[:7]
    gates = Gates()
    results: dict[str, Outcome | BaseException] = {}

    def worker(name: str, make: Callable[[], FTTreeAllreduce], rank: int, crash_at: int | None = None,
               after: threading.Event | None = None) -> Callable[[], None]:
        def go() -> None:
            ar = None
            try:
                if after is not None:
                    gates.wait(after, f"what {name} starts after")
                ar = make().start()
                results[name] = follow_and_train(rank, ar, loader_workers=loader_workers, gates=gates,
                                                 crash_at=crash_at)
            except BaseException as exc:
                results[name] = exc
                for event in (*gates.ready.values(), gates.crashed, gates.failed):
                    event.set()
            finally:
                if ar is not None:
                    ar.close()
                if crash_at is not None:
                    gates.crashed.set()
        return go

    def member(r: int) -> Callable[[], FTTreeAllreduce]:
        return lambda: FTTreeAllreduce(r, first, timeout_policy="static")

    targets = [worker(f"rank {r}", member(r), r, crash_at=3 if r == 4 else None) for r in range(7)]
    targets.append(worker("rank 4 restarted", member(4), 4, after=gates.crashed))
    targets.append(worker("rank 7 joining", lambda: FTTreeAllreduce(7, {7: peers[7]}, join=peers[1],
                                                                   timeout_policy="static"), 7, after=gates.ready[4]))
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    failures = {name: res for name, res in results.items() if isinstance(res, BaseException)}
    if failures:
        first_failure = next(iter(failures.values()))
        raise AssertionError("; ".join(f"{name} failed: {res!r}" for name, res in failures.items())) \
            from first_failure
    check_with_joins({k: v for k, v in results.items() if isinstance(v, Outcome)})
