"""ElasticSampler: a batch sampler that gives every sample to exactly one contributing worker
per epoch, whatever workers die or join, computed alike by every member from a shared history.

The history of an epoch is (config, epoch, the members at its start, and per step the ranks
whose contribution the step's result contains and the view for the following steps). Every
member already learns these from the allreduce; no sampler messages exist.

Slots and items. The hash ring (ring.py) places *slots* 0..n-1 once per member set (cached:
placing 60,000 slots takes tens of milliseconds, far more than the 1 % of a training step that
the sampler may cost). In stable mode slot s is sample s in every epoch, so a worker keeps its
samples across epochs and a restarted rank gets its own back; otherwise a keyed per-epoch
permutation maps slots to samples, so each epoch deals samples afresh. Each worker's queue is
its slots in a per-epoch shuffled order.

Steps. At step s a member's batch is the next `batch_size` slots of its queue that are
available at s (fewer, or none, at the end: an empty batch still takes part in the step with
an empty contribution). `commit(t, contributors, members_next)` then:
- commits the batches of the contributors of t;
- puts into a pool the batches of members that did not contribute, and everything a departed
  member had not yet processed;
- water-fills the pool over `members_next` (ring.rebalance): each survivor keeps its own queue
  and receives its share of the pool *after* it, so a departure moves exactly the departed
  member's samples, spread over all survivors;
- lets each joiner take a fair share of what is left, only from the *free* part of the
  queues (below).

Prefetching, and the horizon H. A DataLoader asks for batches ahead of the steps that commit
them: with `num_workers` w and `prefetch_factor` f it has asked for step t + w*f when step t
is being trained. So batches up to step t + H may be in flight when commit(t) changes the view,
with H = w*f (`loader_horizon`; 0 for a single-process loader). The rules that keep every
handed-out batch valid:
- slots moved at commit(t) to a survivor become available only from step t + 1 + H, after
  everything that survivor may already have handed out;
- joiners take only slots beyond what the owner batches by step t + H (the free part), and
  may use them from step t + 1: nobody can have prefetched them;
- the loader may ask for step s only once step s - 1 - H is committed; asking earlier raises
  a ConfigError that names the horizon (a bigger prefetch than declared);
- the epoch ends at the first step s at which every queue is empty and every batch of steps
  s - H .. s - 1 was empty, so no late failure can return a sample after the iterator
  stopped. The last H steps of an epoch are therefore empty for everyone. Every member
  decides the end alike, whichever commits beyond s - 1 - H it already knows.
Exactly once follows: every slot is always in exactly one place (a queue, an uncommitted
batch, or committed), commits move batches only from uncommitted to committed or back to a
queue, and the iterator stops only when nothing is left anywhere.

All members must use the same config (size, batch size, seed, stable, horizon, vnodes, load
factor): it is part of the history (`EpochHistory.config`), which a joining or restarted rank
replays (`ElasticSampler.from_history`) to compute its own queue.

Joins, with no messages of their own. A joiner (a restarted rank or a new one, fttree's
elastic joins) takes part in every step from its admission on, first with uncounted zeros
until its training state arrives. `ElasticSampler.follow(opt, ...)` puts the sampler's epoch
history into that state (`opt.register_state`): the donor's history as of the state's step
and the last training step it holds; the joiner records the outcome of every step it took
part in (`commit_from`) and, once the history is in, replays those after it, so it computes
what the members computed. It is no member yet, so its batch is empty at its first step
counted among the contributors (`opt.step(contribute=False)`); each member's `commit_from`
sees a contributor outside its view and takes it in at that commit t as a joiner (free part
of the queues, usable from t + 1). A restarted rank is a joiner whose rank departed earlier
in the epoch; `committed(rank)` lists both its stays. Until the joiner is a member it does not
iterate a loader, so no prefetched batch of it has to be honoured; its sampler follows the
group across an epoch end on its own (the members' `set_epoch(e + 1)` keeps the view):

    sampler = ElasticSampler.follow(opt, len(ds), 100, stable=True, horizon=H)  # every rank
    while not sampler.member:                 # a joiner: take part with no batch until dealt to
        opt.zero_grad()
        opt.step(contribute=False)
        sampler.commit_from(opt)
    for epoch in range(sampler.epoch, epochs):
        if epoch > sampler.epoch:
            sampler.set_epoch(epoch)
        for batch in loader: ...              # as below

Use with fttree.DistributedOptimizer (the loader must deliver batches in order: DataLoader's
default in_order=True). `commit_from(opt)` after each `opt.step()` is the whole integration:

    sampler = ElasticSampler(len(ds), 100, rank=ar.rank, members=ar.view.members, stable=True,
                             horizon=loader_horizon(num_workers=2, prefetch_factor=2))
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, collate_fn=CollateOrNone())
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            if batch is None:                 # nothing left for this rank: it still takes part,
                opt.step(contribute=False)    # counted in no average
            else:
                loss_fn(model(batch[0]), batch[1]).backward()
                opt.step()
            sampler.commit_from(opt)          # contributors of every bucket; next view

What commit_from reads (`opt.last_step`, the same on every survivor): a training step's
contributors are the ranks in the result of *every* gradient bucket of the step (a rank that
died during backward may be in the first buckets and not the last: its batch is not
committed and goes to the survivors); the view for the next step is those contributors and the
step's late members (Config.straggler_policy="deadline": their batches go to the pool like a
failed member's and are dealt again; they stay members), not
`ar.view` read after the step, which a concurrent view change could make differ between ranks.
A step that fails (`StepAborted` from `opt.step()`) commits nothing: see "limits" in the
docs/failures.md. With one plain `ar.allreduce` per step, `commit_from(ar)` reads `ar.last` instead.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from .hash_ring import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_VNODES,
    HashRing,
    check_ranks,
    item_positions,
    mix64,
    permute_index,
    rebalance,
    stable_key,
)

Indices = npt.NDArray[np.int64]
_Record = tuple[int, tuple[int, ...], tuple[int, ...], bool | None]  # step, contributors, next view, contributed
_EMPTY: Indices = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def loader_horizon(num_workers: int, prefetch_factor: int | None = 2) -> int:
    """How many steps ahead a torch DataLoader asks its batch sampler for batches."""
    if num_workers < 0:
        raise ConfigError(f"num_workers must be at least 0, got {num_workers}")
    return 0 if num_workers == 0 else num_workers * (2 if prefetch_factor is None else prefetch_factor)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerConfig:
    """What every member must agree on."""

    dataset_size: int
    batch_size: int
    seed: int = 0
    stable: bool = False
    horizon: int = 0  # steps the loader may run ahead of the commits: loader_horizon()
    vnodes: int = DEFAULT_VNODES
    load_factor: float = DEFAULT_LOAD_FACTOR

    def __post_init__(self) -> None:
        for name in ("dataset_size", "batch_size", "seed", "horizon", "vnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        if self.dataset_size < 1:
            raise ConfigError(f"dataset_size must be at least 1, got {self.dataset_size}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.horizon < 0:
            raise ConfigError(f"horizon must be at least 0, got {self.horizon}")
        if self.vnodes < 1:
            raise ConfigError(f"vnodes must be at least 1, got {self.vnodes}")
        if not self.load_factor >= 1.0:
            raise ConfigError(f"load_factor must be at least 1.0, got {self.load_factor}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Commit:
    """Step `step` finished; its result holds the batches of `contributors`; `members` is
    the view for the steps after it."""

    step: int
    contributors: tuple[int, ...]
    members: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochHistory:
    """Everything a rank needs to compute the epoch's assignment: the config, the members at
    the start, every commit that was not "all contributed, same view" and the last committed
    step (-1: none). Plain data: `to_dict()` is msgpack/json-friendly."""

    config: SamplerConfig
    epoch: int
    members: tuple[int, ...]
    commits: tuple[Commit, ...] = ()
    through: int = -1

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that was a member at some step of the epoch so far: the start members,
        and those each commit took in, a joiner that left again before the epoch ended too."""
        seen = set(self.members)
        for k in self.commits:
            seen.update(k.members)
            seen.update(k.contributors)
        return tuple(sorted(seen))

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "config": {"dataset_size": c.dataset_size, "batch_size": c.batch_size, "seed": c.seed,
                       "stable": c.stable, "horizon": c.horizon, "vnodes": c.vnodes, "load_factor": c.load_factor},
            "epoch": self.epoch, "members": list(self.members), "through": self.through,
            "commits": [[k.step, list(k.contributors), list(k.members)] for k in self.commits],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpochHistory:
        try:
            commits = tuple(Commit(step=int(s), contributors=tuple(c), members=tuple(m))
                            for s, c, m in data["commits"])
            return cls(config=SamplerConfig(**data["config"]), epoch=int(data["epoch"]),
                       members=tuple(data["members"]), commits=commits, through=int(data["through"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"not an epoch history: {exc!r}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveEvent:
    """What one membership change or failed contribution moved, for audits."""

    step: int
    departed: tuple[int, ...]
    joined: tuple[int, ...]
    failed: tuple[int, ...]  # members whose batch at `step` is not in the result
    members: int  # members before the change
    remaining: int  # samples not yet processed after `step`, before the move
    pool: int  # samples that had to find a new owner
    moved: int  # samples whose owner changed
    received: dict[int, int]  # rank -> samples it received (pool or joiner's take)
    given: dict[int, int]  # rank -> samples it handed to joiners
    loads: dict[int, int]  # rank -> samples left after the move

    @property
    def moved_fraction(self) -> float:
        return self.moved / self.remaining if self.remaining else 0.0

    @property
    def ideal_fraction(self) -> float:
        """The least fraction any scheme must move: a departed member's fair share, and what
        joiners need for an even split."""
        after = self.members - len(self.departed) + len(self.joined)
        return len(self.departed) / self.members + (len(self.joined) / after if after else 0.0)

    @property
    def balance(self) -> float:
        """Heaviest member's load over the average, after the move (1.0 is perfect)."""
        if not self.loads or not sum(self.loads.values()):
            return 1.0
        return max(self.loads.values()) / (sum(self.loads.values()) / len(self.loads))


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerStats:
    """A snapshot for audits and /status."""

    epoch: int
    rank: int
    member: bool
    members: tuple[int, ...]
    step: int  # last committed step (-1: none)
    steps: int  # steps this epoch will take if the view does not change
    committed: int  # samples committed by all members so far this epoch
    loads: dict[int, int]  # member -> samples not yet processed
    events: tuple[MoveEvent, ...]

    @property
    def balance(self) -> float:
        if not self.loads or not sum(self.loads.values()):
            return 1.0
        return max(self.loads.values()) / (sum(self.loads.values()) / len(self.loads))


@lru_cache(maxsize=16)
def _placement(n: int, seed: int, vnodes: int, load_factor: float, members: tuple[int, ...]) -> dict[int, Indices]:
    """Each member's slots (ascending) at the start of an epoch. Depends on the member set
    only, so it is computed once per set, not once per epoch."""
    ring = HashRing(members, seed=seed, vnodes=vnodes)
    owners = ring.place(_slot_positions(n, seed), load_factor=load_factor)
    order = np.argsort(owners, kind="stable")
    cuts = np.searchsorted(owners[order], members[1:])
    out = dict(zip(members, np.split(order.astype(np.int64), cuts), strict=True))
    for slots in out.values():
        slots.flags.writeable = False
    return out


@lru_cache(maxsize=16)
def _slot_positions(n: int, seed: int) -> npt.NDArray[np.uint64]:
    pos = item_positions(n, seed=seed, salt="slots")
    pos.flags.writeable = False
    return pos


@lru_cache(maxsize=8)
def _ring(members: tuple[int, ...], seed: int, vnodes: int) -> HashRing:
    return HashRing(members, seed=seed, vnodes=vnodes)


@dataclass(slots=True, kw_only=True)
class _Tenure:
    """One stay of a rank in the view: its queue of slots and when each part of it becomes
    available. `ends[k]` is the end of segment k in the queue, available from `avail[k]`."""

    rank: int
    first: int  # first step as a member
    last: int | None = None  # last step as a member (None: still one)
    ends: list[int] = field(default_factory=list)
    avail: list[int] = field(default_factory=list)
    slots: Indices | None = None  # built on first use for the initial tenures
    items: Indices | None = None
    failed: list[int] = field(default_factory=list)  # steps whose batch is not committed

    @property
    def size(self) -> int:
        return self.ends[-1] if self.ends else 0

    def consumed(self, step: int, batch: int) -> int:
        """How many queue entries the batches of steps first..step take."""
        if step < self.first:
            return 0
        taken, at, ready = 0, self.first - 1, 0
        for end, avail in zip(self.ends, self.avail, strict=True):
            avail = max(avail, self.first)
            if avail > step:
                break
            if avail - 1 > at:
                taken, at = min(ready, taken + batch * (avail - 1 - at)), avail - 1
            ready = end
        return min(ready, taken + batch * (step - at))

    def exhausted_at(self, batch: int) -> int:
        """The step whose batch takes the last entry (first - 1 for an empty queue)."""
        taken, at, ready = 0, self.first - 1, 0
        for end, avail in zip(self.ends, self.avail, strict=True):
            avail = max(avail, self.first)
            if avail - 1 > at:
                taken, at = min(ready, taken + batch * (avail - 1 - at)), avail - 1
            ready = end
        return at + math.ceil((self.size - taken) / batch)

    def last_busy_step(self, batch: int) -> int:
        """The last step at which this tenure may hold a non-empty batch (-1: none)."""
        if not self.size:
            return -1
        done = self.exhausted_at(batch)
        return done if self.last is None else min(done, self.last)


@dataclass(slots=True)
class _TakenBack:
    """What a commit found uncommitted: pooled slots (with the rank they came from), each
    survivor's remaining queue and how much of it is pinned by prefetching."""

    pool: list[tuple[int, Indices]] = field(default_factory=list)
    rest: dict[int, Indices] = field(default_factory=dict)
    pinned: dict[int, int] = field(default_factory=dict)
    remaining: int = 0

    def parts(self) -> list[tuple[bool, int, Indices]]:
        """(pooled?, rank, slots): kept queues, then the pool, in the order rebalance sees."""
        return [(False, r, p) for r, p in self.rest.items()] + [(True, r, p) for r, p in self.pool]


class _Epoch:
    """The deterministic assignment of one epoch: pure state, no rank of its own."""

    def __init__(self, config: SamplerConfig, epoch: int, members: tuple[int, ...]) -> None:
        self.config, self.epoch = config, epoch
        self.initial = self.members = members
        self.last_commit = -1
        self.commits: list[Commit] = []
        self.events: list[MoveEvent] = []
        n = config.dataset_size
        self.start = _placement(n, config.seed, config.vnodes, config.load_factor, members)
        self.tenures: dict[int, list[_Tenure]] = {
            r: [_Tenure(rank=r, first=0, ends=[len(self.start[r])], avail=[0])] for r in members}
        self.order_key = stable_key("order", config.seed, epoch)
        self.item_key = stable_key("items", config.seed, epoch)
        self.busy_until = -(-max(len(v) for v in self.start.values()) // config.batch_size) - 1  # = _last_busy()

    # ---- queries -------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Steps in the epoch as far as the commits known now tell."""
        return self.busy_until + 1 + self.config.horizon

    def current(self, rank: int) -> _Tenure | None:
        tenures = self.tenures.get(rank)
        return tenures[-1] if tenures and tenures[-1].last is None else None

    def batch(self, rank: int, step: int) -> Indices:
        """Samples of `rank`'s batch at `step` (empty if it was not a member then)."""
        for ten in self.tenures.get(rank, ()):
            if ten.first <= step and (ten.last is None or step <= ten.last):
                b = self.config.batch_size
                lo, hi = ten.consumed(step - 1, b), ten.consumed(step, b)
                return self._items(ten)[lo:hi] if hi > lo else _EMPTY
        return _EMPTY

    def pending(self, rank: int) -> Indices:
        """Samples `rank` has not processed yet, in the order it will."""
        ten = self.current(rank)
        if ten is None:
            return _EMPTY
        return self._items(ten)[ten.consumed(self.last_commit, self.config.batch_size):].copy()

    def committed(self, rank: int) -> Indices:
        parts = []
        b = self.config.batch_size
        for ten in self.tenures.get(rank, ()):
            upto = self.last_commit if ten.last is None else min(ten.last, self.last_commit)
            if upto < ten.first:
                continue
            keep = np.ones(ten.consumed(upto, b), dtype=bool)
            for step in ten.failed:
                keep[ten.consumed(step - 1, b):ten.consumed(step, b)] = False
            parts.append(self._items(ten)[:len(keep)][keep])
        return np.concatenate(parts) if parts else _EMPTY.copy()

    def loads(self, step: int | None = None) -> dict[int, int]:
        """Samples each member has left after `step` (default: the last committed one)."""
        t, b = self.last_commit if step is None else step, self.config.batch_size
        return {r: ten.size - ten.consumed(t, b) for r in self.members if (ten := self.current(r)) is not None}

    # ---- commits -------------------------------------------------------------------------

    def commit(self, step: int, contributors: tuple[int, ...], members: tuple[int, ...]) -> MoveEvent | None:
        self._check_commit(step, contributors, members)
        event = None
        if contributors != self.members or members != self.members:
            event = self._move(step, contributors, members)
            self.commits.append(Commit(step=step, contributors=contributors, members=members))
            self.events.append(event)
            self.members = members
            self.busy_until = self._last_busy()
        self.last_commit = step
        return event

    def _check_commit(self, step: int, contributors: tuple[int, ...], members: tuple[int, ...]) -> None:
        if step != self.last_commit + 1:
            raise ConfigError(f"commit of step {step} is out of order: the next step to commit in epoch "
                              f"{self.epoch} is {self.last_commit + 1}")
        if step >= self.steps:
            raise ConfigError(f"step {step} is beyond epoch {self.epoch}, which ended after step {self.steps - 1}")
        strays = [] if contributors is self.members else sorted(set(contributors) - set(self.members))
        if strays:
            raise ConfigError(f"contributors {strays} of step {step} are not members {self.members}")
        if not members:
            raise ConfigError(f"the view after step {step} has no members")

    def _move(self, t: int, contributors: tuple[int, ...], nxt: tuple[int, ...]) -> MoveEvent:
        cur = self.members
        failed = tuple(r for r in cur if r not in contributors)
        departed = tuple(r for r in cur if r not in nxt)
        joined = tuple(r for r in nxt if r not in cur)
        took = self._take_back(t, failed, departed)
        parts = took.parts()
        slots = np.concatenate([p for _, _, p in parts])
        was = np.concatenate([np.full(len(p), r, dtype=np.int64) for _, r, p in parts])
        in_pool = np.concatenate([np.full(len(p), pooled) for pooled, _, p in parts])
        owners = np.where(in_pool, -1, was)
        free = np.concatenate([np.arange(len(p)) >= took.pinned[r] if not pooled else np.zeros(len(p), dtype=bool)
                               for pooled, r, p in parts])
        cfg = self.config
        moves = rebalance(_ring(nxt, cfg.seed, cfg.vnodes), _slot_positions(cfg.dataset_size, cfg.seed)[slots],
                          owners, pool=in_pool, free=free, joiners=joined)
        at = 0
        for r, p in took.rest.items():
            self._keep_and_append(r, t, moves.owners[at:at + len(p)] == r, slots[in_pool & (moves.owners == r)])
            at += len(p)
        for j in joined:
            self._open(j, t + 1, slots[moves.owners == j])
        received = dict(moves.received)
        for j, q in moves.taken.items():
            received[j] = received.get(j, 0) + q
        self.members = nxt
        return MoveEvent(step=t, departed=departed, joined=joined, failed=failed, members=len(cur),
                         remaining=took.remaining, pool=int(in_pool.sum()),
                         moved=int(np.count_nonzero(moves.owners != was)), received=received,
                         given=dict(moves.given), loads=self.loads(t))

    def _take_back(self, t: int, failed: tuple[int, ...], departed: tuple[int, ...]) -> _TakenBack:
        """Split what the members had not committed after step t: the batches of t that are
        not in the result and the queues of departed members go to the pool; survivors keep
        the rest of their queues, of which the part batched by step t + horizon is pinned."""
        b, horizon = self.config.batch_size, self.config.horizon
        took = _TakenBack()
        for r in self.members:
            ten = self._current(r)
            slots = self._slots(ten)
            before, done = ten.consumed(t - 1, b), ten.consumed(t, b)
            took.remaining += ten.size - done
            if r in failed:
                ten.failed.append(t)
                took.pool.append((r, slots[before:done]))
                took.remaining += done - before
            if r in departed:
                ten.last = t
                took.pool.append((r, slots[done:]))
            else:
                took.rest[r] = slots[done:]
                took.pinned[r] = ten.consumed(t + horizon, b) - done
        return took

    def _keep_and_append(self, rank: int, t: int, keep: npt.NDArray[np.bool_], new: Indices) -> None:
        """Drop the slots `rank` handed to joiners (all beyond what it may have prefetched),
        then queue the pool slots it received, available from step t + 1 + horizon."""
        ten = self._current(rank)
        slots = self._slots(ten)  # sample ids (ten.items) stay lazy: only batches and audits need them
        if not keep.all():
            kept = np.concatenate([np.ones(ten.consumed(t, self.config.batch_size), dtype=bool), keep])
            cum = np.concatenate([[0], np.cumsum(kept)])
            ten.ends, ten.avail = _squeeze([int(cum[e]) for e in ten.ends], ten.avail)
            ten.slots = slots[kept]
            ten.items = None if ten.items is None else ten.items[kept]
        if len(new):
            new = self._shuffled(new)
            ten.slots = np.concatenate([ten.slots, new])
            ten.items = None if ten.items is None else np.concatenate([ten.items, self._to_items(new)])
            ten.ends.append(ten.size + len(new))
            ten.avail.append(t + 1 + self.config.horizon)

    def _open(self, rank: int, first: int, slots: Indices) -> None:
        slots = self._shuffled(slots)
        ten = _Tenure(rank=rank, first=first, slots=slots)
        if len(slots):
            ten.ends, ten.avail = [len(slots)], [first]
        self.tenures.setdefault(rank, []).append(ten)

    def _last_busy(self) -> int:
        b = self.config.batch_size
        return max(ten.last_busy_step(b) for tens in self.tenures.values() for ten in tens)

    # ---- slots and items -----------------------------------------------------------------

    def _current(self, rank: int) -> _Tenure:
        ten = self.current(rank)
        if ten is None:
            raise AssertionError(f"rank {rank} is in the view but has no open tenure")
        return ten

    def _slots(self, ten: _Tenure) -> Indices:
        if ten.slots is None:  # an initial tenure: its share of the placement, shuffled
            ten.slots = self._shuffled(self.start[ten.rank])
        return ten.slots

    def _items(self, ten: _Tenure) -> Indices:
        if ten.items is None:
            ten.items = self._to_items(self._slots(ten))
        return ten.items

    def _shuffled(self, slots: Indices) -> Indices:
        """Slots in this epoch's order: sorted by a per-epoch key of each slot. The keys are
        distinct (an odd multiplier, an addition and mix64 are bijections), so any sort
        algorithm gives the same order in every process."""
        keys = mix64(slots.astype(np.uint64) * _GOLDEN + np.uint64(self.order_key))
        return slots[np.argsort(keys)]

    def _to_items(self, slots: Indices) -> Indices:
        if self.config.stable:
            return slots.copy()
        return permute_index(slots, self.config.dataset_size, self.item_key)


def _squeeze(ends: list[int], avail: list[int]) -> tuple[list[int], list[int]]:
    """Drop segments left empty."""
    out_e: list[int] = []
    out_a: list[int] = []
    prev = 0
    for e, a in zip(ends, avail, strict=True):
        if e > prev:
            out_e.append(e)
            out_a.append(a)
        prev = e
    return out_e, out_a


class ElasticSampler:
    """Batch sampler for `torch.utils.data.DataLoader(batch_sampler=...)`: yields this rank's
    batch (a list of sample indices, possibly empty) for each step of the epoch. Feed it every
    step's outcome with `commit`; see the module docstring for the guarantees and the rules.

    With a multi-process loader pass `horizon=loader_horizon(num_workers, prefetch_factor)`
    (the same on every rank) and `collate_fn=CollateOrNone()` so that empty batches arrive as
    None."""

    def __init__(self, dataset_size: int, batch_size: int, *, rank: int, members: Iterable[int], seed: int = 0,
                 stable: bool = False, horizon: int = 0, epoch: int = 0, vnodes: int = DEFAULT_VNODES,
                 load_factor: float = DEFAULT_LOAD_FACTOR) -> None:
        config = SamplerConfig(dataset_size=dataset_size, batch_size=batch_size, seed=seed, stable=stable,
                               horizon=horizon, vnodes=vnodes, load_factor=load_factor)
        self._init(config, rank, epoch, _members(members, "members"))
        self._require_member(f"members {self._plan.members}")

    def _init(self, config: SamplerConfig, rank: int, epoch: int, members: tuple[int, ...] | None) -> None:
        """`members` None: no epoch yet (a joiner waiting for the history)."""
        (rank,) = check_ranks([rank], "rank")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.config, self.rank = config, rank
        self._epoch_plan: _Epoch | None = None if members is None else _Epoch(config, epoch, members)
        if not hasattr(self, "_source_step"):  # kept across epochs: the source's steps only grow
            self._source_step: tuple[str, int] | None = None
            self._waiting: list[_Record] | None = None  # a joiner's steps seen before the history came
            self._history_through = -1  # a joiner: the last training step its restored history holds
            self._lock = threading.Lock()  # the history may be restored on another thread than commit_from's

    @classmethod
    def from_history(cls, history: EpochHistory, *, rank: int) -> ElasticSampler:
        """The sampler of a rank that joins (or restarts) mid-epoch: replays the epoch's
        history, so its queue is what every other member computed for it."""
        self = cls.__new__(cls)
        self._init(history.config, rank, history.epoch, None)
        self._epoch_plan = _replayed(history)
        self._require_member(f"the view after step {history.through}, {self._plan.members}")
        return self

    @classmethod
    def follow(cls, opt: Any, dataset_size: int, batch_size: int, *, seed: int = 0, stable: bool = False,
               horizon: int = 0, epoch: int = 0, vnodes: int = DEFAULT_VNODES,
               load_factor: float = DEFAULT_LOAD_FACTOR, name: str = "sampler") -> ElasticSampler:
        """The sampler of `opt`'s worker (a DistributedOptimizer), following joins as well as
        deaths. Every rank calls it alike, members and joiners.

        On a member it is `ElasticSampler(..., rank=ar.rank, members=ar.view.members)`. A
        joining or restarted worker (`opt.syncing`) has no epoch yet: its sampler records each
        step's outcome (`commit_from`) until the epoch history arrives with the training state
        (registered here as `opt.register_state(name, ...)`), then replays those steps. Its
        first step after the state counts it among the contributors with an empty batch
        (`opt.step(contribute=False)`), so every member's `commit_from` takes it in and it gets
        a fair share of what is left from the next step on: loop until `sampler.member`
        (stepping an LR scheduler after each opt.step() there too, as the catch-up expects).
        Every rank must then commit with `commit_from(opt)`."""
        ar = opt.sync.ar
        if opt.syncing:
            config = SamplerConfig(dataset_size=dataset_size, batch_size=batch_size, seed=seed, stable=stable,
                                   horizon=horizon, vnodes=vnodes, load_factor=load_factor)
            self = cls.__new__(cls)
            self._init(config, ar.rank, epoch, None)
            self._waiting = []
        else:
            self = cls(dataset_size, batch_size, rank=ar.rank, members=ar.view.members, seed=seed, stable=stable,
                       horizon=horizon, epoch=epoch, vnodes=vnodes, load_factor=load_factor)
        opt.register_state(name, self._state, self._restore)
        return self

    def _state(self) -> dict[str, Any]:
        """What a joiner takes over (a donor's `register_state` getter): the epoch history and
        the last training step it holds, so the joiner knows which of its own records follow."""
        with self._lock:
            if self._epoch_plan is None:
                raise ConfigError(f"rank {self.rank} was asked for its sampler state while it waits for its own")
            source = self._source_step
            if source is None and self._plan.last_commit >= 0:
                raise ConfigError(f"rank {self.rank}'s sampler has commits but none from commit_from(opt): a joiner "
                                  f"could not tell which training steps its history holds")
            if source is not None and source[0] != "training step":
                raise ConfigError(f"rank {self.rank}'s sampler follows {source[0]}s (commit_from(ar)); a joiner "
                                  f"follows training steps: use commit_from(opt) on every rank")
            return {"history": self.history().to_dict(), "step": -1 if source is None else source[1]}

    def _restore(self, value: Any) -> None:
        """A joiner's `register_state` setter: replay the donor's history, then every step
        this worker recorded after it."""
        with self._lock:
            if self._waiting is None:
                raise ConfigError(f"rank {self.rank}: a sampler state arrived, but this sampler already has its "
                                  f"epoch (only a sampler made by ElasticSampler.follow on a joiner waits for one)")
            try:
                history, last = EpochHistory.from_dict(value["history"]), int(value["step"])
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, ConfigError):
                    raise
                raise ConfigError(f"rank {self.rank}: not a sampler state: {exc!r}") from exc
            if history.config != self.config:
                raise ConfigError(f"rank {self.rank}'s sampler config {self.config} differs from the group's "
                                  f"{history.config}: every rank must build its sampler alike")
            records = [r for r in self._waiting if r[0] > last]
            seen = [r[0] for r in records]
            if seen != list(range(last + 1, last + 1 + len(seen))):
                raise ConfigError(f"rank {self.rank}: the sampler history runs through training step {last}, but "
                                  f"this worker recorded steps {seen} after it while joining (commit_from(opt) "
                                  f"must follow every opt.step())")
            self._epoch_plan = _replayed(history)
            self._waiting = None
            self._history_through = last  # steps up to here are in the history, should they come after it
            for step, contributors, members, contributed in records:
                self._commit_record(("training step", step), contributors, members, contributed)

    def resume(self, history: EpochHistory, members: Iterable[int]) -> bool:
        """Take over a checkpoint's epoch on a member whose process restarted with the whole
        job: replay `history` through its last committed step, and, where the job's processes
        (`members`) differ from its view, commit the next step with no contributors and
        `members` as the view, so returning ranks take their share from then on as joiners do
        (that step's batches are dealt again). Every rank must call it alike. The step numbers
        of the restarted optimizer start again at 0, so `commit_from` accepts them all after it.

        Returns False when the epoch has no step left to take `members` in: the next epoch
        must then start with them (`set_epoch`)."""
        if not isinstance(history, EpochHistory):
            raise ConfigError(f"resume takes an EpochHistory, got {type(history).__name__}")
        if history.config != self.config:
            raise ConfigError(f"the history's sampler config {history.config} differs from this sampler's "
                              f"{self.config}")
        plan = _replayed(history)
        wanted = _members(members, "members")
        taken = True
        if plan.members != wanted:
            if plan.last_commit + 1 < plan.steps:
                plan.commit(plan.last_commit + 1, (), wanted)
            else:
                taken = False
        with self._lock:
            self._epoch_plan = plan
            self._waiting = None
            self._source_step = ("training step", -1)
        return taken

    def _require_member(self, where: str) -> None:
        if self.rank not in self._plan.members:
            raise ConfigError(f"rank {self.rank} is not in {where}")

    @property
    def _plan(self) -> _Epoch:
        plan = self._epoch_plan
        if plan is None:
            raise ConfigError(f"rank {self.rank} is joining and has no epoch history yet: step with "
                              f"opt.step(contribute=False) and sampler.commit_from(opt) until sampler.member")
        return plan

    # ---- the epoch -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._plan.epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The current view: the members of the next step to commit."""
        return self._plan.members

    @property
    def member(self) -> bool:
        """This rank is dealt samples from the next step on (False while a joiner waits)."""
        return self._epoch_plan is not None and self.rank in self._epoch_plan.members

    @property
    def next_step(self) -> int:
        """The next step to commit."""
        return self._plan.last_commit + 1

    @property
    def finished(self) -> bool:
        """Every step of the epoch is committed."""
        return self._plan.last_commit + 1 >= self._plan.steps

    def set_epoch(self, epoch: int, members: Iterable[int] | None = None) -> None:
        """Start `epoch` with `members` (default: the current view). Every member must do the
        same. Samples not committed in the abandoned epoch are not carried over."""
        view = self._plan.members if members is None else _members(members, "members")
        if self.rank not in view:
            raise ConfigError(f"rank {self.rank} is not in members {view} of epoch {epoch}")
        self._init(self.config, self.rank, epoch, view)

    def __len__(self) -> int:
        """Steps in the epoch, trailing empty steps included, if the view does not change."""
        return self._plan.steps

    def __iter__(self) -> Iterator[list[int]]:
        plan, horizon = self._plan, self.config.horizon
        step = plan.last_commit + 1
        while True:
            if self._plan is not plan:
                raise ConfigError(f"set_epoch was called while a loader still iterated epoch {plan.epoch}")
            if step > plan.last_commit + 1 + horizon:
                raise ConfigError(
                    f"rank {self.rank} was asked for the batch of step {step} before step {step - 1 - horizon} was "
                    f"committed: the loader runs further ahead than horizon={horizon} (use "
                    f"loader_horizon(num_workers, prefetch_factor), and commit each step before the next batch)")
            if step >= plan.steps:
                return
            ten = plan.current(self.rank)
            if ten is None or step < ten.first:
                return  # this rank left the view
            yield plan.batch(self.rank, step).tolist()
            step += 1

    def batch(self, step: int, rank: int | None = None) -> list[int]:
        """The batch `rank` (default: this one) has or will have at `step`, as far as the
        commits known now tell (final up to step next_step + horizon)."""
        out: list[int] = self._plan.batch(self.rank if rank is None else rank, step).tolist()
        return out

    def commit(self, step: int, contributors: Collection[int], members_next: Collection[int] | None = None
               ) -> MoveEvent | None:
        """Step `step` finished and its result holds the batches of `contributors`;
        `members_next` (default: unchanged) is the view for the following steps. Returns what
        moved, or None when everyone contributed and the view is unchanged (the fast path)."""
        view = self._plan.members
        contrib = _same_or_checked(contributors, view, "contributors")
        nxt = view if members_next is None else _same_or_checked(members_next, view, "members_next")
        return self._plan.commit(step, contrib, nxt)

    def commit_from(self, source: Any) -> MoveEvent | None:
        """Commit the next step (`next_step`) from what `source` saw of the step it just
        finished: a DistributedOptimizer or GradientSync (`last_step`: the contributors common
        to all its gradient buckets) or an FTTreeAllreduce (`last`, for loops with one allreduce
        per step). Call it once after each step; every member gets the same outcome from the
        allreduce, so all samplers stay alike with no messages of their own."""
        if hasattr(source, "last_step"):
            rec = source.last_step
            if rec is None:
                raise ConfigError(f"commit_from: {type(source).__name__} has finished no training step yet: "
                                  f"call opt.step() first")
            key, contributors, members = ("training step", int(rec.step)), rec.contributors, rec.members_next
            contributed: bool | None = bool(rec.contributed)
        elif hasattr(source, "last") and hasattr(source, "view"):
            res = source.last
            if res is None:
                raise ConfigError("commit_from: the allreduce handle has finished no step yet")
            key, contributors, members, contributed = ("allreduce step", int(res.step)), res.contributors, \
                tuple(sorted({*res.contributors, *res.late})), None
        else:
            raise ConfigError(f"commit_from takes a DistributedOptimizer, GradientSync or FTTreeAllreduce, "
                              f"not {type(source).__name__}")
        with self._lock:
            if self._source_step is not None and key[0] == self._source_step[0] and key[1] <= self._source_step[1]:
                raise ConfigError(f"commit_from: {key[0]} {key[1]} is already committed; call it once after each "
                                  f"step")
            if key[0] == "training step" and key[1] <= self._history_through:
                self._source_step = key  # a joiner's step that the history it restored already holds
                return None
            if self._waiting is not None:  # a joiner without its history: replayed when it comes (_restore)
                if key[0] != "training step":
                    raise ConfigError(f"rank {self.rank} is joining: its sampler follows a DistributedOptimizer "
                                      f"(commit_from(opt)), not {type(source).__name__}")
                if getattr(source, "syncing", True) is False:
                    raise ConfigError(f"rank {self.rank} has its training state but no sampler history in it: the "
                                      f"donor's sampler was not made with ElasticSampler.follow(opt, ...), which "
                                      f"every rank must use")
                self._waiting.append((key[1], tuple(contributors), tuple(members), contributed))
                self._source_step = key
                return None
            return self._commit_record(key, contributors, members, contributed)

    def _commit_record(self, key: tuple[str, int], contributors: Collection[int], members: Collection[int],
                       contributed: bool | None) -> MoveEvent | None:
        """Commit the next step from one step's outcome. Contributors this sampler has never
        dealt to are joiners: a rank not in the view had an empty batch, whatever it sent (its
        own sampler refuses anything else), and takes its share from the next step on."""
        plan = self._plan
        if self.rank not in plan.members and plan.last_commit + 1 >= plan.steps:
            # a joiner not dealt to yet follows the group into its next epoch, as the members'
            # set_epoch(epoch + 1) does, with the view the epoch ended with
            self._epoch_plan = plan = _Epoch(self.config, plan.epoch + 1, plan.members)
        step = plan.last_commit + 1
        if contributed is not None and self.rank in contributors:
            has_batch = len(plan.batch(self.rank, step)) > 0
            if has_batch and not contributed:
                raise ConfigError(f"rank {self.rank} stepped with contribute=False at step {step} of epoch "
                                  f"{self.epoch}, but its batch there has samples: they would count as trained")
            if contributed and not has_batch:
                raise ConfigError(f"rank {self.rank} has no batch at step {step} of epoch {self.epoch} but "
                                  f"contributed gradients: use opt.step(contribute=False), so the average "
                                  f"leaves it out")
        view = plan.members
        if not set(contributors).issubset(view):
            joiners = sorted(set(contributors) - set(view))
            missing = sorted(set(joiners) - set(members))
            if missing:
                raise ConfigError(f"ranks {missing} contributed to {key[0]} {key[1]} but are neither in this "
                                  f"sampler's view {list(view)} nor in the next view {sorted(members)}")
            contributors = tuple(r for r in contributors if r in view)
        event = self.commit(step, contributors, members)
        self._source_step = key
        return event

    # ---- audits --------------------------------------------------------------------------

    def committed(self, rank: int | None = None) -> Indices:
        """Samples `rank` (default: this one) committed in this epoch, in commit order."""
        return self._plan.committed(self.rank if rank is None else rank)

    def pending(self, rank: int | None = None) -> Indices:
        """Samples `rank` (default: this one) has yet to process, in order: what a node-local
        cache should hold next."""
        return self._plan.pending(self.rank if rank is None else rank)

    def history(self) -> EpochHistory:
        p = self._plan
        return EpochHistory(config=self.config, epoch=p.epoch, members=p.initial,
                            commits=tuple(p.commits), through=p.last_commit)

    def stats(self) -> SamplerStats:
        p = self._plan
        committed = sum(len(self._plan.committed(r)) for r in p.tenures)
        return SamplerStats(epoch=p.epoch, rank=self.rank, member=self.member, members=p.members,
                            step=p.last_commit, steps=p.steps, committed=committed, loads=p.loads(),
                            events=tuple(p.events))


def _replayed(history: EpochHistory) -> _Epoch:
    """The epoch as `history` leaves it: its commits, and "all contributed, same view" between."""
    plan = _Epoch(history.config, history.epoch, _members(history.members, "members"))

    def fill(upto: int) -> None:
        while plan.last_commit < upto:
            plan.commit(plan.last_commit + 1, plan.members, plan.members)

    for c in history.commits:
        if c.step > history.through:
            raise ConfigError(f"history holds a commit of step {c.step} beyond its last step {history.through}")
        fill(c.step - 1)
        view = plan.members
        plan.commit(c.step, _same_or_checked(c.contributors, view, "contributors"),
                    _same_or_checked(c.members, view, "members_next"))
    fill(history.through)
    return plan


def _same_or_checked(ranks: Collection[int], view: tuple[int, ...], what: str) -> tuple[int, ...]:
    """`view` itself when `ranks` equals it (the per-step fast path), else checked ranks."""
    if ranks is view or (isinstance(ranks, tuple) and ranks == view):
        return view
    if isinstance(ranks, set | frozenset) and len(ranks) == len(view) and ranks.issuperset(view):
        return view
    return _members(ranks, what)


def _members(ranks: Iterable[int], what: str) -> tuple[int, ...]:
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Iterable):
        raise ConfigError(f"{what} must be a collection of ranks, got {ranks!r}")
    return check_ranks(ranks, what)


class CollateOrNone:
    """A DataLoader collate_fn that turns an empty batch into None (the step still runs, with
    an empty contribution) and hands the others to `collate_fn` (default: torch's)."""

    def __init__(self, collate_fn: Any = None) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: list[Any]) -> Any:
        if not batch:
            return None
        if self.collate_fn is None:
            from torch.utils.data import default_collate

            return default_collate(batch)
        return self.collate_fn(batch)
