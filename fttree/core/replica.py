"""Replica: what one worker decides, behind one entrance, `Replica.step(event, now) -> actions`.

A worker is three machines that must move together: the tree machine (each step's reduce and
broadcast, protocol.py), the membership (failure detection and the Paxos view change,
membership.py) and the life cycle (lifecycle.py). Their hand-offs were the driver's: a view
change fences the tree (the membership asks, the tree answers with the steps it holds), a view
is applied to the tree when decided or, for a join, at a training-step boundary, and the
boundary itself is news to the membership. Here they are decided in one place, without I/O:

- `Arrived(frame)` is checked against the sender rules (messages.SENDER_RULES, `may_send`): a
  frame its sender may not send comes back as `Foreign`, changing nothing (as does a step's
  frame whose sender has another role in the step's tree: roles.py, the tree machine's entry
  checks it, as only it knows which view's tree a frame is of). A member's frame
  that comes before this process takes part waits (until `Connected` hands it back in
  `Redeliver`); then it is news to the membership (its sender is alive) and goes to its part:
  a step's frame to the tree, a membership frame to the membership, DONE/DONE_ACK to the
  farewell, model state out as `Deliver`;
- tree events (Submit, TimerFired) go to the tree machine, and `LinkLost` too while taking part;
- membership events (PeerDown, Busy, ControlReceived, MemberTimer, Uplink, Heard, Finish) go to
  the membership, and its Fence comes back as Fenced at once, with the steps this rank holds
  results of;
- `StepBoundary` takes decided joins into effect (the joiners hear from which step, `Reply`)
  and tells the membership where training is; `StepDone` records a step's whole result (a view
  change reports it as held); `AckDue` sends the DONE_ACKs finished peers wait for;
- the life cycle's news (`FirstStart`, `GroupFound`, `Connected`, `Leave`, `Stop`) moves the
  transition table (lifecycle.py): the driver reads where it is (`phase`, `running`), never moves it;
- a view is applied in one place, `_apply_view` (raft's ApplyConfChange): decided joins not in
  effect yet are superseded, the tree installs it, holders send the catch-up results;
- the join handshake's frames (JOIN, JOIN_ASK, JOIN_REPLY) go to admission.py: a member answers
  whether a group runs and takes requests to the membership; an asker hears the answers and,
  once admitted, starts its machines in the view it was let into.

What comes back is for the driver (net/node.py) to carry out: frames, timers, results, and
records of its own: `Admit` (a decided join), `ViewApplied` (run the steps held back during the
change), `JoinInEffect` (a decided join took effect), `Foreign`, `Deliver`, `Farewells`,
`Redeliver`, and the handshake's `Reply`, `LearnAddress`, `Answered` and `Joined`. `step` is
the only way in that changes anything: the driver reads the rest through read-only properties,
and tests/test_driver_writes_nothing.py keeps fttree/net/ to that.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .admission import Admission, Answer, Answered, Joined, LearnAddress, Query, Reply
from .config import Config
from .effects import Action, Cause, Complete, LinkState, Note, Send
from .effects import Foreign as Foreign  # (re-exported: the driver takes it from here with the others)
from .farewell import Farewell
from .lifecycle import Life, Lifecycle, Phase
from .membership import (
    Boundary,
    Confirmed,
    ControlReceived,
    Fence,
    Fenced,
    Installed,
    MemberAction,
    MemberEvent,
    MemberFrame,
    Membership,
    MemberState,
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


@dataclass(frozen=True, slots=True)
class FirstStart:
    """No group runs: every peer is starting too, so this process connects to its tree neighbours."""


@dataclass(frozen=True, slots=True)
class GroupFound:
    """A group runs already: this process asks it to be admitted."""


@dataclass(frozen=True, slots=True)
class Connected:
    """The tree neighbours are reachable: this rank takes part from now on."""


@dataclass(frozen=True, slots=True)
class Leave:
    """This rank leaves the group (the members drop it from the next view)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """This rank produces no more results: closed, crashed, left out, or never admitted."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDone:
    """Allreduce step `step` has its whole result here: a view change reports it as held."""

    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AckDue:
    """Acknowledge the finished peers (DONE_ACK) whose last step has an outcome here: submitted
    (at most `last_submitted`) and not `pending` any more, or all of them if `stopped`."""

    last_submitted: int
    pending: frozenset[int]
    stopped: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Deliver:
    """A piece of model state (or a request for it) from a member, for the elastic listeners."""

    msg: State


@dataclass(frozen=True, slots=True, kw_only=True)
class Farewells:
    """A DONE or DONE_ACK changed the farewell (farewell.py): acknowledge what is due (`AckDue`),
    look again whether this finished rank may close."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Redeliver:
    """Frames that came before this rank took part: hand them in again, as if they came now."""

    frames: tuple[Frame, ...]


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


#: the driver's news of this process's life (lifecycle.py): the move each makes
_LIFE_EVENTS: dict[type, Life] = {FirstStart: Life.FIRST_START, GroupFound: Life.GROUP_FOUND, Leave: Life.LEAVE,
                                  Stop: Life.STOP}
ReplicaEvent = (Event | MemberEvent | StepBoundary | Arrived | Heard | LinkLost | Finish | FirstStart | GroupFound
                | Connected | Leave | Stop | StepDone | AckDue)
_TREE_EVENTS = frozenset({Submit, Received, TimerFired, LinkDown})
ReplicaAction = (Action | MemberAction | Admit | ViewApplied | JoinInEffect | Reply | LearnAddress | Answered
                 | Joined | Foreign | Deliver | Farewells | Redeliver)


class Replica:
    """One worker's decisions. `step` is the only way in that changes anything; the properties
    are for reading (the driver, status pages, tests)."""

    def __init__(self, rank: int, view: View, config: Config, *, join: bool = False) -> None:
        self.rank = rank
        self.cfg = config
        self._machine = TreeMachine(rank, view, config)
        self._membership = Membership(rank, view, config)
        self._life = Lifecycle(join=join)
        self._admission = Admission()
        # decided joins, each taking effect at its training step, in order: a second join can be
        # decided here before the first took effect (another member coordinated it)
        self._pending: deque[Installed] = deque()
        self._completed: deque[int] = deque(maxlen=256)  # steps with a whole result here, newest last
        self._early: list[Frame] = []  # frames from members before this process takes part
        self._early_kept = 0  # their payload bytes (at most EARLY_BYTES_FLOOR)
        self._farewell = Farewell()  # DONE and DONE_ACK bookkeeping (farewell.py)
        self._data_at: dict[int, float] = {}  # peer -> when tensor data from it last arrived
        # data frames for steps not submitted here yet (EARLY_BYTES_FLOOR): step -> bytes handed on
        self.newest_submitted = -1
        self._early_steps: dict[int, int] = {}
        self.early_bytes = 0  # subtree sums' bytes handed to the tree for steps not submitted yet
        self._recent: deque[list[int]] = deque()  # [step, bytes submitted] of the last EARLY_WINDOW_STEPS steps
        self._recent_bytes = 0
        self.early_dropped = 0  # data frames dropped for want of room (counted; the first is noted)
        self.early_dropped_bytes = 0
        self._unconfirmed: list[Complete] = []  # results kept back after a freeze (self_check.py)

    # ---- what the driver may read (it changes nothing but through `step`) ----------------------

    @property
    def view(self) -> View:
        return self._machine.view

    @property
    def machine(self) -> TreeMachine:
        """The tree machine, for status pages and tests."""
        return self._machine

    @property
    def membership(self) -> Membership:
        """The membership, for status pages, tests and the driver's readings (its deadlines)."""
        return self._membership

    @property
    def admission(self) -> Admission:
        """What the join handshake heard, for the driver's polls (net/joining.py)."""
        return self._admission

    @property
    def phase(self) -> Phase:
        """Where this process is in its life (lifecycle.py)."""
        return self._life.phase

    @property
    def running(self) -> bool:
        """Taking part, or leaving: a broken link is news, not a peer still starting up."""
        return self._life.running

    @property
    def leaving(self) -> bool:
        """This rank said it leaves (its end is a leave, not a failure)."""
        return self._life.phase is Phase.LEAVING

    @property
    def changing_view(self) -> bool:
        """A view change is under way: steps submitted now wait for its view."""
        return self._membership.state is MemberState.CHANGING

    @property
    def pending(self) -> tuple[Installed, ...]:
        """Decided joins not in effect yet, in the order they take effect."""
        return tuple(self._pending)

    @property
    def owes_acks(self) -> bool:
        """Finished peers wait for this rank's DONE_ACK (`AckDue` sends those due)."""
        return bool(self._farewell.owed)

    def waiting_for(self, last: int) -> list[int]:
        """The members this finished rank, whose last step is `last`, still waits for (farewell.py)."""
        membership = self._membership
        return self._farewell.waiting_for(membership.view.members, me=self.rank, done=membership.done, last=last)

    def _admitted(self, view: View, first_step: int, user_step: int) -> None:
        """This process (a joiner) was admitted into `view` from `first_step` (training step
        `user_step`): its machines start there."""
        self._machine = TreeMachine(self.rank, view, self.cfg)
        self._machine.start_at(first_step)
        self._membership = Membership(self.rank, view, self.cfg)
        self._membership.user_step = user_step - 1
        self.newest_submitted = max(self.newest_submitted, first_step - 1)

    # ---- the entrance ----------------------------------------------------------------------------

    def step(self, event: ReplicaEvent, now: float) -> list[ReplicaAction]:
        """Take `event` at time `now`; what comes back is for the driver to carry out, in order."""
        kind = type(event)
        membership = self._membership
        if membership.detection.late_by(now) > 0 and not membership.doubting:
            return self._froze(event, now)
        if kind in _TREE_EVENTS:  # hundreds a step: straight to the tree
            if kind is Submit:
                self._submitted(event)  # type: ignore[arg-type]
            actions = self._machine.handle(event, now)  # type: ignore[arg-type]
            return self._keep_back(actions) if membership.doubting else actions  # type: ignore[return-value]
        out: list[ReplicaAction] = []
        if kind is Arrived:  # one per frame
            self._arrived(event.msg, event.link, now, out)  # type: ignore[union-attr]
        else:
            self._other(event, now, out)
        return out

    def _other(self, event: ReplicaEvent, now: float, out: list[ReplicaAction]) -> None:
        """Everything but a step's events and its frames (a few a step)."""
        kind = type(event)
        match event:
            case Heard(peer=peer):
                if self._life.running:
                    self._data_at[peer] = now
                    self._carry(self._membership.heard(peer, now), now, out)
            case StepBoundary():
                self._boundary(event, now, out)
            case LinkLost(peer=peer, reason=reason, refused=refused):
                if self._life.running and peer not in self._membership.done:  # not starting, nor finished
                    actions = self._machine.handle(LinkDown(peer=peer, reason=reason), now)
                    out.extend(self._keep_back(actions) if self._membership.doubting else actions)
                    if refused:
                        self._member(PeerDown(peer=peer, reason=reason), now, out)
            case Finish(step=step):
                self._carry(self._membership.finish(step), now, out)
            case StepDone(step=step):
                self._completed.append(step)
            case AckDue():
                self._ack_due(event, out)
            case Connected():
                self._connected(out)
            case FirstStart() | GroupFound() | Leave() | Stop():
                self._life.on(_LIFE_EVENTS[kind])
            case _:
                self._member(event, now, out)  # type: ignore[arg-type]

    def _froze(self, event: ReplicaEvent, now: float) -> list[ReplicaAction]:
        """The check timer is late: this process did not run, and may have
        been left out meanwhile. Its results wait until a neighbour confirms (self_check.py);
        then `event` is taken as any other."""
        out: list[ReplicaAction] = []
        self._carry(self._membership.froze(now), now, out)
        out.extend(self.step(event, now))
        return out

    def _keep_back(self, actions: list[Action]) -> list[Action]:
        """While this rank doubts it is a member, its results wait (a failure goes out: it hands
        the caller no sum)."""
        if not any(type(a) is Complete for a in actions):
            return actions
        self._unconfirmed.extend(a for a in actions if isinstance(a, Complete))
        return [a for a in actions if type(a) is not Complete]

    def alive(self, now: float) -> frozenset[int]:
        """Peers whose tensor data arrived within the node deadline (a frame or part of one):
        their part of a step is on its way, slowly. A peer that only answers pings is alive
        but not sending (it may have left the step)."""
        recent = now - self._membership.node_deadline_s
        return frozenset(peer for peer, at in self._data_at.items() if at >= recent)

    # ---- a frame: whether its sender may send it, and which part it is for -----------------------

    def _arrived(self, msg: Frame, link: LinkState | None, now: float, out: list[ReplicaAction]) -> None:
        rule = SENDER_RULES[msg.kind]
        if rule is Sender.PROVEN and isinstance(msg, Join):
            self._join_frame(msg, now, out)
            return
        running = self._life.phase is not Phase.STOPPED
        epoch = self._membership.view.epoch
        stale = msg.epoch < epoch and running  # its sender may not know it was left out
        if rule not in _MEMBER_RULES or not self.may_send(msg.src):
            out.append(Foreign(msg=msg, rule=rule))
            if stale and rule in _MEMBER_RULES:
                self._carry(self._membership.stale_sender(msg), now, out)
            return
        if self._keep_early(msg):
            return
        if isinstance(msg, State):
            out.append(Deliver(msg=msg))
            return
        if running:
            heard = self._membership.heard(msg.src, now)
            if heard:  # almost always nothing
                self._carry(heard, now, out)
        if msg.payload is not None:
            self._data_at[msg.src] = now
        if not isinstance(msg, Message):
            self._view_frame(msg, running, now, out)  # type: ignore[arg-type]
            return
        if stale:
            self._carry(self._membership.stale_sender(msg), now, out)
        # data held until its step runs here, or until its view is installed: within the early bytes
        if (msg.payload is not None
                and (msg.epoch > epoch or (msg.kind is Kind.DATA_REDUCE and msg.step > self.newest_submitted))
                and not self._room_early(msg, out, later_view=msg.epoch > epoch)):
            return
        actions = self._machine.handle(Received(msg=msg, link=link), now)
        out.extend(self._keep_back(actions) if self._membership.doubting else actions)

    def _view_frame(self, msg: MemberFrame, running: bool, now: float, out: list[ReplicaAction]) -> None:
        if isinstance(msg, Notice) and msg.kind is Kind.DONE_ACK:
            self._farewell.peer_has(msg.src, msg.step)
            out.append(Farewells())
        elif isinstance(msg, Join):
            self._join_frame(msg, now, out)
        else:
            if running:
                self._member(ControlReceived(msg=msg), now, out)
            if isinstance(msg, Notice) and msg.kind is Kind.DONE:
                self._farewell.peer_done(msg.src, msg.step)
                out.append(Farewells())

    def _ack_due(self, event: AckDue, out: list[ReplicaAction]) -> None:
        """The DONE_ACKs due now: the finished peer's last step has an outcome here."""
        epoch = self._machine.view.epoch
        for peer, step in self._farewell.due(last_submitted=event.last_submitted, pending=event.pending.__contains__,
                                             stopped=event.stopped):
            out.append(Send(dst=peer, msg=Notice(kind=Kind.DONE_ACK, src=self.rank, epoch=epoch, step=step)))

    # ---- the hand-offs ---------------------------------------------------------------------------

    def _member(self, event: MemberEvent, now: float, out: list[ReplicaAction]) -> None:
        self._carry(self._membership.handle(event, now), now, out)

    def _carry(self, actions: list[MemberAction], now: float, out: list[ReplicaAction]) -> None:
        for action in actions:
            match action:
                case Confirmed():
                    out.append(action)
                    out.extend(self._unconfirmed)
                    self._unconfirmed.clear()
                case Fence():
                    self._machine.fence()
                    self._member(Fenced(held=tuple(sorted(set(self._completed)))), now, out)
                case Installed() if action.activate_at >= 0:
                    self._pending.append(action)  # a join: the tree switches at that training step
                    if len(self._pending) == 1:  # the next to take effect: its early frames are handled
                        out.extend(self._machine.expect(action.view, now))
                    self._admission.admitted(action.joined)
                    out.append(Admit(installed=action))
                case Installed():
                    self._apply_view(action, now, out)
                    if self._membership.doubting:
                        # kept by the change (self_check.py): of the results kept back, those of
                        # committed steps go out; the others' steps were voided and run again
                        self._unconfirmed = [c for c in self._unconfirmed if c.step in action.committed]
                        self._carry(self._membership.kept_by_view(), now, out)
                case Stopped():  # left out or a minority: the tree produces no more results
                    self._machine.fence()
                    self._unconfirmed.clear()  # the driver fails their steps as it fails all others
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
        superseded = tuple(p.view.epoch for p in self._pending)
        self._pending.clear()
        out.extend(self._machine.install(inst.view, inst.committed, now))
        for plan in inst.catch_up:
            if plan.holder != self.rank:
                continue
            for chunk, result, contributors, late, signature in self._machine.result_of(plan.step):
                msg = Message(kind=Kind.CATCHUP, src=self.rank, epoch=inst.view.epoch, step=plan.step, chunk=chunk,
                              contributors=contributors, late=late, dtype=result.dtype.str, numel=int(result.size),
                              signature=signature, payload=result.data.cast("B"))
                out.extend(Send(dst=dst, msg=msg) for dst in plan.lacking)
        out.append(ViewApplied(installed=inst, superseded=superseded))

    def _boundary(self, event: StepBoundary, now: float, out: list[ReplicaAction]) -> None:
        """Decided joins whose training step has come take effect, in order; then the
        membership hears where training is (a join or pace change waiting for this may start)."""
        while self._pending and event.user_step >= self._pending[0].activate_at:
            inst = self._pending.popleft()
            out.extend(self._machine.activate(inst.view, now))
            # the joiners hear from which step they take part
            out.extend(Reply(dst=r, answer=Answer.ADMITTED, view=inst.view, first_step=event.first_step,
                             user_step=inst.activate_at) for r in inst.joined)
            out.append(JoinInEffect(installed=inst, first_step=event.first_step))
            if self._pending:
                out.extend(self._machine.expect(self._pending[0].view, now))
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

    def _room_early(self, msg: Message, out: list[ReplicaAction], *, later_view: bool = False) -> bool:
        """Is there room to hold `msg`, a subtree sum for a step not submitted here (the tree
        holds it until the step runs), or any data of a view not installed here (`later_view`:
        the tree holds it until the view is)? If not, it is dropped and counted (the first one
        noted). A subtree sum for a step too far ahead is the tree's to drop
        (Config.max_ops_ahead); a later view's frame is held whatever its step, so it is
        counted and dropped here when its step is that far ahead (released, as the others, once
        this rank submits past it)."""
        size = len(memoryview(msg.payload).cast("B")) if msg.payload is not None else 0
        step = msg.step
        if step > self.newest_submitted + self.cfg.max_ops_ahead:
            if not later_view:
                return True
        elif self.early_bytes + size <= self.early_limit() and self._room_far(step, size):
            self._early_steps[step] = self._early_steps.get(step, 0) + size
            self.early_bytes += size
            return True
        self.early_dropped += 1
        self.early_dropped_bytes += size
        if self.early_dropped == 1:
            out.append(Note(step=step, cause=Cause.PROTOCOL_VIOLATION, peer=msg.src,
                            text=f"dropped {msg.kind.name} of {size} bytes from rank {msg.src} for step {step}"
                                 f"{f' of view {msg.epoch}, not installed here' if later_view else ''}, which this "
                                 f"rank has not submitted yet: it holds {self.early_bytes} bytes for such steps "
                                 f"already (at most {self.early_limit()}); further ones are counted, not logged"))
        return False

    def _room_far(self, step: int, size: int) -> bool:
        """Is there room for `size` bytes for `step` among the steps far ahead (EARLY_FAR_BYTES)?
        Near steps always are: the overall bound is theirs."""
        near = self.newest_submitted + EARLY_NEAR_STEPS
        if step <= near:
            return True
        return sum(b for s, b in self._early_steps.items() if s > near) + size <= EARLY_FAR_BYTES

    # ---- frames before taking part, and stale frames ---------------------------------------------

    def _keep_early(self, msg: Frame) -> bool:
        """Is this process not sure yet whether it is in a group, or in which view? Then `msg`
        waits (a step's frame or a state piece, up to `max_ops_ahead` of them) until `connected`.
        A restarted process may be handed frames its previous incarnation's peers had queued
        (probes, relays): answered from view 0 as if this were the first start, the stale answer
        would draw the view that leaves this rank out."""
        if not self._life.early:
            return False
        size = 0 if msg.payload is None else len(memoryview(msg.payload).cast("B"))
        if isinstance(msg, Message | State) and len(self._early) < self.cfg.max_ops_ahead \
                and self._early_kept + size <= EARLY_BYTES_FLOOR:
            self._early.append(msg)
            self._early_kept += size
        return True

    def _connected(self, out: list[ReplicaAction]) -> None:
        """The tree neighbours are reachable: this rank takes part from now on, and the frames
        that came early go back to the driver to hand in again (it knows their links now)."""
        self._life.on(Life.CONNECTED)
        early, self._early = self._early, []
        self._early_kept = 0
        if early:
            out.append(Redeliver(frames=tuple(early)))

    def is_stale(self, msg: Frame) -> bool:
        """Is `msg` worthless now (the transport drops it unsent)? Only a step's frame of a view
        older than the tree's: a view change voided its op, which runs again under a new id. A
        frame of an op that finished here is still owed to its peer: behind a slow uplink a
        child's share of the result waits in the bulk queue for longer than the op lingers."""
        if type(msg) is not Message or msg.kind in _NEVER_STALE or msg.answer:
            return False  # about links, views or committed results; or answers about an op we let go of
        return self._machine.is_past_epoch(msg.epoch)

    # ---- who may send, and the join handshake ----------------------------------------------------

    def may_send(self, rank: int) -> bool:
        """Is `rank` one whose frames this worker takes (the sender rule MEMBER)? A member of
        its view or of a view decided and not yet in effect, a rank it is admitting, or, while
        this process asks to join, a member of the group it asked."""
        if rank in self._membership.view or rank in self._admission.candidates:
            return True
        if any(rank in p.view for p in self._pending):
            return True
        if self._life.phase is Phase.ASKING:
            group = self._admission.group
            return group is None or rank in group[1]
        return False

    def _join_frame(self, msg: Join, now: float, out: list[ReplicaAction]) -> None:
        if msg.kind is Kind.JOIN_REPLY:
            self._join_answer(msg, out)
            return
        phase = self._life.phase
        if phase is Phase.ASKING:
            return  # not a member yet: nothing to tell
        if msg.kind is Kind.JOIN and msg.query is Query.IS_RUNNING:
            out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r == msg.src != self.rank)
            view = self._membership.view
            answer = self._admission.answer(msg.src, msg.incarnation, view=view,
                                           began=bool(self._completed or self._machine.view.epoch),
                                           stopped=phase is Phase.STOPPED)
            out.append(Reply(dst=msg.src, answer=answer, view=view))
            return
        joiner = msg.src if msg.kind is Kind.JOIN else msg.target  # JOIN_ASK: a member passes it on
        if joiner < 0 or joiner == self.rank or phase is Phase.STOPPED:
            return
        if not self._admission.request(joiner, msg.incarnation, self._membership.view):
            return
        out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r == joiner)
        self._member(ControlReceived(msg=msg), now, out)

    def _join_answer(self, msg: Join, out: list[ReplicaAction]) -> None:
        """A starting or joining process hears: the group is starting too, is running in this
        view, or admits this rank from this step."""
        phase = self._life.phase
        if phase is Phase.ASKING and msg.answer is Answer.ADMITTED and self.rank in msg.members:
            # the admitting member's address book: ranks that joined with us (other trees link them)
            out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r != self.rank)
            self._admitted(View(msg.epoch, msg.members, msg.pace, msg.uplinks, self.view.reach), msg.step,
                          msg.user_step)
            self._life.on(Life.ADMITTED)
            for r in msg.members:
                self._admission.incarnations.setdefault(r, 0)
            out.append(Joined(first_step=msg.step, user_step=msg.user_step))
        elif phase in (Phase.STARTING, Phase.ASKING):
            self._admission.heard(msg.src, msg.answer, msg.epoch, msg.members, starting=phase is Phase.STARTING)
            if phase is Phase.ASKING and msg.answer is Answer.RUNNING:
                out.extend(LearnAddress(rank=r, address=a) for r, a in msg.addresses if r != self.rank)
        out.append(Answered())
