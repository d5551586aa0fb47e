"""Whole-job checkpoints of an ElasticJob: what a job whose every process died resumes from.

A checkpoint is one file, `DIR/step-<S>.fttree`, written by the lowest-ranked member of the
job's current view (the same rank on every member; when it dies the next one writes) after
training step S - 1 and at every epoch's end. It holds the training state in
fttree.training.state's format (no pickle: a file cannot run code) and, as extra state, the
job's position: the training step count, the epoch, and the epoch's sampler history through
the last committed step. The model in it is exactly the result of the committed steps in
that history, so on resume the samples committed before the checkpoint are not dealt again
and those after it (trained into a model that died with the job) are.

File format: b"FTTK" + u8 version + u32 meta length + 32-byte blake2b digest of (meta +
state) + the meta (JSON: step, epoch, world, the sampler config, DiLoCo's H) + the state
bytes. Written to a temporary file, fsynced, renamed into place and the directory fsynced, so
a reader sees a whole file or none; the newest `KEEP` files are kept. A file whose digest
does not match, or whose meta does not fit the job (another dataset size, batch, seed, world
or model), is refused with a ConfigError that names the file and the difference.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.sampler import ElasticSampler, EpochHistory
from ..errors import ConfigError
from .state import StateError, TrainingState, decode, new_hasher

__all__ = ["Checkpoint", "latest", "read", "resume_sampler", "write"]

MAGIC = b"FTTK"
VERSION = 1
_HEAD = struct.Struct("<4sBI32s")  # magic, version, meta length, digest
MAX_META = 1 << 20  # the meta is a few hundred bytes; a bigger length field is damage
KEEP = 2  # files kept: the newest, and the one before it should the newest's writer be slow
_NAME = re.compile(r"step-(\d{1,18})\.fttree")
_OWN = re.compile(r"step-(\d{1,18})\.rank-(\d{1,9})\.fttree")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint as read back: where it came from, its meta and the training state."""

    path: Path
    meta: dict[str, Any]
    state: TrainingState
    digest: bytes


def _digest(meta: bytes, state: bytes | memoryview) -> bytes:
    hasher = new_hasher()
    hasher.update(meta)
    hasher.update(state)
    return bytes(hasher.digest())


def own_path(directory: Path, step: int, rank: int) -> Path:
    """Where `rank` keeps its own part of checkpoint `step` (DiLoCo's inner optimizer)."""
    return directory / f"step-{step:012d}.rank-{rank}.fttree"


def write(directory: Path, step: int, meta: dict[str, Any], state: bytes, rank: int | None = None) -> Path:
    """Write one checkpoint (or with `rank`, that rank's own part of it) atomically
    (temporary file, fsync, rename, fsync of the directory) and drop all but the newest KEEP
    of its kind. Returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    path = directory / f"step-{step:012d}.fttree" if rank is None else own_path(directory, step, rank)
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, VERSION, len(raw), _digest(raw, state)))
            f.write(raw)
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(directory)
    for old in _listed(directory, rank)[:-KEEP]:
        old.unlink(missing_ok=True)  # a slower writer may have removed it already
    return path


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listed(directory: Path, rank: int | None = None) -> list[Path]:
    """Checkpoint files in `directory` (with `rank`: that rank's own parts), oldest first
    (temporary files are not listed)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _NAME.fullmatch(p.name) if rank is None else _OWN.fullmatch(p.name))
             and (rank is None or int(m.group(2)) == rank)]
    return [p for _, p in sorted(found)]


def latest(directory: Path) -> Path | None:
    """The newest checkpoint in `directory`, or None."""
    files = _listed(directory)
    return files[-1] if files else None


def drop_partial(directory: Path) -> None:
    """Remove temporary files a writer killed mid-write left behind. Only while no rank
    writes: when a job starts, after its ranks agreed on the checkpoint to resume from and
    before their first step."""
    if directory.is_dir():
        for p in directory.glob(".step-*.tmp"):
            p.unlink(missing_ok=True)  # another rank may have removed it first


def read(path: Path) -> Checkpoint:
    """Read and verify one checkpoint: ConfigError naming the file if it is not a whole,
    undamaged checkpoint of this format."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"checkpoint {path} cannot be read: {exc}") from exc
    if len(data) < _HEAD.size:
        raise ConfigError(f"checkpoint {path} is corrupt: {len(data)} bytes, shorter than its header")
    magic, version, size, digest = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ConfigError(f"{path} is not an fttree checkpoint (it starts {magic!r}, not {MAGIC!r})")
    if version != VERSION:
        raise ConfigError(f"checkpoint {path} has format version {version}; this fttree reads version {VERSION}")
    if size > MAX_META or _HEAD.size + size > len(data):
        raise ConfigError(f"checkpoint {path} is corrupt: its meta length {size} runs past the file's "
                          f"{len(data)} bytes")
    raw = data[_HEAD.size:_HEAD.size + size]
    state = memoryview(data)[_HEAD.size + size:]
    if _digest(raw, state) != digest:
        raise ConfigError(f"checkpoint {path} is corrupt: the digest in the file does not match its contents "
                          f"(damaged or truncated on disk)")
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise TypeError(f"the meta is a {type(meta).__name__}, not an object")
        return Checkpoint(path, meta, decode(bytes(state)), digest)
    except (ValueError, TypeError, StateError) as exc:
        raise ConfigError(f"checkpoint {path} cannot be decoded: {exc}") from exc


def check_meta(ckpt: Checkpoint, expected: dict[str, Any]) -> None:
    """Refuse a checkpoint made by a job unlike this one, naming every difference."""
    diffs = [f"{key} {ckpt.meta.get(key)!r} there, {value!r} here" for key, value in expected.items()
             if ckpt.meta.get(key) != value]
    if diffs:
        raise ConfigError(f"checkpoint {ckpt.path} is of another job: {'; '.join(diffs)} (start with another "
                          f"checkpoint_dir, or with the settings it was made with)")


def resume_sampler(sampler: ElasticSampler, history: dict[str, Any] | None, epoch: int,
                   members: tuple[int, ...]) -> tuple[int, ...] | None:
    """Put a checkpoint's epoch into a member's sampler. `history` None: the checkpoint was
    written at an epoch's end and `epoch` starts afresh with `members` (this job's processes).
    Else the epoch is replayed through its last committed step; if ranks that had left its
    view are back (every process restarted), one step is committed with no contributors and
    `members` as the next view, so they take their share from the next step on as joiners do
    (the step's batches are dealt again). Every rank computes the same. Returns the members the
    next epoch must start with when the replayed epoch has no step left to take them in."""
    if history is None:
        sampler.set_epoch(epoch, members)
        return None
    try:
        past = EpochHistory.from_dict(history)
    except ConfigError as exc:
        raise ConfigError(f"the checkpoint's sampler history is not one: {exc}") from exc
    if past.config != sampler.config:
        raise ConfigError(f"the checkpoint's sampler config {past.config} differs from this job's {sampler.config}")
    if sampler.resume(past, members):
        return None
    return tuple(members)
