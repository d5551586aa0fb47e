"""How an op stops waiting: deadlines, aborts, failures, and the linger before it is retired.

A deadline gives up on silence, not slowness: it is put off while the step's bytes may still
be on their way or a member says it is still computing. The root that gives up floods ABORT
naming the ranks whose contributions never came; every rank adds whom it waited for. A
finished op lingers (linger_s) to serve late checks and catch-ups before it is retired.
"""

from __future__ import annotations

from .effects import AbortCode, Action, CancelTimer, Cause, Fail, Note, Send, SetTimer, TimerKind
from .events import TimerFired
from .machine_base import MachineBase
from .messages import Kind, Message
from .op_state import Op
from .timeouts import SLACK, Phase

# The root's deadline is put off while the children it waits for send bytes, up to this many
# times its length in all: a step is given up on for silence, not slowness, but never waits for ever.
MAX_DEADLINE_EXTENSIONS = 20


class Deadlines(MachineBase):
    """A part of TreeMachine (protocol.py), which mixes it in: no state of its own."""

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
