"""fttree.ElasticJob with a process restarted mid-epoch (threads of one process over loopback
TCP): the epoch's audit counts what the rank's earlier process committed exactly once, however
the restarted process's wait for the group's state lines up with the epoch's end."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fttree
from fttree import FTTreeAllreduce
from fttree.training.job import EpochSummary, StepReport
from tests.conftest import local_peers, run_threads

from .test_elastic_job import BATCH, Pairs
from .test_torch_optim import mlp

SETTINGS = dict(timeout_s=0.2, step_timeout_s=10.0)
KILLED_AT = 3  # the training step the victim's first process dies at
SIZE = 3 * BATCH * 150  # an epoch of 150 steps: the restart is over long before it ends


def job_of(ar: FTTreeAllreduce, on_step: list[StepReport] | None = None,
           schedule: bool = False, size: int = SIZE) -> tuple[fttree.ElasticJob, nn.Module]:
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = fttree.ElasticJob(model, opt, Pairs(size), batch_size=BATCH, allreduce=ar, bucket_mb=0.0005,
                            on_step=None if on_step is None else on_step.append,
                            scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.7) if schedule else None)
    return job, model


@pytest.mark.parametrize("schedule", [False, True])
def test_a_restarted_rank_that_becomes_a_member_at_the_epochs_last_step_is_audited_with_its_commits(
        schedule: bool) -> None:
    """Rank 2 dies at step 3 and is restarted at once; the members end the epoch (job.stop())
    at the very step its new process is first counted, so it becomes a member while it still
    waits in epochs(), and answers that audit there. It used to answer nothing, as a rank that
    is not a member does, while the others counted its answer instead of the history: the
    samples its first process committed were missing from the epoch (`fttree chaos` saw
    "epoch 139: 200 missing" once). With an LR scheduler the restarted process takes the
    group's schedule with the state: it ends with the members' LR and parameter bits."""
    peers = local_peers(3)
    killed = threading.Event()
    reports: dict[str, list[StepReport]] = {"0": [], "1": [], "2 first": [], "2 again": []}
    summaries: dict[int, list[EpochSummary]] = {}
    errors: list[BaseException] = []
    ends: dict[int, tuple[list[float], list[torch.Tensor]]] = {}

    def end_of(rank: int, job: fttree.ElasticJob, model: nn.Module) -> None:
        lr = job.scheduler.get_last_lr() if schedule else [g["lr"] for g in job.opt.param_groups]
        ends[rank] = (lr, [p.detach().clone() for p in model.parameters()])

    def member(rank: int) -> None:
        try:
            ar = FTTreeAllreduce(rank, peers, **SETTINGS).start()  # type: ignore[arg-type]
            try:
                job, model = job_of(ar, reports[str(rank)], schedule)
                gone = False

                def stop_when_back(report: StepReport) -> None:
                    nonlocal gone
                    gone = gone or (killed.is_set() and 2 not in report.contributors)
                    if gone and 2 in report.contributors:
                        job.stop()

                job.step_listeners.append(stop_when_back)
                for epoch in job.epochs(1):
                    for x, y in epoch:
                        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                        job.step()
                summaries[rank] = job.summaries
                end_of(rank, job, model)
            finally:
                ar.close()
        except BaseException as exc:
            errors.append(exc)

    def first_victim() -> None:
        try:
            ar = FTTreeAllreduce(2, peers, **SETTINGS).start()  # type: ignore[arg-type]
            job, model = job_of(ar, reports["2 first"], schedule)
            for epoch in job.epochs(1):
                for x, y in epoch:
                    nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                    job.step()
                    if job.training_steps == KILLED_AT:
                        ar.crash(f"test: rank 2 killed at training step {KILLED_AT}")
                        killed.set()  # after the crash closed its listener: the new process binds its port
                        return
        except BaseException as exc:
            errors.append(exc)

    def restarted() -> None:
        try:
            assert killed.wait(60), "rank 2's first process never reached its last step"
            ar = FTTreeAllreduce(2, peers, join=True, **SETTINGS).start()  # type: ignore[arg-type]
            try:
                job, model = job_of(ar, reports["2 again"], schedule)
                for epoch in job.epochs(1):
                    for x, y in epoch:
                        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                        job.step()
                end_of(2, job, model)
            finally:
                ar.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads([lambda: member(0), lambda: member(1), first_victim, restarted])
    assert not errors, errors
    first = summaries[0][0]
    assert summaries[1] == summaries[0], "the members' accounts differ"
    assert not first.complete, f"the epoch ended before rank 2 came back: {first}"
    assert (first.answered, first.departed) == ((0, 1, 2), ()), first
    trained = sum(r.trained for rs in reports.values() for r in rs)
    assert sum(r.trained for r in reports["2 first"]) == KILLED_AT * BATCH
    assert (first.committed, first.distinct, first.repeated) == (trained, trained, 0), first
    lr, params = ends[0]
    if schedule:
        assert lr[0] < 0.1, f"the schedule never moved the LR: {lr}"
    for rank in (1, 2):
        assert ends[rank][0] == lr, f"rank {rank}'s LR {ends[rank][0]} differs from rank 0's {lr}"
        for a, b in zip(params, ends[rank][1], strict=True):
            assert torch.equal(a, b), f"rank {rank}'s parameters differ from rank 0's"


def test_a_rank_that_joins_and_dies_inside_one_epoch_is_counted_from_the_history() -> None:
    """Rank 2 dies in epoch 0; its new process is started once the others are in epoch 1,
    joins inside a later epoch, trains one step and dies again; the others stop the job once
    it has left their view. It was a member of that epoch neither at its start nor at its end,
    and the audit used to count only those two views' ranks for members that cannot answer:
    its step's samples were "missing" (`fttree chaos --kinds kill --seed 8`: "epoch 129: 100
    missing"). Every epoch's audit must hold exactly the samples the processes' reports trained."""
    size = 3 * BATCH * 8  # short epochs: the rejoin lands inside one, many steps after epoch 0
    peers = local_peers(3)
    first_dead, in_epoch_1, second_dead = threading.Event(), threading.Event(), threading.Event()
    reports: dict[str, list[StepReport]] = {"0": [], "1": [], "2 first": [], "2 again": []}
    summaries: dict[int, list[EpochSummary]] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            ar = FTTreeAllreduce(rank, peers, **SETTINGS).start()  # type: ignore[arg-type]
            try:
                job, model = job_of(ar, reports[str(rank)], size=size)

                def watch(report: StepReport) -> None:
                    if report.epoch >= 1:
                        in_epoch_1.set()
                    if second_dead.is_set() and 2 not in job.sampler.members:
                        job.stop()

                job.step_listeners.append(watch)
                for epoch in job.epochs():
                    for x, y in epoch:
                        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                        job.step()
                summaries[rank] = job.summaries
            finally:
                ar.close()
        except BaseException as exc:
            errors.append(exc)

    def victim(again: bool) -> None:
        try:
            if again:
                assert in_epoch_1.wait(60), "the members never reached epoch 1"
            ar = FTTreeAllreduce(2, peers, join=again, **SETTINGS).start()  # type: ignore[arg-type]
            try:
                job, model = job_of(ar, reports["2 again" if again else "2 first"], size=size)
                for epoch in job.epochs():
                    for x, y in epoch:
                        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                        job.step()
                        if again or job.training_steps == KILLED_AT:
                            ar.crash(f"test: rank 2 killed at training step {job.training_steps}")
                            (second_dead if again else first_dead).set()
                            return
            finally:
                ar.close()
        except BaseException as exc:
            errors.append(exc)

    def restarted() -> None:
        assert first_dead.wait(60), "rank 2's first process never reached its last step"
        victim(True)

    run_threads([lambda: member(0), lambda: member(1), lambda: victim(False), restarted])
    assert not errors, errors
    assert summaries[1] == summaries[0], "the members' accounts differ"
    again = [r for r in reports["2 again"] if r.trained]
    assert len(again) == 1, "rank 2's second process did not train exactly one step"
    joined_in = again[0].epoch
    assert joined_in >= 1
    for summary in summaries[0]:
        trained = sum(r.trained for rs in reports.values() for r in rs if r.epoch == summary.epoch)
        assert (summary.committed, summary.distinct, summary.repeated) == (trained, trained, 0), summary
        assert summary.once or summary is summaries[0][-1], summary
