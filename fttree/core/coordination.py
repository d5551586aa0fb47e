"""Who coordinates, and whose ballot a ballot is. One rule for every decision that needs one rank
to act (a view change, a join, a pace round), so that every member that knows the same names the
same rank; a ballot carries its coordinator's slot, so any member can tell who may commit it."""

from __future__ import annotations

from collections.abc import Collection, Sequence

SLOTS = 1 << 16  # ballot = round * SLOTS + (SLOTS - 1 - the coordinator's slot): later rounds, then earlier slots win


def coordinator(members: Sequence[int], passed_over: Collection[int] = ()) -> int | None:
    """Who coordinates: the member in the lowest slot that is not passed over. What is passed
    over depends on the decision: the confirmed dead for a view change (so the next live rank
    takes over when the coordinator dies), the ranks leaving for joins (a leaving coordinator
    would admit a rank into a view it is about to leave), nobody for a pace round. None: every
    member is passed over. One rule, so every member that knows the same names the same rank."""
    return next((r for r in members if r not in passed_over), None)


def ballot_of(round_: int, slot: int) -> int:
    """The ballot of round `round_` run by the member in `slot`."""
    return round_ * SLOTS + (SLOTS - 1 - slot)


def round_of(ballot: int) -> int:
    """The round a ballot is of (the epochs a value of this ballot moves the view on by)."""
    return ballot // SLOTS


def ballot_owner(members: Sequence[int], ballot: int) -> int | None:
    """The member whose ballots `ballot` is of (its slot is in the ballot); None for no ballot."""
    if ballot <= 0:
        return None
    slot = SLOTS - 1 - ballot % SLOTS
    return members[slot] if slot < len(members) else None
