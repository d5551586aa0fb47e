"""The reduce up a tree: a rank adds its children's subtree sums into its own contribution and
sends the sum to its parent, telling its backup nodes.

Sums are added in slot order (float addition is not associative: the same bits on every run),
each checked first: its sender may relay for that origin, its contributors are a fresh part of
the origin's subtree, its tensor matches ours (or the op aborts everywhere). A sum goes around
an uplink that link memory marked failed (tree_links.py), and the origin answers a backup
node's check on its sum: still moving, or here it is to relay.
"""

from __future__ import annotations

import numpy as np

from .effects import AbortCode, Action, CancelTimer, Cause, LinkState, Note, Send, TimerKind
from .machine_base import MachineBase
from .messages import COMPRESSIONS, Kind, Message, from_wire, to_wire
from .op_state import Op


class Reduce(MachineBase):
    """A part of TreeMachine (protocol.py), which mixes it in: no state of its own."""

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

    def _matches(self, op: Op, msg: Message, now: float, out: list[Action]) -> bool:
        """True if msg's tensor matches ours; otherwise abort the op everywhere."""
        red = op.reduce
        if not op.submitted:
            return True
        assert red.acc is not None
        if msg.signature == op.signature and self._accepts(op, msg.dtype) and msg.numel == red.acc.size \
                and msg.chunks == op.chunks:
            return True
        reason = (f"tensor mismatch: rank {msg.src} sent {msg.signature} ({msg.numel} x {msg.dtype}) "
                  f"for chunk {op.chunk} of {msg.chunks}, rank {self.rank} has {op.signature} "
                  f"({red.acc.size} x {op.dtype}, chunk {op.chunk} of {op.chunks})")
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
        red = op.reduce
        if not self.cfg.ordered_sums:  # as they came
            for origin in list(red.held):
                self._add(op, red.held.pop(origin))
                red.added += 1
            return
        children = self._t(op).me.children
        while red.added < len(children) and children[red.added] in red.held:
            self._add(op, red.held.pop(children[red.added]))
            red.added += 1

    def _add(self, op: Op, msg: Message) -> None:
        red = op.reduce
        assert red.acc is not None
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
        if red.acc is op.own:  # the first sum: into a buffer of its own, so our contribution stays as it was
            red.acc = op.combine(op.own, incoming, out=self.buffers.array(op.own.size, op.own.dtype))
        else:
            op.combine(red.acc, incoming, out=red.acc)
        red.contributors.update(msg.contributors)
        op.stragglers.late.update(msg.late)

    def _maybe_send_up(self, op: Op, now: float, out: list[Action]) -> None:
        red = op.reduce
        t = self._t(op)
        if not op.submitted or red.sent or op.done or len(red.got_children) < len(t.me.children):
            return
        assert red.acc is not None
        red.sent = True
        red.sent_at = now
        contributors = tuple(sorted(red.contributors))
        parent = t.me.parent
        if parent is None:  # the root: its subtree sum is the result
            if self.fenced:
                red.sent = False  # a view change is being agreed: no result of this view now
                return
            if op.wire != op.dtype:
                # Compressed: the result is what the encoding holds, here as on every other
                # rank (they decode the bytes we send), so all of them agree bit for bit.
                encoded = to_wire(red.acc, op.wire, self.scratch)
                op.bcast.wire = (encoded, op.wire)
                # decoded into the sum's own buffer, done with now (never into our contribution)
                into = None if red.acc is op.own else red.acc
                op.bcast.result = red.acc = from_wire(encoded.data.cast("B"), op.wire, op.dtype, into=into)
            else:
                if red.acc is op.own:  # a root without children: the result is a copy, never our contribution
                    red.acc = red.acc.copy()
                op.bcast.result = red.acc
            op.bcast.contributors = contributors
            op.bcast.late = tuple(sorted(op.stragglers.late))
            out.append(CancelTimer(key=self._timer(TimerKind.ROOT_DEADLINE, op)))
            out.append(CancelTimer(key=self._timer(TimerKind.STRAGGLER, op)))
            self._finish(op, now, out)
            return
        if self._ft and t.up.failed and t.up.relays:
            # link memory: straight to every backup, no timeout to pay. Both, because we cannot
            # tell which of them still reaches our parent; the parent adds the first copy only.
            red.rerouted = red.rerouted_planned = True
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

    def _on_data_reduce(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        red = op.reduce
        t = self._t(op)
        origin = msg.origin  # a child of ours; the sender is it or a backup of it (roles.ROLE_RULES)
        if msg.src == origin:  # any direct copy, even a late duplicate, proves the link works
            t.down_failed.discard(origin)
        if op.done:
            return
        if origin in red.got_children:
            out.append(Note(step=op.step, cause=Cause.DUPLICATE_DROPPED, peer=msg.src,
                            text=f"step {op.step}: dropped a second copy of rank {origin}'s subtree sum"))
            return
        contributors = set(msg.contributors)
        # (empty is allowed: a joiner still receiving its state takes part without contributing;
        # such a sum counts as the child's arrival, and _add adds none of its bytes)
        if not contributors <= t.subtrees[origin] or contributors & red.contributors:
            return self._protocol(out, msg, f"contributors {sorted(contributors)} are not a fresh part "
                                            f"of rank {origin}'s subtree")
        late = set(msg.late)
        if not late <= t.subtrees[origin] or late & (contributors | red.contributors | op.stragglers.late):
            return self._protocol(out, msg, f"late ranks {sorted(late)} are not a fresh part of rank {origin}'s "
                                            f"subtree apart from its contributors")
        if not self._matches(op, msg, now, out):
            return
        red.got_children.add(origin)
        red.held[origin] = msg
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
            red.relayed_children[origin] = msg.src
        if self._ft:
            confirm = self._msg(op, Kind.META_REDUCE_RECEIVED, origin=origin)
            for observer in (t.me.brother, *t.me.children):
                if observer is not None and observer != origin:
                    out.append(Send(dst=observer, msg=confirm))
        self._maybe_send_up(op, now, out)
        return None

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
