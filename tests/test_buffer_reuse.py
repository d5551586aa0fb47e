"""Buffers used again (core/buffers.py): the staging copy of a submitted tensor, the sums a rank
adds up and the payloads it receives come from pools, and a buffer anyone still holds, the
caller's result included, is never handed out again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fttree.core.buffers import BufferPool

from .conftest import cluster

BIG = BufferPool.MIN_BYTES * 4


def test_an_array_comes_back_only_when_nothing_holds_it() -> None:
    pool = BufferPool()
    first = pool.array(BIG // 4, "<f4")
    assert first.dtype == np.float32
    assert first.size == BIG // 4
    assert first.flags.writeable
    owner = id(first.base)  # an id: holding the owner would keep it busy
    held = torch.from_numpy(first[:10])  # a caller's tensor on a slice of it
    del first
    second = pool.array(BIG // 4, "<f4")
    assert id(second.base) != owner
    del held, second
    third = pool.array(BIG // 2, "<f2")  # the same bytes in another dtype: the same memory is fine
    assert id(third.base) == owner
    assert third.dtype == np.float16
    assert pool.reused == 1
    assert pool.allocated == 2


def test_small_arrays_are_not_pooled() -> None:
    pool = BufferPool()
    small = pool.array(10, "<i8")
    assert small.dtype == np.int64
    assert small.size == 10
    assert not pool.lent


def test_results_the_caller_holds_are_never_written_again() -> None:
    """Results kept (as numpy arrays and as torch tensors) stay exact while later steps reuse the
    buffers of the results let go; the reuse is real: each pool handed buffers out again (sums
    on the ranks that are interior but not the root of a tree: 4 workers have one per tree; a
    root's sum is its result, held for linger_s, longer than this test runs)."""
    size = 300_000  # 1.2 MB: a pooled staging copy, and with 256 KiB chunks pooled sums and payloads
    kept: dict[int, list[object]] = {}
    with cluster(4, timeout_s=0.5, chunk_bytes=256 * 1024) as handles:
        for step in range(12):
            tensors = [np.full(size, float((h.rank + 1) * (step + 1)), np.float32) for h in handles]
            if step % 2:
                tensors = [torch.from_numpy(t) for t in tensors]
            futures = [h.allreduce_async(t) for h, t in zip(handles, tensors, strict=True)]
            outs = [f.result(timeout=30) for f in futures]
            if step % 3 == 0:
                kept[step] = outs  # the rest are dropped here, and their buffers may serve again
        for step, outs in kept.items():
            want = np.full(size, 10.0 * (step + 1), np.float32)
            for out in outs:
                assert np.array_equal(np.asarray(out), want), step
        assert all(h.staging.reused > 0 for h in handles)
        assert sum(h.node.machine.buffers.reused for h in handles if h.node is not None) > 0
        assert all(h.transport.inner.pool.reused > 0 for h in handles if h.transport is not None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensors_are_summed_on_the_host_without_a_staging_copy() -> None:  # pragma: no cover - needs a GPU
    """A CUDA tensor's host copy is already private, so nothing is staged; results come back on
    the tensor's device, exact, and a result kept stays so while later steps run."""
    size = 300_000
    with cluster(3, timeout_s=0.5, chunk_bytes=256 * 1024) as handles:
        kept = None
        for step in range(4):
            tensors = [torch.full((size,), float((h.rank + 1) * (step + 1)), device="cuda") for h in handles]
            outs = [f.result(timeout=60) for f in [h.allreduce_async(t) for h, t in zip(handles, tensors, strict=True)]]
            for out in outs:
                assert out.device.type == "cuda"
                assert torch.equal(out, torch.full((size,), 6.0 * (step + 1), device="cuda"))
            kept = kept if kept is not None else outs
        assert all(torch.equal(out, torch.full((size,), 6.0, device="cuda")) for out in kept)
        assert [h.staging.allocated + h.staging.reused for h in handles] == [0, 0, 0]


def test_compressed_steps_reuse_working_arrays_and_agree() -> None:
    """End to end (API, TCP, 256 KiB chunks) with bf16 and its pooled working arrays: results
    kept while later steps ran still agree bit for bit across ranks, within bf16's rounding of
    the exact sum. Which arrays are pooled is checked on the simulator (test_compression.py)."""
    size = 300_000
    kept: dict[int, list[np.ndarray]] = {}
    rng = np.random.default_rng(5)
    with cluster(4, timeout_s=0.5, chunk_bytes=256 * 1024, compression="bf16") as handles:
        for step in range(8):
            tensors = [rng.standard_normal(size).astype(np.float32) for _ in handles]
            futures = [h.allreduce_async(t) for h, t in zip(handles, tensors, strict=True)]
            outs = [np.asarray(f.result(timeout=30)) for f in futures]
            kept[step] = [*outs, np.sum(np.array(tensors, dtype=np.float64), axis=0)]
        for step, (*outs, exact) in kept.items():
            for out in outs:
                assert np.array_equal(out.view(np.uint32), outs[0].view(np.uint32)), step
            assert np.abs(outs[0] - exact).max() <= 2.0**-6 * np.abs(exact).max() + 1e-3, step
        assert sum(h.node.machine.scratch.reused for h in handles if h.node is not None) > 0
