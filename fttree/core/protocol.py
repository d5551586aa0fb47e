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
its own neighbours, subtrees, link memory and broken-child set (`Tree`, tree_links.py); an op
runs on one tree, and everything above (observers, relays, pushes, exactly-once) happens in
that tree.
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

import numpy as np

from .buffers import BufferPool
from .config import Config

# (`X as X`: re-exported, other modules import the machine's events, effects and status from here)
from .effects import AbortCode as AbortCode
from .effects import Action as Action
from .effects import CancelTimer as CancelTimer
from .effects import Cause as Cause
from .effects import Complete as Complete
from .effects import Fail as Fail
from .effects import Foreign as Foreign
from .effects import LinkState as LinkState
from .effects import Note as Note
from .effects import NoteKind as NoteKind
from .effects import Send as Send
from .effects import SetTimer as SetTimer
from .effects import TimerKey as TimerKey
from .effects import TimerKind as TimerKind
from .effects import Void as Void
from .events import Event as Event
from .events import LinkDown as LinkDown
from .events import Received as Received
from .events import Submit as Submit
from .events import TimerFired as TimerFired
from .machine_base import PEER_SHARE
from .machine_status import MachineStatus as MachineStatus
from .machine_status import OpPhase as OpPhase
from .machine_status import OpStatus as OpStatus
from .machine_status import TreeStatus as TreeStatus
from .machine_status import UplinkStatus as UplinkStatus
from .messages import COMPRESSIONS, Kind, Message
from .op_state import Op, OpId
from .reduce_ops import REDUCE_OPS
from .roles import ROLE_RULES, role_allows
from .timeouts import Phase
from .topology import Neighbours
from .tree_bcast import Broadcast
from .tree_close import StragglerClose
from .tree_deadlines import Deadlines
from .tree_links import LinkMemory, Tree, UpLink
from .tree_reduce import Reduce
from .tree_watches import Watching
from .view import View

# Sum buffers the machine tracks for reuse (buffers.py): one per op this rank adds into, held
# until it sent its sum on, or at a root (where the sum is the result) until the op lingers out.
SUM_BUFFERS = 32
# Working arrays of wire compression (a received bf16 sum decoded before it is added, the
# encoder's uint32 array): each is let go of at once, so a few cover every chunk. Fresh ones
# cost more than the decoding: 147 us against 17 us for a 333 KB chunk, in page faults.
SCRATCH_BUFFERS = 4


class TreeMachine(Reduce, Broadcast, Watching, StragglerClose, Deadlines, LinkMemory):
    """One rank's protocol state for all ops in flight. Deterministic: the same events at the
    same times give the same actions.

    Mixed from its parts, a module each (machine_base.py names them and what they share);
    this class holds the entrances: view changes (install, activate, expect), the local submit,
    and the routing of every frame and timer to the part that handles it."""

    def __init__(self, rank: int, view: View, config: Config | None = None) -> None:
        # (MachineBase declares each of these with what it holds)
        self.rank = rank
        self.view = view
        self.cfg = config or Config()
        self._rates = None
        self._earlier_rates = {}
        self._bf16_up = False
        self.trees = self._build_trees(view)
        self._ops = {}
        self._retired = set()
        self._retired_order = deque()
        self._retired_floor = -1
        self._max_step_submitted = -1
        self._last_abort_at = -float("inf")
        self.timeouts = self.cfg.make_timeouts()
        self.fenced = False
        self._later: deque[Message] = deque()  # frames of a view not installed yet (_hold_later)
        self._later_by_src: dict[int, int] = {}  # how many of them each rank sent
        self._expected = None
        self._closed_steps = {}
        self._same_trees = set()
        self.buffers = BufferPool(keep=SUM_BUFFERS)
        self.scratch = BufferPool(keep=SCRATCH_BUFFERS)
        self.empty_sums = 0
        self._made = {}
        self._swept_at = {}
        self.ops_refused = 0
        self._refusals_noted = set()
        self.ops_reclaimed = 0

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
            self._claim(op)
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
        for msg in self._take_later():
            if msg.epoch == view.epoch:
                self._on_message(msg, now, out)
            else:
                self._hold_later(msg, out)
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
        for msg in self._take_later():
            if msg.epoch >= view.epoch:
                self._on_message(msg, now, out)

    def _hold_later(self, msg: Message, out: list[Action]) -> None:
        """Keep a frame of a view not installed here (its commit is on its way): up to
        max_ops_ahead of them, a rank's frames at most a PEER_SHARE of those, so that one
        member's flood neither holds more nor pushes out the others' frames (their bytes are
        bounded before: the replica's early bytes). A frame past that is dropped and counted."""
        held = self._later_by_src.get(msg.src, 0)
        if len(self._later) >= self.cfg.max_ops_ahead or held >= self.cfg.max_ops_ahead // PEER_SHARE:
            self._refuse(msg.step, msg.src, out, "later", f"view {msg.epoch}, not installed here: rank {msg.src} "
                                                          f"has {held} frames of later views held here, "
                                                          f"{len(self._later)} from all ranks (max_ops_ahead "
                                                          f"{self.cfg.max_ops_ahead}, a rank's share 1/{PEER_SHARE})")
            return
        self._later.append(msg)
        self._later_by_src[msg.src] = held + 1

    def _take_later(self) -> deque[Message]:
        """The frames of later views held here, handed over: none held from now."""
        later, self._later = self._later, deque()
        self._later_by_src = {}
        return later

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

    def footprint(self) -> dict[str, int]:
        """Sizes of everything this machine keeps between events: none may grow with the
        number of ops run (tests check it over many thousands of ops)."""
        return {"ops": len(self._ops), "active_ops": sum(not op.done for op in self._ops.values()),
                "retired": len(self._retired), "closed_steps": len(self._closed_steps),
                "held": sum(len(op.reduce.held) for op in self._ops.values()),
                "unclaimed": sum(self._made.values()), "makers": len(self._made), "swept": len(self._swept_at)}

    # ---- the trees (trees.py) ---------------------------------------------------------

    def _build_trees(self, view: View) -> tuple[Tree, ...]:
        self._rates, self._bf16_up = self._follow_uplinks(view)
        family = self.cfg.trees
        return tuple(Tree.build(family, t, view, self.rank) for t in range(view.tree_count(family)))

    @property
    def me(self) -> Neighbours:
        """This rank's neighbours in tree 0 (the tree every rank is interior or leaf of as in
        the single tree; membership watches these)."""
        return self.trees[0].me

    @property
    def up(self) -> UpLink:
        """Link memory of this rank's uplink in tree 0."""
        return self.trees[0].up

    @property
    def down_failed(self) -> set[int]:
        """Tree 0's children whose link to us is known broken."""
        return self.trees[0].down_failed

    # ---- ops: made, found, retired ----------------------------------------------------

    def is_past_epoch(self, epoch: int) -> bool:
        """Are frames of view `epoch` out of date here? Those of an earlier view are, unless it
        had these very members (a pace change): its ops run on, and their frames still count."""
        return epoch < self.view.epoch and epoch not in self._same_trees

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

    def _start(self, ev: Submit, now: float, out: list[Action], *, late: bool = False) -> None:
        """Our contribution to an op (`late`: zeros, this rank being late; not counted)."""
        op_id = (ev.step, ev.chunk)
        if ev.data.ndim != 1:
            raise ValueError("Submit.data must be a 1-D array")
        self._max_step_submitted = max(self._max_step_submitted, ev.step)
        op = self._ops.get(op_id) or self._ops.setdefault(op_id, Op(step=ev.step, chunk=ev.chunk,
                                                                    epoch=self.view.epoch, chunks=ev.chunks,
                                                                    tree=self.tree_of(ev.chunk, ev.chunks)))
        if op.maker >= 0:  # a peer's frame made it: this rank answers for it now
            self._claim(op)
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

    # ---- messages ----------------------------------------------------------------------

    def _on_message(self, msg: Message, now: float, out: list[Action], link: LinkState | None = None) -> None:
        expected = self._expected
        if msg.epoch != self.view.epoch and (expected is None or msg.epoch != expected.epoch):
            if msg.epoch > self.view.epoch:
                self._hold_later(msg, out)  # a view we are about to install (its commit is on its way)
                return
            if msg.epoch in self._same_trees:  # an op of an earlier pace: its trees are ours
                held = self._ops.get(msg.op)
                if msg.kind is Kind.META_BCAST_REQUEST and (held is None or held.epoch != msg.epoch):
                    if self._frame_tree(msg, now, out) is not None:
                        self._answer_retired(msg, link, out)
                    return
                if held is not None and held.epoch == msg.epoch:
                    return self._on_op_message(msg, now, out, link)
            out.append(Note(step=msg.step, cause=Cause.STALE_DROPPED, peer=msg.src,
                            text=f"dropped {msg.kind.name} of view {msg.epoch} from rank {msg.src}"))
            return
        self._on_op_message(msg, now, out, link)

    def _frame_tree(self, msg: Message, now: float, out: list[Action]) -> Tree | None:
        """The tree `msg` belongs to (its op's, by the tree rule; a probe's, by its `tree`), if
        its sender may send it there (roles.ROLE_RULES: a frame from any other rank is Foreign,
        dropped and counted before any handler sees it). The role is checked in the tree the
        frame names, where this rank has it: only a frame that fits its own tree can say the
        workers differ in their trees (`_tree_mismatch`, which fails the op everywhere); one its
        sender could not send there makes no op and no abort (a member's flood of them filled
        max_live_ops on every rank, the ABORTs making ops on its neighbours in turn)."""
        named = msg.tree
        trees = self.trees
        if 0 <= named < len(trees) and not role_allows(msg, trees[named].me, trees[named].roles):
            out.append(Foreign(msg=msg, rule=ROLE_RULES[msg.kind]))
            return None
        probe = msg.kind is Kind.PROBE or msg.kind is Kind.PROBE_ACK
        tree = named if probe else self.tree_of(msg.chunk, msg.chunks, msg.epoch)  # a probe: its tree's uplink
        if named != tree or not 0 <= tree < len(self.trees):
            self._tree_mismatch(msg, tree, now, out)
            return None
        return self.trees[tree]

    def _on_op_message(self, msg: Message, now: float, out: list[Action], link: LinkState | None) -> None:
        if msg.kind is Kind.CATCHUP:  # from any member that holds the result (ROLE_RULES): no tree
            self._on_catchup(msg, now, out)
            return
        t = self._frame_tree(msg, now, out)
        if t is None:
            return
        if msg.kind is Kind.PROBE:  # (from a child, ROLE_RULES: as every check of a sender's role below)
            ack = Message(kind=Kind.PROBE_ACK, src=self.rank, epoch=self.view.epoch, step=msg.step, tree=t.tree)
            out.append(Send(dst=msg.src, msg=ack))
            return
        if msg.kind is Kind.PROBE_ACK:
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
