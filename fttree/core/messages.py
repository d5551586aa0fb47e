"""Message kinds and the one wire format.

A frame is::

    b"FT" | version:u8 | header_len:u32 | payload_len:u64 | msgpack header | raw payload

The header is a msgpack map of small ints and strings; the payload is the tensor's raw bytes
(never pickled). `encode` returns buffers to write without copying the payload; `decode_prefix`
and `decode_header` validate everything a hostile or broken peer could get wrong and raise
`FrameError` with a reason, so the transport can drop that connection and keep serving.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from enum import Enum, IntEnum
from typing import Any, ClassVar, Protocol, Self

import msgpack
import numpy as np

from ..errors import FrameError
from .limits import DEFAULT_MAX_PAYLOAD_BYTES

MAGIC = b"FT"
VERSION = 10  # 2: epoch in every header, ABORT code and queued bytes in fields of their own; 3: membership; 4: joins;
#               5: a control and a bulk connection per peer, link progress queries, DONE; 6: the authenticated
#               handshake (net/handshake.py); 7: the join handshake's addresses in a field of their own; 8: a JOIN's
#               query and a JOIN_REPLY's answer in fields of their own (was one `code`); 9: a view's
#               measured uplinks (`uplinks`) in the view change's frames and JOIN_REPLY;
#               META_CLOSE and the late ranks of a sum or result (`late`); 10: COMPUTING, a
#               PING's `step`
PREFIX = struct.Struct(">2sBIQ")
MAX_HEADER_BYTES = 64 * 1024

#: dtypes allowed on the wire (numpy `dtype.str`, "bf16" and "int8") and their bytes per element. A
#: bfloat16 *tensor* travels as float32 (see api.py); "bf16" and "int8" are float32 data compressed
#: on the wire ("int8" adds a float32 scale per INT8_BLOCK elements: see wire_nbytes).
WIRE_ITEMSIZE = {"<f2": 2, "<f4": 4, "<f8": 8, "<i4": 4, "<i8": 8, "bf16": 2, "int8": 1}
WIRE_DTYPES = frozenset(WIRE_ITEMSIZE)
BF16 = "bf16"  # the top 16 bits of a float32, rounded to nearest even (numpy has no bfloat16)
INT8 = "int8"  # per block of INT8_BLOCK elements: a float32 scale (absmax / 127), then int8 values
INT8_BLOCK = 256
#: Config.compression -> the wire dtype float32 data travels as (other dtypes travel as they are)
COMPRESSIONS = {"bf16": BF16, "fp16": "<f2", "int8": INT8}


def wire_nbytes(wire: str, numel: int) -> int:
    """The payload bytes of `numel` elements travelling as `wire`."""
    if wire == INT8:
        return 4 * -(-numel // INT8_BLOCK) + numel
    return numel * WIRE_ITEMSIZE[wire]


def wire_numel(wire: str, held: np.ndarray) -> int:
    """How many elements `held` (an array as it travels as `wire`) holds."""
    if wire == INT8:
        return int(held.size) - 4 * -(-int(held.size) // (INT8_BLOCK + 4))  # wire_nbytes, inverted
    return int(held.size)


def wire_unit(wire: str) -> np.dtype[Any]:
    """The numpy type a payload of `wire` is held as, unchanged, to pass it on as it came."""
    return np.dtype(np.uint16 if wire == BF16 else np.uint8 if wire == INT8 else wire)


class Kind(IntEnum):
    """The eight messages of the thesis (Algorithms 1 and 2), plus connection, abort and probes."""

    DATA_REDUCE = 1  # subtree sum of `origin`, to origin's parent (maybe via a relay)
    META_REDUCE_SENT = 2  # `origin` sent its subtree sum to `target`
    META_REDUCE_RECEIVED = 3  # `src` received the subtree sum of `origin`
    META_REDUCE_REQUEST = 4  # please send me your subtree sum again (to relay it)
    DATA_REDUCE_REQUEST = 5  # here is my subtree sum: relay it to `target`
    DATA_BCAST = 6  # the final result of the step
    META_BCAST_RECEIVED = 7  # `src` has the final result
    META_BCAST_SENT = 8  # `src` sent the final result to `target`
    ABORT = 9  # the step cannot finish: `reason`, `missing`
    HELLO = 10  # first frame on a connection: who is speaking
    PROBE = 11  # is this primary link healthy again? (link memory)
    PROBE_ACK = 12  # yes, it carried your probe
    # membership (core/membership.py); `epoch` is the sender's view unless said otherwise
    PING = 13  # are you alive? (a step is slow and you have been silent)
    PONG = 14  # yes
    SUSPECT = 15  # rank `target` is silent or gone to me (code 1), or heard again (code 0)
    ALIVE = 16  # rank `target` answered me just now: do not evict it
    # a view change is single-decree Paxos over the next view of `epoch` (membership.py): the
    # value is (`proposed` epoch, `members`, `committed` steps, catch-up `plan`)
    VIEW_PREPARE = 17  # ballot `ballot`: promise me and fence your results (`missing`: whom I find dead)
    VIEW_PROMISE = 18  # promised `ballot`; `steps` I hold results of; the value I accepted, if any (`accepted`)
    VIEW_ACCEPT = 19  # accept this value at `ballot`
    VIEW_ACCEPTED = 20  # accepted it at `ballot`
    VIEW_COMMIT = 21  # this value is decided: install it
    VIEW_NACK = 22  # I promised `ballot`, higher than yours; or (`proposed` set) I installed this value already
    MINORITY = 23  # the change found no majority: `members` promised, `world` was the view's size
    CATCHUP = 24  # the committed result of (step, chunk) for a rank that did not get it
    # elastic membership (membership.py, net/node.py, training/elastic.py)
    JOIN = 25  # `query` a Query; `incarnation`: this process; `addresses`: where `src` listens
    JOIN_REPLY = 26  # `answer` an Answer: RUNNING in view `epoch` (`members`); ADMITTED into `epoch` (`members`)
    #                  from allreduce `step`, training step `user_step`; STARTING (no group yet). `addresses`:
    #                  where the members listen
    LEAVE = 27  # `src` finished its last step and leaves: drop it from the next view without waiting
    STATE_REQUEST = 28  # send me the training state as of training step `user_step` or later
    STATE = 29  # piece `chunk` of `world` of the training state at training step `user_step`; `signature`: digest
    # slow is not broken (protocol.py, "Watches"): a backup node whose watch ran out asks the
    # sender whether its frame is still getting through before it acts
    META_BCAST_REQUEST = 30  # to the parent of `target`: is your result to `target` getting through?
    META_STALLED = 31  # from that parent: my result to `target` is not getting through, send yours
    DONE = 32  # `src` finished its last step `step` and closes once its peers have finished too
    DONE_ACK = 33  # `src` has an outcome of step `step`: it needs nothing more of you for it
    PACE = 34  # to the coordinator: my uplink sends `rate` bytes per second, far from the view's pace
    # the handshake (net/handshake.py): their frames have headers of their own, never a Message
    CHALLENGE = 35  # the acceptor's nonce and its proof of the job's key
    PROOF = 36  # the dialer's proof of the job's key
    # a member passes a JOIN on to the coordinator, whose link to the joiner may be down: rank
    # `target`, process `incarnation`, listening at `addresses`, asks to be admitted
    JOIN_ASK = 37
    # stragglers (protocol.py, Config.straggler_policy): from the parent in the op's tree: the
    # step closes without the late ranks below you; if you have not submitted, take part with
    # `size` zeros of `dtype` (not counted: you are late), and pass it on to your children
    # whose sums have not come
    META_CLOSE = 38
    # slow compute is not broken (detection.py): an answer to a PING for `step` from a rank
    # whose caller has not submitted `step` yet, to every member: I am alive and still computing
    COMPUTING = 39


DATA_KINDS = frozenset({Kind.DATA_REDUCE, Kind.DATA_REDUCE_REQUEST, Kind.DATA_BCAST, Kind.CATCHUP})
#: the frames of a step's reduce and broadcast and of link probes: hundreds per step
TREE_OP_KINDS = frozenset({Kind.DATA_REDUCE, Kind.META_REDUCE_SENT, Kind.META_REDUCE_RECEIVED,
                            Kind.META_REDUCE_REQUEST, Kind.DATA_REDUCE_REQUEST, Kind.DATA_BCAST,
                            Kind.META_BCAST_RECEIVED, Kind.META_BCAST_SENT, Kind.PROBE, Kind.PROBE_ACK,
                            Kind.META_BCAST_REQUEST, Kind.META_STALLED, Kind.META_CLOSE})
#: the membership's kinds (Detection, Agreement, Join but JOIN_REPLY, Notice): frames of no step
VIEW_KINDS = frozenset({Kind.PING, Kind.PONG, Kind.SUSPECT, Kind.ALIVE, Kind.COMPUTING, Kind.VIEW_PREPARE,
                        Kind.VIEW_PROMISE, Kind.VIEW_ACCEPT, Kind.VIEW_ACCEPTED, Kind.VIEW_COMMIT, Kind.VIEW_NACK,
                        Kind.MINORITY, Kind.JOIN, Kind.JOIN_ASK, Kind.LEAVE, Kind.DONE, Kind.DONE_ACK, Kind.PACE})
#: the kinds a backup node sends to ask whether a frame is getting through: the node hands the
#: machine what its transport knows of the link to the message's `target` with them
LINK_QUERY_KINDS = frozenset({Kind.META_REDUCE_REQUEST, Kind.META_BCAST_REQUEST})
STATE_DTYPE = "|u1"  # STATE carries raw bytes


class Query(IntEnum):
    """What a JOIN asks (Join.query; admission.py)."""

    IS_RUNNING = 0  # is a group running already? (every starting process asks its peers)
    ADMIT_ME = 1  # let this process in as its rank


class Answer(IntEnum):
    """What a JOIN_REPLY says (Join.answer; admission.py)."""

    RUNNING = 0  # a group runs in view `epoch` with `members`: ask it to admit you
    ADMITTED = 1  # you are in view `epoch` from allreduce `step`, training step `user_step`
    STARTING = 2  # no group runs yet: this rank is starting up too


class Sender(Enum):
    """Who may send a kind. The transport proves the rank a frame comes from (net/handshake.py);
    these rules say which proven ranks a frame is taken from (core/replica.py applies them before
    a frame changes any state; a frame from anyone else is dropped, counted and logged once). A
    step's frame (`Message`) has a second rule, its sender's role in the step's tree
    (core/roles.py's ROLE_RULES, which the tree machine applies the same way)."""

    MEMBER = "a member of the receiver's view, of a view it has decided to take, or a rank it is admitting"
    # a MEMBER (the replica's gate), and then the one its ballot names (membership.py checks it)
    COORDINATOR = "the coordinator of the ballot it commits, a member of the receiver's view"
    PROVEN = "any rank that proved the job's key: a process asking to join, or answering one"
    HANDSHAKE = "the other end of a connection, during its handshake (never a Frame)"


# ---- the message types ------------------------------------------------------------------------
#
# One type per family of kinds, with the fields that family needs and each field with one
# meaning; the kinds of a family and who may send each sit next to its fields (`RULES`). The
# wire keys of a family's fields are in `WIRE`: (header key, field, what errors call it, type).

_INT, _INTS, _STR, _BOOL, _ADDRS = range(5)
WireType = int | type[IntEnum]  # one of the five above, or an enum whose values the field takes
Payload = bytes | bytearray | memoryview


@dataclass(slots=True, kw_only=True)
class Frame:
    """What every frame has: its kind, the rank that sent it (the transport proves it), the
    view it belongs to, and the raw bytes that follow its header, if any.

    Treat it as immutable: one frame may sit in several links' queues. It is not declared
    frozen because a frozen dataclass sets each of its fields through `object.__setattr__`:
    6.5 us to build one against 1.7 us, and every frame builds one on each side. To change a
    field, take a copy with `but`."""

    RULES: ClassVar[Mapping[Kind, Sender]] = {}
    WIRE: ClassVar[tuple[tuple[str, str, str, WireType], ...]] = ()

    kind: Kind
    src: int
    epoch: int = 0  # the membership view the frame belongs to (view.py)
    payload: Payload | None = field(default=None, repr=False)

    def but(self, **changes: Any) -> Self:
        """A copy with `changes` applied (a field-by-field copy: `dataclasses.replace` builds
        through `__init__` and costs four times as much)."""
        cls = type(self)
        names = _SLOTS[cls]
        copy = object.__new__(cls)
        for name in names:
            setattr(copy, name, getattr(self, name))
        for name, value in changes.items():
            if name not in names:
                raise TypeError(f"{cls.__name__} has no field {name!r}")
            setattr(copy, name, value)
        return copy


@dataclass(slots=True, kw_only=True)
class Message(Frame):
    """A frame of a step (protocol.py): the reduce, the broadcast, their confirmations and
    relays, link probes, a committed result for a rank that lacks it, an abort. `step` and
    `chunk` name the op; `origin` is the rank whose subtree sum (or confirmation) it is about;
    `target` the rank it concerns or must be relayed to; `contributors` the ranks summed into
    `payload`."""

    RULES: ClassVar[Mapping[Kind, Sender]] = dict.fromkeys(
        (*sorted(TREE_OP_KINDS), Kind.CATCHUP, Kind.ABORT), Sender.MEMBER)
    WIRE = (("s", "step", "step", _INT), ("c", "chunk", "chunk", _INT), ("tr", "tree", "tree", _INT),
            ("nc", "chunks", "chunk count", _INT), ("o", "origin", "origin", _INT), ("t", "target", "target", _INT),
            ("n", "contributors", "contributors", _INTS), ("d", "dtype", "dtype", _STR),
            ("e", "numel", "numel", _INT), ("g", "signature", "signature", _STR),
            ("qb", "queued_bytes", "queued bytes", _INT), ("rt", "rate", "rate", _INT),
            ("an", "answer", "answer", _BOOL), ("pl", "planned", "planned", _BOOL),
            ("r", "reason", "reason", _STR), ("m", "missing", "missing", _INTS), ("ab", "code", "abort code", _INT),
            ("lt", "late", "late ranks", _INTS), ("sz", "size", "size", _INT), ("cl", "closable", "closable", _BOOL))

    step: int = -1
    chunk: int = 0
    tree: int = 0  # which tree the op runs on (trees.py)
    chunks: int = 1  # how many chunks the op's step has (the tree rule depends on it)
    origin: int = -1
    target: int = -1
    contributors: tuple[int, ...] = ()
    dtype: str = ""
    numel: int = 0  # elements of the payload
    signature: str = ""  # full tensor's dtype and shape, to catch mismatched workers
    queued_bytes: int = 0  # META_*_SENT: bytes the sender had queued ahead, not yet acknowledged (timeouts.py)
    rate: int = 0  # META_*_SENT: the sender's measured uplink in bytes per second (0: not measured yet)
    answer: bool = False  # META_*_SENT: answers a check; queued_bytes is what the link to `target` still holds
    planned: bool = False  # DATA_REDUCE(_REQUEST): sent around a link marked failed, not after a loss
    reason: str = ""  # ABORT: why, for the user
    missing: tuple[int, ...] = ()  # ABORT: ranks whose contributions never arrived
    code: int = 0  # ABORT: an AbortCode (protocol.py)
    late: tuple[int, ...] = ()  # data kinds: ranks that were late and take part with zeros, not counted
    size: int = 0  # META_CLOSE: the chunk's elements (of `dtype`), for a late rank's zeros
    closable: bool = False  # DATA_REDUCE(_REQUEST): the step may close without late ranks (Submit.closable)

    @property
    def op(self) -> tuple[int, int]:
        return (self.step, self.chunk)


@dataclass(slots=True, kw_only=True)
class Detection(Frame):
    """Failure detection (detection.py): a ping and its answer, what a member reports of
    another (`target`), and a member that is alive but has not submitted a step yet."""

    RULES: ClassVar[Mapping[Kind, Sender]] = dict.fromkeys(
        (Kind.PING, Kind.PONG, Kind.SUSPECT, Kind.ALIVE, Kind.COMPUTING), Sender.MEMBER)
    WIRE = (("t", "target", "target", _INT), ("gn", "gone", "gone", _BOOL), ("s", "step", "step", _INT))

    # SUSPECT, ALIVE: the rank reported; PING: a self-check's number (-1: none), which its PONG echoes
    target: int = -1
    # SUSPECT: silent or gone to the sender (False: heard again); PONG: the answerer is in a view change
    gone: bool = False
    step: int = -1  # PING: the newest step the sender waits on; COMPUTING: the oldest one not submitted here


@dataclass(slots=True, kw_only=True)
class Agreement(Frame):
    """The view change (agreement.py): single-decree Paxos over the view after `epoch`, whose
    value is (`proposed` epoch, `members`, `committed` steps, catch-up `plan`, `user_step`,
    `pace`); MINORITY when it finds no majority. Relayed copies name their first sender in
    `origin` and their addressee in `target`."""

    RULES: ClassVar[Mapping[Kind, Sender]] = {
        **dict.fromkeys((Kind.VIEW_PREPARE, Kind.VIEW_PROMISE, Kind.VIEW_ACCEPT, Kind.VIEW_ACCEPTED, Kind.VIEW_NACK,
                         Kind.MINORITY), Sender.MEMBER),
        Kind.VIEW_COMMIT: Sender.COORDINATOR}
    WIRE = (("t", "target", "target", _INT), ("o", "origin", "origin", _INT), ("bl", "ballot", "ballot", _INT),
            ("ac", "accepted", "accepted ballot", _INT), ("pp", "proposed", "proposed epoch", _INT),
            ("mb", "members", "members", _INTS), ("cm", "committed", "committed", _INTS),
            ("pn", "plan", "plan", _INTS), ("us", "user_step", "user step", _INT), ("pc", "pace", "pace", _INT),
            ("ul", "uplinks", "uplinks", _INTS), ("st", "steps", "steps", _INTS),
            ("ts", "sender_user_step", "sender user step", _INT),
            ("rt", "rate", "rate", _INT), ("dd", "dead", "dead", _INTS), ("jn", "joining", "joining", _INTS),
            ("pr", "pace_round", "pace round", _BOOL), ("pm", "promised", "promised", _INTS),
            ("w", "view_size", "view size", _INT))

    target: int = -1
    origin: int = -1
    ballot: int = 0  # the Paxos ballot (round and coordinator); MINORITY: 0 from a rank that would coordinate
    accepted: int = 0  # VIEW_PROMISE: the ballot of the value accepted before (0: none)
    proposed: int = 0  # the value's epoch (0: no value in this frame)
    members: tuple[int, ...] = ()  # the value's ranks in slot order
    committed: tuple[int, ...] = ()  # the value's steps kept (results some member holds)
    plan: tuple[int, ...] = ()  # the value's catch-up plan, flattened (membership.py)
    user_step: int = -1  # the value's training step a join or pace change takes effect at (-1: at once)
    pace: int = 0  # the value's pace, bytes per second (view.py; 0: the configured one)
    uplinks: tuple[int, ...] = ()  # the value's members' measured uplinks, bytes per second (view.py)
    steps: tuple[int, ...] = ()  # VIEW_PROMISE: the steps the sender holds complete results of
    sender_user_step: int = -1  # VIEW_PROMISE: the user step the sender is in (a join starts after it)
    rate: int = 0  # VIEW_PROMISE: the sender's measured uplink, bytes per second
    dead: tuple[int, ...] = ()  # VIEW_PREPARE: the ranks the coordinator finds dead
    joining: tuple[int, ...] = ()  # VIEW_PREPARE: the ranks asking to join
    pace_round: bool = False  # VIEW_PREPARE: the round changes the pace only
    promised: tuple[int, ...] = ()  # MINORITY: the ranks that promised (or answered)
    view_size: int = 0  # MINORITY: the size of the view that lost its majority


@dataclass(slots=True, kw_only=True)
class Join(Frame):
    """The join handshake (admission.py): JOIN asks whether a group runs or to be let in,
    JOIN_ASK is a member passing such a request on, JOIN_REPLY answers."""

    RULES: ClassVar[Mapping[Kind, Sender]] = {
        Kind.JOIN: Sender.PROVEN,  # a restarted or new process: not in the view yet
        Kind.JOIN_REPLY: Sender.PROVEN,  # to such a process, which knows no view yet
        Kind.JOIN_ASK: Sender.MEMBER,
    }
    WIRE = (("q", "query", "query", Query), ("an", "answer", "answer", Answer),
            ("in", "incarnation", "incarnation", _INT),
            ("t", "target", "target", _INT), ("ad", "addresses", "addresses", _ADDRS),
            ("mb", "members", "members", _INTS), ("s", "step", "step", _INT), ("us", "user_step", "user step", _INT),
            ("pc", "pace", "pace", _INT), ("ul", "uplinks", "uplinks", _INTS))

    query: Query = Query.IS_RUNNING  # JOIN, JOIN_ASK: what is asked
    answer: Answer = Answer.RUNNING  # JOIN_REPLY: what the member says
    incarnation: int = 0  # JOIN, JOIN_ASK: which start of the asking process this is
    target: int = -1  # JOIN_ASK: the rank asking to be admitted
    addresses: tuple[tuple[int, str], ...] = ()  # (rank, "host:port") of the ranks the frame names
    members: tuple[int, ...] = ()  # JOIN_REPLY: the view's ranks
    step: int = -1  # JOIN_REPLY, ADMITTED: the allreduce step the joiner takes part from
    user_step: int = -1  # JOIN_REPLY, ADMITTED: the training step that is
    pace: int = 0  # JOIN_REPLY: the view's pace
    uplinks: tuple[int, ...] = ()  # JOIN_REPLY: the view's members' measured uplinks


@dataclass(slots=True, kw_only=True)
class Notice(Frame):
    """What a member tells the others of itself (membership.py, farewell.py): it leaves, it
    finished (with the finished ranks it knows of), it has an outcome of a finished peer's last
    step, its uplink is far from the view's pace."""

    RULES: ClassVar[Mapping[Kind, Sender]] = dict.fromkeys(
        (Kind.LEAVE, Kind.DONE, Kind.DONE_ACK, Kind.PACE), Sender.MEMBER)
    WIRE = (("s", "step", "step", _INT), ("rt", "rate", "rate", _INT), ("fn", "finished", "finished", _INTS),
            ("ls", "last_steps", "last steps", _INTS))

    step: int = -1  # DONE: the sender's last step; DONE_ACK: the step it has an outcome of
    rate: int = 0  # PACE: the sender's uplink, bytes per second
    finished: tuple[int, ...] = ()  # DONE: the ranks the sender knows to be finished...
    last_steps: tuple[int, ...] = ()  # ...and their last steps, in the same order


@dataclass(slots=True, kw_only=True)
class State(Frame):
    """A joiner's training state from a peer (training/elastic.py)."""

    RULES: ClassVar[Mapping[Kind, Sender]] = dict.fromkeys((Kind.STATE_REQUEST, Kind.STATE), Sender.MEMBER)
    WIRE = (("us", "user_step", "user step", _INT), ("c", "piece", "piece", _INT),
            ("np", "pieces", "pieces", _INT), ("dg", "digest", "digest", _STR), ("e", "numel", "numel", _INT))

    user_step: int = -1  # the training step the state is of (STATE_REQUEST: or later)
    piece: int = 0  # STATE: which piece this is...
    pieces: int = 0  # ...of how many
    digest: str = ""  # STATE: the whole state's digest (training/state.py)
    numel: int = 0  # STATE: the payload's bytes


FAMILIES: tuple[type[Frame], ...] = (Message, Detection, Agreement, Join, Notice, State)
#: the type of every kind's frames
FAMILY_OF: dict[Kind, type[Frame]] = {kind: family for family in FAMILIES for kind in family.RULES}
#: the sender rule of every kind
SENDER_RULES: dict[Kind, Sender] = {
    **{kind: rule for family in FAMILIES for kind, rule in family.RULES.items()},
    Kind.HELLO: Sender.HANDSHAKE, Kind.CHALLENGE: Sender.HANDSHAKE, Kind.PROOF: Sender.HANDSHAKE,
}
_EVERY_TYPE: tuple[type[Frame], ...] = (Frame, *FAMILIES)
_SLOTS: dict[type[Frame], frozenset[str]] = {
    cls: frozenset(f.name for f in dataclass_fields(cls)) for cls in _EVERY_TYPE}


def make(kind: Kind, src: int, **fields: Any) -> Frame:
    """A frame of `kind` (of its family's type); TypeError names a field the family lacks."""
    family = FAMILY_OF.get(kind)
    if family is None:
        raise TypeError(f"{kind.name} travels in the handshake's frames, not as a Frame")
    return family(kind=kind, src=src, **fields)


def encode(msg: Frame) -> list[bytes | memoryview]:
    """Buffers to write for one frame; the payload is passed through untouched."""
    if FAMILY_OF.get(msg.kind) is not type(msg):  # would decode as another type, or not at all
        raise TypeError(f"{msg.kind.name} travels as {getattr(FAMILY_OF.get(msg.kind), '__name__', 'no Frame')}, "
                        f"not as {type(msg).__name__}")
    header: dict[str, Any] = {"k": int(msg.kind), "f": msg.src}
    if msg.epoch:
        header["ep"] = msg.epoch
    if type(msg) is Message:
        _encode_step_fields(msg, header)
    else:
        _encode_fields(msg, header)
    head = msgpack.packb(header)
    payload = b"" if msg.payload is None else memoryview(msg.payload).cast("B")
    prefix = PREFIX.pack(MAGIC, VERSION, len(head), len(payload))
    return [prefix + head, payload] if len(payload) else [prefix + head]


def _encode_step_fields(msg: Message, header: dict[str, Any]) -> None:
    """A step's frame: hundreds a step, so written out field by field."""
    header["s"] = msg.step
    header["c"] = msg.chunk
    if msg.tree:
        header["tr"] = msg.tree
    if msg.chunks != 1:
        header["nc"] = msg.chunks
    if msg.origin >= 0:
        header["o"] = msg.origin
    if msg.target >= 0:
        header["t"] = msg.target
    if msg.contributors:
        header["n"] = list(msg.contributors)
    if msg.payload is not None:
        header.update(d=msg.dtype, e=msg.numel, g=msg.signature)
    elif msg.kind is Kind.META_CLOSE:
        header.update(d=msg.dtype, g=msg.signature)
    if msg.late or msg.closable or msg.size:
        _encode_straggler_fields(msg, header)
    if msg.queued_bytes:
        header["qb"] = msg.queued_bytes
    if msg.rate:
        header["rt"] = msg.rate
    if msg.answer:
        header["an"] = True
    if msg.planned:
        header["pl"] = True
    if msg.kind is Kind.ABORT:
        _encode_abort(msg, header)


def _encode_straggler_fields(msg: Message, header: dict[str, Any]) -> None:
    if msg.late:
        header["lt"] = list(msg.late)
    if msg.closable:
        header["cl"] = True
    if msg.size:
        header["sz"] = msg.size


def _encode_abort(msg: Message, header: dict[str, Any]) -> None:
    if msg.code:
        header["ab"] = msg.code
    if msg.reason:
        header["r"] = msg.reason
    if msg.missing:
        header["m"] = list(msg.missing)


def _encode_fields(msg: Frame, header: dict[str, Any]) -> None:
    """Any other family: the fields that differ from their defaults, by the family's WIRE."""
    defaults = _DEFAULTS[type(msg)]
    for key, name, _label, kind_of in msg.WIRE:
        value = getattr(msg, name)
        if value == defaults[name]:
            continue
        if kind_of == _ADDRS:
            value = [list(pair) for pair in value]
        elif kind_of == _INTS:
            value = list(value)
        header[key] = value
    if msg.payload is not None:  # a STATE piece: raw bytes
        header["d"] = STATE_DTYPE


def decode_prefix(raw: bytes, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[int, int]:
    """Header and payload lengths from a frame prefix, or FrameError."""
    magic, version, head_len, payload_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r} (not an fttree peer?)")
    if version != VERSION:
        raise FrameError(f"wire version {version} is not supported (this is version {VERSION})")
    if not 0 < head_len <= MAX_HEADER_BYTES:
        raise FrameError(f"frame header length {head_len} outside 1..{MAX_HEADER_BYTES}")
    if payload_len > max_payload_bytes:
        raise FrameError(f"frame payload of {payload_len} bytes exceeds the limit of {max_payload_bytes}")
    return head_len, payload_len


_KINDS: dict[int, Kind] = {kind.value: kind for kind in Kind}
_COMMON = (("f", "src", "src", _INT), ("ep", "epoch", "epoch", _INT))
#: family -> header key -> (field, what errors call it, type)
_FIELDS: dict[type[Frame], dict[str, tuple[str, str, WireType]]] = {
    cls: {key: (name, label, kind_of) for key, name, label, kind_of in (*_COMMON, *cls.WIRE)} for cls in FAMILIES}
_DEFAULTS: dict[type[Frame], dict[str, Any]] = {
    cls: {f.name: f.default for f in dataclass_fields(cls)} for cls in FAMILIES}
MAX_ADDRESSES = 4096  # a JOIN_REPLY names every member's address once


def _addresses(value: Any, label: str) -> tuple[tuple[int, str], ...]:
    if (type(value) is not list or len(value) > MAX_ADDRESSES
            or not all(type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is str for p in value)):
        raise FrameError(f"frame field {label} must be a list of at most {MAX_ADDRESSES} [rank, address] pairs")
    return tuple((rank, address) for rank, address in value)


def unpack_map(head: bytes, what: str) -> dict[Any, Any]:
    """A header's msgpack map, or FrameError naming `what` is wrong with it."""
    try:
        header = msgpack.unpackb(head, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"{what} is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise FrameError(f"{what} is not a map")
    return header


def _header_fields(header: dict[Any, Any], table: dict[str, tuple[str, str, WireType]]) -> dict[str, Any]:
    """The fields of a header that its family has (`table`), each checked for its type; keys
    the family lacks are ignored, as unknown ones are."""
    fields: dict[str, Any] = {"src": -1}
    for key, value in header.items():
        spec = table.get(key)
        if spec is None:
            continue
        name, label, kind_of = spec
        if kind_of == _INT:
            if type(value) is not int:
                raise FrameError(f"frame field {label} must be an integer, got {value!r}")
        elif kind_of == _INTS:
            if type(value) is not list or not all(type(v) is int for v in value):
                raise FrameError(f"frame field {label} must be a list of integers")
            value = tuple(value)
        elif kind_of == _STR:
            if type(value) is not str:
                raise FrameError(f"frame field {label} must be a string")
        elif kind_of == _ADDRS:
            value = _addresses(value, label)
        elif isinstance(kind_of, type):  # an enum: one of its values, as its member
            member = kind_of._value2member_map_.get(value) if type(value) is int else None
            if member is None:
                raise FrameError(f"frame field {label} must be one of {[int(m) for m in kind_of]}, got {value!r}")
            value = member
        elif type(value) is not bool:
            raise FrameError(f"frame field {label} must be true or false, got {value!r}")
        fields[name] = value
    return fields


def decode_header(head: bytes, payload: Payload | None) -> Frame:
    """Build a frame of its kind's type from a header and payload, validating types, kind and
    sizes. One pass over the header's keys: every frame goes through here, hundreds per step,
    so it avoids a lookup and a call per field."""
    header = unpack_map(head, "frame header")
    raw_kind = header.get("k", -1)
    if type(raw_kind) is not int:
        raise FrameError(f"frame field kind must be an integer, got {raw_kind!r}")
    kind = _KINDS.get(raw_kind)  # a dict: calling Kind(raw_kind) costs a microsecond per frame
    if kind is None:
        raise FrameError(f"unknown message kind {raw_kind}")
    family = FAMILY_OF.get(kind)
    if family is None:
        raise FrameError(f"{kind.name} belongs to the handshake, not after it")
    fields = _header_fields(header, _FIELDS[family])
    payload_len = 0 if payload is None else len(payload)
    if family is Message:
        _check_step_payload(kind, fields, payload_len)
    elif kind is Kind.STATE:
        dtype = header.get("d", "")
        if dtype != STATE_DTYPE or fields.get("numel", 0) != payload_len:
            raise FrameError(f"STATE must carry {fields.get('numel', 0)} raw bytes as {STATE_DTYPE!r}, got "
                             f"{payload_len} as {dtype!r}")
    elif payload_len or fields.get("numel", 0):
        raise FrameError(f"{kind.name} must not carry a payload ({payload_len} bytes, numel {fields.get('numel', 0)})")
    return family(kind=kind, payload=payload if payload_len else None, **fields)


def _check_step_payload(kind: Kind, fields: dict[str, Any], payload_len: int) -> None:
    """A step's payload is `numel` wire-dtype elements (data kinds), or none."""
    if fields.get("tree", 0) < 0:
        raise FrameError(f"frame field tree must not be negative, got {fields['tree']!r}")
    if fields.get("chunks", 1) < 1:
        raise FrameError(f"frame field chunk count must be at least 1, got {fields['chunks']!r}")
    dtype: str = fields.get("dtype", "")
    numel: int = fields.get("numel", 0)
    if kind in DATA_KINDS:
        if dtype not in WIRE_DTYPES:
            raise FrameError(f"{kind.name} carries unsupported dtype {dtype!r}")
        if numel < 0 or wire_nbytes(dtype, numel) != payload_len:
            raise FrameError(f"{kind.name} payload of {payload_len} bytes does not hold {numel} x {dtype}")
    elif payload_len or numel:
        raise FrameError(f"{kind.name} must not carry a payload ({payload_len} bytes, numel {numel})")


def decode(frame: bytes | bytearray, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Frame:
    """Decode one whole frame held in memory (tests and the simulator use this)."""
    if len(frame) < PREFIX.size:
        raise FrameError(f"frame of {len(frame)} bytes is shorter than its {PREFIX.size}-byte prefix")
    head_len, payload_len = decode_prefix(bytes(frame[: PREFIX.size]), max_payload_bytes=max_payload_bytes)
    end = PREFIX.size + head_len + payload_len
    if len(frame) != end:
        raise FrameError(f"frame is {len(frame)} bytes but its prefix announces {end}")
    head = bytes(frame[PREFIX.size : PREFIX.size + head_len])
    payload = memoryview(frame)[PREFIX.size + head_len :] if payload_len else None
    return decode_header(head, payload)


# ---- wire compression -------------------------------------------------------------------------
#
# Float32 data may travel as bfloat16 or float16 (Config.compression): half the bytes. Every hop
# decodes to float32, adds in float32 and encodes again; the root's result is decoded from its
# own encoding, so what every rank holds is the same float32 values bit for bit.


def encode_bf16(a: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16): round to nearest, ties to even, as hardware does.
    Overflow rounds to infinity; a NaN stays a (quiet) NaN of the same sign. `scratch`, a
    uint32 array of a's size, saves a fresh one (whose pages would have to be zeroed)."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    u = f.view(np.uint32)
    t = np.right_shift(u, 16, out=scratch)
    t &= 1
    t += 0x7FFF  # with the lowest kept bit: ties go to the even neighbour
    t += u  # wraps only for negative NaNs, fixed below
    t >>= 16
    out = t.astype(np.uint16)
    # min() is NaN exactly when some element is: one pass, no mask to allocate
    if f.size and np.isnan(np.minimum.reduce(f, axis=None)):
        nan = np.isnan(f)
        out[nan] = (np.right_shift(u[nan], 16) | 0x0040).astype(np.uint16)
    return out


def encode_int8(a: np.ndarray) -> np.ndarray:
    """float32 -> the int8 wire form (uint8 bytes): per block of INT8_BLOCK elements its scale
    (absmax / 127, float32), then every element rounded to the nearest multiple of its block's
    scale (int8, -127..127). The error of an element is at most half its block's scale. A block
    holding NaN or Inf gets a NaN scale: it decodes to NaN, never to a finite wrong value."""
    f = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    n = f.size
    blocks = -(-n // INT8_BLOCK)
    out = np.empty(4 * blocks + n, dtype=np.uint8)
    whole = n - n % INT8_BLOCK
    scales = np.empty(blocks, dtype=np.float32)
    if whole:
        np.max(np.abs(f[:whole]).reshape(-1, INT8_BLOCK), axis=1, out=scales[: whole // INT8_BLOCK])
    if whole < n:
        scales[-1] = np.max(np.abs(f[whole:]))
    scales /= 127
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(scales > 0, np.float32(1) / scales, np.float32(0)).astype(np.float32)
    per_element = np.repeat(inverse, INT8_BLOCK)[:n]
    with np.errstate(invalid="ignore"):  # inf * 0 in a non-finite block, whose scale says NaN
        q = np.rint(f * per_element)  # |q| <= 127 by the scale's construction
    np.nan_to_num(q, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    scales[~np.isfinite(scales)] = np.nan
    out[: 4 * blocks] = scales.view(np.uint8)
    out[4 * blocks :] = q.astype(np.int8).view(np.uint8)
    return out


def decode_int8(payload: np.ndarray, numel: int, into: np.ndarray | None = None) -> np.ndarray:
    """The int8 wire form (uint8 bytes of `numel` elements) -> float32; into `into` if given."""
    blocks = -(-numel // INT8_BLOCK)
    raw = np.asarray(payload, dtype=np.uint8)
    scales = raw[: 4 * blocks].view(np.float32)
    values = raw[4 * blocks :].view(np.int8)
    out = np.empty(numel, dtype=np.float32) if into is None else into
    np.multiply(values, np.repeat(scales, INT8_BLOCK)[:numel], out=out, casting="unsafe")
    return out


def decode_bf16(bits: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly; into `into` (float32, bits' size) if given."""
    wide = np.left_shift(np.asarray(bits, dtype=np.uint16), 16, dtype=np.uint32,
                         out=None if into is None else into.view(np.uint32))
    return wide.view(np.float32)


class Buffers(Protocol):
    """Where temporary arrays come from (core/buffers.py's BufferPool)."""

    def array(self, count: int, dtype: np.dtype[Any] | str) -> np.ndarray: ...


def to_wire(a: np.ndarray, wire: str, pool: Buffers | None = None) -> np.ndarray:
    """`a` (1-D) as it travels as `wire`: itself when `wire` is its dtype, else encoded (with
    bf16's working array from `pool`, if given)."""
    if wire == a.dtype.str:
        return a
    if wire == BF16:
        return encode_bf16(a, None if pool is None else pool.array(a.size, np.dtype(np.uint32)))
    if wire == INT8:
        return encode_int8(a)
    return a.astype(np.dtype(wire))


def from_wire(payload: bytes | bytearray | memoryview, wire: str, dtype: str,
              into: np.ndarray | None = None) -> np.ndarray:
    """The `dtype` array a payload of `wire` holds: a view of the payload when nothing was
    encoded (`into` is then not used), else decoded into `into` (an array of `dtype` and the
    payload's length) or a new array. bf16 is float32 data only."""
    if wire == dtype:
        return np.frombuffer(payload, dtype=np.dtype(dtype))
    if wire == INT8:
        assert dtype == "<f4", f"int8 carries float32 data, not {dtype}"
        raw = np.frombuffer(payload, dtype=np.uint8)
        return decode_int8(raw, wire_numel(INT8, raw), into)
    if into is not None:
        if wire == BF16:
            assert dtype == "<f4", f"bf16 carries float32 data, not {dtype}"
            return decode_bf16(np.frombuffer(payload, dtype=np.uint16), into)
        np.copyto(into, np.frombuffer(payload, dtype=np.dtype(wire)))
        return into
    if wire == BF16:
        return decode_bf16(np.frombuffer(payload, dtype=np.uint16)).astype(np.dtype(dtype), copy=False)
    return np.frombuffer(payload, dtype=np.dtype(wire)).astype(np.dtype(dtype))
