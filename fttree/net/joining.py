"""How a process finds its group and asks to be admitted: polls on timers, not awaits, so the
simulator runs them as the real loop does. The answers are the replica's to judge
(core/admission.py); this module only asks again, and says when it is over."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

from ..core.admission import Answer, Answered, Handshake, Joined, LearnAddress, Query, Reply
from ..core.config import Config
from ..core.messages import Join, Kind
from ..core.replica import FirstStart, GroupFound, Replica, ReplicaEvent, Stop
from ..errors import ConfigError, PeerError
from . import handshake as hs
from .address import parse_address
from .scheduler import Handle, Scheduler
from .transport import Transport

log = logging.getLogger("fttree.net.node")

CONTACT = hs.CONTACT  # the transport's key for a joiner's contact, whose rank it does not know yet
FIND_POLL_S = 0.25  # a starting process asks its peers again this often whether a group runs
FIND_GRACE_S = 2.0  # a start that a majority answered "starting too" waits this long for the rest
ADMIT_POLL_S = 0.5  # a joiner asks again this often to be admitted


class Asker:
    """One process's questions to its peers before it takes part. It reads the answers in the
    replica; what it settles goes back to the replica through `tell` (the node's entrance)."""

    def __init__(self, rank: int, config: Config, transport: Transport, scheduler: Scheduler,
                 replica: Replica, *, tell: Callable[[ReplicaEvent], None], incarnation: int,
                 contact: bool) -> None:
        self.rank = rank
        self.cfg = config
        self.transport = transport
        self.scheduler = scheduler
        self.replica = replica
        self._tell = tell
        self.incarnation = incarnation
        self.contact = contact  # a member's address was given to ask first (a joiner knowing no rank)
        self.joined_at: tuple[int, int] | None = None  # (first allreduce step, first training step)
        self._on_answer: Callable[[], None] | None = None  # the running procedure's next look
        self._timer: Handle | None = None

    def query(self, code: Query, ranks: Iterable[int]) -> None:
        msg = Join(kind=Kind.JOIN, src=self.rank, query=code, incarnation=self.incarnation,
                      addresses=((self.rank, self.transport.status().address),))
        for r in ranks:
            if r != self.rank:
                self.transport.send(r, msg)

    def find_group(self, end: float, done: Callable[[bool], None]) -> None:
        """Ask every peer whether a group is already running (this process is a restart, or
        came late), again every FIND_POLL_S: `done(True)` once one says so, `done(False)` once
        all say they are starting up too, or at `end`."""
        replica = self.replica
        peers = [r for r in replica.view.members if r != self.rank]
        since = self.scheduler.now()

        def settled() -> bool:
            now = self.scheduler.now()
            return now >= end or replica.admission.start_settled(peers, waited_s=now - since, grace_s=FIND_GRACE_S)

        def check() -> None:  # after every answer
            if settled():
                self.stop()
                running = replica.admission.group is not None
                self._tell(GroupFound() if running else FirstStart())
                done(running)

        def ask() -> None:
            if settled():
                check()
                return
            self.query(Query.IS_RUNNING, (r for r in peers if r not in replica.admission.starting))
            self._timer = self.scheduler.call_later(FIND_POLL_S, ask)

        self._on_answer = check
        ask()

    def ask_admission(self, end: float, done: Callable[[PeerError | None], None]) -> None:
        """Ask the members to admit this rank (again every ADMIT_POLL_S, and at once after an
        answer that brings news: the group found or changed, or the admission) until one says
        from which step: then `done(None)`; at `end`, `done` with the error that names whom it
        asked. Asking again after every answer, news or not, cost p(p - 1) JOIN frames per
        restart: each of the p - 1 answers to a question asked of all made it ask all again
        (16,002 at 127 simulated ranks, about a million at 1,023)."""
        asked_of: list[tuple[int, tuple[int, ...]] | None] = [None]  # the group the last question went to

        def news() -> None:
            if self.joined_at is not None or self.replica.admission.group != asked_of[0]:
                ask()

        def ask() -> None:
            if self.joined_at is not None:
                self.stop()
                log.info("rank %d joined view %d from step %d (training step %d)", self.rank,
                         self.replica.view.epoch, *self.joined_at)
                done(None)
                return
            if self.scheduler.now() >= end:
                self.stop()
                self._tell(Stop())
                asked = list(self.replica.admission.asked())
                done(PeerError(f"rank {self.rank} was not admitted to the running group within "
                               f"{self.cfg.startup_timeout_s:g} s (asked ranks {asked})", peers=tuple(asked)))
                return
            asked_of[0] = self.replica.admission.group
            if asked_of[0] is None:  # find the group first: through the contact, or any rank
                self.query(Query.IS_RUNNING, [CONTACT] if self.contact else self.replica.view.members)
            else:
                self.query(Query.ADMIT_ME, self.replica.admission.asked())
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.scheduler.call_later(ADMIT_POLL_S, ask)

        self._on_answer = news
        ask()

    def carry(self, action: Handshake) -> None:
        """Carry out the replica's handshake actions (core/admission.py)."""
        match action:
            case Reply():
                send_reply(self.rank, action, self.transport)
            case LearnAddress(rank=rank, address=address) if rank != self.rank:
                with contextlib.suppress(ValueError, ConfigError):
                    self.transport.add_peer(rank, parse_address(address))
            case Joined(first_step=first_step, user_step=user_step):
                self.joined_at = (first_step, user_step)
            case Answered():
                self.answered()

    def answered(self) -> None:
        """An answer came: whoever asks looks again now."""
        if self._on_answer is not None:
            self._on_answer()

    def stop(self) -> None:
        self._on_answer = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def send_reply(rank: int, reply: Reply, transport: Transport) -> None:
    """A member's JOIN_REPLY; RUNNING and ADMITTED name the view's members and where they listen
    (as far as this rank knows). STARTING names nobody: at a first start every rank answers
    every other, again every poll, and p answers of p addresses each would be p^2 per poll."""
    view = reply.view
    members = () if reply.answer is Answer.STARTING else view.members
    addresses = tuple((r, a) for r in members if (a := transport.address_of(r)))
    transport.send(reply.dst, Join(kind=Kind.JOIN_REPLY, src=rank, answer=reply.answer, epoch=view.epoch,
                                   members=members, step=reply.first_step, user_step=reply.user_step,
                                   pace=view.pace, uplinks=view.uplinks, addresses=addresses))
