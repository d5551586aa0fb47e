"""TreeMachine: the fault-tolerant tree allreduce as a pure state machine.

``TreeMachine.handle(event, now) -> list[Action]``. No sockets, threads, clocks or sleeps in
here: time comes in as `now`, timers go out as SetTimer/CancelTimer and come back as
TimerFired. The asyncio node (node.py) and the simulator (testing.py) drive the same code.

The algorithm (seed thesis, chapter 6, Algorithms 1 and 2)
----------------------------------------------------------
Ranks form a binary heap rooted at 0. Each collective op (a step, or one chunk of a step) is a
reduce up the tree and a broadcast down it.

Reduce. A node adds its children's subtree sums into its own contribution; once every child is
in, it sends DATA_REDUCE to its parent and META_REDUCE_SENT(target=parent) to its *brother* and
*uncle*. Those two are exactly the parent's other child and the parent's brother, so they also
hear the parent's META_REDUCE_RECEIVED(origin) when the data lands. An observer that heard
"sent" but not "received" within the timeout asks the origin (META_REDUCE_REQUEST), gets the
data back (DATA_REDUCE_REQUEST) and relays it to the parent as DATA_REDUCE with the same origin.

Broadcast. The root's sum is the result. A node holding the result sends DATA_BCAST to each
child, META_BCAST_SENT(child) to that child's brother and uncle, and META_BCAST_RECEIVED to its
own brother and uncle. An observer that heard "sent to k" but not "k received" within the
timeout sends the result to k itself. Beyond the thesis: an observer that relayed k's reduce
data already knows k's primary link is broken, so it pushes the result to k the moment it has
it instead of waiting a second timeout (the thesis pays ~2.4-2.9 timeouts per fault; this pays
about one).

Exactly-once. A DATA_REDUCE is identified by (step, chunk, origin) and the receiving parent
keeps the set of origins it has added; a second copy (a relay racing the original, a duplicate,
a late delivery after a link heals) is dropped before it touches the sum. Each subtree sum
carries the ranks it contains, checked to lie inside the origin's subtree and to be disjoint
from what is already summed, so even a protocol bug cannot count a rank twice silently. The
result is taken once (first DATA_BCAST wins). Messages of retired ops are dropped, never mixed
into a new op; messages of ops not yet submitted locally are kept until the submit.

Several trees (Config.trees, trees.py). A step of two or more chunks spreads them over
several heaps of the same members, so no rank carries the 3N bytes of a single tree's interior:
with the default "rotated" family, p trees whose busiest rank sends about the ring's 2N(p-1)/p.
A one-chunk step has only chunk 0 and runs on tree 0 exactly as the single tree. Each tree has
its own neighbours, subtrees, link memory and broken-child set (`_Tree`); an op runs on one
tree, and everything above (observers, relays, pushes, exactly-once) happens in that tree.
Frames carry the tree id and the step's chunk count, and the tree is checked against the rule:
workers that differ in `trees` fail the op as a mismatch.

Failures are data. A step that cannot finish ends by a deadline: the root gives up after
`root_timeout_s` and floods ABORT naming the ranks whose contributions never arrived; every
other node fails at `step_timeout_s` naming what it was waiting for. Tensors of different
shape or dtype across workers abort the step everywhere with both signatures in the reason.

Ordering of emitted actions: sends of data come before the metadata announcing them, so an
observer never hears "sent" for data that is not yet on the wire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from .buffers import BufferPool
from .config import Config
from .effects import (
    AbortCode,
    Action,
    CancelTimer,
    Cause,
    Complete,
    Fail,
    LinkState,
    Note,
    Send,
    SetTimer,
    TimerKey,
    TimerKind,
    Void,
)
from .effects import (
    NoteKind as NoteKind,  # re-exported: the effect types' old home
)
from .messages import COMPRESSIONS, Kind, Message, from_wire, to_wire, wire_numel, wire_unit
from .op_state import Op, OpId
from .reduce_ops import REDUCE_OPS
from .shares import measured_rates, plan, tree_of_planned, uniform
from .stragglers import CLOSE_AHEAD_STEPS, ZERO_DTYPES, close_at, data_dtype, identity_zeros
from .timeouts import SLACK, Phase, TimeoutPolicy
from .topology import Neighbours
from .trees import tree_of
from .view import View

# Sum buffers the machine tracks for reuse (buffers.py): one per op this rank adds into, held
# until it sent its sum on, or at a root (where the sum is the result) until the op lingers out.
SUM_BUFFERS = 32
# Working arrays of wire compression (a received bf16 sum decoded before it is added, the
# encoder's uint32 array): each is let go of at once, so a few cover every chunk. Fresh ones
# cost more than the decoding: 147 us against 17 us for a 333 KB chunk, in page faults.
SCRATCH_BUFFERS = 4

# A backup node acts on a watch only after this many checks went unanswered: one answer that
# waited behind a slow uplink's data is not a dead sender.
UNANSWERED_CHECKS = 2
# The root's deadline is put off while the children it waits for send bytes, up to this many
# times its length in all: a step is given up on for silence, not slowness, but never waits for ever.
MAX_DEADLINE_EXTENSIONS = 20


# ---- events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Submit:
    """The local contribution to one op. `data` is 1-D and now owned by the machine."""

    step: int
    chunk: int = 0
    chunks: int = 1  # how many chunks the step has: the tree a chunk runs on depends on it
    data: np.ndarray
    signature: str  # dtype and shape of the whole tensor, compared across workers
    contribute: bool = True  # False: `data` is zeros and this rank is not among the result's contributors
    abort: str = ""  # fail this step everywhere for this reason, naming this rank (a NaN, Config.nonfinite)
    reduce: str = "sum"  # how contributions meet (reduce_ops.py); named in the signature, so ranks agree
    # float32 data of this step travels as "bf16", "fp16" or "int8" (None: Config.compression).
    # Ranks may differ: every hop decodes what it gets
    compression: str | None = None
    # under straggler_policy="deadline", the step may close without late ranks (gradient buckets);
    # False (a broadcast, a layout check, an audit): it waits for every member
    closable: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    msg: Message
    link: LinkState | None = None  # LINK_QUERY_KINDS: the link from this rank to msg.target


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerFired:
    key: TimerKey
    alive: frozenset[int] | None = None  # DEADLINE, ROOT_DEADLINE: peers whose bytes arrived lately
    uplink: float = 0.0  # DEADLINE, ROOT_DEADLINE: this rank's measured uplink, bytes per second (0.0: unknown)
    # DEADLINE, ROOT_DEADLINE: members that said lately they are alive and have not submitted
    # a step -> the oldest such step (Membership.computing)
    computing: Mapping[int, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkDown:
    """The driver saw a hard failure on the link to `peer` (refused, reset, closed)."""

    peer: int
    reason: str



Event = Submit | Received | TimerFired | LinkDown


# ---- actions ------------------------------------------------------------------------------




# ---- the machine's public state (status pages read this, never the private fields) ----------


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


@dataclass(slots=True)
class _UpLink:
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
class _Tree:
    """This rank's place in one tree (tree 0: the heap over the view's slot order; the others
    over other orders, trees.py) and what it remembers about that tree's links: the uplink
    differs per tree, so does its link memory."""

    tree: int
    view: View  # the view whose heap is this tree
    me: Neighbours
    subtrees: dict[int, frozenset[int]]  # child -> every rank of its subtree
    up: _UpLink = field(default_factory=_UpLink)
    down_failed: set[int] = field(default_factory=set)  # children whose link to us is known broken

    @classmethod
    def build(cls, family: str, tree: int, view: View, rank: int) -> _Tree:
        heap = view.tree(tree, family)
        me = heap.neighbours(rank)
        return cls(tree=tree, view=heap, me=me, subtrees={c: heap.subtree(c) for c in me.children})

    @property
    def label(self) -> str:
        """For notes: which tree, when it is not tree 0."""
        return f" (tree {self.tree})" if self.tree else ""


class TreeMachine:
    """One rank's protocol state for all ops in flight. Deterministic: the same events at the
    same times give the same actions."""

    def __init__(self, rank: int, view: View, config: Config | None = None) -> None:
        self.rank = rank
        self.view = view
        self.cfg = config or Config()
        self._rates: tuple[float, ...] | None = None  # the members' unequal uplinks (None: even shares)
        self._earlier_rates: dict[int, tuple[float, ...] | None] = {}  # those of the _same_trees epochs
        self._bf16_up = False  # a slow uplink: float32 sums go up as bf16 (Config.bf16_uplinks_below)
        self.trees: tuple[_Tree, ...] = self._build_trees(view)
        self._ops: dict[OpId, Op] = {}
        self._retired: set[OpId] = set()
        self._retired_order: deque[OpId] = deque()  # the same ids, oldest retired first
        self._retired_floor = -1  # ops of steps below this are retired too
        self._max_step_submitted = -1
        self._last_abort_at = -float("inf")
        self.timeouts: TimeoutPolicy = self.cfg.make_timeouts()
        self.fenced = False  # a view change is being agreed: take and produce no results
        self._later: deque[Message] = deque(maxlen=self.cfg.max_ops_ahead)  # frames of a view not installed yet
        self._expected: View | None = None  # a decided view of the same members, in effect from a later step
        self._closed_steps: dict[int, float] = {}  # steps this rank took part in with zeros, late -> when
        self._same_trees: set[int] = set()  # earlier epochs of these very members (pace changes): their ops go on
        self.buffers = BufferPool(keep=SUM_BUFFERS)  # where subtree sums are added up
        self.scratch = BufferPool(keep=SCRATCH_BUFFERS)  # compression's working arrays
        self.empty_sums = 0  # subtree sums that named no contributor: taken as the child's arrival, none of it added

    # ---- public ------------------------------------------------------------------------

    def fence(self) -> None:
        """A view change is being agreed (membership.py): from now on take no result and
        finalize nothing in this view, so the steps reported held are final."""
        self.fenced = True

    def install(self, view: View, committed: frozenset[int], now: float) -> list[Action]:
        """Move to `view`. Ops of committed steps stay (a result not here yet comes by
        CATCHUP); every other op of the old view is voided (Void), its step to be run again in
        the new view or handed back, by policy. Link memory starts over: the tree changed."""
        out: list[Action] = []
        self._enter(view)
        self._expected = None
        self.fenced = False
        for op_id, op in list(self._ops.items()):
            if op.linger_over:  # kept through the change to serve catch-ups: linger once more
                op.linger_over = False
                out.append(SetTimer(key=self._timer(TimerKind.LINGER, op), at=now + self.cfg.linger_s))
            if op.epoch == view.epoch:
                continue
            for kind in (TimerKind.DEADLINE, TimerKind.ROOT_DEADLINE):
                out.append(CancelTimer(key=self._timer(kind, op)))
            if op.step in committed and op.submitted:
                if not op.done:
                    op.awaiting_catchup = True
                    out.append(SetTimer(key=self._timer(TimerKind.DEADLINE, op), at=now + self.cfg.step_timeout_s))
                continue
            del self._ops[op_id]  # not retired: the step runs again under the same id
            if op.submitted:
                out.append(Void(step=op.step, chunk=op.chunk))
        voided = {a.step for a in out if isinstance(a, Void)}
        if voided:
            # Chunks of those steps that finished here before the change (behind a slow
            # uplink a step's first chunks are done seconds before its last) were retired:
            # they run again too. Late frames of the old view are dropped by their epoch.
            self._retired -= {op_id for op_id in self._retired if op_id[0] in voided}
        self._replay_later(view, now, out)
        return out

    def activate(self, view: View, now: float) -> list[Action]:
        """Move to `view`, which only adds members (a join) or changes the pace, at a
        training-step boundary: ops in flight keep running in the view they began in, new ops
        run in this one, and frames of this view that came early are handled now."""
        out: list[Action] = []
        self._enter(view)
        self._expected = None
        self._replay_later(view, now, out)
        return out

    def expect(self, view: View, now: float) -> list[Action]:
        """`view` was decided and takes effect at a later training step. If its members are
        ours (a pace change: the trees are the same), its ops' frames are handled as they
        come, before this rank reaches that step: a faster peer's data is confirmed at once,
        not held back while its backup nodes take the silence for a lost frame."""
        out: list[Action] = []
        if view.members != self.view.members or view.epoch <= self.view.epoch:
            return out
        self._expected = view
        later, self._later = self._later, deque(maxlen=self.cfg.max_ops_ahead)
        for msg in later:
            if msg.epoch == view.epoch:
                self._on_message(msg, now, out)
            else:
                self._later.append(msg)
        return out

    def _enter(self, view: View) -> None:
        """This rank's place in `view`; link memory starts over, as the tree changed. A view of
        the same members (a pace change) keeps the trees and their link memory, and the ops
        of the view before run on in it."""
        if view.members == self.view.members and view.epoch > self.view.epoch:
            self._same_trees.add(self.view.epoch)
            self._earlier_rates[self.view.epoch] = self._rates  # its ops keep their shares
            self.view = view
            self._rates, self._bf16_up = self._follow_uplinks(view)
            return
        self._same_trees.clear()
        self._earlier_rates.clear()
        self.view = view
        self.trees = self._build_trees(view)

    def _replay_later(self, view: View, now: float, out: list[Action]) -> None:
        """Frames that came before this view was installed here: handled now (those of a later
        view are kept again by _on_message)."""
        later, self._later = self._later, deque(maxlen=self.cfg.max_ops_ahead)
        for msg in later:
            if msg.epoch >= view.epoch:
                self._on_message(msg, now, out)

    def start_at(self, step: int) -> None:
        """A joiner: its first op is `step`; every earlier step belongs to the group's past."""
        self._max_step_submitted = step - 1
        self._retired_floor = step

    def closed_run(self, step: int) -> int:
        """How many steps from `step` on this rank was late for in a row (stragglers.py): the
        group closed them without it, and their results are here or on their way. (Membership
        tests only: safe to ask from another thread.)"""
        run = 0
        while step + run in self._closed_steps:
            run += 1
        return run

    def result_of(self, step: int) -> list[tuple[int, np.ndarray, tuple[int, ...], tuple[int, ...], str]]:
        """(chunk, result, contributors, late, signature) of every chunk of `step` finished here
        and still kept (a holder serves them to ranks that lack them after a view change)."""
        return [(op.chunk, op.bcast.result, op.bcast.contributors, op.bcast.late, op.signature)
                for (s, _c), op in sorted(self._ops.items()) if s == step and op.done and op.bcast.result is not None]

    def handle(self, event: Event, now: float) -> list[Action]:
        out: list[Action] = []
        match event:
            case Submit():
                self._on_submit(event, now, out)
            case Received(msg=msg, link=link):
                self._on_message(msg, now, out, link)
            case TimerFired():
                self._on_timer(event, now, out)
            case LinkDown(peer=peer, reason=reason):
                self._on_link_down(peer, reason, now, out)
        return out

    def active_ops(self) -> list[OpId]:
        return sorted(k for k, op in self._ops.items() if not op.done)

    def status(self) -> MachineStatus:
        ops = []
        for (step, chunk), op in sorted(self._ops.items()):
            if op.done:
                continue
            phase = (OpPhase.WAITING if not op.submitted else OpPhase.BROADCAST if op.reduce.sent
                     else OpPhase.REDUCE)
            red = op.reduce
            ops.append(OpStatus(step=step, chunk=chunk, phase=phase, contributors=tuple(sorted(red.contributors)),
                                waiting_for=tuple(c for c in self._t(op).me.children if c not in red.got_children)))
        return MachineStatus(rank=self.rank, view=self.view, ops=tuple(ops), footprint=self.footprint(),
                             trees=tuple(self._tree_status(t) for t in self.trees))

    def _tree_status(self, t: _Tree) -> TreeStatus:
        up = t.up
        return TreeStatus(
            tree=t.tree, neighbours=t.me, relayed_children=tuple(sorted(t.down_failed)),
            uplink=UplinkStatus(parent=t.me.parent, failed=up.failed, relays=up.relays, failures=up.failures,
                                probing=up.failed and up.healthy_since is not None, hold_s=self._heal_hold_s(t)))

    def footprint(self) -> dict[str, int]:
        """Sizes of everything this machine keeps between events: none may grow with the
        number of ops run (tests check it over many thousands of ops)."""
        return {"ops": len(self._ops), "active_ops": sum(not op.done for op in self._ops.values()),
                "retired": len(self._retired), "closed_steps": len(self._closed_steps),
                "held": sum(len(op.reduce.held) for op in self._ops.values())}

    # ---- the trees (trees.py) ---------------------------------------------------------

    def _build_trees(self, view: View) -> tuple[_Tree, ...]:
        self._rates, self._bf16_up = self._follow_uplinks(view)
        family = self.cfg.trees
        return tuple(_Tree.build(family, t, view, self.rank) for t in range(view.tree_count(family)))

    def _follow_uplinks(self, view: View) -> tuple[tuple[float, ...] | None, bool]:
        """The members' uplinks the shares follow in `view` (None: even shares), and whether
        this rank's is slow enough to send its sums as bf16: the declared ones
        (Config.uplinks_by_rank) or else the measured ones the view holds."""
        if self.cfg.uplinks_by_rank:
            rates: tuple[float, ...] | None = tuple(self.cfg.uplink_of(r) for r in view.members)  # in slot order
            mine = self.cfg.uplink_of(self.rank)
        else:
            rates = measured_rates([view.planned_uplink(r) for r in view.members])
            mine = view.uplink_of(self.rank) or self.cfg.uplink_bytes_per_s
        if self.cfg.trees != "rotated" or rates is None or uniform(rates) or view.reach:
            # (the shares plan p trees that rotate everybody: reach.py)
            rates = None
        return rates, mine < self.cfg.bf16_uplinks_below

    def _rates_in(self, epoch: int | None) -> tuple[float, ...] | None:
        """The shares' uplinks in view `epoch`: a pace change keeps the trees, but each view's
        ops keep that view's shares."""
        if epoch is None or epoch == self.view.epoch:
            return self._rates
        if self._expected is not None and epoch == self._expected.epoch:
            return self._follow_uplinks(self._expected)[0]
        return self._earlier_rates.get(epoch, self._rates)

    def tree_of(self, chunk: int, chunks: int, epoch: int | None = None) -> int:
        """The tree chunk `chunk` of a step of `chunks` chunks runs on in this view (trees.py).
        A one-chunk step always runs on tree 0: small tensors and their fault costs are those
        of the single tree. Stateless, so a frame that comes before the local submit is checked
        against the same rule (and `tree` in its header). With unequal uplinks (declared, or
        measured and held by the view) the rotated trees carry shares that follow them
        (shares.py)."""
        rates = self._rates_in(epoch)
        if rates is not None and chunks >= 2 and len(rates) >= 2:
            return tree_of_planned(plan(rates, chunks), chunk)
        return tree_of(self.cfg.trees, chunk, chunks, self.view.size, self.view.turn(self.cfg.trees))

    def _t(self, op: Op) -> _Tree:
        return self.trees[op.tree]

    @property
    def me(self) -> Neighbours:
        """This rank's neighbours in tree 0 (the tree every rank is interior or leaf of as in
        the single tree; membership watches these)."""
        return self.trees[0].me

    @property
    def up(self) -> _UpLink:
        """Link memory of this rank's uplink in tree 0."""
        return self.trees[0].up

    @property
    def down_failed(self) -> set[int]:
        """Tree 0's children whose link to us is known broken."""
        return self.trees[0].down_failed

    @property
    def peers(self) -> tuple[int, ...]:
        """Every rank this one exchanges frames with: its neighbours in every tree (the
        transport connects to these at start)."""
        if len(self.trees) == 1:
            return self.trees[0].me.all
        return tuple(sorted({r for t in self.trees for r in t.me.all}))

    # ---- helpers -----------------------------------------------------------------------

    @property
    def _ft(self) -> bool:
        return self.cfg.fault_tolerant

    def _msg(self, op: Op, kind: Kind, **kw: object) -> Message:
        return Message(kind=kind, src=self.rank, epoch=op.epoch, step=op.step, chunk=op.chunk, tree=op.tree,
                       chunks=op.chunks, **kw)  # type: ignore[arg-type]

    def _data_msg(self, op: Op, kind: Kind, wire: tuple[np.ndarray, str], contributors: tuple[int, ...],
                  **kw: object) -> Message:
        array, dtype = wire
        return self._msg(op, kind, payload=array.data.cast("B"), dtype=dtype,
                         numel=wire_numel(dtype, array), signature=op.signature,
                         contributors=contributors, **kw)

    # ---- wire compression: float32 data may travel as bf16 or fp16 (Config.compression) ----

    def _accepts(self, op: Op, wire: str) -> bool:
        """Can data of op travel as `wire`? Its own dtype, or float32 in a compressed form (peers
        may differ in compression: every hop decodes what it gets)."""
        return wire == op.dtype or (op.dtype == "<f4" and wire in COMPRESSIONS.values())

    def _acc_wire(self, op: Op) -> tuple[np.ndarray, str]:
        """Our subtree sum as it travels: encoded once, when first sent up (it no longer changes
        then), and the same bytes for every copy (relays, the direct retry)."""
        if op.reduce.acc_wire is None:
            assert op.reduce.acc is not None
            wire = COMPRESSIONS["bf16"] if op.wire == "<f4" and self._bf16_up else op.wire
            op.reduce.acc_wire = (to_wire(op.reduce.acc, wire, self.scratch), wire)
        return op.reduce.acc_wire

    def _result_wire(self, op: Op) -> tuple[np.ndarray, str]:
        """The result as it travels: the encoded form the root made (or we received), never
        encoded again here, so every rank decodes the same bytes."""
        assert op.bcast.result is not None
        return op.bcast.wire if op.bcast.wire is not None else (op.bcast.result, op.bcast.result.dtype.str)

    def _take_result(self, op: Op, msg: Message) -> np.ndarray:
        assert msg.payload is not None
        op.bcast.result = result = from_wire(msg.payload, msg.dtype, op.dtype)
        if msg.dtype != op.dtype:  # keep the bytes to pass on as they came
            held = np.frombuffer(msg.payload, dtype=wire_unit(msg.dtype))
            op.bcast.wire = (held, msg.dtype)
        return result

    def is_past_epoch(self, epoch: int) -> bool:
        """Are frames of view `epoch` out of date here? Those of an earlier view are, unless it
        had these very members (a pace change): its ops run on, and their frames still count."""
        return epoch < self.view.epoch and epoch not in self._same_trees

    def is_retired(self, op_id: OpId) -> bool:
        """Has this op finished here long enough ago that its messages are dropped?"""
        return op_id[0] < self._retired_floor or op_id in self._retired

    def _get_op(self, step: int, chunk: int, chunks: int, out: list[Action], src: int,
                epoch: int | None = None) -> Op | None:
        op_id = (step, chunk)
        op = self._ops.get(op_id)
        if op is not None:
            return op
        if self.is_retired(op_id):
            out.append(Note(step=step, cause=Cause.STALE_DROPPED, peer=src,
                            text=f"dropped a late message of retired step {step} chunk {chunk}"))
            return None
        if step < 0 or chunk < 0 or step > self._max_step_submitted + self.cfg.max_ops_ahead:
            out.append(Note(step=step, cause=Cause.PROTOCOL_VIOLATION, peer=src,
                            text=f"dropped a message for step {step} chunk {chunk}: too far ahead"))
            return None
        if not chunk < chunks <= self.cfg.max_step_chunks:
            out.append(Note(step=step, cause=Cause.PROTOCOL_VIOLATION, peer=src,
                            text=f"dropped a message for step {step} chunk {chunk} of {chunks}: not a chunk a step "
                                 f"can have (at most {self.cfg.max_step_chunks})"))
            return None
        if len(self._ops) >= self.cfg.max_live_ops:
            out.append(Note(step=step, cause=Cause.PROTOCOL_VIOLATION, peer=src,
                            text=f"dropped a message for step {step} chunk {chunk}: {len(self._ops)} ops in flight "
                                 f"already (max_live_ops)"))
            return None
        op = self._ops[op_id] = Op(step=step, chunk=chunk, epoch=self.view.epoch if epoch is None else epoch,
                                    chunks=chunks, tree=self.tree_of(chunk, chunks, epoch))
        return op

    def _retire(self, op: Op) -> None:
        """Forget a finished op but remember its id, so its late messages are dropped.

        At most `retired_memory` ids are kept, oldest retired first out, in O(1) per op. An id
        that falls out raises the floor to its step: every step below the floor was submitted
        here (steps are submitted in order), so an op below it is active or retired."""
        op_id = (op.step, op.chunk)
        self._ops.pop(op_id, None)
        if op_id in self._retired:
            return
        self._retired.add(op_id)
        self._retired_order.append(op_id)
        while len(self._retired_order) > self.cfg.retired_memory:
            oldest = self._retired_order.popleft()
            self._retired.discard(oldest)
            self._retired_floor = max(self._retired_floor, oldest[0])

    def _timer(self, kind: TimerKind, op: Op, peer: int = -1) -> TimerKey:
        return TimerKey(kind, op.step, op.chunk, peer, op.epoch)

    # ---- submit ------------------------------------------------------------------------

    def _on_submit(self, ev: Submit, now: float, out: list[Action]) -> None:
        op_id = (ev.step, ev.chunk)
        held = self._ops.get(op_id)
        taken = held is not None and held.stragglers.taken
        if ev.step in self._closed_steps and not self.is_retired(op_id) and not taken:
            self._late_submit(ev, now, out)
            return
        if self.is_retired(op_id) or (held is not None and held.submitted):
            raise ValueError(f"step {ev.step} chunk {ev.chunk} was already submitted on rank {self.rank}")
        self._start(ev, now, out)

    def _late_submit(self, ev: Submit, now: float, out: list[Action]) -> None:
        """The caller's contribution to a step that closed without it (stragglers.py): it is not
        added. The caller gets the result the others made, now or when it comes."""
        closed_at = self._closed_steps[ev.step]
        op = self._ops.get((ev.step, ev.chunk))
        if op is None or not op.submitted:  # this chunk's close has not come: zeros, as in the others
            self._start(replace(ev, data=identity_zeros(ev.data.size, ev.data.dtype.str), contribute=False), now,
                        out, late=True)
            op = self._ops[(ev.step, ev.chunk)]
        op.stragglers.taken = True
        if ev.chunk == 0:
            out.append(Note(step=ev.step, cause=Cause.LATE_DROPPED, peer=self.rank, seconds=now - closed_at,
                            text=f"rank {self.rank}'s contribution to step {ev.step} came {now - closed_at:.3f} s "
                                 f"after the step closed without it: not added (straggler_policy='deadline')"))
        if op.done and op.bcast.result is not None:  # finished before the caller came: hand it over now
            out.append(self._completed(op))
        elif op.done and op.failure is not None:
            out.append(op.failure)

    def _start(self, ev: Submit, now: float, out: list[Action], *, late: bool = False) -> None:
        """Our contribution to an op (`late`: zeros, this rank being late; not counted)."""
        op_id = (ev.step, ev.chunk)
        if ev.data.ndim != 1:
            raise ValueError("Submit.data must be a 1-D array")
        self._max_step_submitted = max(self._max_step_submitted, ev.step)
        op = self._ops.get(op_id) or self._ops.setdefault(op_id, Op(step=ev.step, chunk=ev.chunk,
                                                                    epoch=self.view.epoch, chunks=ev.chunks,
                                                                    tree=self.tree_of(ev.chunk, ev.chunks)))
        t = self._t(op)
        op.submitted, op.signature, op.dtype, op.started = True, ev.signature, ev.data.dtype.str, now
        op.nbytes = ev.data.nbytes
        op.own = op.reduce.acc = ev.data
        op.combine = REDUCE_OPS[ev.reduce]
        compression = self.cfg.compression if ev.compression is None else ev.compression
        op.wire = COMPRESSIONS[compression] if compression and op.dtype == "<f4" else op.dtype
        if ev.contribute:
            op.reduce.contributors.add(self.rank)
        op.stragglers.closable = op.stragglers.closable or ev.closable
        if late:
            op.stragglers.late.add(self.rank)
            op.stragglers.closed_at = now
        op.stragglers.arrivals.append(now)
        if op.failure is not None:  # an ABORT arrived before our submit
            self._emit_failure(op, op.failure, now, out)
            return
        out.append(SetTimer(key=self._timer(TimerKind.DEADLINE, op), at=now + self.cfg.step_timeout_s))
        if t.me.parent is None and t.me.children:
            # After an abort, a rank that never heard of it leaves that step only at its own
            # deadline, up to step_timeout - root_give_up after us; wait for it as long as for
            # anyone from then on, or one lost step would abort the next one too.
            give_up = max(now + self.cfg.root_give_up_s, self._last_abort_at + self.cfg.step_timeout_s)
            out.append(SetTimer(key=self._timer(TimerKind.ROOT_DEADLINE, op), at=give_up))
        if ev.abort:
            self._abort(op, AbortCode.NONFINITE, ev.abort, (self.rank,), now, out)
            return
        for msg in list(op.reduce.held.values()):  # data that came before our submit
            if not self._matches(op, msg, now, out):
                return
        self._add_in_order(op)
        self._maybe_send_up(op, now, out)
        self._maybe_arm_close(op, now, out)

    def _matches(self, op: Op, msg: Message, now: float, out: list[Action]) -> bool:
        """True if msg's tensor matches ours; otherwise abort the op everywhere."""
        if not op.submitted:
            return True
        assert op.reduce.acc is not None
        if msg.signature == op.signature and self._accepts(op, msg.dtype) and msg.numel == op.reduce.acc.size \
                and msg.chunks == op.chunks:
            return True
        reason = (f"tensor mismatch: rank {msg.src} sent {msg.signature} ({msg.numel} x {msg.dtype}) "
                  f"for chunk {op.chunk} of {msg.chunks}, rank {self.rank} has {op.signature} "
                  f"({op.reduce.acc.size} x {op.dtype}, chunk {op.chunk} of {op.chunks})")
        if msg.signature == op.signature and self._accepts(op, msg.dtype):
            reason += (": the same tensor cut into other chunks; chunk_bytes and uplink_bytes_per_s "
                       "(--chunk-bytes, --uplink) must be the same on every worker")
        self._abort(op, AbortCode.MISMATCH, reason, (msg.src,), now, out)
        return False

    def _add_in_order(self, op: Op) -> None:
        """Add the children's subtree sums that can be added now: always in slot order, after
        our own contribution, holding one that comes early until those before it are in. Float
        addition is not associative, so this is what makes a sum the same bits on every run,
        whatever order the data arrives in and whichever way a relay took it."""
        if not self.cfg.ordered_sums:  # as they came
            for origin in list(op.reduce.held):
                self._add(op, op.reduce.held.pop(origin))
                op.reduce.added += 1
            return
        children = self._t(op).me.children
        while op.reduce.added < len(children) and children[op.reduce.added] in op.reduce.held:
            self._add(op, op.reduce.held.pop(children[op.reduce.added]))
            op.reduce.added += 1

    def _add(self, op: Op, msg: Message) -> None:
        assert op.reduce.acc is not None
        assert msg.payload is not None
        if not msg.contributors:
            # A subtree sum of no rank (a joiner taking part without contributing, a late leaf):
            # its label says it holds nothing, so nothing of it is added, whatever its bytes
            # (before: they were summed into a result that named only the others).
            op.stragglers.late.update(msg.late)
            self.empty_sums += 1
            return
        if msg.dtype == "<f2" and op.dtype == "<f4":  # fp16 on the wire: numpy widens while it adds
            incoming = np.frombuffer(msg.payload, dtype=np.float16)
        elif msg.dtype != op.dtype:  # decoded into a working array, let go of once added
            incoming = from_wire(msg.payload, msg.dtype, op.dtype, into=self.scratch.array(msg.numel, op.dtype))
        else:
            incoming = from_wire(msg.payload, msg.dtype, op.dtype)
        if op.reduce.acc is op.own:  # the first sum: into a buffer of its own, so our contribution stays as it was
            op.reduce.acc = op.combine(op.own, incoming, out=self.buffers.array(op.own.size, op.own.dtype))
        else:
            op.combine(op.reduce.acc, incoming, out=op.reduce.acc)
        op.reduce.contributors.update(msg.contributors)
        op.stragglers.late.update(msg.late)

    def _maybe_send_up(self, op: Op, now: float, out: list[Action]) -> None:
        t = self._t(op)
        if not op.submitted or op.reduce.sent or op.done or len(op.reduce.got_children) < len(t.me.children):
            return
        assert op.reduce.acc is not None
        op.reduce.sent = True
        op.reduce.sent_at = now
        contributors = tuple(sorted(op.reduce.contributors))
        parent = t.me.parent
        if parent is None:  # the root: its subtree sum is the result
            if self.fenced:
                op.reduce.sent = False  # a view change is being agreed: no result of this view now
                return
            if op.wire != op.dtype:
                # Compressed: the result is what the encoding holds, here as on every other
                # rank (they decode the bytes we send), so all of them agree bit for bit.
                encoded = to_wire(op.reduce.acc, op.wire, self.scratch)
                op.bcast.wire = (encoded, op.wire)
                # decoded into the sum's own buffer, done with now (never into our contribution)
                into = None if op.reduce.acc is op.own else op.reduce.acc
                op.bcast.result = op.reduce.acc = from_wire(encoded.data.cast("B"), op.wire, op.dtype, into=into)
            else:
                if op.reduce.acc is op.own:  # a root without children: the result is a copy, never our contribution
                    op.reduce.acc = op.reduce.acc.copy()
                op.bcast.result = op.reduce.acc
            op.bcast.contributors = contributors
            op.bcast.late = tuple(sorted(op.stragglers.late))
            out.append(CancelTimer(key=self._timer(TimerKind.ROOT_DEADLINE, op)))
            out.append(CancelTimer(key=self._timer(TimerKind.STRAGGLER, op)))
            self._finish(op, now, out)
            return
        if self._ft and t.up.failed and t.up.relays:
            # link memory: straight to every backup, no timeout to pay. Both, because we cannot
            # tell which of them still reaches our parent; the parent adds the first copy only.
            op.reduce.rerouted = op.reduce.rerouted_planned = True
            for relay in t.up.relays:
                out.append(Send(dst=relay, msg=self._data_msg(op, Kind.DATA_REDUCE_REQUEST, self._acc_wire(op),
                                                              contributors, origin=self.rank, target=parent,
                                                              planned=True, late=tuple(sorted(op.stragglers.late)),
                                                              closable=op.stragglers.closable)))
        else:
            out.append(Send(dst=parent, msg=self._data_msg(op, Kind.DATA_REDUCE, self._acc_wire(op), contributors,
                                                           origin=self.rank, late=tuple(sorted(op.stragglers.late)),
                                                           closable=op.stragglers.closable)))
        if self._ft:
            for observer in (t.me.brother, t.me.uncle):
                if observer is not None:
                    out.append(Send(dst=observer, msg=self._msg(op, Kind.META_REDUCE_SENT,
                                                                origin=self.rank, target=parent)))

    # ---- messages ----------------------------------------------------------------------

    def _on_message(self, msg: Message, now: float, out: list[Action], link: LinkState | None = None) -> None:
        expected = self._expected
        if msg.epoch != self.view.epoch and (expected is None or msg.epoch != expected.epoch):
            if msg.epoch > self.view.epoch:
                self._later.append(msg)  # a view we are about to install (its commit is on its way)
                return
            if msg.epoch in self._same_trees:  # an op of an earlier pace: its trees are ours
                held = self._ops.get(msg.op)
                if msg.kind is Kind.META_BCAST_REQUEST and (held is None or held.epoch != msg.epoch):
                    self._answer_retired(msg, link, out)
                    return
                if held is not None and held.epoch == msg.epoch:
                    return self._on_op_message(msg, now, out, link)
            out.append(Note(step=msg.step, cause=Cause.STALE_DROPPED, peer=msg.src,
                            text=f"dropped {msg.kind.name} of view {msg.epoch} from rank {msg.src}"))
            return
        self._on_op_message(msg, now, out, link)

    def _on_op_message(self, msg: Message, now: float, out: list[Action], link: LinkState | None) -> None:
        if msg.kind is Kind.CATCHUP:
            self._on_catchup(msg, now, out)
            return
        probe = msg.kind in (Kind.PROBE, Kind.PROBE_ACK)
        tree = msg.tree if probe else self.tree_of(msg.chunk, msg.chunks, msg.epoch)  # a probe: its tree's uplink
        if msg.tree != tree or not 0 <= tree < len(self.trees):
            self._tree_mismatch(msg, tree, now, out)
            return
        t = self.trees[tree]
        if msg.src not in t.me.all:
            out.append(Note(step=msg.step, cause=Cause.PROTOCOL_VIOLATION, peer=msg.src,
                            text=f"dropped {msg.kind.name} from rank {msg.src}, not a neighbour in tree {tree}"))
            return
        if msg.kind is Kind.PROBE:
            if msg.src in t.me.children:
                ack = Message(kind=Kind.PROBE_ACK, src=self.rank, epoch=self.view.epoch, step=msg.step, tree=tree)
                out.append(Send(dst=msg.src, msg=ack))
            return
        if msg.kind is Kind.PROBE_ACK:
            if msg.src == t.me.parent:
                self._on_probe_ack(t, now, out)
            return
        if msg.kind is Kind.META_BCAST_REQUEST and self.is_retired(msg.op):
            self._answer_retired(msg, link, out)
            return
        op = self._get_op(msg.step, msg.chunk, msg.chunks, out, msg.src, msg.epoch)
        if op is None:
            return
        if op.epoch != msg.epoch:  # a committed op of an older view, waiting for its catch-up
            out.append(Note(step=msg.step, cause=Cause.STALE_DROPPED, peer=msg.src,
                            text=f"dropped {msg.kind.name} for step {msg.step}, committed in view {op.epoch}"))
            return
        self._on_op_frame(op, msg, now, out, link)

    def _on_op_frame(self, op: Op, msg: Message, now: float, out: list[Action], link: LinkState | None) -> None:
        """A frame of one op, from a neighbour, in the op's view: the thesis' eight messages."""
        match msg.kind:
            case Kind.DATA_REDUCE:
                self._on_data_reduce(op, msg, now, out)
            case Kind.META_REDUCE_SENT:
                self._on_meta_reduce_sent(op, msg, now, out)
            case Kind.META_REDUCE_RECEIVED:
                op.watches.reduce_confirmed.add(msg.origin)
                out.append(CancelTimer(key=self._timer(TimerKind.REDUCE_WATCH, op, msg.origin)))
                self._sample(op, Phase.REDUCE, msg.origin, now)
            case Kind.META_REDUCE_REQUEST:
                self._on_meta_reduce_request(op, msg, now, out, link)
            case Kind.DATA_REDUCE_REQUEST:
                self._on_data_reduce_request(op, msg, out)
            case Kind.DATA_BCAST:
                self._on_data_bcast(op, msg, now, out)
            case Kind.META_BCAST_SENT:
                self._on_meta_bcast_sent(op, msg, now, out)
            case Kind.META_BCAST_REQUEST:
                self._on_meta_bcast_request(op, msg, out, link)
            case Kind.META_STALLED:
                self._on_meta_stalled(op, msg, out)
            case Kind.META_BCAST_RECEIVED:
                op.watches.bcast_confirmed.add(msg.src)
                op.watches.bcast_pending.discard(msg.src)
                out.append(CancelTimer(key=self._timer(TimerKind.BCAST_WATCH, op, msg.src)))
                self._sample(op, Phase.BCAST, msg.src, now)
            case Kind.ABORT:
                self._on_abort(op, msg, now, out)
            case Kind.META_CLOSE:
                self._on_close(op, msg, now, out)
            case _:
                out.append(Note(step=msg.step, cause=Cause.PROTOCOL_VIOLATION, peer=msg.src,
                                text=f"dropped unexpected {msg.kind.name} from rank {msg.src}"))

    def _on_abort(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        """A neighbour says the op cannot finish: so it fails here too, with what this rank adds
        to the reason (whom it still waited for, or where its subtree sum went)."""
        t = self.trees[msg.tree]
        codes = {c.value for c in AbortCode}
        code = AbortCode(msg.code) if msg.code in codes else AbortCode.UNREACHABLE
        reason, peers = msg.reason, msg.missing
        waiting = sorted(set(t.me.children) - op.reduce.got_children)
        if op.submitted and not op.reduce.sent and waiting:
            reason += f"; rank {self.rank} was still waiting for children {waiting}"
            peers = tuple(waiting)
        elif op.reduce.sent and t.me.parent is not None and op.bcast.result is None:
            reason += f"; rank {self.rank} had sent its subtree sum to rank {t.me.parent}"
        self._abort(op, code, reason, peers, now, out, remote=msg.src)

    def _tree_mismatch(self, msg: Message, tree: int, now: float, out: list[Action]) -> None:
        """A frame names another tree than this rank's rule gives for its op: the workers differ
        in `trees` (or a peer is broken). Like a tensor mismatch, the op fails everywhere with
        both sides in the reason; a probe, which belongs to no op, is dropped."""
        if msg.src not in self.peers:
            self._protocol(out, msg, f"tree {msg.tree} from a rank that is no neighbour in any tree")
            return
        if msg.kind in (Kind.PROBE, Kind.PROBE_ACK):
            self._protocol(out, msg, f"a probe of tree {msg.tree}, but rank {self.rank} has trees 0.."
                                     f"{len(self.trees) - 1} (trees={self.cfg.trees!r})")
            return
        op = self._get_op(msg.step, msg.chunk, msg.chunks, out, msg.src, msg.epoch)
        if op is None or op.epoch != msg.epoch:
            return
        reason = (f"tree mismatch: rank {msg.src} runs step {msg.step} chunk {msg.chunk} on tree {msg.tree}, "
                  f"rank {self.rank} on tree {tree} (trees={self.cfg.trees!r} here; every worker "
                  f"must use the same trees setting)")
        self._abort(op, AbortCode.MISMATCH, reason, (msg.src,), now, out, remote=msg.src)

    def _protocol(self, out: list[Action], msg: Message, why: str) -> None:
        out.append(Note(step=msg.step, cause=Cause.PROTOCOL_VIOLATION, peer=msg.src,
                        text=f"dropped {msg.kind.name} from rank {msg.src}: {why}"))

    def _on_data_reduce(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        t = self._t(op)
        origin = msg.origin
        if origin not in t.subtrees:
            return self._protocol(out, msg, f"origin {origin} is not a child of rank {self.rank}")
        if msg.src != origin and msg.src not in (t.me.brother, *t.me.children):
            return self._protocol(out, msg, f"rank {msg.src} cannot relay for rank {origin}")
        if msg.src == origin:  # any direct copy, even a late duplicate, proves the link works
            t.down_failed.discard(origin)
        if op.done:
            return
        if origin in op.reduce.got_children:
            out.append(Note(step=op.step, cause=Cause.DUPLICATE_DROPPED, peer=msg.src,
                            text=f"step {op.step}: dropped a second copy of rank {origin}'s subtree sum"))
            return
        contributors = set(msg.contributors)
        # (empty is allowed: a joiner still receiving its state takes part without contributing;
        # such a sum counts as the child's arrival, and _add adds none of its bytes)
        if not contributors <= t.subtrees[origin] or contributors & op.reduce.contributors:
            return self._protocol(out, msg, f"contributors {sorted(contributors)} are not a fresh part "
                                            f"of rank {origin}'s subtree")
        late = set(msg.late)
        if not late <= t.subtrees[origin] or late & (contributors | op.reduce.contributors | op.stragglers.late):
            return self._protocol(out, msg, f"late ranks {sorted(late)} are not a fresh part of rank {origin}'s "
                                            f"subtree apart from its contributors")
        if not self._matches(op, msg, now, out):
            return
        op.reduce.got_children.add(origin)
        op.reduce.held[origin] = msg
        op.stragglers.closable = op.stragglers.closable or msg.closable
        op.stragglers.arrivals.append(now)
        self._maybe_arm_close(op, now, out)
        if op.submitted:
            self._add_in_order(op)
        if msg.src != origin:
            if msg.planned:
                out.append(Note(step=op.step, cause=Cause.DETOUR, peer=origin, link=(origin, self.rank),
                                text=f"step {op.step}: rank {origin}'s data came around its link to rank "
                                     f"{self.rank} through rank {msg.src} (link memory: {origin}->{self.rank} "
                                     f"is marked failed)"))
            else:
                out.append(Note(step=op.step, cause=Cause.DATA_CAME_AROUND, peer=origin, link=(origin, self.rank),
                                text=f"step {op.step}: data {origin}->{self.rank} lost, forwarded by {msg.src}"))
            t.down_failed.add(origin)
            op.reduce.relayed_children[origin] = msg.src
        if self._ft:
            confirm = self._msg(op, Kind.META_REDUCE_RECEIVED, origin=origin)
            for observer in (t.me.brother, *t.me.children):
                if observer is not None and observer != origin:
                    out.append(Send(dst=observer, msg=confirm))
        self._maybe_send_up(op, now, out)
        return None

    def _on_meta_reduce_sent(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        """The origin sent its subtree sum to `target`: watch for the parent's confirmation. The
        same frame answers a check (the sum is still on its way): the watch starts over."""
        t = self._t(op)
        origin = msg.src
        watched = t.view.neighbours(origin)
        if self.rank not in (watched.brother, watched.uncle) or msg.target != watched.parent:
            return self._protocol(out, msg, "not an observer of that link")
        if origin in op.watches.reduce_confirmed or not self._ft:
            return None
        self._arm_watch(op, Phase.REDUCE, origin, (origin, msg.target, Phase.REDUCE), msg, now, out)
        return None

    def _arm_watch(self, op: Op, phase: Phase, peer: int, key: tuple[int, int, Phase], msg: Message, now: float,
                   out: list[Action]) -> None:
        """(Re)start the watch of `peer`'s link in `phase` with the figures `msg` carries: what
        its sender had queued, unacknowledged, and the rate its uplink sends at."""
        checked = op.watches.checked_at.pop((phase, peer), None) if msg.answer else None
        if checked is not None:  # the answer to our check: the frame is on its way, the watch starts over
            self.timeouts.observe_check(now - checked)
            op.watches.fired.add((phase, peer))  # Karn: this watch gives no sample
            (op.watches.bcast_tries if phase is Phase.BCAST else op.watches.reduce_tries)[peer] = 0
            if not msg.queued_bytes:  # delivered to the far end, which has not confirmed: not forever
                heard = op.watches.delivered_heard[(phase, peer)] = op.watches.delivered_heard.get((phase, peer), 0) + 1
                if heard > self.cfg.watch_retries + 1:
                    if phase is Phase.BCAST and op.bcast.result is not None:
                        self._push_result(op, peer, out, f"rank {msg.src} delivered it {heard} times "
                                                         f"over without a confirmation")
                    op.watches.started.pop((phase, peer), None)
                    return
        elif msg.answer or (phase, peer) in op.watches.started:
            return  # a second announcement of the same watch (an answer that came late)
        else:
            (op.watches.bcast_tries if phase is Phase.BCAST else op.watches.reduce_tries).setdefault(peer, 0)
        rate = float(msg.rate) or self.cfg.uplink_bytes_per_s
        op.watches.started[(phase, peer)] = (now, msg.queued_bytes, rate)
        kind = TimerKind.BCAST_WATCH if phase is Phase.BCAST else TimerKind.REDUCE_WATCH
        wait = self.timeouts.deadline_s(key, msg.queued_bytes, rate)
        if checked is not None and not msg.queued_bytes:
            # the far end has it all: its confirmation leaves through its own uplink, behind
            # its own data, and it may be busy adding; give it a node deadline
            wait = max(wait, self.cfg.node_deadline_s)
        out.append(SetTimer(key=self._timer(kind, op, peer), at=now + wait))

    def _on_meta_reduce_request(self, op: Op, msg: Message, now: float, out: list[Action],
                                link: LinkState | None = None) -> None:
        """An observer saw no confirmation of our subtree sum in time. If our link to the parent
        is moving, it is only slow: say so (META_REDUCE_SENT with fresh figures) and the
        observer waits on. If it stalled, or lost frames since we sent, hand the observer our
        sum to relay."""
        t = self._t(op)
        if op.bcast.result is not None:
            return None  # holding the result proves our sum reached the root already
        if not op.reduce.sent or op.reduce.acc is None or t.me.parent is None:
            return self._protocol(out, msg, "nothing sent yet to relay")
        if msg.src not in (t.me.brother, t.me.uncle):
            return self._protocol(out, msg, "only our brother and uncle relay for us")
        told = op.watches.delivered_told.get(msg.src, 0)
        if link is not None and not link.stalled and link.lost_at < op.reduce.sent_at and not op.reduce.rerouted \
                and (link.pending_bytes or told < self.cfg.watch_retries):
            # Moving; or delivered to the parent's end, which has not confirmed yet (it may be
            # busy, or its confirmation slow). Said watch_retries times, the sum goes to the
            # observer instead: a frame dropped at the parent's end (an injected fault) comes
            # again no other way.
            if not link.pending_bytes:
                op.watches.delivered_told[msg.src] = told + 1
            out.append(Send(dst=msg.src, msg=self._msg(op, Kind.META_REDUCE_SENT, origin=self.rank, target=t.me.parent,
                                                        queued_bytes=link.pending_bytes, answer=True)))
            return None
        if msg.src not in op.reduce.requested_by:
            op.reduce.requested_by.append(msg.src)
        contributors = tuple(sorted(op.reduce.contributors))
        out.append(Send(dst=msg.src, msg=self._data_msg(op, Kind.DATA_REDUCE_REQUEST, self._acc_wire(op), contributors,
                                                        origin=self.rank, target=t.me.parent)))
        if op.reduce.rerouted and not op.reduce.sent_direct:
            # Our sum went around our uplink and an observer still sees no sign of it at the
            # parent: the way around is not getting through (the relay's own uplink may be cut
            # too). Try the direct link as well; the parent adds whichever copy comes first.
            op.reduce.sent_direct = True
            out.append(Send(dst=t.me.parent, msg=self._data_msg(op, Kind.DATA_REDUCE, self._acc_wire(op),
                                                                   contributors, origin=self.rank)))
        return None

    def _on_data_reduce_request(self, op: Op, msg: Message, out: list[Action]) -> None:
        t = self._t(op)
        origin = msg.src
        watched = t.view.neighbours(origin)
        if self.rank not in (watched.brother, watched.uncle) or msg.target != watched.parent:
            return self._protocol(out, msg, "not an observer of that link")
        op.watches.relayed_for.add(origin)
        if msg.planned:
            op.watches.detoured_for.add(origin)
        if op.watches.checked_at.pop((Phase.REDUCE, origin), None) is not None:
            out.append(Note(step=op.step, cause=Cause.WATCH_EXPIRED, peer=origin, link=(origin, msg.target),
                            text=f"step {op.step}: no sign that rank {msg.target} got rank {origin}'s data in time, "
                                 f"and rank {origin} says it did not get through: relaying it"))
        out.append(Send(dst=msg.target, msg=Message(
            kind=Kind.DATA_REDUCE, src=self.rank, epoch=msg.epoch, step=op.step, chunk=op.chunk, tree=op.tree,
            chunks=op.chunks, origin=origin,
            contributors=msg.contributors, dtype=msg.dtype, numel=msg.numel,
            signature=msg.signature, planned=msg.planned, payload=msg.payload)))
        if msg.planned:
            out.append(Note(step=op.step, cause=Cause.DETOUR, peer=origin, link=(origin, msg.target),
                            text=f"step {op.step}: carried rank {origin}'s data around its link to rank "
                                 f"{msg.target} (marked failed)"))
        else:
            out.append(Note(step=op.step, cause=Cause.DATA_RELAYED, peer=origin, link=(origin, msg.target),
                            text=f"step {op.step}: relayed rank {origin}'s data to rank {msg.target}"))
        if op.bcast.result is not None and origin not in op.watches.bcast_confirmed:
            self._push_result(op, origin, out, "its reduce link failed")
        return None

    def _on_data_bcast(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        t = self._t(op)
        if msg.src not in (t.me.parent, t.me.brother, t.me.uncle):
            return self._protocol(out, msg, "only parent, brother or uncle send results")
        if self.fenced:  # a view change is being agreed; what we reported held is final
            out.append(Note(step=op.step, cause=Cause.STALE_DROPPED, peer=msg.src,
                            text=f"step {op.step}: dropped a result during a view change"))
            return None
        if op.bcast.result is not None or op.done:
            out.append(Note(step=op.step, cause=Cause.DUPLICATE_DROPPED, peer=msg.src,
                            text=f"step {op.step}: dropped a second copy of the result"))
            return None
        if not op.submitted:  # the result holds our contribution, so it cannot come first
            return self._protocol(out, msg, "a result for a step this rank has not submitted")
        if not self._matches(op, msg, now, out):
            return None
        self._take_result(op, msg)
        op.bcast.contributors = msg.contributors
        op.bcast.late = msg.late
        if msg.src != t.me.parent and op.reduce.requested_by:
            # Our sum needed a relay AND the result came around too: the link to the parent is
            # down both ways. A request alone is no proof (an observer cut off from our parent
            # asks in vain), so only both together make later steps route around it.
            self._mark_up_failed(t, f"step {op.step} needed relays both ways", now, out)
        if msg.src != t.me.parent:
            parent = t.me.parent
            uplink = None if parent is None else (self.rank, parent)
            if op.reduce.rerouted_planned:
                out.append(Note(step=op.step, cause=Cause.DETOUR, peer=msg.src, link=uplink,
                                text=f"step {op.step}: result came around link {self.rank}->{parent} through "
                                     f"rank {msg.src} (marked failed)"))
            else:
                out.append(Note(step=op.step, cause=Cause.RESULT_CAME_AROUND, peer=msg.src, link=uplink,
                                text=f"step {op.step}: result reached rank {self.rank} through rank {msg.src}"))
        self._finish(op, now, out)
        return None

    def _on_meta_bcast_sent(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        """`target`'s parent sent it the result: watch for its confirmation (or, as the answer
        to a check, the result is still on its way: the watch starts over)."""
        target = msg.target
        t = self._t(op)
        watched = t.view.neighbours(target) if target in self.view else None
        if watched is None or msg.src != watched.parent or self.rank not in (watched.brother, watched.uncle):
            return self._protocol(out, msg, "not an observer of that link")
        if target in op.watches.bcast_confirmed or not self._ft:
            return None
        self._arm_watch(op, Phase.BCAST, target, (msg.src, target, Phase.BCAST), msg, now, out)
        return None

    def _on_meta_bcast_request(self, op: Op, msg: Message, out: list[Action], link: LinkState | None) -> None:
        """A backup node of our child `target` saw no confirmation of the result we sent it: say
        whether it is still on its way (META_BCAST_SENT with fresh figures) or stuck
        (META_STALLED: the backup node sends its own copy)."""
        t = self._t(op)
        target = msg.target
        if target not in t.me.children or msg.src not in (t.view.neighbours(target).brother,
                                                           t.view.neighbours(target).uncle):
            return self._protocol(out, msg, "not an observer of our link to that child")
        if op.bcast.result is None:
            return None  # not sent yet: its announcement starts the watch over when it is
        pending = 0 if link is None else link.pending_bytes
        told = op.watches.delivered_told.get(msg.src, 0)
        stuck = link is not None and (link.stalled or link.lost_at >= op.bcast.finished_at)
        if target in op.reduce.relayed_children or stuck or (not pending and told >= self.cfg.watch_retries):
            out.append(Send(dst=msg.src, msg=self._msg(op, Kind.META_STALLED, target=target)))
        else:
            if not pending:
                op.watches.delivered_told[msg.src] = told + 1
            out.append(Send(dst=msg.src, msg=self._msg(op, Kind.META_BCAST_SENT, target=target, queued_bytes=pending,
                                                        answer=True)))
        return None

    def _answer_retired(self, msg: Message, link: LinkState | None, out: list[Action]) -> None:
        """A broadcast check about an op finished and forgotten here (its result went out, and
        took longer than the op lingers, over a slow link): the link alone says whether it
        still moves."""
        if link is None:
            return
        moving = not link.stalled and link.lost_at == -float("inf")
        kind = Kind.META_BCAST_SENT if moving else Kind.META_STALLED
        out.append(Send(dst=msg.src, msg=Message(kind=kind, src=self.rank, epoch=msg.epoch, step=msg.step,
                                                 chunk=msg.chunk, tree=msg.tree, chunks=msg.chunks, target=msg.target,
                                                 queued_bytes=link.pending_bytes if moving else 0, answer=moving)))

    def _on_meta_stalled(self, op: Op, msg: Message, out: list[Action]) -> None:
        """The parent of `target` cannot get the result through: send ours (or once we hold it)."""
        target = msg.target
        t = self._t(op)
        watched = t.view.neighbours(target) if target in self.view else None
        if watched is None or msg.src != watched.parent or self.rank not in (watched.brother, watched.uncle):
            return self._protocol(out, msg, "not an observer of that link")
        if op.watches.checked_at.pop((Phase.BCAST, target), None) is not None:
            out.append(Note(step=op.step, cause=Cause.WATCH_EXPIRED, peer=target, link=(target, msg.src),
                            text=f"step {op.step}: no sign that rank {target} got the result in time, and rank "
                                 f"{msg.src} says it does not get through"))
        if target in op.watches.bcast_confirmed:
            return None
        if op.bcast.result is not None:
            self._push_result(op, target, out, f"link {msg.src}->{target} is not getting it through")
        else:
            op.watches.bcast_pending.add(target)
        return None

    def _on_catchup(self, msg: Message, now: float, out: list[Action]) -> None:
        """The committed result of an op of an older view, sent straight by a holder."""
        op = self._ops.get((msg.step, msg.chunk))
        if op is None or not op.awaiting_catchup or op.done:
            out.append(Note(step=msg.step, cause=Cause.DUPLICATE_DROPPED, peer=msg.src,
                            text=f"step {msg.step}: dropped a catch-up copy of a result held already"))
            return
        if not self._matches(op, msg, now, out):
            return
        self._take_result(op, msg)
        op.bcast.contributors = msg.contributors
        op.bcast.late = msg.late
        op.done = True
        op.awaiting_catchup = False
        out.append(CancelTimer(key=self._timer(TimerKind.DEADLINE, op)))
        out.append(Note(step=op.step, cause=Cause.RESULT_CAME_AROUND, peer=msg.src,
                        text=f"step {op.step}: its result (committed in view {op.epoch}) came from rank {msg.src} "
                             f"after the view change"))
        out.append(self._completed(op))
        out.append(SetTimer(key=self._timer(TimerKind.LINGER, op), at=now + self.cfg.linger_s))

    # ---- finishing ---------------------------------------------------------------------

    def _push_result(self, op: Op, dst: int, out: list[Action], why: str) -> None:
        t = self._t(op)
        assert op.bcast.result is not None
        out.append(Send(dst=dst, msg=self._data_msg(op, Kind.DATA_BCAST, self._result_wire(op),
                                                    op.bcast.contributors, late=op.bcast.late)))
        parent = t.view.neighbours(dst).parent
        link = None if parent is None else (dst, parent)
        if dst in op.watches.detoured_for:
            out.append(Note(step=op.step, cause=Cause.DETOUR, peer=dst, link=link,
                            text=f"step {op.step}: sent the result to rank {dst} around its link to rank "
                                 f"{parent} (marked failed)"))
        else:
            out.append(Note(step=op.step, cause=Cause.RESULT_PUSHED, peer=dst, link=link,
                            text=f"step {op.step}: sent the result to rank {dst} directly ({why})"))

    def _finish(self, op: Op, now: float, out: list[Action]) -> None:
        """We hold the result: hand it up to the user and pass it down the tree."""
        t = self._t(op)
        assert op.bcast.result is not None
        op.done = True
        op.bcast.finished_at = now
        out.append(CancelTimer(key=self._timer(TimerKind.DEADLINE, op)))
        for child in t.me.children:
            if self._ft and self.cfg.link_memory and t.me.brother is not None \
                    and op.reduce.relayed_children.get(child) == t.me.brother:
                # This op's data from it came around a broken link through our brother (its
                # uncle), who gets the result from our parent and pushes it on. A relay that is
                # our own child gets the result only from us: never skip for that one, or two
                # brothers relaying for each other would each wait for the other.
                continue
            out.append(Send(dst=child, msg=self._data_msg(op, Kind.DATA_BCAST, self._result_wire(op),
                                                          op.bcast.contributors, late=op.bcast.late)))
        if self._ft:
            for observer in (t.me.brother, t.me.uncle):
                if observer is not None:
                    out.append(Send(dst=observer, msg=self._msg(op, Kind.META_BCAST_RECEIVED)))
            for child in t.me.children:
                sent = self._msg(op, Kind.META_BCAST_SENT, target=child)
                for observer in (t.me.brother, *t.me.children):
                    if observer is not None and observer != child:
                        out.append(Send(dst=observer, msg=sent))
            for k in sorted(op.watches.relayed_for | op.watches.bcast_pending):
                if k not in op.watches.bcast_confirmed:
                    self._push_result(op, k, out, "its primary link failed")
            op.watches.bcast_pending.clear()
        if t.me.parent is not None:
            op.reduce.acc = op.reduce.acc_wire = None  # our sum is in the result now: drop the buffer (see linger_s)
        op.own = None  # our contribution too: the caller's buffer may take the next step's now
        out.append(self._completed(op))
        out.append(SetTimer(key=self._timer(TimerKind.LINGER, op), at=now + self.cfg.linger_s))

    @staticmethod
    def _completed(op: Op) -> Complete:
        """The op's result for the caller: a read-only view, with whom it holds."""
        assert op.bcast.result is not None
        view = op.bcast.result.view()
        view.flags.writeable = False
        return Complete(step=op.step, chunk=op.chunk, result=view, contributors=op.bcast.contributors,
                        late=op.bcast.late)

    def _emit_failure(self, op: Op, failure: Fail, now: float, out: list[Action]) -> None:
        op.done = True
        op.failure = failure  # a late rank's caller may come for it (_late_submit)
        out.append(CancelTimer(key=self._timer(TimerKind.DEADLINE, op)))
        out.append(CancelTimer(key=self._timer(TimerKind.ROOT_DEADLINE, op)))
        out.append(failure)
        out.append(SetTimer(key=self._timer(TimerKind.LINGER, op), at=now + self.cfg.linger_s))

    def _abort(self, op: Op, code: AbortCode, reason: str, peers: tuple[int, ...], now: float,
               out: list[Action], *, remote: int = -1) -> None:
        """Fail the op here and flood ABORT to every neighbour so no one waits for a deadline."""
        t = self._t(op)
        if op.aborted:
            return
        op.aborted = True
        self._last_abort_at = now
        failure = Fail(step=op.step, chunk=op.chunk, code=code, reason=reason, peers=peers)
        if not op.done:
            if op.submitted:
                self._emit_failure(op, failure, now, out)
            else:
                op.failure = failure
        abort = self._msg(op, Kind.ABORT, reason=reason, missing=peers, code=int(code))
        for peer in t.me.all:
            if peer != remote:
                out.append(Send(dst=peer, msg=abort))

    # ---- timers ------------------------------------------------------------------------

    def _on_timer(self, event: TimerFired, now: float, out: list[Action]) -> None:
        key = event.key
        if key.kind is TimerKind.PROBE:  # `chunk` holds the tree (_probe_key)
            if 0 <= key.chunk < len(self.trees):
                self._probe(self.trees[key.chunk], now, out)
            return
        op = self._ops.get((key.step, key.chunk))
        if op is None or op.epoch != key.epoch:
            return  # that op is gone, or it is the same step run again in a later view
        if key.kind in (TimerKind.REDUCE_WATCH, TimerKind.BCAST_WATCH) and op.epoch != self.view.epoch \
                and op.epoch not in self._same_trees:
            # a committed op of a view whose trees are gone (a member left): no link to watch
            phase = Phase.REDUCE if key.kind is TimerKind.REDUCE_WATCH else Phase.BCAST
            op.watches.started.pop((phase, key.peer), None)
            return
        match key.kind:
            case TimerKind.REDUCE_WATCH:
                self._reduce_watch_fired(op, key.peer, now, out)
            case TimerKind.BCAST_WATCH:
                self._bcast_watch_fired(op, key.peer, now, out)
            case TimerKind.DEADLINE:
                if not op.done and not self._extended(op, event, self.cfg.step_timeout_s, now, out):
                    if self._t(op).me.parent is None and not op.reduce.sent:
                        self._root_gives_up(op, now, out)  # its reason names the missing ranks
                    else:
                        self._deadline(op, now, out)
            case TimerKind.STRAGGLER:
                self._close(op, now, out)
            case TimerKind.ROOT_DEADLINE:
                if not op.done and not op.reduce.sent and not self._extended(op, event, self.cfg.root_give_up_s, now,
                                                                                 out):
                    self._root_gives_up(op, now, out)
            case TimerKind.LINGER:
                self._linger_over(op, now, out)

    def _root_gives_up(self, op: Op, now: float, out: list[Action]) -> None:
        missing = tuple(sorted(set(self.view.members) - op.reduce.contributors
                               - {r for m in op.reduce.held.values() for r in m.contributors}))
        waiting = sorted(set(self._t(op).me.children) - op.reduce.got_children)
        reason = (f"no contribution from ranks {list(missing)} within {self._waited(op, now)} "
                  f"(root still waiting for the subtree sums of children {waiting})")
        self._abort(op, AbortCode.UNREACHABLE, reason, missing, now, out)

    def _linger_over(self, op: Op, now: float, out: list[Action]) -> None:
        if self.fenced:  # a holder may have to serve this result after the view change
            op.linger_over = True
        elif op.stragglers.closed_at >= 0 and not op.stragglers.taken and op.done:
            # closed without this rank, whose caller has not come for the result yet: kept for
            # it (at most CLOSE_AHEAD_STEPS steps ahead of its newest submit)
            out.append(SetTimer(key=self._timer(TimerKind.LINGER, op), at=now + self.cfg.linger_s))
        elif any(phase is Phase.BCAST for phase, _peer in op.watches.started):
            # still watching a neighbour's result on its way over a slow link: this backup node
            # must be able to send its own copy if that one gets stuck
            out.append(SetTimer(key=self._timer(TimerKind.LINGER, op), at=now + self.cfg.linger_s))
        else:
            self._retire(op)

    def _extended(self, op: Op, event: TimerFired, base_s: float, now: float, out: list[Action]) -> bool:
        """A step deadline gives up on silence, not on slowness: True (and the deadline moved on)
        if the step's bytes may still be on their way. Behind 1 Mbit/s a 1.63 MB step takes
        twenty seconds and more (a first step, cut for a LAN before a pace was agreed, three
        times that). A deadline allows for three times the step's bytes at the slowest of the
        group's pace, the slowest declared uplink, this rank's measured uplink and the slowest one
        members reported (`uplink`, from the driver). The root's, which waits for its children's
        uplinks, is also put off while a child it waits for sends tensor data (a silent child is
        evicted by the membership), up to MAX_DEADLINE_EXTENSIONS times its length. Either is
        put off while a member says it has not submitted the step and is computing it (a slow
        device), by at most submit_wait_s."""
        key = event.key
        pace = min(self.view.pace or self.cfg.uplink_bytes_per_s, self.cfg.slowest_declared)
        rate = min(pace, event.uplink) if event.uplink > 0 else pace
        end = op.started + base_s + SLACK * 3 * op.nbytes * op.chunks / rate
        if now < end:
            out.append(SetTimer(key=key, at=end))
            return True
        again = min(base_s, self.cfg.node_deadline_s)  # how soon an extended deadline looks again
        said = event.computing or {}
        computing = tuple(sorted(r for r, step in said.items() if step <= op.step and r != self.rank))
        last = op.started + base_s + self.cfg.submit_wait_s
        if computing and now < last:
            if not op.stragglers.computing and op.chunk == 0:  # one note a step
                out.append(Note(step=op.step, cause=Cause.STILL_COMPUTING, peer=computing[0],
                                seconds=now - op.started,
                                text=f"step {op.step}: ranks {list(computing)} have not submitted it yet and say they "
                                     f"are computing; waiting for them (at most {self.cfg.submit_wait_s:g} s more)"))
            op.stragglers.computing = computing
            out.append(SetTimer(key=key, at=min(now + again, last)))
            return True
        if key.kind is TimerKind.DEADLINE:
            return False
        waiting = [c for c in self._t(op).me.children if c not in op.reduce.got_children]
        if not event.alive or now - op.started >= base_s * MAX_DEADLINE_EXTENSIONS \
                or not any(c in event.alive for c in waiting):
            return False
        out.append(SetTimer(key=key, at=now + again))
        return True

    def _waited(self, op: Op, now: float) -> str:
        """How long a step was waited for, for an abort's reason: with the members it waited on
        as still computing, if it did."""
        if not op.stragglers.computing:
            return f"{now - op.started:.3g} s"
        return (f"{now - op.started:.3g} s, put off while ranks {list(op.stragglers.computing)} said they were still "
                f"computing it (by at most submit_wait_s = {self.cfg.submit_wait_s:g} s)")

    def _reduce_watch_fired(self, op: Op, origin: int, now: float, out: list[Action]) -> None:
        """No confirmation that `origin`'s sum reached its parent in time. First a check: ask the
        origin (META_REDUCE_REQUEST), which says the sum is still on its way or hands it over
        to relay. Only a check left unanswered is a watch that expired."""
        t = self._t(op)
        if origin in op.watches.reduce_confirmed or op.bcast.result is not None or op.done:
            op.watches.started.pop((Phase.REDUCE, origin), None)
            return  # holding the result proves every subtree sum reached the root
        tries = op.watches.reduce_tries[origin] = op.watches.reduce_tries.get(origin, 0) + 1
        parent = t.view.neighbours(origin).parent
        assert parent is not None
        op.watches.fired.add((Phase.REDUCE, origin))
        if tries > UNANSWERED_CHECKS:
            self.timeouts.timed_out((origin, parent, Phase.REDUCE))
            out.append(Note(step=op.step, cause=Cause.WATCH_EXPIRED, peer=origin, link=(origin, parent),
                            text=f"step {op.step}: no sign that rank {parent} got rank {origin}'s data after a "
                                 f"check; asking rank {origin} for it (try {tries})"))
        else:
            out.append(Note(step=op.step, cause=Cause.LINK_CHECKED, peer=origin, link=(origin, parent),
                            text=f"step {op.step}: no confirmation yet that rank {parent} got rank {origin}'s data; "
                                 f"asking rank {origin} whether it is getting through"))
        op.watches.checked_at.setdefault((Phase.REDUCE, origin), now)
        out.append(Send(dst=origin, msg=self._msg(op, Kind.META_REDUCE_REQUEST, target=parent)))
        if tries <= self.cfg.watch_retries + UNANSWERED_CHECKS:
            out.append(SetTimer(key=self._timer(TimerKind.REDUCE_WATCH, op, origin), at=now + self.timeouts.check_s()))
        else:
            op.watches.started.pop((Phase.REDUCE, origin), None)

    def _bcast_watch_fired(self, op: Op, target: int, now: float, out: list[Action]) -> None:
        """No confirmation that `target` got the result from its parent in time. First a check:
        ask the parent (META_BCAST_REQUEST), which says the result is still on its way or that
        it is stuck (META_STALLED). Only a check left unanswered is a watch that expired: then
        this backup node sends the result itself."""
        t = self._t(op)
        if target in op.watches.bcast_confirmed:
            op.watches.started.pop((Phase.BCAST, target), None)
            return
        tries = op.watches.bcast_tries[target] = op.watches.bcast_tries.get(target, 0) + 1
        parent = t.view.neighbours(target).parent
        assert parent is not None
        op.watches.fired.add((Phase.BCAST, target))
        wait = self.timeouts.check_s()
        if tries <= UNANSWERED_CHECKS:
            op.watches.checked_at.setdefault((Phase.BCAST, target), now)
            out.append(Send(dst=parent, msg=self._msg(op, Kind.META_BCAST_REQUEST, target=target)))
            out.append(Note(step=op.step, cause=Cause.LINK_CHECKED, peer=target, link=(target, parent),
                            text=f"step {op.step}: no confirmation yet that rank {target} got the result from rank "
                                 f"{parent}; asking rank {parent} whether it is getting through"))
        else:
            op.watches.checked_at.pop((Phase.BCAST, target), None)
            self.timeouts.timed_out((parent, target, Phase.BCAST))
            out.append(Note(step=op.step, cause=Cause.WATCH_EXPIRED, peer=target, link=(target, parent),
                            text=f"step {op.step}: no sign that rank {target} got the result from rank {parent} "
                                 f"after a check (try {tries})"))
            if op.bcast.result is not None:
                self._push_result(op, target, out, f"link {parent}->{target} looks broken")
                started = op.watches.started.get((Phase.BCAST, target))
                if started is not None:  # our copy takes as long to arrive as the parent's
                    wait = max(wait, self.timeouts.deadline_s((parent, target, Phase.BCAST), started[1], started[2]))
            else:
                op.watches.bcast_pending.add(target)
        if tries <= self.cfg.watch_retries + UNANSWERED_CHECKS:
            out.append(SetTimer(key=self._timer(TimerKind.BCAST_WATCH, op, target), at=now + wait))
        else:
            op.watches.started.pop((Phase.BCAST, target), None)

    def _deadline(self, op: Op, now: float, out: list[Action]) -> None:
        t = self._t(op)
        me = t.me
        if not op.reduce.sent:
            waiting = tuple(sorted(set(me.children) - op.reduce.got_children))
            reason = f"rank {self.rank} got no subtree sum from children {list(waiting)} within {self._waited(op, now)}"
            peers = waiting
        else:
            relays = [r for r in (me.brother, me.uncle) if r is not None]
            reason = (f"rank {self.rank} got no result from parent {me.parent} or backups {relays} "
                      f"within {self._waited(op, now)}")
            peers = tuple(r for r in (me.parent, *relays) if r is not None)
        self._emit_failure(op, Fail(step=op.step, chunk=op.chunk, code=AbortCode.TIMEOUT,
                                    reason=reason, peers=peers), now, out)

    # ---- stragglers (stragglers.py): a root closes a step without its late inputs ----------

    def _maybe_arm_close(self, op: Op, now: float, out: list[Action]) -> None:
        """As a tree's root under straggler_policy="deadline": once at most max_late inputs are
        missing and half are in, close the op straggler_grace_s past the median input."""
        st = op.stragglers
        if self.cfg.straggler_policy != "deadline" or not st.closable or st.close_armed or op.reduce.sent or op.done:
            return
        t = self._t(op)
        if t.me.parent is not None or (op.submitted and op.combine is not np.add):
            return  # only roots decide; a closed step's zeros are only neutral in a sum
        at = close_at(st.arrivals, len(t.me.children) + 1, self.cfg.max_late, self.cfg.straggler_grace_s)
        if at is not None:
            st.close_armed = True
            out.append(SetTimer(key=self._timer(TimerKind.STRAGGLER, op), at=max(at, now)))

    def _close(self, op: Op, now: float, out: list[Action]) -> None:
        """The grace is over: the missing children are told to close (their late ranks take
        part with zeros), and this root takes part with zeros if it is the late one."""
        if op.done or op.reduce.sent or self.fenced:
            return
        if op.submitted:
            assert op.reduce.acc is not None
            size, dtype, signature = op.reduce.acc.size, op.dtype, op.signature
        else:
            if not op.reduce.held:
                return
            first = next(iter(op.reduce.held.values()))
            size, dtype, signature = first.numel, data_dtype(first.dtype), first.signature
        missing = [c for c in self._t(op).me.children if c not in op.reduce.got_children]
        for child in missing:
            out.append(Note(step=op.step, cause=Cause.STEP_CLOSED, peer=child,
                            text=f"step {op.step} chunk {op.chunk}: closed without the late rank(s) below rank "
                                 f"{child}, {self.cfg.straggler_grace_s:g} s past the median input"))
        self._close_below(op, missing, size, dtype, signature, out)
        if not op.submitted:
            out.append(Note(step=op.step, cause=Cause.STEP_CLOSED, peer=self.rank,
                            text=f"step {op.step} chunk {op.chunk}: closed without this root's own late contribution, "
                                 f"{self.cfg.straggler_grace_s:g} s past the median input"))
            self._close_here(op, size, dtype, signature, now, out)

    def _close_below(self, op: Op, children: list[int], size: int, dtype: str, signature: str,
                     out: list[Action]) -> None:
        for child in children:
            if child not in op.stragglers.closed_children:
                op.stragglers.closed_children.add(child)
                out.append(Send(dst=child, msg=self._msg(op, Kind.META_CLOSE, size=size, dtype=dtype,
                                                         signature=signature)))

    def _close_here(self, op: Op, size: int, dtype: str, signature: str, now: float, out: list[Action]) -> None:
        """This rank is late for op's step: it takes part in this op with zeros, not counted, and
        so will its caller's contribution to every chunk of the step (_late_submit)."""
        self._closed_steps.setdefault(op.step, now)
        while len(self._closed_steps) > CLOSE_AHEAD_STEPS:  # the oldest were taken or are long gone
            del self._closed_steps[next(iter(self._closed_steps))]
        self._start(Submit(step=op.step, chunk=op.chunk, chunks=op.chunks, data=identity_zeros(size, dtype),
                           signature=signature, contribute=False, closable=True), now, out, late=True)

    def _on_close(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        """Our parent closed the op without the late ranks below it: pass it on to our missing
        children, and take part with zeros if we have not submitted."""
        t = self._t(op)
        if msg.src != t.me.parent:
            return self._protocol(out, msg, f"only rank {self.rank}'s parent closes its steps")
        itemsize = np.dtype(msg.dtype).itemsize if msg.dtype in ZERO_DTYPES else 0
        if not itemsize or not 0 < msg.size * itemsize <= self.cfg.max_payload_bytes:
            return self._protocol(out, msg, f"a close for {msg.size} x {msg.dtype!r}, not a chunk a step can have")
        if op.done or op.reduce.sent:
            return None  # our sum went up before the close came
        if not op.submitted and op.step > self._max_step_submitted + CLOSE_AHEAD_STEPS:
            return None  # too far behind to take part with zeros: the step waits for us
        self._close_below(op, [c for c in t.me.children if c not in op.reduce.got_children], msg.size, msg.dtype,
                          msg.signature, out)
        if not op.submitted:
            self._close_here(op, msg.size, msg.dtype, msg.signature, now, out)
        return None

    # ---- link memory, probes, hard failures ----------------------------------------------

    def _sample(self, op: Op, phase: Phase, peer: int, now: float) -> None:
        """A confirmation arrived: feed the watch's duration to the timeout policy (Karn: not
        if the watch already fired)."""
        t = self._t(op)
        started = op.watches.started.pop((phase, peer), None)
        op.watches.checked_at.pop((phase, peer), None)
        if started is None or (phase, peer) in op.watches.fired:
            return
        parent = t.view.neighbours(peer).parent
        if parent is not None:
            self.timeouts.observe((peer, parent, phase), now - started[0], started[1], started[2])

    def _heal_hold_s(self, t: _Tree) -> float:
        return float(min(self.cfg.heal_after_s * 2.0 ** max(0, t.up.failures - 1), self.cfg.max_heal_after_s))

    def _mark_up_failed(self, t: _Tree, why: str, now: float, out: list[Action]) -> None:
        parent = t.me.parent
        if not self._ft or not self.cfg.link_memory or parent is None:
            return
        if t.up.failed:
            t.up.healthy_since = None  # still failing: the healthy run starts over
            return
        relays = tuple(r for r in (t.me.brother, t.me.uncle) if r is not None)
        if not relays:
            return
        t.up = _UpLink(failed=True, relays=relays, failures=t.up.failures + 1)
        out.append(Note(step=self._max_step_submitted, cause=Cause.LINK_MARKED_FAILED, peer=parent,
                        link=(self.rank, parent),
                        text=f"link {self.rank}->{parent} marked failed ({why}); routing through "
                             f"rank {t.up.via} "
                             f"until it answers probes for {self._heal_hold_s(t):g} s{t.label}"))
        out.append(SetTimer(key=self._probe_key(t), at=now + self.cfg.probe_interval_s))

    def _probe_key(self, t: _Tree) -> TimerKey:
        """The probe timer of tree `t`'s uplink (`chunk` holds the tree: the uplinks differ)."""
        return TimerKey(TimerKind.PROBE, -1, t.tree, -1 if t.me.parent is None else t.me.parent)

    def _probe(self, t: _Tree, now: float, out: list[Action]) -> None:
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

    def _on_probe_ack(self, t: _Tree, now: float, out: list[Action]) -> None:
        if not t.up.failed:
            return
        t.up.probe_sent_at = None
        if t.up.healthy_since is None:
            t.up.healthy_since = now
        elif now - t.up.healthy_since >= self._heal_hold_s(t):
            held = now - t.up.healthy_since
            t.up = _UpLink(failures=t.up.failures)
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

    def _link_down_in(self, t: _Tree, peer: int, reason: str, now: float, out: list[Action]) -> None:
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
