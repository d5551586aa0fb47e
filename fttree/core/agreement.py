"""The agreement round: single-decree Paxos per view, which moves the group to its next view.

The coordinator is the member in the lowest slot that is not confirmed dead (coordination.py).
Its ballot (round, then slot) must be the highest a member has seen:
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
of a change it already installed answers with it (NACK carrying the value). A join or a pace
round (joins.py) runs the same way but fences nothing: its promisers only hold their next
training step until it is decided.

Every step not committed was finished by nobody who promised: its members run it again in the
new view with their own contributions (or hand it back to the caller, by policy). So a step
either keeps the one result some rank may already have delivered, or gets a new one from the
survivors; never two. The plan travels flattened: step, holder, count, then that many ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .coordination import SLOTS, ballot_of, ballot_owner, round_of
from .effects import Send, SetTimer, TimerKey, TimerKind
from .member_events import (
    CatchUp,
    Fence,
    Hold,
    MemberAction,
    MemberState,
    NotCoordinator,
    ViewValue,
    flatten_plan,
)
from .messages import Agreement, Frame, Kind
from .term import Ballots, Round

if TYPE_CHECKING:
    from .membership import Membership

MAX_STALLS = 3  # a view change stalled this many times (3 node deadlines each) stops this rank
#: the agreement's messages: each goes directly and through a relay (Membership.send)
RELAYED_KINDS = frozenset(
    {Kind.VIEW_PREPARE, Kind.VIEW_PROMISE, Kind.VIEW_ACCEPT, Kind.VIEW_ACCEPTED, Kind.VIEW_COMMIT}
)
__all__ = ["MAX_STALLS", "RELAYED_KINDS", "SLOTS", "ViewChange"]


class ViewChange:
    """This rank's side of the agreement, as coordinator and as member. What it promised and
    accepted in the current view is in the view's record (term.Ballots); only the highest round
    it has seen outlives a view (ballots keep growing)."""

    def __init__(self, m: Membership) -> None:
        self.m = m
        self.max_round = 0
        self.no_change = ""  # why the last look for a view change started none (MemberStatus.no_change)

    @property
    def b(self) -> Ballots:
        return self.m.term.ballots

    def agree(self, kind: Kind, **kw: Any) -> Agreement:
        """A frame of the view change, from this rank in its view."""
        return Agreement(kind=kind, src=self.m.rank, epoch=self.m.view.epoch, **kw)

    def majority(self, ranks: Iterable[int]) -> bool:
        return 2 * len(set(ranks)) > self.m.view.size

    def minority_reason(self, promised: int, size: int) -> str:
        return (f"minority {promised} of {size}: view {self.m.view.epoch} has no majority on this side of the "
                f"network ({size // 2 + 1} needed); this rank stops producing results")

    def arm(self, kind: TimerKind, after: float, now: float, out: list[MemberAction]) -> None:
        out.append(SetTimer(key=TimerKey(kind, -1, 0), at=now + after))

    # ---- the coordinator ----------------------------------------------------------------------

    def why_not_start(self, dead: frozenset[int]) -> str:
        """Why this rank starts no view change that leaves out `dead` now ("": it does)."""
        m = self.m
        if self.b.round is not None:
            return f"this rank's round (ballot {self.b.round.ballot}) is under way"
        if not dead:
            return "no member is confirmed dead or leaving"
        if m.rank in dead:
            return "this rank is among those to leave out"
        coordinator = m.coordinator(passed_over=dead)
        if coordinator != m.rank:
            return f"rank {coordinator} coordinates the change without {sorted(dead)}"
        return ""

    def evaluate(self, now: float, out: list[MemberAction]) -> None:
        """Start a view change if this rank is the coordinator and someone is confirmed dead
        (or leaves); else remember why not, for /status."""
        dead = frozenset() if self.b.round is not None else self.m.detection.dead(now)
        self.no_change = self.why_not_start(dead)
        if not self.no_change:
            self.start_round(dead, now, out)

    def start_round(self, dead: frozenset[int], now: float, out: list[MemberAction],
                    joining: tuple[int, ...] = (), *, pace: bool = False) -> None:
        m = self.m
        view = m.view
        alive = [r for r in view.members if r not in dead]
        if not self.majority(alive):  # this side of the network cannot form the next view
            minority = self.agree(Kind.MINORITY, ballot=0, promised=tuple(alive), view_size=view.size)
            for r in alive:
                if r != m.rank:
                    out.append(Send(dst=r, msg=minority))
            m.stop(MemberState.MINORITY, self.minority_reason(len(alive), view.size), out)
            return
        self.max_round += 1
        ballot = ballot_of(self.max_round, view.slot_of(m.rank))
        self.b.round = Round(ballot=ballot, dead=dead, joining=joining, pace=pace)
        prepare = self.agree(Kind.VIEW_PREPARE, ballot=ballot, dead=tuple(sorted(dead)), joining=joining,
                             pace_round=pace)
        m.to_all(prepare, out, but=tuple(dead))
        self.on_prepare(prepare, now, out)  # this rank is a member too
        self.arm(TimerKind.MEMBER_ROUND, m.detection.node_deadline_s, now, out)

    def on_promise(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        r = self.b.round
        if r is None or r.accepting or msg.ballot != r.ballot:
            return
        r.promises[msg.src] = (msg.steps, msg.accepted, ViewValue.of(msg))
        r.user_steps[msg.src] = msg.sender_user_step
        r.rates[msg.src] = msg.rate
        if msg.rate > 0:
            self.m.joins.uplinks[msg.src] = msg.rate
        if {x for x in self.m.view.members if x not in r.dead} <= set(r.promises):
            self.propose(now, out)

    def _value(self, r: Round) -> ViewValue:
        """What this round proposes: a value accepted before (it may have been decided), else
        the next view."""
        view = self.m.view
        epoch = view.epoch + round_of(r.ballot)
        earlier = [(acc, v) for _held, acc, v in r.promises.values() if v is not None]
        if earlier:  # Paxos: a value accepted before may have been decided; keep it
            return max(earlier, key=lambda av: av[0])[1]
        if r.joining or r.pace:
            # Joiners are added in the last slots (leaves of the heap: no member's links change);
            # a pace round keeps the members and takes the slowest uplink promised. Either takes
            # effect from the training step after every promiser's current one: none has
            # started it (they hold).
            members = view.members + tuple(j for j in r.joining if j not in view)
            rates = [rate for rate in r.rates.values() if rate > 0]
            pace = min(rates) if r.pace and rates else view.pace
            if pace >= self.m.cfg.uplink_bytes_per_s:  # nobody's link holds the group back: unpaced
                pace = 0
            # each member's figure: what it promised now in a pace round, else what the view held
            uplinks = tuple((r.rates.get(x, 0) if r.pace else 0) or view.uplink_of(x) for x in members)
            return ViewValue(epoch=epoch, members=members, committed=(), plan=(),
                             user_step=max(r.user_steps.values(), default=-1) + 1, pace=pace, uplinks=uplinks)
        promised = set(r.promises)
        new = view.without([x for x in view.members if x not in promised], epoch)
        committed = sorted({s for held, _a, _v in r.promises.values() for s in held})
        plan = []
        for step in committed:
            holders = sorted(x for x, (held, _a, _v) in r.promises.items() if step in held)
            lacking = tuple(sorted(promised - set(holders)))
            if lacking:
                plan.append(CatchUp(step=step, holder=self.m.rank if self.m.rank in holders else holders[0],
                                    lacking=lacking))
        return ViewValue(epoch=new.epoch, members=new.members, committed=tuple(committed),
                         plan=flatten_plan(plan), pace=new.pace, uplinks=new.uplinks)

    def propose(self, now: float, out: list[MemberAction]) -> None:
        r = self.b.round
        assert r is not None
        r.value = self._value(r)
        r.accepting = True
        accept = self.agree(Kind.VIEW_ACCEPT, ballot=r.ballot, **r.value.fields())
        self.m.to_all(accept, out, but=tuple(r.dead))
        self.on_accept(accept, now, out)
        self.arm(TimerKind.MEMBER_ROUND, self.m.detection.node_deadline_s, now, out)

    def on_accepted(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        r = self.b.round
        if r is None or not r.accepting or msg.ballot != r.ballot:
            return
        r.accepts.add(msg.src)
        assert r.value is not None
        # every member of the new view that is in this one (a joiner accepts nothing: it is not in yet)
        if (self.majority(r.accepts) or r.pace) and set(r.value.members) & set(self.m.view.members) <= r.accepts:
            self.decide(now, out)

    def decide(self, now: float, out: list[MemberAction]) -> None:
        r = self.b.round
        assert r is not None
        assert r.value is not None
        commit = self.agree(Kind.VIEW_COMMIT, ballot=r.ballot, **r.value.fields())
        self.m.to_all(commit, out, but=tuple(d for d in r.dead if d not in self.m.joins.leaving))
        self.m.install(commit, now, out)

    def round_deadline(self, now: float, out: list[MemberAction]) -> None:
        r = self.b.round
        if r is None:
            self.stalled(now, out)
            return
        view = self.m.view
        if r.pace and not set(view.members) <= (r.accepts if r.accepting else set(r.promises)):
            # A pace change needs every member: one that missed it would cut its steps another
            # way. Some did not answer in time (a cut link, a slow one): give up; it is asked
            # for again later, and the promisers go on at their stall deadline.
            self.b.round = None
            return
        if r.accepting:
            if self.majority(r.accepts):
                self.decide(now, out)
            else:
                self.retry(now, out)
        elif self.majority(r.promises):
            self.propose(now, out)
        elif self.majority(set(r.promises) | r.refusals):
            self.retry(now, out)  # alive, but promised elsewhere: another round
        elif r.joining and not r.dead:
            # Admitting is not a failure: members that did not promise in time (behind, or
            # their answers lost) are not shown dead by it. Give up; detection handles the dead,
            # and the joiners wait for the next chance (the promisers go on at their stall deadline).
            self.b.round = None
            self.m.joins.wait_again(r.joining)
        else:
            minority = self.agree(Kind.MINORITY, ballot=r.ballot, promised=tuple(sorted(r.promises)),
                                  view_size=view.size)  # the promisers stop with us
            for x in r.promises:
                if x != self.m.rank:
                    out.append(Send(dst=x, msg=minority))
            self.m.stop(MemberState.MINORITY, self.minority_reason(len(r.promises), view.size), out)

    def retry(self, now: float, out: list[MemberAction]) -> None:
        """Give up this round; start another if this rank still coordinates a change."""
        self.b.round = None
        self.evaluate(now, out)

    # ---- a member ----------------------------------------------------------------------------

    def on_prepare(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        m, b = self.m, self.b
        if msg.epoch < m.view.epoch:
            self.tell_decided(msg, out)
            return
        if msg.epoch > m.view.epoch or m.rank in msg.dead:
            return  # we are behind, or the one being left out: the decision will tell us
        self.max_round = max(self.max_round, round_of(msg.ballot))
        if msg.ballot == b.promised and msg.src != m.rank:
            if b.held is not None:  # the same PREPARE the second way: the same answer
                self.send_promise(msg.ballot, msg.src, now, out)
            return
        if msg.ballot < b.promised:
            out.append(Send(dst=msg.src, msg=self.agree(Kind.VIEW_NACK, ballot=b.promised)))
            return
        if b.round is not None and msg.src != m.rank and msg.ballot > b.round.ballot:
            b.round = None  # a better coordinator: follow it
        b.promised = msg.ballot
        stall_after = 3 * m.detection.node_deadline_s
        if (msg.joining or msg.pace_round) and not msg.dead and m.state is MemberState.ACTIVE:
            # a join: nothing is fenced (the steps in flight finish in this view); only the
            # next training step waits for the decision, which says where the new view starts
            if not b.holding:
                b.holding = True
                out.append(Hold(on=True))
                self.arm(TimerKind.MEMBER_STALL, stall_after, now, out)
            b.held = ()
            self.send_promise(msg.ballot, msg.src, now, out)
            return
        if m.state is MemberState.ACTIVE:
            m.term.state = MemberState.CHANGING
            self.arm(TimerKind.MEMBER_STALL, stall_after, now, out)
        if b.held is None:
            if not b.waiting:
                out.append(Fence())
            b.waiting.append((msg.ballot, msg.src))
        else:
            self.send_promise(msg.ballot, msg.src, now, out)

    def fenced(self, held: tuple[int, ...], now: float, out: list[MemberAction]) -> None:
        """The node fenced its results and holds `held`: promise to those waiting for it."""
        b = self.b
        b.held = held
        waiting, b.waiting = b.waiting, []
        for ballot, coordinator in waiting:
            self.send_promise(ballot, coordinator, now, out)

    def send_promise(self, ballot: int, coordinator: int, now: float, out: list[MemberAction]) -> None:
        b, m = self.b, self.m
        assert b.held is not None
        accepted_ballot, value = b.accepted if b.accepted is not None else (0, None)
        promise = self.agree(Kind.VIEW_PROMISE, ballot=ballot, steps=b.held, accepted=accepted_ballot,
                             sender_user_step=m.user_step, rate=m.joins.target_pace(),
                             **(value.fields() if value is not None else {}))
        if coordinator == m.rank:
            self.on_promise(promise, now, out)
        else:
            m.send(coordinator, promise, out)

    def on_accept(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        b = self.b
        value = ViewValue.of(msg)
        if msg.epoch != self.m.view.epoch or value is None:
            return
        if msg.ballot < b.promised or b.held is None:  # only a fenced promiser may accept
            out.append(Send(dst=msg.src, msg=self.agree(Kind.VIEW_NACK, ballot=b.promised)))
            return
        b.promised = msg.ballot
        b.accepted = (msg.ballot, value)
        accepted = self.agree(Kind.VIEW_ACCEPTED, ballot=msg.ballot)
        if msg.src == self.m.rank:
            self.on_accepted(accepted, now, out)
        else:
            self.m.send(msg.src, accepted, out)

    def on_nack(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        if msg.proposed and msg.epoch < self.m.view.epoch:
            return
        if msg.proposed:  # the sender installed a change of our view already: so do we
            self.m.install(msg, now, out)
            return
        self.max_round = max(self.max_round, round_of(msg.ballot))
        r = self.b.round
        if r is not None:
            r.refusals.add(msg.src)

    def tell_decided(self, msg: Agreement, out: list[MemberAction]) -> None:
        """A proposal for a view we already left: answer with the change we installed from it."""
        decided = self.m.term.decided
        if decided is not None and decided[0] == msg.epoch:
            out.append(Send(dst=msg.src, msg=Agreement(kind=Kind.VIEW_NACK, src=self.m.rank, epoch=msg.epoch,
                                                       **decided[1].fields())))

    def stale_sender(self, msg: Frame) -> list[MemberAction]:
        """A frame of an older view: a rank not in ours missed the change that left it out (it
        was cut off, or stopped and resumed); a member may have missed the commit of a change
        that kept it (a cut link between it and the coordinator). Tell it, once per rank and
        view: it installs the decision as if the commit had come."""
        m = self.m
        term = m.term
        out: list[MemberAction] = []
        if msg.src == m.rank or msg.src in term.told:
            return out
        if msg.src in m.view:
            if term.decided is None or term.decided[0] != msg.epoch:
                return out
            term.told.add(msg.src)
            out.append(Send(dst=msg.src, msg=Agreement(kind=Kind.VIEW_NACK, src=m.rank, epoch=msg.epoch,
                                                       **term.decided[1].fields())))
            return out
        term.told.add(msg.src)
        out.append(Send(dst=msg.src, msg=Agreement(kind=Kind.VIEW_NACK, src=m.rank, epoch=msg.epoch,
                                                   proposed=m.view.epoch, members=m.view.members)))
        return out

    def stalled(self, now: float, out: list[MemberAction]) -> None:
        """Fenced and no decision in time: if this rank is the coordinator now (the old one may
        have died), run a round; a promise is never taken back."""
        m, b = self.m, self.b
        if b.holding and m.state is MemberState.ACTIVE:
            # a join round that never decided (its coordinator died): go on; the joiner asks
            # again. Nothing else was promised or fenced in this view (a member that fenced is
            # CHANGING), so this view's ballots start over.
            m.term.ballots = Ballots()
            out.append(Hold(on=False))
            return
        if m.state is not MemberState.CHANGING:
            return
        b.stalls += 1
        stall_after = 3 * m.detection.node_deadline_s
        if b.stalls > MAX_STALLS:
            # No coordinator reached us in all that time, and none could be formed here: a
            # bounded wait, then an answer (the caller's steps fail; the process can rejoin).
            waited = b.stalls * stall_after
            m.stop(MemberState.MINORITY, f"the change of view {m.view.epoch} did not finish within "
                                         f"{waited:.0f} s and this rank could reach no majority to finish it; "
                                         "this rank stops producing results", out)
            return
        self.arm(TimerKind.MEMBER_STALL, stall_after, now, out)
        detection = m.detection
        if detection.busy_since is None:
            # Fenced with no step in flight (new ones wait for the view): watch the members as
            # if one were, so that a coordinator that is gone or cut off is found and replaced,
            # or this side learns it is a minority, instead of waiting for ever.
            detection.busy_since = now
            if not detection.check_armed:
                detection.arm_check(now, out)
        self.retry(now, out)

    # ---- dispatch ------------------------------------------------------------------------------

    def relayed(self, msg: Agreement, out: list[MemberAction]) -> Agreement | None:
        """A copy of an agreement message sent through this rank: pass it on (once: the copy
        names its first sender in `origin`) and return None; or, relayed to this rank, the
        message as its first sender sent it."""
        m = self.m
        if msg.origin >= 0:
            if msg.target != m.rank or msg.origin not in m.view or msg.src not in m.view:
                return None
            return msg.but(src=msg.origin, origin=-1, target=-1)
        if msg.target >= 0 and msg.target != m.rank:
            if msg.target in m.view and msg.src in m.view:
                out.append(Send(dst=msg.target, msg=msg.but(src=m.rank, origin=msg.src)))
            return None
        return msg

    def on_message(self, msg: Agreement, now: float, out: list[MemberAction]) -> None:
        """The view change's messages (single-decree Paxos, then MINORITY)."""
        m = self.m
        if msg.kind in RELAYED_KINDS:
            relayed = self.relayed(msg, out)
            if relayed is None:
                return
            msg = relayed
        epoch = m.view.epoch
        match msg.kind:
            case Kind.VIEW_PREPARE:
                self.on_prepare(msg, now, out)
            case Kind.VIEW_PROMISE:
                if msg.epoch == epoch:
                    self.on_promise(msg, now, out)
            case Kind.VIEW_ACCEPT:
                self.on_accept(msg, now, out)
            case Kind.VIEW_ACCEPTED:
                if msg.epoch == epoch:
                    self.on_accepted(msg, now, out)
            case Kind.VIEW_COMMIT:
                if msg.epoch == epoch and msg.src != ballot_owner(m.view.members, msg.ballot):
                    # only the coordinator of the ballot commits (before: any member's commit was
                    # installed, so one member could evict others or seat ranks nobody agreed on)
                    m.foreign_commits += 1
                    out.append(NotCoordinator(msg=msg))
                    return
                m.install(msg, now, out)
            case Kind.VIEW_NACK:
                self.on_nack(msg, now, out)
            case Kind.MINORITY:
                # from the coordinator we promised, or (ballot 0) from the rank that would coordinate
                # this side and finds it has no majority: either way nothing here can form a view
                if msg.epoch == epoch and m.rank in msg.promised and msg.ballot in (0, self.b.promised):
                    m.stop(MemberState.MINORITY, self.minority_reason(len(msg.promised), msg.view_size), out)
