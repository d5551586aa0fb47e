"""The broadcast down a tree: taking the result once, passing it to the children and telling
their backup nodes.

Also the parent's answer to a backup node's check on a child's copy (still moving, or stuck),
the result pushed straight to a rank whose link failed, and a committed result that comes
straight from a holder after a view change (CATCHUP).
"""

from __future__ import annotations

import numpy as np

from .effects import Action, CancelTimer, Cause, Complete, LinkState, Note, Send, SetTimer, TimerKind
from .machine_base import MachineBase
from .messages import Kind, Message, from_wire, wire_unit
from .op_state import Op


class Broadcast(MachineBase):
    """A part of TreeMachine (protocol.py), which mixes it in: no state of its own."""

    def _result_wire(self, op: Op) -> tuple[np.ndarray, str]:
        """The result as it travels: the encoded form the root made (or we received), never
        encoded again here, so every rank decodes the same bytes."""
        bc = op.bcast
        assert bc.result is not None
        return bc.wire if bc.wire is not None else (bc.result, bc.result.dtype.str)

    def _take_result(self, op: Op, msg: Message) -> np.ndarray:
        bc = op.bcast
        assert msg.payload is not None
        bc.result = result = from_wire(msg.payload, msg.dtype, op.dtype)
        if msg.dtype != op.dtype:  # keep the bytes to pass on as they came
            held = np.frombuffer(msg.payload, dtype=wire_unit(msg.dtype))
            bc.wire = (held, msg.dtype)
        return result

    def _on_data_bcast(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        bc = op.bcast
        t = self._t(op)
        if self.fenced:  # a view change is being agreed; what we reported held is final
            out.append(Note(step=op.step, cause=Cause.STALE_DROPPED, peer=msg.src,
                            text=f"step {op.step}: dropped a result during a view change"))
            return None
        if bc.result is not None or op.done:
            out.append(Note(step=op.step, cause=Cause.DUPLICATE_DROPPED, peer=msg.src,
                            text=f"step {op.step}: dropped a second copy of the result"))
            return None
        if not op.submitted:  # the result holds our contribution, so it cannot come first
            return self._protocol(out, msg, "a result for a step this rank has not submitted")
        if not self._matches(op, msg, now, out):
            return None
        self._take_result(op, msg)
        bc.contributors = msg.contributors
        bc.late = msg.late
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

    def _on_meta_bcast_request(self, op: Op, msg: Message, out: list[Action],
                               link: LinkState | None) -> None:
        """A backup node of our child `target` saw no confirmation of the result we sent it: say
        whether it is still on its way (META_BCAST_SENT with fresh figures) or stuck
        (META_STALLED: the backup node sends its own copy)."""
        target = msg.target  # our child; the sender, its brother or uncle (roles.ROLE_RULES)
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

    def _push_result(self, op: Op, dst: int, out: list[Action], why: str) -> None:
        bc = op.bcast
        t = self._t(op)
        assert bc.result is not None
        out.append(Send(dst=dst, msg=self._data_msg(op, Kind.DATA_BCAST, self._result_wire(op),
                                                    bc.contributors, late=bc.late)))
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
        w = op.watches
        bc = op.bcast
        t = self._t(op)
        assert bc.result is not None
        op.done = True
        bc.finished_at = now
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
                                                          bc.contributors, late=bc.late)))
        if self._ft:
            for observer in (t.me.brother, t.me.uncle):
                if observer is not None:
                    out.append(Send(dst=observer, msg=self._msg(op, Kind.META_BCAST_RECEIVED)))
            for child in t.me.children:
                sent = self._msg(op, Kind.META_BCAST_SENT, target=child)
                for observer in (t.me.brother, *t.me.children):
                    if observer is not None and observer != child:
                        out.append(Send(dst=observer, msg=sent))
            for k in sorted(w.relayed_for | w.bcast_pending):
                if k not in w.bcast_confirmed:
                    self._push_result(op, k, out, "its primary link failed")
            w.bcast_pending.clear()
        if t.me.parent is not None:
            op.reduce.acc = op.reduce.acc_wire = None  # our sum is in the result now: drop the buffer (see linger_s)
        op.own = None  # our contribution too: the caller's buffer may take the next step's now
        out.append(self._completed(op))
        out.append(SetTimer(key=self._timer(TimerKind.LINGER, op), at=now + self.cfg.linger_s))

    @staticmethod
    def _completed(op: Op) -> Complete:
        """The op's result for the caller: a read-only view, with whom it holds."""
        bc = op.bcast
        assert bc.result is not None
        view = bc.result.view()
        view.flags.writeable = False
        return Complete(step=op.step, chunk=op.chunk, result=view, contributors=bc.contributors,
                        late=bc.late)
