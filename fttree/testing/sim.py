"""A simulated network with a fake clock for driving TreeMachines in tests.

It speaks the fault language of the netem scripts and `--faults`: `cut(a, b)`, `drop(a, b, p)`,
`delay(a, b, s)`, `isolate(a)`, `heal(...)`, plus a step-windowed FaultSchedule, so a scenario
reads the same in simulation, in-process injection and real iptables runs. Everything is
seeded: a failing seed reproduces exactly.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..core.faults import FaultSchedule
from ..core.messages import Message, decode, encode
from ..core.protocol import (
    Action,
    CancelTimer,
    Complete,
    Fail,
    MachineConfig,
    Note,
    Received,
    Send,
    SetTimer,
    Submit,
    TimerFired,
    TimerKey,
    TimerKind,
    TreeMachine,
)


def _pair(a: int, b: int) -> tuple[int, int]:
    return (min(a, b), max(a, b))


@dataclass
class SimStats:
    sent: int = 0
    dropped: int = 0
    duplicated: int = 0
    data_bytes: int = 0


@dataclass
class SimNetwork:
    """Deterministic discrete-event network of `world` TreeMachines."""

    world: int
    timeout_s: float = 0.5
    step_timeout_s: float = 10.0
    root_timeout_s: float | None = None
    latency_s: float = 0.001
    jitter_s: float = 0.0  # uniform extra latency per frame: reorders messages
    duplicate_p: float = 0.0  # each frame is delivered twice with this probability
    fault_tolerant: bool = True
    seed: int = 0
    wire: bool = True  # round-trip every message through the codec
    faults: FaultSchedule = field(default_factory=FaultSchedule)
    now: float = 0.0
    machines: list[TreeMachine] = field(init=False)
    results: dict[tuple[int, int, int], Complete | Fail] = field(init=False, default_factory=dict)
    finished_at: dict[tuple[int, int, int], float] = field(init=False, default_factory=dict)
    notes: list[tuple[int, Note]] = field(init=False, default_factory=list)
    stats: SimStats = field(init=False, default_factory=SimStats)

    def __post_init__(self) -> None:
        self.machines = [
            TreeMachine(MachineConfig(rank=r, world=self.world, timeout_s=self.timeout_s,
                                      step_timeout_s=self.step_timeout_s,
                                      root_timeout_s=self.root_timeout_s,
                                      fault_tolerant=self.fault_tolerant))
            for r in range(self.world)
        ]
        self._rng = random.Random(self.seed)
        self._queue: list[tuple[float, int, bool, Callable[[], None]]] = []
        self._essential = 0  # queued events other than background probes
        self._seq = itertools.count()
        self._timers: dict[tuple[int, TimerKey], int] = {}
        self._cut: set[tuple[int, int]] = set()
        self._drop: dict[tuple[int, int], float] = {}
        self._delay: dict[tuple[int, int], float] = {}

    # ---- fault language ----------------------------------------------------------------

    def cut(self, a: int, b: int) -> None:
        self._cut.add(_pair(a, b))

    def heal(self, a: int | None = None, b: int | None = None) -> None:
        """Heal one link, every link of rank `a`, or (no arguments) everything."""
        if a is None:
            self._cut.clear()
            self._drop.clear()
            self._delay.clear()
            return
        keep = (lambda p: p != _pair(a, b)) if b is not None else (lambda p: a not in p)
        self._cut = {p for p in self._cut if keep(p)}
        self._drop = {p: v for p, v in self._drop.items() if keep(p)}
        self._delay = {p: v for p, v in self._delay.items() if keep(p)}

    def drop(self, a: int, b: int, p: float) -> None:
        self._drop[_pair(a, b)] = p

    def delay(self, a: int, b: int, s: float) -> None:
        self._delay[_pair(a, b)] = s

    def isolate(self, a: int) -> None:
        for r in range(self.world):
            if r != a:
                self.cut(a, r)

    def at(self, when: float, fn: Callable[[], None], *, essential: bool = True) -> None:
        """Run `fn` (a fault change, a submit) at simulated time `when`."""
        heapq.heappush(self._queue, (when, next(self._seq), essential, fn))
        self._essential += essential

    # ---- driving -----------------------------------------------------------------------

    def submit(self, rank: int, step: int, data: np.ndarray, *, chunk: int = 0,
               signature: str | None = None) -> None:
        sig = signature if signature is not None else f"{data.dtype.name}{list(data.shape)}"
        self._apply(rank, self.machines[rank].handle(
            Submit(step=step, chunk=chunk, data=np.array(data, copy=True).ravel(), signature=sig), self.now))

    def submit_all(self, step: int, contributions: list[np.ndarray], *, chunk: int = 0) -> None:
        for rank, data in enumerate(contributions):
            self.submit(rank, step, data, chunk=chunk)

    def run(self, until: float | None = None) -> None:
        """Process events until only background probes are left (or time passes `until`).

        Probes of failed links go on forever in a real node; here they run while anything
        else is pending, so a run always ends."""
        while self._queue and (self._essential or until is not None):
            when, _, essential, fn = self._queue[0]
            if until is not None and when > until:
                self.now = until
                return
            heapq.heappop(self._queue)
            self._essential -= essential
            self.now = max(self.now, when)
            fn()

    def run_until_finished(self, step: int, *, chunk: int = 0, limit_s: float = 60.0) -> None:
        """Process events until every rank has an outcome for (step, chunk)."""
        end = self.now + limit_s
        while any((r, step, chunk) not in self.results for r in range(self.world)):
            if not self._queue or self.now >= end:
                missing = [r for r in range(self.world) if (r, step, chunk) not in self.results]
                raise AssertionError(f"ranks {missing} have no outcome for step {step} after {limit_s:g} s")
            self.run(until=min(end, self._queue[0][0]))

    def outcome(self, rank: int, step: int, chunk: int = 0) -> Complete | Fail | None:
        return self.results.get((rank, step, chunk))

    # ---- internals ---------------------------------------------------------------------

    def _apply(self, rank: int, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send(dst=dst, msg=msg):
                    self._transmit(rank, dst, msg)
                case SetTimer(key=key, at=at):
                    token = next(self._seq)
                    self._timers[(rank, key)] = token
                    self.at(at, functools.partial(self._fire, rank, key, token),
                            essential=key.kind is not TimerKind.PROBE)
                case CancelTimer(key=key):
                    self._timers.pop((rank, key), None)
                case Complete() | Fail():
                    key3 = (rank, action.step, action.chunk)
                    assert key3 not in self.results, f"rank {rank} finished {key3} twice"
                    self.results[key3] = action
                    self.finished_at[key3] = self.now
                case Note():
                    self.notes.append((rank, action))

    def _fire(self, rank: int, key: TimerKey, token: int) -> None:
        if self._timers.get((rank, key)) != token:
            return  # cancelled or re-armed since
        del self._timers[(rank, key)]
        self._apply(rank, self.machines[rank].handle(TimerFired(key=key), self.now))

    def _transmit(self, src: int, dst: int, msg: Message) -> None:
        self.stats.sent += 1
        pair = _pair(src, dst)
        verdict = self.faults.verdict(src, dst, msg.step)
        if pair in self._cut or verdict.drop or self._rng.random() < self._drop.get(pair, 0.0):
            self.stats.dropped += 1
            return
        if msg.payload is not None:
            self.stats.data_bytes += len(memoryview(msg.payload).cast("B"))
        if self.wire:
            msg = decode(b"".join(bytes(b) for b in encode(msg)))
        copies = 2 if self._rng.random() < self.duplicate_p else 1
        self.stats.duplicated += copies - 1
        for _ in range(copies):
            delay = self.latency_s + self._delay.get(pair, 0.0) + verdict.delay_s
            if self.jitter_s:
                delay += self._rng.uniform(0, self.jitter_s)
            self.at(self.now + delay, functools.partial(self._deliver, dst, msg))

    def _deliver(self, dst: int, msg: Message) -> None:
        self._apply(dst, self.machines[dst].handle(Received(msg=msg), self.now))
