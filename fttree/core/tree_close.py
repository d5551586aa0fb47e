"""The straggler close (straggler_policy="deadline", stragglers.py): a tree's root closes a
step without its late inputs.

Once at most max_late inputs are missing and half are in, the root waits straggler_grace_s past
the median input, then tells the missing children to close: the late ranks take part with
zeros, not counted. A late caller's own contribution is not added; it gets the others' result.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .effects import Action, Cause, Note, Send, SetTimer, TimerKind
from .events import Submit
from .machine_base import MachineBase
from .messages import Kind, Message
from .op_state import Op
from .stragglers import CLOSE_AHEAD_STEPS, ZERO_DTYPES, close_at, data_dtype, identity_zeros


class StragglerClose(MachineBase):
    """A part of TreeMachine (protocol.py), which mixes it in: no state of its own."""

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

    def _close_here(self, op: Op, size: int, dtype: str, signature: str, now: float,
                    out: list[Action]) -> None:
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
        t = self._t(op)  # (the sender is our parent: roles.ROLE_RULES)
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
