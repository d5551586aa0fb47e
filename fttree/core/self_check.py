"""After a freeze, a rank checks that it is still a member before it hands out a result.

A process stopped for longer than its peers wait (SIGSTOP, a paused VM, a machine swapping)
can be evicted while frames of its old view wait in its socket buffers. On resuming it reads
them in whatever order its loop gives, and as the root of a step it can complete the old
view's op with every rank's sum while the group ran that step again without it: its caller
would get a result no other rank holds. An hour of chaos found this (docs/chaos.md).

The freeze shows as the membership's check timer coming late: it is due every quarter node
deadline from this rank's first step on (idle too: a rank stopped between steps finds its
children's sums of the next step waiting), so being more than half a node deadline past it
means the process did not run (`Detector.late_by`). From then on the replica keeps this rank's results
back and this part pings the tree neighbours, each ping carrying a number its answer echoes:

- an answer to this check from a member in the same view and not in a view change confirms
  the rank: the results go out (`Confirmed`);
- a member in a later view that left this rank out answers a ping of an older view with the
  decision (agreement.py `stale_sender`), and the rank stops as any evicted rank does;
- a view change that reaches it while it doubts settles it too: a rank in the decided view is a
  member. It promised (or was told the decision) without counting the results it kept back as
  held, so of those only the steps the view committed go out; the others were voided with
  their ops and run again in the new view (replica.py);
- an answer from a member in a view change, or in a later view, is no answer yet: it is asked
  again every quarter node deadline. With no change under way here, after two node deadlines
  without an answer the rank stops: a rank that cannot tell whether its result is the group's
  gives none, and comes back as an evicted worker does (it restarts and takes the group's
  state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .effects import SetTimer, TimerKey, TimerKind
from .member_events import Confirmed, Doubted, MemberAction, MemberState
from .messages import Detection, Kind

if TYPE_CHECKING:
    from .membership import Membership

#: the check gives up, and the rank stops, this many node deadlines after it began
LIMIT_DEADLINES = 2.0


class SelfCheck:
    """Whether this rank doubts it is still a member, and the pings that settle it."""

    def __init__(self, m: Membership) -> None:
        self.m = m
        self.serial = -1  # the number of the current check: its pings carry it, their answers echo it
        self.since: float | None = None  # when the current check began (None: no doubt)
        self.frozen_s = 0.0  # how long the process did not run, as the check timer saw it
        self.checks_total = 0  # checks begun (status: each is a freeze this rank noticed)
        self.stops_total = 0  # checks that ended in this rank stopping

    @property
    def doubting(self) -> bool:
        return self.since is not None

    def begin(self, frozen_s: float, now: float, out: list[MemberAction]) -> None:
        """The process did not run for `frozen_s`: doubt until a neighbour confirms."""
        if self.since is not None or self.m.state in (MemberState.MINORITY, MemberState.EVICTED):
            return
        self.checks_total += 1
        self.serial += 1
        self.frozen_s = frozen_s
        asked = self._neighbours()
        if not asked:  # nobody could have left this rank out
            out.append(Confirmed(frozen_s=frozen_s, by=-1))
            return
        self.since = now
        out.append(Doubted(frozen_s=frozen_s, asked=asked))
        self._ask(now, out)

    def answered(self, msg: Detection, now: float, out: list[MemberAction]) -> None:
        """A PONG echoing a check's number: from the same view and not in a change, it confirms."""
        view = self.m.view
        if self.since is None or msg.target != self.serial or msg.src not in view:
            return
        if msg.epoch == view.epoch and not msg.gone:
            self.since = None
            out.append(Confirmed(frozen_s=self.frozen_s, by=msg.src))

    def kept(self, out: list[MemberAction]) -> None:
        """A decided view with this rank in it was installed: it is a member."""
        if self.since is not None:
            self.since = None
            out.append(Confirmed(frozen_s=self.frozen_s, by=-1))

    def timer(self, now: float, out: list[MemberAction]) -> None:
        """Ask again, or give up at the limit (not while a view change runs here: its decision
        settles the doubt, and the change has deadlines of its own)."""
        if self.since is None:
            return
        limit = LIMIT_DEADLINES * self.m.node_deadline_s
        if now - self.since >= limit and self.m.state is MemberState.ACTIVE:
            self.stop(f"no neighbour confirmed within {limit:.2f} s that it is still in view "
                      f"{self.m.view.epoch}", out)
            return
        self._ask(now, out)

    def stop(self, why: str, out: list[MemberAction]) -> None:
        """Give up: this rank hands out nothing it completed since the freeze, and stops."""
        if self.since is None:
            return
        self.since = None
        self.stops_total += 1
        self.m.stop(MemberState.EVICTED, f"rank {self.m.rank} did not run for {self.frozen_s:.2f} s and {why}: it "
                                         f"leaves the group rather than hand out a result the group may not hold", out)

    def _neighbours(self) -> tuple[int, ...]:
        """The tree neighbours to ask: members of the view that have not finished their job (a
        finished one may have closed, and would never answer)."""
        view, rank, done = self.m.view, self.m.rank, self.m.joins.done
        return tuple(p for p in self.m.detection.neighbours() if p != rank and p in view and p not in done)

    def _ask(self, now: float, out: list[MemberAction]) -> None:
        m = self.m
        detection = m.detection
        for peer in self._neighbours():
            detection.pinged[peer] = now  # the answer is a round-trip sample like any other
            m.send(peer, Detection(kind=Kind.PING, src=m.rank, epoch=m.view.epoch, step=detection.submitted,
                                   target=self.serial), out)
        out.append(SetTimer(key=TimerKey(TimerKind.MEMBER_DOUBT, -1, 0), at=now + m.node_deadline_s / 4))
