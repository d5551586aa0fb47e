"""SimNetwork: `world` real Nodes on an in-memory network with a fake clock, for tests.

The Nodes are the ones that run over TCP (chunking, reassembly, timers, the protocol), driven
through the transport seam: each gets a `MemoryTransport`, wrapped in the in-process fault layer
when a fault schedule is given, and a clock that is the shared `SimClock` seen through that
rank's eyes (a hung rank's timers wait; a crashed rank's never fire). The network speaks the
fault language of the netem scripts and `--faults`: `cut`, `drop`, `delay`, `isolate`,
`partition`, `heal`, `crash`, `hang`, `resume`, plus step-windowed schedules. Everything is
seeded: a failing seed reproduces exactly. Given `uplink` (bytes per second), the frames go
through a ShapedNetwork instead (shaped.py): every rank's uplink at that rate, segments lost at
the `loss` rate and sent again, and the fault language speaking of packets, as iptables does.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..core.config import Config
from ..core.effects import Note
from ..core.faults import FaultKind, FaultRule, FaultSchedule
from ..core.lifecycle import Phase
from ..core.protocol import TreeMachine
from ..core.reach import EVERYONE, Reach
from ..core.view import View
from ..errors import ConfigError, PeerError
from ..net.faulty import FaultyTransport
from ..net.node import Node, StepResult
from ..net.scheduler import Handle
from ..net.transport import Transport
from .clock import SimClock
from .memory import MemoryNetwork, WireStats
from .shaped import ShapedNetwork

Outcome = StepResult | BaseException


class _RankClock:
    """The shared clock as one process of a rank sees it: its callbacks wait while it hangs and
    are dropped once it crashed or a new process took the rank, like the timers of a stopped or
    killed process."""

    def __init__(self, sim: SimNetwork, rank: int, process: int = 0) -> None:
        self.sim, self.rank, self.process = sim, rank, process

    def now(self) -> float:
        return self.sim.clock.now()

    def monotonic(self) -> float:
        return self.sim.clock.monotonic()

    def call_at(self, when: float, fn: Callable[[], None], *, background: bool = False) -> Handle:
        return self.sim.clock.call_at(when, lambda: self.sim.run_as(self.rank, fn, process=self.process),
                                      background=background)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Handle:
        return self.call_at(self.now() + delay_s, fn)


class SimNetwork:
    """Deterministic discrete-event network of `world` Nodes. Settings are `Config` fields."""

    def __init__(self, world: int, *, config: Config | None = None, latency_s: float = 0.001,
                 jitter_s: float = 0.0, duplicate_p: float = 0.0, seed: int = 0, wire: bool = True,
                 faults: FaultSchedule | str | None = None, uplink: float | Mapping[int, float] | None = None,
                 loss: float = 0.0, fifo: bool = False, reach: Reach = EVERYONE, quick_start: bool = False,
                 **settings: Any) -> None:
        """`reach`: which ranks can connect (core/reach.py). The views place the members by it,
        as workers do from their peers file, and a pair that cannot connect is a link that is
        always down here (the simulator has no relays: what a relay carries over TCP, the
        protocol carries around the link here). `quick_start`: the first processes take part at
        once, as they do once every peer said it is starting too, without asking (a world of
        1,023 asks a million questions first: minutes of CPU before the first step)."""
        self.world = world
        self.reach = reach
        self.config = Config.build(config, **settings)
        self.clock = SimClock()
        self.wire: MemoryNetwork | ShapedNetwork
        if uplink is not None:  # bytes per second, every rank or one each: TCP behind real uplinks
            self.wire = ShapedNetwork(self.clock, uplink=uplink, latency_s=latency_s, loss=loss, seed=seed,
                                      wire=wire)
        else:
            self.wire = MemoryNetwork(self.clock, latency_s=latency_s, jitter_s=jitter_s, duplicate_p=duplicate_p,
                                      seed=seed, wire=wire, fifo=fifo)
        self.faults = (faults if isinstance(faults, FaultSchedule)
                       else FaultSchedule(faults, world=world, seed=seed, simulated=True))
        view = View.initial(world, reach)
        self.nodes: list[Node] = []
        self.notes: list[tuple[int, Note]] = []
        self.note_listeners: list[Callable[[int, Note], None]] = []  # told each note as it is made
        self.results: dict[tuple[int, int], Outcome] = {}
        self.finished_at: dict[tuple[int, int], float] = {}
        self._futures: dict[tuple[int, int], Future[StepResult]] = {}
        self._hung: dict[int, list[Callable[[], None]]] = {}
        self._resume_after: dict[int, int] = {}  # hung rank -> the step the others must finish first
        self._process: dict[int, int] = {}  # rank -> its current process (a restart counts up)
        self._restart_after: dict[int, int] = {}  # crashed rank -> the step the others must finish first
        self._joins = sorted((r for r in self.faults.node_faults() if r.kind is FaultKind.JOIN), key=lambda r: r.a)
        if [r.a for r in self._joins] != list(range(world, world + len(self._joins))) or any(
                (a.first_step or 0) > (b.first_step or 0) for a, b in itertools.pairwise(self._joins)):
            raise ConfigError(f"joins {[str(r) for r in self._joins]}: new ranks are {world}, {world + 1}, ... "
                              "and join in that order (a later step for a higher rank)")
        self.leaves = {r.a: r.first_step or 0 for r in self.faults.node_faults() if r.kind is FaultKind.LEAVE}
        # (rank, its new process, None or the error that kept it out) once a restart or join is settled
        self.process_listeners: list[Callable[[int, Node, PeerError | None], None]] = []
        for a, b in itertools.combinations(range(world), 2):
            if not reach.can_connect(a, b):
                self.cut(a, b)
        end = self.config.startup_timeout_s
        for rank in range(world):  # the first start: each asks the others whether a group runs
            node = self._new_process(rank, view)
            if not quick_start:
                node.find_group(end, functools.partial(self._answered, node, end, self._settled, False))
        for node in self.nodes if quick_start else ():
            node.first_start()
            node.connected()
        # as `fttree launch` does, the first steps come once every worker has started
        while any(n.replica.phase is Phase.STARTING for n in self.nodes) and self.clock.next_at is not None:
            self.clock.run(until=self.clock.next_at)

    def _answered(self, node: Node, end: float, on_admitted: Callable[[Node, PeerError | None], None],
                  tell_first_start: bool, running: bool) -> None:
        """A process learnt whether a group runs: if one does (or it is a new rank) it asks to be
        admitted, and `on_admitted` hears how that ends; if every peer is starting too it is a
        first start and takes part now (`on_admitted` hears of it if `tell_first_start`)."""
        if running or node.joining:
            node.ask_admission(end, lambda error: self._admitted(node, error, on_admitted))
            return
        node.connected()
        if tell_first_start:
            on_admitted(node, None)

    def _new_process(self, rank: int, view: View, *, join: bool = False) -> Node:
        """A process for `rank`: the first, or one that replaces a crashed one (restart), or a
        new rank's (join). It starts with a fresh transport, clock and incarnation."""
        process = self._process[rank] = self._process.get(rank, -1) + 1
        if process or rank >= self.world:
            if not isinstance(self.wire, MemoryNetwork):
                raise ConfigError("restart and join run on the in-memory network (no uplink= shaping)")
            self.wire.revive(rank)
            self._hung.pop(rank, None)
        clock = _RankClock(self, rank, process)
        transport: Transport = self.wire.transport(rank)
        if self.faults:
            transport = FaultyTransport(transport, self.faults, clock)
        node = Node(rank, view, self.config, transport, clock, join=join)
        node.note_listeners.append(functools.partial(self._note, rank))
        if rank < len(self.nodes):
            self.nodes[rank] = node
        elif rank == len(self.nodes):
            self.nodes.append(node)
        else:
            raise ConfigError(f"rank {rank} cannot join before rank {len(self.nodes)}: new ranks join in order")
        return node

    @staticmethod
    def _admitted(node: Node, error: PeerError | None,
                  on_admitted: Callable[[Node, PeerError | None], None]) -> None:
        if error is None:
            node.connected()
        on_admitted(node, error)

    def process_of(self, rank: int) -> int:
        """Which process of `rank` runs now: 0 for the first, one more for each restart."""
        return self._process[rank]

    def start_process(self, rank: int, on_admitted: Callable[[Node, PeerError | None], None]) -> Node:
        """Start a new process of `rank` as a worker starts (`fttree worker`): a rank of the
        world asks its peers whether a group runs (a restart finds one), a new rank asks to be
        admitted; `on_admitted(node, None)` once it is in the group, or with the error that
        kept it out. Nothing of it is left out: the same Node code as over TCP, on timers."""
        joining = rank >= self.world
        node = self._new_process(rank, View.initial(max(self.world, rank + 1), self.reach), join=joining)
        end = self.clock.now() + self.config.startup_timeout_s
        found = functools.partial(self._answered, node, end, on_admitted, True)
        if joining:
            self.run_as(rank, lambda: found(True), process=self._process[rank])
        else:
            self.run_as(rank, lambda: node.find_group(end, found), process=self._process[rank])
        return node

    def _note(self, rank: int, note: Note) -> None:
        self.notes.append((rank, note))
        for listener in self.note_listeners:
            listener(rank, note)

    @property
    def machines(self) -> list[TreeMachine]:
        return [n.machine for n in self.nodes]

    @property
    def hung(self) -> frozenset[int]:
        """Ranks stopped by `hang` and not resumed."""
        return frozenset(self._hung)

    @property
    def now(self) -> float:
        return self.clock.now()

    @property
    def stats(self) -> WireStats:
        return self.wire.stats

    # ---- the fault language ----------------------------------------------------------------

    def reshape(self, rank: int, rate: float) -> None:
        """`rank`'s uplink sends `rate` bytes per second from now on (a shaped network only)."""
        if not isinstance(self.wire, ShapedNetwork):
            raise ConfigError("reshape needs a shaped network: SimNetwork(uplink=...)")
        self.wire.reshape(rank, rate)

    def cut(self, a: int, b: int) -> None:
        self.wire.cut(a, b)

    def drop(self, a: int, b: int, p: float) -> None:
        self.wire.drop(a, b, p)

    def delay(self, a: int, b: int, s: float) -> None:
        self.wire.delay(a, b, s)

    def isolate(self, a: int) -> None:
        self.wire.isolate(a)

    def partition(self, group: Sequence[int]) -> None:
        self.wire.partition(group)

    def heal(self, a: int | None = None, b: int | None = None) -> None:
        self.wire.heal(a, b)

    def crash(self, rank: int) -> None:
        """The rank's process dies: its timers never fire, its sockets are gone (peers that send
        to it see a refused connection), its own steps never finish."""
        self.wire.crash(rank)
        self._hung.pop(rank, None)

    def hang(self, rank: int) -> None:
        """The rank stops (SIGSTOP): frames to it wait, its timers wait, nothing comes from it."""
        self.wire.hang(rank)
        self._hung.setdefault(rank, [])

    def resume(self, rank: int) -> None:
        for fn in self._hung.pop(rank, []):
            fn()
        self.wire.resume(rank)

    def link_down(self, rank: int, peer: int, reason: str = "connection reset") -> None:
        """Tell `rank` its link to `peer` failed hard (what its transport would report)."""
        self.run_as(rank, lambda: self.nodes[rank].on_link_down(peer, reason))

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run `fn` (a fault change, a submit) at simulated time `when`."""
        self.clock.call_at(when, fn)

    def run_as(self, rank: int, fn: Callable[[], None], *, process: int | None = None) -> None:
        """Run `fn` as `rank`'s process (its current one, or `process`) would: not at all once it
        crashed or was replaced, later if it hangs."""
        if rank in self.wire.crashed or (process is not None and process != self._process.get(rank)):
            return
        held = self._hung.get(rank)
        if held is not None:
            held.append(fn)
            return
        fn()

    # ---- driving -----------------------------------------------------------------------------

    def submit(self, rank: int, step: int, data: np.ndarray, *, signature: str | None = None,
               closable: bool = False) -> Future[StepResult]:
        """Rank `rank` starts `step` with its contribution `data` (copied). Node faults of the
        schedule (crash R @S, hang R @S..E, restart R @S[..E]) strike when the rank reaches their
        step; `join R @S` starts rank R's process when the first member reaches step S."""
        for rule in self.faults.node_faults(rank):
            if rule.first_step == step and rule.kind not in (FaultKind.JOIN, FaultKind.LEAVE):
                self._strike(rule)
        for rule in [r for r in self._joins if r.first_step is not None and r.first_step <= step]:
            self._joins.remove(rule)
            self.start_process(rule.a, self._settled)
        sig = signature if signature is not None else f"{data.dtype.name}{list(data.shape)}"
        future: Future[StepResult] = Future()
        key = (rank, step)
        self._futures[key] = future
        future.add_done_callback(functools.partial(self._record, key))
        flat = np.array(data, copy=True).ravel()

        def go() -> None:
            transport = self.nodes[rank].transport
            if isinstance(transport, FaultyTransport):  # as the API counts them: membership frames
                transport.marks.next_step = max(transport.marks.next_step, step + 1)  # belong to this step
            self.nodes[rank].submit(step, flat, sig, future, closable=closable)

        self.run_as(rank, go)
        return future

    def submit_all(self, step: int, contributions: Sequence[np.ndarray]) -> None:
        for rank, data in enumerate(contributions):
            self.submit(rank, step, data)

    def _strike(self, rule: FaultRule) -> None:
        if rule.kind is FaultKind.CRASH:
            self.crash(rule.a)
        elif rule.kind is FaultKind.RESTART:
            self.crash(rule.a)
            if rule.last_step is None or rule.last_step == rule.first_step:
                self.clock.call_later(0.0, functools.partial(self._restart, rule.a))
            else:
                self._restart_after[rule.a] = rule.last_step
        elif rule.kind is FaultKind.HANG:
            self.hang(rule.a)
            if rule.last_step is not None:
                self._resume_after[rule.a] = rule.last_step

    def _record(self, key: tuple[int, int], future: Future[StepResult]) -> None:
        exc = future.exception()
        self.results[key] = exc if exc is not None else future.result()
        self.finished_at[key] = self.clock.now()
        for hung, step in list(self._resume_after.items()):
            if self._others_finished(hung, step):
                del self._resume_after[hung]
                self.resume(hung)
        for crashed, step in list(self._restart_after.items()):
            if self._others_finished(crashed, step):
                del self._restart_after[crashed]
                self._restart(crashed)

    def _others_finished(self, rank: int, step: int) -> bool:
        """Has every other live process that runs `step` an outcome of it (a joiner admitted
        after it does not run it)?"""
        return all((r, step) in self.results for r, node in enumerate(self.nodes)
                   if r != rank and r not in self.wire.crashed
                   and (node.joined_at is None or node.joined_at[0] <= step))

    def _restart(self, rank: int) -> None:
        self.start_process(rank, self._settled)

    def restart(self, rank: int) -> Node:
        """A new process of `rank` (after a crash, an eviction or a leave) starts now, as
        `restart R @S` starts one: the process listeners hear whether the group admitted it."""
        self.crash(rank)  # whatever was left of the old one ends (a process that left exits)
        return self.start_process(rank, self._settled)

    def forget(self, rank: int, step: int) -> None:
        """Drop what is kept of `rank`'s outcome of `step`: a long run that has checked it keeps
        memory bounded (1,023 ranks hold a million outcomes in a thousand steps)."""
        self.results.pop((rank, step), None)
        self.finished_at.pop((rank, step), None)
        self._futures.pop((rank, step), None)

    def _settled(self, node: Node, error: PeerError | None) -> None:
        for listener in self.process_listeners:
            listener(node.rank, node, error)

    def run(self, until: float | None = None) -> None:
        """Process events until only background probes are left (or until simulated time
        `until`). Probes of failed links go on forever in a real node; here they run while
        anything else is pending, so a run always ends."""
        self.clock.run(until)

    def run_until_finished(self, step: int, *, limit_s: float = 60.0, ranks: Sequence[int] | None = None) -> None:
        """Process events until every rank (of `ranks`, or all) that has not crashed and does
        not hang has an outcome for `step`."""
        end = self.clock.now() + limit_s

        def missing() -> list[int]:  # a rank that crashed or hangs meanwhile is no longer waited for
            wanted = range(self.world) if ranks is None else ranks
            return [r for r in wanted
                    if (r, step) not in self.results and r not in self.wire.crashed and r not in self._hung]

        while missing():
            nxt = self.clock.next_at
            if nxt is None or self.clock.now() >= end:
                raise AssertionError(f"ranks {missing()} have no outcome for step {step} after {limit_s:g} s")
            self.clock.run(until=min(end, nxt))

    def outcome(self, rank: int, step: int) -> Outcome | None:
        """The StepResult or the exception rank `rank` got for `step`, or None if none yet."""
        return self.results.get((rank, step))
