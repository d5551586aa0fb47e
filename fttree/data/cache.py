"""CachedDataset: a node-local disk cache in front of a dataset on slow or remote storage.

With ElasticSampler in stable mode each worker reads the same samples every epoch, so after
the first epoch they all come from local disk; after a membership change only the samples
that moved to this worker are fetched from the source (FT-HVAC's re-caching, seed 003).
`stats()` counts those fetches, for every process that used the cache directory (DataLoader
workers included): each fetch appends one 8-byte record to `fetched.log` there, so the count
is structured data that survives worker processes and restarts, not a log line.

Samples are stored one file each with torch.save and read back with
torch.load(weights_only=True), which never runs code from the file; so a sample must be made
of tensors, numbers, strings, None and lists/tuples/dicts of them. Files are written to a
temporary name and renamed, so a crash never leaves half a sample behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError

_LOG = "fetched.log"
_RECORD = np.dtype("<i8")
_PLAIN = (int, float, str, bool, bytes, type(None))


class _Dataset(Protocol):
    def __getitem__(self, index: int, /) -> Any: ...
    def __len__(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStats:
    """Fetches from the source (all processes, since the cache directory was created) and
    what the disk holds now."""

    fetched: int  # samples read from the wrapped dataset
    distinct: int  # distinct samples among them
    cached: int  # samples on local disk

    @property
    def refetched(self) -> int:
        """Fetches of samples that had been fetched before (evicted, then needed again)."""
        return self.fetched - self.distinct

    def since(self, earlier: CacheStats) -> CacheStats:
        """The change from `earlier`, e.g. what a membership change cost."""
        return CacheStats(fetched=self.fetched - earlier.fetched, distinct=self.distinct - earlier.distinct,
                          cached=self.cached - earlier.cached)


class CachedDataset:
    """`dataset` (anything with __getitem__ and __len__) with each sample kept on local disk
    under `cache_dir` after its first read."""

    def __init__(self, dataset: _Dataset, cache_dir: str | os.PathLike[str]) -> None:
        if not callable(getattr(dataset, "__getitem__", None)) or not callable(getattr(dataset, "__len__", None)):
            raise ConfigError(f"CachedDataset needs a dataset with __getitem__ and __len__, "
                              f"got {type(dataset).__name__}")
        self.dataset = dataset
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._size = len(dataset)

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> Any:
        path = self._path(index)
        try:
            return self._load(path)
        except FileNotFoundError:
            return self._fetch(index, path)

    def prefetch(self, indices: Iterable[int]) -> int:
        """Fetch the samples among `indices` that are not on disk yet (e.g. a sampler's
        `pending()` after a membership change). Returns how many were fetched."""
        fetched = 0
        for index in indices:
            path = self._path(int(index))
            if not path.exists():
                self._fetch(int(index), path)
                fetched += 1
        return fetched

    def retain(self, indices: Iterable[int]) -> int:
        """Delete cached samples not in `indices` (those that moved to other workers).
        Returns how many were deleted."""
        keep = {int(i) for i in indices}
        removed = 0
        for index, path in self._cached_files():
            if index not in keep:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def stats(self) -> CacheStats:
        log = self.cache_dir / _LOG
        records = np.fromfile(log, dtype=_RECORD) if log.exists() else np.zeros(0, dtype=_RECORD)
        return CacheStats(fetched=len(records), distinct=len(np.unique(records)),
                          cached=sum(1 for _ in self._cached_files()))

    # ---- storage -------------------------------------------------------------------------

    def _path(self, index: int) -> Path:
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise ConfigError(f"sample index must be an integer, got {index!r}")
        if not 0 <= index < self._size:
            raise ConfigError(f"sample index {index} is outside the dataset of {self._size} samples")
        return self.cache_dir / f"{int(index)}.pt"

    def _cached_files(self) -> Iterable[tuple[int, Path]]:
        with os.scandir(self.cache_dir) as entries:
            for entry in entries:
                stem, dot, ext = entry.name.partition(".")
                if dot and ext == "pt" and stem.isdigit():
                    yield int(stem), Path(entry.path)

    def _fetch(self, index: int, path: Path) -> Any:
        import torch

        sample = self.dataset[index]
        _check_storable(sample, index)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(sample, tmp)
        os.replace(tmp, path)
        fd = os.open(self.cache_dir / _LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, np.asarray([index], dtype=_RECORD).tobytes())  # one small O_APPEND write: atomic
        finally:
            os.close(fd)
        return sample

    @staticmethod
    def _load(path: Path) -> Any:
        import torch

        return torch.load(path, weights_only=True)


def _check_storable(sample: Any, index: int) -> None:
    """Refuse, naming the culprit, what torch.load(weights_only=True) could not read back."""
    import torch

    stack = [sample]
    while stack:
        x = stack.pop()
        if isinstance(x, (torch.Tensor, *_PLAIN)):
            continue
        if isinstance(x, list | tuple):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        else:
            raise ConfigError(f"CachedDataset stores tensors, numbers, strings, None and lists/tuples/dicts of "
                              f"them; sample {index} holds a {type(x).__module__}.{type(x).__qualname__} "
                              f"(convert it in the dataset, e.g. torch.from_numpy)")
