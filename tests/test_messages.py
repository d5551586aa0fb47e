"""Wire codec: round trips, and every way a frame can be broken gives a FrameError."""

import dataclasses
import struct

import msgpack
import numpy as np
import pytest

from fttree.core.messages import (
    DATA_KINDS,
    FAMILY_OF,
    PREFIX,
    SENDER_RULES,
    VERSION,
    Agreement,
    Answer,
    Frame,
    Join,
    Kind,
    Message,
    Query,
    Sender,
    State,
    decode,
    encode,
    make,
)
from fttree.errors import FrameError


def frame(msg: Frame) -> bytes:
    return b"".join(bytes(b) for b in encode(msg))


def test_data_message_round_trip_keeps_payload_bytes() -> None:
    data = np.arange(10, dtype=np.float32)
    msg = Message(kind=Kind.DATA_REDUCE, src=3, step=7, chunk=2, origin=3, contributors=(3, 7, 8),
                  dtype=data.dtype.str, numel=10, signature="float32[10]", payload=memoryview(data).cast("B"))
    out = decode(frame(msg))
    assert (out.kind, out.src, out.step, out.chunk, out.origin, out.contributors) == (
        Kind.DATA_REDUCE, 3, 7, 2, 3, (3, 7, 8))
    assert out.payload is not None
    assert np.array_equal(np.frombuffer(out.payload, dtype=np.float32), data)


def _sample(field_type: str, name: str) -> object:
    """A value unlike the field's default, of its type."""
    if name == "addresses":
        return ((2, "10.0.0.2:29500"), (0, "[::1]:7"))
    if field_type.startswith("tuple"):
        return (5, 0, 3)
    if field_type == "bool":
        return True
    if field_type == "str":
        return "x7"
    if field_type in ("Query", "Answer"):  # enums: their last member (the default is the first)
        return list(Query if field_type == "Query" else Answer)[-1]
    return 123456789


@pytest.mark.parametrize("kind", sorted(FAMILY_OF), ids=lambda k: k.name)
def test_every_kind_round_trips_with_every_field_of_its_type(kind: Kind) -> None:
    family = FAMILY_OF[kind]
    fields = {f.name: _sample(str(f.type), f.name) for f in dataclasses.fields(family)
              if f.name not in ("kind", "src", "payload", "dtype", "numel")}
    if kind in DATA_KINDS:
        fields.update(dtype="<f8", numel=2, payload=np.zeros(2, np.float64).tobytes())
    elif kind is Kind.STATE:
        fields.update(numel=16, payload=bytes(range(16)))
    elif family is State:
        fields.pop("numel", None)
    if family is Message:
        fields.update(tree=1, chunks=3, chunk=2)
    msg = family(kind=kind, src=1, **fields)
    out = decode(frame(msg))
    assert type(out) is family
    if family is Message and kind is not Kind.ABORT:  # a step's frames send no abort fields
        msg = msg.but(reason="", missing=(), code=0)
    if kind is Kind.META_CLOSE:
        msg = msg.but(numel=0)  # a close carries a chunk's signature, dtype and size, and no payload
    elif kind not in DATA_KINDS and kind is not Kind.STATE and family is Message:
        msg = msg.but(signature="", dtype="", numel=0)  # read with a payload only
    assert out == msg


def test_each_type_takes_only_its_own_fields() -> None:
    with pytest.raises(TypeError, match="members"):
        make(Kind.SUSPECT, 1, members=(1, 2))
    with pytest.raises(TypeError, match="HELLO"):
        make(Kind.HELLO, 1)
    assert isinstance(make(Kind.VIEW_PREPARE, 1, dead=(3,), joining=(4,)), Agreement)
    assert {SENDER_RULES[k] for k in Join.RULES} == {Sender.PROVEN, Sender.MEMBER}
    assert all(SENDER_RULES[k] is rule for family in (Message, Agreement, Join) for k, rule in family.RULES.items())


def test_a_handshake_kind_after_the_handshake_is_a_frame_error() -> None:
    with pytest.raises(FrameError, match="HELLO belongs to the handshake"):
        decode(_raw({"k": int(Kind.HELLO), "f": 0}))


def test_but_copies_with_changes_and_leaves_the_original() -> None:
    msg = Message(kind=Kind.META_REDUCE_SENT, src=1, step=7, origin=1, target=0, contributors=(1, 2))
    stamped = msg.but(queued_bytes=4096)
    assert stamped.queued_bytes == 4096
    assert msg.queued_bytes == 0
    assert stamped == dataclasses.replace(msg, queued_bytes=4096)
    assert stamped is not msg
    with pytest.raises(TypeError, match="Message has no field 'queued'"):
        msg.but(queued=1)


def _raw(header: dict, payload: bytes = b"", magic: bytes = b"FT", version: int = VERSION) -> bytes:
    head = msgpack.packb(header)
    return PREFIX.pack(magic, version, len(head), len(payload)) + head + payload


@pytest.mark.parametrize(("raw", "needle"), [
    (_raw({"k": 1}, magic=b"XX"), "magic"),
    (_raw({"k": 1}, version=VERSION + 1), f"version {VERSION + 1}"),
    (_raw({"k": 99, "f": 0}), "unknown message kind 99"),
    (_raw({"k": 1, "f": 0, "d": "<f4", "e": 3}, b"\0" * 8), "does not hold 3"),
    (_raw({"k": 1, "f": 0, "d": "|O", "e": 1}, b"\0" * 8), "unsupported dtype"),
    (_raw({"k": 2, "f": 0}, b"\0" * 4), "must not carry a payload"),
    (_raw({"k": "one", "f": 0}), "kind must be an integer"),
    (_raw({"k": 2, "f": 0, "n": ["a"]}), "contributors"),
    (_raw({"k": 2, "f": 0, "ep": "x"}), "epoch"),
    (_raw({"k": 9, "f": 0, "ab": 1.5}), "abort code"),
    (_raw({"k": 2, "f": 0, "pl": 1}), "planned"),
    (_raw({"k": 26, "f": 0, "ad": [[1, 2]]}), "addresses"),
    (_raw({"k": 26, "f": 0, "ad": [[1, "a", "b"]]}), "addresses"),
    (_raw({"k": 26, "f": 0, "ad": [[0, "a"]] * 4097}), "at most 4096"),
    (_raw({"k": 17, "f": 0, "pr": 1}), "pace round"),
    (_raw({"k": 15, "f": 0, "gn": "yes"}), "gone"),
    (_raw({"k": 25, "f": 0, "q": 7}), r"query must be one of \[0, 1\], got 7"),
    (_raw({"k": 26, "f": 0, "an": True}), r"answer must be one of \[0, 1, 2\], got True"),
    (_raw({"k": 26, "f": 0, "an": "1"}), "answer must be one of"),
    (_raw({"k": 29, "f": 0, "d": "<f4", "e": 4}, b"\0" * 4), "raw bytes"),
    (_raw({"k": 2, "f": 0, "e": 4}), "must not carry a payload"),
    (PREFIX.pack(b"FT", VERSION, 3, 0) + b"\xc1\xc1\xc1", "not valid msgpack"),
    (PREFIX.pack(b"FT", VERSION, 1, 0) + b"\x05", "not a map"),
    (PREFIX.pack(b"FT", VERSION, 10**6, 0), "header length"),
    (b"FT", "shorter than"),
])
def test_broken_frames_raise_frame_error(raw: bytes, needle: str) -> None:
    with pytest.raises(FrameError, match=needle):
        decode(raw)


def test_a_joins_query_and_answer_arrive_as_their_enums() -> None:
    """The types hold enums, not ints: what a JOIN asks and a JOIN_REPLY says decode to members."""
    ask = decode(frame(Join(kind=Kind.JOIN, src=4, query=Query.ADMIT_ME)))
    reply = decode(frame(Join(kind=Kind.JOIN_REPLY, src=0, answer=Answer.STARTING)))
    assert isinstance(ask, Join)
    assert isinstance(reply, Join)
    assert ask.query is Query.ADMIT_ME
    assert reply.answer is Answer.STARTING
    assert decode(frame(Join(kind=Kind.JOIN, src=4))).query is Query.IS_RUNNING  # the default is not sent


def test_every_field_has_its_own_meaning_on_the_wire() -> None:
    """The epoch, an ABORT's code and a META's queued bytes each travel in a field of their own
    (no field is reused to mean something else for some kinds)."""
    abort = decode(frame(Message(kind=Kind.ABORT, src=2, epoch=3, step=7, code=2, reason="why", missing=(4,))))
    assert (abort.epoch, abort.code, abort.target, abort.reason, abort.missing) == (3, 2, -1, "why", (4,))
    meta = decode(frame(Message(kind=Kind.META_REDUCE_SENT, src=1, step=7, origin=1, target=0, queued_bytes=9000)))
    assert (meta.queued_bytes, meta.numel, meta.target) == (9000, 0, 0)
    data = np.ones(3, np.float32)
    relay = decode(frame(Message(kind=Kind.DATA_REDUCE, src=2, step=1, origin=3, planned=True, dtype="<f4",
                                 numel=3, payload=data.tobytes())))
    assert relay.planned
    assert relay.numel == 3


def test_oversized_payload_is_refused_before_reading_it() -> None:
    raw = PREFIX.pack(b"FT", VERSION, 5, 1 << 40)
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode(raw + b"x" * 5)
    assert struct.calcsize(">2sBIQ") == PREFIX.size
