"""ElasticSampler.resume: a whole job restarted from a checkpoint takes the epoch's history on
every member and deals the rest of the epoch so each sample is committed once overall."""
from __future__ import annotations

import numpy as np
import pytest

from fttree.data.sampler import ElasticSampler, EpochHistory
from fttree.errors import ConfigError

SIZE, BATCH = 203, 5


def _run(samplers: dict[int, ElasticSampler], steps: int, contributors: tuple[int, ...]) -> None:
    """Commit `steps` steps on every sampler with `contributors`."""
    for _ in range(steps):
        (step,) = {s.next_step for s in samplers.values()}
        for s in samplers.values():
            s.commit(step, contributors)


def _fresh(ranks: tuple[int, ...]) -> dict[int, ElasticSampler]:
    return {r: ElasticSampler(SIZE, BATCH, rank=r, members=ranks, seed=3) for r in ranks}


def test_a_resumed_member_deals_what_an_uninterrupted_one_would() -> None:
    ranks = (0, 1, 2)
    going = _fresh(ranks)
    _run(going, 4, ranks)
    saved = going[0].history().to_dict()
    restarted = _fresh(ranks)
    for s in restarted.values():
        assert s.resume(EpochHistory.from_dict(saved), ranks) is True
    for r in ranks:
        assert restarted[r].next_step == going[r].next_step == 4
        assert np.array_equal(restarted[r].committed(), going[r].committed())
        assert restarted[r].batch(4) == going[r].batch(4)
        assert np.array_equal(restarted[r].pending(), going[r].pending())


def test_ranks_gone_from_the_view_come_back_and_every_sample_is_committed_once() -> None:
    ranks = (0, 1, 2)
    before = _fresh(ranks)
    _run(before, 2, ranks)
    for r in (0, 1):  # rank 2 dies: its step-2 batch is not in the result, and it leaves the view
        before[r].commit(2, (0, 1), (0, 1))
    _run({0: before[0], 1: before[1]}, 3, (0, 1))
    saved = EpochHistory.from_dict(before[0].history().to_dict())
    assert 2 not in before[0].members
    # Every process restarts, rank 2 with them.
    after = _fresh(ranks)
    for s in after.values():
        assert s.resume(saved, ranks) is True
        assert s.members == ranks
        assert s.member
    assert after[2].batch(after[2].next_step) != []
    while not after[0].finished:
        _run(after, 1, ranks)
    seen = np.concatenate([after[r].committed(r) for r in ranks])
    assert sorted(seen.tolist()) == list(range(SIZE))


def test_an_epoch_with_no_step_left_hands_the_members_to_the_next_epoch() -> None:
    ranks = (0, 1)
    going = _fresh(ranks)
    while not going[0].finished:
        _run(going, 1, ranks)
    saved = EpochHistory.from_dict(going[0].history().to_dict())
    back = _fresh((0, 1, 2))[0]
    assert back.resume(saved, (0, 1, 2)) is False
    assert back.members == (0, 1)
    back.set_epoch(1, (0, 1, 2))
    assert back.members == (0, 1, 2)


def test_a_history_of_another_config_is_refused_by_name() -> None:
    other = ElasticSampler(SIZE, BATCH + 1, rank=0, members=(0, 1), seed=3)
    s = _fresh((0, 1))[0]
    with pytest.raises(ConfigError, match="sampler config"):
        s.resume(other.history(), (0, 1))
    with pytest.raises(ConfigError, match="EpochHistory"):
        s.resume({"epoch": 0}, (0, 1))  # type: ignore[arg-type]
