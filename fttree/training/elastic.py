"""State from a peer: how a worker that joins a running job gets the model and optimizer state.

A joiner is admitted at a training step U (net/node.py). From U on it takes part in every
allreduce, but with zeros that are not counted (`contribute=False`), and keeps each step's
averaged gradients. Meanwhile it asks a member (the donor) for the training state; the donor
serialises it at its next step boundary T >= U (the state after step T-1's update), without
pausing, and sends it in pieces over the node's links with a digest of the whole. Once the
state is in, the joiner checks and decodes it a bounded piece per training step (the joiner
is a leaf its parent waits for, so whatever it does inside one step delays every member's
step), then loads it and replays its kept gradients of steps T, T+1, ...
through the same optimizer code path the others ran, so it ends bit for bit where they are, and
contributes from the next step. If the donor does not deliver in time (it died, or left), the
joiner asks the next member; a state of a later step only means fewer gradients to replay.

The state is a fttree.training.state TrainingState, in that module's format and digest
(msgpack and raw tensor bytes, no pickle; blake2b-256), as sync_state sends it: the model's
state_dict, the optimizer's, a registered LR scheduler's, the group's optimizer step count, and
registered extra state. The donor captures it on the training thread and encodes it on
another; the joiner decodes it and `state.load`s it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.messages import Kind, State
from ..errors import PeerError
from .state import StateError, TrainingState, decode, encode, new_hasher

if TYPE_CHECKING:
    from ..api import FTTreeAllreduce

log = logging.getLogger("fttree.training.elastic")

CHUNK_BYTES = 1 << 20


@dataclass
class _Incoming:
    """The pieces of one state being received."""

    donor: int
    user_step: int
    total: int
    digest: str
    pieces: dict[int, bytes] = field(default_factory=dict)
    hasher: Any = field(default_factory=new_hasher)
    hashed: int = 0  # pieces 0..hashed-1 are in the hasher; all of them, still incoming: checked


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """What a finished transfer cost, for tests and benchmarks."""

    donor: int
    user_step: int  # the training step the state is as of
    nbytes: int
    seconds: float  # from the first request to the state being checked
    donors_asked: tuple[int, ...]
    replayed: int  # steps replayed after loading


class StateTransfer:
    """Both sides of the state transfer for one worker. `capture()` returns the training state
    (fttree.training.state.capture) on the caller's thread; frames arrive on the node's loop
    thread (`_on_frame`)."""

    def __init__(self, ar: FTTreeAllreduce, capture: Callable[[], TrainingState],
                 wait_s: float | None = None) -> None:
        self.ar = ar
        self.capture = capture
        self.wait_s = wait_s if wait_s is not None else max(2.0, ar.config.step_timeout_s)
        self._lock = threading.Lock()
        self._requests: dict[int, int] = {}  # joiner -> the earliest training step it can use
        self._incoming: _Incoming | None = None
        self._asked: list[int] = []
        self._asked_at = 0.0
        self._started_at = 0.0
        self.served = 0  # states this worker sent as a donor
        self.record: TransferRecord | None = None
        assert ar.node is not None
        ar.node.elastic_listeners.append(self._on_frame)

    # ---- joiner ------------------------------------------------------------------------------

    def request(self, user_step: int) -> None:
        """Ask a donor for the state as of `user_step` or later (again, of another donor, if
        the last one did not deliver within `wait_s`)."""
        members = [r for r in self.ar.view.members if r != self.ar.rank]
        if not members:
            raise PeerError(f"rank {self.ar.rank} has no member to take the training state from")
        untried = [r for r in members if r not in self._asked] or members
        donor = untried[0]
        if not self._asked:
            self._started_at = time.monotonic()
        self._asked.append(donor)
        self._asked_at = time.monotonic()
        with self._lock:
            self._incoming = None
        log.info("rank %d asks rank %d for the training state as of step %d", self.ar.rank, donor, user_step)
        self.ar.send_frame(donor, State(kind=Kind.STATE_REQUEST, src=self.ar.rank, user_step=user_step))

    def poll(self, user_step: int) -> tuple[int, TrainingState] | None:
        """The state, once fully received and checked: (its training step, the state).
        Asks the next donor if this one is late or gone."""
        with self._lock:
            inc = self._incoming
        if inc is not None and (inc.hashed == inc.total or inc.hashed in inc.pieces):
            return self._advance(inc)
        current = self._asked[-1] if self._asked else None
        if current is None or time.monotonic() - self._asked_at > self.wait_s or current not in self.ar.view:
            self.request(user_step)
        return None

    # ---- donor ---------------------------------------------------------------------------------

    def serve(self, user_step: int) -> None:
        """At a step boundary (the state is as of training step `user_step`): serve the joiners
        waiting for a state of this step or earlier."""
        with self._lock:
            due = [j for j, first in self._requests.items() if first <= user_step]
            for j in due:
                del self._requests[j]
        if not due:
            return
        state = self.capture().frozen()  # about a millisecond for the thesis MLP; the rest off the training thread
        threading.Thread(target=self._send, args=(due, user_step, state), name="fttree-state-donor",
                         daemon=True).start()

    def _send(self, due: list[int], user_step: int, state: TrainingState) -> None:
        snap = encode(state)
        data, digest = snap.data, snap.hexdigest
        total = max(1, -(-len(data) // CHUNK_BYTES))
        view = memoryview(data)  # pieces are views, not copies
        for j in due:
            for i in range(total):
                piece = view[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]
                self.ar.send_frame(j, State(kind=Kind.STATE, src=self.ar.rank, user_step=user_step, piece=i,
                                            pieces=total, digest=digest, numel=len(piece), payload=piece))
            self.served += 1
            log.info("rank %d sent rank %d the training state as of step %d (%d bytes in %d pieces)", self.ar.rank, j,
                     user_step, len(data), total)

    # ---- frames (the node's loop thread) -----------------------------------------------------

    def _on_frame(self, msg: State) -> None:
        if msg.kind is Kind.STATE_REQUEST:
            with self._lock:
                self._requests[msg.src] = max(msg.user_step, self._requests.get(msg.src, -1))
            return
        if msg.kind is not Kind.STATE or msg.payload is None:
            return
        with self._lock:
            inc = self._incoming
            if inc is None or (inc.donor, inc.user_step, inc.digest) != (msg.src, msg.user_step, msg.digest):
                if not self._asked or msg.src != self._asked[-1]:
                    return  # from a donor given up on
                inc = self._incoming = _Incoming(donor=msg.src, user_step=msg.user_step, total=msg.pieces,
                                                 digest=msg.digest)
            if 0 <= msg.piece < inc.total:
                inc.pieces[msg.piece] = bytes(msg.payload)

    def _advance(self, inc: _Incoming) -> tuple[int, TrainingState] | None:
        """One bounded piece of the joiner's work on a received state, per training step: hash
        the next piece (about a millisecond a MiB), or, once the digest matched, decode it.
        Done all at once inside one step, this work held up every member's next step by the
        joiner's whole decode (the joiner is a leaf its parent waits for)."""
        if inc.hashed < inc.total:
            inc.hasher.update(inc.pieces[inc.hashed])
            inc.hashed += 1
            if inc.hashed < inc.total:
                return None
            if inc.hasher.hexdigest() != inc.digest:
                log.error("rank %d: the training state from rank %d does not match its digest; asking again",
                          self.ar.rank, inc.donor)
                with self._lock:
                    if self._incoming is inc:
                        self._incoming = None
                self._asked_at = 0.0  # the next poll() asks the next donor
                return None
            return None  # decoded at the next step, not in this one
        with self._lock:
            if self._incoming is inc:
                self._incoming = None
        data = b"".join(inc.pieces[i] for i in range(inc.total))
        try:
            state = decode(data)
        except StateError as exc:
            raise PeerError(f"rank {self.ar.rank}: the training state from rank {inc.donor} as of step "
                            f"{inc.user_step} matched its digest but is unusable: {exc}", peers=(inc.donor,)) from exc
        self.record = TransferRecord(donor=inc.donor, user_step=inc.user_step, nbytes=len(data),
                                     seconds=time.monotonic() - self._started_at, donors_asked=tuple(self._asked),
                                     replayed=0)
        return inc.user_step, state
