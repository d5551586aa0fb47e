"""The tree machine's public state (TreeMachine.status): what status pages read, never the
machine's private fields."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .topology import Neighbours
from .view import View


class OpPhase(Enum):
    WAITING = "waiting"  # peers' messages arrived; not submitted here yet
    REDUCE = "reduce"  # waiting for children's subtree sums, or sending ours up
    BROADCAST = "broadcast"  # our sum is sent; waiting for the result
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)


class OpStatus:
    step: int
    chunk: int
    phase: OpPhase
    contributors: tuple[int, ...]  # summed here so far
    waiting_for: tuple[int, ...]  # children whose subtree sums have not arrived


@dataclass(frozen=True, slots=True, kw_only=True)


class UplinkStatus:
    """Link memory about this rank's link to its parent."""

    parent: int | None
    failed: bool  # later steps go around it, through `relays`
    relays: tuple[int, ...]
    failures: int  # times it was marked failed (each doubles the hold before reuse)
    probing: bool  # failed, and probes are answered again: waiting `hold_s` to trust it
    hold_s: float


@dataclass(frozen=True, slots=True, kw_only=True)


class TreeStatus:
    """This rank's place in one tree and what link memory holds about that tree's links (the
    uplink and the children differ from tree to tree, trees.py)."""

    tree: int
    neighbours: Neighbours
    uplink: UplinkStatus
    relayed_children: tuple[int, ...]  # children whose data last came around a broken link


@dataclass(frozen=True, slots=True, kw_only=True)


class MachineStatus:
    rank: int
    view: View
    ops: tuple[OpStatus, ...]  # the ops not finished here, oldest first
    trees: tuple[TreeStatus, ...]  # every tree of Config.trees over the view, tree 0 first
    footprint: dict[str, int]

    @property
    def tree0(self) -> TreeStatus:
        """Tree 0: every step of one chunk runs on it (small tensors only ever use it)."""
        return self.trees[0]
