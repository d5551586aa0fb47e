"""fttree.ElasticJob in process: a few workers on threads over loopback TCP run the loop as a
user writes it, and each epoch's summary says every sample was committed exactly once, with
the models alike at the end. The real-process guarantees (crash, restart, straggler, DiLoCo
with a restart) are tested through examples/train_mlp.py, which runs on ElasticJob."""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fttree
from fttree import ConfigError, FTTreeAllreduce
from fttree.training.job import EpochSummary, StepReport

from .test_torch_optim import mlp, ok, run_ranks

SIZE = 3 * 4 * 5 + 7  # not a multiple of the global batch: partial and empty batches at the end
BATCH = 4


class Pairs(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(features, label), as a user's dataset returns them: no sample index."""

    def __init__(self, size: int = SIZE) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(size, 12, generator=g), torch.randint(0, 4, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loop(job: fttree.ElasticJob, model: nn.Module, epochs: int) -> list[EpochSummary]:
    """The README's loop."""
    out = []
    for epoch in job.epochs(epochs):
        for x, y in epoch:
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            job.step()
        out.append(epoch.summary)
    return out


def assert_once(summaries: list[EpochSummary], epochs: int, ranks: tuple[int, ...], first: int = 0) -> None:
    assert [s.epoch for s in summaries] == list(range(first, first + epochs))
    for s in summaries:
        assert s.complete, s
        assert s.once, s
        assert s.committed == s.distinct == SIZE, s
        assert s.repeated == s.missing == 0, s
        assert s.answered == ranks, s


@pytest.mark.parametrize(("diloco", "overlap", "workers"), [(0, False, 0), (3, False, 0), (2, True, 0), (0, False, 2)])
def test_every_sample_once_per_epoch_and_the_models_alike(diloco: int, overlap: bool, workers: int) -> None:
    """Data-parallel, DiLoCo rounds (their empty local batches stepped by the job), DiLoCo
    with overlap (a round committed a round late, the last at the epoch's end), and loader
    processes that prefetch ahead of the commits."""
    def body(rank: int, ar: FTTreeAllreduce) -> tuple[list[EpochSummary], list[torch.Tensor], list[StepReport]]:
        model = mlp(0)
        reports: list[StepReport] = []
        job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), batch_size=BATCH,
                                allreduce=ar, diloco=diloco, overlap=overlap, num_workers=workers,
                                bucket_mb=0.0005, on_step=reports.append)
        summaries = loop(job, model, 2)
        return summaries, [p.detach().clone() for p in model.parameters()], reports

    results = ok(run_ranks(3, body))
    for summaries, _, reports in results:
        assert_once(summaries, 2, (0, 1, 2))
        assert [r.step for r in reports] == list(range(len(reports)))  # every training step, once
        assert all(r.contributors == (0, 1, 2) for r in reports)
    assert sum(r.trained for _, _, reports in results for r in reports) == 2 * SIZE
    assert results[0][0] == results[1][0] == results[2][0]  # one account, whoever prints it
    for got in results[1:]:
        for a, b in zip(results[0][1], got[1], strict=True):
            assert torch.equal(a, b)


def test_a_diloco_round_with_no_sample_for_a_rank_is_one_round() -> None:
    """74 samples, 3 ranks, rounds of 3 x 4 per rank: the last round holds 2 samples, so a rank
    gets none in it; the epoch steps its 3 empty local steps once (stepping them for each
    of its empty local batches made it run rounds the others did not)."""
    size = 2 * 3 * 3 * BATCH + 2

    def body(rank: int, ar: FTTreeAllreduce) -> list[EpochSummary]:
        model = mlp(0)
        job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(size), batch_size=BATCH,
                                allreduce=ar, diloco=3, joins=False, bucket_mb=0.0005)  # no flag to end it early
        return loop(job, model, 2)

    for summaries in ok(run_ranks(3, body)):
        assert [(s.once, s.committed, s.steps) for s in summaries] == [(True, size, 3)] * 2, summaries


def test_a_rank_that_leaves_mid_epoch_leaves_its_samples_to_the_others() -> None:
    """Rank 2 leaves the group after two training steps: its committed samples count once, the
    rest of its share goes to ranks 0 and 1, and they still audit the epoch complete."""
    def body(rank: int, ar: FTTreeAllreduce) -> list[EpochSummary] | None:
        model = mlp(0)
        job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), batch_size=BATCH,
                                allreduce=ar, joins=False, bucket_mb=0.0005)
        if rank != 2:
            return loop(job, model, 2)
        for epoch in job.epochs(2):
            for x, y in epoch:
                nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                job.step()
                if job.training_steps == 2:
                    ar.leave()  # gone for good: no audit, no later step
                    return None
        raise AssertionError("rank 2 never left")

    results = ok(run_ranks(3, body, node_deadline_s=1.0))
    first, second = results[0]
    assert first == results[1][0]
    assert first.once, first
    assert (first.departed, first.answered) == ((2,), (0, 1)), first
    assert first.moved > 0
    assert second.once, second
    assert (second.departed, second.answered) == ((), (0, 1)), second


def test_a_rank_lost_between_its_last_step_and_the_audit_is_counted_from_the_history() -> None:
    """Rank 2 takes part in every step of epoch 0 and dies before its audit: the audit's sum
    lacks its counts, and it has not departed (no committed step changed the members). What
    it committed comes from the history every member holds; the audit used to miss it and
    say 1/3 of the epoch was never trained (found by `fttree chaos`)."""
    steps = -(-SIZE // (3 * BATCH))  # the epoch's training steps
    all_stepped = threading.Barrier(3)

    def body(rank: int, ar: FTTreeAllreduce) -> list[EpochSummary] | None:
        model = mlp(0)
        job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), batch_size=BATCH,
                                allreduce=ar, joins=False, bucket_mb=0.0005)
        summaries = []
        for epoch in job.epochs(2):
            for x, y in epoch:
                nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                job.step()
                if job.training_steps == steps:
                    all_stepped.wait(timeout=60)  # every rank holds the epoch's last result
                    if rank == 2:
                        ar.crash("killed after the epoch's last step")
                        return None
            summaries.append(epoch.summary)
        return summaries

    results = ok(run_ranks(3, body, node_deadline_s=1.0))
    first, second = results[0]
    assert results[1][0] == first
    assert (first.departed, first.answered) == ((), (0, 1)), first
    assert first.once, first
    assert first.committed == SIZE, first
    assert second.once, second


@pytest.mark.parametrize("how", ["break", "steps", "stop"])
def test_leaving_an_epoch_early_stops_the_job_on_every_rank(how: str) -> None:
    """Every rank leaves after training step 2 (a `break`, `epochs(steps=3)`, or `job.stop()`
    from a step listener): the epoch's summary says it stopped with nothing committed twice,
    and epochs() ends."""
    def body(rank: int, ar: FTTreeAllreduce) -> tuple[list[EpochSummary], int]:
        model = mlp(0)
        job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), batch_size=BATCH,
                                allreduce=ar, bucket_mb=0.0005)
        if how == "stop":
            job.step_listeners.append(lambda report: job.stop() if report.step == 2 else None)
        seen = []
        for epoch in job.epochs(steps=3 if how == "steps" else None):
            for x, y in epoch:
                nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                job.step()
                if how == "break" and job.training_steps == 3:
                    break
            seen.append(epoch.summary)
        return seen, job.training_steps

    for seen, steps in ok(run_ranks(3, body)):
        assert steps == 3
        (summary,) = seen
        assert not summary.complete, summary
        assert not summary.once, summary
        assert summary.committed == summary.distinct == 3 * 3 * BATCH, summary
        assert summary.repeated == 0, summary


def test_misuse_is_named() -> None:
    def body(rank: int, ar: FTTreeAllreduce) -> list[str]:
        model = mlp(0)
        job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), batch_size=BATCH,
                                allreduce=ar, bucket_mb=0.0005)
        errors = []
        with pytest.raises(ConfigError) as e1:
            job.step()
        errors.append(str(e1.value))
        epochs = job.epochs(1)
        epoch = next(epochs)
        x, y = next(epoch)
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        with pytest.raises(ConfigError) as e2:
            next(epoch)
        errors.append(str(e2.value))
        job.step()
        for x, y in epoch:
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            job.step()
        assert epoch.summary.once
        with pytest.raises(ConfigError) as e3:
            next(job.epochs(1))
        errors.append(str(e3.value))
        return errors

    for errors in ok(run_ranks(2, body)):
        assert "without a batch" in errors[0]
        assert "without job.step() on the last one" in errors[1]
        assert "runs once per job" in errors[2]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"batch_size": True}, "batch_size must be an integer >= 1"),
    ({"batch_size": 4, "diloco": -1}, "diloco must be an integer >= 0"),
    ({"batch_size": 4, "overlap": True}, "needs diloco=H"),
    ({"batch_size": 4, "compression": "sparse"}, "sends a share of DiLoCo's pseudo-gradients"),
    ({"batch_size": 4, "compression": fttree.Sparse()}, "it needs diloco=H"),
    ({"batch_size": 4, "diloco": 2, "overlap": True, "joins": True}, "joins=True with overlap=True"),
    ({"batch_size": 4, "num_workers": -1}, "num_workers must be an integer >= 0"),
    ({"batch_size": 4, "prefetch_factor": 2}, "needs num_workers > 0"),
    ({"batch_size": 4, "num_workers": 1, "prefetch_factor": 0}, "prefetch_factor must be an integer >= 1"),
])
def test_bad_settings_are_refused_by_name(kwargs: dict[str, Any], says: str) -> None:
    model = mlp(0)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), **kwargs)


def test_bad_objects_are_refused_by_name() -> None:
    model, other = mlp(0), mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="not the model's parameters"):
        fttree.ElasticJob(model, torch.optim.SGD(other.parameters(), lr=0.1), Pairs(), batch_size=4)
    with pytest.raises(ConfigError, match="map-style dataset"):
        fttree.ElasticJob(model, opt, iter(range(3)), batch_size=4)
    with pytest.raises(ConfigError, match="dataset is empty"):
        fttree.ElasticJob(model, opt, Pairs(0), batch_size=4)
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        fttree.ElasticJob(opt, opt, Pairs(), batch_size=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be an FTTreeAllreduce"):
        fttree.ElasticJob(model, opt, Pairs(), batch_size=4, allreduce=object())  # type: ignore[arg-type]


def readme_loop() -> str:
    """The README's ElasticJob block, less the line that starts a handle from the environment
    (the test's workers are threads of one process, each with its own handle)."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = next(b for b in (part.split("```")[0] for part in text.split("```python")[1:]) if "ElasticJob" in b)
    lines = block.strip().splitlines()
    assert len(lines) <= 15, f"the README's loop grew to {len(lines)} lines"
    return "\n".join(line for line in lines if not line.startswith("ar = "))


def test_the_readmes_loop_trains_every_sample_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = readme_loop()
    monkeypatch.chdir(tmp_path)  # its checkpoint_dir="ckpt" is relative

    def body(rank: int, ar: FTTreeAllreduce) -> list[EpochSummary]:
        scope: dict[str, Any] = {"model": mlp(0), "dataset": Pairs(), "ar": ar}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, scope)
        summaries: list[EpochSummary] = scope["job"].summaries
        return summaries

    for summaries in ok(run_ranks(3, body)):
        assert_once(summaries, 10, (0, 1, 2))
    assert (tmp_path / "ckpt").is_dir()  # the finished job's checkpoints: started again, it has nothing left


def test_plain_outer_sgd_is_outer_momentum_zero() -> None:
    """`outer_momentum=0` asks for plain outer SGD (SparseLoCo's outer step); the job used to
    pass it on with Nesterov, which DiLoCo refuses."""
    def body(rank: int, ar: FTTreeAllreduce) -> tuple[float, bool]:
        model = mlp(0)
        job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(), batch_size=BATCH,
                                allreduce=ar, diloco=2, outer_lr=1.0, outer_momentum=0.0, joins=False,
                                bucket_mb=0.0005)
        assert isinstance(job.opt, fttree.DiLoCo)
        group = job.opt.outer.optimizer.param_groups[0]
        loop(job, model, 1)
        return group["momentum"], group["nesterov"]

    assert ok(run_ranks(2, body)) == [(0.0, False)] * 2
