"""Link memory and probes: which of this rank's uplinks are known bad, and probing them back into use.

A rank whose subtree sum needed a relay while its result came around too, or whose connection
to its parent was refused or reset, marks that uplink failed: later steps send their sums
straight to both backup nodes and pay no timeout. A PROBE goes to the parent every
probe_interval_s; a link that answers them for its hold (heal_after_s, doubled at each new
failure up to max_heal_after_s, so a flapping link is damped) is back in use. Each tree has
its own uplink and children (trees.py), so each `Tree` keeps its own memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .effects import Action, Cause, Note, Send, SetTimer, TimerKey, TimerKind
from .machine_base import MachineBase
from .machine_status import TreeStatus, UplinkStatus
from .messages import Kind, Message
from .roles import Role, roles_of
from .topology import Neighbours
from .view import View


@dataclass(slots=True)


class UpLink:
    """What this rank remembers about its primary link to its parent."""

    failed: bool = False
    relays: tuple[int, ...] = ()  # backup nodes that relay for us while the link is failed
    failures: int = 0  # times it was marked failed: damps a flapping link
    probe_sent_at: float | None = None  # an unanswered probe
    healthy_since: float | None = None  # first of an unbroken run of answered probes

    @property
    def via(self) -> str:
        return " and ".join(str(r) for r in self.relays)


@dataclass(slots=True)


class Tree:
    """This rank's place in one tree (tree 0: the heap over the view's slot order; the others
    over other orders, trees.py) and what it remembers about that tree's links: the uplink
    differs per tree, so does its link memory."""

    tree: int
    view: View  # the view whose heap is this tree
    me: Neighbours
    subtrees: dict[int, frozenset[int]]  # child -> every rank of its subtree
    roles: dict[int, Role]  # neighbour -> who it is to this rank here (roles.py checks each frame's sender by it)
    up: UpLink = field(default_factory=UpLink)
    down_failed: set[int] = field(default_factory=set)  # children whose link to us is known broken

    @classmethod
    def build(cls, family: str, tree: int, view: View, rank: int) -> Tree:
        heap = view.tree(tree, family)
        me = heap.neighbours(rank)
        return cls(tree=tree, view=heap, me=me, subtrees={c: heap.subtree(c) for c in me.children},
                   roles=roles_of(me))

    @property
    def label(self) -> str:
        """For notes: which tree, when it is not tree 0."""
        return f" (tree {self.tree})" if self.tree else ""


class LinkMemory(MachineBase):
    """A part of TreeMachine (protocol.py), which mixes it in: no state of its own."""

    def _tree_status(self, t: Tree) -> TreeStatus:
        up = t.up
        return TreeStatus(
            tree=t.tree, neighbours=t.me, relayed_children=tuple(sorted(t.down_failed)),
            uplink=UplinkStatus(parent=t.me.parent, failed=up.failed, relays=up.relays, failures=up.failures,
                                probing=up.failed and up.healthy_since is not None, hold_s=self._heal_hold_s(t)))

    def _heal_hold_s(self, t: Tree) -> float:
        return float(min(self.cfg.heal_after_s * 2.0 ** max(0, t.up.failures - 1), self.cfg.max_heal_after_s))

    def _mark_up_failed(self, t: Tree, why: str, now: float, out: list[Action]) -> None:
        parent = t.me.parent
        if not self._ft or not self.cfg.link_memory or parent is None:
            return
        if t.up.failed:
            t.up.healthy_since = None  # still failing: the healthy run starts over
            return
        relays = tuple(r for r in (t.me.brother, t.me.uncle) if r is not None)
        if not relays:
            return
        t.up = UpLink(failed=True, relays=relays, failures=t.up.failures + 1)
        out.append(Note(step=self._max_step_submitted, cause=Cause.LINK_MARKED_FAILED, peer=parent,
                        link=(self.rank, parent),
                        text=f"link {self.rank}->{parent} marked failed ({why}); routing through "
                             f"rank {t.up.via} "
                             f"until it answers probes for {self._heal_hold_s(t):g} s{t.label}"))
        out.append(SetTimer(key=self._probe_key(t), at=now + self.cfg.probe_interval_s))

    def _probe_key(self, t: Tree) -> TimerKey:
        """The probe timer of tree `t`'s uplink (`chunk` holds the tree: the uplinks differ)."""
        return TimerKey(TimerKind.PROBE, -1, t.tree, -1 if t.me.parent is None else t.me.parent)

    def _probe(self, t: Tree, now: float, out: list[Action]) -> None:
        parent = t.me.parent
        if not t.up.failed or parent is None:
            return
        if t.up.probe_sent_at is not None:  # the last probe got no answer
            t.up.healthy_since = None
        t.up.probe_sent_at = now
        step = max(self._max_step_submitted, 0)  # so step-windowed faults apply to probes too
        out.append(Send(dst=parent, msg=Message(kind=Kind.PROBE, src=self.rank, epoch=self.view.epoch, step=step,
                                                tree=t.tree)))
        out.append(SetTimer(key=self._probe_key(t), at=now + self.cfg.probe_interval_s))

    def _on_probe_ack(self, t: Tree, now: float, out: list[Action]) -> None:
        if not t.up.failed:
            return
        t.up.probe_sent_at = None
        if t.up.healthy_since is None:
            t.up.healthy_since = now
        elif now - t.up.healthy_since >= self._heal_hold_s(t):
            held = now - t.up.healthy_since
            t.up = UpLink(failures=t.up.failures)
            parent = t.me.parent
            out.append(Note(step=self._max_step_submitted, cause=Cause.LINK_BACK_IN_USE,
                            peer=-1 if parent is None else parent, link=None if parent is None else (self.rank, parent),
                            text=f"link {self.rank}->{parent} answered probes for {held:.2f} s: "
                                 f"back in use{t.label}"))

    def _on_link_down(self, peer: int, reason: str, now: float, out: list[Action]) -> None:
        """A refused or reset connection: act now instead of waiting for a watch to expire."""
        if not self._ft:
            return
        for t in self.trees:  # the peer may be a neighbour in several
            self._link_down_in(t, peer, reason, now, out)

    def _link_down_in(self, t: Tree, peer: int, reason: str, now: float, out: list[Action]) -> None:
        if peer in t.me.children:
            t.down_failed.add(peer)
            return
        if peer != t.me.parent:
            return
        relays = [r for r in (t.me.brother, t.me.uncle) if r is not None]
        if not relays:
            return
        self._mark_up_failed(t, f"connection to rank {peer} failed: {reason}", now, out)
        for op in self._ops.values():
            red = op.reduce
            if op.tree == t.tree and red.sent and op.bcast.result is None and not op.done and not red.rerouted \
                    and red.acc is not None:
                op.reduce.rerouted = True
                for relay in relays:
                    out.append(Send(dst=relay, msg=self._data_msg(op, Kind.DATA_REDUCE_REQUEST, self._acc_wire(op),
                                                                  tuple(sorted(op.reduce.contributors)),
                                                                  origin=self.rank, target=peer)))
