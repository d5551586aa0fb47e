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
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from enum import Enum, IntEnum
from typing import Any, Protocol

import msgpack
import numpy as np

from ..errors import FrameError

MAGIC = b"FT"
VERSION = 7  # 2: epoch in every header, ABORT code and queued bytes in fields of their own; 3: membership; 4: joins;
#               5: a control and a bulk connection per peer, link progress queries, DONE; 6: the authenticated
#               handshake (net/handshake.py); 7: the join handshake's addresses in a field of their own
PREFIX = struct.Struct(">2sBIQ")
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30

#: dtypes allowed on the wire (numpy `dtype.str`, and "bf16") and their bytes per element. A
#: bfloat16 *tensor* travels as float32 (see api.py); "bf16" is float32 data compressed on the wire.
WIRE_ITEMSIZE = {"<f2": 2, "<f4": 4, "<f8": 8, "<i4": 4, "<i8": 8, "bf16": 2}
WIRE_DTYPES = frozenset(WIRE_ITEMSIZE)
BF16 = "bf16"  # the top 16 bits of a float32, rounded to nearest even (numpy has no bfloat16)
#: Config.compression -> the wire dtype float32 data travels as (other dtypes travel as they are)
COMPRESSIONS = {"bf16": BF16, "fp16": "<f2"}


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
    JOIN = 25  # `code` a Query (admission.py); `incarnation`: this process; `addresses`: where `src` listens
    JOIN_REPLY = 26  # `code` an Answer: RUNNING in view `epoch` (`members`); ADMITTED into `epoch` (`members`)
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


DATA_KINDS = frozenset({Kind.DATA_REDUCE, Kind.DATA_REDUCE_REQUEST, Kind.DATA_BCAST, Kind.CATCHUP})
#: the frames of a step's reduce and broadcast and of link probes: hundreds per step, carrying
#: only the op fields (no abort, view or join fields, which `encode` leaves out for them)
TREE_OP_KINDS = frozenset({Kind.DATA_REDUCE, Kind.META_REDUCE_SENT, Kind.META_REDUCE_RECEIVED,
                            Kind.META_REDUCE_REQUEST, Kind.DATA_REDUCE_REQUEST, Kind.DATA_BCAST,
                            Kind.META_BCAST_RECEIVED, Kind.META_BCAST_SENT, Kind.PROBE, Kind.PROBE_ACK,
                            Kind.META_BCAST_REQUEST, Kind.META_STALLED})
VIEW_KINDS = frozenset({Kind.PING, Kind.PONG, Kind.SUSPECT, Kind.ALIVE, Kind.VIEW_PREPARE, Kind.VIEW_PROMISE,
                        Kind.VIEW_ACCEPT, Kind.VIEW_ACCEPTED, Kind.VIEW_COMMIT, Kind.VIEW_NACK, Kind.MINORITY,
                        Kind.JOIN, Kind.JOIN_ASK, Kind.LEAVE, Kind.DONE, Kind.DONE_ACK, Kind.PACE})
#: the kinds a backup node sends to ask whether a frame is getting through: the node hands the
#: machine what its transport knows of the link to the message's `target` with them
LINK_QUERY_KINDS = frozenset({Kind.META_REDUCE_REQUEST, Kind.META_BCAST_REQUEST})
ELASTIC_KINDS = frozenset({Kind.JOIN_REPLY, Kind.STATE_REQUEST, Kind.STATE})  # the node's, not the tree's
STATE_DTYPE = "|u1"  # STATE carries raw bytes


class Sender(Enum):
    """Who may send a kind. The transport proves the rank a frame comes from (net/handshake.py);
    these rules say which proven ranks a frame is taken from (net/node.py applies them before a
    frame changes any state; a frame from anyone else is dropped, counted and logged once)."""

    MEMBER = "a member of the receiver's view, of a view it has decided to take, or a rank it is admitting"
    PROVEN = "any rank that proved the job's key: a process asking to join, or answering one"
    HANDSHAKE = "the other end of a connection, during its handshake (never a Message)"


#: the sender rule of every kind
SENDER_RULES: dict[Kind, Sender] = {
    **dict.fromkeys(Kind, Sender.MEMBER),
    Kind.JOIN: Sender.PROVEN,  # a restarted or new process: not in the view yet
    Kind.JOIN_REPLY: Sender.PROVEN,  # to such a process, which knows no view yet
    Kind.HELLO: Sender.HANDSHAKE, Kind.CHALLENGE: Sender.HANDSHAKE, Kind.PROOF: Sender.HANDSHAKE,
}


@dataclass(slots=True, kw_only=True)
class Message:
    """One protocol message. `step` and `chunk` name the collective op it belongs to;
    `origin` is the rank whose subtree sum (or confirmation) it is about; `target` the rank
    it concerns or must be relayed to; `contributors` the ranks summed into `payload`.

    Treat it as immutable: one message may sit in several links' queues. It is not declared
    frozen because a frozen dataclass sets each of its fields through `object.__setattr__`:
    6.5 us to build one against 1.7 us, and every frame builds one on each side. To change a
    field, take a copy with `but`."""

    kind: Kind
    src: int
    epoch: int = 0  # the membership view the message belongs to (view.py)
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
    reason: str = ""  # ABORT: why, for the user
    missing: tuple[int, ...] = ()  # ABORT: ranks whose contributions never arrived
    code: int = 0  # ABORT: an AbortCode
    queued_bytes: int = 0  # META_*_SENT: bytes the sender had queued ahead, not yet acknowledged (timeouts.py)
    rate: int = 0  # META_*_SENT: the sender's measured uplink in bytes per second (0: not measured yet)
    answer: bool = False  # META_*_SENT: answers a check; queued_bytes is what the link to `target` still holds
    planned: bool = False  # DATA_REDUCE(_REQUEST): sent around a link marked failed, not after a loss
    ballot: int = 0  # VIEW_*: the Paxos ballot (round and coordinator)
    accepted: int = 0  # VIEW_PROMISE: the ballot of the value accepted before (0: none)
    proposed: int = 0  # VIEW_*: the epoch of the proposed view (0: no value in this message)
    members: tuple[int, ...] = ()  # VIEW_*: the proposed view's ranks in slot order; MINORITY: who promised
    committed: tuple[int, ...] = ()  # VIEW_*: the steps the proposed view keeps (results some member holds)
    plan: tuple[int, ...] = ()  # VIEW_*: the catch-up plan, flattened (see membership.py)
    steps: tuple[int, ...] = ()  # VIEW_PROMISE: the steps the sender holds complete results of
    user_step: int = -1  # VIEW_*: the training step a join takes effect at; JOIN_REPLY, STATE*: a training step
    pace: int = 0  # VIEW_*, JOIN_REPLY: the proposed view's pace, bytes per second (view.py; 0: the configured one)
    incarnation: int = 0  # JOIN: which start of the sender's process this is
    training_step: int = -1  # VIEW_PROMISE: the training step the sender is in (a join starts after it)
    world: int = 0  # HELLO: the job's size; MINORITY: the size of the view that lost its majority
    addresses: tuple[tuple[int, str], ...] = ()  # JOIN*: (rank, "host:port") of the ranks it names
    payload: bytes | bytearray | memoryview | None = field(default=None, repr=False)

    @property
    def op(self) -> tuple[int, int]:
        return (self.step, self.chunk)

    def but(self, **changes: Any) -> Message:
        """A copy with `changes` applied (a field-by-field copy: `dataclasses.replace` builds
        through `__init__` and costs four times as much)."""
        copy = object.__new__(Message)
        for name in _MESSAGE_SLOTS:
            setattr(copy, name, getattr(self, name))
        for name, value in changes.items():
            if name not in _MESSAGE_FIELDS:
                raise TypeError(f"Message has no field {name!r}")
            setattr(copy, name, value)
        return copy


_MESSAGE_SLOTS: tuple[str, ...] = tuple(f.name for f in dataclass_fields(Message))
_MESSAGE_FIELDS = frozenset(_MESSAGE_SLOTS)


def encode(msg: Message) -> list[bytes | memoryview]:
    """Buffers to write for one frame; the payload is passed through untouched."""
    header: dict[str, Any] = {"k": int(msg.kind), "f": msg.src}
    if msg.kind != Kind.HELLO:
        header.update(s=msg.step, c=msg.chunk)
    if msg.epoch:
        header["ep"] = msg.epoch
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
    if msg.queued_bytes:
        header["qb"] = msg.queued_bytes
    if msg.rate:
        header["rt"] = msg.rate
    if msg.answer:
        header["an"] = True
    if msg.planned:
        header["pl"] = True
    if msg.kind not in TREE_OP_KINDS:  # the fields of aborts, views and joins: not on the hot path
        _encode_rare_fields(msg, header)
    head = msgpack.packb(header)
    payload = b"" if msg.payload is None else memoryview(msg.payload).cast("B")
    prefix = PREFIX.pack(MAGIC, VERSION, len(head), len(payload))
    return [prefix + head, payload] if len(payload) else [prefix + head]


def _encode_rare_fields(msg: Message, header: dict[str, Any]) -> None:
    if msg.code:
        header["ab"] = msg.code
    if msg.reason:
        header["r"] = msg.reason
    if msg.missing:
        header["m"] = list(msg.missing)
    if msg.world:
        header["w"] = msg.world
    for key, ints in (("mb", msg.members), ("cm", msg.committed), ("pn", msg.plan), ("st", msg.steps)):
        if ints:
            header[key] = list(ints)
    for key, value in (("bl", msg.ballot), ("ac", msg.accepted), ("pp", msg.proposed), ("in", msg.incarnation),
                       ("pc", msg.pace)):
        if value:
            header[key] = value
    if msg.addresses:
        header["ad"] = [list(pair) for pair in msg.addresses]
    if msg.user_step >= 0:
        header["us"] = msg.user_step
    if msg.training_step >= 0:
        header["ts"] = msg.training_step


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


def _int(header: dict[Any, Any], key: str, default: int, name: str) -> int:
    value = header.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError(f"frame field {name} must be an integer, got {value!r}")
    return value


def _ints(header: dict[Any, Any], key: str, name: str) -> tuple[int, ...]:
    value = header.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise FrameError(f"frame field {name} must be a list of integers")
    return tuple(value)


def _bool(header: dict[Any, Any], key: str, name: str) -> bool:
    value = header.get(key, False)
    if not isinstance(value, bool):
        raise FrameError(f"frame field {name} must be true or false, got {value!r}")
    return value


def _str(header: dict[Any, Any], key: str, name: str) -> str:
    value = header.get(key, "")
    if not isinstance(value, str):
        raise FrameError(f"frame field {name} must be a string")
    return value


_KINDS: dict[int, Kind] = {kind.value: kind for kind in Kind}
_INT, _INTS, _STR, _BOOL, _ADDRS = range(5)
#: header key -> (Message field, its name in errors, type)
_FIELDS: dict[str, tuple[str, str, int]] = {
    "f": ("src", "src", _INT), "ep": ("epoch", "epoch", _INT), "s": ("step", "step", _INT),
    "c": ("chunk", "chunk", _INT), "tr": ("tree", "tree", _INT),
    "nc": ("chunks", "chunk count", _INT), "o": ("origin", "origin", _INT),
    "t": ("target", "target", _INT),
    "n": ("contributors", "contributors", _INTS), "d": ("dtype", "dtype", _STR), "e": ("numel", "numel", _INT),
    "g": ("signature", "signature", _STR), "r": ("reason", "reason", _STR), "m": ("missing", "missing", _INTS),
    "ab": ("code", "abort code", _INT), "qb": ("queued_bytes", "queued bytes", _INT),
    "rt": ("rate", "rate", _INT), "an": ("answer", "answer", _BOOL),
    "pl": ("planned", "planned", _BOOL), "w": ("world", "world", _INT), "bl": ("ballot", "ballot", _INT),
    "ac": ("accepted", "accepted ballot", _INT), "pp": ("proposed", "proposed epoch", _INT),
    "mb": ("members", "members", _INTS), "cm": ("committed", "committed", _INTS), "pn": ("plan", "plan", _INTS),
    "st": ("steps", "steps", _INTS), "us": ("user_step", "user step", _INT),
    "in": ("incarnation", "incarnation", _INT), "ts": ("training_step", "training step", _INT),
    "pc": ("pace", "pace", _INT), "ad": ("addresses", "addresses", _ADDRS),
}
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


def _header_fields(header: dict[Any, Any]) -> dict[str, Any]:
    """The Message fields of a header, each checked for its type."""
    fields: dict[str, Any] = {"src": -1}
    for key, value in header.items():
        spec = _FIELDS.get(key)
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
        elif type(value) is not bool:
            raise FrameError(f"frame field {label} must be true or false, got {value!r}")
        fields[name] = value
    if fields.get("tree", 0) < 0:
        raise FrameError(f"frame field tree must not be negative, got {fields['tree']!r}")
    if fields.get("chunks", 1) < 1:
        raise FrameError(f"frame field chunk count must be at least 1, got {fields['chunks']!r}")
    return fields


def decode_header(head: bytes, payload: bytes | bytearray | memoryview | None) -> Message:
    """Build a Message from a header and payload, validating types, kind and sizes.

    One pass over the header's keys (unknown keys are ignored): every frame goes through
    here, hundreds per step, so it avoids a lookup and a call per Message field."""
    header = unpack_map(head, "frame header")
    raw_kind = _int(header, "k", -1, "kind")
    kind = _KINDS.get(raw_kind)  # a dict: calling Kind(raw_kind) costs a microsecond per frame
    if kind is None:
        raise FrameError(f"unknown message kind {raw_kind}")
    fields = _header_fields(header)
    payload_len = 0 if payload is None else len(payload)
    # the payload is what the header says: raw state bytes, `numel` wire-dtype elements, or none
    dtype: str = fields.get("dtype", "")
    numel: int = fields.get("numel", 0)
    if kind is Kind.STATE:
        if dtype != STATE_DTYPE or numel != payload_len:
            raise FrameError(f"STATE must carry {numel} raw bytes as {STATE_DTYPE!r}, got {payload_len} as {dtype!r}")
    elif kind in DATA_KINDS:
        if dtype not in WIRE_DTYPES:
            raise FrameError(f"{kind.name} carries unsupported dtype {dtype!r}")
        if numel < 0 or numel * WIRE_ITEMSIZE[dtype] != payload_len:
            raise FrameError(f"{kind.name} payload of {payload_len} bytes does not hold {numel} x {dtype}")
    elif payload_len or numel:
        raise FrameError(f"{kind.name} must not carry a payload ({payload_len} bytes, numel {numel})")
    return Message(kind=kind, payload=payload if payload_len else None, **fields)


def decode(frame: bytes | bytearray, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Message:
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
    return a.astype(np.dtype(wire))


def from_wire(payload: bytes | bytearray | memoryview, wire: str, dtype: str,
              into: np.ndarray | None = None) -> np.ndarray:
    """The `dtype` array a payload of `wire` holds: a view of the payload when nothing was
    encoded (`into` is then not used), else decoded into `into` (an array of `dtype` and the
    payload's length) or a new array. bf16 is float32 data only."""
    if wire == dtype:
        return np.frombuffer(payload, dtype=np.dtype(dtype))
    if into is not None:
        if wire == BF16:
            assert dtype == "<f4", f"bf16 carries float32 data, not {dtype}"
            return decode_bf16(np.frombuffer(payload, dtype=np.uint16), into)
        np.copyto(into, np.frombuffer(payload, dtype=np.dtype(wire)))
        return into
    if wire == BF16:
        return decode_bf16(np.frombuffer(payload, dtype=np.uint16)).astype(np.dtype(dtype), copy=False)
    return np.frombuffer(payload, dtype=np.dtype(wire)).astype(np.dtype(dtype))
