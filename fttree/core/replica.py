"""Replica: what one worker decides, behind one entrance, `Replica.step(event, now) -> actions`.

A worker is three machines that must move together: the tree machine (each step's reduce and
broadcast, protocol.py), the membership (failure detection and the Paxos view change,
membership.py) and the life cycle (lifecycle.py). Their hand-offs were the driver's: a view
change fences the tree (the membership asks, the tree answers with the steps it holds), a view
is applied to the tree when decided or, for a join, at a training-step boundary, and the
boundary itself is news to the membership. Here they are decided in one place, without I/O:

- `Arrived(frame)` is checked against the sender rules (messages.SENDER_RULES, `may_send`): a
  frame its sender may not send comes back as `Foreign`, changing nothing. A member's frame
  that comes before this process takes part waits (`keep_early`, until `connected`); then it is
  news to the membership (its sender is alive) and goes to its part: a step's frame to the tree,
  a membership frame to the membership, DONE/DONE_ACK to the farewell, model state out as
  `Deliver`;
- tree events (Submit, TimerFired) go to the tree machine, and `LinkLost` too while taking part;
- membership events (PeerDown, Busy, ControlReceived, MemberTimer, Uplink, Heard, Finish) go to
  the membership, and its Fence comes back as Fenced at once, with the steps this rank holds
  results of;
- `StepBoundary` takes decided joins into effect and tells the membership where training is;
- a view is applied in one place, `_apply_view` (raft's ApplyConfChange): decided joins not in
  effect yet are superseded, the tree installs it, holders send the catch-up results;
- the join handshake's frames (JOIN, JOIN_ASK, JOIN_REPLY) go to admission.py: a member answers
  whether a group runs and takes requests to the membership; an asker hears the answers and,
  once admitted, starts its machines in the view it was let into.

What comes back is for the driver (net/node.py) to carry out: frames, timers, results, and
records of its own: `Admit` (a decided join), `ViewApplied` (run the steps held back during the
change), `JoinInEffect` (tell the joiners from which step they take part), `Foreign`, `Deliver`,
`Farewells`, and the handshake's `Reply`, `LearnAddress`, `Answered` and `Joined`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .admission import Admission, Answer, Answered, Joined, LearnAddress, Query, Reply
from .config import Config
from .effects import Action, Cause, LinkState, Note, Send
from .farewell import Farewell
from .lifecycle import Life, Lifecycle, Phase
from .membership import (
    Boundary,
    ControlReceived,
    Fence,
    Fenced,
    Installed,
    MemberAction,
    MemberEvent,
    MemberFrame,
    Membership,
    NotCoordinator,
    PeerDown,
    Stopped,
)
from .messages import SENDER_RULES, Frame, Join, Kind, Message, Notice, Sender, State
from .protocol import Event, LinkDown, Received, Submit, TimerFired, TreeMachine
from .view import View

#: a step's frames about links or committed results: never stale (Replica.is_stale)
_NEVER_STALE = frozenset({Kind.PROBE, Kind.PROBE_ACK, Kind.CATCHUP, Kind.META_STALLED})
# Data that comes for steps this rank has not submitted yet (its children are ahead of it) is held
# until the step runs. Its bytes are bounded: the larger of EARLY_BYTES_FLOOR and EARLY_FACTOR
# times what this rank submitted over its last EARLY_WINDOW_STEPS steps (a training step's
# gradient buckets are many steps, all of which the children may send before this rank reaches
# them). A frame beyond it is dropped, counted and logged once; the step it was for gets that
# data back the way a lost frame comes (the backups relay it) or ends by its deadline.
EARLY_BYTES_FLOOR = 64 << 20
EARLY_WINDOW_STEPS = 64
EARLY_FACTOR = 4
# Of those bytes, steps more than EARLY_NEAR_STEPS beyond this rank's newest submitted one hold
# at most EARLY_FAR_BYTES: children run ahead by a training step's buckets, not by hundreds of
# steps, and a key holder's sums for steps a thousand ahead would otherwise sit in memory until
# those steps run (a dropped one costs its step a relay, never a wrong sum).
EARLY_NEAR_STEPS = 256
EARLY_FAR_BYTES = 8 << 20
#: sender rules whose frames a member sends (a coordinator's commit: the membership checks the ballot)
_MEMBER_RULES = frozenset({Sender.MEMBER, Sender.COORDINATOR})


@dataclass(frozen=True, slots=True, kw_only=True)
class StepBoundary:
    """The caller begins training step `user_step` with allreduce step `first_step`."""

    user_step: int
    first_step: int


class Arrived(NamedTuple):
    """A frame came, claiming to be from `msg.src` (SENDER_RULES say whether it may be). `link`:
    for LINK_QUERY_KINDS, this rank's link to `msg.target`, as the transport sees it. (A tuple:
    one is made for every frame, and a frozen dataclass costs several times as much to build.)"""

    msg: Frame
    link: LinkState | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkLost:
    """The transport lost its link to `peer`; `refused`: a connection to it was refused (its
    process is likely gone, which the membership hears at once)."""

    peer: int
    reason: str
    refused: bool = False


class Heard(NamedTuple):
    """Bytes of a large frame are arriving from `peer`: it is alive, and its data is on its way."""

    peer: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """This rank's job is over after allreduce step `step`."""

    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Foreign:
    """`msg` was dropped: its sender may not send it (`rule`). For the driver to count and log."""

    msg: Frame
    rule: Sender


@dataclass(frozen=True, slots=True, kw_only=True)
class Deliver:
    """A piece of model state (or a request for it) from a member, for the elastic listeners."""

    msg: State


@dataclass(frozen=True, slots=True, kw_only=True)
class Farewells:
    """A DONE or DONE_ACK changed `Replica.farewell`: acknowledge what is due, look again
    whether this finished rank may close."""


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


ReplicaEvent = Event | MemberEvent | StepBoundary | Arrived | Heard | LinkLost | Finish
_TREE_EVENTS = frozenset({Submit, Received, TimerFired, LinkDown})
ReplicaAction = (Action | MemberAction | Admit | ViewApplied | JoinInEffect | Reply | LearnAddress | Answered
                 | Joined | Foreign | Deliver | Farewells)


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
        self.early: list[Frame] = []  # frames from members before this process takes part
        self._early_kept = 0  # their payload bytes (at most EARLY_BYTES_FLOOR)
        self.farewell = Farewell()  # DONE and DONE_ACK bookkeeping (farewell.py)
        self._data_at: dict[int, float] = {}  # peer -> when tensor data from it last arrived
        # data frames for steps not submitted here yet (EARLY_BYTES_FLOOR): step -> bytes handed on
        self.newest_submitted = -1
        self._early_steps: dict[int, int] = {}
        self.early_bytes = 0  # subtree sums' bytes handed to the tree for steps not submitted yet
        self._recent: deque[list[int]] = deque()  # [step, bytes submitted] of the last EARLY_WINDOW_STEPS steps
        self._recent_bytes = 0
        self.early_dropped = 0  # data frames dropped for want of room (counted; the first is noted)
        self.early_dropped_bytes = 0

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
        self.newest_submitted = max(self.newest_submitted, first_step - 1)

    def step(self, event: ReplicaEvent, now: float) -> list[ReplicaAction]:
        kind = type(event)
        if kind in _TREE_EVENTS:  # hundreds a step: straight to the tree
            if kind is Submit:
                self._submitted(event)  # type: ignore[arg-type]
            return self.machine.handle(event, now)  # type: ignore[arg-type, return-value]
        out: list[ReplicaAction] = []
        if kind is Arrived:  # one per frame
            self._arrived(event.msg, event.link, now, out)  # type: ignore[union-attr]
            return out
        match event:
            case Heard(peer=peer):
                if self.life.running:
                    self._data_at[peer] = now
                    self._carry(self.membership.heard(peer, now), now, out)
            case StepBoundary():
                self._boundary(event, now, out)
            case LinkLost(peer=peer, reason=reason, refused=refused):
                if self.life.running and peer not in self.membership.done:  # not starting, nor finished
                    out.extend(self.machine.handle(LinkDown(peer=peer, reason=reason), now))
                    if refused:
                        self._member(PeerDown(peer=peer, reason=reason), now, out)
            case Finish(step=step):
                self._carry(self.membership.finish(step), now, out)
            case _:
                self._member(event, now, out)  # type: ignore[arg-type]
        return out

    def alive(self, now: float) -> frozenset[int]:
        """Peers whose tensor data arrived within the node deadline (a frame or part of one):
        their part of a step is on its way, slowly. A peer that only answers pings is alive
        but not sending (it may have left the step)."""
        recent = now - self.membership.node_deadline_s
        return frozenset(peer for peer, at in self._data_at.items() if at >= recent)

    # ---- a frame: whether its sender may send it, and which part it is for -----------------------

    def _arrived(self, msg: Frame, link: LinkState | None, now: float, out: list[ReplicaAction]) -> None:
        rule = SENDER_RULES[msg.kind]
        if rule is Sender.PROVEN and isinstance(msg, Join):
            self._join_frame(msg, now, out)
            return
        running = self.life.phase is not Phase.STOPPED
        stale = msg.epoch < self.membership.view.epoch and running  # its sender may not know it was left out
        if rule not in _MEMBER_RULES or not self.may_send(msg.src):
            out.append(Foreign(msg=msg, rule=rule))
            if stale and rule in _MEMBER_RULES:
                self._carry(self.membership.stale_sender(msg), now, out)
            return
        if self.keep_early(msg):
            return
        if isinstance(msg, State):
            out.append(Deliver(msg=msg))
            return
        if running:
            heard = self.membership.heard(msg.src, now)
            if heard:  # almost always nothing
                self._carry(heard, now, out)
        if msg.payload is not None:
            self._data_at[msg.src] = now
        if not isinstance(msg, Message):
            self._view_frame(msg, running, now, out)  # type: ignore[arg-type]
            return
        if stale:
            self._carry(self.membership.stale_sender(msg), now, out)
        if msg.kind is Kind.DATA_REDUCE and msg.step > self.newest_submitted and not self._room_early(msg, out):
            return
        out.extend(self.machine.handle(Received(msg=msg, link=link), now))

    def _view_frame(self, msg: MemberFrame, running: bool, now: float, out: list[ReplicaAction]) -> None:
        if isinstance(msg, Notice) and msg.kind is Kind.DONE_ACK:
            self.farewell.peer_has(msg.src, msg.step)
            out.append(Farewells())
        elif isinstance(msg, Join):
            self._join_frame(msg, now, out)
        else:
            if running:
                self._member(ControlReceived(msg=msg), now, out)
            if isinstance(msg, Notice) and msg.kind is Kind.DONE:
                self.farewell.peer_done(msg.src, msg.step)
                out.append(Farewells())

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
                case NotCoordinator(msg=msg):  # counted as any frame its sender may not send
                    out.append(Foreign(msg=msg, rule=Sender.COORDINATOR))
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
            for chunk, result, contributors, late, signature in self.machine.result_of(plan.step):
                msg = Message(kind=Kind.CATCHUP, src=self.rank, epoch=inst.view.epoch, step=plan.step, chunk=chunk,
                              contributors=contributors, late=late, dtype=result.dtype.str, numel=int(result.size),
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

    # ---- data that comes early: bounded in bytes -------------------------------------------------

    def early_limit(self) -> int:
        """The bytes this rank holds at most for steps it has not submitted (EARLY_BYTES_FLOOR)."""
        return max(EARLY_BYTES_FLOOR, EARLY_FACTOR * self._recent_bytes)

    def _submitted(self, ev: Submit) -> None:
        """A chunk of ours started: the sizes seen, and the early data of its step is the op's now."""
        recent = self._recent
        if recent and recent[-1][0] == ev.step:
            recent[-1][1] += ev.data.nbytes
        else:
            recent.append([ev.step, ev.data.nbytes])
            if len(recent) > EARLY_WINDOW_STEPS:
                self._recent_bytes -= recent.popleft()[1]
        self._recent_bytes += ev.data.nbytes
        if ev.step > self.newest_submitted:
            self.newest_submitted = ev.step
            if self._early_steps:
                for step in [s for s in self._early_steps if s <= ev.step]:
                    self.early_bytes -= self._early_steps.pop(step)

    def _room_early(self, msg: Message, out: list[ReplicaAction]) -> bool:
        """Is there room to hold `msg`, a subtree sum for a step not submitted here (the tree
        holds it until the step runs)? If not, it is dropped and counted (the first one noted).
        One for a step too far ahead is the tree's to drop (Config.max_ops_ahead)."""
        size = len(memoryview(msg.payload).cast("B")) if msg.payload is not None else 0
        step = msg.step
        if step > self.newest_submitted + self.cfg.max_ops_ahead:
            return True
        if self.early_bytes + size <= self.early_limit() and self._room_far(step, size):
            self._early_steps[step] = self._early_steps.get(step, 0) + size
            self.early_bytes += size
            return True
        self.early_dropped += 1
        self.early_dropped_bytes += size
        if self.early_dropped == 1:
            out.append(Note(step=step, cause=Cause.PROTOCOL_VIOLATION, peer=msg.src,
                            text=f"dropped {msg.kind.name} of {size} bytes from rank {msg.src} for step {step}, "
                                 f"which this rank has not submitted yet: it holds {self.early_bytes} bytes for "
                                 f"such steps already (at most {self.early_limit()}); further ones are counted, "
                                 "not logged"))
        return False

    def _room_far(self, step: int, size: int) -> bool:
        """Is there room for `size` bytes for `step` among the steps far ahead (EARLY_FAR_BYTES)?
        Near steps always are: the overall bound is theirs."""
        near = self.newest_submitted + EARLY_NEAR_STEPS
        if step <= near:
            return True
        return sum(b for s, b in self._early_steps.items() if s > near) + size <= EARLY_FAR_BYTES

    # ---- frames before taking part, and stale frames ---------------------------------------------

    def keep_early(self, msg: Frame) -> bool:
        """Is this process not sure yet whether it is in a group, or in which view? Then `msg`
        waits (a step's frame or a state piece, up to `max_ops_ahead` of them) until `connected`.
        A restarted process may be handed frames its previous incarnation's peers had queued
        (probes, relays): answered from view 0 as if this were the first start, the stale answer
        would draw the view that leaves this rank out."""
        if not self.life.early:
            return False
        size = 0 if msg.payload is None else len(memoryview(msg.payload).cast("B"))
        if isinstance(msg, Message | State) and len(self.early) < self.cfg.max_ops_ahead \
                and self._early_kept + size <= EARLY_BYTES_FLOOR:
            self.early.append(msg)
            self._early_kept += size
        return True

    def connected(self) -> list[Frame]:
        """The tree neighbours are reachable: this rank takes part from now on. Returns the
        frames that came early, for the driver to hand in again."""
        self.life.on(Life.CONNECTED)
        early, self.early = self.early, []
        self._early_kept = 0
        return early

    def is_stale(self, msg: Frame) -> bool:
        """Is `msg` worthless now (the transport drops it unsent)? Only a step's frame of a view
        older than the tree's: a view change voided its op, which runs again under a new id. A
        frame of an op that finished here is still owed to its peer: behind a slow uplink a
        child's share of the result waits in the bulk queue for longer than the op lingers."""
        if type(msg) is not Message or msg.kind in _NEVER_STALE or msg.answer:
            return False  # about links, views or committed results; or answers about an op we let go of
        return self.machine.is_past_epoch(msg.epoch)

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
        if msg.kind is Kind.JOIN and msg.query == Query.IS_RUNNING:
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
        if phase is Phase.ASKING and msg.answer == Answer.ADMITTED and self.rank in msg.members:
            # the admitting member's address book: ranks that joined with us (other trees link them)
            out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r != self.rank)
            self.admitted(View(msg.epoch, msg.members, msg.pace, msg.uplinks, self.view.reach), msg.step,
                          msg.user_step)
            self.life.on(Life.ADMITTED)
            for r in msg.members:
                self.admission.incarnations.setdefault(r, 0)
            out.append(Joined(first_step=msg.step, user_step=msg.user_step))
        elif phase in (Phase.STARTING, Phase.ASKING):
            self.admission.heard(msg.src, msg.answer, msg.epoch, msg.members, starting=phase is Phase.STARTING)
            if phase is Phase.ASKING and msg.answer == Answer.RUNNING:
                out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r != self.rank)
        out.append(Answered())
