"""Admission: the join handshake's decisions, on both sides, without I/O.

A process that starts asks every peer whether a group already runs (JOIN, `Query.IS_RUNNING`).
A member answers RUNNING when the asker cannot be one of the first start: a new process of a
rank it knew (its incarnation changed), a rank that asks after steps were done, or one outside
the view; otherwise STARTING. A process that found a group, or was told to join, asks to be let
in (`Query.ADMIT_ME`, or a member passes that on as JOIN_ASK); the membership decides the join
(membership.py) and the new members answer ADMITTED with the view and the step it starts at.

`Admission` keeps what those answers rest on: which process each rank is (`incarnations`),
which process asks to become a rank (`candidates`), and, on the asking side, the group found
and the peers that said they are starting too. The replica (replica.py) owns it and turns its
answers into `Reply`, `LearnAddress`, `Answered` and `Joined` actions for the driver.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .messages import Answer as Answer
from .messages import Query as Query
from .view import View


class Handshake:
    """An action of the join handshake, for the driver's asker (net/joining.py) to carry out."""

    __slots__ = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply(Handshake):
    """Send `dst` a JOIN_REPLY: `answer`, about `view` (with its members' addresses)."""

    dst: int
    answer: Answer
    view: View
    first_step: int = -1  # ADMITTED: the allreduce step the joiner takes part from
    user_step: int = -1  # ADMITTED: the training step that is


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnAddress(Handshake):
    """Rank `rank` listens at `address` ("host:port", as the peer sent it)."""

    rank: int
    address: str


@dataclass(frozen=True, slots=True)
class Answered(Handshake):
    """An answer came: a start or an admission waiting for one looks again now."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Joined(Handshake):
    """This process was admitted: it takes part from allreduce step `first_step`, which is
    training step `user_step`."""

    first_step: int
    user_step: int


#: how many processes a member keeps asking to become ranks at once (proven by the job's key,
#: so this bounds mistakes, not strangers)
MAX_CANDIDATES = 1024


class Admission:
    """Who each rank is and who asks to join; on the asking side, what the peers answered."""

    __slots__ = ("candidates", "group", "incarnations", "starting")

    def __init__(self) -> None:
        self.incarnations: dict[int, int] = {}  # rank -> the process we take to be that rank
        self.candidates: dict[int, int] = {}  # rank -> the process that asked to join as it
        self.group: tuple[int, tuple[int, ...]] | None = None  # (epoch, members) of a running group found
        self.starting: set[int] = set()  # peers that said they are starting up too

    # ---- a member's side ---------------------------------------------------------------------

    def answer(self, rank: int, incarnation: int, *, view: View, began: bool, stopped: bool) -> Answer:
        """Process `incarnation` of `rank` asks whether a group runs. `began`: steps were done
        or views changed here, so this is not the first start any more."""
        known = self.incarnations.get(rank)
        if known is None and not began:
            self.incarnations[rank] = incarnation  # a peer of the first start
        restarted = known is not None and known != incarnation
        late = known is None and began
        running = not stopped and (restarted or late or rank not in view)
        return Answer.RUNNING if running else Answer.STARTING

    def request(self, rank: int, incarnation: int, view: View) -> bool:
        """Process `incarnation` asks to be admitted as `rank`: should the membership hear of
        it? Not when it is a member's own late or repeated request (it is in already). A new
        process of a member asks again until admitted: each ask goes on (the membership keeps
        one waiting join per rank), as the first may have found no coordinator to keep it."""
        if rank in view and self.incarnations.get(rank) in (None, incarnation):
            return False
        if rank not in self.candidates and len(self.candidates) >= MAX_CANDIDATES:
            return False
        self.candidates[rank] = incarnation
        return True

    def admitted(self, joined: Iterable[int]) -> None:
        """A join of `joined` was decided: those processes are those ranks now, and their
        repeated asks are not a restart."""
        for rank in joined:
            if rank in self.candidates:
                self.incarnations[rank] = self.candidates.pop(rank)

    # ---- the asking side ---------------------------------------------------------------------

    def heard(self, rank: int, answer: Answer, epoch: int, members: tuple[int, ...], *, starting: bool) -> None:
        """`rank` answered a start's or a joiner's question (`starting`: still asking whether a
        group runs, not yet asking to be admitted)."""
        if answer is Answer.STARTING:
            if starting:
                self.starting.add(rank)
        elif answer is Answer.RUNNING and (self.group is None or not starting):
            self.group = (epoch, members)

    def start_settled(self, peers: Iterable[int], *, waited_s: float, grace_s: float) -> bool:
        """Has a start heard enough to decide between joining a running group and the first
        start? A running group answers; once a majority of the world said "starting" for
        `grace_s`, a peer that stays silent (its link cut, or it starts late) cannot be one."""
        world = list(peers)
        if self.group is not None or set(world) <= self.starting:
            return True
        majority = 2 * (len(self.starting & set(world)) + 1) > len(world) + 1
        return majority and waited_s >= grace_s

    def asked(self) -> tuple[int, ...]:
        """The members of the group found (whom a joiner asks), or none yet."""
        return () if self.group is None else self.group[1]
