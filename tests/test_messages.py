"""Wire codec: round trips, and every way a frame can be broken gives a FrameError."""

import dataclasses
import struct

import msgpack
import numpy as np
import pytest

from fttree.core.messages import DATA_KINDS, PREFIX, TREE_OP_KINDS, VERSION, Kind, Message, decode, encode
from fttree.errors import FrameError


def frame(msg: Message) -> bytes:
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


def test_every_kind_round_trips() -> None:
    for kind in Kind:
        payload = np.zeros(2, np.float64) if kind in DATA_KINDS or kind is Kind.STATE else None
        dtype = "|u1" if kind is Kind.STATE else "<f8"
        numel = 16 if kind is Kind.STATE else 2
        msg = Message(kind=kind, src=1, epoch=3, step=4, origin=2, target=0, reason="r", missing=(5,), world=7,
                      ballot=65541, accepted=65540, proposed=4, members=(0, 2, 1), committed=(3, 4), plan=(3, 0, 1, 2),
                      steps=(4,), user_step=9, incarnation=123456789, training_step=8,
                      addresses=((2, "10.0.0.2:29500"), (0, "[::1]:7")),
                      dtype=dtype if payload is not None else "", numel=numel if payload is not None else 0,
                      payload=None if payload is None else payload.tobytes())
        out = decode(frame(msg))
        assert out.kind == kind
        assert (out.src, out.epoch, out.origin, out.target) == (1, 3, 2, 0)
        if kind in TREE_OP_KINDS:  # a step's frames carry the op fields only: the rest stay unset
            assert out == msg.but(**RARE_DEFAULTS)
            continue
        if payload is None:  # every field back as it was sent (a HELLO carries no step)
            assert out == (msg.but(step=-1) if kind is Kind.HELLO else msg)
        assert (out.ballot, out.members, out.committed, out.plan, out.steps) == (
            65541, (0, 2, 1), (3, 4), (3, 0, 1, 2), (4,))
        assert (out.user_step, out.incarnation, out.training_step) == (9, 123456789, 8)
        assert out.addresses == ((2, "10.0.0.2:29500"), (0, "[::1]:7"))


RARE_DEFAULTS = {"reason": "", "missing": (), "world": 0, "ballot": 0, "accepted": 0, "proposed": 0, "members": (),
                 "committed": (), "plan": (), "steps": (), "user_step": -1, "incarnation": 0, "training_step": -1,
                 "addresses": ()}


def test_but_copies_with_changes_and_leaves_the_original() -> None:
    msg = Message(kind=Kind.META_REDUCE_SENT, src=1, step=7, origin=1, target=0, contributors=(1, 2))
    stamped = msg.but(queued_bytes=4096)
    assert stamped.queued_bytes == 4096
    assert msg.queued_bytes == 0
    assert stamped == dataclasses.replace(msg, queued_bytes=4096)
    assert stamped is not msg
    with pytest.raises(TypeError, match="no field 'queued'"):
        msg.but(queued=1)


def _raw(header: dict, payload: bytes = b"", magic: bytes = b"FT", version: int = VERSION) -> bytes:
    head = msgpack.packb(header)
    return PREFIX.pack(magic, version, len(head), len(payload)) + head + payload


@pytest.mark.parametrize(("raw", "needle"), [
    (_raw({"k": 1}, magic=b"XX"), "magic"),
    (_raw({"k": 1}, version=9), "version 9"),
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
    (_raw({"k": 2, "f": 0, "e": 4}), "must not carry a payload"),
    (PREFIX.pack(b"FT", VERSION, 3, 0) + b"\xc1\xc1\xc1", "not valid msgpack"),
    (PREFIX.pack(b"FT", VERSION, 1, 0) + b"\x05", "not a map"),
    (PREFIX.pack(b"FT", VERSION, 10**6, 0), "header length"),
    (b"FT", "shorter than"),
])
def test_broken_frames_raise_frame_error(raw: bytes, needle: str) -> None:
    with pytest.raises(FrameError, match=needle):
        decode(raw)


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
