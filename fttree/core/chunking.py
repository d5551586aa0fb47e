"""How a step is cut into chunks: a rule every member must apply alike.

Each chunk is its own op in the tree machine, and a chunk's tree depends on the step's chunk
count (trees.py), so ranks that cut one step differently fail it as a chunk mismatch. The
cut therefore depends only on what the group agrees on: the step's size, `Config.chunk_bytes`
and the view's pace (or, while none was agreed, `Config.uplink_bytes_per_s`). The driver
only slices the caller's array at the offsets this returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Config

SPLIT_CHUNKS = 16  # a step larger than one chunk travels in at least this many ...
MIN_SPLIT_CHUNK_BYTES = 1 << 20  # ... of at least this size (or chunk_bytes, if smaller)
# Behind a slow uplink (one hop of a whole chunk takes over PIPELINE_HOP_S at
# uplink_bytes_per_s: 100 Mbit/s, not the LAN default) finer: store-and-forward of each chunk
# at each hop is what keeps a step above its bytes' time there.
PIPELINE_HOP_S = 0.1
SLOW_SPLIT_CHUNKS = 48
MIN_SLOW_SPLIT_CHUNK_BYTES = 1 << 18
# A step small enough for one chunk is still pipelined when one hop of it would take longer than
# PIPELINE_HOP_S (behind 100 Mbit/s: from 1.25 MB on; never at the LAN default, where that
# takes 5 MB, more than a chunk). Its chunks carry at least SLOW_CHUNK_S of uplink time and
# MIN_SLOW_CHUNK_BYTES, so per-chunk costs stay small against the transfer.
SLOW_CHUNK_S = 0.005
MIN_SLOW_CHUNK_BYTES = 32 * 1024
# A pipelined step's chunks take at most about this long a hop at the pace: the tree's tail
# after the last leaf sent is a few chunk hops. 48 chunks of 350 KB took 16 MB behind 10 Mbit/s
# to 1.19x gloo's step (a hop 0.28 s); chunks of 64 KB to 1.01x, at 28% more CPU.
PIPELINE_CHUNK_S = 0.05
MAX_STEP_CHUNKS = 512  # ... but a step travels in no more chunks than this (each costs CPU)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Where each chunk of a step starts, in elements; every chunk but the last has `per_chunk`."""

    per_chunk: int
    offsets: dict[int, int]  # chunk -> its first element

    @property
    def chunks(self) -> int:
        return len(self.offsets)


def chunk_bytes(cfg: Config, nbytes: int, pace: float = 0.0) -> int:
    """The chunk size of a step of `nbytes`. Up to `chunk_bytes` it is one chunk. A larger
    step is cut into at least SPLIT_CHUNKS chunks (no smaller than MIN_SPLIT_CHUNK_BYTES,
    nor larger than `chunk_bytes`): each hop carries a whole chunk before the next hop can
    send it, so a tree of depth d fills its pipeline only after about 2d chunk times, and
    16 MB in four 4 MiB chunks took 1.5x gloo's ring at 100 Mbit/s where 1 MiB chunks took
    1.35x. Behind a slow uplink (see PIPELINE_HOP_S) in at least SLOW_SPLIT_CHUNKS of
    MIN_SLOW_SPLIT_CHUNK_BYTES or more: on the rotated trees at 100 Mbit/s, 48 chunks took
    16 MB from 1.27x to 1.20x gloo's time and 100 MB from 1.12x to 1.07x. A step of up to
    one chunk that would take over PIPELINE_HOP_S a hop is cut too (see SLOW_CHUNK_S): as
    one chunk the thesis MLP's 1.63 MB took 3.3x gloo's time behind 100 Mbit/s uplinks, in
    7 chunks 1.5x on the rotated trees, in 25 chunks 1.15x. Every rank must compute the
    same size: `pace` is the view's (the group agrees on it, membership.py), or, while none
    was agreed, `uplink_bytes_per_s`, so that and `chunk_bytes` must be the same on every
    worker (a difference fails the step as a chunk mismatch). A pipelined step's chunks
    also take no more than PIPELINE_CHUNK_S a hop (down to MIN_SLOW_CHUNK_BYTES, in at most
    MAX_STEP_CHUNKS chunks)."""
    rate = pace or cfg.uplink_bytes_per_s
    slow = cfg.chunk_bytes > rate * PIPELINE_HOP_S
    per_chunk = -(-nbytes // (SLOW_SPLIT_CHUNKS if slow else SPLIT_CHUNKS))
    if nbytes <= cfg.chunk_bytes:
        if nbytes <= rate * PIPELINE_HOP_S:
            return cfg.chunk_bytes
        floor = max(MIN_SLOW_CHUNK_BYTES, int(rate * SLOW_CHUNK_S))
        return min(cfg.chunk_bytes, max(floor, per_chunk))
    floor = min(MIN_SLOW_SPLIT_CHUNK_BYTES if slow else MIN_SPLIT_CHUNK_BYTES, cfg.chunk_bytes)
    size = min(cfg.chunk_bytes, max(floor, per_chunk))
    if slow:
        hop = max(MIN_SLOW_CHUNK_BYTES, int(rate * PIPELINE_CHUNK_S), -(-nbytes // MAX_STEP_CHUNKS))
        size = min(size, hop)
    return size


def chunk_elements(cfg: Config, nbytes: int, itemsize: int, pace: float = 0.0) -> int:
    """Elements a chunk of a step of `nbytes` holds (chunk_bytes gives the bytes)."""
    if nbytes < 0 or itemsize < 0:
        raise ValueError(f"a step has no negative size: nbytes={nbytes}, itemsize={itemsize}")
    return max(1, chunk_bytes(cfg, nbytes, pace) // max(1, itemsize))


def plan_chunks(cfg: Config, numel: int, itemsize: int, pace: float = 0.0) -> ChunkPlan:
    """The chunks of a step of `numel` elements of `itemsize` bytes, at the view's `pace`. An
    empty step is one empty chunk (it still runs, so every member takes part)."""
    per_chunk = chunk_elements(cfg, numel * itemsize, itemsize, pace)
    starts = range(0, max(1, numel), per_chunk)
    return ChunkPlan(per_chunk=per_chunk, offsets=dict(enumerate(starts)))
