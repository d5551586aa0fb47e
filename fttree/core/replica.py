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

- `JoinFrame` (JOIN, JOIN_ASK, JOIN_REPLY) goes to the join handshake (admission.py): a member
  answers whether a group runs and takes requests to the membership; an asker hears the answers
  and, once admitted, starts its machines in the view it was let into;
- `may_send(rank)` is the sender rule MEMBER (messages.py): whose frames are taken at all.

What comes back is for the driver (net/node.py) to carry out: frames, timers, results, and
records of its own: `Admit` (a decided join), `ViewApplied` (run the steps held back during the
change), `JoinInEffect` (tell the joiners from which step they take part), and the handshake's
`Reply`, `LearnAddress`, `Answered` and `Joined`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .admission import Admission, Answer, Answered, Joined, LearnAddress, Query, Reply
from .config import Config
from .lifecycle import Life, Lifecycle, Phase
from .membership import (
    Boundary,
    ControlReceived,
    Fence,
    Fenced,
    Installed,
    MemberAction,
    MemberEvent,
    Membership,
    Stopped,
)
from .messages import Frame, Join, Kind, Message
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

    msg: Frame


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """This rank's job is over after allreduce step `step`."""

    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinFrame:
    """A frame of the join handshake: JOIN, JOIN_ASK or JOIN_REPLY."""

    msg: Join


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


ReplicaEvent = Event | MemberEvent | StepBoundary | Heard | StaleSender | Finish | JoinFrame
_TREE_EVENTS = frozenset({Submit, Received, TimerFired, LinkDown})
ReplicaAction = (Action | MemberAction | Admit | ViewApplied | JoinInEffect | Reply | LearnAddress | Answered
                 | Joined)


class Replica:
    """One worker's decisions. `step` is the only way in that changes anything; the fields are
    for reading (status pages, tests)."""

    def __init__(self, rank: int, view: View, config: Config, *, join: bool = False) -> None:
        self.rank = rank
        self.cfg = config
        self.machine = TreeMachine(rank, view, config)
        self.membership = Membership(rank, view, config)
        self.life = Lifecycle(join=join)
        self.admission = Admission()
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
            case JoinFrame(msg=msg):
                self._join_frame(msg, now, out)
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
                    self.admission.admitted(action.joined)
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

    # ---- who may send, and the join handshake ----------------------------------------------------

    def may_send(self, rank: int) -> bool:
        """Is `rank` one whose frames this worker takes (the sender rule MEMBER)? A member of
        its view or of a view decided and not yet in effect, a rank it is admitting, or, while
        this process asks to join, a member of the group it asked."""
        if rank in self.membership.view or rank in self.admission.candidates:
            return True
        if any(rank in p.view for p in self.pending):
            return True
        if self.life.phase is Phase.ASKING:
            group = self.admission.group
            return group is None or rank in group[1]
        return False

    def _join_frame(self, msg: Join, now: float, out: list[ReplicaAction]) -> None:
        if msg.kind is Kind.JOIN_REPLY:
            self._join_answer(msg, out)
            return
        phase = self.life.phase
        if phase is Phase.ASKING:
            return  # not a member yet: nothing to tell
        if msg.kind is Kind.JOIN and msg.code == Query.IS_RUNNING:
            out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r == msg.src != self.rank)
            view = self.membership.view
            answer = self.admission.answer(msg.src, msg.incarnation, view=view,
                                           began=bool(self.completed or self.machine.view.epoch),
                                           stopped=phase is Phase.STOPPED)
            out.append(Reply(dst=msg.src, answer=answer, view=view))
            return
        joiner = msg.src if msg.kind is Kind.JOIN else msg.target  # JOIN_ASK: a member passes it on
        if joiner < 0 or joiner == self.rank or phase is Phase.STOPPED:
            return
        if not self.admission.request(joiner, msg.incarnation, self.membership.view):
            return
        out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r == joiner)
        self._member(ControlReceived(msg=msg), now, out)

    def _join_answer(self, msg: Join, out: list[ReplicaAction]) -> None:
        """A starting or joining process hears: the group is starting too, is running in this
        view, or admits this rank from this step."""
        phase = self.life.phase
        if phase is Phase.ASKING and msg.code == Answer.ADMITTED and self.rank in msg.members:
            # the admitting member's address book: ranks that joined with us (other trees link them)
            out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r != self.rank)
            self.admitted(View(msg.epoch, msg.members, msg.pace), msg.step, msg.user_step)
            self.life.on(Life.ADMITTED)
            for r in msg.members:
                self.admission.incarnations.setdefault(r, 0)
            out.append(Joined(first_step=msg.step, user_step=msg.user_step))
        elif phase in (Phase.STARTING, Phase.ASKING):
            self.admission.heard(msg.src, msg.code, msg.epoch, msg.members, starting=phase is Phase.STARTING)
            if phase is Phase.ASKING and msg.code == Answer.RUNNING:
                out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r != self.rank)
        out.append(Answered())
