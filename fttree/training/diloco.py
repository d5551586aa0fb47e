"""DiLoCo: training that talks less. Each worker takes `sync_every` steps of its own optimizer
(the inner one) on its own data; then the workers average their parameter change once (the
pseudo-gradient: the global parameters minus the worker's own), dividing by the workers whose
change is in the sum, and every worker applies the same outer step (SGD with Nesterov momentum,
as in Douillard et al. 2023) to the global parameters and starts its next steps from them.

    ar = fttree.FTTreeAllreduce.from_env().start()
    opt = fttree.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3), allreduce=ar, sync_every=32)
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

An outer step sends the model once each way, so syncing every H steps sends 1/H of what
data-parallel training sends (and a quarter of that with `compression="int8"`).

The outer step is a DistributedOptimizer over the global parameters, with an outer step as its
training step, so it inherits what data-parallel training has: a worker that dies is missing
from that average (its result's contributors say so), a step voided by a view change runs
again, a joiner or restarted worker takes the global parameters and the outer optimizer's state
from a peer, and `ElasticSampler.follow(opt, ...)` / `commit_from(opt)` deal each round's
samples exactly once per epoch (a round's batch is its `sync_every` inner batches).

With `overlap=True` the outer sync runs in the background while the next local steps compute (a
one-round-delayed outer update, as Streaming DiLoCo overlaps it): a round's pseudo-gradient is
the worker's own progress over the round (where it started minus where it ended); when the
next round ends, the outer step of the previous one is taken in, and the worker goes on from
the new global parameters plus its progress since. The global parameters stay alike on every
worker; a worker's model is the global parameters only after `flush()`. `stats` says how long
the caller waited for outer steps and how long they took.

With `overlap="eager"` the outer step runs behind the next round as with `overlap=True`, and
each worker goes on from the eager update of Kale, Douillard and Donchev 2025 ("Eager updates
for overlapped communication and computation in DiLoCo", the delayed outer step of Streaming
DiLoCo): its own pseudo-gradient of the round just ended stands in for its missing term of the
average still in flight, weighted as that term will be (1 / the contributors), and is taken out
again when the real average lands. The paper runs the outer optimizer on each worker's mixed
gradient; the outer step is linear in its gradient, so here the shared outer step takes the
averages only (the global parameters and the outer momentum stay alike bit for bit) and each
worker keeps the difference, its correction and the correction's momentum, apart
(EagerCorrection below): its model is the global parameters plus its correction.

With `compression="sparse"` (or `fttree.Sparse(...)`) a worker sends only a share of the
coordinates, the same ones on every worker, at 2-4 bits, and its model keeps the progress it
has not sent (fttree.training.sparse): the global parameters stay alike on every worker, the
model is each worker's own. With "eager" too, a worker's term in the average is what it sent,
so that is its stand-in (the message is built before the next round trains, not behind it),
and its model is the global parameters plus its correction less its accumulator.

Buffers (batch-norm statistics) are each worker's own, measured on its own data, as
DistributedDataParallel keeps them with broadcast_buffers=False; a joiner starts from its
donor's. The inner optimizer's state (Adam's moments) is each worker's own too and is kept
across outer steps; a joiner's starts empty once the global parameters arrive: a peer's moments
describe that peer's data, and sending them would double what a join transfers.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..api import FTTreeAllreduce
from ..core.config import COMPRESSIONS
from ..errors import ConfigError
from .buckets import DEFAULT_BUCKET_MB
from .optim import DistributedOptimizer, GradientSync, TrainingStep
from .sparse import Sparse, SparseCodec, SparseOuter

OVERLAPS = (False, True, "eager")


def check_overlap(overlap: object) -> bool | str:
    """`overlap` as given, refused by name unless it is False, True or "eager"."""
    if isinstance(overlap, bool) or (isinstance(overlap, str) and overlap == "eager"):
        return overlap
    raise ConfigError(f"overlap must be one of {OVERLAPS} (False: the outer step blocks; True: it runs behind the "
                      f"next round; 'eager': that, with the eager update), got {overlap!r}")


@dataclass
class OuterStats:
    """Where the outer steps' time went on this worker."""

    outer_steps: int = 0  # timed in this process (DiLoCo.outer_steps also counts a checkpoint's)
    sync_s: float = 0.0  # the outer steps took this long, from submitting to the new global parameters
    waited_s: float = 0.0  # of which the caller waited this long (overlap hides the rest behind local steps)

    @property
    def hidden(self) -> float:
        """The fraction of the outer steps' time that local steps hid (0 without overlap)."""
        return max(0.0, 1.0 - self.waited_s / self.sync_s) if self.sync_s > 0 else 0.0


class EagerCorrection:
    """One worker's eager update (overlap="eager"), kept apart from the shared outer step: the
    paper's worker applies the outer SGD to `avg(t-1) + (own(t) - own(t-1) * w(t-1))`, where
    own(t) is its pseudo-gradient of the round just ended (weighted 1 / the last step's
    contributors) and own(t-1) * w(t-1) what its previous one weighs in the average that just
    landed (where the average left it out: 0 dense, and with sparse the weight it went in with,
    since its sent part went back into the accumulator and is stood in again when sent). SGD
    with momentum is linear in its gradient, so that is the shared outer step on avg(t-1) (the
    global parameters, alike everywhere) plus this worker's own SGD on the difference: `offset`,
    with its momentum.
    With sparse compression own(t) is what the worker sent (its term in the average)."""

    def __init__(self, outer: torch.optim.Optimizer) -> None:
        self.outer = outer
        self.offset: list[torch.Tensor] | None = None  # the model is the global parameters plus this
        self.momentum: list[torch.Tensor] | None = None
        self.previous: list[torch.Tensor] | None = None  # own(t-1), the pseudo-gradient in flight
        self.previous_stand_in = 0.0  # the weight own(t-1) went in with (sparse takes it back out when left out)

    def update(self, own: list[torch.Tensor] | None, weight: float, previous_weight: float) -> list[torch.Tensor]:
        """Take in this round's pseudo-gradient (`own`, None for an empty contribution) and
        return the offset (empty: none yet). `weight`: the share own(t) will likely have in its
        average (1 / the last step's contributors); `previous_weight`: the share own(t-1) had
        in the average that just landed (0 if it left this worker out; sparse passes the weight
        own(t-1) went in with, `previous_stand_in`)."""
        group = self.outer.param_groups[0]
        lr, mu, nesterov = float(group["lr"]), float(group["momentum"]), bool(group["nesterov"])
        terms = [] if own is None else [(own, weight)]
        if self.previous is not None and previous_weight:
            terms.append((self.previous, -previous_weight))
        self.previous, self.previous_stand_in = own, weight
        if not terms:
            return self.offset or []
        diff = [terms[0][0][i] * terms[0][1] for i in range(len(terms[0][0]))]
        for t, w in terms[1:]:
            for d, x in zip(diff, t, strict=True):
                d.add_(x, alpha=w)
        if self.momentum is None or self.offset is None:
            self.momentum = [torch.zeros_like(d) for d in diff]
            self.offset = [torch.zeros_like(d) for d in diff]
        for buf, off, e in zip(self.momentum, self.offset, diff, strict=True):
            buf.mul_(mu).add_(e)
            off.sub_(lr * (e + mu * buf) if nesterov else lr * (buf if mu else e))
        return self.offset

    def reset(self) -> None:
        """The model is the global parameters again (flush, a checkpoint loaded): no correction."""
        self.offset = self.momentum = self.previous = None
        self.previous_stand_in = 0.0


class DiLoCo:
    """Local steps with an averaged outer step every `sync_every` of them (see the module)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 allreduce: FTTreeAllreduce, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, compression: str | Sparse | None = None, overlap: bool | str = False,
                 bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        if sync_every < 1:
            raise ConfigError(f"sync_every must be at least 1 inner step, got {sync_every}")
        if not outer_lr > 0:
            raise ConfigError(f"outer_lr must be positive, got {outer_lr}")
        if not 0 <= outer_momentum < 1 or (nesterov and outer_momentum == 0):
            raise ConfigError(f"outer_momentum must be in [0, 1) (and above 0 with nesterov), got {outer_momentum}")
        sparse = Sparse() if compression == "sparse" else compression if isinstance(compression, Sparse) else None
        if sparse is None and compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {(*COMPRESSIONS, 'sparse')} or a fttree.Sparse, "
                              f"got {compression!r}")
        overlap = check_overlap(overlap)
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo takes a torch.optim.Optimizer, not {type(inner_optimizer).__name__}")
        self.model = model
        self.inner = inner_optimizer
        self.sync_every = sync_every
        self.ar = allreduce
        self._local = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not self._local:
            raise ConfigError("the model has no parameter that requires grad: nothing to train")
        # The global parameters, in float32 whatever the model's dtype: the outer step's own.
        self._global = [(name, torch.nn.Parameter(p.detach().float().clone())) for name, p in self._local]
        outer = torch.optim.SGD([g for _, g in self._global], lr=outer_lr, momentum=outer_momentum,
                                nesterov=nesterov)
        # Rank 0's parameters become everyone's start (a joiner takes them with the state).
        self._sparse: SparseOuter | None = None
        self.outer: DistributedOptimizer
        if sparse is not None:
            codec = SparseCodec(sparse, self._global, allreduce.world)
            self._sparse = SparseOuter(outer, named_globals=self._global, codec=codec, allreduce=allreduce,
                                       bucket_mb=bucket_mb)
            self.outer = self._sparse
        else:
            assert not isinstance(compression, Sparse)
            self.outer = DistributedOptimizer(outer, named_parameters=self._global, allreduce=allreduce,
                                              bucket_mb=bucket_mb, broadcast=True, compression=compression)
        self.outer.register_state("diloco buffers", self._buffers, self._load_buffers)
        self.inner_steps = 0  # inner steps taken here (a joiner counts from its own start)
        self.outer_steps = 0  # outer steps this worker took part in
        self._worked = False  # an inner step of this round had a batch
        self._was_syncing = self.outer.syncing
        self.overlap = overlap
        self.eager = EagerCorrection(outer) if overlap == "eager" else None
        self.stats = OuterStats()
        # called with this DiLoCo after each outer step here, on the thread that took it (with
        # overlap the background one, before anything else writes the global parameters)
        self.outer_listeners: list[Callable[[DiLoCo], None]] = []
        self._in_flight: threading.Thread | None = None  # overlap: the previous round's outer step
        self._failed: BaseException | None = None  # ...and what it raised
        self._started_at = 0.0
        self._settled: TrainingStep | None = None  # see settled_step
        self._to_model()
        self._round_start = [p.detach().clone() for _, p in self._local]  # overlap: where this round began

    # ---- the loop -----------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, *, contribute: bool = True) -> Any:
        """One inner step; every `sync_every`-th also runs the outer step before it returns (then
        the model's parameters are the new global parameters, alike on every worker; with sparse
        compression less this worker's progress not yet sent).
        `contribute=False`: this worker has no batch for this inner step (its sampler ran dry):
        no inner update; a round without any batch takes part in the outer step counted in no
        average."""
        loss = None
        if contribute:
            loss = self.inner.step(closure) if closure is not None else self.inner.step()
            self._worked = True
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.outer_step(contribute=self._worked)
        return loss

    def outer_step(self, *, contribute: bool = True) -> None:
        """Average the pseudo-gradients, take the outer step, restart from the global
        parameters. `step()` calls it every `sync_every` inner steps; call it directly to end
        a round early (every worker must, at the same round). With overlap it starts this
        round's outer step in the background and takes in the previous round's."""
        if self.overlap:
            self._outer_step_overlapped(contribute)
            return
        with torch.no_grad():
            for (_, g), (_, p) in zip(self._global, self._local, strict=True):
                g.grad = g.detach() - p.detach().float() if contribute else torch.zeros_like(g)
        self._worked = False
        began = time.perf_counter()
        self._sync(contribute)
        took = time.perf_counter() - began
        self.stats.sync_s += took
        self.stats.waited_s += took  # blocking: the caller waits for all of it
        self._to_model()

    def _sync(self, contribute: bool, encoded: bool = False) -> None:
        """One outer step on the global parameters, whose `.grad` holds this worker's pseudo-gradient
        (`encoded`: sparse, the message is built already; the eager update builds it first)."""
        if self._sparse is not None and not encoded:  # the wire carries the sparse message
            self._sparse.encode([g.grad for _, g in self._global if g.grad is not None] if contribute else None,
                                accumulate=bool(self.overlap))
        self.outer.synchronize(contribute)
        if self._sparse is not None:
            self._sparse.settle()
        self.outer.step(contribute=contribute)
        self.outer_steps += 1
        self.stats.outer_steps += 1
        for listener in self.outer_listeners:
            listener(self)
        if not self.overlap:
            self._settled = self.outer.last_step
        if self._sparse is not None and self.overlap == "eager":
            # the next round's index set and scales, from the state this step left: the caller
            # builds the eager message when the round ends, and choosing is most of that cost
            self._sparse.codec.plan(self._sparse.step_count)
        if self._was_syncing and not self.outer.syncing:  # a joiner's state arrived in this step
            self.inner.state = defaultdict(dict)  # its inner state grew on parameters that were not the group's
            if self._sparse is not None:
                self._sparse.codec.reset()  # the accumulator is this worker's own: it starts empty
            if self.eager is not None:  # its correction grew on parameters that were not the group's
                self.eager.reset()
        self._was_syncing = self.outer.syncing

    def _outer_step_overlapped(self, contribute: bool) -> None:
        with torch.no_grad():
            progress = [p.detach().float() - s.float() for (_, p), s in zip(self._local, self._round_start,
                                                                             strict=True)]
        finished = self._in_flight is not None
        if finished:  # the previous round's outer step: wait, then go on from it
            self._finish_in_flight()
        encoded = self.eager is not None and self._sparse is not None
        if encoded:  # the eager stand-in is what this worker sends: build the message here
            assert self._sparse is not None
            began = time.perf_counter()
            self._sparse.encode([-d for d in progress] if contribute else None, accumulate=True)
            took = time.perf_counter() - began  # part of the outer step, and the caller waits for it
            self.stats.sync_s += took
            self.stats.waited_s += took
        if self.eager is not None:  # the model: the global parameters plus this worker's eager correction
            self._eager_update(progress, contribute)
        elif finished:  # the model: the new global parameters plus its progress since
            with torch.no_grad():  # sparse: the model also keeps what it has not sent
                kept = self._sparse.codec.residuals() if self._sparse is not None else [None] * len(self._global)
                for (_, g), (_, p), d, r in zip(self._global, self._local, progress, kept, strict=True):
                    p.copy_(g.detach() + d if r is None else g.detach() - r + d)
        with torch.no_grad():
            for (_, g), d in zip(self._global, progress, strict=True):
                g.grad = -d if contribute else torch.zeros_like(g)
        self._round_start = [p.detach().clone() for _, p in self._local]
        self._worked = False
        self._started_at = time.perf_counter()
        self._in_flight = threading.Thread(target=self._sync_in_background, args=(contribute, encoded),
                                           name=f"fttree-diloco-outer-rank{self.ar.rank}", daemon=True)
        self._in_flight.start()

    def _eager_update(self, progress: list[torch.Tensor], contribute: bool) -> None:
        """overlap="eager": the global parameters (with the last average taken in, or the start)
        plus the correction that stands this round's pseudo-gradient in for its term of the
        average in flight (see EagerCorrection). Sparse: the stand-in is what the worker sent
        (its term in the average), not its pseudo-gradient, and the model keeps the rest, its
        accumulator, as without eager; a sent part the average left out went back into the
        accumulator, so its stand-in comes out again (docs/diloco.md, "Eager with sparse")."""
        assert self.eager is not None
        last = self.outer.last_step
        counted = len(last.contributors) if last is not None and last.contributors else self.ar.world
        was_in = last is not None and self.ar.rank in last.contributors
        sparse = self._sparse
        if sparse is None:
            own = [-d for d in progress] if contribute else None
            previous_weight = 1.0 / counted if was_in else 0.0
        else:
            own = sparse.codec.sent()
            previous_weight = 1.0 / counted if was_in else self.eager.previous_stand_in
        with torch.no_grad():
            offset = self.eager.update(own, 1.0 / counted, previous_weight)
            kept = sparse.codec.residuals() if sparse is not None else [None] * len(self._global)
            for i, ((_, g), (_, p), r) in enumerate(zip(self._global, self._local, kept, strict=True)):
                base = g.detach() + offset[i] if offset else g.detach()
                p.copy_(base if r is None else base - r)

    def _sync_in_background(self, contribute: bool, encoded: bool) -> None:
        try:
            self._sync(contribute, encoded)
        except BaseException as exc:  # the caller hears of it at its next outer step or flush()
            self._failed = exc
        finally:
            self.stats.sync_s += time.perf_counter() - self._started_at

    def _finish_in_flight(self) -> None:
        thread, self._in_flight = self._in_flight, None
        if thread is None:
            return
        began = time.perf_counter()
        thread.join()
        self.stats.waited_s += time.perf_counter() - began
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed
        self._settled = self.outer.last_step

    def flush(self) -> None:
        """overlap=True or "eager": wait for the outer step in flight and go on from the global
        parameters it made (the model is then exactly them, as without overlap, and an eager
        correction is dropped; with sparse compression less this worker's progress not yet
        sent). A no-op otherwise, and when nothing is in flight."""
        if self._in_flight is None:
            return
        self._finish_in_flight()
        self._to_model()
        self._round_start = [p.detach().clone() for _, p in self._local]

    def _to_model(self) -> None:
        with torch.no_grad():
            # sparse: the model keeps its progress not yet sent (the global parameters stay alike)
            kept = self._sparse.codec.residuals() if self._sparse is not None else [None] * len(self._global)
            for (_, g), (_, p), r in zip(self._global, self._local, kept, strict=True):
                p.copy_(g if r is None else g - r)
                g.grad = None
        if self.eager is not None:
            self.eager.reset()

    # ---- what the sampler and a joiner need (ElasticSampler.follow(opt), commit_from(opt)) --

    @property
    def sync(self) -> GradientSync:
        """The outer step's gradient averaging (its `ar` is the allreduce handle)."""
        return self.outer.sync

    @property
    def syncing(self) -> bool:
        """A joiner that has not yet received the global parameters."""
        return self.outer.syncing

    @property
    def last_step(self) -> TrainingStep | None:
        """The newest outer step that finished here: its contributors and next view."""
        return self.outer.last_step

    @property
    def settled_step(self) -> TrainingStep | None:
        """The newest outer step this worker has taken in. Without overlap it is `last_step`;
        with overlap `last_step` may already be the round in flight, which its own thread
        finishes at any moment, so a sampler that commits a round a round late reads this."""
        return self._settled

    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Extra state a joiner takes over with the global parameters (see DistributedOptimizer)."""
        self.outer.register_state(name, get, set_)

    @property
    def global_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The global parameters (float32), named as the model's (with overlap, read them after
        `flush()`: an outer step in flight writes them)."""
        return [(name, g.detach()) for name, g in self._global]

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {name: b.detach() for name, b in self.model.named_buffers()}

    def _load_buffers(self, value: Any) -> None:
        own = dict(self.model.named_buffers())
        if set(value) != set(own):
            raise ConfigError(f"the donor's model has buffers {sorted(value)}, this worker's {sorted(own)}")
        with torch.no_grad():
            for name, b in own.items():
                b.copy_(torch.as_tensor(value[name]))

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint: the global parameters, both optimizers and the step counts (with
        overlap, after `flush()`: the outer step in flight is taken in first)."""
        self.flush()
        return {"global": {name: g.detach().clone() for name, g in self._global},
                "outer": self.outer.state_dict(), "inner": self.inner.state_dict(),
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {name for name, _ in self._global}
        if set(state["global"]) != names:
            raise ConfigError(f"checkpoint holds parameters {sorted(state['global'])}, the model {sorted(names)}")
        with torch.no_grad():
            for name, g in self._global:
                g.copy_(state["global"][name])
        self.outer.load_state_dict(state["outer"])
        self.inner.load_state_dict(state["inner"])
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        if self._sparse is not None:  # a checkpoint holds no accumulator or scales: both start over, alike
            self._sparse.codec.reset()
            self._sparse.codec.rms.zero_()
        self._to_model()

    def __repr__(self) -> str:
        return f"DiLoCo(sync_every={self.sync_every}, inner={self.inner!r}, outer={self.outer.optimizer!r})"
