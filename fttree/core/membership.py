"""Membership: which ranks are alive, and the agreement that moves the group to a new view.

A pure state machine like TreeMachine (`handle(event, now) -> actions`). The Node feeds it every
frame it hears (`heard`), refused connections, its own activity and the membership messages,
and carries out what comes back. It never touches an op: TreeMachine learns the outcome as a
view change (`Installed`), and is told to stop taking results while one is being agreed
(`Fence`).

`Membership` routes each event to one of its parts and installs the views they decide:
- detection.py: failure detection (pings, the node deadline, suspicions, who is confirmed dead);
- agreement.py: the agreement round (single-decree Paxos over the next view, MINORITY, stalls);
- joins.py: the changes members ask for (joins, leaves, the end of a job, pace);
- coordination.py: who coordinates (one rule for every decision) and whose ballot is whose;
- term.py: what lives for one view only, in one record that an installed view replaces whole;
- member_events.py: the events, actions, agreed value and status that cross its boundary.
Every name other modules import from here can still be imported from here.
"""

from __future__ import annotations

from collections.abc import Collection

from .agreement import MAX_STALLS, RELAYED_KINDS, ViewChange
from .config import Config
from .coordination import SLOTS, coordinator
from .detection import (
    CLOCK_SLACK_S,
    COMPUTING_FRESH,
    MAX_NODE_DEADLINE_S,
    RETRANSMIT_TRIES,
    Detector,
    confirmed_dead,
)
from .effects import CancelTimer, Send, TimerKey, TimerKind
from .joins import JOIN_PASS_ON_S, MAX_WAITING_JOINS, PACE_FACTOR, JoinsAndPace
from .member_events import (
    Boundary,
    Busy,
    CatchUp,
    Confirmed,
    ControlReceived,
    Doubted,
    Eviction,
    Fence,
    Fenced,
    Hold,
    Installed,
    MemberAction,
    MemberEvent,
    MemberFrame,
    MemberState,
    MemberStatus,
    MemberTimer,
    NotCoordinator,
    PeerDown,
    Stopped,
    Suspected,
    Uplink,
    ViewValue,
    flatten_plan,
    unflatten_plan,
)
from .messages import Agreement, Detection, Frame, Join, Notice
from .self_check import SelfCheck
from .term import Term
from .view import View

__all__ = [
    "CLOCK_SLACK_S", "COMPUTING_FRESH", "JOIN_PASS_ON_S", "MAX_NODE_DEADLINE_S", "MAX_STALLS", "MAX_WAITING_JOINS",
    "PACE_FACTOR", "RELAYED_KINDS", "RETRANSMIT_TRIES", "SLOTS",
    "Boundary", "Busy", "CatchUp", "Confirmed", "ControlReceived", "Doubted", "Eviction", "Fence", "Fenced", "Hold",
    "Installed",
    "MemberAction", "MemberEvent", "MemberFrame", "MemberState", "MemberStatus", "MemberTimer", "Membership",
    "NotCoordinator", "PeerDown", "Stopped", "Suspected", "Uplink", "ViewValue",
    "confirmed_dead", "coordinator", "flatten_plan", "unflatten_plan",
]


class Membership:
    """One rank's view of the group. Deterministic: the same events at the same times give the
    same actions. Its parts (`detection`, `change`, `joins`) keep what outlives a view; what
    lives for the current view only is `term`."""

    def __init__(self, rank: int, view: View, config: Config | None = None) -> None:
        self.rank = rank
        self.cfg = config or Config()
        self.term = Term(view=view)
        self.reason = ""  # why this rank stopped, if it did
        self.user_step = -1  # the training step this rank is in (the node reports each boundary)
        self.foreign_commits = 0  # VIEW_COMMITs dropped: not from their ballot's coordinator
        self.detection = Detector(self)
        self.change = ViewChange(self)
        self.joins = JoinsAndPace(self)
        self.self_check = SelfCheck(self)

    # ---- readings --------------------------------------------------------------------------------

    @property
    def view(self) -> View:
        return self.term.view

    @property
    def state(self) -> MemberState:
        return self.term.state

    @property
    def node_deadline_s(self) -> float:
        """How long a neighbour may be silent with a step in flight (detection.py)."""
        return self.detection.node_deadline_s

    @property
    def busy_since(self) -> float | None:
        return self.detection.busy_since

    @property
    def submitted(self) -> int:
        return self.detection.submitted

    @property
    def done(self) -> dict[int, int]:
        """Members that finished their job -> their last step."""
        return self.joins.done

    @property
    def rate(self) -> float:
        """This rank's measured uplink (Uplink events), bytes per second."""
        return self.joins.rate

    @property
    def holding(self) -> bool:
        """Promised in a join or pace round: start no training step until it is decided."""
        return self.term.ballots.holding

    @property
    def slowest_uplink(self) -> float:
        return self.joins.slowest_uplink

    def coordinator(self, passed_over: Collection[int] = ()) -> int | None:
        """The member that coordinates this view's rounds now (see `coordination.coordinator`)."""
        return coordinator(self.view.members, passed_over)

    def computing(self, now: float) -> dict[int, int]:
        """Members still computing a step others wait on -> that step (detection.py)."""
        return self.detection.computing(now)

    def status(self) -> MemberStatus:
        d = self.detection
        return MemberStatus(state=self.state, epoch=self.view.epoch, reason=self.reason,
                            suspects={p: tuple(sorted(r)) for p, r in sorted(self.term.suspicions.reports.items())
                                      if r},
                            evictions=tuple(d.evictions), evicted_total=d.evicted_total,
                            node_deadline_s=d.node_deadline_s, suspicions_total=d.suspicions_total,
                            no_change=self.change.no_change, self_checks=self.self_check.checks_total,
                            self_check_stops=self.self_check.stops_total)

    # ---- events ----------------------------------------------------------------------------------

    def heard(self, peer: int, now: float) -> list[MemberAction]:
        """Any frame from `peer`. The Node calls this for every frame: keep it cheap."""
        return self.detection.heard(peer, now)

    def finish(self, step: int) -> list[MemberAction]:
        """This rank's job is over after `step` (joins.py)."""
        return self.joins.finish(step)

    def stale_sender(self, msg: Frame) -> list[MemberAction]:
        """A frame of an older view: tell its sender the decision it missed (agreement.py)."""
        return self.change.stale_sender(msg)

    @property
    def doubting(self) -> bool:
        """After a freeze: not sure yet that this rank is still a member (self_check.py)."""
        return self.self_check.doubting

    def froze(self, now: float) -> list[MemberAction]:
        """The check timer is late (`detection.late_by`): this process did not run for a while
        (self_check.py)."""
        out: list[MemberAction] = []
        self.self_check.begin(self.detection.freeze_seen(now), now, out)
        return out

    def kept_by_view(self) -> list[MemberAction]:
        """A view change that kept this rank was installed while it doubted (self_check.py)."""
        out: list[MemberAction] = []
        self.self_check.kept(out)
        return out

    def handle(self, event: MemberEvent, now: float) -> list[MemberAction]:
        out: list[MemberAction] = []
        if self.state in (MemberState.MINORITY, MemberState.EVICTED):
            return out
        match event:
            case Busy(since=since, step=step):
                self.detection.busy(since, step, now, out)
                self.joins.finished_before(step, now, out)
            case PeerDown(peer=peer, reason=reason):
                self.detection.peer_down(peer, reason, now, out)
            case MemberTimer(key=key):
                self._on_timer(key, now, out)
            case ControlReceived(msg=msg):
                self._on_message(msg, now, out)
            case Boundary(user_step=user_step):
                self.user_step = max(self.user_step, user_step)
                self.joins.boundary(now, out)
            case Uplink(rate=rate, retransmit_s=retransmit_s):
                self.joins.measured(rate)
                self.detection.set_retransmit(retransmit_s)
                self.joins.maybe_ask_pace(now, out)
            case Fenced(held=held):
                self.change.fenced(held, now, out)
        return out

    def _on_message(self, msg: MemberFrame, now: float, out: list[MemberAction]) -> None:
        match msg:
            case Agreement():
                self.change.on_message(msg, now, out)
            case Detection():
                self.detection.on_message(msg, now, out)
            case Join():
                self.joins.on_request(msg, now, out)
            case Notice():
                self.joins.on_notice(msg, now, out)

    def _on_timer(self, key: TimerKey, now: float, out: list[MemberAction]) -> None:
        match key.kind:
            case TimerKind.MEMBER_CHECK:
                self.detection.check(now, out)
            case TimerKind.MEMBER_CONFIRM:
                self.change.evaluate(now, out)
            case TimerKind.MEMBER_ROUND:
                self.change.round_deadline(now, out)
            case TimerKind.MEMBER_STALL:
                self.change.stalled(now, out)
            case TimerKind.MEMBER_DOUBT:
                self.self_check.timer(now, out)

    # ---- what the parts share --------------------------------------------------------------------

    def to_all(self, msg: Frame, out: list[MemberAction], but: tuple[int, ...] = ()) -> None:
        for r in self.view.members:
            if r != self.rank and r not in but:
                self.send(r, msg, out)

    def send(self, dst: int, msg: Frame, out: list[MemberAction]) -> None:
        """Send; a message of the agreement also goes a second way, through a relay, so that one
        silent link between the coordinator and a member does not leave the member out. Never
        through a rank that anyone reported: relaying through a crashed rank got every member's
        connection refused, and each refusal became a suspicion sent to every member (n^2)."""
        out.append(Send(dst=dst, msg=msg))
        if isinstance(msg, Agreement) and msg.kind in RELAYED_KINDS:
            suspicions, gone = self.term.suspicions, self.joins.gone
            relay = next((m for m in self.view.members if m not in (self.rank, dst) and m not in gone
                          and not suspicions.reported(m)), None)
            if relay is not None:
                out.append(Send(dst=relay, msg=msg.but(target=dst)))

    def stop(self, state: MemberState, reason: str, out: list[MemberAction]) -> None:
        """This rank produces no more results: its side has no majority, or it was left out."""
        self.term.state = state
        self.reason = reason
        self.term.ballots.round = None
        out.append(Stopped(state=state, reason=reason))

    def install(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        """A decided change of this view (its commit, or a NACK carrying it): the next view
        starts from a fresh record, and each part carries over what outlives a view."""
        value = ViewValue.of(msg)
        if msg.epoch != self.view.epoch or value is None:
            return
        previous = self.view
        if self.rank not in value.members:
            self.stop(MemberState.EVICTED, f"rank {self.rank} was left out of view {value.epoch} (decided by "
                                           f"rank {msg.src}): the others confirmed it dead or it did not answer "
                                           f"the change in time", out)
            return
        try:
            plan = unflatten_plan(value.plan)
            view = View(value.epoch, value.members, value.pace, value.uplinks, previous.reach)
        except ValueError:
            return  # a broken value: the change will time out and run again
        user_step = value.user_step
        if user_step >= 0 and self.user_step >= user_step and value.members == previous.members:
            # a pace change this rank learns late (it missed the commit): the steps since cut
            # another way failed everywhere; from its next step on it cuts them as the others
            user_step = self.user_step + 1
        elif user_step >= 0 and self.user_step >= user_step:
            # a join taking effect at a training step this rank has already begun (it did not
            # promise in time): its steps would not line up with the others'. It leaves, and
            # can come back as a joiner itself.
            self.stop(MemberState.EVICTED, f"rank {self.rank} was already in training step {self.user_step} "
                                           f"when view {value.epoch} was decided to start at step "
                                           f"{value.user_step}; it must rejoin", out)
            return
        joined = tuple(r for r in view.members if r not in previous)
        evicted = tuple(sorted(set(previous.members) - set(view.members)))
        self.joins.settle(view, evicted, joined, user_step)
        self.detection.record_evictions(view, evicted, now)
        reason = ("; ".join(f"rank {r} {self.detection.reason(r)}" for r in evicted)
                  or f"view {view.epoch} from rank {msg.src}")
        was_holding = self.holding
        self.term = Term(view=view, installed_at=now, decided=(previous.epoch, value), unheard=set(joined))
        self.joins.carry_into(view)
        self.detection.carry_into(view, joined)
        for kind in (TimerKind.MEMBER_ROUND, TimerKind.MEMBER_STALL):
            out.append(CancelTimer(key=TimerKey(kind, -1, 0)))
        if joined:
            reason = f"ranks {list(joined)} joined from training step {user_step}"
        elif user_step >= 0 and view.pace != previous.pace:
            reason = (f"pace {view.pace / 1e6:.3g} MB/s" if view.pace else "unpaced (no link holds the group back)") + \
                f" from training step {user_step}"
        out.append(Installed(view=view, previous=previous, committed=frozenset(value.committed), catch_up=plan,
                             evicted=evicted, reason=reason, joined=joined, activate_at=user_step))
        if was_holding:
            out.append(Hold(on=False))
        self.joins.maybe_ask_pace(now, out)
        self.joins.maybe_admit(now, out)
        self.joins.maybe_pace_round(now, out)
