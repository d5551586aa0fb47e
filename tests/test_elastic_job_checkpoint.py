"""ElasticJob's whole-job checkpoints in process: a group on threads that all stop dead at
one step (every rank raises, as if killed) and a new group started on the same directory
resumes, and each epoch's summary then says every sample was committed exactly once overall.
Mismatched and damaged checkpoints are refused. The real-process test (every worker
SIGKILLed) is tests/test_elastic_job_restart.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fttree
from fttree import ConfigError, FTTreeAllreduce
from fttree.data.sampler import ElasticSampler, EpochHistory
from fttree.training import checkpoint as ckpt_file
from fttree.training.job import EpochSummary, StepReport

from .test_elastic_job import BATCH, SIZE, Pairs, assert_once, loop
from .test_torch_optim import mlp, ok, run_ranks

MOMENTUM = 0.9  # inner (DiLoCo) momentum differs per rank: each rank must get its own back


class Killed(Exception):
    """Every rank stops dead here, as a job whose processes were all killed."""


def make_job(ar: FTTreeAllreduce, directory: Path, *, diloco: int = 0, size: int = SIZE, every: int = 2,
             model: nn.Module | None = None, reports: list[StepReport] | None = None,
             schedule: bool = False) -> tuple[Any, nn.Module]:
    model = mlp(0) if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=MOMENTUM)
    job = fttree.ElasticJob(model, opt, Pairs(size), batch_size=BATCH, allreduce=ar, diloco=diloco,
                            bucket_mb=0.0005, checkpoint_dir=directory, checkpoint_every=every,
                            on_step=None if reports is None else reports.append,
                            scheduler=torch.optim.lr_scheduler.StepLR(opt, 3, 0.5) if schedule else None)
    return job, model


def killed_at(directory: Path, step: int, diloco: int = 0, schedule: bool = False) -> list[Any]:
    """Run a group until training step `step` is committed, then stop every rank dead."""
    def body(rank: int, ar: FTTreeAllreduce) -> list[EpochSummary]:
        job, model = make_job(ar, directory, diloco=diloco, schedule=schedule)

        def die(report: StepReport) -> None:
            if report.step == step:
                raise Killed(f"rank {rank} at step {step}")

        job.step_listeners.append(die)
        return loop(job, model, 2)

    return run_ranks(3, body)


def resumed(directory: Path, epochs: int = 2, diloco: int = 0, schedule: bool = False
            ) -> list[tuple[list[EpochSummary], list[StepReport], Path | None, list[torch.Tensor]]]:
    def body(rank: int, ar: FTTreeAllreduce) -> tuple[list[EpochSummary], list[StepReport], Path | None,
                                                       list[torch.Tensor]]:
        reports: list[StepReport] = []
        job, model = make_job(ar, directory, diloco=diloco, reports=reports, schedule=schedule)
        return loop(job, model, epochs), reports, job.resumed_from, [p.detach().clone() for p in model.parameters()]

    return ok(run_ranks(3, body))


@pytest.mark.parametrize(("diloco", "step"), [(0, 4), (0, 8), (2, 4)])
def test_a_job_stopped_dead_resumes_and_commits_every_sample_once(tmp_path: Path, diloco: int, step: int) -> None:
    """Killed one step after a checkpoint (every 2 steps): the killed step's samples were
    committed but not saved, so they are dealt again; those before the checkpoint are not."""
    first = killed_at(tmp_path, step, diloco)
    assert all(isinstance(r, Killed) for r in first), first
    saved = ckpt_file.latest(tmp_path)
    assert saved is not None
    assert saved.name == f"step-{step:012d}.fttree"
    results = resumed(tmp_path, diloco=diloco)
    summaries = results[0][0]
    killed_epoch = 0 if step < 6 // (diloco or 1) else 1  # an epoch is 6 steps, or 3 rounds of 2
    # every epoch left to run: each sample once, those committed before the kill included
    assert_once(summaries, 2 - killed_epoch, (0, 1, 2), first=killed_epoch)
    for got, reports, path, params in results:
        assert got == summaries
        assert path == saved
        assert reports[0].step == step  # the step counts on where the checkpoint left off
        for a, b in zip(results[0][3], params, strict=True):
            assert torch.equal(a, b)
    again = resumed(tmp_path, diloco=diloco)  # the finished job's checkpoint: nothing left to do
    assert all(s == [] and r == [] for s, r, _, _ in again), again


def test_a_resumed_job_does_not_deal_samples_committed_before_the_checkpoint(tmp_path: Path) -> None:
    """The same check from the samplers' side: what the resumed epoch commits is exactly the
    samples the checkpoint's history had not committed."""
    killed_at(tmp_path, 4)
    saved = ckpt_file.read(ckpt_file.latest(tmp_path) or tmp_path)
    history = ElasticSampler.from_history(EpochHistory.from_dict(saved.state.extra["job"]["history"]), rank=0)
    before = set().union(*(set(history.committed(r).tolist()) for r in range(3)))
    assert len(before) == 4 * 3 * BATCH  # four full steps
    partial = tmp_path / ".step-000000000006.fttree.4242.tmp"  # a writer killed mid-write left it
    partial.write_bytes(b"FTTK")
    got: list[set[int]] = []

    def body(rank: int, ar: FTTreeAllreduce) -> None:
        job, model = make_job(ar, tmp_path)
        for epoch in job.epochs(1):
            for x, y in epoch:
                nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                job.step()
            if rank == 0:
                got.append({int(i) for r in range(3) for i in job.sampler.committed(r)} - before)

    ok(run_ranks(3, body))
    assert got[0] == set(range(SIZE)) - before
    assert not partial.exists()  # removed once the ranks agreed on the checkpoint


def test_a_checkpoint_of_another_job_is_refused(tmp_path: Path) -> None:
    killed_at(tmp_path, 2)

    def other_size(rank: int, ar: FTTreeAllreduce) -> Any:
        return make_job(ar, tmp_path, size=SIZE + 1)

    errors = run_ranks(3, other_size)
    assert all(isinstance(e, ConfigError) and "dataset_size 67 there, 68 here" in str(e) for e in errors), errors

    def other_model(rank: int, ar: FTTreeAllreduce) -> Any:
        return make_job(ar, tmp_path, model=nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4)))

    errors = run_ranks(3, other_model)
    assert all(isinstance(e, ConfigError) and "does not fit this job's model" in str(e) for e in errors), errors

    def as_diloco(rank: int, ar: FTTreeAllreduce) -> Any:
        return make_job(ar, tmp_path, diloco=2)

    errors = run_ranks(3, as_diloco)
    assert all(isinstance(e, ConfigError) and "diloco 0 there, 2 here" in str(e) for e in errors), errors


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    killed_at(tmp_path, 2)
    path = ckpt_file.latest(tmp_path)
    assert path is not None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit flipped on disk
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"checkpoint {path} is corrupt: the digest in the file does not match"):
        ckpt_file.read(path)
    path.write_bytes(bytes(data[:40]))  # truncated
    with pytest.raises(ConfigError, match="corrupt"):
        ckpt_file.read(path)
    partial = tmp_path / f".{path.name}.4242.tmp"  # a writer killed mid-write: never read
    partial.write_bytes(bytes(data[:100]))
    assert ckpt_file.latest(tmp_path) == path
    path.write_bytes(b"PK\x03\x04" + bytes(60))  # some other file under the name
    with pytest.raises(ConfigError, match="is not an fttree checkpoint"):
        ckpt_file.read(path)
    errors = run_ranks(3, lambda rank, ar: make_job(ar, tmp_path))
    assert all(isinstance(e, ConfigError) and str(path) in str(e) for e in errors), errors


def test_ranks_that_see_different_checkpoints_refuse_to_start(tmp_path: Path) -> None:
    killed_at(tmp_path / "a", 2)
    killed_at(tmp_path / "b", 4)

    def body(rank: int, ar: FTTreeAllreduce) -> Any:
        return make_job(ar, tmp_path / ("a" if rank == 0 else "b"))

    errors = run_ranks(3, body)
    assert all(isinstance(e, ConfigError) and "every rank must see the same checkpoint" in str(e)
               for e in errors), errors


def test_checkpoint_settings_are_checked() -> None:
    def body(rank: int, ar: FTTreeAllreduce) -> list[Exception]:
        out = []
        for kw in ({"checkpoint_every": 0}, {"checkpoint_dir": "x", "diloco": 2, "overlap": True, "joins": False}):
            model = mlp(0)
            try:
                fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), batch_size=BATCH,
                                  allreduce=ar, **kw)
            except ConfigError as exc:
                out.append(exc)
        return out

    for errors in ok(run_ranks(1, body)):
        assert "checkpoint_every must be an integer >= 1" in str(errors[0])
        assert "checkpoint_dir with overlap=True" in str(errors[1])


@pytest.mark.parametrize(("diloco", "schedule"), [(0, False), (2, False), (0, True)])
def test_a_resumed_job_ends_with_the_parameters_of_one_never_stopped(tmp_path: Path, diloco: int,
                                                                     schedule: bool) -> None:
    """The checkpoint holds everything training depends on: the optimizer's momentum (with
    DiLoCo the outer momentum, the global parameters and the inner optimizer too), the LR
    scheduler's position and the sampler's. A job stopped dead after step 4 and resumed from its
    checkpoint ends with the same parameter bits as one that ran straight through."""
    def straight(rank: int, ar: FTTreeAllreduce) -> list[torch.Tensor]:
        job, model = make_job(ar, tmp_path / "straight", diloco=diloco, schedule=schedule)
        loop(job, model, 2)
        return [p.detach().clone() for p in model.parameters()]

    expected = ok(run_ranks(3, straight))[0]
    killed_at(tmp_path / "cut", 4, diloco, schedule)
    for _, _, path, params in resumed(tmp_path / "cut", diloco=diloco, schedule=schedule):
        assert path is not None
        for a, b in zip(expected, params, strict=True):
            assert torch.equal(a, b)


def test_ranks_that_had_left_before_the_checkpoint_are_taken_back_on_resume(tmp_path: Path) -> None:
    """Rank 2 leaves after two steps; the checkpoint after step 4 has the view [0, 1]. All
    three processes start again: the resumed epoch takes rank 2 back in (one step with no
    contributors, its batches dealt again), and the epoch is still committed once."""
    def first(rank: int, ar: FTTreeAllreduce) -> None:
        job, model = make_job(ar, tmp_path)

        def die(report: StepReport) -> None:
            if report.step == 4:
                raise Killed(f"rank {rank}")

        job.step_listeners.append(die)
        for epoch in job.epochs(2):
            for x, y in epoch:
                nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                job.step()
                if rank == 2 and job.training_steps == 2:
                    ar.leave()  # gone for good
                    return

    run_ranks(3, first)
    saved = ckpt_file.read(ckpt_file.latest(tmp_path) or tmp_path)
    assert saved.meta["step"] == 4
    history = EpochHistory.from_dict(saved.state.extra["job"]["history"])
    assert ElasticSampler.from_history(history, rank=0).members == (0, 1)
    results = resumed(tmp_path)
    assert_once(results[0][0], 2, (0, 1, 2))
    for summaries, reports, _, _ in results:
        assert summaries == results[0][0]
        assert reports[0].contributors == (0, 1, 2)


def test_a_job_that_had_taken_all_its_steps_takes_none_when_started_again(tmp_path: Path) -> None:
    """epochs(steps=7): the job stops after 7 steps (one into epoch 1) and checkpoints there; started again with the
    same limit it trains nothing more (its one epoch ends at once, audited as before)."""
    def body(rank: int, ar: FTTreeAllreduce) -> tuple[int, list[StepReport], list[EpochSummary]]:
        reports: list[StepReport] = []
        job, model = make_job(ar, tmp_path, every=100, reports=reports)
        out = []
        for epoch in job.epochs(2, steps=7):
            for x, y in epoch:
                nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                job.step()
            out.append(epoch.summary)
        return job.training_steps, reports, out

    for steps, reports, summaries in ok(run_ranks(3, body)):
        assert (steps, len(reports)) == (7, 7)
        assert [(s.epoch, s.complete, s.committed) for s in summaries] == [(0, True, SIZE), (1, False, 3 * BATCH)]
    for steps, reports, summaries in ok(run_ranks(3, body)):
        assert (steps, reports) == (7, [])
        assert [(s.epoch, s.complete, s.committed) for s in summaries] == [(1, False, 3 * BATCH)]


def test_scheduler_settings_are_checked() -> None:
    def body(rank: int, ar: FTTreeAllreduce) -> list[Exception]:
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD(mlp(1).parameters(), lr=0.1)
        out: list[Exception] = []
        for kw in ({"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)},
                   {"scheduler": torch.optim.lr_scheduler.StepLR(other, 3)},
                   {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3), "diloco": 2},
                   {"scheduler": "cosine"}):
            try:
                fttree.ElasticJob(model, opt, Pairs(), batch_size=BATCH, allreduce=ar, **kw)  # type: ignore[arg-type]
            except (ConfigError, TypeError) as exc:
                out.append(exc)
        return out

    for errors in ok(run_ranks(1, body)):
        assert len(errors) == 4
        assert "ReduceLROnPlateau" in str(errors[0])
        assert "another optimizer" in str(errors[1])
        assert "diloco" in str(errors[2])
        assert "must be an LR scheduler" in str(errors[3])


def test_a_checkpoint_without_the_jobs_scheduler_is_refused(tmp_path: Path) -> None:
    """A job given scheduler= that finds a checkpoint written without one (or the other way
    round) says so instead of resuming with the LR at its start."""
    killed_at(tmp_path, 4)

    def body(rank: int, ar: FTTreeAllreduce) -> Any:
        return make_job(ar, tmp_path, schedule=True)

    for err in run_ranks(3, body):
        assert isinstance(err, ConfigError)
        assert "scheduler" in str(err)
