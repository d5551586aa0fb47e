"""What every part of the tree machine may use: its state, and the helpers that each part needs.

The tree machine (protocol.py) is one class mixed from parts, a module each: the reduce
(tree_reduce.py), the broadcast (tree_bcast.py), the backup-node watches (tree_watches.py),
the straggler close (tree_close.py), deadlines and aborts (tree_deadlines.py) and link memory
(tree_links.py). Each part derives from `MachineBase`: here are the state they share (set in
TreeMachine.__init__), the helpers (an op's frames and timers, its tree, finding and retiring
ops), and, declared abstract, the few methods one part calls on another. Method lookup through
the mixed-in class costs what it did in one class: the per-frame code gains no layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from .buffers import BufferPool
from .config import Config
from .effects import AbortCode, Action, Cause, Complete, Note, TimerKey, TimerKind
from .events import Submit
from .messages import Kind, Message, wire_numel
from .op_state import Op, OpId
from .shares import measured_rates, plan, tree_of_planned, uniform
from .stragglers import CLOSE_AHEAD_STEPS
from .timeouts import TimeoutPolicy
from .trees import tree_of
from .view import View

if TYPE_CHECKING:
    from .tree_links import Tree

# One peer's frames make at most max_live_ops // PEER_SHARE ops here that this rank has not
# submitted (`Op.maker`): a key holder's flood of frames for steps that will never run here
# fills its own share, never the table the other members' frames need (docs/security.md).
PEER_SHARE = 4
# An op a peer made for a step this many steps below this rank's newest submit, and still not
# submitted here, never will be (steps are submitted in order, every chunk at once; a late rank
# takes part with zeros at most CLOSE_AHEAD_STEPS ahead): a full share lets go of such ops.
UNCLAIMED_STALE_STEPS = CLOSE_AHEAD_STEPS + 1


class MachineBase(ABC):
    """The tree machine's shared state and helpers; TreeMachine (protocol.py) is the class to use."""

    rank: int
    view: View
    cfg: Config
    trees: tuple[Tree, ...]  # this rank's place in every tree of the view, tree 0 first (trees.py)
    timeouts: TimeoutPolicy
    fenced: bool  # a view change is being agreed: take and produce no results
    buffers: BufferPool  # where subtree sums are added up
    scratch: BufferPool  # compression's working arrays
    empty_sums: int  # subtree sums that named no contributor: taken as the child's arrival, none of it added
    _ops: dict[OpId, Op]
    _retired: set[OpId]
    _retired_order: deque[OpId]  # the same ids, oldest retired first
    _retired_floor: int  # ops of steps below this are retired too
    _max_step_submitted: int
    _last_abort_at: float
    _closed_steps: dict[int, float]  # steps this rank took part in with zeros, late -> when
    _same_trees: set[int]  # earlier epochs of these very members (pace changes): their ops go on
    _expected: View | None  # a decided view of the same members, in effect from a later step
    _rates: tuple[float, ...] | None  # the members' unequal uplinks (None: even shares)
    _earlier_rates: dict[int, tuple[float, ...] | None]  # those of the _same_trees epochs
    _bf16_up: bool  # a slow uplink: float32 sums go up as bf16 (Config.bf16_uplinks_below)
    _made: dict[int, int]  # peer -> ops its frames made here that this rank has not submitted (Op.maker)
    _swept_at: dict[int, int]  # peer -> this rank's newest submit when its full share was last swept
    ops_refused: int  # frames dropped: over their sender's share (PEER_SHARE: ops, later views), or a cut not ours
    _refusals_noted: set[str]  # the reasons of those noted once ("share", "cut", "later")
    ops_reclaimed: int  # ops a peer made for steps long past here and never submitted, let go of

    # ---- one part calls these on another (each is implemented in the part named) -----------

    @abstractmethod
    def _start(self, ev: Submit, now: float, out: list[Action], *, late: bool = False) -> None:
        """Our contribution to an op (protocol.py)."""

    @abstractmethod
    def _matches(self, op: Op, msg: Message, now: float, out: list[Action]) -> bool:
        """Does msg's tensor match ours? Otherwise the op aborts everywhere (tree_reduce.py)."""

    @abstractmethod
    def _acc_wire(self, op: Op) -> tuple[np.ndarray, str]:
        """Our subtree sum as it travels (tree_reduce.py)."""

    @abstractmethod
    def _finish(self, op: Op, now: float, out: list[Action]) -> None:
        """We hold the result: to the caller and down the tree (tree_bcast.py)."""

    @staticmethod
    @abstractmethod
    def _completed(op: Op) -> Complete:
        """The op's result for the caller (tree_bcast.py)."""

    @abstractmethod
    def _push_result(self, op: Op, dst: int, out: list[Action], why: str) -> None:
        """The result straight to `dst`, whose link failed (tree_bcast.py)."""

    @abstractmethod
    def _maybe_arm_close(self, op: Op, now: float, out: list[Action]) -> None:
        """A root may close the op without its late inputs (tree_close.py)."""

    @abstractmethod
    def _abort(self, op: Op, code: AbortCode, reason: str, peers: tuple[int, ...], now: float,
               out: list[Action], *, remote: int = -1) -> None:
        """Fail the op here and flood ABORT (tree_deadlines.py)."""

    @abstractmethod
    def _mark_up_failed(self, t: Tree, why: str, now: float, out: list[Action]) -> None:
        """Link memory: tree `t`'s uplink is failed (tree_links.py)."""

    # ---- the trees (trees.py) and an op's frames ------------------------------------------

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

    def _t(self, op: Op) -> Tree:
        return self.trees[op.tree]

    @property
    def peers(self) -> tuple[int, ...]:
        """Every rank this one exchanges frames with: its neighbours in every tree (the
        transport connects to these at start)."""
        if len(self.trees) == 1:
            return self.trees[0].me.all
        return tuple(sorted({r for t in self.trees for r in t.me.all}))

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
        ours = self._ops.get((step, 0))
        if ours is not None and ours.submitted and ours.chunks != chunks:
            self._refuse(step, src, out, "cut", f"step {step} chunk {chunk} of {chunks}, a step rank {self.rank} "
                                                f"cut into {ours.chunks} chunks (the chunk rule is alike everywhere)")
            return None
        made = self._made.get(src, 0)
        if made >= self.cfg.max_live_ops // PEER_SHARE:
            made = self._sweep(src)
            if made >= self.cfg.max_live_ops // PEER_SHARE:
                self._refuse(step, src, out, "share", f"step {step} chunk {chunk} of {chunks}: its frames made "
                                                      f"{made} ops here that rank {self.rank} has not submitted, "
                                                      f"its share of max_live_ops ({self.cfg.max_live_ops} // "
                                                      f"{PEER_SHARE})")
                return None
        op = self._ops[op_id] = Op(step=step, chunk=chunk, epoch=self.view.epoch if epoch is None else epoch,
                                    chunks=chunks, tree=self.tree_of(chunk, chunks, epoch), maker=src)
        self._made[src] = made + 1
        return op

    # ---- what one peer's frames make here (PEER_SHARE) -------------------------------------

    def _refuse(self, step: int, src: int, out: list[Action], reason: str, what: str) -> None:
        """A frame of rank `src` makes no op: dropped and counted, the first one of each
        `reason` noted."""
        self.ops_refused += 1
        if reason not in self._refusals_noted:
            self._refusals_noted.add(reason)
            out.append(Note(step=step, cause=Cause.PROTOCOL_VIOLATION, peer=src,
                            text=f"dropped a message of rank {src} for {what}; further ones are counted "
                                 "(ops_refused), not logged"))

    def _sweep(self, src: int) -> int:
        """Let go of the ops `src` made for steps long past here and never submitted (they never
        will be: UNCLAIMED_STALE_STEPS); how many it holds then. At most one pass over the ops
        per peer and step submitted here, so a flood at a full share costs no pass per frame."""
        newest = self._max_step_submitted
        if self._swept_at.get(src) != newest:
            self._swept_at[src] = newest
            below = newest - UNCLAIMED_STALE_STEPS
            for op_id, op in [(k, o) for k, o in self._ops.items() if o.maker == src and o.step < below]:
                del self._ops[op_id]  # not retired: no id of it is kept
                self._claim(op)
                self.ops_reclaimed += 1
        return self._made.get(src, 0)

    def _claim(self, op: Op) -> None:
        """`op` is no longer its maker's to answer for: submitted here, or gone."""
        maker = op.maker
        if maker < 0:
            return
        op.maker = -1
        left = self._made[maker] - 1
        if left:
            self._made[maker] = left
        else:
            del self._made[maker]

    def _retire(self, op: Op) -> None:
        """Forget a finished op but remember its id, so its late messages are dropped.

        At most `retired_memory` ids are kept, oldest retired first out, in O(1) per op. An id
        that falls out raises the floor to its step: every step below the floor was submitted
        here (steps are submitted in order), so an op below it is active or retired."""
        op_id = (op.step, op.chunk)
        if self._ops.pop(op_id, None) is op:
            self._claim(op)
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

    def _protocol(self, out: list[Action], msg: Message, why: str) -> None:
        out.append(Note(step=msg.step, cause=Cause.PROTOCOL_VIOLATION, peer=msg.src,
                        text=f"dropped {msg.kind.name} from rank {msg.src}: {why}"))
