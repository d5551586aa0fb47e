"""CachedDataset: samples come from local disk after their first read, and after a membership
change only the samples that moved are fetched again, counted across loader processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fttree import ConfigError
from fttree.data.cache import CachedDataset, CacheStats
from fttree.data.sampler import CollateOrNone, ElasticSampler, loader_horizon

torch = pytest.importorskip("torch")


class Source:
    """A dataset on "slow storage" that counts its reads (in this process)."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        return torch.full((3,), float(i)), i


def _epoch(sampler: ElasticSampler, data: CachedDataset, members: tuple[int, ...]) -> list[int]:
    seen = []
    for step, batch in enumerate(sampler):
        seen.extend(int(data[i][1]) for i in batch)
        sampler.commit(step, members)
    return seen


def test_a_stable_worker_reads_its_samples_from_disk_after_the_first_epoch(tmp_path: Path) -> None:
    source = Source(300)
    data = CachedDataset(source, tmp_path)
    sampler = ElasticSampler(300, 8, rank=1, members=range(3), stable=True)
    first = _epoch(sampler, data, sampler.members)
    assert data.stats() == CacheStats(fetched=len(first), distinct=len(first), cached=len(first))
    sampler.set_epoch(1)
    again = _epoch(sampler, data, sampler.members)
    assert sorted(again) == sorted(first)
    assert data.stats().fetched == len(first) == source.reads  # nothing fetched in epoch 1


def test_after_a_death_survivors_fetch_exactly_the_samples_they_received(tmp_path: Path) -> None:
    members = tuple(range(4))
    samplers = {r: ElasticSampler(800, 10, rank=r, members=members, stable=True) for r in members}
    caches = {r: CachedDataset(Source(800), tmp_path / f"rank{r}") for r in members}
    for r in members:  # epoch 0 warmed every cache with its own share
        caches[r].prefetch(samplers[r].pending())
    for s in samplers.values():
        s.set_epoch(1)
    warm = {r: caches[r].stats() for r in members}
    for step in range(5):
        for s in samplers.values():
            s.commit(step, members)
    survivors = (0, 1, 3)
    events = [samplers[r].commit(5, survivors, survivors) for r in survivors]  # rank 2 dies
    event = events[0]
    assert event is not None
    for r in survivors:
        fetched = caches[r].prefetch(samplers[r].pending())
        assert fetched == event.received[r] > 0  # the moved samples, and nothing else
        assert caches[r].stats().since(warm[r]).fetched == fetched


def test_fetches_in_loader_worker_processes_are_counted(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    data = CachedDataset(Source(120), tmp_path)
    sampler = ElasticSampler(120, 5, rank=0, members=[0, 1], horizon=loader_horizon(2, 2), stable=True)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=2, prefetch_factor=2, collate_fn=CollateOrNone())
    seen: list[int] = []
    for step, batch in enumerate(loader):
        if batch is not None:
            seen.extend(batch[1].tolist())
        sampler.commit(step, [0, 1])
    assert data.stats().fetched == len(seen) == 60  # counted in the workers, read here
    assert data.stats().cached == 60


def test_retain_drops_samples_that_moved_away(tmp_path: Path) -> None:
    data = CachedDataset(Source(20), tmp_path)
    data.prefetch(range(10))
    assert data.retain(range(5, 15)) == 5
    stats = data.stats()
    assert stats.cached == 5
    data.prefetch(range(10))
    assert data.stats().since(stats) == CacheStats(fetched=5, distinct=0, cached=5)
    assert data.stats().refetched == 5


def test_samples_that_cannot_be_stored_safely_are_named(tmp_path: Path) -> None:
    class Numpy(Source):
        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:  # type: ignore[override]
            return np.zeros(2), i

    with pytest.raises(ConfigError, match=r"sample 3 holds a numpy\.ndarray"):
        CachedDataset(Numpy(5), tmp_path)[3]


@pytest.mark.parametrize(("index", "needle"), [(7, "outside the dataset of 5"), (-1, "outside"), ("a", "integer")])
def test_bad_indices_are_named(tmp_path: Path, index: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        CachedDataset(Source(5), tmp_path)[index]  # type: ignore[index]


def test_a_dataset_without_len_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="__getitem__ and __len__"):
        CachedDataset(object(), tmp_path)  # type: ignore[arg-type]
