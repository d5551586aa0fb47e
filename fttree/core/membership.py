"""Membership: which ranks are alive, and the agreement that moves the group to a new view.

A pure state machine like TreeMachine (`handle(event, now) -> actions`). The Node feeds it every
frame it hears (`heard`), refused connections, its own activity and the membership messages,
and carries out what comes back. It never touches an op: TreeMachine learns the outcome as a
view change (`Installed`), and is told to stop taking results while one is being agreed
(`Fence`).

Detection. Silence is about a node, not a busy link: any bytes from a neighbour count as life,
a frame or part of one (a large payload takes seconds on a slow link), and pings travel on the
control connection, which never waits behind tensor data (net/tcp.py). A tree or backup
neighbour silent for half the node deadline while this rank has a step in flight is pinged; it
is suspected only once that ping has gone unanswered for the whole node deadline. A connection
to a member that is refused (its process is gone: the transport tried to reconnect and nobody
listens) suspects it at once. The node deadline is `node_deadline_s` (1 s), or more where pings
take long: twice the round trip they were answered in (RFC 6298's SRTT + 4 RTTVAR).

Pace. How a step is cut into chunks must be the same on every member, and the best cut follows
the uplinks (pipelined in small chunks behind 10 Mbit/s, in few large ones on a LAN). So the view
carries a pace (view.py), changed like a join: a member whose measured uplink is far from the
uplink the view holds for it (beyond a factor 2, never above Config.uplink_bytes_per_s; the
view's pace while it holds none) tells the coordinator (PACE), which runs a round that fences
nothing; every member promises with its own measured uplink, and the value is the same members
at the slowest promised pace, with every member's promised uplink (View.uplinks, which the
rotated trees' shares follow), from the training step after every promiser's current one (they
hold new steps until it is decided). Comparing each member with its own figure, not with the
pace, is what keeps a fast member among slow ones from asking for a round in every view; a
figure changes only when the link's rate halves or doubles, so noise never starts a round.

A member that finished its job says so (DONE, with its last step) and closes only once every
member has: its silence after that is no failure. A member still running steps past another's
last step drops it from the view as it would a leaver (without a suspicion).

Confirmation. A suspicion goes to every member (SUSPECT). A neighbour of the suspect that gets it
pings the suspect and, if it answers, tells everyone (ALIVE), which starts the suspect's
confirmation clock over. A rank is confirmed dead once suspected for `confirm_wait_s` without an
ALIVE, by at least two of its neighbours that are not dead themselves (one, if it has only one
such neighbour), counted over the largest set of suspects for which that holds (a fixed point):
a partition's far side, whose members each have one neighbour on this side, is confirmed as a
whole, while one silent link (two ranks suspecting each other) or two serial cuts (the others
still hear the middle rank, and say so) never are. Silence on every link is what a crash or a
hang looks like; silence on some links is a link fault, which the relays handle within a step.

Agreement: single-decree Paxos per view. The coordinator is the member in the lowest slot that
is not confirmed dead. Its ballot (round, then slot) must be the highest a member has seen:
    PREPARE -> PROMISE   the member fences its results of this view (it takes no more results and
                         finalizes nothing, so what it reports is final) and reports the steps it
                         holds complete results of, and any value it accepted before;
    ACCEPT  -> ACCEPTED  the value: a value accepted before if any (the highest ballot's), else
                         the next view without the dead ranks and without those that did not
                         promise (View.without, a heap deletion: fewest links change), the
                         committed steps (every step some promiser holds: a user may have it, so
                         it is never replaced), and a catch-up plan (for each committed step, one
                         holder sends its result to the members that lack it);
    COMMIT               once a majority of the current view accepted.
A member stays fenced from its first promise until it learns the decision, so it never takes a
result that the decided view runs again. Two coordinators (ranks that know different things) are
safe: majorities intersect and a later ballot adopts any value accepted before. A coordinator
that reaches no majority of promises and refusals is on the minority side of a partition: it
tells its promisers (MINORITY), and they stop producing results and say so. A member that hears
of a change it already installed answers with it (NACK carrying the value).

Every step not committed was finished by nobody who promised: its members run it again in the
new view with their own contributions (or hand it back to the caller, by policy). So a step
either keeps the one result some rank may already have delivered, or gets a new one from the
survivors; never two. The plan travels flattened: step, holder, count, then that many ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from .admission import Query
from .config import Config
from .coordination import SLOTS, coordinator
from .effects import CancelTimer, Send, SetTimer, TimerKey, TimerKind
from .member_events import (
    Boundary,
    Busy,
    CatchUp,
    ControlReceived,
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
from .messages import Agreement, Detection, Frame, Join, Kind, Notice
from .view import View

__all__ = [
    "CLOCK_SLACK_S", "COMPUTING_FRESH", "JOIN_PASS_ON_S", "MAX_NODE_DEADLINE_S", "MAX_STALLS", "MAX_WAITING_JOINS",
    "PACE_FACTOR", "RELAYED_KINDS", "RETRANSMIT_TRIES", "SLOTS",
    "Boundary", "Busy", "CatchUp", "ControlReceived", "Eviction", "Fence", "Fenced", "Hold", "Installed",
    "MemberAction", "MemberEvent", "MemberFrame", "MemberState", "MemberStatus", "MemberTimer", "Membership",
    "NotCoordinator", "PeerDown", "Stopped", "Suspected", "Uplink", "ViewValue",
    "confirmed_dead", "coordinator", "flatten_plan", "unflatten_plan",
]

MAX_NODE_DEADLINE_S = 30.0  # however slowly pings come back, a silent rank is suspected after this
# A ping or its answer lost on a lossy link waits for TCP to send it again, and again if that is
# lost too: where a link to a neighbour has lost packets, the node deadline covers three tries
# (the timeout, then twice and four times it).
RETRANSMIT_TRIES = 1 + 2 + 4
MAX_WAITING_JOINS = 64  # new ranks a coordinator keeps waiting for admission; more ask again later
MAX_STALLS = 3  # a view change stalled this many times (3 node deadlines each) stops this rank
JOIN_PASS_ON_S = 1.0  # a member passes one joiner's request on to the coordinator at most this often
COMPUTING_FRESH = 3.0  # a member's COMPUTING counts for this many node deadlines (it says it again when pinged)
CLOCK_SLACK_S = 1e-6  # a wait computed as a difference of sums of timer steps may round a hair below its length
PACE_FACTOR = 2.0  # a member asks for a pace round when its uplink is this far from the view's figure for it
#: the agreement's messages: each goes directly and through a relay (Membership._send)
RELAYED_KINDS = frozenset(
    {Kind.VIEW_PREPARE, Kind.VIEW_PROMISE, Kind.VIEW_ACCEPT, Kind.VIEW_ACCEPTED, Kind.VIEW_COMMIT}
)


def confirmed_dead(view: View, reports: dict[int, set[int]], ready: Iterable[int]) -> frozenset[int]:
    """The ranks the reports confirm dead: the largest set D of `ready` suspects in which each
    has at least min(2, its neighbours outside D) reporters outside D, and at least one."""
    dead = {p for p in ready if reports.get(p) and p in view}
    changed = True
    while changed:
        changed = False
        for p in sorted(dead):
            neighbours = set(view.neighbours(p).all) - dead
            reporters = reports[p] - dead - {p}
            if len(reporters) < max(1, min(2, len(neighbours))):
                dead.discard(p)
                changed = True
    return frozenset(dead)


@dataclass(slots=True)
class _Round:
    """A view change this rank coordinates."""

    ballot: int
    dead: frozenset[int]
    joining: tuple[int, ...] = ()  # a join round: these ranks are added, nobody fences
    pace: bool = False  # a pace round: the same members at the slowest promised uplink, nobody fences
    rates: dict[int, int] = field(default_factory=dict)  # promiser -> its measured uplink (0: not measured)
    user_steps: dict[int, int] = field(default_factory=dict)  # promiser -> its current training step
    accepting: bool = False
    promises: dict[int, tuple[tuple[int, ...], int, ViewValue | None]] = field(default_factory=dict)
    refusals: set[int] = field(default_factory=set)
    value: ViewValue | None = None
    accepts: set[int] = field(default_factory=set)



class Membership:
    """One rank's view of the group. Deterministic: the same events at the same times give the
    same actions."""

    def __init__(self, rank: int, view: View, config: Config | None = None) -> None:
        self.rank = rank
        self.view = view
        self.cfg = config or Config()
        self.state = MemberState.ACTIVE
        self.reason = ""
        self.busy_since: float | None = None
        self.node_deadline_s = self.cfg.node_deadline_s
        self._last_heard: dict[int, float] = {}
        self._pinged: dict[int, float] = {}
        self._suspects: dict[int, str] = {}  # my own suspicions -> why
        self._reports: dict[int, set[int]] = {}  # suspect -> reporters
        self._standing: dict[int, float] = {}  # suspect -> since when it stands unrefuted
        self._first_suspected: dict[int, float] = {}  # suspect -> the first report this view
        self._refute: set[int] = set()  # suspects pinged to check them for the others
        self._check_armed = False
        self._installed_at = 0.0
        # Paxos, for the view after the current one
        self._round: _Round | None = None  # as coordinator
        self._max_round = 0
        self._promised = 0  # the highest ballot promised (0: none)
        self._accepted: tuple[int, ViewValue] | None = None
        self._held: tuple[int, ...] | None = None  # once fenced: the steps reported held
        self._waiting: list[tuple[int, int]] = []  # (ballot, coordinator) promised before the node reported held
        self._decided: tuple[int, ViewValue] | None = None  # the last change installed: (its base epoch, value)
        self._evictions: list[Eviction] = []
        self._evicted_total = 0
        self._suspicions_total = 0
        self._told: dict[int, int] = {}  # left-out rank -> the view we told it about
        # joins and leaves
        self.user_step = -1  # the training step this rank is in (the node reports each boundary)
        self.holding = False  # promised in a join round: start no training step until it is decided
        self._activating_at = -1  # the training step the last decided join takes effect at
        # new ranks that asked while another change was agreed or waited to take effect: the
        # coordinator admits them together once it may (they ask again meanwhile, too)
        self._waiting_joins: dict[int, bool] = {}  # rank -> a restart whose old process is in the view
        self._admitting: set[int] = set()  # ranks of a decided join that has not taken effect yet
        self._stalls = 0  # stall deadlines passed in this view change
        self._passed_on: dict[int, float] = {}  # joiner -> when its request was last passed to the coordinator
        self._leaving: set[int] = set()  # ranks that said they leave: evicted without waiting
        self._unheard: set[int] = set()  # ranks that joined in this view, until their join takes effect here
        self._gone: dict[int, str] = {}  # ranks known gone without a suspicion (restarted), and why
        self._ping_since: dict[int, float] = {}  # silent neighbour -> when the first unanswered ping went
        self._ping_rtt: tuple[float, float] | None = None  # (SRTT, RTTVAR) of answered pings
        self._retransmit_s = 0.0  # the longest retransmission timeout to a neighbour (Uplink events)
        self.done: dict[int, int] = {}  # members that finished their job -> their last step
        self.rate = 0.0  # this rank's measured uplink (Uplink events)
        self._uplinks: dict[int, int] = {}  # member -> the uplink it reported (PACE, VIEW_PROMISE)
        self._pace_asked = -1  # the view in which this rank last asked for a pace round
        self._pace_wanted: dict[int, int] = {}  # coordinator: member -> the uplink it asked a pace round for
        # slow compute is not broken: a member still computing a step others wait on says so
        self.submitted = -1  # the newest step this rank submitted (Busy events)
        self._computing: dict[int, tuple[int, float]] = {}  # member -> (oldest step it has not submitted, when said)
        self._computing_said = -1e9  # when this rank last said COMPUTING
        self.foreign_commits = 0  # VIEW_COMMITs dropped: not from their ballot's coordinator

    # ---- public ------------------------------------------------------------------------------

    def heard(self, peer: int, now: float) -> list[MemberAction]:
        """Any frame from `peer`. The Node calls this for every frame: keep it cheap."""
        self._last_heard[peer] = now
        self._unheard.discard(peer)
        self._ping_since.pop(peer, None)
        if peer not in self._refute and peer not in self._suspects:
            return []
        out: list[MemberAction] = []
        if peer in self._refute:
            self._refute.discard(peer)
            self._to_all(Detection(kind=Kind.ALIVE, src=self.rank, epoch=self.view.epoch, target=peer), out)
        if self._suspects.pop(peer, None) is not None:
            self._to_all(Detection(kind=Kind.SUSPECT, src=self.rank, epoch=self.view.epoch, target=peer), out)
            self._report(self.rank, peer, False, now, out)
        return out

    def handle(self, event: MemberEvent, now: float) -> list[MemberAction]:
        out: list[MemberAction] = []
        if self.state in (MemberState.MINORITY, MemberState.EVICTED):
            return out
        match event:
            case Busy(since=since, step=step):
                self.busy_since = since
                self.submitted = max(self.submitted, step)
                if since is not None and not self._check_armed:
                    self._arm_check(now, out)
                finished = {p for p, last in self.done.items() if step > last and p in self.view and p != self.rank}
                if finished - self._leaving:  # they finished before this step: go on without them
                    self._leaving |= finished
                    self._evaluate(now, out)
            case PeerDown(peer=peer, reason=reason):
                if peer in self.view and peer != self.rank and peer not in self.done:
                    self._suspect(peer, f"connection refused ({reason})", now, out)
            case MemberTimer(key=key):
                self._on_timer(key, now, out)
            case ControlReceived(msg=msg):
                self._on_message(msg, now, out)
            case Boundary(user_step=user_step):
                self.user_step = max(self.user_step, user_step)
                if self.user_step >= self._activating_at:
                    self._admitting.clear()
                    self._watch_joined(now)
                self._maybe_admit(now, out)
                self._maybe_pace_round(now, out)
            case Uplink(rate=rate, retransmit_s=retransmit_s):
                self.rate = rate
                self._retransmit_s = retransmit_s
                self._set_node_deadline()
                self._maybe_ask_pace(now, out)
            case Fenced(held=held):
                self._held = held
                waiting, self._waiting = self._waiting, []
                for ballot, coordinator in waiting:
                    self._send_promise(ballot, coordinator, now, out)
        return out

    @property
    def slowest_uplink(self) -> float:
        """The slowest uplink this rank knows of in the group (its own, and those members told
        it: PACE, promises), bytes per second; 0.0 if none. A root's deadline allows for it."""
        known = [r for m, r in self._uplinks.items() if m in self.view] + ([self.rate] if self.rate else [])
        return float(min(known, default=0.0))

    def _target_pace(self) -> int:
        """The pace this rank's uplink calls for: its rate, never above the configured one (above
        it, steps are cut as on a LAN anyway)."""
        return int(min(self.rate, self.cfg.uplink_bytes_per_s))

    def _held_rate(self, rank: int) -> float:
        """The uplink the view plans `rank` at (View.planned_uplink); the view's pace while it
        holds no figure at all."""
        return self.view.planned_uplink(rank) or self.view.pace or self.cfg.uplink_bytes_per_s

    def _maybe_ask_pace(self, now: float, out: list[MemberAction]) -> None:
        """Ask the coordinator for a pace round, once a view, if this rank's uplink is far from
        what the view holds for it."""
        target = self._target_pace()
        held = self._held_rate(self.rank)
        if (not target or self._pace_asked == self.view.epoch or self.state is not MemberState.ACTIVE
                or held / PACE_FACTOR <= target <= held * PACE_FACTOR):
            return
        self._pace_asked = self.view.epoch
        coordinator = self.coordinator()
        if coordinator is None or coordinator == self.rank:
            self._pace_wanted[self.rank] = target
            self._maybe_pace_round(now, out)
        else:
            out.append(Send(dst=coordinator, msg=Notice(kind=Kind.PACE, src=self.rank, epoch=self.view.epoch,
                                                         rate=target)))

    def _maybe_pace_round(self, now: float, out: list[MemberAction]) -> None:
        """As coordinator: run a pace round that members asked for, when nothing else is being
        agreed or waits to take effect."""
        for rank, wanted in list(self._pace_wanted.items()):
            held = self._held_rate(rank)
            if held / PACE_FACTOR <= wanted <= held * PACE_FACTOR:
                del self._pace_wanted[rank]  # the view holds a figure near it now (a round since)
        if not self._pace_wanted or not self._may_change() or self.coordinator() != self.rank:
            return
        self._pace_wanted.clear()
        self._start_round(frozenset(), now, out, pace=True)

    def finish(self, step: int) -> list[MemberAction]:
        """This rank's job is over after `step`: tell every member, with what it knows of the
        others (a cut link does not keep two finished ranks from learning of each other)."""
        self.done[self.rank] = step
        out: list[MemberAction] = []
        self._tell_done(out)
        return out

    def _tell_done(self, out: list[MemberAction]) -> None:
        ranks = tuple(sorted(self.done))
        self._to_all(Notice(kind=Kind.DONE, src=self.rank, epoch=self.view.epoch, step=self.done[self.rank],
                            finished=ranks, last_steps=tuple(self.done[r] for r in ranks)), out)

    def _on_done(self, msg: Notice, out: list[MemberAction]) -> None:
        """Ranks that finished their job (the sender, and those it knows of): a finished rank
        passes on what it learns, so the news goes around a cut link."""
        told = dict(zip(msg.finished, msg.last_steps, strict=True)) if len(msg.finished) == len(msg.last_steps) else {}
        told.setdefault(msg.src, msg.step)
        new = False
        for r, last in told.items():
            if r in self.view and r != self.rank and self.done.get(r, -1) < last:
                self.done[r] = last
                new = True
        if new and self.rank in self.done:
            self._tell_done(out)

    def _pong(self, peer: int, now: float) -> None:
        """A ping answered: learn how long answers take, and derive the node deadline from it."""
        sent = self._pinged.get(peer)
        if sent is None:
            return
        r = now - sent
        if self._ping_rtt is None:
            srtt, rttvar = r, r / 2
        else:
            srtt, rttvar = self._ping_rtt
            rttvar = 0.75 * rttvar + 0.25 * abs(srtt - r)
            srtt = 0.875 * srtt + 0.125 * r
        self._ping_rtt = (srtt, rttvar)
        self._set_node_deadline()

    def _set_node_deadline(self) -> None:
        """`node_deadline_s`, or more: twice what pings took to be answered (SRTT + 4 RTTVAR),
        and three tries of a lost ping or answer on a lossy link."""
        answered = 0.0 if self._ping_rtt is None else 2 * (self._ping_rtt[0] + 4 * self._ping_rtt[1])
        self.node_deadline_s = min(max(self.cfg.node_deadline_s, answered, RETRANSMIT_TRIES * self._retransmit_s),
                                   MAX_NODE_DEADLINE_S)

    def stale_sender(self, msg: Frame) -> list[MemberAction]:
        """A frame of an older view: a rank not in ours missed the change that left it out (it
        was cut off, or stopped and resumed); a member may have missed the commit of a change
        that kept it (a cut link between it and the coordinator). Tell it, once per rank and
        view: it installs the decision as if the commit had come."""
        out: list[MemberAction] = []
        if msg.src == self.rank or self._told.get(msg.src) == self.view.epoch:
            return out
        if msg.src in self.view:
            if self._decided is None or self._decided[0] != msg.epoch:
                return out
            self._told[msg.src] = self.view.epoch
            out.append(Send(dst=msg.src, msg=Agreement(kind=Kind.VIEW_NACK, src=self.rank, epoch=msg.epoch,
                                                       **self._decided[1].fields())))
            return out
        self._told[msg.src] = self.view.epoch
        out.append(Send(dst=msg.src, msg=Agreement(kind=Kind.VIEW_NACK, src=self.rank, epoch=msg.epoch,
                                                   proposed=self.view.epoch, members=self.view.members)))
        return out

    def status(self) -> MemberStatus:
        return MemberStatus(state=self.state, epoch=self.view.epoch, reason=self.reason,
                            suspects={p: tuple(sorted(r)) for p, r in sorted(self._reports.items()) if r},
                            evictions=tuple(self._evictions), evicted_total=self._evicted_total,
                            node_deadline_s=self.node_deadline_s, suspicions_total=self._suspicions_total)

    # ---- detection -----------------------------------------------------------------------------

    def _agree(self, kind: Kind, **kw: Any) -> Agreement:
        """A frame of the view change, from this rank in its view."""
        return Agreement(kind=kind, src=self.rank, epoch=self.view.epoch, **kw)

    def _neighbours(self) -> tuple[int, ...]:
        return self.view.neighbours(self.rank).all

    def _arm_check(self, now: float, out: list[MemberAction]) -> None:
        self._check_armed = True
        out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_CHECK, -1, 0), at=now + self.node_deadline_s / 4))

    def _check(self, now: float, out: list[MemberAction]) -> None:
        """While a step is in flight: ping neighbours silent for half the node deadline, suspect
        those silent for all of it."""
        self._check_armed = False
        if self.busy_since is None:
            return
        deadline = self.node_deadline_s
        for peer in self._neighbours():
            if peer in self._unheard or peer in self.done:  # a joiner starts later; a finished member is quiet
                continue
            silent = now - max(self._last_heard.get(peer, self._installed_at), self.busy_since)
            if silent < deadline / 2:
                continue
            asked = self._ping_since.get(peer)
            if asked is not None and asked < self.busy_since:  # a ping of an earlier step's silence
                del self._ping_since[peer]
                asked = None
            # (the checks come every quarter deadline: the fourth after the ping may compute to a
            # hair under it, which put the suspicion off by a whole quarter)
            if asked is not None and now - asked >= deadline - CLOCK_SLACK_S:
                self._suspect(peer, f"silent for {silent:.2f} s with a step in flight, and a ping unanswered for "
                                    f"{now - asked:.2f} s (node deadline {deadline:.2f} s)", now, out)
            elif now - self._pinged.get(peer, -1e9) >= deadline / 4:
                self._ping_since.setdefault(peer, now)
                self._ping(peer, now, out)
        self._evaluate(now, out)
        self._arm_check(now, out)

    def _ping(self, peer: int, now: float, out: list[MemberAction]) -> None:
        self._pinged[peer] = now
        out.append(Send(dst=peer, msg=Detection(kind=Kind.PING, src=self.rank, epoch=self.view.epoch,
                                                step=self.submitted)))

    def computing(self, now: float) -> dict[int, int]:
        """Members that said lately that they are alive and have not submitted a step yet ->
        the oldest such step. A step waiting on one of them is slow, not broken: its deadlines
        are put off (protocol.TreeMachine._extended), up to Config.submit_wait_s."""
        fresh = now - COMPUTING_FRESH * self.node_deadline_s
        return {peer: step for peer, (step, said) in self._computing.items() if said >= fresh and peer in self.view}

    def _pinged_by(self, msg: Detection, now: float, out: list[MemberAction]) -> None:
        """Answer a ping. A pinger waits on step `msg.step`; if this rank has not submitted it,
        its caller is still computing: it tells every member (they cannot all ping it), at
        most every half node deadline."""
        out.append(Send(dst=msg.src, msg=Detection(kind=Kind.PONG, src=self.rank, epoch=self.view.epoch)))
        if self.submitted >= msg.step or now - self._computing_said < self.node_deadline_s / 2 \
                or self.state is not MemberState.ACTIVE or self.rank not in self.view:
            return
        self._computing_said = now
        self._to_all(Detection(kind=Kind.COMPUTING, src=self.rank, epoch=self.view.epoch, step=self.submitted + 1),
                     out)

    def _suspect(self, peer: int, why: str, now: float, out: list[MemberAction]) -> None:
        if peer in self._suspects:
            return
        self._suspects[peer] = why
        self._suspicions_total += 1
        out.append(Suspected(peer=peer, reason=why))
        self._to_all(Detection(kind=Kind.SUSPECT, src=self.rank, epoch=self.view.epoch, target=peer, gone=True), out,
                     but=(peer,))
        self._report(self.rank, peer, True, now, out)

    def _report(self, reporter: int, suspect: int, on: bool, now: float, out: list[MemberAction]) -> None:
        reporters = self._reports.setdefault(suspect, set())
        if on:
            if not reporters:
                self._standing[suspect] = now
                self._first_suspected.setdefault(suspect, now)
                out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_CONFIRM, -1, 0, suspect),
                                    at=now + self.cfg.confirm_wait_s))
            reporters.add(reporter)
        else:
            reporters.discard(reporter)
            if not reporters:
                del self._reports[suspect]
                self._standing.pop(suspect, None)
        self._evaluate(now, out)

    def _dead(self, now: float) -> frozenset[int]:
        # `since + wait`, the very sum the confirmation timer was set for (now - since could round below it)
        ready = [p for p, since in self._standing.items() if now >= since + self.cfg.confirm_wait_s]
        leaving = frozenset(p for p in self._leaving if p in self.view)
        return confirmed_dead(self.view, self._reports, ready) | leaving

    def _evaluate(self, now: float, out: list[MemberAction]) -> None:
        """Start a view change if this rank is the coordinator and someone is confirmed dead."""
        if self._round is not None:
            return
        dead = self._dead(now)
        if not dead or self.rank in dead or self.coordinator(passed_over=dead) != self.rank:
            return
        self._start_round(dead, now, out)

    def _on_join(self, joiner: int, now: float, out: list[MemberAction]) -> None:
        """A rank asks to be admitted (the node has checked it is a new process). Only the
        coordinator acts; the joiner asks every member, again until admitted. A rank still in
        the view is a restarted process: its old one is gone, so it is evicted first."""
        if self.coordinator(passed_over=self._leaving) != self.rank:
            return
        if len(self._waiting_joins) < MAX_WAITING_JOINS or joiner in self._waiting_joins:
            self._waiting_joins[joiner] = joiner in self.view
        if not self._may_change():
            # Another change is being agreed, or a decided join has not taken effect here yet: a
            # second one decided now would give the first joiner a view it never hears of (its
            # admission names the first view). The joiner waits here (and asks again).
            return
        if joiner in self.view:  # its admission follows once this eviction is installed
            self._gone[joiner] = "restarted: a new process of this rank asked to join"
            self._start_round(frozenset({joiner}), now, out)
        else:
            self._maybe_admit(now, out)

    def _pass_on_join(self, msg: Join, now: float, out: list[MemberAction]) -> None:
        """A member that is not the coordinator passes a join request on (at most once a
        second per joiner): the joiner's own frames to the coordinator may not get through."""
        coordinator = self.coordinator(passed_over=self._leaving)
        if coordinator is None or coordinator == self.rank or self.state is not MemberState.ACTIVE:
            return
        if now - self._passed_on.get(msg.src, -1e9) < JOIN_PASS_ON_S:
            return
        if msg.src not in self._passed_on and len(self._passed_on) >= MAX_WAITING_JOINS:
            self._passed_on.clear()
        self._passed_on[msg.src] = now
        out.append(Send(dst=coordinator, msg=Join(kind=Kind.JOIN_ASK, src=self.rank, epoch=self.view.epoch,
                                                  target=msg.src, incarnation=msg.incarnation,
                                                  addresses=msg.addresses)))

    def _may_change(self) -> bool:
        """May a join or pace change be agreed now (nothing else agreed or waiting to take effect)?"""
        return (self.state is MemberState.ACTIVE and not self.holding and self._round is None
                and self.user_step >= self._activating_at)

    def _watch_joined(self, now: float) -> None:
        """A decided join took effect here (this rank began its training step): the joiners
        take part from this step on, so from now they are watched as any member, their silence
        counted from here. Before, a joiner stayed exempt until its first frame: one that went
        silent right after its admission was never suspected, and every step waited for it."""
        for peer in self._unheard:
            self._last_heard[peer] = max(self._last_heard.get(peer, now), now)
        self._unheard.clear()

    def _maybe_admit(self, now: float, out: list[MemberAction]) -> None:
        """As coordinator, admit the new ranks that wait, in one round, once a change may be agreed."""
        for rank, restarted in list(self._waiting_joins.items()):
            if rank in self.view and not restarted:
                del self._waiting_joins[rank]  # admitted meanwhile
            elif rank not in self.view:
                self._waiting_joins[rank] = False  # a restarted rank's old process is out now
        joining = tuple(sorted(r for r, restarted in self._waiting_joins.items() if not restarted))
        if (not joining or not self._may_change()
                or self.coordinator(passed_over=self._leaving) != self.rank):
            return
        for rank in joining:
            del self._waiting_joins[rank]
        self._start_round(frozenset(), now, out, joining=joining)

    def _reason(self, peer: int) -> str:
        if peer in self._gone:
            return self._gone[peer]
        if peer in self._leaving and peer not in self._reports:
            return "left the group (graceful leave)"
        reporters = sorted(self._reports.get(peer, ()))
        mine = self._suspects.get(peer)
        return f"suspected by ranks {reporters}" + (f" (here: {mine})" if mine else "")

    def _to_all(self, msg: Frame, out: list[MemberAction], but: tuple[int, ...] = ()) -> None:
        for r in self.view.members:
            if r != self.rank and r not in but:
                self._send(r, msg, out)

    def _send(self, dst: int, msg: Frame, out: list[MemberAction]) -> None:
        """Send; a message of the agreement also goes a second way, through a relay, so that one
        silent link between the coordinator and a member does not leave the member out. Never
        through a rank that anyone reported: relaying through a crashed rank got every member's
        connection refused, and each refusal became a suspicion sent to every member (n^2)."""
        out.append(Send(dst=dst, msg=msg))
        if isinstance(msg, Agreement) and msg.kind in RELAYED_KINDS:
            relay = next((m for m in self.view.members if m not in (self.rank, dst) and m not in self._suspects
                          and m not in self._gone and not self._reports.get(m)), None)
            if relay is not None:
                out.append(Send(dst=relay, msg=msg.but(target=dst)))

    def _relayed(self, msg: Agreement, out: list[MemberAction]) -> Agreement | None:
        """A copy of an agreement message sent through this rank: pass it on (once: the copy
        names its first sender in `origin`) and return None; or, relayed to this rank, the
        message as its first sender sent it."""
        if msg.origin >= 0:
            if msg.target != self.rank or msg.origin not in self.view or msg.src not in self.view:
                return None
            return msg.but(src=msg.origin, origin=-1, target=-1)
        if msg.target >= 0 and msg.target != self.rank:
            if msg.target in self.view and msg.src in self.view:
                out.append(Send(dst=msg.target, msg=msg.but(src=self.rank, origin=msg.src)))
            return None
        return msg

    # ---- the coordinator ----------------------------------------------------------------------

    def _start_round(self, dead: frozenset[int], now: float, out: list[MemberAction],
                     joining: tuple[int, ...] = (), *, pace: bool = False) -> None:
        alive = [m for m in self.view.members if m not in dead]
        if not self._majority(alive):  # this side of the network cannot form the next view
            minority = self._agree(Kind.MINORITY, ballot=0, promised=tuple(alive), view_size=self.view.size)
            for m in alive:
                if m != self.rank:
                    out.append(Send(dst=m, msg=minority))
            self._stop(MemberState.MINORITY, self._minority_reason(len(alive), self.view.size), out)
            return
        self._max_round += 1
        ballot = self._max_round * SLOTS + (SLOTS - 1 - self.view.slot_of(self.rank))
        self._round = _Round(ballot=ballot, dead=dead, joining=joining, pace=pace)
        prepare = self._agree(Kind.VIEW_PREPARE, ballot=ballot, dead=tuple(sorted(dead)), joining=joining,
                              pace_round=pace)
        self._to_all(prepare, out, but=tuple(dead))
        self._on_prepare(prepare, now, out)  # this rank is a member too
        out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_ROUND, -1, 0), at=now + self.node_deadline_s))

    def _expected(self, r: _Round) -> set[int]:
        return {m for m in self.view.members if m not in r.dead}

    def _majority(self, ranks: Iterable[int]) -> bool:
        return 2 * len(set(ranks)) > self.view.size

    def _on_promise(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        r = self._round
        if r is None or r.accepting or msg.ballot != r.ballot:
            return
        r.promises[msg.src] = (msg.steps, msg.accepted, ViewValue.of(msg))
        r.user_steps[msg.src] = msg.training_step
        r.rates[msg.src] = msg.rate
        if msg.rate > 0:
            self._uplinks[msg.src] = msg.rate
        if self._expected(r) <= set(r.promises):
            self._propose(now, out)

    def _propose(self, now: float, out: list[MemberAction]) -> None:
        r = self._round
        assert r is not None
        earlier = [(acc, v) for _held, acc, v in r.promises.values() if v is not None]
        if earlier:  # Paxos: a value accepted before may have been decided; keep it
            r.value = max(earlier, key=lambda av: av[0])[1]
        elif r.joining or r.pace:
            # Joiners are added in the last slots (leaves of the heap: no member's links change);
            # a pace round keeps the members and takes the slowest uplink promised. Either takes
            # effect from the training step after every promiser's current one: none has
            # started it (they hold).
            members = self.view.members + tuple(j for j in r.joining if j not in self.view)
            rates = [rate for rate in r.rates.values() if rate > 0]
            pace = min(rates) if r.pace and rates else self.view.pace
            # each member's figure: what it promised now in a pace round, else what the view held
            uplinks = tuple((r.rates.get(m, 0) if r.pace else 0) or self.view.uplink_of(m) for m in members)
            r.value = ViewValue(epoch=self.view.epoch + (r.ballot // SLOTS), members=members, committed=(), plan=(),
                                user_step=max(r.user_steps.values(), default=-1) + 1, pace=pace, uplinks=uplinks)
        else:
            promised = set(r.promises)
            new = self.view.without([m for m in self.view.members if m not in promised],
                                    self.view.epoch + (r.ballot // SLOTS))
            committed = sorted({s for held, _a, _v in r.promises.values() for s in held})
            plan = []
            for step in committed:
                holders = sorted(m for m, (held, _a, _v) in r.promises.items() if step in held)
                lacking = tuple(sorted(promised - set(holders)))
                if lacking:
                    plan.append(CatchUp(step=step, holder=self.rank if self.rank in holders else holders[0],
                                        lacking=lacking))
            r.value = ViewValue(epoch=new.epoch, members=new.members, committed=tuple(committed),
                                plan=flatten_plan(plan), pace=new.pace, uplinks=new.uplinks)
        r.accepting = True
        accept = self._agree(Kind.VIEW_ACCEPT, ballot=r.ballot, **r.value.fields())
        self._to_all(accept, out, but=tuple(r.dead))
        self._on_accept(accept, now, out)
        out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_ROUND, -1, 0), at=now + self.node_deadline_s))

    def _on_accepted(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        r = self._round
        if r is None or not r.accepting or msg.ballot != r.ballot:
            return
        r.accepts.add(msg.src)
        assert r.value is not None
        # every member of the new view that is in this one (a joiner accepts nothing: it is not in yet)
        if (self._majority(r.accepts) or r.pace) and set(r.value.members) & set(self.view.members) <= r.accepts:
            self._decide(now, out)

    def _decide(self, now: float, out: list[MemberAction]) -> None:
        r = self._round
        assert r is not None
        assert r.value is not None
        commit = self._agree(Kind.VIEW_COMMIT, ballot=r.ballot, **r.value.fields())
        self._to_all(commit, out, but=tuple(d for d in r.dead if d not in self._leaving))
        self._install(commit, now, out)

    def _round_deadline(self, now: float, out: list[MemberAction]) -> None:
        r = self._round
        if r is None:
            self._stalled(now, out)
            return
        if r.pace and not set(self.view.members) <= (r.accepts if r.accepting else set(r.promises)):
            # A pace change needs every member: one that missed it would cut its steps another
            # way. Some did not answer in time (a cut link, a slow one): give up; it is asked
            # for again later, and the promisers go on at their stall deadline.
            self._round = None
            return
        if r.accepting:
            if self._majority(r.accepts):
                self._decide(now, out)
            else:
                self._retry(now, out)
        elif self._majority(r.promises):
            self._propose(now, out)
        elif self._majority(set(r.promises) | r.refusals):
            self._retry(now, out)  # alive, but promised elsewhere: another round
        elif r.joining and not r.dead:
            # Admitting is not a failure: members that did not promise in time (behind, or
            # their answers lost) are not shown dead by it. Give up; detection handles the dead,
            # and the joiners wait for the next chance (the promisers go on at their stall deadline).
            self._round = None
            for rank in r.joining:
                self._waiting_joins.setdefault(rank, False)
        else:
            minority = self._agree(Kind.MINORITY, ballot=r.ballot, promised=tuple(sorted(r.promises)),
                                   view_size=self.view.size)  # the promisers stop with us
            for m in r.promises:
                if m != self.rank:
                    out.append(Send(dst=m, msg=minority))
            self._stop(MemberState.MINORITY, self._minority_reason(len(r.promises), self.view.size), out)

    def _retry(self, now: float, out: list[MemberAction]) -> None:
        self._round = None
        dead = self._dead(now)
        if dead and self.rank not in dead and next(m for m in self.view.members if m not in dead) == self.rank:
            self._start_round(dead, now, out)

    def _minority_reason(self, promised: int, size: int) -> str:
        return (f"minority {promised} of {size}: view {self.view.epoch} has no majority on this side of the "
                f"network ({size // 2 + 1} needed); this rank stops producing results")

    # ---- a member ----------------------------------------------------------------------------

    def _on_prepare(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        if msg.epoch < self.view.epoch:
            self._tell_decided(msg, out)
            return
        if msg.epoch > self.view.epoch or self.rank in msg.dead:
            return  # we are behind, or the one being left out: the decision will tell us
        self._max_round = max(self._max_round, msg.ballot // SLOTS)
        if msg.ballot == self._promised and msg.src != self.rank:
            if self._held is not None:  # the same PREPARE the second way: the same answer
                self._send_promise(msg.ballot, msg.src, now, out)
            return
        if msg.ballot < self._promised:
            out.append(Send(dst=msg.src, msg=self._agree(Kind.VIEW_NACK, ballot=self._promised)))
            return
        if self._round is not None and msg.src != self.rank and msg.ballot > self._round.ballot:
            self._round = None  # a better coordinator: follow it
        self._promised = msg.ballot
        if (msg.joining or msg.pace_round) and not msg.dead and self.state is MemberState.ACTIVE:
            # a join: nothing is fenced (the steps in flight finish in this view); only the
            # next training step waits for the decision, which says where the new view starts
            if not self.holding:
                self.holding = True
                out.append(Hold(on=True))
                out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_STALL, -1, 0), at=now + 3 * self.node_deadline_s))
            self._held = ()
            self._send_promise(msg.ballot, msg.src, now, out)
            return
        if self.state is MemberState.ACTIVE:
            self.state = MemberState.CHANGING
            out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_STALL, -1, 0), at=now + 3 * self.node_deadline_s))
        if self._held is None:
            if not self._waiting:
                out.append(Fence())
            self._waiting.append((msg.ballot, msg.src))
        else:
            self._send_promise(msg.ballot, msg.src, now, out)

    def _send_promise(self, ballot: int, coordinator: int, now: float, out: list[MemberAction]) -> None:
        assert self._held is not None
        accepted_ballot, value = self._accepted if self._accepted is not None else (0, None)
        promise = self._agree(Kind.VIEW_PROMISE, ballot=ballot, steps=self._held, accepted=accepted_ballot,
                            training_step=self.user_step, rate=self._target_pace(),
                            **(value.fields() if value is not None else {}))
        if coordinator == self.rank:
            self._on_promise(promise, now, out)
        else:
            self._send(coordinator, promise, out)

    def _on_accept(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        value = ViewValue.of(msg)
        if msg.epoch != self.view.epoch or value is None:
            return
        if msg.ballot < self._promised or self._held is None:  # only a fenced promiser may accept
            out.append(Send(dst=msg.src, msg=self._agree(Kind.VIEW_NACK, ballot=self._promised)))
            return
        self._promised = msg.ballot
        self._accepted = (msg.ballot, value)
        accepted = self._agree(Kind.VIEW_ACCEPTED, ballot=msg.ballot)
        if msg.src == self.rank:
            self._on_accepted(accepted, now, out)
        else:
            self._send(msg.src, accepted, out)

    def _on_nack(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        if msg.proposed and msg.epoch < self.view.epoch:
            return
        if msg.proposed:  # the sender installed a change of our view already: so do we
            self._install(msg, now, out)
            return
        self._max_round = max(self._max_round, msg.ballot // SLOTS)
        r = self._round
        if r is not None:
            r.refusals.add(msg.src)

    def _tell_decided(self, msg: Agreement, out: list[MemberAction]) -> None:
        """A proposal for a view we already left: answer with the change we installed from it."""
        if self._decided is not None and self._decided[0] == msg.epoch:
            out.append(Send(dst=msg.src, msg=Agreement(kind=Kind.VIEW_NACK, src=self.rank, epoch=msg.epoch,
                                                       **self._decided[1].fields())))

    def _supersede(self, view: View, evicted: tuple[int, ...], admitting: tuple[int, ...]) -> None:
        """A view installed before a decided join took effect leaves its joiners out (they did
        not know to promise): they wait to be admitted again, and nothing waits for that join."""
        for r in evicted:
            if r in self._admitting:
                self._gone[r] = (f"was admitted in a view that view {view.epoch} superseded before it took effect "
                                 "(it is admitted again)")
                if len(self._waiting_joins) < MAX_WAITING_JOINS:
                    self._waiting_joins[r] = False
        if self._admitting and self.user_step < self._activating_at:
            self._activating_at = -1
        self._admitting = set(admitting)

    def _record_evictions(self, view: View, evicted: tuple[int, ...], now: float) -> None:
        for r in evicted:
            first = self._first_suspected.get(r)
            self._evictions.append(Eviction(rank=r, epoch=view.epoch, reason=self._reason(r),
                                            detected_after_s=0.0 if first is None else now - first,
                                            suspected_by=tuple(sorted(self._reports.get(r, ())))))
        self._evicted_total += len(evicted)
        del self._evictions[:-16]

    def _install(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        value = ViewValue.of(msg)
        if msg.epoch != self.view.epoch or value is None:
            return
        previous = self.view
        if self.rank not in value.members:
            self._stop(MemberState.EVICTED, f"rank {self.rank} was left out of view {value.epoch} (decided by "
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
            self._stop(MemberState.EVICTED, f"rank {self.rank} was already in training step {self.user_step} "
                                            f"when view {value.epoch} was decided to start at step "
                                            f"{value.user_step}; it must rejoin", out)
            return
        joined = tuple(r for r in view.members if r not in previous)
        evicted = tuple(sorted(set(previous.members) - set(view.members)))
        self._supersede(view, evicted, joined if user_step >= 0 else ())
        self._record_evictions(view, evicted, now)
        reason = "; ".join(f"rank {r} {self._reason(r)}" for r in evicted) or f"view {view.epoch} from rank {msg.src}"
        self._decided = (previous.epoch, value)
        self.view = view
        self.state = MemberState.ACTIVE
        self._round = None
        self._promised = 0
        self._accepted = None
        self._held = None
        self._waiting = []
        self._stalls = 0
        self._suspects.clear()
        self._reports.clear()
        self._standing.clear()
        self._first_suspected.clear()
        self._refute.clear()
        self._ping_since.clear()
        self.done = {r: last for r, last in self.done.items() if r in view}
        self._installed_at = now
        self._leaving &= set(view.members)
        self._gone = {r: why for r, why in self._gone.items() if r in view}
        self._computing = {r: said for r, said in self._computing.items() if r in view and r not in joined}
        self._unheard = set(joined)
        for kind in (TimerKind.MEMBER_ROUND, TimerKind.MEMBER_STALL):
            out.append(CancelTimer(key=TimerKey(kind, -1, 0)))
        if joined:
            reason = f"ranks {list(joined)} joined from training step {user_step}"
        elif user_step >= 0 and view.pace != previous.pace:
            reason = f"pace {view.pace / 1e6:.3g} MB/s from training step {user_step}"
        if user_step >= 0:
            self._activating_at = user_step
        out.append(Installed(view=view, previous=previous, committed=frozenset(value.committed), catch_up=plan,
                             evicted=evicted, reason=reason, joined=joined, activate_at=user_step))
        if self.holding:
            self.holding = False
            out.append(Hold(on=False))
        self._maybe_ask_pace(now, out)
        self._maybe_admit(now, out)
        self._maybe_pace_round(now, out)

    def _stalled(self, now: float, out: list[MemberAction]) -> None:
        """Fenced and no decision in time: if this rank is the coordinator now (the old one may
        have died), run a round; a promise is never taken back."""
        if self.holding and self.state is MemberState.ACTIVE:
            # a join round that never decided (its coordinator died): go on; the joiner asks again
            self.holding = False
            self._promised = 0
            self._accepted = None
            self._held = None
            self._round = None
            out.append(Hold(on=False))
            return
        if self.state is not MemberState.CHANGING:
            return
        self._stalls += 1
        if self._stalls > MAX_STALLS:
            # No coordinator reached us in all that time, and none could be formed here: a
            # bounded wait, then an answer (the caller's steps fail; the process can rejoin).
            waited = self._stalls * 3 * self.node_deadline_s
            self._stop(MemberState.MINORITY, f"the change of view {self.view.epoch} did not finish within "
                                             f"{waited:.0f} s and this rank could reach no majority to finish it; "
                                             "this rank stops producing results", out)
            return
        out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_STALL, -1, 0), at=now + 3 * self.node_deadline_s))
        if self.busy_since is None:
            # Fenced with no step in flight (new ones wait for the view): watch the members as
            # if one were, so that a coordinator that is gone or cut off is found and replaced,
            # or this side learns it is a minority, instead of waiting for ever.
            self.busy_since = now
            if not self._check_armed:
                self._arm_check(now, out)
        self._retry(now, out)

    def _stop(self, state: MemberState, reason: str, out: list[MemberAction]) -> None:
        self.state = state
        self.reason = reason
        self._round = None
        out.append(Stopped(state=state, reason=reason))

    # ---- dispatch ------------------------------------------------------------------------------

    def _on_message(self, msg: MemberFrame, now: float, out: list[MemberAction]) -> None:
        match msg:
            case Agreement():
                self._on_agreement(msg, now, out)
            case Detection():
                self._on_detection(msg, now, out)
            case Join():
                self._on_join_request(msg, now, out)
            case Notice():
                self._on_notice(msg, now, out)

    def _on_agreement(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        """The view change's messages (single-decree Paxos, then MINORITY)."""
        if msg.kind in RELAYED_KINDS:
            relayed = self._relayed(msg, out)
            if relayed is None:
                return
            msg = relayed
        match msg.kind:
            case Kind.VIEW_PREPARE:
                self._on_prepare(msg, now, out)
            case Kind.VIEW_PROMISE:
                if msg.epoch == self.view.epoch:
                    self._on_promise(msg, now, out)
            case Kind.VIEW_ACCEPT:
                self._on_accept(msg, now, out)
            case Kind.VIEW_ACCEPTED:
                if msg.epoch == self.view.epoch:
                    self._on_accepted(msg, now, out)
            case Kind.VIEW_COMMIT:
                if msg.epoch == self.view.epoch and msg.src != self._coordinator_of(msg.ballot):
                    # only the coordinator of the ballot commits (before: any member's commit was
                    # installed, so one member could evict others or seat ranks nobody agreed on)
                    self.foreign_commits += 1
                    out.append(NotCoordinator(msg=msg))
                    return
                self._install(msg, now, out)
            case Kind.VIEW_NACK:
                self._on_nack(msg, now, out)
            case Kind.MINORITY:
                # from the coordinator we promised, or (ballot 0) from the rank that would coordinate
                # this side and finds it has no majority: either way nothing here can form a view
                if msg.epoch == self.view.epoch and self.rank in msg.promised and msg.ballot in (0, self._promised):
                    self._stop(MemberState.MINORITY, self._minority_reason(len(msg.promised), msg.view_size), out)

    def coordinator(self, passed_over: Collection[int] = ()) -> int | None:
        """The member that coordinates this view's rounds now (see `coordinator`)."""
        return coordinator(self.view.members, passed_over)

    def _coordinator_of(self, ballot: int) -> int | None:
        """The member of this view whose ballots `ballot` is of (its slot is in the ballot)."""
        if ballot <= 0:
            return None
        slot = SLOTS - 1 - ballot % SLOTS
        return self.view.members[slot] if slot < self.view.size else None

    def _on_join_request(self, msg: Join, now: float, out: list[MemberAction]) -> None:
        """A process asks to be admitted, or a member passes such a request on."""
        match msg.kind:
            case Kind.JOIN if msg.query == Query.ADMIT_ME:
                self._on_join(msg.src, now, out)
                self._pass_on_join(msg, now, out)
            case Kind.JOIN_ASK if msg.src in self.view and msg.target not in self._gone:
                self._on_join(msg.target, now, out)

    def _on_notice(self, msg: Notice, now: float, out: list[MemberAction]) -> None:
        """A member changes how the view runs: it leaves, it is done, its uplink is off the pace."""
        match msg.kind:
            case Kind.LEAVE if msg.epoch == self.view.epoch and msg.src in self.view:
                self._leaving.add(msg.src)
                self._evaluate(now, out)
            case Kind.DONE if msg.src in self.view:
                self._on_done(msg, out)
            case Kind.PACE if msg.src in self.view and msg.rate > 0:
                self._pace_wanted[msg.src] = self._uplinks[msg.src] = msg.rate
                self._maybe_pace_round(now, out)

    def _on_detection(self, msg: Detection, now: float, out: list[MemberAction]) -> None:
        """Failure detection: pings and what members report of each other."""
        match msg.kind:
            case Kind.PING:
                self._pinged_by(msg, now, out)
            case Kind.COMPUTING if msg.src in self.view:
                self._computing[msg.src] = (msg.step, now)
            case Kind.PONG:
                self._pong(msg.src, now)  # `heard` counted it as life
            case Kind.SUSPECT if msg.epoch == self.view.epoch and msg.target in self.view:
                self._report(msg.src, msg.target, msg.gone, now, out)
                if msg.gone and msg.target in self._neighbours() and msg.target not in self._suspects:
                    # check it for the others: only a frame heard after this ping refutes it
                    self._refute.add(msg.target)
                    self._ping(msg.target, now, out)
            case Kind.ALIVE if msg.epoch == self.view.epoch and msg.target in self._standing:
                self._standing[msg.target] = now  # refuted: the confirmation clock starts over
                out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_CONFIRM, -1, 0, msg.target),
                                    at=now + self.cfg.confirm_wait_s))

    def _on_timer(self, key: TimerKey, now: float, out: list[MemberAction]) -> None:
        match key.kind:
            case TimerKind.MEMBER_CHECK:
                self._check(now, out)
            case TimerKind.MEMBER_CONFIRM:
                self._evaluate(now, out)
            case TimerKind.MEMBER_ROUND:
                self._round_deadline(now, out)
            case TimerKind.MEMBER_STALL:
                self._stalled(now, out)
