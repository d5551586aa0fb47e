"""State from peers: how a worker that joins a running job gets the model and optimizer state.

A joiner is admitted at a training step U (net/node.py). From U on it takes part in every
allreduce, but with zeros that are not counted (`contribute=False`), and keeps each step's
averaged gradients. Meanwhile it asks several members (the donors, up to MAX_DONORS, from an
offset by its rank so that joiners at once spread over different donors: `donors_for`) for the
training state as of U. Every member learns U from the view that admits the joiner, and each of
its donors keeps the state as of U (after step U-1's update) at its step U boundary, whether the
request came before or comes after: donors answer at different moments but all for the same
step, and training is bit for bit alike on every member, so they hold the same bytes. Each
answers with a manifest: the state's size, its digest and each piece's digest. (A donor that
did not see the join offers the state of its next step boundary; a joiner asked by another
joiner answers that it holds none.) The joiner deals every donor asked a share of the pieces
(fttree.training.pieces) and asks each, once its manifest came, for a window of its share at a
time: each donor's uplink carries a share, a faster one more (it takes unasked pieces of ready
donors' shares once its own is done). A piece is checked against the manifest as it arrives;
one that is wrong loses its donor. A donor that sends no manifest or delivers nothing for
`wait_s` (it died, or stalls), offers another step, or leaves the view costs the joiner only
the pieces it still owed and its share, which go to the other donors; with none left, the
joiner asks again. Once every piece is in, the joiner checks the whole digest and decodes it on
another thread (the joiner is a node of the trees, so whatever it does inside one step delays
every member's step; a slice of it per step made it take as many steps as the state has
pieces), then, at the next step boundary, loads it and replays its kept gradients of
steps U, U+1, ... through the same optimizer code path the others ran, so it ends bit for bit
where they are, and contributes from the next step.

Frames: STATE_REQUEST with `piece` MANIFEST asks for a manifest of a state as of `user_step`
or later; with `piece` >= 0 and the manifest's `digest`, for that piece. STATE with `piece`
MANIFEST carries a manifest (payload: the size as 8 bytes big-endian, then each piece's 32-byte
digest), with `piece` >= 0 a piece. Anything not asked for, or not matching, is dropped and
counted (`dropped`), each reason logged once; a donor keeps one state per joiner in its view
(joiners admitted together share it) until the joiner leaves or stops asking for 4 x `wait_s`.
A manifest frame with `pieces` NO_STATE says its sender holds no state.

The state is a fttree.training.state TrainingState, in that module's format and digest
(msgpack and raw tensor bytes, no pickle; blake2b-256), as sync_state sends it: the model's
state_dict, the optimizer's, a registered LR scheduler's, the group's optimizer step count, and
registered extra state. The donor captures it on the training thread and encodes it on
another; the joiner decodes it and `state.load`s it.
"""

from __future__ import annotations

import functools
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.messages import Kind, State
from ..errors import FTTreeError, PeerError
from .pieces import DIGEST_BYTES, Ledger, Manifest, Verdict, split, start_offset
from .state import StateError, TrainingState, decode, encode, state_digest

if TYPE_CHECKING:
    from ..core.config import Config
    from ..core.membership import Installed
    from ..core.view import View
    from ..net.node import Node

log = logging.getLogger("fttree.training.elastic")

CHUNK_BYTES = 1 << 20
MANIFEST = -1  # the `piece` of a request for a manifest, and of the STATE frame carrying one
NO_STATE = -1  # the `pieces` of a manifest frame from a rank that holds no state (it is joining too)
MAX_DONORS = 8  # a joiner's downlink is one; beyond this, more donors add holders of a copy, not speed
WINDOW = 4  # pieces asked of one donor at once
_SIZE = struct.Struct(">Q")


def donors_for(joiner: int, members: Iterable[int], max_donors: int) -> list[int]:
    """The members a joiner asks for its state, in the order it deals them pieces: from an
    offset by its rank (joiners at once begin at different donors), at most `max_donors`. A
    member works this out from the view the join takes effect in, to hold a state for a joiner
    that will ask it."""
    others = [r for r in members if r != joiner]
    if not others:
        return []
    first = start_offset(joiner, len(others))
    return (others[first:] + others[:first])[:max_donors]


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
    expected: list[int] = field(default_factory=list)  # the donors asked, less those holding no state
    donors: list[int] = field(default_factory=list)  # those whose manifest matched, in order of answer
    delivered: Counter[int] = field(default_factory=Counter)  # donor -> pieces it delivered
    check: _Check | None = None  # the whole digest and the decode, once every piece is in
    manifest_at: float = 0.0  # StateTransfer.now(), the first manifest's arrival; the timeline TransferRecord reports
    first_piece_at: float | None = None
    all_pieces_at: float | None = None


@dataclass
class _Check:
    """The joiner's check and decode of a whole state, off the training thread: hashing and
    decoding 100 MB takes a few hundred milliseconds, which inside a step would hold up every
    member (the joiner is a node of the trees), and a slice of it per step made it take as
    many steps as the state has pieces."""

    done: threading.Event = field(default_factory=threading.Event)
    matched: bool = False  # the whole digest matched
    state: TrainingState | None = None
    error: BaseException | None = None  # decoding failed (or the check itself did)
    nbytes: int = 0
    checked_at: float | None = None  # StateTransfer.now()


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """What a finished transfer cost, for tests and benchmarks."""

    donors: tuple[int, ...]  # those that delivered pieces, most first
    pieces: dict[int, int]  # donor -> pieces it delivered
    user_step: int  # the training step the state is as of
    nbytes: int
    seconds: float  # from the first request to the state being checked and decoded
    donors_asked: tuple[int, ...]
    refetched: int  # pieces asked of a second donor because the first did not deliver
    replayed: int  # steps replayed after loading
    # The timeline, seconds from the first request: where a transfer's time goes (the link's
    # part ends at `all_pieces_s`; the rest is the joiner's check and decode, and waiting for
    # its next step boundary).
    manifest_s: float = 0.0  # the donors' part: reaching the join's step, capturing and encoding the state
    first_piece_s: float = 0.0
    all_pieces_s: float = 0.0
    checked_s: float = 0.0
    piece_bytes: int = 0  # piece payload bytes that reached the joiner, refetched and dropped ones too

    @property
    def donor(self) -> int:
        """The donor that delivered most."""
        return self.donors[0]


class GroupLink(Protocol):
    """What the state transfer uses of its worker's place in the group: its rank, the view, the
    node whose listeners hear STATE frames and views, and a way to send a frame. An
    FTTreeAllreduce is one; the simulator hands it a simulated node's (fttree.testing.simstate),
    so that a join is tested end to end on the fake clock."""

    @property
    def rank(self) -> int: ...

    @property
    def view(self) -> View: ...

    @property
    def config(self) -> Config: ...

    @property
    def joining(self) -> bool: ...

    @property
    def node(self) -> Node | None: ...

    def send_frame(self, dst: int, msg: Any) -> None:
        """Queue a frame for rank `dst` (from any thread)."""


Background = Callable[[str, Callable[[], None]], None]  # (a thread's name, the work): runs it off the caller


def in_thread(name: str, work: Callable[[], None]) -> None:
    """Run `work` on a daemon thread named `name`: encoding or checking a state takes a while,
    and the training thread (a node of the trees) must not wait for it."""
    threading.Thread(target=work, name=name, daemon=True).start()


class StateTransfer:
    """Both sides of the state transfer for one worker. `capture()` returns the training state
    (fttree.training.state.capture) on the caller's thread; frames arrive on the node's loop
    thread (`_on_frame`). `now` (seconds, monotonic) and `background` (how work leaves the
    training thread) are the wall clock and threads, except in the simulator, which gives its
    fake clock and runs the work on it."""

    def __init__(self, ar: GroupLink, capture: Callable[[], TrainingState],
                 wait_s: float | None = None, max_donors: int = MAX_DONORS, window: int = WINDOW, *,
                 now: Callable[[], float] = time.monotonic, background: Background = in_thread) -> None:
        if max_donors <= 0 or window <= 0:
            raise ValueError(f"max_donors and window must be positive, got {max_donors} and {window}")
        self.ar = ar
        self.now = now
        self.background = background
        self.capture = capture
        self.wait_s = wait_s if wait_s is not None else max(2.0, ar.config.step_timeout_s)
        self.max_donors = max_donors
        self.window = window
        self._lock = threading.Lock()
        # donor side
        self._requests: dict[int, int] = {}  # joiner -> the earliest training step it can use
        self._held: dict[int, _Held] = {}  # joiner -> the state kept for it
        self._joins: dict[int, int] = {}  # joiner that will ask this rank -> the step its join takes effect
        self._preparing: set[int] = set()  # joiners whose state is being encoded
        self._stateless = bool(ar.joining)  # a joiner holds no state to give until it has its own
        self.served = 0  # manifests this worker sent as a donor
        self.pieces_sent = 0
        # joiner side
        self._fetch: _Fetch | None = None
        self._asking: set[int] = set()  # donors asked for a manifest in this round, not yet answered
        self._round: list[int] = []  # the donors asked in this round
        self._refused: set[int] = set()  # donors of this round that hold no state (joiners too)
        self._asked: list[int] = []
        self._asked_at = 0.0
        self._started_at = 0.0
        self._given_up: set[int] = set()  # donors lost in earlier rounds: asked last
        self._refetched = 0
        self._resume: _Fetch | None = None  # a transfer whose donors were all lost: its pieces are kept
        self.dropped: Counter[str] = Counter()  # frames dropped, by reason
        self._told: set[str] = set()
        self.record: TransferRecord | None = None
        self.piece_bytes = 0  # piece payload bytes received, whatever became of them
        assert ar.node is not None
        ar.node.elastic_listeners.append(self._on_frame)
        ar.node.view_listeners.append(self._on_view)

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
        order = donors_for(self.ar.rank, members, len(members))
        if self._given_up:  # a later round: others first
            order = [r for r in order if r not in self._given_up] + [r for r in order if r in self._given_up]
        donors = order[:self.max_donors]
        if not self._asked:
            self._started_at = self.now()
        self._asked.extend(donors)
        self._asked_at = self.now()
        with self._lock:
            self._fetch = None
            self._asking = set(donors)
            self._round = list(donors)
            self._refused = set()
        log.info("rank %d asks ranks %s for the training state as of step %d", self.ar.rank, donors, user_step)
        for donor in donors:
            self.ar.send_frame(donor, State(kind=Kind.STATE_REQUEST, src=self.ar.rank, user_step=user_step,
                                            piece=MANIFEST))

    def poll(self, user_step: int) -> tuple[int, TrainingState] | None:
        """The state, once fully received and checked: (its training step, the state).
        Hands a dead, late or departed donor's pieces to the others; asks again if none is left."""
        now = self.now()
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
            self._replace_donors(fetch, user_step, now)
            return None
        return self._advance(fetch, user_step)

    def _replace_donors(self, fetch: _Fetch, user_step: int, now: float) -> None:
        with self._lock:
            if self._fetch is not fetch:
                return
            led = fetch.ledger
            gone = [d for d in fetch.expected if d not in self.ar.view and d not in led.lost]
            late = led.overdue(now, self.wait_s)
            silent = [d for d in fetch.expected if d in self._asking and d not in led.lost
                      and now - self._asked_at > self.wait_s]
            for d in sorted(set(gone) | set(late) | set(silent)):
                why = ("left the view" if d in gone else f"sent no manifest within {self.wait_s:.1f}s" if d in silent
                       else f"delivered none of the pieces it owes within {self.wait_s:.1f}s")
                log.warning("rank %d: rank %d %s; its %d missing pieces of the training state go to the other donors",
                            self.ar.rank, d, why, len(led.owed_by(d)) + len(led.share.get(d, ())))
                led.lose(d)
                self._asking.discard(d)
                self._given_up.add(d)
            live = [d for d in fetch.expected if d not in led.lost]
            if not live:
                log.warning("rank %d: every donor of the training state as of step %d is lost; asking again "
                            "(keeping the %d pieces in hand)", self.ar.rank, fetch.user_step, len(led.have))
                self._resume = fetch
                self._fetch = None
                restart = True
            else:
                self._ask_pieces(fetch, now)
                restart = False
        if restart:
            self.request(user_step)

    def _ask_pieces(self, fetch: _Fetch, now: float) -> None:
        """Deal a lost donor's pieces to the live ones, and keep every ready donor's window of
        pieces full (the caller holds the lock)."""
        led = fetch.ledger
        live = [d for d in fetch.expected if d not in led.lost]
        if not live:
            return  # the next poll asks again
        led.deal(live)
        ready = [d for d in fetch.donors if d not in led.lost]
        if not ready:
            return
        for donor, pieces in led.plan(ready, now, limit=self.window).items():
            for piece in pieces:
                self.ar.send_frame(donor, State(kind=Kind.STATE_REQUEST, src=self.ar.rank, user_step=fetch.user_step,
                                                piece=piece, digest=fetch.digest))

    # ---- donor ---------------------------------------------------------------------------------

    def _on_view(self, inst: Installed) -> None:
        """A view that admits joiners (the node's loop thread): hold the state as of the step
        their join takes effect for each joiner that will ask this rank, whenever its request
        comes, so that every donor it asks offers the same step and the same bytes."""
        if not inst.joined or inst.activate_at < 0:
            return
        with self._lock:
            for j in inst.joined:
                if j != self.ar.rank and self.ar.rank in donors_for(j, inst.view.members, self.max_donors):
                    self._joins[j] = inst.activate_at

    def serve(self, user_step: int) -> None:
        """At a step boundary (the state is as of training step `user_step`): keep the state
        for the joiners whose join takes effect at this step, serve the joiners waiting for a
        state of this step or earlier, and forget the states of joiners that left or stopped
        asking."""
        now = self.now()
        with self._lock:
            due = [j for j, first in self._requests.items() if first <= user_step and j not in self._preparing]
            for j in due:
                del self._requests[j]
            joins = [j for j, at in self._joins.items() if at <= user_step]
            fresh = [j for j in joins if self._joins.pop(j) == user_step and j not in due]  # earlier: missed
            for j, held in list(self._held.items()):
                if j not in self.ar.view or now - held.used_at > 4 * self.wait_s:
                    del self._held[j]
            self._preparing.update(due + fresh)
        if not due and not fresh:
            return
        state = self.capture().frozen()  # about a millisecond for the thesis MLP; the rest off the training thread
        self._in_background(self._send_manifest, due, user_step, state, fresh)

    def _in_background(self, target: Callable[..., None], *args: Any) -> None:
        """Run `target(*args)` off the training thread (encoding a state takes a while)."""
        self.background("fttree-state-donor", functools.partial(target, *args))

    def _send_manifest(self, due: list[int], user_step: int, state: TrainingState,
                       fresh: Iterable[int] = ()) -> None:
        """Encode a state and keep it for the joiners `due` (asked: they get its manifest now)
        and `fresh` (their join took effect at `user_step`: they get it once they ask)."""
        snap = encode(state)
        manifest = split(snap.data, CHUNK_BYTES)
        now = self.now()
        held = _Held(user_step=user_step, digest=snap.hexdigest, data=snap.data, manifest=manifest, used_at=now)
        answer = list(due)
        with self._lock:
            for j in [*due, *fresh]:
                self._held[j] = held
                self._preparing.discard(j)
                # Asked (again) while encoding: this state answers it. Left pending, the request
                # would make the next step boundary replace the state the joiner is fetching
                # with a later one, and drop its piece requests until it gave up on this donor.
                if self._requests.get(j, user_step + 1) <= user_step:
                    del self._requests[j]
                    if j not in answer:
                        answer.append(j)
        for j in answer:
            self._offer(j, held)

    def _offer(self, joiner: int, held: _Held) -> None:
        """Send `joiner` the manifest of the state held for it."""
        payload = manifest_payload(held.manifest)
        self.ar.send_frame(joiner, State(kind=Kind.STATE, src=self.ar.rank, user_step=held.user_step, piece=MANIFEST,
                                         pieces=held.manifest.total, digest=held.digest, numel=len(payload),
                                         payload=payload))
        self.served += 1
        log.info("rank %d offers rank %d the training state as of step %d (%d bytes in %d pieces)", self.ar.rank,
                 joiner, held.user_step, held.manifest.nbytes, held.manifest.total)

    def _on_request(self, msg: State) -> None:
        """A joiner asks for a manifest as of `user_step` or later: the state held for it if it
        is one, else one at this rank's next step boundary; none from a rank without state."""
        with self._lock:
            held = self._held.get(msg.src)
            if self._stateless:
                offer = None
            elif held is not None and held.user_step >= msg.user_step:
                held.used_at = self.now()
                offer = held
            else:
                self._requests[msg.src] = max(msg.user_step, self._requests.get(msg.src, -1))
                return
        if offer is not None:
            self._offer(msg.src, offer)
            return
        self.ar.send_frame(msg.src, State(kind=Kind.STATE, src=self.ar.rank, user_step=msg.user_step, piece=MANIFEST,
                                          pieces=NO_STATE, numel=0, payload=b""))

    def _send_piece(self, msg: State) -> None:
        with self._lock:
            held = self._held.get(msg.src)
            if held is None or (held.user_step, held.digest) != (msg.user_step, msg.digest) \
                    or not 0 <= msg.piece < held.manifest.total:
                ok = False
            else:
                ok = True
                held.used_at = self.now()
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
                self._on_request(msg)
            else:
                self._send_piece(msg)
            return
        if msg.kind is Kind.STATE and msg.piece == MANIFEST and msg.pieces == NO_STATE:
            self._on_no_state(msg)
            return
        if msg.kind is not Kind.STATE or msg.payload is None:
            return
        if msg.piece == MANIFEST:
            self._on_manifest(msg)
        else:
            self._on_piece(msg)

    def _on_no_state(self, msg: State) -> None:
        """A donor asked holds no state (it is joining too): its share goes to the others."""
        with self._lock:
            if msg.src not in self._asking:
                self._drop("a manifest not asked for", msg)
                return
            self._asking.discard(msg.src)
            self._refused.add(msg.src)
            fetch = self._fetch
            if fetch is not None:
                fetch.ledger.lose(msg.src)
                self._ask_pieces(fetch, self.now())
        log.info("rank %d: rank %d holds no training state to give (it is joining too)", self.ar.rank, msg.src)

    def _on_manifest(self, msg: State) -> None:
        assert msg.payload is not None
        with self._lock:
            if msg.src not in self._asking:
                self._drop("a manifest not asked for", msg)
                return
            self._asking.discard(msg.src)
            fetch = self._fetch
            try:
                manifest = manifest_from(msg.payload, msg.pieces)
            except ValueError as exc:
                self._drop(f"an unusable manifest ({exc})", msg)
                if fetch is not None:
                    fetch.ledger.lose(msg.src)
                    self._ask_pieces(fetch, self.now())
                return
            if fetch is not None and ((fetch.user_step, fetch.digest) != (msg.user_step, msg.digest)
                                      or manifest != fetch.ledger.manifest):
                log.warning("rank %d: rank %d offers the state as of step %d, not step %d as the first donor; "
                            "its share goes to the others", self.ar.rank, msg.src, msg.user_step, fetch.user_step)
                fetch.ledger.lose(msg.src)
                self._ask_pieces(fetch, self.now())
                return
            if fetch is None:
                fetch = self._fetch = self._start(msg, manifest)
            fetch.donors.append(msg.src)
            self._ask_pieces(fetch, self.now())

    def _start(self, msg: State, manifest: Manifest) -> _Fetch:
        """The transfer of the state the first manifest of a round offers: the one whose
        donors were all lost, with the pieces in hand, if it is that state (the caller holds the
        lock)."""
        expected = [d for d in self._round if d not in self._refused]
        old, self._resume = self._resume, None
        if old is not None and (old.user_step, old.digest, old.ledger.manifest) == (msg.user_step, msg.digest,
                                                                                    manifest):
            log.info("rank %d resumes the training state as of step %d with %d of its %d pieces in hand",
                     self.ar.rank, msg.user_step, len(old.ledger.have), manifest.total)
            old.ledger = Ledger(manifest=manifest, joiner=self.ar.rank, have=old.ledger.have,
                                refetched=old.ledger.refetched)
            old.expected, old.donors = expected, []
            return old
        if old is not None:
            self._refetched += old.ledger.refetched
        return _Fetch(user_step=msg.user_step, digest=msg.digest, ledger=Ledger(manifest=manifest, joiner=self.ar.rank),
                      expected=expected, manifest_at=self.now())

    def _on_piece(self, msg: State) -> None:
        assert msg.payload is not None
        with self._lock:
            self.piece_bytes += len(msg.payload)
            fetch = self._fetch
            if fetch is None or (fetch.user_step, fetch.digest) != (msg.user_step, msg.digest):
                self._drop("a piece of a state not being fetched", msg)
                return
            verdict = fetch.ledger.receive(msg.src, msg.piece, msg.payload)
            if verdict is Verdict.ACCEPTED:
                now = self.now()
                fetch.delivered[msg.src] += 1
                fetch.ledger.progress(msg.src, now)
                if fetch.first_piece_at is None:
                    fetch.first_piece_at = now
                if fetch.ledger.done:
                    fetch.all_pieces_at = now
            elif verdict is Verdict.BAD_DIGEST:
                log.error("rank %d: piece %d of the training state from rank %d does not match its digest; "
                          "rank %d is asked nothing more", self.ar.rank, msg.piece, msg.src, msg.src)
                self.dropped["a piece that does not match its digest"] += 1
                self._given_up.add(msg.src)
            else:
                self._drop(f"a piece {verdict.value}", msg)
                return
            self._ask_pieces(fetch, self.now())

    def _check_in_background(self, target: Callable[..., None], *args: Any) -> None:
        """Run the joiner's check of a whole state, `target(*args)`, off the training thread."""
        self.background("fttree-state-check", functools.partial(target, *args))

    def _check(self, data: bytes, digest: str, check: _Check) -> None:
        """Hash `data` (hashlib lets the training thread run meanwhile) and, if it matches
        `digest`, decode it; whatever happens, `check.done` is set."""
        try:
            check.nbytes = len(data)
            check.matched = state_digest(data) == digest
            check.checked_at = self.now()
            if check.matched:
                check.state = decode(data)
        except Exception as exc:  # handed to the training thread, which raises it
            check.error = exc
        finally:
            check.done.set()

    def _advance(self, fetch: _Fetch, user_step: int) -> tuple[int, TrainingState] | None:
        """Once every piece is in: start the check of the whole digest and the decode off the
        training thread; once it is done, the state (or, if the digest does not match, ask
        again; if it does not decode, PeerError)."""
        led = fetch.ledger
        if fetch.check is None:
            fetch.check = _Check()
            self._check_in_background(self._check, led.assemble(), fetch.digest, fetch.check)
        check = fetch.check
        if not check.done.is_set():
            return None
        donors = tuple(sorted(fetch.delivered, key=lambda d: (-fetch.delivered[d], d)))
        if check.error is None and not check.matched:
            log.error("rank %d: the training state from ranks %s does not match its digest; asking again",
                      self.ar.rank, fetch.donors)
            self._given_up |= set(fetch.donors)
            self._refetched += led.refetched
            self.request(user_step)
            return None
        with self._lock:
            if self._fetch is fetch:
                self._fetch = None
        if isinstance(check.error, StateError):
            raise PeerError(f"rank {self.ar.rank}: the training state from ranks {list(donors)} as of step "
                            f"{fetch.user_step} matched its digest but is unusable: {check.error}",
                            peers=donors) from check.error
        if check.error is not None or check.state is None:
            raise FTTreeError(f"rank {self.ar.rank}: checking the training state as of step {fetch.user_step} "
                              f"failed: {check.error!r}") from check.error
        began = self._started_at
        self.record = TransferRecord(donors=donors, pieces=dict(fetch.delivered), user_step=fetch.user_step,
                                     nbytes=check.nbytes, seconds=self.now() - began,
                                     donors_asked=tuple(self._asked), refetched=self._refetched + led.refetched,
                                     replayed=0, manifest_s=fetch.manifest_at - began,
                                     first_piece_s=(fetch.first_piece_at or began) - began,
                                     all_pieces_s=(fetch.all_pieces_at or began) - began,
                                     checked_s=(check.checked_at or began) - began, piece_bytes=self.piece_bytes)
        self._stateless = False  # loaded by the caller now: from here on this rank can give it
        return fetch.user_step, check.state
