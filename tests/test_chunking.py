"""The chunking rule (core/chunking.py): every member must cut a step alike, so the cut depends
only on the step's size, the agreed configuration and the view's pace, and covers the step."""

from __future__ import annotations

import pytest

from fttree.core.chunking import MAX_STEP_CHUNKS, chunk_bytes, plan_chunks
from fttree.core.config import Config

MIB = 1 << 20


@pytest.mark.parametrize("numel", [0, 1, 7, 1023, 1024, 1025, 4 * MIB // 4 + 3, 25_000_000])
@pytest.mark.parametrize("pace", [0.0, 12.5e6, 1.25e6])
def test_a_plan_covers_every_element_once_in_order(numel: int, pace: float) -> None:
    cfg = Config(chunk_bytes=4096) if numel < 2048 else Config()
    cut = plan_chunks(cfg, numel, 4, pace)
    starts = [cut.offsets[c] for c in range(cut.chunks)]
    assert starts[0] == 0
    assert starts == sorted(starts)
    ends = [*starts[1:], max(numel, 1)]
    assert all(0 < end - start <= cut.per_chunk for start, end in zip(starts, ends, strict=True))
    # the byte size is rounded down to whole elements, which can add one chunk (kept as it was:
    # every member rounds alike)
    assert cut.chunks <= MAX_STEP_CHUNKS + 1


def test_an_empty_step_still_runs_as_one_chunk() -> None:
    """Every member takes part in an empty step, so it is one op, not none."""
    cut = plan_chunks(Config(), 0, 4)
    assert cut.offsets == {0: 0}
    assert cut.chunks == 1


def test_the_cut_follows_the_agreed_pace_not_the_local_uplink() -> None:
    """Two workers that measured different uplinks but share the view's pace cut alike; without
    a pace each takes its configured uplink, and those differ (hence SAME_ON_EVERY_WORKER)."""
    fast, slow = Config(uplink_bytes_per_s=1.25e9), Config(uplink_bytes_per_s=12.5e6)
    numel = 16 * MIB // 4
    assert plan_chunks(fast, numel, 4, pace=12.5e6) == plan_chunks(slow, numel, 4, pace=12.5e6)
    assert plan_chunks(fast, numel, 4).chunks < plan_chunks(slow, numel, 4).chunks


def test_config_asks_the_rule_in_core() -> None:
    cfg = Config()
    for nbytes in (1, 1_630_000, 16 * MIB, 100_000_000):
        assert cfg.chunk_bytes_for(nbytes, 12.5e6) == chunk_bytes(cfg, nbytes, 12.5e6)


def test_a_negative_size_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="negative size"):
        plan_chunks(Config(), 10, -4)
