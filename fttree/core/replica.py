"""Replica: what one worker decides, behind one entrance, `Replica.step(event, now) -> actions`.

A worker is three machines that must move together: the tree machine (each step's reduce and
broadcast, protocol.py), the membership (failure detection and the Paxos view change,
membership.py) and the life cycle (lifecycle.py). Their hand-offs were the driver's: a view
change fences the tree (the membership asks, the tree answers with the steps it holds), a view
is applied to the tree when decided or, for a join, at a training-step boundary, and the
boundary itself is news to the membership. Here they are decided in one place, without I/O:

- tree events (Submit, Received, TimerFired, LinkDown) go to the tree machine;
- membership events (PeerDown, Busy, ControlReceived, MemberTimer, Uplink; Heard, StaleSender,
  Finish) go to the membership, and its Fence comes back as Fenced at once, with the steps this
  rank holds results of;
- `StepBoundary` takes decided joins into effect and tells the membership where training is;
- a view is applied in one place, `_apply_view` (raft's ApplyConfChange): decided joins not in
  effect yet are superseded, the tree installs it, holders send the catch-up results.

What comes back is for the driver (net/node.py) to carry out: frames, timers, results, and
three records of its own: `Admit` (a decided join: the driver remembers the joiner's process),
`ViewApplied` (run the steps held back during the change) and `JoinInEffect` (tell the joiners,
with the members' addresses, from which step they take part).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .config import Config
from .lifecycle import Lifecycle
from .membership import (
    Boundary,
    Fence,
    Fenced,
    Installed,
    MemberAction,
    MemberEvent,
    Membership,
    Stopped,
)
from .messages import Kind, Message
from .protocol import Action, Event, LinkDown, Received, Send, Submit, TimerFired, TreeMachine
from .view import View


@dataclass(frozen=True, slots=True, kw_only=True)
class StepBoundary:
    """The caller begins training step `user_step` with allreduce step `first_step`."""

    user_step: int
    first_step: int


class Heard(NamedTuple):
    """A frame, or bytes of one, came from `peer`: it is alive. (A tuple: one is made for every
    frame, and a frozen dataclass costs several times as much to build.)"""

    peer: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StaleSender:
    """`msg` came from a view before ours: its sender may not know it was left out."""

    msg: Message


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """This rank's job is over after allreduce step `step`."""

    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Admit:
    """A join was decided; it takes effect at training step `installed.activate_at`."""

    installed: Installed


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewApplied:
    """`installed` is this rank's view now: steps held back during the change run in it."""

    installed: Installed
    superseded: tuple[int, ...] = ()  # epochs of decided joins this view voided


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinInEffect:
    """A decided join took effect here at allreduce step `first_step`."""

    installed: Installed
    first_step: int


ReplicaEvent = Event | MemberEvent | StepBoundary | Heard | StaleSender | Finish
_TREE_EVENTS = frozenset({Submit, Received, TimerFired, LinkDown})
ReplicaAction = Action | MemberAction | Admit | ViewApplied | JoinInEffect


class Replica:
    """One worker's decisions. `step` is the only way in that changes anything; the fields are
    for reading (status pages, tests)."""

    def __init__(self, rank: int, view: View, config: Config, *, join: bool = False) -> None:
        self.rank = rank
        self.cfg = config
        self.machine = TreeMachine(rank, view, config)
        self.membership = Membership(rank, view, config)
        self.life = Lifecycle(join=join)
        # decided joins, each taking effect at its training step, in order: a second join can be
        # decided here before the first took effect (another member coordinated it)
        self.pending: deque[Installed] = deque()
        self.completed: deque[int] = deque(maxlen=256)  # steps with a whole result here, newest last

    @property
    def view(self) -> View:
        return self.machine.view

    def admitted(self, view: View, first_step: int, user_step: int) -> None:
        """This process (a joiner) was admitted into `view` from `first_step` (training step
        `user_step`): its machines start there."""
        self.machine = TreeMachine(self.rank, view, self.cfg)
        self.machine.start_at(first_step)
        self.membership = Membership(self.rank, view, self.cfg)
        self.membership.user_step = user_step - 1

    def step(self, event: ReplicaEvent, now: float) -> list[ReplicaAction]:
        kind = type(event)
        if kind in _TREE_EVENTS:  # hundreds a step: straight to the tree
            return self.machine.handle(event, now)  # type: ignore[arg-type, return-value]
        out: list[ReplicaAction] = []
        if kind is Heard:  # one per frame from a member, almost always nothing to do
            heard = self.membership.heard(event.peer, now)  # type: ignore[union-attr]
            if heard:
                self._carry(heard, now, out)
            return out
        match event:
            case StepBoundary():
                self._boundary(event, now, out)
            case StaleSender(msg=msg):
                self._carry(self.membership.stale_sender(msg), now, out)
            case Finish(step=step):
                self._carry(self.membership.finish(step), now, out)
            case _:
                self._member(event, now, out)  # type: ignore[arg-type]
        return out

    # ---- the hand-offs ---------------------------------------------------------------------------

    def _member(self, event: MemberEvent, now: float, out: list[ReplicaAction]) -> None:
        self._carry(self.membership.handle(event, now), now, out)

    def _carry(self, actions: list[MemberAction], now: float, out: list[ReplicaAction]) -> None:
        for action in actions:
            match action:
                case Fence():
                    self.machine.fence()
                    self._member(Fenced(held=tuple(sorted(set(self.completed)))), now, out)
                case Installed() if action.activate_at >= 0:
                    self.pending.append(action)  # a join: the tree switches at that training step
                    if len(self.pending) == 1:  # the next to take effect: its early frames are handled
                        out.extend(self.machine.expect(action.view, now))
                    out.append(Admit(installed=action))
                case Installed():
                    self._apply_view(action, now, out)
                case Stopped():  # left out or a minority: the tree produces no more results
                    self.machine.fence()
                    out.append(action)
                case _:
                    out.append(action)

    def _apply_view(self, inst: Installed, now: float, out: list[ReplicaAction]) -> None:
        """The one place a decided view becomes this rank's. Decided joins not yet in effect
        are superseded: this view was formed from the promisers, and a joiner that never heard
        of its admission did not promise; taking its older view into effect later would bring
        back whoever this one evicted (the membership admits that joiner again)."""
        superseded = tuple(p.view.epoch for p in self.pending)
        self.pending.clear()
        out.extend(self.machine.install(inst.view, inst.committed, now))
        for plan in inst.catch_up:
            if plan.holder != self.rank:
                continue
            for chunk, result, contributors, signature in self.machine.result_of(plan.step):
                msg = Message(kind=Kind.CATCHUP, src=self.rank, epoch=inst.view.epoch, step=plan.step, chunk=chunk,
                              contributors=contributors, dtype=result.dtype.str, numel=int(result.size),
                              signature=signature, payload=result.data.cast("B"))
                out.extend(Send(dst=dst, msg=msg) for dst in plan.lacking)
        out.append(ViewApplied(installed=inst, superseded=superseded))

    def _boundary(self, event: StepBoundary, now: float, out: list[ReplicaAction]) -> None:
        """Decided joins whose training step has come take effect, in order; then the
        membership hears where training is (a join or pace change waiting for this may start)."""
        while self.pending and event.user_step >= self.pending[0].activate_at:
            inst = self.pending.popleft()
            out.extend(self.machine.activate(inst.view, now))
            out.append(JoinInEffect(installed=inst, first_step=event.first_step))
            if self.pending:
                out.extend(self.machine.expect(self.pending[0].view, now))
        self._member(Boundary(user_step=event.user_step), now, out)
