"""Horovod-style gradient averaging on top of FTTreeAllreduce.

    ar = fttree.FTTreeAllreduce.from_env().start()
    opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, allreduce=ar)
    loss.backward(); opt.step(); opt.zero_grad()

or `sync = fttree.attach(model, ar)` then `fttree.synchronize(model)` before any optimizer.

How a step goes. Every parameter gets a post-accumulate-grad hook. When the last gradient of
a bucket (fttree.training.buckets) arrives during backward, the bucket's gradients are copied into a
fresh flat buffer and submitted at once, so its allreduce runs on the fttree loop thread while
backward goes on. Buckets are submitted strictly in index order, so every worker gives them the
same step numbers. When backward ends (an autograd engine callback) the buckets still waiting
for gradients that never came (unused parameters) are submitted too. `synchronize()` waits for
all of them and writes the averaged gradients back into `.grad`.
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import StateDict
from torch.utils.hooks import RemovableHandle

from ..api import FTTreeAllreduce
from ..core.config import COMPRESSIONS
from ..core.messages import INT8_BLOCK
from ..errors import ConfigError, FTTreeError, StepAborted, StepRetry, TensorMismatch
from ..net.node import StepResult
from .buckets import DEFAULT_BUCKET_MB, BucketSpec, blank, copy_divided, describe, digest, plan_buckets, wire_dtype
from .elastic import StateTransfer
from .state import StateMismatch, TrainingState, capture, load

__all__ = ["DistributedOptimizer", "GradientSync", "ModelMismatch", "TrainingStep", "attach", "broadcast_parameters",
           "check_same_layout", "close_gracefully", "synchronize"]

Named = list[tuple[str, torch.Tensor]]
# torch's step hooks, hook(optimizer, args, kwargs); a DistributedOptimizer's get the wrapped optimizer.
StepPreHook = Callable[[Any, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]] | None]
StepPostHook = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]


class ModelMismatch(TensorMismatch):
    """Workers hold different models (or bucket plans); raised on every worker."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingStep:
    """A finished training step as every survivor sees it, bit for bit alike (they all hold the
    same bucket results), so a data sampler can follow it without messages of its own
    (`ElasticSampler.commit_from(opt)`)."""

    step: int  # training step, counted from 0 as fault windows count them
    contributors: tuple[int, ...]  # ranks in the result of every bucket (sorted): whose batch the step holds
    epoch: int  # newest view epoch among the buckets' results
    # The view for the next step: the contributors. Not `ar.view` read after the step: a view
    # change can be installed at any moment, so two survivors could read different views.
    members_next: tuple[int, ...]
    contributed: bool  # False: this rank gave an empty contribution (synchronize(contribute=False))
    # members that were late in some bucket (Config.straggler_policy="deadline") and not in every
    # bucket's result: their batches are not in the step, and they stay members (in members_next)
    late: tuple[int, ...] = ()


# ---- helpers ------------------------------------------------------------------------------


def _named_tensors(target: Any, *, buffers: bool = True) -> Named:
    """(name, tensor) pairs of a module (parameters, then buffers), a state_dict, or an
    iterable of tensors or (name, tensor) pairs. Shared tensors are listed once."""
    if isinstance(target, torch.nn.Module):
        items: list[tuple[str, torch.Tensor]] = list(target.named_parameters())
        if buffers:
            items += list(target.named_buffers())
    elif isinstance(target, torch.Tensor):
        items = [("tensor", target)]
    elif isinstance(target, Mapping):  # a state_dict
        items = [(str(k), v) for k, v in target.items() if isinstance(v, torch.Tensor)]
    else:
        items = []
        for i, item in enumerate(target):
            if isinstance(item, torch.Tensor):
                items.append((f"tensor{i}", item))
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
                items.append((str(item[0]), item[1]))
            else:
                raise TypeError(f"expected tensors or (name, tensor) pairs, got {type(item).__name__} at {i}")
    seen: set[int] = set()
    unique = []
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            unique.append((name, t))
    return unique


def _settle(futures: Sequence[Future[StepResult]], ar: FTTreeAllreduce,
            context: Callable[[int], str], nbytes: int = 0) -> list[StepResult | FTTreeError]:
    """The outcome of every future (a result or its fttree error, with `context(i)` noted),
    once all have settled, so no step of this batch is left running behind the caller.
    `nbytes`: the batch's bytes, which the wait allows for at the slowest known rate."""
    limit = ar.outcome_limit_s(nbytes)
    deadline = time.monotonic() + limit
    outcomes: list[StepResult | FTTreeError] = []
    for i, fut in enumerate(futures):
        try:
            outcomes.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
        except FutureTimeout:
            outcomes.append(StepAborted(-1, f"rank {ar.rank}: no outcome within {limit:g} s "
                                            f"(event loop stuck?) while {context(i)}"))
        except FTTreeError as exc:
            exc.add_note(f"fttree rank {ar.rank}: while {context(i)}")
            outcomes.append(exc)
    return outcomes


def _first_error(outcomes: Sequence[StepResult | FTTreeError]) -> list[StepResult]:
    for out in outcomes:
        if isinstance(out, FTTreeError):
            raise out
    return [out for out in outcomes if isinstance(out, StepResult)]


def _wait(futures: Sequence[Future[StepResult]], ar: FTTreeAllreduce,
          context: Callable[[int], str], nbytes: int = 0) -> list[StepResult]:
    """Results of all futures; on failure, the first error after every future has settled."""
    return _first_error(_settle(futures, ar, context, nbytes))


def close_gracefully(allreduce: FTTreeAllreduce) -> None:
    """Close a handle; `FTTreeAllreduce.close()` itself waits (bounded) for queued frames and
    for peers that may still need this rank's relay, so this is kept as a plain alias."""
    allreduce.close()


def check_same_layout(ar: FTTreeAllreduce, what: str, entries: Sequence[str], *, numel: int = 0,
                      summary: str = "", values: str = "") -> bool:
    """Compare a layout description across all workers in one small allreduce; raise
    ModelMismatch on every worker (naming the ranks that differ) if they are not all equal.

    Each rank writes (digest, entry count, `numel`, `values`) into its own row of a world x 4
    int64 array; the sum hands every rank every row. `values` (hex, at most 60 bits) is a
    digest of this rank's values: returns whether every contributor's is the same, which every
    worker decides alike from the same rows (False when `values` is not given)."""
    world, rank = ar.world, ar.rank
    mine = digest(entries)
    table = np.zeros((world, 4), dtype=np.int64)
    table[rank] = (int(mine, 16), len(entries), numel, int(values, 16) if values else 0)
    res = _wait([ar.submit_array(table.reshape(-1), f"layout check: {what} int64[{world}x4]")], ar,
                lambda _: f"comparing the {what} of all workers")[0]
    rows = res.data.reshape(world, 4)
    voters = list(res.contributors)
    if all(rows[r, 0] == rows[rank, 0] for r in voters):
        return bool(values) and all(rows[r, 3] == rows[rank, 3] for r in voters)
    groups: dict[int, list[int]] = {}
    for r in voters:
        groups.setdefault(int(rows[r, 0]), []).append(r)
    parts = [f"ranks {ranks} have #{key:012x} ({rows[ranks[0], 1]} tensors, {rows[ranks[0], 2]:,} elements)"
             for key, ranks in sorted(groups.items(), key=lambda kv: kv[1])]
    reason = (f"{what} differs between workers: {'; '.join(parts)}. This is rank {rank}"
              + (f", whose {what} is {summary}" if summary else ""))
    raise ModelMismatch(res.step, reason, peers=tuple(r for r in voters if rows[r, 0] != rows[rank, 0]))


def values_digest(named: Named) -> str:
    """A 60-bit digest of the tensors' bytes (names and shapes are the layout's part): replicas
    that start from the same seed have the same one, so nothing needs to be copied."""
    h = hashlib.blake2b(digest_size=8)
    for _, t in named:
        if t.numel():  # a device tensor comes to the host once, at the start
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
        h.update(b"\0")
    return f"{int.from_bytes(h.digest(), 'big') >> 4:015x}"


def _layout_entries(named: Named) -> list[str]:
    return [describe(t.shape, t.dtype) for _, t in named]


def _summary(named: Named, limit: int = 6) -> str:
    shown = ", ".join(f"{n} {describe(t.shape, t.dtype)}" for n, t in named[:limit])
    return shown + (f", ... ({len(named) - limit} more)" if len(named) > limit else "")


# ---- broadcast ----------------------------------------------------------------------------


def broadcast_parameters(target: Any, allreduce: FTTreeAllreduce, root_rank: int = 0, *, check: bool = True) -> bool:
    """Copy rank `root_rank`'s parameters (and buffers, for a module) into every worker, so
    all replicas start identical without seeding by hand. Returns whether anything was copied.

    `target` is a module, a tensor, or an iterable of tensors or (name, tensor) pairs. With
    `check` (the default), one small allreduce first compares the layouts, so different models
    fail with ModelMismatch on every worker instead of a bare size mismatch, and a digest of
    the values: when every worker already holds the same values (they were built from one
    seed), nothing is copied, which saves a model's worth of bytes through every link. Else
    one allreduce per wire dtype: the root contributes its values, everyone else -0.0 (x + -0.0
    is x to the bit)."""
    ar = allreduce
    if not 0 <= root_rank < ar.world:
        raise ConfigError(f"root_rank {root_rank} is not a rank of a world of {ar.world}")
    named = _named_tensors(target)
    if check and check_same_layout(ar, "model state", _layout_entries(named), numel=sum(t.numel() for _, t in named),
                                   summary=_summary(named), values=values_digest(named)):
        return False
    groups: dict[np.dtype, Named] = {}
    for name, t in named:
        groups.setdefault(wire_dtype(t.dtype), []).append((name, t))
    futures, plans = [], []
    for dtype, members in groups.items():
        total = sum(t.numel() for _, t in members)
        flat = blank(total, dtype)
        if ar.rank == root_rank:
            view, offset = torch.from_numpy(flat), 0
            for _, t in members:
                view[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
                offset += t.numel()
        layout = digest([dtype.str, *(tuple(t.shape) for _, t in members)])
        futures.append(ar.submit_array(flat, f"broadcast from rank {root_rank} {dtype.name}[{total}] #{layout}",
                                       nonfinite="allow"))
        plans.append(members)
    results = _wait(futures, ar, lambda i: f"broadcasting parameters from rank {root_rank}",
                    nbytes=sum(t.numel() * t.element_size() for _, t in named))
    if ar.rank == root_rank:
        return True
    with torch.no_grad():
        for members, res in zip(plans, results, strict=True):
            data, offset = torch.from_numpy(res.data), 0
            for _, t in members:
                t.copy_(data[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
    return True


# ---- gradient hooks -----------------------------------------------------------------------


class GradientSync:
    """Per-parameter gradient hooks feeding fused buckets; `synchronize()` averages.

    A bucket voided after a node failure (StepRetry, on_node_failure="rollback") is run again on
    the new view by `synchronize()` itself, up to RETRIES times.

    `bucket_mb` caps a bucket's size; `backward_passes_per_step` > 1 accumulates that many
    backward passes locally and allreduces once (the gradients are summed over passes and
    averaged over workers, as in Horovod). `average=False` leaves the sum. `compression`: float32
    buckets travel as "bf16", "fp16" or "int8" (None: the handle's Config.compression); it must
    be the same on every worker (int8 changes the buckets' layout)."""

    RETRIES = 3

    def __init__(self, allreduce: FTTreeAllreduce, named_parameters: Iterable[tuple[str, torch.Tensor]], *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, backward_passes_per_step: int = 1, average: bool = True,
                 check: bool = True, compression: str | None = None) -> None:
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        self.ar = allreduce
        self.params = [(n, p) for n, p in _named_tensors(list(named_parameters)) if p.requires_grad]
        if not self.params:
            raise ConfigError("no parameter requires grad: nothing to synchronize")
        self.passes = backward_passes_per_step
        self.average = average
        if compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.compression = compression
        gap = INT8_BLOCK - 1 if (compression or allreduce.config.compression) == "int8" else 0
        self.buckets = plan_buckets(self.params, max(1, int(bucket_mb * 2**20)), gap=gap)
        self._bucket_of = {slot.param: spec.index for spec in self.buckets for slot in spec.slots}
        self._lock = threading.RLock()
        self.rounds = 0  # synchronizations submitted: the training steps fault windows count
        self.contribute = True  # False while a joiner waits for its state: it takes part with zeros
        self.on_admitted: Callable[[int], None] | None = None  # a joiner: told its first training step
        self.retried = 0  # buckets submitted again after the group voided them (StepRetry)
        self.last_step: TrainingStep | None = None  # the newest training step that finished here
        self._reset()
        self.synchronized = False  # True from synchronize() until the next gradient arrives
        if check:
            check_same_layout(self.ar, "gradient bucket plan", [b.signature for b in self.buckets],
                              numel=sum(b.numel for b in self.buckets),
                              summary=f"{len(self.buckets)} buckets over {_summary(self.params)}")
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))  # type: ignore[no-untyped-call]
                         for i, (_, p) in enumerate(self.params)]

    def _reset(self) -> None:
        self._pass = 0
        self._waiting = [len(b.slots) for b in self.buckets]  # gradients still due in the final pass
        self._fired: set[int] = set()
        self._futures: list[Future[StepResult] | None] = [None] * len(self.buckets)
        self._next = 0  # first bucket not yet submitted
        self._callback_queued = False
        self._marked = False  # this round's buckets are marked as training step `rounds`
        self._touched = False  # a gradient arrived in this round

    def detach(self) -> None:
        """Remove the hooks; gradients are left local from now on."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- during backward (autograd thread) -------------------------------------------

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_grad(index)
        return hook

    def next_round(self) -> int:
        """The training step the next gradients belong to. A joiner is admitted here, at its
        first step (not when it started: the others would wait while it builds its model)."""
        if self.on_admitted is not None and self.ar.joining:
            self.ar.admit()
            joined = self.ar.joined_at
            assert joined is not None
            self.rounds = joined[1]
            callback, self.on_admitted = self.on_admitted, None
            callback(self.rounds)
        return self.rounds

    def _mark_round(self) -> None:
        if not self._marked:
            self._marked = True
            self.ar.mark_step(self.next_round())

    def _on_grad(self, index: int) -> None:
        with self._lock:
            self._mark_round()
            self.synchronized = False
            self._touched = True
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self._pass >= self.passes:
                raise ConfigError(f"fttree rank {self.ar.rank}: more than backward_passes_per_step={self.passes} "
                                  f"backward passes before step() or synchronize()")
            if self._pass + 1 < self.passes or index in self._fired:
                return
            self._fired.add(index)
            b = self._bucket_of[index]
            self._waiting[b] -= 1
            if self._waiting[b] == 0:
                self._launch_ready()

    def _end_of_backward(self) -> None:
        with self._lock:
            self._callback_queued = False
            self._fired.clear()
            self._pass += 1
            if self._pass >= self.passes:
                self._flush()

    def _flush(self) -> None:
        for b in range(self._next, len(self.buckets)):
            self._waiting[b] = 0
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:
            self._futures[self._next] = self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, spec: BucketSpec, contribute: bool = True) -> Future[StepResult]:
        # One element after the flags counts the workers whose data is in the sum (1 here, 0
        # for an empty contribution): averages divide by it, not by every rank in the step.
        buf = (np.zeros if spec.gap else np.empty)(spec.size + 1, dtype=spec.dtype)
        signature = f"{spec.signature} +count"
        wire = self.compression if spec.dtype == np.float32 else None
        if not contribute:
            buf.fill(0)
            return self.ar.submit_array(buf, signature, contribute=self.contribute, compression=wire, closable=True)
        buf[spec.size] = 1
        flat, flags = torch.from_numpy(buf), buf[spec.flags_at:spec.flags_at + len(spec.slots)]
        for k, slot in enumerate(spec.slots):
            grad = self.params[slot.param][1].grad
            dst = flat[slot.offset:slot.offset + slot.numel]
            if grad is None:
                dst.zero_()
                flags[k] = 0
                continue
            if grad.layout != torch.strided:
                raise TypeError(f"fttree: parameter {slot.name} has a {grad.layout} gradient; only dense "
                                f"gradients are supported")
            dst.copy_(grad.detach().reshape(-1))
            flags[k] = 1
        # closable: under straggler_policy="deadline" a late rank's gradients are left out; the
        # count slot and the flags divide by the workers whose gradients are in
        return self.ar.submit_array(buf, signature, contribute=self.contribute, compression=wire, closable=True)

    # ---- step (caller thread) ------------------------------------------------------------

    def synchronize(self, contribute: bool = True) -> None:
        """Submit what is left, wait for every bucket, write the averaged gradients back.

        `contribute=False` takes part in the step with an empty contribution (zeros, counted in
        no average): for a worker with no batch left, which must still join every step."""
        with self._lock:
            if not contribute and self._touched:
                raise ConfigError(f"fttree rank {self.ar.rank}: synchronize(contribute=False) after backward "
                                  f"produced gradients in training step {self.rounds}: for an empty batch skip "
                                  f"backward")
            self._mark_round()
            if contribute:
                self._flush()
            else:
                for b in range(len(self.buckets)):
                    self._futures[b] = self._launch(self.buckets[b], contribute=False)
            futures = [f for f in self._futures if f is not None]
            self._reset()
            step, counted = self.rounds, self.contribute  # counted: False for a joiner awaiting its state
            self.rounds += 1  # submitted: the next gradients belong to the next training step
        outcomes = self._settle_retrying(futures, contribute)
        results = _first_error(outcomes)
        for spec, res in zip(self.buckets, results, strict=True):
            self._write_back(spec, res)
        common = set.intersection(*(set(res.contributors) for res in results))
        late = set().union(*(res.late for res in results)) - common
        self.last_step = TrainingStep(step=step, contributors=tuple(sorted(common)),
                                      epoch=max(res.epoch for res in results),
                                      members_next=tuple(sorted(common | late)), contributed=contribute and counted,
                                      late=tuple(sorted(late)))
        self.synchronized = True

    @property
    def steps_behind(self) -> int:
        """Training steps, from the next one, that the group already closed without this rank,
        a straggler (Config.straggler_policy="deadline"): computing their gradients would be
        wasted, as they would not be added. Skip each with `opt.step(contribute=False)` (it
        returns at once with the others' average) and drop its batch: the sampler deals it
        again. 0 under the default policy."""
        return self.ar.late_steps_ahead // max(1, len(self.buckets))

    def _settle_retrying(self, futures: list[Future[StepResult]], contribute: bool = True
                         ) -> list[StepResult | FTTreeError]:
        """Wait for every bucket. Buckets the group voided after losing a worker (StepRetry,
        on_node_failure="rollback") are submitted again on the new view, from the gradients
        still in .grad; every survivor voided the same ones, so they agree on the new steps."""
        def context(i: int) -> str:
            return f"averaging gradient bucket {self.buckets[i].index} ({self.buckets[i].names()})"

        nbytes = sum(spec.size * 4 for spec in self.buckets)
        outcomes = _settle(futures, self.ar, context, nbytes)
        for _ in range(self.RETRIES):
            again = [i for i, out in enumerate(outcomes) if isinstance(out, StepRetry)]
            if not again:
                break
            self.retried += len(again)
            futures = list(futures)
            for i in again:
                futures[i] = self._launch(self.buckets[i], contribute)
            for i, out in zip(again, _settle([futures[i] for i in again], self.ar, context, nbytes), strict=True):
                outcomes[i] = out
        return outcomes

    def _write_back(self, spec: BucketSpec, res: StepResult) -> None:
        # res.data is read, never written: at the root it is also the payload of the result
        # still queued for the children.
        data = res.data
        flat, flags = torch.from_numpy(data[:spec.numel]), data[spec.flags_at:spec.flags_at + len(spec.slots)]
        divisor = round(float(data[spec.size])) if self.average else 1  # workers whose data is in the sum
        with torch.no_grad():
            for k, slot in enumerate(spec.slots):
                if flags[k] == 0:  # no worker produced this gradient: leave it None, like one process would
                    continue
                param = self.params[slot.param][1]
                src = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                if param.grad is None:
                    param.grad = torch.empty_like(param)
                copy_divided(param.grad, src, divisor)


_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, GradientSync] = weakref.WeakKeyDictionary()


def attach(model: torch.nn.Module, allreduce: FTTreeAllreduce, *, bucket_mb: float = DEFAULT_BUCKET_MB,
           backward_passes_per_step: int = 1, average: bool = True, broadcast: bool = True) -> GradientSync:
    """Hook `model`'s gradients into fttree; call `synchronize(model)` before the optimizer
    steps. With `broadcast`, rank 0's parameters and buffers are copied to every worker first."""
    if model in _ATTACHED:
        raise ConfigError("this model is already attached to fttree")
    allreduce.mark_step(None)  # the broadcast and layout checks are setup: no fault window hits them
    if broadcast:
        broadcast_parameters(model, allreduce)
    sync = GradientSync(allreduce, model.named_parameters(), bucket_mb=bucket_mb,
                        backward_passes_per_step=backward_passes_per_step, average=average)
    _ATTACHED[model] = sync
    return sync


def synchronize(target: torch.nn.Module | GradientSync | DistributedOptimizer | None = None) -> None:
    """Average the gradients of an attached model (or of a GradientSync / DistributedOptimizer).
    Without an argument, the one model attached in this process."""
    if isinstance(target, GradientSync | DistributedOptimizer):
        target.synchronize()
    elif isinstance(target, torch.nn.Module):
        sync = _ATTACHED.get(target)
        if sync is None:
            raise ConfigError("this model is not attached: call fttree.attach(model, allreduce) first")
        sync.synchronize()
    elif target is None:
        attached = list(_ATTACHED.values())
        if len(attached) != 1:
            raise ConfigError(f"{len(attached)} models are attached: pass the one to synchronize")
        attached[0].synchronize()
    else:
        raise TypeError(f"cannot synchronize a {type(target).__name__}")


# ---- optimizer wrapper --------------------------------------------------------------------


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap any torch optimizer: `step()` first averages the gradients over all workers.

    The wrapper holds the optimizer (`.optimizer`) and delegates to it: `param_groups`,
    `state` and `defaults` are the wrapped optimizer's own objects, read through on every
    access (a change made through either is seen by both, also after a load_state_dict that
    replaces them), and zero_grad, state_dict, load_state_dict, add_param_group and the hook
    registrations are the wrapped optimizer's. It is a torch.optim.Optimizer, so LR schedulers
    take it, but not an instance of the wrapped class: reach that, and anything of its own, as
    `.optimizer`. Step hooks registered here run inside the wrapped optimizer's step, after
    the gradients are averaged, and receive the wrapped optimizer.

    A closure passed to step() is evaluated once before the gradients are averaged
    (optimizers that call it repeatedly, like LBFGS, are not supported).

    `compression` ("bf16", "fp16", "int8"): float32 gradients travel in that form (see
    GradientSync); every worker must pass the same.
    """

    sync: GradientSync

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                 allreduce: FTTreeAllreduce, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, backward_passes_per_step: int = 1, average: bool = True,
                 broadcast: bool = True, compression: str | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("this optimizer is already a DistributedOptimizer")
        # Deliberately not Optimizer.__init__: it would build groups and state of our own;
        # the properties below read the wrapped optimizer's.
        self.optimizer = optimizer
        if named_parameters is not None:
            named = list(named_parameters)
        elif model is not None:
            named = list(model.named_parameters())
        else:
            named = [(f"param_groups[{g}][{i}]", p) for g, group in enumerate(self.param_groups)
                     for i, p in enumerate(group["params"])]
        joiner = allreduce.joining
        if not joiner:  # a joiner skips the setup collectives: the group ran them long ago
            allreduce.mark_step(None)  # the broadcast and layout checks are setup: no fault window hits them
            if broadcast:
                broadcast_parameters(model if model is not None else named, allreduce)
        self.sync = GradientSync(allreduce, named, bucket_mb=bucket_mb,
                                 backward_passes_per_step=backward_passes_per_step, average=average,
                                 check=not joiner, compression=compression)
        self._rounds_at_step = -1  # sync.rounds when step() last returned
        self.model = model
        self.step_count = 0  # the group's optimizer steps so far (a joiner takes it over)
        self.scheduler: Any = None
        self._extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._kept: dict[int, list[torch.Tensor | None]] = {}  # a joiner's averaged gradients by training step
        self.syncing = joiner  # a joiner waiting for its state
        self.transfer = StateTransfer(allreduce, self._capture)
        self._joined_step = -1
        if joiner:
            self.sync.contribute = False
            self.sync.on_admitted = self._admitted
            if allreduce.joined_at is not None:  # admitted already (admit() before this)
                self.sync.next_round()

    # ---- the wrapped optimizer's, read through --------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, state: defaultdict[torch.Tensor, Any]) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's; the new group's gradients are not averaged (the gradient
        buckets were planned, alike on every worker, when the wrapper was made)."""
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: StepPreHook) -> RemovableHandle:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: StepPostHook) -> RemovableHandle:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable[[torch.optim.Optimizer], None],
                                     prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[[torch.optim.Optimizer, StateDict], StateDict | None],
                                      prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[[torch.optim.Optimizer, StateDict],
                                                               StateDict | None],
                                          prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[[torch.optim.Optimizer], None],
                                           prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    # ---- elastic state --------------------------------------------------------------------

    def _admitted(self, user_step: int) -> None:
        """This joiner was admitted from training step `user_step`: ask a member for the state."""
        self._joined_step = user_step
        self.transfer.request(user_step)

    def register_scheduler(self, scheduler: Any) -> None:
        """Make an LR scheduler part of the state a joining worker takes over."""
        self.scheduler = scheduler

    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Extra state a joiner takes over (an RNG state, a data position): `get()` returns
        tensors, numbers, strings or lists/dicts of them; `set_(value)` restores it."""
        self._extra[name] = (get, set_)

    def _model_state(self) -> torch.nn.Module | dict[str, torch.Tensor]:
        """The model as fttree.training.state takes it: the module, else the named parameters."""
        return self.model if self.model is not None else dict(self.sync.params)

    def _capture(self) -> TrainingState:
        """What a joiner takes over, in fttree.training.state's one format: the model, this
        optimizer's state (the wrapped one's state_dict), a registered scheduler, the step count
        and the registered extra state."""
        return capture(self._model_state(), self, self.scheduler, self._extra, self.step_count)

    def _keep_or_catch_up(self, step: int) -> None:
        """A joiner: keep this step's averaged gradients; once the state is here, load it and
        replay every kept step from the state's on, as the others applied them."""
        self._kept[step] = [None if p.grad is None else p.grad.detach().clone() for _, p in self.sync.params]
        got = self.transfer.poll(self._joined_step)
        if got is None:
            return
        first, state = got
        if first not in self._kept:
            raise FTTreeError(f"rank {self.sync.ar.rank}: the training state is as of step {first}, but this "
                              f"worker kept the gradients of steps {sorted(self._kept)}")
        try:
            load(state, self._model_state(), self, self.scheduler, self._extra)  # sets self.step_count too
        except StateMismatch as exc:
            exc.add_note(f"fttree rank {self.sync.ar.rank}: loading the training state as of step {first} "
                         f"(the scheduler and register_state names must be alike on every worker)")
            raise
        replay = sorted(t for t in self._kept if t >= first)
        for t in replay:
            with torch.no_grad():
                for (_, p), g in zip(self.sync.params, self._kept[t], strict=True):
                    p.grad = g
            self.optimizer.step()
            self.step_count += 1
            if t != replay[-1] and self.scheduler is not None:
                self.scheduler.step()  # the caller steps it after this step()
        self._kept.clear()
        self.syncing = False
        self.sync.contribute = True
        record = self.transfer.record
        if record is not None:
            self.transfer.record = replace(record, replayed=len(replay))

    def synchronize(self, contribute: bool = True) -> None:
        """Average the gradients now (for clipping before step(); step() then skips it).
        `contribute=False`: an empty contribution, see GradientSync.synchronize."""
        self.sync.synchronize(contribute)

    def step(self, closure: Callable[[], Any] | None = None, *, contribute: bool = True) -> Any:
        """Average, then step. `contribute=False` (no batch: zero_grad() and no backward)
        still takes part in the step, counted in no average."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # An empty contribution produces no gradient, so nothing has cleared `synchronized`: it
        # still runs its step unless synchronize(contribute=False) did since the last step().
        if not self.sync.synchronized or (not contribute and self.sync.rounds == self._rounds_at_step):
            self.sync.synchronize(contribute)
        self._rounds_at_step = self.sync.rounds
        step = self.sync.rounds - 1  # the training step whose gradients are averaged now
        if self.syncing:
            self._keep_or_catch_up(step)
            return loss
        self.transfer.serve(step)  # the state before this step's update, for joiners that asked
        self.optimizer.step()
        self.step_count += 1
        return loss

    @property
    def last_step(self) -> TrainingStep | None:
        """The newest training step that finished here: its contributors and next view."""
        return self.sync.last_step

    @property
    def steps_behind(self) -> int:
        """Training steps, from the next one, that the group already closed without this rank
        (GradientSync.steps_behind)."""
        return self.sync.steps_behind
