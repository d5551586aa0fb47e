"""State from peers: how a worker that joins a running job gets the model and optimizer state.

A joiner is admitted at a training step U (net/node.py). From U on it takes part in every
allreduce, but with zeros that are not counted (`contribute=False`), and keeps each step's
averaged gradients. Meanwhile it asks several members (the donors, up to MAX_DONORS, starting
at an offset by its rank so that joiners at once spread over different donors) for the
training state. Each donor serialises it at its next step boundary T >= U (the state after step
T-1's update), without pausing, keeps it, and answers with a manifest: the state's size, its
digest and each piece's digest. Training is bit for bit alike on every member, so donors
answering for the same T hold the same bytes; the joiner takes the first manifest's (T, digest)
and asks every donor whose manifest matches for pieces, a window at a time
(fttree.training.pieces): each donor's uplink carries a share, and a faster one more. A piece is
checked against the manifest as it arrives; one that is wrong loses its donor. A donor that
delivers nothing for `wait_s` (it died, or stalls) or leaves the view costs the joiner only
the pieces it still owed, which go to the other donors; with none left, the joiner asks again.
Once every piece is in, the joiner checks the whole digest and decodes it a bounded piece per
training step (the joiner is a leaf its parent waits for, so whatever it does inside one step
delays every member's step), then loads it and replays its kept gradients of steps T, T+1, ...
through the same optimizer code path the others ran, so it ends bit for bit where they are, and
contributes from the next step.

Frames: STATE_REQUEST with `piece` MANIFEST asks for a manifest of a state as of `user_step`
or later; with `piece` >= 0 and the manifest's `digest`, for that piece. STATE with `piece`
MANIFEST carries a manifest (payload: the size as 8 bytes big-endian, then each piece's 32-byte
digest), with `piece` >= 0 a piece. Anything not asked for, or not matching, is dropped and
counted (`dropped`), each reason logged once; a donor keeps one state per joiner in its view.

The state is a fttree.training.state TrainingState, in that module's format and digest
(msgpack and raw tensor bytes, no pickle; blake2b-256), as sync_state sends it: the model's
state_dict, the optimizer's, a registered LR scheduler's, the group's optimizer step count, and
registered extra state. The donor captures it on the training thread and encodes it on
another; the joiner decodes it and `state.load`s it.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.messages import Kind, State
from ..errors import PeerError
from .pieces import DIGEST_BYTES, Ledger, Manifest, Verdict, split, start_offset
from .state import StateError, TrainingState, decode, encode, new_hasher

if TYPE_CHECKING:
    from ..api import FTTreeAllreduce

log = logging.getLogger("fttree.training.elastic")

CHUNK_BYTES = 1 << 20
MANIFEST = -1  # the `piece` of a request for a manifest, and of the STATE frame carrying one
MAX_DONORS = 4
WINDOW = 4  # pieces asked of one donor at once
_SIZE = struct.Struct(">Q")


def manifest_payload(manifest: Manifest) -> bytes:
    """A manifest on the wire: its size, then each piece's digest."""
    return _SIZE.pack(manifest.nbytes) + b"".join(bytes.fromhex(d) for d in manifest.digests)


def manifest_from(payload: bytes | bytearray | memoryview, pieces: int) -> Manifest:
    """A manifest from the wire, or ValueError naming what is wrong with it."""
    raw = bytes(payload)
    if len(raw) != _SIZE.size + DIGEST_BYTES * pieces:
        raise ValueError(f"a manifest of {pieces} pieces must be {_SIZE.size + DIGEST_BYTES * pieces} bytes, "
                         f"got {len(raw)}")
    (nbytes,) = _SIZE.unpack_from(raw)
    digests = tuple(raw[_SIZE.size + i * DIGEST_BYTES:_SIZE.size + (i + 1) * DIGEST_BYTES].hex()
                    for i in range(pieces))
    return Manifest(nbytes=nbytes, piece_bytes=CHUNK_BYTES, digests=digests)


@dataclass
class _Held:
    """A donor's encoded state for one joiner, kept while it asks for pieces."""

    user_step: int
    digest: str
    data: bytes
    manifest: Manifest
    used_at: float


@dataclass
class _Fetch:
    """The joiner's transfer of one state (one T and digest) from several donors."""

    user_step: int
    digest: str
    ledger: Ledger
    donors: list[int] = field(default_factory=list)  # those whose manifest matched, in order of answer
    delivered: Counter[int] = field(default_factory=Counter)  # donor -> pieces it delivered
    hasher: Any = field(default_factory=new_hasher)
    hashed: int = 0  # pieces 0..hashed-1 are in the hasher
    checked: bool = False  # the whole digest matched


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """What a finished transfer cost, for tests and benchmarks."""

    donors: tuple[int, ...]  # those that delivered pieces, most first
    pieces: dict[int, int]  # donor -> pieces it delivered
    user_step: int  # the training step the state is as of
    nbytes: int
    seconds: float  # from the first request to the state being checked
    donors_asked: tuple[int, ...]
    refetched: int  # pieces asked of a second donor because the first did not deliver
    replayed: int  # steps replayed after loading

    @property
    def donor(self) -> int:
        """The donor that delivered most."""
        return self.donors[0]


class StateTransfer:
    """Both sides of the state transfer for one worker. `capture()` returns the training state
    (fttree.training.state.capture) on the caller's thread; frames arrive on the node's loop
    thread (`_on_frame`)."""

    def __init__(self, ar: FTTreeAllreduce, capture: Callable[[], TrainingState],
                 wait_s: float | None = None, max_donors: int = MAX_DONORS, window: int = WINDOW) -> None:
        if max_donors <= 0 or window <= 0:
            raise ValueError(f"max_donors and window must be positive, got {max_donors} and {window}")
        self.ar = ar
        self.capture = capture
        self.wait_s = wait_s if wait_s is not None else max(2.0, ar.config.step_timeout_s)
        self.max_donors = max_donors
        self.window = window
        self._lock = threading.Lock()
        # donor side
        self._requests: dict[int, int] = {}  # joiner -> the earliest training step it can use
        self._held: dict[int, _Held] = {}  # joiner -> the state kept for it
        self.served = 0  # manifests this worker sent as a donor
        self.pieces_sent = 0
        # joiner side
        self._fetch: _Fetch | None = None
        self._asking: set[int] = set()  # donors asked for a manifest in this round
        self._asked: list[int] = []
        self._asked_at = 0.0
        self._started_at = 0.0
        self._given_up: set[int] = set()  # donors lost in earlier rounds: asked last
        self._refetched = 0
        self.dropped: Counter[str] = Counter()  # frames dropped, by reason
        self._told: set[str] = set()
        self.record: TransferRecord | None = None
        assert ar.node is not None
        ar.node.elastic_listeners.append(self._on_frame)

    def _drop(self, reason: str, msg: State) -> None:
        """A frame not asked for or not matching: counted, and each reason logged once."""
        self.dropped[reason] += 1
        if reason not in self._told:
            self._told.add(reason)
            log.warning("rank %d drops a %s frame from rank %d: %s (further ones counted, not logged)",
                        self.ar.rank, msg.kind.name, msg.src, reason)

    # ---- joiner ------------------------------------------------------------------------------

    def request(self, user_step: int) -> None:
        """Ask several members for a manifest of the state as of `user_step` or later (again,
        of others first, if no donor delivered)."""
        members = [r for r in self.ar.view.members if r != self.ar.rank]
        if not members:
            raise PeerError(f"rank {self.ar.rank} has no member to take the training state from")
        first = start_offset(self.ar.rank, len(members))
        order = members[first:] + members[:first]
        order = [r for r in order if r not in self._given_up] + [r for r in order if r in self._given_up]
        donors = order[:self.max_donors]
        if not self._asked:
            self._started_at = time.monotonic()
        self._asked.extend(donors)
        self._asked_at = time.monotonic()
        with self._lock:
            self._fetch = None
            self._asking = set(donors)
        log.info("rank %d asks ranks %s for the training state as of step %d", self.ar.rank, donors, user_step)
        for donor in donors:
            self.ar.send_frame(donor, State(kind=Kind.STATE_REQUEST, src=self.ar.rank, user_step=user_step,
                                            piece=MANIFEST))

    def poll(self, user_step: int) -> tuple[int, TrainingState] | None:
        """The state, once fully received and checked: (its training step, the state).
        Hands a dead, late or departed donor's pieces to the others; asks again if none is left."""
        now = time.monotonic()
        with self._lock:
            fetch = self._fetch
        if fetch is None:
            asking = [r for r in self._asking if r in self.ar.view]
            if not self._asked or not asking or now - self._asked_at > self.wait_s:
                if self._asked:
                    log.warning("rank %d: no manifest of the training state from ranks %s within %.1fs; asking again",
                                self.ar.rank, sorted(self._asking), self.wait_s)
                    self._given_up |= self._asking
                self.request(user_step)
            return None
        if not fetch.ledger.done:
            self._hash_next(fetch)  # while the rest arrives
            self._replace_donors(fetch, user_step, now)
            return None
        return self._advance(fetch, user_step)

    def _hash_next(self, fetch: _Fetch) -> bool:
        """Add the next piece in order to the whole digest, if it is here; whether it was."""
        with self._lock:
            piece = fetch.ledger.have.get(fetch.hashed)
        if piece is None:
            return False
        fetch.hasher.update(piece)
        fetch.hashed += 1
        return True

    def _replace_donors(self, fetch: _Fetch, user_step: int, now: float) -> None:
        with self._lock:
            if self._fetch is not fetch:
                return
            led = fetch.ledger
            gone = [d for d in fetch.donors if d not in self.ar.view and d not in led.lost]
            late = led.overdue(now, self.wait_s)
            for d in sorted(set(gone) | set(late)):
                owed = led.owed_by(d)
                log.warning("rank %d: rank %d %s; its %d missing pieces of the training state go to the other donors",
                            self.ar.rank, d, "left the view" if d in gone else
                            f"delivered none of the pieces it owes within {self.wait_s:.1f}s", len(owed))
                led.lose(d)
                self._given_up.add(d)
            live = [d for d in fetch.donors if d not in led.lost]
            if not live:
                log.warning("rank %d: every donor of the training state as of step %d is lost; asking again",
                            self.ar.rank, fetch.user_step)
                self._refetched += led.refetched
                self._fetch = None
                restart = True
            else:
                self._ask_pieces(fetch, now)
                restart = False
        if restart:
            self.request(user_step)

    def _ask_pieces(self, fetch: _Fetch, now: float) -> None:
        """Keep every live donor's window of pieces full (the caller holds the lock)."""
        live = [d for d in fetch.donors if d not in fetch.ledger.lost]
        if not live:
            return
        for donor, pieces in fetch.ledger.plan(live, now, limit=self.window).items():
            for piece in pieces:
                self.ar.send_frame(donor, State(kind=Kind.STATE_REQUEST, src=self.ar.rank, user_step=fetch.user_step,
                                                piece=piece, digest=fetch.digest))

    # ---- donor ---------------------------------------------------------------------------------

    def serve(self, user_step: int) -> None:
        """At a step boundary (the state is as of training step `user_step`): serve the joiners
        waiting for a state of this step or earlier, and forget the states of joiners that
        left or stopped asking."""
        now = time.monotonic()
        with self._lock:
            due = [j for j, first in self._requests.items() if first <= user_step]
            for j in due:
                del self._requests[j]
            for j, held in list(self._held.items()):
                if j not in self.ar.view or now - held.used_at > 4 * self.wait_s:
                    del self._held[j]
        if not due:
            return
        state = self.capture().frozen()  # about a millisecond for the thesis MLP; the rest off the training thread
        threading.Thread(target=self._send_manifest, args=(due, user_step, state), name="fttree-state-donor",
                         daemon=True).start()

    def _send_manifest(self, due: list[int], user_step: int, state: TrainingState) -> None:
        snap = encode(state)
        manifest = split(snap.data, CHUNK_BYTES)
        payload = manifest_payload(manifest)
        now = time.monotonic()
        with self._lock:
            for j in due:
                self._held[j] = _Held(user_step=user_step, digest=snap.hexdigest, data=snap.data, manifest=manifest,
                                      used_at=now)
        for j in due:
            self.ar.send_frame(j, State(kind=Kind.STATE, src=self.ar.rank, user_step=user_step, piece=MANIFEST,
                                        pieces=manifest.total, digest=snap.hexdigest, numel=len(payload),
                                        payload=payload))
            self.served += 1
            log.info("rank %d offers rank %d the training state as of step %d (%d bytes in %d pieces)", self.ar.rank,
                     j, user_step, manifest.nbytes, manifest.total)

    def _send_piece(self, msg: State) -> None:
        with self._lock:
            held = self._held.get(msg.src)
            if held is None or (held.user_step, held.digest) != (msg.user_step, msg.digest) \
                    or not 0 <= msg.piece < held.manifest.total:
                ok = False
            else:
                ok = True
                held.used_at = time.monotonic()
        if not ok or held is None:
            self._drop("a request for a piece of a state not held for it", msg)
            return
        start, end = held.manifest.span(msg.piece)
        piece = memoryview(held.data)[start:end]  # a view, not a copy
        self.ar.send_frame(msg.src, State(kind=Kind.STATE, src=self.ar.rank, user_step=held.user_step, piece=msg.piece,
                                          pieces=held.manifest.total, digest=held.digest, numel=len(piece),
                                          payload=piece))
        self.pieces_sent += 1

    # ---- frames (the node's loop thread) -----------------------------------------------------

    def _on_frame(self, msg: State) -> None:
        if msg.kind is Kind.STATE_REQUEST:
            if msg.piece == MANIFEST:
                with self._lock:
                    self._requests[msg.src] = max(msg.user_step, self._requests.get(msg.src, -1))
            else:
                self._send_piece(msg)
            return
        if msg.kind is not Kind.STATE or msg.payload is None:
            return
        if msg.piece == MANIFEST:
            self._on_manifest(msg)
        else:
            self._on_piece(msg)

    def _on_manifest(self, msg: State) -> None:
        assert msg.payload is not None
        with self._lock:
            if msg.src not in self._asking:
                self._drop("a manifest not asked for", msg)
                return
            self._asking.discard(msg.src)
            fetch = self._fetch
            if fetch is not None and (fetch.user_step, fetch.digest) != (msg.user_step, msg.digest):
                log.info("rank %d: rank %d offers the state as of step %d, not step %d as the first donor; "
                         "not used", self.ar.rank, msg.src, msg.user_step, fetch.user_step)
                return
            try:
                manifest = manifest_from(msg.payload, msg.pieces)
            except ValueError as exc:
                self._drop(f"an unusable manifest ({exc})", msg)
                return
            if fetch is None:
                fetch = self._fetch = _Fetch(user_step=msg.user_step, digest=msg.digest,
                                             ledger=Ledger(manifest=manifest, joiner=self.ar.rank))
            elif manifest != fetch.ledger.manifest:
                self._drop("a manifest unlike the first donor's for the same digest", msg)
                return
            fetch.donors.append(msg.src)
            self._ask_pieces(fetch, time.monotonic())

    def _on_piece(self, msg: State) -> None:
        assert msg.payload is not None
        with self._lock:
            fetch = self._fetch
            if fetch is None or (fetch.user_step, fetch.digest) != (msg.user_step, msg.digest):
                self._drop("a piece of a state not being fetched", msg)
                return
            verdict = fetch.ledger.receive(msg.src, msg.piece, msg.payload)
            if verdict is Verdict.ACCEPTED:
                fetch.delivered[msg.src] += 1
                fetch.ledger.progress(msg.src, time.monotonic())
            elif verdict is Verdict.BAD_DIGEST:
                log.error("rank %d: piece %d of the training state from rank %d does not match its digest; "
                          "rank %d is asked nothing more", self.ar.rank, msg.piece, msg.src, msg.src)
                self.dropped["a piece that does not match its digest"] += 1
                self._given_up.add(msg.src)
            else:
                self._drop(f"a piece {verdict.value}", msg)
                return
            self._ask_pieces(fetch, time.monotonic())

    def _advance(self, fetch: _Fetch, user_step: int) -> tuple[int, TrainingState] | None:
        """One bounded piece of the joiner's work on a received state, per training step: hash
        the next piece (about a millisecond a MiB), or, once the digest matched, decode it.
        Done all at once inside one step, this work held up every member's next step by the
        joiner's whole decode (the joiner is a leaf its parent waits for)."""
        led = fetch.ledger
        if not fetch.checked:
            if fetch.hashed < led.manifest.total:
                self._hash_next(fetch)
                if fetch.hashed < led.manifest.total:
                    return None
            if fetch.hasher.hexdigest() != fetch.digest:
                log.error("rank %d: the training state from ranks %s does not match its digest; asking again",
                          self.ar.rank, fetch.donors)
                self._given_up |= set(fetch.donors)
                self.request(user_step)
                return None
            fetch.checked = True
            return None  # decoded at the next step, not in this one
        with self._lock:
            if self._fetch is fetch:
                self._fetch = None
        data = led.assemble()
        donors = tuple(sorted(fetch.delivered, key=lambda d: (-fetch.delivered[d], d)))
        try:
            state = decode(data)
        except StateError as exc:
            raise PeerError(f"rank {self.ar.rank}: the training state from ranks {list(donors)} as of step "
                            f"{fetch.user_step} matched its digest but is unusable: {exc}", peers=donors) from exc
        self.record = TransferRecord(donors=donors, pieces=dict(fetch.delivered), user_step=fetch.user_step,
                                     nbytes=len(data), seconds=time.monotonic() - self._started_at,
                                     donors_asked=tuple(self._asked), refetched=self._refetched + led.refetched,
                                     replayed=0)
        return fetch.user_step, state
