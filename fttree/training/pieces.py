"""Which piece of a training state to take from which donor: a pure planner and ledger.

A joiner takes its state in pieces from several members at once so that each donor's uplink
carries a share, not the whole. This module holds no sockets and no clock of its own (callers
pass `now`), so every decision - the split, who sends what, what a dead, late or lying donor
costs - is tested without processes.

- `Manifest`: the state split into pieces of `piece_bytes`, each with its digest, and the
  whole's digest. Every donor derives the same manifest from the same bytes.
- `Ledger`: the joiner's book of one transfer. `deal` reserves the missing pieces for every
  donor asked, round-robin, each donor taking pieces in proportion to its weight (its uplink),
  starting at an offset derived from the joiner's rank so that several joiners at once begin
  at different donors instead of all pulling piece 0 from the first one. `plan` asks each ready
  donor for a window of its share; a donor whose share is done takes unasked pieces of a ready
  donor's, never of one not yet ready, so every live donor serves a share however late its
  answer comes. `lose` hands a dead donor's missing pieces and share to the others;
  `overdue` names donors whose pieces are late; a piece whose digest is wrong is dropped and
  its donor lost. A piece arrived and checked is never asked for again: a donor dying costs
  the joiner only its missing pieces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

DIGEST_BYTES = 32
PIECE_BYTES = 1 << 20


def piece_digest(data: bytes | bytearray | memoryview) -> str:
    """A piece's digest (blake2b-256, hex), as the whole state's in fttree.training.state."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest()


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a state is, piece by piece: enough for a joiner to check each piece on its own."""

    nbytes: int
    piece_bytes: int
    digests: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be positive, got {self.piece_bytes}")
        if self.nbytes < 0:
            raise ValueError(f"nbytes must not be negative, got {self.nbytes}")
        want = max(1, -(-self.nbytes // self.piece_bytes))
        if len(self.digests) != want:
            raise ValueError(f"a manifest of {self.nbytes} bytes in pieces of {self.piece_bytes} has {want} "
                             f"pieces, got {len(self.digests)} digests")

    @property
    def total(self) -> int:
        return len(self.digests)

    def span(self, piece: int) -> tuple[int, int]:
        """Piece `piece`'s [start, end) in the state's bytes."""
        if not 0 <= piece < self.total:
            raise IndexError(f"piece {piece} is not in 0..{self.total - 1}")
        start = piece * self.piece_bytes
        return start, min(self.nbytes, start + self.piece_bytes)

    def check(self, piece: int, payload: bytes | bytearray | memoryview) -> bool:
        """Whether `payload` is piece `piece`: its length and its digest."""
        if not 0 <= piece < self.total:
            return False
        start, end = self.span(piece)
        return len(payload) == end - start and piece_digest(payload) == self.digests[piece]


def split(data: bytes | bytearray | memoryview, piece_bytes: int = PIECE_BYTES) -> Manifest:
    """The manifest of `data` in pieces of `piece_bytes` (the last may be shorter; an empty
    state is one empty piece)."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    view = memoryview(data)
    total = max(1, -(-len(view) // piece_bytes))
    return Manifest(nbytes=len(view), piece_bytes=piece_bytes,
                    digests=tuple(piece_digest(view[i * piece_bytes:(i + 1) * piece_bytes]) for i in range(total)))


def start_offset(joiner: int, donors: int) -> int:
    """Where in the donor order a joiner starts, so that joiners of consecutive ranks begin at
    different donors."""
    if donors <= 0:
        raise ValueError(f"a plan needs at least one donor, got {donors}")
    return joiner % donors


class Verdict(Enum):
    """What `Ledger.receive` made of a piece."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # already have it: dropped
    NOT_REQUESTED = "not requested"  # not asked of this sender (now): dropped
    BAD_DIGEST = "bad digest"  # asked for, but not the piece: dropped, the sender lost


@dataclass
class Ledger:
    """One transfer's book on the joiner: which pieces it has, which donor owes which, since when."""

    manifest: Manifest
    joiner: int
    have: dict[int, bytes] = field(default_factory=dict)
    owed: dict[int, int] = field(default_factory=dict)  # piece -> the donor asked for it
    asked_at: dict[int, float] = field(default_factory=dict)  # donor -> when it was last asked
    lost: set[int] = field(default_factory=set)  # donors no longer asked (dead, late, lying)
    share: dict[int, list[int]] = field(default_factory=dict)  # donor -> pieces dealt to it, not yet asked
    refetched: int = 0  # pieces asked of a second donor because the first did not deliver

    @property
    def done(self) -> bool:
        return len(self.have) == self.manifest.total

    def missing(self) -> list[int]:
        """Pieces not yet received, in order."""
        return [i for i in range(self.manifest.total) if i not in self.have]

    def unassigned(self) -> list[int]:
        """Missing pieces no live donor owes."""
        return [i for i in self.missing() if i not in self.owed]

    def owed_by(self, donor: int) -> list[int]:
        return sorted(p for p, d in self.owed.items() if d == donor)

    def reserved(self) -> set[int]:
        """Pieces dealt to a donor's share and not yet asked of it."""
        return {p for ps in self.share.values() for p in ps}

    def deal(self, donors: Sequence[int], weights: Mapping[int, float] | None = None) -> dict[int, list[int]]:
        """Reserve every missing piece that no donor owes or holds in its share for the live
        donors of `donors`: round-robin weighted by `weights` (default 1 each), beginning at the
        joiner's offset. A share is asked of its donor as its window allows (`plan`); only a
        donor that is ready (`plan`'s donors) gives up unasked pieces of its share to a faster
        one, so every donor dealt a share delivers at least its first window unless it is lost.
        Returns donor -> the pieces newly dealt to it."""
        live = [d for d in dict.fromkeys(donors) if d not in self.lost and d != self.joiner]
        held = self.reserved()
        pieces = [p for p in self.unassigned() if p not in held]
        if not pieces:
            return {}
        if not live:
            raise ValueError(f"rank {self.joiner} has {len(pieces)} pieces to fetch and no live donor "
                             f"(lost: {sorted(self.lost)})")
        w = {d: float((weights or {}).get(d, 1.0)) for d in live}
        bad = [d for d, x in w.items() if not x > 0]
        if bad:
            raise ValueError(f"donor weights must be positive, got {[(d, w[d]) for d in bad]}")
        first = start_offset(self.joiner, len(live))
        order = live[first:] + live[:first]
        # smooth weighted round-robin: each turn every donor gains its weight, the richest takes
        credit = dict.fromkeys(order, 0.0)
        total = sum(w.values())
        dealt: dict[int, list[int]] = {}
        for piece in pieces:
            for d in order:
                credit[d] += w[d]
            donor = max(order, key=lambda d: credit[d])  # ties: the first in the joiner's order
            credit[donor] -= total
            dealt.setdefault(donor, []).append(piece)
            self.share.setdefault(donor, []).append(piece)
        return dealt

    def plan(self, donors: Sequence[int], now: float, weights: Mapping[int, float] | None = None,
             limit: int | None = None) -> dict[int, list[int]]:
        """Ask the ready donors `donors` for pieces: first deal any piece nobody owes or holds
        in a share among them (`deal`), then fill each one's window of `limit` pieces owed at
        once (None: all of its share now) from its own share and, once that is empty, from the back
        of the largest share of another ready donor. A window keeps a fast donor asking for more
        sooner. Returns donor -> the pieces newly asked of it (to send as requests)."""
        if limit is not None and limit <= 0:
            raise ValueError(f"a plan's limit must be positive, got {limit}")
        self.deal(donors, weights)
        ready = [d for d in dict.fromkeys(donors) if d not in self.lost and d != self.joiner]
        if ready:
            first = start_offset(self.joiner, len(ready))
            ready = ready[first:] + ready[:first]
        asked: dict[int, list[int]] = {}

        def ask(donor: int, piece: int) -> None:
            self.owed[piece] = donor
            asked.setdefault(donor, []).append(piece)

        for donor in ready:  # each from its own share first...
            own = self.share.get(donor, [])
            room = len(own) if limit is None else limit - len(self.owed_by(donor))
            while room > 0 and own:
                ask(donor, own.pop(0))
                room -= 1
        if limit is not None:  # ...then a ready one with room left takes from the largest ready share
            for donor in ready:
                room = limit - len(self.owed_by(donor))
                while room > 0:
                    victims = [d for d in ready if d != donor and self.share.get(d)]
                    if not victims:
                        break
                    ask(donor, self.share[max(victims, key=lambda d: len(self.share[d]))].pop())
                    room -= 1
        for donor in asked:
            self.asked_at[donor] = now
        return asked

    def receive(self, src: int, piece: int, payload: bytes | bytearray | memoryview) -> Verdict:
        """Book a piece from `src`. Only a piece asked of `src` is kept, and only if it is the
        manifest's; a wrong one loses `src` and frees its pieces for `plan`."""
        if piece in self.have:
            return Verdict.DUPLICATE
        if self.owed.get(piece) != src:
            return Verdict.NOT_REQUESTED
        if not self.manifest.check(piece, payload):
            self.lose(src)
            return Verdict.BAD_DIGEST
        self.have[piece] = bytes(payload)
        del self.owed[piece]
        return Verdict.ACCEPTED

    def lose(self, donor: int) -> list[int]:
        """`donor` is dead, gone, late or lying: ask it nothing more; the pieces it owes and its
        unasked share become unassigned (the next `plan` deals them to the others). Returns the
        pieces it owed (asked again elsewhere: `refetched`)."""
        self.lost.add(donor)
        freed = self.owed_by(donor)
        for piece in freed:
            del self.owed[piece]
        self.share.pop(donor, None)  # never asked: dealt again, not refetched
        self.refetched += len(freed)
        self.asked_at.pop(donor, None)
        return freed

    def progress(self, donor: int, now: float) -> None:
        """`donor` delivered something: its deadline starts again from `now`."""
        if donor in self.asked_at:
            self.asked_at[donor] = now

    def overdue(self, now: float, wait_s: float) -> list[int]:
        """Donors that owe pieces and delivered none for `wait_s`."""
        return sorted(d for d, at in self.asked_at.items() if now - at > wait_s and self.owed_by(d))

    def assemble(self) -> bytes:
        """The whole state, once `done`."""
        if not self.done:
            raise ValueError(f"rank {self.joiner}: the state is missing pieces {self.missing()[:8]} "
                             f"({len(self.missing())} of {self.manifest.total})")
        return b"".join(self.have[i] for i in range(self.manifest.total))

