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

Format (no pickle, so a snapshot from a peer cannot run code): b"FTTS" + u8 version + u64
header length + a msgpack header (tensor table and every non-tensor value, maps in sorted
key order) + the tensors' raw bytes in table order. Equal states give equal bytes, so the
blake2b digest of the bytes identifies the state; chunks carry it and `restore` checks it.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from ..errors import FTTreeError

__all__ = ["Chunk", "StateError", "StateMismatch", "StateSnapshot", "pack_value", "restore", "snapshot", "sync_state",
           "unpack_value"]

MAGIC = b"FTTS"
VERSION = 1
_HEAD = struct.Struct("<4sBQ")  # magic, version, header length
_CHUNK = struct.Struct("<4sIIQ32s32s")  # magic, index, count, total bytes, state digest, chunk digest
_CHUNK_MAGIC = b"FTTC"
_EXT_TENSOR, _EXT_TUPLE, _EXT_NDARRAY = 1, 2, 3

Extra = Mapping[str, tuple[Callable[[], Any], Callable[[Any], None]]]


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


def _decoder(table: Sequence[Sequence[Any]], payload: memoryview) -> Callable[[int, bytes], Any]:
    def tensor_at(i: int) -> Any:
        dtype, shape, offset, nbytes = table[i]
        raw = payload[offset:offset + nbytes]
        if dtype.startswith("np:"):
            return np.frombuffer(raw, dtype=np.dtype(dtype[3:])).reshape(shape).copy()
        tdtype = getattr(torch, dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=tdtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdtype).reshape(shape)

    def hook(code: int, data: bytes) -> Any:
        if code in (_EXT_TENSOR, _EXT_NDARRAY):
            return tensor_at(struct.unpack("<I", data)[0])
        if code == _EXT_TUPLE:
            return tuple(_unpack(data, hook))
        raise StateError(f"unknown value type {code} in the state header")

    return hook


def _unpack(data: bytes | memoryview, hook: Callable[[int, bytes], Any] | None = None) -> Any:
    return msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=False,
                           ext_hook=hook or (lambda code, d: msgpack.ExtType(code, d)))


def _read(data: bytes) -> tuple[dict[str, Any], Callable[[int, bytes], Any]]:
    """The outer header (with values still as ext references) and a hook that resolves them."""
    if len(data) < _HEAD.size:
        raise StateError(f"state of {len(data)} bytes is shorter than its header")
    magic, version, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise StateError(f"not an fttree state (starts with {bytes(magic)!r})")
    if version != VERSION:
        raise StateError(f"state format version {version}, this fttree reads version {VERSION}")
    view = memoryview(data)
    outer = _unpack(view[_HEAD.size:_HEAD.size + hlen])
    if outer.get("byteorder") != sys.byteorder:
        raise StateError(f"state written on a {outer.get('byteorder')}-endian machine, this one is {sys.byteorder}")
    return outer, _decoder(outer["table"], view[_HEAD.size + hlen:])


# ---- snapshot / restore -------------------------------------------------------------------


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
             extra: Extra | None = None, step_count: int | None = None) -> StateSnapshot:
    """Capture the training state as of now (call it at a step boundary).

    `step_count` defaults to the optimizer's `step_count` attribute (fttree.DistributedOptimizer
    keeps one), else 0. `extra` maps a name to a (getter, setter) pair, e.g. RNG state or a data
    position; the getter's value is stored and the setter gets it back on restore.
    """
    if step_count is None:
        step_count = int(getattr(optimizer, "step_count", 0) or 0)
    w = _Writer()
    model_state = model.state_dict()
    body: dict[str, Any] = {
        "model": [[name, w.encode(t)] for name, t in model_state.items()],
        "optimizer": w.encode(optimizer.state_dict()) if optimizer is not None else None,
        "scheduler": w.encode(scheduler.state_dict()) if scheduler is not None else None,
        "extra": w.encode({name: get() for name, (get, _) in sorted((extra or {}).items())}),
    }
    data = _frame(w, body, step_count=step_count)
    return StateSnapshot(data, _digest(data), step_count)


def _frame(w: _Writer, body: Any, **fields: Any) -> bytes:
    header = _pack({"byteorder": sys.byteorder, **fields, "table": w.table, "body": _pack(body)})
    return b"".join([_HEAD.pack(MAGIC, VERSION, len(header)), header, *w.blobs])


def pack_value(value: Any) -> bytes:
    """Any nested state (dicts, lists and tuples of tensors, numpy arrays, numbers, strings) as
    bytes in this module's format, with no pickle: what fttree.DistributedOptimizer sends a
    joiner. Decoding it is a msgpack header plus one copy per tensor."""
    w = _Writer()
    return _frame(w, w.encode(value))


def unpack_value(data: bytes) -> Any:
    """The value `pack_value` encoded; StateError on bytes that are not one."""
    try:
        outer, hook = _read(data)
        return _unpack(outer["body"], hook)
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as e:
        raise StateError(f"the state's body cannot be decoded: {e}") from e


@dataclass(frozen=True)
class Restored:
    """What `restore` loaded besides the tensors."""

    step_count: int
    digest: str
    extra: tuple[str, ...]


def _describe(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_model(saved: list[list[Any]], model: torch.nn.Module) -> None:
    mine = model.state_dict()
    theirs = dict((name, t) for name, t in saved)
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


def restore(state: StateSnapshot | bytes | Iterable[Chunk | bytes], model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
            extra: Extra | None = None) -> Restored:
    """Load a snapshot (or its bytes, or its chunks) so training continues bit for bit.

    Checks the digest and that the snapshot fits (parameter names, shapes and dtypes; the
    optimizer's groups) before anything is changed; a mismatch raises StateMismatch naming it.
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
    outer, hook = _read(snap.data)
    body = _unpack(outer["body"], hook)
    _check_model(body["model"], model)
    if (body["optimizer"] is None) != (optimizer is None):
        raise StateMismatch(f"snapshot {'has no' if body['optimizer'] is None else 'has an'} optimizer state; "
                            f"restore was given {'one' if optimizer is not None else 'none'}")
    if (body["scheduler"] is None) != (scheduler is None):
        raise StateMismatch(f"snapshot {'has no' if body['scheduler'] is None else 'has a'} scheduler state; "
                            f"restore was given {'one' if scheduler is not None else 'none'}")
    if optimizer is not None:
        _check_optimizer(body["optimizer"], optimizer)
    setters = dict((name, put) for name, (_, put) in (extra or {}).items())
    missing_extra = sorted(set(setters) - set(body["extra"]))
    if missing_extra:
        raise StateMismatch(f"extra state {missing_extra} is registered here but not in the snapshot "
                            f"(it has {sorted(body['extra'])})")
    own = model.state_dict()
    with torch.no_grad():
        for name, t in body["model"]:
            own[name].copy_(t)
    if optimizer is not None:
        optimizer.load_state_dict(body["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(body["scheduler"])
    for name, put in setters.items():
        put(body["extra"][name])
    step_count = int(outer["step_count"])
    if optimizer is not None and hasattr(optimizer, "step_count"):
        optimizer.step_count = step_count
    return Restored(step_count, snap.hexdigest, tuple(sorted(body["extra"])))


# ---- sync over the fttree torch.distributed backend ----------------------------------------


def sync_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
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
