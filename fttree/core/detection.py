"""Failure detection: which members are alive, which are suspected, and which are confirmed dead.

Silence is about a node, not a busy link: any bytes from a neighbour count as life, a frame or
part of one (a large payload takes seconds on a slow link), and pings travel on the control
connection, which never waits behind tensor data (net/tcp.py). A tree or backup neighbour silent
for half the node deadline while this rank has a step in flight is pinged; it is suspected only
once that ping has gone unanswered for the whole node deadline. A connection to a member that is
refused (its process is gone: the transport tried to reconnect and nobody listens) suspects it at
once. The node deadline is `node_deadline_s` (1 s), or more where pings take long: twice the
round trip they were answered in (RFC 6298's SRTT + 4 RTTVAR).

Confirmation. A suspicion goes to every member (SUSPECT). A neighbour of the suspect that gets it
pings the suspect and, if it answers, tells everyone (ALIVE), which starts the suspect's
confirmation clock over. A rank is confirmed dead once suspected for `confirm_wait_s` without an
ALIVE, by at least two of its neighbours that are not dead themselves (one, if it has only one
such neighbour), counted over the largest set of suspects for which that holds (a fixed point):
a partition's far side, whose members each have one neighbour on this side, is confirmed as a
whole, while one silent link (two ranks suspecting each other) or two serial cuts (the others
still hear the middle rank, and say so) never are. Silence on every link is what a crash or a
hang looks like; silence on some links is a link fault, which the relays handle within a step.

Slow compute is not broken: a pinged member that has not submitted the step its pinger waits on
tells every member it is still computing (COMPUTING), and steps waiting on it are put off.

This part suspects and confirms; whether the group moves on is the agreement's (agreement.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .effects import Send, SetTimer, TimerKey, TimerKind
from .member_events import Eviction, MemberAction, MemberState, Suspected
from .messages import Detection, Kind
from .term import Suspicions
from .view import View

if TYPE_CHECKING:
    from .membership import Membership

MAX_NODE_DEADLINE_S = 30.0  # however slowly pings come back, a silent rank is suspected after this
# A ping or its answer lost on a lossy link waits for TCP to send it again, and again if that is
# lost too: where a link to a neighbour has lost packets, the node deadline covers three tries
# (the timeout, then twice and four times it).
RETRANSMIT_TRIES = 1 + 2 + 4
COMPUTING_FRESH = 3.0  # a member's COMPUTING counts for this many node deadlines (it says it again when pinged)
CLOCK_SLACK_S = 1e-6  # a wait computed as a difference of sums of timer steps may round a hair below its length
MAX_EVICTIONS_KEPT = 16  # the evictions /status lists, newest last


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


class Detector:
    """This rank's failure detector: when it last heard each rank, its pings and how long their
    answers took (the node deadline), whether a step is in flight, who says it is still
    computing, and what was evicted. The suspicions of the current view are in its record
    (term.Suspicions), so a new view starts without them."""

    def __init__(self, m: Membership) -> None:
        self.m = m
        self.node_deadline_s = m.cfg.node_deadline_s
        self.busy_since: float | None = None  # a step in flight since (None: idle)
        self.submitted = -1  # the newest step this rank submitted (Busy events)
        self.last_heard: dict[int, float] = {}
        self.pinged: dict[int, float] = {}  # peer -> when it was last pinged
        self.ping_rtt: tuple[float, float] | None = None  # (SRTT, RTTVAR) of answered pings
        self.retransmit_s = 0.0  # the longest retransmission timeout to a neighbour (Uplink events)
        self.check_armed = False
        self.check_due = float("inf")  # when the armed check is due (self_check.py: a freeze makes it late)
        self.computing_of: dict[int, tuple[int, float]] = {}  # member -> (oldest step it has not submitted, when said)
        self.computing_said = -1e9  # when this rank last said COMPUTING
        self.suspicions_total = 0
        self.evictions: list[Eviction] = []
        self.evicted_total = 0

    @property
    def s(self) -> Suspicions:
        return self.m.term.suspicions

    def neighbours(self) -> tuple[int, ...]:
        return self.m.view.neighbours(self.m.rank).all

    # ---- what the node tells -------------------------------------------------------------------

    def heard(self, peer: int, now: float) -> list[MemberAction]:
        """Any frame from `peer`: life, and the end of any suspicion of it this rank holds."""
        self.last_heard[peer] = now
        self.m.term.unheard.discard(peer)
        s = self.s
        s.ping_since.pop(peer, None)
        if peer not in s.refute and peer not in s.mine:
            return []
        out: list[MemberAction] = []
        m = self.m
        if peer in s.refute:
            s.refute.discard(peer)
            m.to_all(Detection(kind=Kind.ALIVE, src=m.rank, epoch=m.view.epoch, target=peer), out)
        if s.mine.pop(peer, None) is not None:
            m.to_all(Detection(kind=Kind.SUSPECT, src=m.rank, epoch=m.view.epoch, target=peer), out)
            self.report(m.rank, peer, False, now, out)
        return out

    def busy(self, since: float | None, step: int, now: float, out: list[MemberAction]) -> None:
        """A step in flight since `since` (None: idle): watch the neighbours while there is."""
        self.busy_since = since
        self.submitted = max(self.submitted, step)
        if since is not None and not self.check_armed:
            self.arm_check(now, out)

    def peer_down(self, peer: int, reason: str, now: float, out: list[MemberAction]) -> None:
        """The transport's connection to `peer` was refused: its process is gone."""
        if peer in self.m.view and peer != self.m.rank and peer not in self.m.joins.done:
            self.suspect(peer, f"connection refused ({reason})", now, out)

    def set_retransmit(self, retransmit_s: float) -> None:
        self.retransmit_s = retransmit_s
        self.set_node_deadline()

    def watch_joined(self, now: float) -> None:
        """A decided join took effect here (this rank began its training step): the joiners
        take part from this step on, so from now they are watched as any member, their silence
        counted from here. Before, a joiner stayed exempt until its first frame: one that went
        silent right after its admission was never suspected, and every step waited for it."""
        unheard = self.m.term.unheard
        for peer in unheard:
            self.last_heard[peer] = max(self.last_heard.get(peer, now), now)
        unheard.clear()

    def carry_into(self, view: View, joined: tuple[int, ...]) -> None:
        """A new view: a joiner's or a departed member's word that it computes counts no more."""
        self.computing_of = {r: said for r, said in self.computing_of.items() if r in view and r not in joined}

    # ---- pings and the node deadline -----------------------------------------------------------

    def arm_check(self, now: float, out: list[MemberAction]) -> None:
        self.check_armed = True
        self.check_due = now + self.node_deadline_s / 4
        out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_CHECK, -1, 0), at=self.check_due))

    def late_by(self, now: float) -> float:
        """How far past its due time the armed check timer is, beyond half a node deadline: more
        than 0 means this process did not run for that long."""
        return now - self.check_due - self.node_deadline_s / 2

    def freeze_seen(self, now: float) -> float:
        """How long past its due time the check timer is: noticed once (it is due again when
        it fires and is armed anew)."""
        frozen_s = now - self.check_due
        self.check_due = float("inf")
        return frozen_s

    def check(self, now: float, out: list[MemberAction]) -> None:
        """While a step is in flight: ping neighbours silent for half the node deadline, suspect
        those silent for all of it. Idle, only come again: a freeze shows as this timer coming
        late (self_check.py), and a rank frozen between steps finds its children's sums of the
        next step waiting when it resumes."""
        self.check_armed = False
        self.check_due = float("inf")
        busy_since = self.busy_since
        if busy_since is None:
            self.arm_check(now, out)
            return
        deadline = self.node_deadline_s
        term = self.m.term
        for peer in self.neighbours():
            if peer in term.unheard or peer in self.m.joins.done:  # a joiner starts later; a finished member is quiet
                continue
            silent = now - max(self.last_heard.get(peer, term.installed_at), busy_since)
            if silent < deadline / 2:
                continue
            asked = term.suspicions.ping_since.get(peer)
            if asked is not None and asked < busy_since:  # a ping of an earlier step's silence
                del term.suspicions.ping_since[peer]
                asked = None
            # (the checks come every quarter deadline: the fourth after the ping may compute to a
            # hair under it, which put the suspicion off by a whole quarter)
            if asked is not None and now - asked >= deadline - CLOCK_SLACK_S:
                self.suspect(peer, f"silent for {silent:.2f} s with a step in flight, and a ping unanswered for "
                                   f"{now - asked:.2f} s (node deadline {deadline:.2f} s)", now, out)
            elif now - self.pinged.get(peer, -1e9) >= deadline / 4:
                term.suspicions.ping_since.setdefault(peer, now)
                self.ping(peer, now, out)
        self.m.change.evaluate(now, out)
        self.arm_check(now, out)

    def ping(self, peer: int, now: float, out: list[MemberAction]) -> None:
        self.pinged[peer] = now
        out.append(Send(dst=peer, msg=Detection(kind=Kind.PING, src=self.m.rank, epoch=self.m.view.epoch,
                                                step=self.submitted)))

    def pong(self, peer: int, now: float) -> None:
        """A ping answered: learn how long answers take, and derive the node deadline from it."""
        sent = self.pinged.get(peer)
        if sent is None:
            return
        r = now - sent
        if self.ping_rtt is None:
            srtt, rttvar = r, r / 2
        else:
            srtt, rttvar = self.ping_rtt
            rttvar = 0.75 * rttvar + 0.25 * abs(srtt - r)
            srtt = 0.875 * srtt + 0.125 * r
        self.ping_rtt = (srtt, rttvar)
        self.set_node_deadline()

    def set_node_deadline(self) -> None:
        """`node_deadline_s`, or more: twice what pings took to be answered (SRTT + 4 RTTVAR),
        and three tries of a lost ping or answer on a lossy link."""
        answered = 0.0 if self.ping_rtt is None else 2 * (self.ping_rtt[0] + 4 * self.ping_rtt[1])
        self.node_deadline_s = min(max(self.m.cfg.node_deadline_s, answered, RETRANSMIT_TRIES * self.retransmit_s),
                                   MAX_NODE_DEADLINE_S)

    # ---- slow compute ----------------------------------------------------------------------------

    def computing(self, now: float) -> dict[int, int]:
        """Members that said lately that they are alive and have not submitted a step yet ->
        the oldest such step. A step waiting on one of them is slow, not broken: its deadlines
        are put off (tree_deadlines.Deadlines._extended), up to Config.submit_wait_s."""
        fresh = now - COMPUTING_FRESH * self.node_deadline_s
        view = self.m.view
        return {peer: step for peer, (step, said) in self.computing_of.items() if said >= fresh and peer in view}

    def pinged_by(self, msg: Detection, now: float, out: list[MemberAction]) -> None:
        """Answer a ping. A pinger waits on step `msg.step`; if this rank has not submitted it,
        its caller is still computing: it tells every member (they cannot all ping it), at
        most every half node deadline."""
        m = self.m
        # a self-check's ping (target >= 0) hears back its number, and whether a change is under way here
        out.append(Send(dst=msg.src, msg=Detection(kind=Kind.PONG, src=m.rank, epoch=m.view.epoch, target=msg.target,
                                                   gone=msg.target >= 0 and m.state is MemberState.CHANGING)))
        if self.submitted >= msg.step or now - self.computing_said < self.node_deadline_s / 2 \
                or m.state is not MemberState.ACTIVE or m.rank not in m.view:
            return
        self.computing_said = now
        m.to_all(Detection(kind=Kind.COMPUTING, src=m.rank, epoch=m.view.epoch, step=self.submitted + 1), out)

    # ---- suspicions ----------------------------------------------------------------------------

    def suspect(self, peer: int, why: str, now: float, out: list[MemberAction]) -> None:
        s, m = self.s, self.m
        if peer in s.mine:
            return
        s.mine[peer] = why
        self.suspicions_total += 1
        out.append(Suspected(peer=peer, reason=why))
        m.to_all(Detection(kind=Kind.SUSPECT, src=m.rank, epoch=m.view.epoch, target=peer, gone=True), out,
                 but=(peer,))
        self.report(m.rank, peer, True, now, out)

    def report(self, reporter: int, suspect: int, on: bool, now: float, out: list[MemberAction]) -> None:
        s = self.s
        reporters = s.reports.setdefault(suspect, set())
        if on:
            if not reporters:
                s.standing[suspect] = now
                s.first.setdefault(suspect, now)
                out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_CONFIRM, -1, 0, suspect),
                                    at=now + self.m.cfg.confirm_wait_s))
            reporters.add(reporter)
        else:
            reporters.discard(reporter)
            if not reporters:
                del s.reports[suspect]
                s.standing.pop(suspect, None)
        self.m.change.evaluate(now, out)

    def dead(self, now: float) -> frozenset[int]:
        """The members to leave out now: those confirmed dead, and those leaving."""
        s, view = self.s, self.m.view
        # `since + wait`, the very sum the confirmation timer was set for (now - since could round below it)
        ready = [p for p, since in s.standing.items() if now >= since + self.m.cfg.confirm_wait_s]
        leaving = frozenset(p for p in self.m.joins.leaving if p in view)
        return confirmed_dead(view, s.reports, ready) | leaving

    def on_message(self, msg: Detection, now: float, out: list[MemberAction]) -> None:
        """Pings and what members report of each other."""
        s, view = self.s, self.m.view
        match msg.kind:
            case Kind.PING:
                self.pinged_by(msg, now, out)
            case Kind.COMPUTING if msg.src in view:
                self.computing_of[msg.src] = (msg.step, now)
            case Kind.PONG:
                self.pong(msg.src, now)  # `heard` counted it as life
                if msg.target >= 0:
                    self.m.self_check.answered(msg, now, out)
            case Kind.SUSPECT if msg.epoch == view.epoch and msg.target in view:
                self.report(msg.src, msg.target, msg.gone, now, out)
                if msg.gone and msg.target in self.neighbours() and msg.target not in s.mine:
                    # check it for the others: only a frame heard after this ping refutes it
                    s.refute.add(msg.target)
                    self.ping(msg.target, now, out)
            case Kind.ALIVE if msg.epoch == view.epoch and msg.target in s.standing:
                s.standing[msg.target] = now  # refuted: the confirmation clock starts over
                out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_CONFIRM, -1, 0, msg.target),
                                    at=now + self.m.cfg.confirm_wait_s))

    # ---- what was evicted ------------------------------------------------------------------------

    def reason(self, peer: int) -> str:
        """Why `peer` is left out of the next view, as far as this rank knows."""
        joins = self.m.joins
        if peer in joins.gone:
            return joins.gone[peer]
        s = self.s
        if peer in joins.leaving and peer not in s.reports:
            return "left the group (graceful leave)"
        reporters = sorted(s.reports.get(peer, ()))
        mine = s.mine.get(peer)
        return f"suspected by ranks {reporters}" + (f" (here: {mine})" if mine else "")

    def record_evictions(self, view: View, evicted: tuple[int, ...], now: float) -> None:
        s = self.s
        for r in evicted:
            first = s.first.get(r)
            self.evictions.append(Eviction(rank=r, epoch=view.epoch, reason=self.reason(r),
                                           detected_after_s=0.0 if first is None else now - first,
                                           suspected_by=tuple(sorted(s.reports.get(r, ())))))
        self.evicted_total += len(evicted)
        del self.evictions[:-MAX_EVICTIONS_KEPT]
