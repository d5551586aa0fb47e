"""Zero-element steps (a frozen layer's bucket, a rank with no samples of a class): every rank
takes part, the result is empty and names its contributors, and a rank that passes something
else there is named on every rank instead of a wait."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fttree import TensorMismatch

from .conftest import cluster


def test_an_empty_allreduce_returns_empty_on_every_rank_and_the_next_step_is_exact() -> None:
    with cluster(3, timeout_s=0.3, step_timeout_s=20) as handles:
        futures = [h.submit_array(np.zeros(0, np.float32), "empty") for h in handles]
        for h, fut in zip(handles, futures, strict=True):
            res = fut.result(timeout=30)
            assert res.data.shape == (0,)
            assert res.data.dtype == np.float32
            assert res.contributors == (0, 1, 2), h.rank
        tensors = [torch.empty(0, 3, dtype=torch.float64) for _ in handles]
        futs = [h.allreduce_async(t) for h, t in zip(handles, tensors, strict=True)]
        for fut in futs:
            out = fut.result(timeout=30)
            assert tuple(out.shape) == (0, 3)
            assert out.dtype == torch.float64
        data = [np.full(10, float(r + 1), np.float32) for r in range(3)]
        futures = [h.allreduce_async(d) for h, d in zip(handles, data, strict=True)]
        for fut in futures:
            assert np.array_equal(fut.result(timeout=30), np.full(10, 6.0, np.float32))


def test_an_empty_step_against_a_full_one_fails_on_every_rank_and_the_next_works() -> None:
    with cluster(3, timeout_s=0.3, step_timeout_s=5) as handles:
        arrays = [np.zeros(0, np.float32), np.zeros(0, np.float32), np.ones(4, np.float32)]
        futures = [h.submit_array(a, f"bucket[{a.size}]") for h, a in zip(handles, arrays, strict=True)]
        for fut in futures:
            with pytest.raises(TensorMismatch, match=r"rank 2 sent bucket\[4\] \(4 x <f4\)"):
                fut.result(timeout=30)
        data = [np.full(10, float(r + 1), np.float32) for r in range(3)]
        futures = [h.allreduce_async(d) for h, d in zip(handles, data, strict=True)]
        for fut in futures:
            assert np.array_equal(fut.result(timeout=30), np.full(10, 6.0, np.float32))
