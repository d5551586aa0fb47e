"""A node's status, frozen at one moment: what status pages, metrics and tests read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.effects import NoteKind
from ..core.machine_status import MachineStatus
from ..core.member_events import MemberStatus
from .transport import TransportStatus

if TYPE_CHECKING:
    from .node import Node


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStatus:
    """Everything status pages need about a node, frozen at one moment (see fttree.status)."""

    rank: int
    machine: MachineStatus
    membership: MemberStatus
    transport: TransportStatus
    steps_in_flight: tuple[int, ...]
    last_steps: tuple[tuple[int, float], ...]  # (step, duration_s), oldest first
    note_counts: dict[NoteKind, int]
    reruns: int  # steps run again in a new view after a node failure
    foreign_frames: int = 0  # frames dropped because their sender may not send them (SENDER_RULES)
    late_streak: dict[int, int] = field(default_factory=dict)  # member -> steps in a row it was late in
    late_total: dict[int, int] = field(default_factory=dict)  # member -> steps it was late in
    empty_sums: int = 0  # subtree sums that named no contributor: nothing of them added
    early_dropped: int = 0  # data frames for steps not submitted here yet, dropped for want of room
    early_dropped_bytes: int = 0
    ops_refused: int = 0  # step frames dropped: over their sender's share (ops, later views' frames), or a cut not ours


def node_status(node: Node) -> NodeStatus:
    """`node`'s status now (read on its loop)."""
    replica, steps = node.replica, node.steps
    return NodeStatus(rank=node.rank, machine=node.machine.status(), membership=node.membership.status(),
                      transport=node.transport.status(), steps_in_flight=tuple(node.active_steps()),
                      last_steps=tuple(node.step_durations), note_counts=dict(node.note_counts),
                      reruns=node.reruns, foreign_frames=node.foreign_frames,
                      late_streak=dict(steps.late_streak), late_total=dict(steps.late_total),
                      empty_sums=node.machine.empty_sums, early_dropped=replica.early_dropped,
                      early_dropped_bytes=replica.early_dropped_bytes,
                      ops_refused=node.machine.ops_refused)
