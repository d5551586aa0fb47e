"""What a node counts and logs of what happens to it: the replica's notes, and frames dropped
because their sender may not send them. Both are counted always and logged within bounds, so a
peer that floods the node with bad frames cannot flood its log."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from ..core.effects import Note, NoteKind
from ..core.messages import Frame, Kind, Sender
from ..core.roles import RoleRule

log = logging.getLogger("fttree.net.node")

_LOGGED = (NoteKind.RECOVERY, NoteKind.TIMEOUT, NoteKind.PROTOCOL, NoteKind.LINK, NoteKind.NONFINITE)
PROTOCOL_NOTES_LOGGED = 20  # protocol violations logged one by one; later ones are counted
FOREIGN_SENDERS_LOGGED = 64  # senders of foreign frames named in the log; later ones are counted


class NoteLog:
    """The replica's notes: counted by kind, logged (protocol violations up to a bound), and
    handed to listeners (status pages, tests)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.counts: Counter[NoteKind] = Counter()
        self.listeners: list[Callable[[Note], None]] = []

    def record(self, note: Note) -> None:
        self.counts[note.kind] += 1
        count = self.counts[note.kind]
        if note.kind is NoteKind.PROTOCOL and count > PROTOCOL_NOTES_LOGGED:
            pass  # a peer that breaks the protocol in a flood must not flood the log: counted only
        elif note.kind in _LOGGED:
            last = note.kind is NoteKind.PROTOCOL and count == PROTOCOL_NOTES_LOGGED
            log.info("rank %d: %s%s", self.rank, note.text,
                     " (further protocol violations are counted, not logged)" if last else "")
        for listener in self.listeners:
            listener(note)


class ForeignLog:
    """Frames dropped because their sender may not send them (messages.SENDER_RULES, and for a
    step's frame its sender's role in the frame's tree, roles.ROLE_RULES): counted, and logged
    once per sender."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.count = 0
        self.by_role: Counter[Kind] = Counter()  # of those, step frames whose sender had another role in their tree
        self._logged: set[int] = set()

    def dropped(self, msg: Frame, rule: Sender | RoleRule) -> None:
        self.count += 1
        if isinstance(rule, RoleRule):
            self.by_role[msg.kind] += 1
        if msg.src not in self._logged and len(self._logged) < FOREIGN_SENDERS_LOGGED:
            self._logged.add(msg.src)
            log.warning("rank %d: dropped %s from rank %d, which may not send it (%s); further frames of that "
                        "rank are dropped and counted, not logged", self.rank, msg.kind.name, msg.src,
                        rule.value if isinstance(rule, Sender) else f"in the frame's tree only {rule.text} may")
