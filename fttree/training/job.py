"""ElasticJob: fttree's exactly-once training loop as one object.

    job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset,
                            batch_size=100, allreduce=ar)          # or diloco=32, compression="int8"
    for epoch in job.epochs(10):
        for x, y in epoch:                  # this rank's share; every sample once per epoch over the group
            loss_fn(model(x), y).backward()
            job.step()                      # average, update, commit, clear the gradients
        print(epoch.summary)                # committed samples (each once), contributors, late steps

The protocol the loop no longer writes, and why each part is needed (the guarantees are the
sampler's and the optimizer's; see fttree.data.sampler and fttree.training.elastic):

- Every member takes part in every collective in the same order, or the group hangs. A rank
  whose sampler has nothing left for a step, a straggler the group already closed a step
  without (`steps_behind`), and a joiner waiting for the group's state all still step, with
  `contribute=False`; the epoch iterator does that itself and never hands the loop an empty
  batch.
- Each training step is committed from what the optimizer saw of it (`commit_from`): the
  contributors of every gradient bucket and the next view, bit for bit alike on every
  survivor, so the samplers stay alike with no messages of their own.
- DiLoCo: a training step is a round of `diloco` local steps; the sampler deals the round's
  samples at once and the epoch iterator splits them into `diloco` local batches (empty ones
  stepped here). With `overlap=True` (or "eager") a round is committed when the next one ends (its outer
  step runs behind the next local steps), and the last one at the epoch's end (`flush`).
- A restarted or new process (a joiner) has no epoch until the state and the sampler's
  history come from a peer (`ElasticSampler.follow`): `epochs()` steps it with empty
  contributions until its sampler deals to it, then it trains like the others.
- The epoch audit is one allreduce of a count per sample (plus each rank's cache fetches)
  that every member makes: the summary then says, group-wide, how often each sample was
  committed. A joiner that waits cannot know when an epoch ends, yet must make that
  allreduce; with `joins=True` every training step is therefore followed by one allreduce
  of two numbers (the epoch ends; the job stops) that every process makes, joiners included.
  `joins=False` saves it, and a process that would join such a job is refused at once with
  a ConfigError (it would hang the group at the next audit); `audit=False` needs no flag and
  takes the counts from the sampler's shared history instead.

Whole-job restart (`checkpoint_dir=DIR`): the lowest-ranked member writes the model, the
optimizer state (DiLoCo: global parameters and both optimizers; each rank also writes its own
inner optimizer), the LR scheduler's state (`scheduler=`), the step count and the epoch's
sampler history every `checkpoint_every`
training steps and at each epoch's end (fttree.training.checkpoint). A job whose every process
died, started again, resumes from the newest file: the history's commits are not dealt again,
later samples are, so the audits still say each sample once.

Leaving an epoch early (`break`) ends the job: every member must leave after the same training
step (decide on something every member sees alike: `job.training_steps`, a step's
contributors), and with DiLoCo only at a round's end (`job.step()` returned True).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..api import FTTreeAllreduce
from ..data.cache import CachedDataset
from ..data.sampler import CollateOrNone, ElasticSampler, loader_horizon
from ..errors import ConfigError
from . import checkpoint as ckpt_file
from .buckets import DEFAULT_BUCKET_MB
from .diloco import DiLoCo, check_overlap
from .optim import DistributedOptimizer, TrainingStep
from .sparse import Sparse
from .state import StateMismatch, capture, encode, load

__all__ = ["ElasticJob", "Epoch", "EpochSummary", "StepReport"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """One committed training step (a DiLoCo round) as this process saw it: for progress
    lines and decisions every member must take alike (its contributors are the same on every
    survivor)."""

    step: int  # training step, counted from 0 as fault windows count them
    epoch: int
    contributors: tuple[int, ...]  # ranks whose batch the step's average holds
    late: tuple[int, ...]  # members the step closed without (straggler_policy="deadline")
    trained: int  # samples this process trained in it (0: an empty turn, a skipped step, or waiting)
    skipped: bool  # this process was late: the group had closed the step without it
    waiting: bool  # this process is joining: no state and no samples yet


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochSummary:
    """What one epoch committed, over the whole group (`answered` says whose counts are in;
    empty with audit=False, when the counts are the sampler history's)."""

    epoch: int
    complete: bool  # every step of the epoch committed (False: the job stopped inside it)
    samples: int  # samples in the dataset
    committed: int  # sample commits, all ranks together
    distinct: int  # samples committed at least once
    repeated: int  # samples committed more than once (never, if fttree keeps its promise)
    missing: int  # samples committed by nobody (0 when complete)
    once: bool  # complete, and every sample committed exactly once
    departed: tuple[int, ...]  # ranks that left the view during the epoch (their commits counted)
    answered: tuple[int, ...]  # ranks whose counts the audit holds
    moved: int  # samples dealt again after a departure or a failed contribution
    fetched: int  # samples read from the source by CachedDataset, all ranks together
    steps: int  # training steps of the epoch this process took part in
    fewest_contributors: int | None  # the fewest ranks one of those steps' averages held
    late: dict[int, int] = field(default_factory=dict)  # rank -> steps closed without it

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, str keys), for JSON."""
        return {"epoch": self.epoch, "complete": self.complete, "samples": self.samples,
                "committed": self.committed, "distinct": self.distinct, "repeated": self.repeated,
                "missing": self.missing, "once": self.once, "departed": list(self.departed),
                "answered": list(self.answered), "moved": self.moved, "fetched": self.fetched,
                "steps": self.steps, "fewest_contributors": self.fewest_contributors,
                "late": {str(r): n for r, n in sorted(self.late.items())}}

    def __str__(self) -> str:
        if self.complete:
            verdict = "each once" if self.once else \
                f"NOT exactly once: {self.repeated} repeated, {self.missing} missing"
            head = f"epoch {self.epoch}: {self.committed} of {self.samples} samples committed, {verdict}"
        else:
            verdict = "none twice" if not self.repeated else f"{self.repeated} TWICE"
            head = (f"epoch {self.epoch} stopped early: {self.committed} of {self.samples} samples committed "
                    f"so far, {verdict}")
        left = (f"; ranks {list(self.departed)} left the view ({self.moved} samples dealt again)"
                if self.departed else "")
        late = f"; late steps {dict(sorted(self.late.items()))}" if self.late else ""
        cache = f"; cache fetches {self.fetched}" if self.fetched else ""
        return head + left + late + cache


@dataclass(frozen=True, slots=True)
class _Part:
    """One local batch as the loader will deliver it: its samples, and its place in the round."""

    indices: tuple[int, ...]
    index: int  # 0 .. parts-1 within the round
    filled: int  # local batches of the round with samples (they come first)


class _Rounds:
    """The DataLoader's batch sampler: each training step's batch from the ElasticSampler,
    split into the round's local batches, each recorded (in order: the loader delivers in
    order) so the job knows which samples a delivered batch holds without asking the dataset."""

    def __init__(self, sampler: ElasticSampler, parts: int) -> None:
        self.sampler, self.parts = sampler, parts
        self.queue: deque[_Part] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        self.queue.clear()  # a new loader iterator: an abandoned one's parts will never come
        for batch in self.sampler:
            if self.parts == 1:
                self.queue.append(_Part(tuple(batch), 0, 1 if batch else 0))
                yield batch
                continue
            split = [list(map(int, p)) for p in np.array_split(np.asarray(batch, dtype=np.int64), self.parts)]
            filled = sum(1 for p in split if p)
            for k, part in enumerate(split):
                self.queue.append(_Part(tuple(part), k, filled))
                yield part

    def __len__(self) -> int:
        return len(self.sampler) * self.parts


class _Settled:
    """What the sampler commits from: the newest step whose result this worker took in. With
    DiLoCo's overlap the outer step in flight may finish on its own thread at any moment; its
    record must not be committed before the round that waits for it ends."""

    def __init__(self, step: TrainingStep | None, syncing: bool) -> None:
        self.last_step, self.syncing = step, syncing


class Epoch:
    """One epoch of this rank's batches (an iterator: `for x, y in epoch`). `summary` is
    ready when the iteration ends (reading it after a `break` ends the job's epochs)."""

    def __init__(self, job: ElasticJob, number: int) -> None:
        self.job, self.number = job, number
        self._it: Iterator[Any] | None = None
        self._summary: EpochSummary | None = None
        self.stopped = False  # left early: the job's last epoch
        self.final = False  # the last of job.epochs(count)

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> Any:
        return self.job._next_batch(self)

    @property
    def summary(self) -> EpochSummary:
        """The epoch's audit (see EpochSummary). Read before the iteration ended, it ends the
        epoch here and the job with it: every member must do so after the same step."""
        if self._summary is None:
            self.job._end_epoch(self, stop=True)
        assert self._summary is not None
        return self._summary

    def __repr__(self) -> str:
        return f"Epoch({self.number}{', done' if self._summary is not None else ''})"


def _positive_int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


class ElasticJob:
    """Data-parallel (or DiLoCo) training in which every sample is committed once per epoch,
    whoever dies, lags or joins. See the module docstring for the loop and the protocol.

    `model` and `optimizer` (a plain torch optimizer over the model's parameters; the inner one
    with `diloco`) are wrapped here; `dataset` is any map-style dataset (`__len__`,
    `__getitem__`), read through a DataLoader with `num_workers`, `pin_memory`,
    `prefetch_factor` and `collate_fn` (default torch's). `batch_size` counts one local step's
    samples on one rank. `allreduce`: a started FTTreeAllreduce (default: the fttree process
    group's, else one from the environment). `checkpoint_dir`: write whole-job checkpoints there
    every `checkpoint_every` training steps and at epoch ends, and resume from the newest one
    found (see the module docstring). `scheduler`: an LR scheduler of `optimizer` that the job
    steps after every optimizer step (empty turns too, so every rank's LR is alike), checkpoints
    and hands to joiners with the state; data-parallel only. Not in the checkpoint: RNG states
    (dropout masks after a resume differ from an uninterrupted run's). Every rank must pass the
    same settings."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, *,
                 batch_size: int, allreduce: FTTreeAllreduce | None = None, diloco: int = 0,
                 overlap: bool | str = False, compression: str | Sparse | None = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB,
                 seed: int = 0, stable: bool = False, num_workers: int = 0, prefetch_factor: int | None = None,
                 pin_memory: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None,
                 joins: bool | None = None, audit: bool = True, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, on_step: Callable[[StepReport], None] | None = None,
                 checkpoint_dir: str | PathLike[str] | None = None, checkpoint_every: int = 100,
                 scheduler: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ElasticJob: model must be a torch.nn.Module, not {type(model).__name__}")
        if isinstance(optimizer, DistributedOptimizer | DiLoCo):
            raise ConfigError("ElasticJob wraps the optimizer itself: pass the plain torch optimizer, not a "
                              f"{type(optimizer).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ElasticJob: optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ConfigError("ElasticJob: the optimizer holds tensors that are not the model's parameters "
                              "(build it from model.parameters())")
        if not callable(getattr(dataset, "__len__", None)) or not callable(getattr(dataset, "__getitem__", None)):
            raise ConfigError(f"ElasticJob: dataset must have __len__ and __getitem__ (a map-style dataset), "
                              f"got {type(dataset).__name__}")
        size = len(dataset)
        if size < 1:
            raise ConfigError("ElasticJob: the dataset is empty")
        batch_size = _positive_int("batch_size", batch_size, 1)
        diloco = _positive_int("diloco", diloco, 0)
        num_workers = _positive_int("num_workers", num_workers, 0)
        if prefetch_factor is not None:
            _positive_int("prefetch_factor", prefetch_factor, 1)
            if not num_workers:
                raise ConfigError(f"prefetch_factor={prefetch_factor} needs num_workers > 0 (loader processes to "
                                  f"prefetch with)")
        overlap = check_overlap(overlap)
        if overlap and not diloco:
            raise ConfigError(f"overlap={overlap!r} overlaps DiLoCo's outer steps: it needs diloco=H (local steps per "
                              f"round)")
        if (isinstance(compression, Sparse) or compression == "sparse") and not diloco:
            raise ConfigError("compression='sparse' sends a share of DiLoCo's pseudo-gradients: it needs diloco=H; "
                              "a data-parallel step takes 'bf16', 'fp16' or 'int8'")
        if joins is None:
            joins = not overlap
        _check_scheduler(scheduler, optimizer, diloco)
        checkpoint_every = _positive_int("checkpoint_every", checkpoint_every, 1)
        if checkpoint_dir is not None and overlap:
            raise ConfigError(f"checkpoint_dir with overlap={overlap!r}: an overlapped round's outer step is still "
                              "in flight when the next round trains, so no step boundary holds a model that matches "
                              "the committed samples; checkpoint without overlap")
        if joins and overlap:
            raise ConfigError(f"joins=True with overlap={overlap!r}: an overlapped round is committed a round late, "
                              "and a joining process could not tell when an epoch ends; use one or the other")
        if allreduce is None:
            allreduce = _default_allreduce()
        if not isinstance(allreduce, FTTreeAllreduce):
            raise TypeError(f"ElasticJob: allreduce must be an FTTreeAllreduce, not {type(allreduce).__name__}")
        if allreduce.node is None:
            raise ConfigError("ElasticJob: the FTTreeAllreduce is not started: call .start() first")
        self.model, self.dataset, self.allreduce = model, dataset, allreduce
        self.scheduler = scheduler
        self.rank = allreduce.rank
        self._parts = diloco or 1  # local steps per training step
        self._lag = 1 if overlap else 0
        stable = stable or isinstance(dataset, CachedDataset)
        horizon = loader_horizon(num_workers, prefetch_factor) + self._lag
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self._job_meta = {"world": allreduce.world, "dataset_size": size, "batch_size": batch_size * self._parts,
                          "seed": seed, "stable": stable, "horizon": horizon, "diloco": diloco}
        # A joiner (one process restarted while the others run) takes the group's state
        # instead, and leaves the directory to the writer
        found = self._load_checkpoint(optimizer) if self.checkpoint_dir is not None and not allreduce.joining \
            else None
        self.opt: DistributedOptimizer | DiLoCo
        if diloco:
            self.opt = DiLoCo(model, optimizer, allreduce=allreduce, sync_every=diloco, compression=compression,
                              overlap=overlap, bucket_mb=bucket_mb, outer_lr=outer_lr, outer_momentum=outer_momentum,
                              nesterov=outer_momentum > 0)
        else:
            assert not isinstance(compression, Sparse)  # refused above without diloco
            self.opt = DistributedOptimizer(optimizer, model, allreduce=allreduce, bucket_mb=bucket_mb,
                                            compression=compression)
            if scheduler is not None:
                self.opt.register_scheduler(scheduler)  # a joiner takes it over with the state
        self.joining = self.opt.syncing  # this process joins a running job (restarted, or new)
        if self.joining and not joins:
            raise ConfigError(f"rank {self.rank} joins a running job, but the job was built with joins=False"
                              f"{f' (overlap={overlap!r})' if overlap else ''}: it could not take part in the epoch "
                              f"audits; "
                              f"build every rank's ElasticJob with joins=True to take processes back")
        self.diloco, self.overlap, self.audit, self.joins = diloco, overlap, audit, joins
        self._flags = joins and audit  # one flag allreduce after every training step
        self.sampler = ElasticSampler.follow(self.opt, size, batch_size * self._parts, seed=seed, stable=stable,
                                             horizon=horizon)
        # Training steps taken before this process's optimizer counted its first: a resumed
        # job's (its optimizer counts from 0 again), taken over by a joiner with the state.
        self._base = 0
        self.opt.register_state("elastic job", lambda: {"base": self._base}, self._set_base)
        self._rounds = _Rounds(self.sampler, self._parts)
        extra: dict[str, Any] = {"prefetch_factor": prefetch_factor} if num_workers and prefetch_factor else {}
        self.loader = torch.utils.data.DataLoader(dataset, batch_sampler=self._rounds, num_workers=num_workers,
                                                  collate_fn=CollateOrNone(collate_fn), pin_memory=pin_memory,
                                                  timeout=120 if num_workers else 0, **extra)
        self.step_listeners: list[Callable[[StepReport], None]] = [on_step] if on_step is not None else []
        self.late: Counter[int] = Counter()  # rank -> training steps closed without it, this process's run
        self.fewest_contributors: int | None = None  # over the steps since this process held the state
        self.summaries: list[EpochSummary] = []
        self._round = 0  # the training step the next local batches belong to
        self._part_no = 0  # local steps taken in this round
        self._round_samples: list[int] = []
        self._in_flight: dict[int, list[int]] = {}  # training step -> this rank's samples in it, until committed
        self._committed = -1  # the newest training step committed
        self._pending: _Part | None = None  # a batch handed to the loop, awaiting job.step()
        self._flag_due = False
        self._skipping = False  # the round being finished is a straggler's skip
        self._trained: list[int] = []  # this epoch: samples this rank trained in steps that list it
        self._epoch_steps = 0
        self._epoch_fewest: int | None = None
        self._epoch_late: Counter[int] = Counter()
        self._fetched_at = self._fetches()
        self._started = False
        self._current: Epoch | None = None
        self._max_steps: int | None = None  # epochs(steps=)
        self._stop = False  # stop() was called
        self._stopping = False  # the job ends after the training step just taken
        self._resume_at: tuple[int, bool] | None = None  # a resumed job's epoch, and whether it is under way
        self._next_members: tuple[int, ...] | None = None  # the view the next epoch starts with, if not the sampler's
        self.resumed_from: Path | None = None  # the checkpoint this job resumed from
        self.resumed_step: int | None = None  # ...and the training step count it was written at
        if self.checkpoint_dir is not None and not self.joining:  # a joiner takes the group's state instead
            self._agree(found)
            # past the agreement no rank writes until this one has taken a step with them
            ckpt_file.drop_partial(self.checkpoint_dir)
            if found is not None:
                self._resume(found)

    # ---- the loop ----------------------------------------------------------------------------

    @property
    def training_steps(self) -> int:
        """The training step (DiLoCo: round) the next batch belongs to, alike on every member."""
        return self._round + self._base

    @property
    def last_step(self) -> TrainingStep | None:
        """The newest committed training step: its contributors, late ranks and next view."""
        return self._settled().last_step

    def epochs(self, count: int | None = None, *, steps: int | None = None) -> Iterator[Epoch]:
        """Epochs up to number `count` (None: no limit), ending the job after training step
        `steps` (DiLoCo: rounds; None: no limit), inside an epoch if so. A joiner first waits
        for the group's state and history here, then starts in the group's epoch."""
        if count is not None:
            _positive_int("count", count, 1)
        if steps is not None:
            _positive_int("steps", steps, 1)
        self._max_steps = steps
        if self._started:
            raise ConfigError("ElasticJob.epochs() runs once per job")
        self._started = True
        self.opt.zero_grad()
        start = self._join() if self.joining else self._resume_at or (0, False)
        if start is None:
            return  # the job stopped while this process waited
        number, resumed = start
        if steps is not None and self.training_steps >= steps:
            self._stopping = True  # a resumed job that had taken them all: its epoch ends at once
        while count is None or number < count:
            if not resumed:
                self.sampler.set_epoch(number, self._next_members)
                self._next_members = None
            resumed = False
            epoch = self._current = Epoch(self, number)
            epoch._it = iter(self.loader)
            epoch.final = count is not None and number + 1 >= count  # its end flag stops waiting joiners too
            yield epoch
            if epoch._summary is None:  # left without reading the summary: the epoch ends here
                self._end_epoch(epoch, stop=True)
            self._save(None if epoch.stopped else number + 1)
            if epoch.stopped:
                return
            number += 1

    def stop(self) -> None:
        """End the job after the training step under way (its epoch ends there, audited, and
        `epochs()` with it). Every member must call it at the same step: from an `on_step`
        listener, which sees every committed step alike on every member, empty ones included
        (a loop body does not: the epoch steps a rank with nothing to train by itself)."""
        self._stop = True

    def step(self) -> bool:
        """After backward on the batch the epoch gave: average (or DiLoCo's local step, and the
        outer step at a round's end), update, clear the gradients, and commit a finished
        training step. True when a training step (a DiLoCo round) ended here."""
        part = self._pending
        if part is None:
            raise ConfigError("ElasticJob.step() without a batch: call it once after each batch the epoch gives")
        self._pending = None
        self._opt_step(True)
        self.opt.zero_grad()
        self._round_samples.extend(part.indices)
        self._part_no += 1
        if part.index + 1 < part.filled:
            return False
        for _ in range(self._parts - self._part_no):  # the round's empty local batches: nothing to compute
            self._empty_local_step()
        self._round_done()
        return True

    # ---- inside the epoch iterator -------------------------------------------------------------

    def _next_batch(self, epoch: Epoch) -> Any:
        if epoch._summary is not None or epoch._it is None:
            raise StopIteration
        if epoch is not self._current:
            raise ConfigError(f"epoch {epoch.number} is over: iterate the epoch job.epochs() gave last")
        if self._pending is not None:
            raise ConfigError("ElasticJob: the loop asked for the next batch without job.step() on the last one")
        while True:
            if self._stopping:  # stop() or epochs(steps=): after the step that ended here
                self._end_epoch(epoch, stop=True)
                raise StopIteration
            if self._flag_due:
                self._flag_due = False
                ends = self.sampler.finished
                if self._flag(ends, ends and epoch.final)[0]:
                    self._end_epoch(epoch, stop=False, flagged=True)
                    raise StopIteration
            try:
                batch = next(epoch._it)
            except StopIteration:
                self._end_epoch(epoch, stop=False)
                raise
            part = self._rounds.queue.popleft()
            if part.index >= max(part.filled, 1):
                continue  # an empty local batch stepped already: by job.step() at its round's last filled
                # one, or below at its round's first when the whole round is empty
            if batch is None:  # nothing left for this rank this round: take part, counted in no average
                for _ in range(self._parts):
                    self._empty_local_step()
                self._round_done()
                continue
            if isinstance(self.opt, DistributedOptimizer) and self.opt.steps_behind:
                # a straggler (straggler_policy="deadline"): the group closed this step without
                # it; computing it would be wasted. Take the others' average; the batch is dealt again
                self._empty_local_step()
                self._skipping = True
                self._round_done()
                continue
            self._pending = part
            return batch

    def _empty_local_step(self) -> None:
        self.opt.zero_grad()
        self._opt_step(False)
        self._part_no += 1

    def _opt_step(self, contribute: bool) -> None:
        """The optimizer's step, then the LR scheduler's: once per optimizer step on every
        rank, empty turns included, so every rank's LR is alike. A joiner's scheduler comes
        with the group's state: it steps from the step that brought it (the replayed ones
        stepped it already), not while it waits (torch would warn of a step with no update)."""
        self.opt.step(contribute=contribute)
        if self.scheduler is not None and not self.opt.syncing:
            self.scheduler.step()

    def _round_done(self) -> None:
        """A training step's local steps are all taken: remember its samples, commit what finished."""
        self._in_flight[self._round] = [] if self._skipping else self._round_samples
        skipped, self._skipping = self._skipping, False
        self._round_samples, self._part_no = [], 0
        self._round += 1
        self._commit_done(skipped)
        self._flag_due = self._flags
        self._stopping = self._stop or (self._max_steps is not None and self.training_steps >= self._max_steps)
        if self.checkpoint_dir is not None and not self._lag and self.training_steps % self.checkpoint_every == 0 \
                and not self._stopping:  # a stopping job writes at its epoch's end
            self._save(None)

    def _settled(self) -> _Settled:
        opt = self.opt
        step = opt.settled_step if isinstance(opt, DiLoCo) else opt.last_step
        return _Settled(step, opt.syncing)

    def _commit_done(self, skipped: bool = False, waiting: bool = False) -> None:
        """Commit the newest training step if its result is here and not committed yet."""
        source = self._settled()
        done = source.last_step
        if done is None or done.step <= self._committed:
            return
        self._committed = done.step
        if not source.syncing:  # a joiner counts from when it holds the group's model
            self.fewest_contributors = min(self.fewest_contributors or len(done.contributors), len(done.contributors))
            self._epoch_fewest = min(self._epoch_fewest or len(done.contributors), len(done.contributors))
        self.late.update(done.late)
        self._epoch_late.update(done.late)
        samples = self._in_flight.pop(done.step, [])
        counted = self.rank in done.contributors
        if counted:
            self._trained.extend(samples)
        epoch = self.sampler.epoch if self.sampler.member else -1
        self.sampler.commit_from(source)
        if not waiting:
            self._epoch_steps += 1
        report = StepReport(step=done.step + self._base, epoch=epoch, contributors=done.contributors, late=done.late,
                            trained=len(samples) if counted else 0, skipped=skipped, waiting=waiting)
        for listener in self.step_listeners:
            listener(report)

    def _flag(self, ends: bool, stop: bool) -> tuple[bool, bool]:
        """After every training step (joins=True): does the epoch end here, does the job stop?
        A waiting joiner answers no and learns the members' answer."""
        self.allreduce.mark_step(None)  # not a training step: fault windows do not count it
        got = self.allreduce.allreduce(np.array([float(ends), float(stop)], dtype=np.float32))
        return bool(got[0] > 0), bool(got[1] > 0)

    def _join(self) -> tuple[int, bool] | None:
        """A joiner: step with empty contributions until the sampler, with the group's history,
        deals to this rank; take part in the audits of epochs that end meanwhile. Returns the
        epoch to go on in and whether it is already under way, or None if the job stopped."""
        audited = False
        while not self.sampler.member:
            for _ in range(self._parts):
                self.opt.zero_grad()
                self._opt_step(False)
            self._commit_done(waiting=True)
            audited = False
            if self._flags:
                ends, stop = self._flag(False, False)
                if ends:  # an epoch ended while this process waited: it answers that audit here
                    self._audit_allreduce(self._waiting_answer())
                    audited = True
                if stop:
                    return None
        done = self.opt.last_step
        assert done is not None
        self._round = done.step + 1 + self._lag
        if audited and self.sampler.finished:  # the epoch it became a member in was audited already
            return self.sampler.epoch + 1, False
        self._trained = self.sampler.committed(self.rank).tolist()  # what its earlier process committed
        return self.sampler.epoch, True

    def _waiting_answer(self) -> npt.NDArray[np.int32]:
        """A joiner's counts for an audit it meets while it waits. Not yet a member: nothing
        (every rank adds its rank's earlier process from the history, as a departed rank's).
        Made a member by the step just committed, the epoch's last: the others now take its
        answer instead of the history, so it answers what its rank committed in the epoch,
        its earlier process's samples. Answering nothing there lost them (`fttree chaos`)."""
        counts = np.zeros(len(self.dataset) + self.allreduce.world, dtype=np.int32)
        if self.sampler.member:
            np.add.at(counts, self.sampler.committed(self.rank), 1)
        return counts

    # ---- the end of an epoch -----------------------------------------------------------------

    def _end_epoch(self, epoch: Epoch, *, stop: bool, flagged: bool = False) -> None:
        if epoch._summary is not None:
            return
        if self._pending is not None:
            raise ConfigError("ElasticJob: the epoch ended with a batch not yet stepped: call job.step() after "
                              "each batch")
        if self._part_no:
            raise ConfigError(f"ElasticJob: left epoch {epoch.number} inside a DiLoCo round ({self._part_no} of "
                              f"{self._parts} local steps): leave only when job.step() returned True")
        epoch._it = None  # a DataLoader's worker processes end with their iterator
        if self._flags and not flagged:
            self._flag(True, stop or epoch.final)
        if self._lag:  # the epoch's last round is in flight: take it in before the audit
            assert isinstance(self.opt, DiLoCo)
            self.opt.flush()
            self._commit_done()
        epoch.stopped = stop
        epoch._summary = self._audit(epoch.number)
        self.summaries.append(epoch._summary)
        self._trained, self._epoch_steps, self._epoch_fewest = [], 0, None
        self._epoch_late = Counter()

    def _fetches(self) -> int:
        return self.dataset.stats().fetched if isinstance(self.dataset, CachedDataset) else 0

    def _audit_allreduce(self, counts: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        self.allreduce.mark_step(None)  # an audit, not a training step: fault windows do not count it
        out: npt.NDArray[np.int32] = self.allreduce.allreduce(counts)
        return out

    def _audit(self, number: int) -> EpochSummary:
        """How often each sample was committed, over all ranks: one allreduce of a count per
        sample (and each rank's cache fetches). Ranks that cannot answer (they left the view,
        or a member lost between its last commit and the audit, or late to it) are counted from
        the history every member computes alike, by every rank after the sum. Adding them
        before it, by the lowest member, lost them when that member was the one lost, and a
        member lost after the epoch's last step was counted by nobody (`fttree chaos` found
        a third of an epoch "missing" that way)."""
        sampler, n, world = self.sampler, len(self.dataset), self.allreduce.world
        fetched_now = self._fetches()
        fetched, self._fetched_at = fetched_now - self._fetched_at, fetched_now
        # every rank that was a member at some step: one that joined and left inside the epoch
        # is in neither its start members nor its last view (`fttree chaos` lost one so)
        departed = tuple(sorted(set(sampler.history().ranks) - set(sampler.members)))
        counts = np.zeros(n + world, dtype=np.int32)
        answered: tuple[int, ...] = ()
        if self.audit:
            np.add.at(counts, np.asarray(self._trained, dtype=np.int64), 1)
            counts[n + self.rank] = fetched
            counts = np.array(self._audit_allreduce(counts))
            last = self.allreduce.last
            answered = tuple(last.contributors) if last is not None else ()
            # a departed rank's answer, if any, is a restarted process's nothing (_join)
            for r in sorted(set(departed) | (set(sampler.members) - set(answered))):
                np.add.at(counts, sampler.committed(r), 1)
        else:  # the shared history's account: every member computes the same
            for r in sorted(set(sampler.history().ranks) | set(sampler.members)):
                np.add.at(counts, sampler.committed(r), 1)
            counts[n + self.rank] = fetched
        per_sample, complete = counts[:n], sampler.finished
        return EpochSummary(epoch=number, complete=complete, samples=n, committed=int(per_sample.sum()),
                            distinct=int((per_sample > 0).sum()), repeated=int((per_sample > 1).sum()),
                            missing=int((per_sample == 0).sum()),
                            once=bool(complete and (per_sample == 1).all()), departed=departed,
                            answered=answered, moved=sum(e.pool for e in sampler.stats().events),
                            fetched=int(counts[n:].sum()), steps=self._epoch_steps,
                            fewest_contributors=self._epoch_fewest, late=dict(self._epoch_late))

    # ---- whole-job checkpoints (fttree.training.checkpoint) -------------------------------------

    def _load_checkpoint(self, optimizer: torch.optim.Optimizer) -> ckpt_file.Checkpoint | None:
        """Before the optimizer is wrapped: read the newest checkpoint, refuse one of another
        job, and put its model (and, data-parallel, optimizer state) in place, so the wrapper's
        start-up check finds every rank's model alike. A joiner's are replaced by the group's."""
        assert self.checkpoint_dir is not None
        path = ckpt_file.latest(self.checkpoint_dir)
        if path is None:
            return None
        found = ckpt_file.read(path)
        ckpt_file.check_meta(found, self._job_meta)
        try:
            load(found.state, self.model, None if self._job_meta["diloco"] else optimizer, self.scheduler)
        except StateMismatch as exc:
            raise ConfigError(f"checkpoint {path} does not fit this job's model or optimizer: {exc}") from exc
        return found

    def _agree(self, found: ckpt_file.Checkpoint | None) -> None:
        """Every rank must resume from the same checkpoint (or none): one max-allreduce of its
        digest, and of its negation, which equal each other only if every rank holds the same."""
        tag = [0, 0] if found is None else [int.from_bytes(found.digest[k:k + 7], "big") for k in (0, 7)]
        self.allreduce.mark_step(None)  # setup, not a training step: fault windows do not count it
        got = self.allreduce.allreduce(np.array([*tag, *(-t for t in tag)], dtype=np.int64), reduce="max")
        if int(got[0]) != -int(got[2]) or int(got[1]) != -int(got[3]):
            where = "no checkpoint" if found is None else f"checkpoint {found.path.name}"
            raise ConfigError(f"rank {self.rank} resumes from {where} in {self.checkpoint_dir}, but another rank "
                              f"from another: every rank must see the same checkpoint directory (shared storage, "
                              f"or the same files copied to every machine)")

    def _resume(self, found: ckpt_file.Checkpoint) -> None:
        """Take the checkpoint's position: the training step count, the epoch and its sampler
        history (the commits before the checkpoint, which are not dealt again)."""
        meta, extra = found.meta, found.state.extra
        try:
            step, epoch, started = int(meta["step"]), int(meta["epoch"]), bool(meta["started"])
            job = extra["job"]
            history, epoch_steps = job["history"], int(job["epoch_steps"])
            if isinstance(self.opt, DiLoCo):
                self.opt.load_state_dict(extra["diloco"])
                self._load_own_inner(step)
            else:
                self.opt.step_count = found.state.step_count
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"checkpoint {found.path} lacks the job's position: {exc!r}") from exc
        self._next_members = ckpt_file.resume_sampler(self.sampler, history if started else None, epoch,
                                                      self.sampler.members)
        self._base = step
        self._resume_at = (epoch, True)
        if started:
            self._trained = self.sampler.committed(self.rank).tolist()  # counted in this epoch's audit
            self._epoch_steps = epoch_steps
        self.resumed_from, self.resumed_step = found.path, step

    def _load_own_inner(self, step: int) -> None:
        """DiLoCo: this rank's own inner optimizer state (its momentum grew on its own
        batches), if it wrote its part of the checkpoint; else it keeps the writer's, which the
        checkpoint holds (a kill can fall between the writer's file and another rank's part)."""
        assert self.checkpoint_dir is not None
        assert isinstance(self.opt, DiLoCo)
        path = ckpt_file.own_path(self.checkpoint_dir, step, self.rank)
        if not path.exists():
            return
        own = ckpt_file.read(path)
        ckpt_file.check_meta(own, {**self._job_meta, "step": step, "rank": self.rank})
        try:
            self.opt.inner.load_state_dict(own.state.optimizer)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"checkpoint part {path} does not fit this rank's inner optimizer: {exc}") from exc

    def _save(self, fresh_epoch: int | None) -> None:
        """Write a checkpoint, on the lowest-ranked member only: after a training step
        (`fresh_epoch` None: the epoch's history through it goes in) or at an epoch's end
        (the next epoch, `fresh_epoch`, starts afresh from it). With DiLoCo every member
        first writes its own part: its inner optimizer's state, which differs per rank."""
        if self.checkpoint_dir is None or self.opt.syncing or not self.sampler.member:
            return
        if isinstance(self.opt, DiLoCo):
            own = encode(capture({}, self.opt.inner, step_count=0))
            part = {**self._job_meta, "step": self.training_steps, "rank": self.rank}
            ckpt_file.write(self.checkpoint_dir, self.training_steps, part, own.data, rank=self.rank)
        if self.rank != min(self.sampler.members):
            return
        started = fresh_epoch is None
        job = {"history": self.sampler.history().to_dict() if started else None,
               "epoch_steps": self._epoch_steps if started else 0}
        extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {"job": (lambda: job, _ignore)}
        inner = None
        if isinstance(self.opt, DiLoCo):
            state = self.opt.state_dict()
            extra["diloco"] = (lambda: state, _ignore)
        else:
            inner = self.opt.optimizer
        snap = encode(capture(self.model, inner, self.scheduler, extra=extra, step_count=self.opt.step_count
                              if isinstance(self.opt, DistributedOptimizer) else 0))
        meta = {**self._job_meta, "step": self.training_steps, "started": started,
                "epoch": self.sampler.epoch if started else fresh_epoch}
        ckpt_file.write(self.checkpoint_dir, self.training_steps, meta, snap.data)

    def _set_base(self, value: Any) -> None:
        """A joiner's `register_state` setter: the group's count of steps before its optimizer's."""
        try:
            self._base = int(value["base"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"rank {self.rank}: not an ElasticJob state: {value!r}") from exc

    def __repr__(self) -> str:
        kind = f"DiLoCo every {self.diloco}" if self.diloco else "data-parallel"
        return (f"ElasticJob(rank {self.rank}, {kind}, {len(self.dataset)} samples, "
                f"batch {self.sampler.config.batch_size // self._parts})")


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, diloco: int) -> None:
    """The job steps the scheduler after every optimizer step, so it must be one that takes
    no metric, of this job's optimizer; DiLoCo's inner schedule is not part of its state yet."""
    if scheduler is None:
        return
    if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
        raise TypeError(f"ElasticJob: scheduler must be an LR scheduler (step, state_dict, load_state_dict), "
                        f"not {type(scheduler).__name__}")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError("ElasticJob: ReduceLROnPlateau steps on a metric the job does not see; pass a scheduler "
                          "stepped by count (StepLR, OneCycleLR, LambdaLR, ...), or step it yourself without "
                          "scheduler= (it is then not checkpointed nor handed to joiners)")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ConfigError("ElasticJob: the scheduler belongs to another optimizer than the job's")
    if diloco:
        raise ConfigError("ElasticJob: scheduler= with diloco=H is not supported yet (the inner optimizers' "
                          "schedules are not part of DiLoCo's state); set the inner LR yourself per round")


def _ignore(_value: Any) -> None:
    """The setter of state only written (a checkpoint's extra state is read by ElasticJob)."""


def _default_allreduce() -> FTTreeAllreduce:
    """The fttree process group's handle when torch.distributed runs on it, else one from the
    environment (FTTREE_RANK, FTTREE_PEERS), started."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .backend import allreduce_of

        return allreduce_of()
    return FTTreeAllreduce.from_env().start()

