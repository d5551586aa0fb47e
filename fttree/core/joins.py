"""Joins, leaves and pace: the changes of the view that members ask for, as opposed to failures.

Joins. A new process asks every member to be admitted (JOIN); a member that does not coordinate
passes the request on (JOIN_ASK), and the coordinator (the lowest slot not leaving,
coordination.py) admits the ranks that wait in one round that fences nothing: the joiners take
part from the training step after every promiser's current one, and the promisers hold their next
step until the round is decided. A rank still in the view that asks is a restarted process: its
old one is evicted first. Only one such change is decided at a time: a second one decided before
the first took effect would give the first joiner a view it never hears of.

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

Leaves. A member that leaves says so (LEAVE) and is left out without waiting for a suspicion. A
member that finished its job says so (DONE, with its last step) and closes only once every
member has: its silence after that is no failure. A member still running steps past another's
last step drops it from the view as it would a leaver (without a suspicion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .admission import Query
from .effects import Send
from .member_events import MemberAction, MemberState
from .messages import Join, Kind, Notice
from .view import View

if TYPE_CHECKING:
    from .membership import Membership

MAX_WAITING_JOINS = 64  # new ranks a coordinator keeps waiting for admission; more ask again later
JOIN_PASS_ON_S = 1.0  # a member passes one joiner's request on to the coordinator at most this often
PACE_FACTOR = 2.0  # a member asks for a pace round when its uplink is this far from the view's figure for it


@dataclass(frozen=True, slots=True)
class Pending:
    """The last decided change that takes effect at a training step (a join or a pace change):
    that step, and the ranks it admits until this rank has begun it (none for a pace change, or
    once it took effect here). Until this rank reaches `at`, no other such change is agreed."""

    at: int = -1
    joiners: frozenset[int] = frozenset()


class JoinsAndPace:
    """Who waits to join, the decided change still to take effect, who leaves or finished, and
    the measured uplinks a pace round needs."""

    def __init__(self, m: Membership) -> None:
        self.m = m
        # new ranks that asked while another change was agreed or waited to take effect: the
        # coordinator admits them together once it may (they ask again meanwhile, too)
        self.waiting: dict[int, bool] = {}  # rank -> a restart whose old process is in the view
        self.pending = Pending()
        self.passed_on: dict[int, float] = {}  # joiner -> when its request was last passed to the coordinator
        self.leaving: set[int] = set()  # ranks that said they leave: evicted without waiting
        self.gone: dict[int, str] = {}  # ranks known gone without a suspicion (restarted), and why
        self.done: dict[int, int] = {}  # members that finished their job -> their last step
        self.rate = 0.0  # this rank's measured uplink (Uplink events)
        self.clear = False  # its link had a figure and showed no queue since (uplink.py): it limits nothing
        self.uplinks: dict[int, int] = {}  # member -> the uplink it reported (PACE, VIEW_PROMISE)
        self.pace_wanted: dict[int, int] = {}  # coordinator: member -> the uplink it asked a pace round for

    # ---- may a change be agreed now --------------------------------------------------------------

    def why_not_now(self) -> str:
        """Why no join or pace change may be agreed now ("": one may): nothing else may be agreed
        or wait to take effect."""
        m = self.m
        b = m.term.ballots
        if m.state is not MemberState.ACTIVE:
            return f"this rank is {m.state.value}"
        if b.holding:
            return "a join or pace round this rank promised in is not decided yet"
        if b.round is not None:
            return f"this rank's round (ballot {b.round.ballot}) is under way"
        if m.user_step < self.pending.at:
            return (f"the change decided for training step {self.pending.at} has not taken effect here "
                    f"(this rank is in step {m.user_step})")
        return ""

    def join_coordinator(self) -> int | None:
        """Who admits joiners: a leaving coordinator would admit a rank into a view it leaves."""
        return self.m.coordinator(passed_over=self.leaving)

    # ---- joins ---------------------------------------------------------------------------------

    def on_request(self, msg: Join, now: float, out: list[MemberAction]) -> None:
        """A process asks to be admitted, or a member passes such a request on."""
        match msg.kind:
            case Kind.JOIN if msg.query is Query.ADMIT_ME:
                self.on_join(msg.src, now, out)
                self.pass_on(msg, now, out)
            case Kind.JOIN_ASK if msg.src in self.m.view and msg.target not in self.gone:
                self.on_join(msg.target, now, out)

    def on_join(self, joiner: int, now: float, out: list[MemberAction]) -> None:
        """A rank asks to be admitted (the node has checked it is a new process). Only the
        coordinator acts; the joiner asks every member, again until admitted. A rank still in
        the view is a restarted process: its old one is gone, so it is evicted first."""
        m = self.m
        if self.join_coordinator() != m.rank:
            return
        if len(self.waiting) < MAX_WAITING_JOINS or joiner in self.waiting:
            self.waiting[joiner] = joiner in m.view
        if self.why_not_now():
            # Another change is being agreed, or a decided join has not taken effect here yet: a
            # second one decided now would give the first joiner a view it never hears of (its
            # admission names the first view). The joiner waits here (and asks again).
            return
        if joiner in m.view:  # its admission follows once this eviction is installed
            self.gone[joiner] = "restarted: a new process of this rank asked to join"
            m.change.start_round(frozenset({joiner}), now, out)
        else:
            self.maybe_admit(now, out)

    def pass_on(self, msg: Join, now: float, out: list[MemberAction]) -> None:
        """A member that is not the coordinator passes a join request on (at most once a
        second per joiner): the joiner's own frames to the coordinator may not get through."""
        m = self.m
        coordinator = self.join_coordinator()
        if coordinator is None or coordinator == m.rank or m.state is not MemberState.ACTIVE:
            return
        if now - self.passed_on.get(msg.src, -1e9) < JOIN_PASS_ON_S:
            return
        if msg.src not in self.passed_on and len(self.passed_on) >= MAX_WAITING_JOINS:
            self.passed_on.clear()
        self.passed_on[msg.src] = now
        out.append(Send(dst=coordinator, msg=Join(kind=Kind.JOIN_ASK, src=m.rank, epoch=m.view.epoch,
                                                  target=msg.src, incarnation=msg.incarnation,
                                                  addresses=msg.addresses)))

    def maybe_admit(self, now: float, out: list[MemberAction]) -> None:
        """As coordinator, admit the new ranks that wait, in one round, once a change may be agreed."""
        view = self.m.view
        for rank, restarted in list(self.waiting.items()):
            if rank in view and not restarted:
                del self.waiting[rank]  # admitted meanwhile
            elif rank not in view:
                self.waiting[rank] = False  # a restarted rank's old process is out now
        joining = tuple(sorted(r for r, restarted in self.waiting.items() if not restarted))
        if not joining or self.why_not_now() or self.join_coordinator() != self.m.rank:
            return
        for rank in joining:
            del self.waiting[rank]
        self.m.change.start_round(frozenset(), now, out, joining=joining)

    def wait_again(self, joiners: tuple[int, ...]) -> None:
        """A join round gave up: its joiners wait for the next chance."""
        for rank in joiners:
            self.waiting.setdefault(rank, False)

    def boundary(self, now: float, out: list[MemberAction]) -> None:
        """This rank began a training step (Membership.user_step): a decided change may have
        taken effect, and one that waited for it may be agreed now."""
        if self.m.user_step >= self.pending.at:
            self.pending = Pending(at=self.pending.at)
            self.m.detection.watch_joined(now)
        self.maybe_admit(now, out)
        self.maybe_pace_round(now, out)

    def settle(self, view: View, evicted: tuple[int, ...], joined: tuple[int, ...], user_step: int) -> None:
        """A view is installed (taking effect at `user_step`, -1: at once). One installed before a
        decided join took effect leaves its joiners out (they did not know to promise): they wait
        to be admitted again, and nothing waits for that join."""
        pending = self.pending
        for r in evicted:
            if r in pending.joiners:
                self.gone[r] = (f"was admitted in a view that view {view.epoch} superseded before it took effect "
                                "(it is admitted again)")
                if len(self.waiting) < MAX_WAITING_JOINS:
                    self.waiting[r] = False
        at = -1 if pending.joiners and self.m.user_step < pending.at else pending.at
        self.pending = Pending(at=user_step if user_step >= 0 else at,
                               joiners=frozenset(joined if user_step >= 0 else ()))

    def carry_into(self, view: View) -> None:
        """A new view: forget the ranks that are no longer in it."""
        self.done = {r: last for r, last in self.done.items() if r in view}
        self.leaving &= set(view.members)
        self.gone = {r: why for r, why in self.gone.items() if r in view}

    # ---- leaves and the end of the job -------------------------------------------------------------

    def on_notice(self, msg: Notice, now: float, out: list[MemberAction]) -> None:
        """A member changes how the view runs: it leaves, it is done, its uplink is off the pace."""
        view = self.m.view
        match msg.kind:
            case Kind.LEAVE if msg.epoch == view.epoch and msg.src in view:
                self.leaving.add(msg.src)
                self.m.change.evaluate(now, out)
            case Kind.DONE if msg.src in view:
                self.on_done(msg, out)
            case Kind.PACE if msg.src in view and msg.rate > 0:
                self.pace_wanted[msg.src] = self.uplinks[msg.src] = msg.rate
                self.maybe_pace_round(now, out)

    def finished_before(self, step: int, now: float, out: list[MemberAction]) -> None:
        """This rank submitted `step`: members that finished before it leave the view."""
        m = self.m
        finished = {p for p, last in self.done.items() if step > last and p in m.view and p != m.rank}
        if finished - self.leaving:  # they finished before this step: go on without them
            self.leaving |= finished
            m.change.evaluate(now, out)

    def finish(self, step: int) -> list[MemberAction]:
        """This rank's job is over after `step`: tell every member, with what it knows of the
        others (a cut link does not keep two finished ranks from learning of each other)."""
        self.done[self.m.rank] = step
        out: list[MemberAction] = []
        self.tell_done(out)
        return out

    def tell_done(self, out: list[MemberAction]) -> None:
        m = self.m
        ranks = tuple(sorted(self.done))
        m.to_all(Notice(kind=Kind.DONE, src=m.rank, epoch=m.view.epoch, step=self.done[m.rank],
                        finished=ranks, last_steps=tuple(self.done[r] for r in ranks)), out)

    def on_done(self, msg: Notice, out: list[MemberAction]) -> None:
        """Ranks that finished their job (the sender, and those it knows of): a finished rank
        passes on what it learns, so the news goes around a cut link."""
        m = self.m
        told = dict(zip(msg.finished, msg.last_steps, strict=True)) if len(msg.finished) == len(msg.last_steps) else {}
        told.setdefault(msg.src, msg.step)
        new = False
        for r, last in told.items():
            if r in m.view and r != m.rank and self.done.get(r, -1) < last:
                self.done[r] = last
                new = True
        if new and m.rank in self.done:
            self.tell_done(out)

    # ---- pace ----------------------------------------------------------------------------------

    @property
    def slowest_uplink(self) -> float:
        """The slowest uplink this rank knows of in the group (its own, and those members told
        it: PACE, promises), bytes per second; 0.0 if none. A root's deadline allows for it."""
        view = self.m.view
        known = [r for member, r in self.uplinks.items() if member in view] + ([self.rate] if self.rate else [])
        return float(min(known, default=0.0))

    def target_pace(self) -> int:
        """The pace this rank's uplink calls for: its measured rate, never above the configured
        one (above it, steps are cut as on a LAN anyway); the configured one once a link that
        had a figure showed no queue over the meter's window (`clear`: uplink.py forgets the
        figure), so that a pace a loss burst or a slow spell brought is lifted after it; 0
        while nothing was measured."""
        configured = self.m.cfg.uplink_bytes_per_s
        if self.rate:
            return int(min(self.rate, configured))
        return int(configured) if self.clear else 0

    def measured(self, rate: float) -> None:
        """The transport's figure for this rank's uplink (Uplink): 0 after a figure means the
        link limits nothing any more."""
        self.clear = not rate and (self.rate > 0 or self.clear)
        self.rate = rate

    def held_rate(self, rank: int) -> float:
        """The uplink the view plans `rank` at (View.planned_uplink); the view's pace while it
        holds no figure at all."""
        view = self.m.view
        return view.planned_uplink(rank) or view.pace or self.m.cfg.uplink_bytes_per_s

    def maybe_ask_pace(self, now: float, out: list[MemberAction]) -> None:
        """Ask the coordinator for a pace round, once a view, if this rank's uplink is far from
        what the view holds for it."""
        m = self.m
        target = self.target_pace()
        held = self.held_rate(m.rank)
        if (not target or m.term.pace_asked or m.state is not MemberState.ACTIVE
                or held / PACE_FACTOR <= target <= held * PACE_FACTOR):
            return
        m.term.pace_asked = True
        coordinator = m.coordinator()
        if coordinator is None or coordinator == m.rank:
            self.pace_wanted[m.rank] = target
            self.maybe_pace_round(now, out)
        else:
            out.append(Send(dst=coordinator, msg=Notice(kind=Kind.PACE, src=m.rank, epoch=m.view.epoch, rate=target)))

    def maybe_pace_round(self, now: float, out: list[MemberAction]) -> None:
        """As coordinator: run a pace round that members asked for, when nothing else is being
        agreed or waits to take effect."""
        for rank, wanted in list(self.pace_wanted.items()):
            held = self.held_rate(rank)
            if held / PACE_FACTOR <= wanted <= held * PACE_FACTOR:
                del self.pace_wanted[rank]  # the view holds a figure near it now (a round since)
        if not self.pace_wanted or self.why_not_now() or self.m.coordinator() != self.m.rank:
            return
        self.pace_wanted.clear()
        self.m.change.start_round(frozenset(), now, out, pace=True)
