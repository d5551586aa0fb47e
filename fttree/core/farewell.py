"""Farewell: when a finished rank may close. A rank whose job is over says so (DONE, with its
last step) and stays until every member is done too or has an outcome of that step (DONE_ACK):
a slower peer may still need its relay or result. The peers answer once they have that outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Farewell:
    """Which finished peers this rank owes a DONE_ACK, and which peers have acknowledged its own
    last step. Keyed by member rank: bounded by the group's size."""

    __slots__ = ("acked", "owed")

    def __init__(self) -> None:
        self.owed: dict[int, int] = {}  # a finished peer -> its last step, which we still run
        self.acked: dict[int, int] = {}  # peer -> the newest step it says it has an outcome of

    def peer_done(self, peer: int, step: int) -> None:
        self.owed[peer] = step

    def peer_has(self, peer: int, step: int) -> None:
        self.acked[peer] = max(self.acked.get(peer, -1), step)

    def due(self, *, last_submitted: int, pending: Callable[[int], bool], stopped: bool) -> list[tuple[int, int]]:
        """The (peer, step) acknowledgements to send now: we have an outcome of the peer's last
        step (it is submitted here and no longer `pending`), or we stopped and never will."""
        ready = [(peer, step) for peer, step in self.owed.items()
                 if stopped or (step <= last_submitted and not pending(step))]
        for peer, _ in ready:
            del self.owed[peer]
        return ready

    def waiting_for(self, members: Iterable[int], *, me: int, done: Iterable[int], last: int) -> list[int]:
        """Members that may still need this rank for its step `last`: not finished themselves,
        and without an outcome of that step yet."""
        finished = set(done)
        return [r for r in members if r != me and r not in finished and self.acked.get(r, -1) < last]
