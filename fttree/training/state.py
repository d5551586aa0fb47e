"""Training state as one deterministic byte string: what a joining worker needs to continue.

    snap = snapshot(model, optimizer, scheduler, extra={"rng": (torch.get_rng_state, torch.set_rng_state)})
    for chunk in snap.chunks(1 << 20): send(chunk.to_bytes())
    ...
    restore([Chunk.from_bytes(b) for b in received], model, optimizer, scheduler, extra=...)

A snapshot holds the model's parameters and buffers (its state_dict), the optimizer's state
(every tensor: SGD momentum buffers, Adam's exp_avg/exp_avg_sq/step, ...) and param_groups
(lr, momentum, betas, ...), the LR scheduler's state_dict, a step count and any registered
extra state. A replacement restored from it continues bit for bit: the scheduler is part of
the state because a healed worker with the wrong learning rate trains silently wrong.

This is the one format of a training state: `sync_state` sends it over torch.distributed and
fttree.DistributedOptimizer to a joiner (fttree.training.elastic). `snapshot` is `encode` of
`capture`, `restore` is `load` of `decode`; the halves are separate so a donor can capture at
a step boundary and encode on another thread.

Format (no pickle, so a snapshot from a peer cannot run code): b"FTTS" + u8 version + u64
header length + a msgpack header (tensor table and every non-tensor value, maps in sorted
key order) + the tensors' raw bytes in table order. Equal states give equal bytes, so the
blake2b digest of the bytes identifies the state; chunks carry it and `restore` checks it.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from ..errors import FTTreeError

__all__ = ["Chunk", "StateError", "StateMismatch", "StateSnapshot", "TrainingState", "capture", "decode", "encode",
           "load", "restore", "snapshot", "sync_state"]

MAGIC = b"FTTS"
VERSION = 1
_HEAD = struct.Struct("<4sBQ")  # magic, version, header length
_CHUNK = struct.Struct("<4sIIQ32s32s")  # magic, index, count, total bytes, state digest, chunk digest
_CHUNK_MAGIC = b"FTTC"
_EXT_TENSOR, _EXT_TUPLE, _EXT_NDARRAY = 1, 2, 3

Extra = Mapping[str, tuple[Callable[[], Any], Callable[[Any], None]]]
# A model: a module (its state_dict), or named tensors (parameters without a module).
Model = torch.nn.Module | Mapping[str, torch.Tensor]


class StateError(FTTreeError):
    """A snapshot that cannot be read: wrong digest, missing or foreign chunks, bad bytes."""


class StateMismatch(StateError):
    """A snapshot that does not fit the model/optimizer/scheduler it is restored into."""


DIGEST_BYTES = 32  # blake2b; the one digest of a state, whichever path moves it (sync_state, a joiner's transfer)


def new_hasher() -> Any:
    """A hasher of the state digest, for a state that arrives in pieces."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def _digest(data: bytes | memoryview) -> bytes:
    hasher = new_hasher()
    hasher.update(data)
    return bytes(hasher.digest())


def state_digest(data: bytes | memoryview) -> str:
    """The state digest of serialised state, as hex."""
    return _digest(data).hex()


@dataclass(frozen=True)
class Chunk:
    """One piece of a snapshot; `digest` is the whole state's, so chunks of different
    snapshots (a donor that moved on a step) are never mixed."""

    index: int
    count: int
    total_bytes: int
    digest: bytes
    data: bytes

    def to_bytes(self) -> bytes:
        return _CHUNK.pack(_CHUNK_MAGIC, self.index, self.count, self.total_bytes, self.digest,
                           _digest(self.data)) + self.data

    @classmethod
    def from_bytes(cls, raw: bytes) -> Chunk:
        if len(raw) < _CHUNK.size:
            raise StateError(f"state chunk of {len(raw)} bytes is shorter than its {_CHUNK.size}-byte header")
        magic, index, count, total, digest, own = _CHUNK.unpack_from(raw)
        if magic != _CHUNK_MAGIC:
            raise StateError(f"not an fttree state chunk (starts with {bytes(magic)!r})")
        data = bytes(raw[_CHUNK.size:])
        if _digest(data) != own:
            raise StateError(f"state chunk {index} of {count} is corrupt: its digest does not match its "
                             f"{len(data)} bytes")
        return cls(index, count, total, digest, data)


@dataclass(frozen=True)
class StateSnapshot:
    """A serialised training state (see the module docstring for the format)."""

    data: bytes
    digest: bytes
    step_count: int

    @property
    def hexdigest(self) -> str:
        return self.digest.hex()

    def chunks(self, size: int) -> list[Chunk]:
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        count = max(1, -(-len(self.data) // size))
        return [Chunk(i, count, len(self.data), self.digest, self.data[i * size:(i + 1) * size])
                for i in range(count)]

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk | bytes]) -> StateSnapshot:
        """Reassemble; every chunk must be present once and belong to the same state."""
        parts = [c if isinstance(c, Chunk) else Chunk.from_bytes(c) for c in chunks]
        if not parts:
            raise StateError("no state chunks to restore from")
        first = parts[0]
        foreign = [c.index for c in parts if (c.digest, c.count, c.total_bytes) != (first.digest, first.count,
                                                                                    first.total_bytes)]
        if foreign:
            raise StateError(f"chunks {foreign} belong to another state than chunk {first.index} "
                             f"(state digest {first.digest.hex()[:12]})")
        by_index = {c.index: c for c in parts}
        missing = sorted(set(range(first.count)) - set(by_index))
        if missing:
            raise StateError(f"state {first.digest.hex()[:12]} is missing chunks {missing} of {first.count}")
        data = b"".join(by_index[i].data for i in range(first.count))
        if len(data) != first.total_bytes:
            raise StateError(f"state {first.digest.hex()[:12]}: chunks hold {len(data)} bytes, header says "
                             f"{first.total_bytes}")
        if _digest(data) != first.digest:
            raise StateError(f"state digest mismatch: the chunks' bytes hash to {_digest(data).hex()[:12]}, the "
                             f"donor's state is {first.digest.hex()[:12]}")
        return cls(data, first.digest, _read(data)[0]["step_count"])


# ---- encoding ---------------------------------------------------------------------------


class _Writer:
    """Collects tensors into a table while the header is encoded."""

    def __init__(self) -> None:
        self.table: list[list[Any]] = []  # [dtype, shape, offset, nbytes]
        self.blobs: list[bytes] = []
        self.offset = 0

    def tensor(self, t: torch.Tensor) -> int:
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return self._add(str(t.dtype).removeprefix("torch."), list(t.shape), raw)

    def ndarray(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        return self._add("np:" + a.dtype.str, list(a.shape), a.tobytes())

    def _add(self, dtype: str, shape: list[int], raw: bytes) -> int:
        self.table.append([dtype, shape, self.offset, len(raw)])
        self.blobs.append(raw)
        self.offset += len(raw)
        return len(self.table) - 1

    def encode(self, obj: Any) -> Any:
        """`obj` with maps key-sorted and tensors/tuples/arrays as msgpack ext references."""
        if isinstance(obj, torch.Tensor):
            return msgpack.ExtType(_EXT_TENSOR, struct.pack("<I", self.tensor(obj)))
        if isinstance(obj, np.ndarray):
            return msgpack.ExtType(_EXT_NDARRAY, struct.pack("<I", self.ndarray(obj)))
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, _pack([self.encode(v) for v in obj]))
        if isinstance(obj, list):
            return [self.encode(v) for v in obj]
        if isinstance(obj, Mapping):
            keys = sorted(obj, key=lambda k: (type(k).__name__, k))
            return {k: self.encode(obj[k]) for k in keys}
        if obj is None or isinstance(obj, bool | int | float | str | bytes):
            return obj
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot snapshot a {type(obj).__name__} ({obj!r:.60}): state values must be tensors, numpy "
                        f"arrays, numbers, strings, bytes, None, lists, tuples or dicts")


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True, strict_types=True))


@dataclass
class _Ref:
    """A tensor or array in the body, before its bytes are read: the table entry it names and
    where in the state it sits (for messages)."""

    code: int
    index: int
    name: str = ""


_MAX_DIMS = 64
_MAX_NUMEL = 1 << 62
# the dtypes a table entry may name, by the name encode writes (str(dtype) without "torch.")
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _refs(body: bytes) -> Any:
    """The body with tensors and arrays as _Refs (nothing allocated for them yet) and tuples as
    tuples. Each table entry may be named once: encode writes one per value, and a forged body
    naming a large one many times would make decode allocate it as often."""
    seen: set[int] = set()

    def hook(code: int, data: bytes) -> Any:
        if code in (_EXT_TENSOR, _EXT_NDARRAY):
            if len(data) != 4:
                raise StateError(f"a tensor reference of {len(data)} bytes in the state header (4 expected)")
            index = struct.unpack("<I", data)[0]
            if index in seen:
                raise StateError(f"table entry {index} is referenced twice in the state header")
            seen.add(index)
            return _Ref(code, index)
        if code == _EXT_TUPLE:
            return tuple(_unpack(data, hook))
        raise StateError(f"unknown value type {code} in the state header")

    return _unpack(body, hook)


def _walk(value: Any, name: str, fn: Callable[[_Ref, str], Any]) -> Any:
    """`value` with each _Ref replaced by fn(ref, its place in the state)."""
    if isinstance(value, _Ref):
        return fn(value, name)
    if isinstance(value, dict):
        return {k: _walk(v, f"{name}.{k}", fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_walk(v, f"{name}[{i}]", fn) for i, v in enumerate(value))
    return value


def _walk_body(body: dict[str, Any], fn: Callable[[_Ref, str], Any]) -> dict[str, Any]:
    out = {key: _walk(body[key], key, fn) for key in ("optimizer", "scheduler", "extra")}
    model = body["model"]
    if not isinstance(model, list) or not all(isinstance(e, list) and len(e) == 2 for e in model):
        raise StateError("the state's model is not a list of [name, tensor] pairs")
    out["model"] = [[name, _walk(t, f"model {name}", fn)] for name, t in model]
    return out


def _entry(entry: Any, name: str, offset: int, payload: int) -> tuple[str, Any, list[int], int]:
    """Check one table entry against the bytes after the header, allocating nothing: its dtype
    is one this format writes, its shape a list of sizes whose product times the dtype's item
    size is its byte count, and its bytes the next ones and present. Returns (dtype, the torch
    or numpy dtype, shape, byte count); StateError naming it otherwise."""
    if not isinstance(entry, list) or len(entry) != 4:
        raise StateError(f"{name}: a table entry of {entry!r:.80}, not [dtype, shape, offset, bytes]")
    dtype, shape, at, nbytes = entry
    kind: Any = None
    if isinstance(dtype, str) and dtype.startswith("np:"):
        try:
            kind = np.dtype(dtype[3:])
        except (TypeError, ValueError):
            kind = None
        if kind is not None and (kind.hasobject or kind.itemsize == 0):
            kind = None  # objects cannot come from bytes; items of no bytes would let any shape fit
    elif isinstance(dtype, str):
        kind = _TORCH_DTYPES.get(dtype)
    if kind is None:
        raise StateError(f"{name}: unknown dtype {dtype!r:.40}")
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise StateError(f"{name}: shape {shape!r:.80} is not a list of at most {_MAX_DIMS} sizes >= 0")
    numel, bound = 1, 1
    for d in shape:
        numel *= d
        bound *= max(d, 1)
    if bound > _MAX_NUMEL:
        raise StateError(f"{name}: shape {shape} is too large")
    itemsize = kind.itemsize
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes != numel * itemsize:
        raise StateError(f"{name}: shape {shape} of {dtype} is {numel} elements, {numel * itemsize} bytes; its "
                         f"table entry says {nbytes!r:.20} bytes")
    if at != offset:
        raise StateError(f"{name}: its bytes are said to start at {at!r:.20}, the previous tensor's end at {offset}")
    if offset + nbytes > payload:
        raise StateError(f"{name}: {nbytes} bytes at {offset} declared, the state holds {payload - offset} "
                         f"bytes from there")
    return dtype, kind, shape, nbytes


def _tensors(outer: dict[str, Any], body: dict[str, Any], payload: memoryview) -> dict[str, Any]:
    """The body with its tensors and arrays read from `payload`, once every table entry has
    been checked against the bytes present (so a forged size fails before anything is made)."""
    table = outer["table"]
    if not isinstance(table, list):
        raise StateError("the state's tensor table is not a list")
    names: dict[int, str] = {}

    def name(ref: _Ref, where: str) -> _Ref:
        names[ref.index] = where
        ref.name = where
        return ref

    body = _walk_body(body, name)
    unknown = sorted(i for i in names if i >= len(table))
    if unknown:
        raise StateError(f"{names[unknown[0]]}: table entry {unknown[0]} of {len(table)}")
    entries, offset = [], 0
    for i, entry in enumerate(table):
        checked = _entry(entry, names.get(i, f"table entry {i} (named nowhere in the state)"), offset, len(payload))
        entries.append(checked)
        offset += checked[3]
    if offset != len(payload):
        raise StateError(f"the table accounts for {offset} bytes of tensors, the state holds {len(payload)}")

    def read(ref: _Ref, where: str) -> Any:
        dtype, kind, shape, nbytes = entries[ref.index]
        if (ref.code == _EXT_NDARRAY) != dtype.startswith("np:"):
            raise StateError(f"{where}: a {'numpy array' if ref.code == _EXT_NDARRAY else 'tensor'} whose table "
                             f"entry is of dtype {dtype}")
        at = table[ref.index][2]
        raw = payload[at:at + nbytes]
        try:
            if isinstance(kind, np.dtype):
                return np.frombuffer(raw, dtype=kind).reshape(shape).copy()
            if nbytes == 0:
                return torch.empty(shape, dtype=kind)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).reshape(shape)
        except (RuntimeError, ValueError, TypeError) as exc:  # a dtype encode never writes (quantized, ...)
            raise StateError(f"{where}: {dtype}{shape} cannot be read: {exc}") from exc

    return _walk_body(body, read)


def _unpack(data: bytes | memoryview, hook: Callable[[int, bytes], Any] | None = None) -> Any:
    return msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=False,
                           ext_hook=hook or (lambda code, d: msgpack.ExtType(code, d)))


def _read(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """The outer header (its body still packed) and the tensors' bytes after it."""
    if len(data) < _HEAD.size:
        raise StateError(f"state of {len(data)} bytes is shorter than its header")
    magic, version, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise StateError(f"not an fttree state (starts with {bytes(magic)!r})")
    if version != VERSION:
        raise StateError(f"state format version {version}, this fttree reads version {VERSION}")
    if hlen > len(data) - _HEAD.size:
        raise StateError(f"the state's header is said to be {hlen} bytes, {len(data) - _HEAD.size} follow")
    view = memoryview(data)
    outer = _unpack(view[_HEAD.size:_HEAD.size + hlen])
    if not isinstance(outer, dict):
        raise StateError(f"the state's header is a {type(outer).__name__}, not a map")
    if outer.get("byteorder") != sys.byteorder:
        raise StateError(f"state written on a {outer.get('byteorder')}-endian machine, this one is {sys.byteorder}")
    return outer, view[_HEAD.size + hlen:]


# ---- the state as values ---------------------------------------------------------------


def _frozen(value: Any) -> Any:
    """A copy of nested state (dicts, lists, tuples of tensors, arrays and numbers) whose
    tensors and arrays training can no longer change."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class TrainingState:
    """A training state as values: what `encode` turns into a StateSnapshot and `decode` gives
    back, and what `load` puts into a model, optimizer, scheduler and extra state.

    Split from the bytes so the cheap part (`capture`, `frozen`) can run on the training
    thread at a step boundary and the rest (`encode`, hashing) on another, as a joiner's donor
    does (fttree.training.elastic)."""

    model: dict[str, torch.Tensor]  # the model's state_dict (or named tensors), in its order
    optimizer: Any  # the optimizer's state_dict, or None
    scheduler: Any  # the LR scheduler's state_dict, or None
    extra: dict[str, Any]  # registered extra state by name
    step_count: int

    def frozen(self) -> TrainingState:
        """A copy whose tensors training can no longer change (`capture` returns the live
        ones, as state_dict() does): to encode on another thread while training goes on."""
        return TrainingState(model=_frozen(self.model), optimizer=_frozen(self.optimizer),
                             scheduler=_frozen(self.scheduler), extra=_frozen(self.extra), step_count=self.step_count)


def _model_state(model: Model) -> dict[str, torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return dict(model.state_dict())
    return {name: t.detach() for name, t in model.items()}


def capture(model: Model, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
            extra: Extra | None = None, step_count: int | None = None) -> TrainingState:
    """The training state as of now (call it at a step boundary). Its tensors are the live
    ones (`.frozen()` copies them).

    `step_count` defaults to the optimizer's `step_count` attribute (fttree.DistributedOptimizer
    keeps one), else 0. `extra` maps a name to a (getter, setter) pair, e.g. RNG state or a data
    position; the getter's value is stored and the setter gets it back on restore.
    """
    if step_count is None:
        step_count = int(getattr(optimizer, "step_count", 0) or 0)
    return TrainingState(model=_model_state(model),
                         optimizer=optimizer.state_dict() if optimizer is not None else None,
                         scheduler=scheduler.state_dict() if scheduler is not None else None,
                         extra={name: get() for name, (get, _) in sorted((extra or {}).items())},
                         step_count=step_count)


def encode(state: TrainingState) -> StateSnapshot:
    """The state's bytes (the module docstring's format) and digest."""
    w = _Writer()
    body: dict[str, Any] = {
        "model": [[name, w.encode(t)] for name, t in state.model.items()],
        "optimizer": w.encode(state.optimizer) if state.optimizer is not None else None,
        "scheduler": w.encode(state.scheduler) if state.scheduler is not None else None,
        "extra": w.encode(state.extra),
    }
    header = _pack({"byteorder": sys.byteorder, "step_count": state.step_count, "table": w.table,
                    "body": _pack(body)})
    data = b"".join([_HEAD.pack(MAGIC, VERSION, len(header)), header, *w.blobs])
    return StateSnapshot(data, _digest(data), state.step_count)


def decode(data: bytes) -> TrainingState:
    """The state `encode` wrote (its digest is the caller's to check); StateError on bytes
    that are not one. Every tensor's declared dtype, shape and size is checked against the bytes
    present before any is made, so a forged state costs no more memory than its own bytes."""
    try:
        outer, payload = _read(data)
        body = _refs(outer["body"])
        if not isinstance(body, dict) or not isinstance(body["extra"], dict):
            raise TypeError(f"the state's body is a {type(body).__name__} without the training state's fields")
        body = _tensors(outer, body, payload)
        return TrainingState(model={str(name): t for name, t in body["model"]}, optimizer=body["optimizer"],
                             scheduler=body["scheduler"], extra=body["extra"], step_count=int(outer["step_count"]))
    except StateError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, msgpack.UnpackException) as e:
        raise StateError(f"the state's body cannot be decoded: {e}") from e


def snapshot(model: Model, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
             extra: Extra | None = None, step_count: int | None = None) -> StateSnapshot:
    """Capture the training state as of now (call it at a step boundary) as bytes: `encode`
    of `capture` (see there for the arguments)."""
    return encode(capture(model, optimizer, scheduler, extra, step_count))


@dataclass(frozen=True)
class Restored:
    """What `restore` loaded besides the tensors."""

    step_count: int
    digest: str
    extra: tuple[str, ...]


def _describe(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_model(theirs: Mapping[str, Any], mine: Mapping[str, torch.Tensor]) -> None:
    problems = []
    missing, unexpected = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing:
        problems.append(f"not in the snapshot: {', '.join(missing)}")
    if unexpected:
        problems.append(f"not in this model: {', '.join(unexpected)}")
    for name in mine.keys() & theirs.keys():
        a, b = mine[name], theirs[name]
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{name}: snapshot {_describe(b)}, model {_describe(a)}")
    if problems:
        raise StateMismatch("snapshot does not fit this model: " + "; ".join(sorted(problems)))


def _check_optimizer(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> None:
    groups, mine = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(mine):
        raise StateMismatch(f"snapshot optimizer has {len(groups)} param groups, this one {len(mine)}")
    for i, (g, m) in enumerate(zip(groups, mine, strict=True)):
        if len(g["params"]) != len(m["params"]):
            raise StateMismatch(f"param group {i}: snapshot has {len(g['params'])} parameters, this optimizer "
                                f"{len(m['params'])}")
    flat = [p for m in mine for p in m["params"]]
    index = {pid: n for n, pid in enumerate(pid for g in groups for pid in g["params"])}
    for pid, state in saved["state"].items():
        p = flat[index[pid]]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise StateMismatch(f"optimizer state {key!r} of parameter {index[pid]}: snapshot "
                                    f"{_describe(value)}, parameter {_describe(p)}")


def load(state: TrainingState, model: Model, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
         extra: Extra | None = None) -> None:
    """Put `state` into the model, optimizer, scheduler and extra state (the setters), and
    its step count into the optimizer's `step_count` attribute if it has one.

    Checks first that it fits (parameter names, shapes and dtypes; the optimizer's groups; a
    scheduler and every extra name on both sides) and changes nothing on a mismatch, which
    raises StateMismatch naming it.
    """
    own = _model_state(model)
    _check_model(state.model, own)
    if (state.optimizer is None) != (optimizer is None):
        raise StateMismatch(f"snapshot {'has no' if state.optimizer is None else 'has an'} optimizer state; "
                            f"restore was given {'one' if optimizer is not None else 'none'}")
    if (state.scheduler is None) != (scheduler is None):
        raise StateMismatch(f"snapshot {'has no' if state.scheduler is None else 'has a'} scheduler state; "
                            f"restore was given {'one' if scheduler is not None else 'none'}")
    if optimizer is not None:
        _check_optimizer(state.optimizer, optimizer)
    setters = dict((name, put) for name, (_, put) in (extra or {}).items())
    missing_extra = sorted(set(setters) - set(state.extra))
    if missing_extra:
        raise StateMismatch(f"extra state {missing_extra} is registered here but not in the snapshot "
                            f"(it has {sorted(state.extra)})")
    with torch.no_grad():
        for name, t in state.model.items():
            own[name].copy_(t)
    if optimizer is not None:
        optimizer.load_state_dict(state.optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(state.scheduler)
    for name, put in setters.items():
        put(state.extra[name])
    if optimizer is not None and hasattr(optimizer, "step_count"):
        optimizer.step_count = state.step_count


def restore(state: StateSnapshot | bytes | Iterable[Chunk | bytes], model: Model,
            optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
            extra: Extra | None = None) -> Restored:
    """Load a snapshot (or its bytes, or its chunks) so training continues bit for bit.

    Checks the digest, then `load`s it: it checks that the snapshot fits before anything is
    changed; a mismatch raises StateMismatch naming it.
    """
    if isinstance(state, bytes | bytearray):
        data = bytes(state)
        snap = StateSnapshot(data, _digest(data), 0)
    elif isinstance(state, StateSnapshot):
        if _digest(state.data) != state.digest:
            raise StateError(f"state digest mismatch: bytes hash to {_digest(state.data).hex()[:12]}, snapshot says "
                             f"{state.digest.hex()[:12]}")
        snap = state
    else:
        snap = StateSnapshot.from_chunks(state)
    values = decode(snap.data)
    load(values, model, optimizer, scheduler, extra)
    return Restored(values.step_count, snap.hexdigest, tuple(sorted(values.extra)))


# ---- sync over the fttree torch.distributed backend ----------------------------------------


def sync_state(model: Model, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
               src: int | None = None, extra: Extra | None = None, group: Any = None) -> Restored:
    """Make every rank's training state equal to `src`'s (default: the lowest rank).

    For DDP users on the "fttree" backend (or any torch.distributed group): call it on every
    rank at the same point, e.g. after a replacement worker started. Two collectives: the
    source's snapshot size, then its bytes (a broadcast; on fttree an exact sum with zeros).
    Every other rank checks the digest and restores, so all hold the source's bits.
    """
    import torch.distributed as dist

    source = 0 if src is None else src
    rank = dist.get_rank(group)
    snap = snapshot(model, optimizer, scheduler, extra) if rank == source else None
    head = torch.zeros(1 + 32, dtype=torch.int64)  # size, then the digest byte by byte
    if snap is not None:
        head[0] = len(snap.data)
        head[1:] = torch.tensor(list(snap.digest), dtype=torch.int64)
    dist.broadcast(head, src=source, group=group)
    size, digest = int(head[0]), bytes(int(b) for b in head[1:])
    if snap is not None:  # the bytes still go out: a broadcast needs every rank
        names = tuple(sorted((extra or {}).keys()))
    # int32 words carry the bytes: every fttree wire dtype is exact for them, uint8 is not sent.
    words = torch.zeros(-(-size // 4), dtype=torch.int32)
    if snap is not None:
        padded = snap.data + b"\0" * (len(words) * 4 - size)
        words.copy_(torch.frombuffer(bytearray(padded), dtype=torch.int32))
    dist.broadcast(words, src=source, group=group)
    if snap is not None:
        return Restored(snap.step_count, snap.hexdigest, names)
    data = words.numpy().tobytes()[:size]
    if _digest(data) != digest:
        raise StateError(f"rank {rank}: state from rank {source} arrived with digest {_digest(data).hex()[:12]}, "
                         f"sent with {digest.hex()[:12]}")
    return restore(StateSnapshot(data, digest, 0), model, optimizer, scheduler, extra)
