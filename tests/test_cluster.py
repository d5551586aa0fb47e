"""Real nodes over loopback TCP: each rank on its own 127.0.0.x address."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from fttree.demo import contribution, expected_sum

from .conftest import cluster, free_port


def test_seven_workers_exact_through_a_cut_link_in_process() -> None:
    size = 20_000
    with cluster(7, timeout=0.3, faults="cut 1-0 @5..10") as handles:
        recovered = []
        for h in handles:
            assert h.node is not None
            h.node.note_listeners.append(lambda n, rank=h.rank: recovered.append((rank, n.step, n.text)))
        for step in range(14):
            futures = [h.allreduce_async(contribution(h.rank, step, size)) for h in handles]
            for h, fut in zip(handles, futures, strict=True):
                out = fut.result(timeout=30)
                assert np.array_equal(out, expected_sum(7, step, size)), f"rank {h.rank} step {step}"
    relayed_steps = {step for rank, step, text in recovered if rank == 0 and "forwarded by" in text}
    assert relayed_steps == set(range(5, 11))


def test_torch_tensors_keep_shape_dtype_and_average() -> None:
    with cluster(3, timeout=0.3) as handles:
        tensors = [torch.full((4, 5), float(r + 1), dtype=torch.bfloat16) for r in range(3)]
        futures = [h.allreduce_async(t, average=True) for h, t in zip(handles, tensors, strict=True)]
        for fut in futures:
            out = fut.result(timeout=30)
            assert isinstance(out, torch.Tensor)
            assert out.shape == (4, 5)
            assert out.dtype == torch.bfloat16
            assert torch.equal(out, torch.full((4, 5), 2.0, dtype=torch.bfloat16))
        ints = [np.arange(6, dtype=np.int64).reshape(2, 3) * (r + 1) for r in range(3)]
        outs = [f.result(timeout=30) for f in [h.allreduce_async(x) for h, x in zip(handles, ints, strict=True)]]
        for out in outs:
            assert out.dtype == np.int64
            assert np.array_equal(out, np.arange(6).reshape(2, 3) * 6)
        assert handles[0].last is not None
        assert handles[0].last.contributors == (0, 1, 2)


def test_large_tensor_is_chunked_and_exact() -> None:
    size = 300_000
    with cluster(3, timeout=0.5, chunk_bytes=256 * 1024) as handles:
        futures = [h.allreduce_async(contribution(h.rank, 0, size)) for h in handles]
        for fut in futures:
            assert np.array_equal(fut.result(timeout=30), expected_sum(3, 0, size))


@pytest.mark.slow
def test_launch_seven_processes_with_a_cut_link() -> None:
    """The issue's acceptance run: 7 processes, link 1-0 silent for steps 5..10 of 20."""
    cmd = [sys.executable, "-m", "fttree", "launch", "-n", "7", "--steps", "20", "--size", "50000",
           "--timeout", "0.3", "--port", str(free_port()), "--faults", "cut 1-0 @5..10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {int(line.split()[1]): line for line in proc.stdout.splitlines() if line.startswith("step ")}
    assert sorted(lines) == list(range(20))
    assert all("exact 7/7" in line for line in lines.values())
    for step in range(20):
        assert ("forwarded by" in lines[step]) == (5 <= step <= 10), lines[step]
    assert "all exact: yes" in proc.stdout
