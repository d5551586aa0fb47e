"""Backup-node watches: this rank as brother or uncle of a neighbour's primary link.

It hears "sent" and waits for "received". Silence past the timeout (timeouts.py: the bytes
queued ahead at the uplink's rate) is first a check, which the sender answers with fresh
figures (the watch starts over) or by saying it is stuck; only a check left unanswered makes
this rank relay the sum or push the result itself. Watches that end in a confirmation feed
the timeout policy (Karn: not one that fired).
"""

from __future__ import annotations

from .effects import Action, Cause, Note, Send, SetTimer, TimerKind
from .machine_base import MachineBase
from .messages import Kind, Message
from .op_state import Op
from .timeouts import Phase

# A backup node acts on a watch only after this many checks went unanswered: one answer that
# waited behind a slow uplink's data is not a dead sender.
UNANSWERED_CHECKS = 2


class Watching(MachineBase):
    """A part of TreeMachine (protocol.py), which mixes it in: no state of its own."""

    def _on_meta_reduce_sent(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        """The origin sent its subtree sum to `target`: watch for the parent's confirmation. The
        same frame answers a check (the sum is still on its way): the watch starts over."""
        origin = msg.src  # we watch its uplink to `target` (roles.ROLE_RULES)
        if origin in op.watches.reduce_confirmed or not self._ft:
            return None
        self._arm_watch(op, Phase.REDUCE, origin, (origin, msg.target, Phase.REDUCE), msg, now, out)
        return None

    def _arm_watch(self, op: Op, phase: Phase, peer: int, key: tuple[int, int, Phase], msg: Message,
                   now: float, out: list[Action]) -> None:
        """(Re)start the watch of `peer`'s link in `phase` with the figures `msg` carries: what
        its sender had queued, unacknowledged, and the rate its uplink sends at."""
        w = op.watches
        checked = w.checked_at.pop((phase, peer), None) if msg.answer else None
        if checked is not None:  # the answer to our check: the frame is on its way, the watch starts over
            self.timeouts.observe_check(now - checked)
            w.fired.add((phase, peer))  # Karn: this watch gives no sample
            (w.bcast_tries if phase is Phase.BCAST else w.reduce_tries)[peer] = 0
            if not msg.queued_bytes:  # delivered to the far end, which has not confirmed: not forever
                heard = w.delivered_heard[(phase, peer)] = w.delivered_heard.get((phase, peer), 0) + 1
                if heard > self.cfg.watch_retries + 1:
                    if phase is Phase.BCAST and op.bcast.result is not None:
                        self._push_result(op, peer, out, f"rank {msg.src} delivered it {heard} times "
                                                         f"over without a confirmation")
                    w.started.pop((phase, peer), None)
                    return
        elif msg.answer or (phase, peer) in w.started:
            return  # a second announcement of the same watch (an answer that came late)
        else:
            (w.bcast_tries if phase is Phase.BCAST else w.reduce_tries).setdefault(peer, 0)
        rate = float(msg.rate) or self.cfg.uplink_bytes_per_s
        w.started[(phase, peer)] = (now, msg.queued_bytes, rate)
        kind = TimerKind.BCAST_WATCH if phase is Phase.BCAST else TimerKind.REDUCE_WATCH
        wait = self.timeouts.deadline_s(key, msg.queued_bytes, rate)
        if checked is not None and not msg.queued_bytes:
            # the far end has it all: its confirmation leaves through its own uplink, behind
            # its own data, and it may be busy adding; give it a node deadline
            wait = max(wait, self.cfg.node_deadline_s)
        out.append(SetTimer(key=self._timer(kind, op, peer), at=now + wait))

    def _on_data_reduce_request(self, op: Op, msg: Message, out: list[Action]) -> None:
        origin = msg.src  # we watch its uplink to `target` (roles.ROLE_RULES)
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

    def _on_meta_bcast_sent(self, op: Op, msg: Message, now: float, out: list[Action]) -> None:
        """`target`'s parent sent it the result: watch for its confirmation (or, as the answer
        to a check, the result is still on its way: the watch starts over)."""
        target = msg.target  # we watch its uplink to the sender (roles.ROLE_RULES)
        if target in op.watches.bcast_confirmed or not self._ft:
            return None
        self._arm_watch(op, Phase.BCAST, target, (msg.src, target, Phase.BCAST), msg, now, out)
        return None

    def _on_meta_stalled(self, op: Op, msg: Message, out: list[Action]) -> None:
        """The parent of `target` cannot get the result through: send ours (or once we hold it)."""
        target = msg.target  # we watch its uplink to the sender (roles.ROLE_RULES)
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

    def _sample(self, op: Op, phase: Phase, peer: int, now: float) -> None:
        """A confirmation arrived: feed the watch's duration to the timeout policy (Karn: not
        if the watch already fired)."""
        w = op.watches
        t = self._t(op)
        started = w.started.pop((phase, peer), None)
        w.checked_at.pop((phase, peer), None)
        if started is None or (phase, peer) in w.fired:
            return
        parent = t.view.neighbours(peer).parent
        if parent is not None:
            self.timeouts.observe((peer, parent, phase), now - started[0], started[1], started[2])
