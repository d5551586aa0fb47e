"""State snapshots: a restored worker continues bit for bit; broken or foreign state is named."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fttree.training.state import Chunk, StateError, StateMismatch, StateSnapshot, decode, restore, snapshot

ROOT = Path(__file__).resolve().parent.parent


def mlp(seed: int, hidden: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 5))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: range) -> None:
    for step in steps:
        x, y = data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def same_bits(a: Any, b: Any, where: str = "") -> None:
    """Recursively equal, tensors bit for bit (dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() == b.reshape(-1).contiguous() \
            .view(torch.uint8).numpy().tobytes(), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same_bits(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_bits(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


OPTIMIZERS: dict[str, Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]]] = {
    "sgd-momentum": lambda m: (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True), None),
    "adam": lambda m: (torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-4), None),
    "adamw-steplr": lambda m: (o := torch.optim.AdamW(m.parameters(), lr=1e-2),
                               torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
    "sgd-onecycle": lambda m: (o := torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                               torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=40)),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_restored_worker_continues_bit_for_bit(kind: str) -> None:
    a = mlp(0)
    opt_a, sched_a = OPTIMIZERS[kind](a)
    train(a, opt_a, sched_a, range(7))
    snap = snapshot(a, opt_a, sched_a, step_count=7)
    b = mlp(1)  # different weights, fresh optimizer: everything must come from the snapshot
    opt_b, sched_b = OPTIMIZERS[kind](b)
    chunks = [Chunk.from_bytes(c.to_bytes()) for c in snap.chunks(4096)]
    random.Random(3).shuffle(chunks)  # chunks may arrive in any order
    got = restore(chunks, b, opt_b, sched_b)
    assert got.step_count == 7
    assert got.digest == snap.hexdigest
    same_bits(a.state_dict(), b.state_dict())
    same_bits(opt_a.state_dict(), opt_b.state_dict())
    train(a, opt_a, sched_a, range(7, 12))
    train(b, opt_b, sched_b, range(7, 12))
    same_bits(a.state_dict(), b.state_dict(), "model")
    same_bits(opt_a.state_dict(), opt_b.state_dict(), "optimizer")
    if sched_a is not None:
        same_bits(sched_a.state_dict(), sched_b.state_dict(), "scheduler")
        assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    assert snapshot(a, opt_a, sched_a).data == snapshot(b, opt_b, sched_b).data


def test_snapshot_bytes_are_deterministic_and_pickle_free() -> None:
    a = mlp(0)
    opt, sched = OPTIMIZERS["adamw-steplr"](a)
    train(a, opt, sched, range(3))
    one, two = snapshot(a, opt, sched), snapshot(a, opt, sched)
    assert one.data == two.data
    assert one.digest == two.digest
    assert b"torch._utils" not in one.data  # no pickle
    assert b"\x80\x04" not in one.data[:64]
    train(a, opt, sched, range(3, 4))
    assert snapshot(a, opt, sched).digest != one.digest


def test_extra_state_round_trips_rng_and_data_position() -> None:
    a = mlp(0)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    position = {"epoch": 2, "batch": 17}
    torch.manual_seed(42)
    np.random.seed(7)
    extra = {"torch_rng": (torch.get_rng_state, torch.set_rng_state),
             "numpy_rng": (np.random.get_state, np.random.set_state),
             "data": (lambda: dict(position), position.update)}
    snap = snapshot(a, opt, extra=extra)
    want_t, want_n = torch.rand(3), np.random.rand(3)
    torch.manual_seed(0)
    np.random.seed(0)
    position.update(epoch=0, batch=0)
    got = restore(snap, mlp(1), torch.optim.SGD(mlp(1).parameters(), lr=0.1), extra=extra)
    assert got.extra == ("data", "numpy_rng", "torch_rng")
    assert torch.equal(torch.rand(3), want_t)
    assert np.array_equal(np.random.rand(3), want_n)
    assert position == {"epoch": 2, "batch": 17}


def test_named_tensors_stand_in_for_a_model() -> None:
    """Parameters without a module (DistributedOptimizer(named_parameters=...) and no model):
    a mapping of names to tensors is captured and loaded like a state_dict."""
    a, b = mlp(0), mlp(1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    train(a, opt_a, None, range(2))
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    named_a, named_b = dict(a.named_parameters()), dict(b.named_parameters())
    snap = snapshot(named_a, opt_a)
    assert decode(snap.data).model.keys() == named_a.keys()  # parameters only, no buffers
    restore(snap, named_b, opt_b)
    same_bits({n: p.detach() for n, p in named_a.items()}, {n: p.detach() for n, p in named_b.items()})
    same_bits(opt_a.state_dict(), opt_b.state_dict())
    assert snapshot(named_b, opt_b).data == snap.data
    with pytest.raises(StateMismatch, match=r"not in this model: 3\.bias"):
        restore(snap, {n: p for n, p in named_b.items() if n != "3.bias"}, opt_b)


def test_bad_state_is_named() -> None:
    a = mlp(0)
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    train(a, opt, None, range(2))
    snap = snapshot(a, opt)
    chunks = snap.chunks(1000)
    # a chunk lost, a chunk of another state, flipped bits
    with pytest.raises(StateError, match=r"missing chunks \[1\] of"):
        restore([chunks[0], *chunks[2:]], mlp(1), torch.optim.SGD(mlp(1).parameters(), lr=0.1, momentum=0.9))
    train(a, opt, None, range(2, 3))
    other = snapshot(a, opt).chunks(1000)
    with pytest.raises(StateError, match=r"chunks \[1\] belong to another state"):
        StateSnapshot.from_chunks([chunks[0], other[1], *chunks[2:]])
    raw = bytearray(chunks[1].to_bytes())
    raw[-1] ^= 1
    with pytest.raises(StateError, match=r"state chunk 1 of \d+ is corrupt"):
        Chunk.from_bytes(bytes(raw))
    forged = [Chunk(c.index, c.count, c.total_bytes, c.digest, c.data if c.index else b"x" + c.data[1:])
              for c in chunks]
    with pytest.raises(StateError, match="state digest mismatch"):
        StateSnapshot.from_chunks(forged)
    with pytest.raises(StateError, match="not an fttree state"):
        restore(b"PK\x03\x04" + bytes(40), a, opt)


def test_a_snapshot_that_does_not_fit_names_what_differs() -> None:
    snap = snapshot(mlp(0), torch.optim.SGD(mlp(0).parameters(), lr=0.1))
    wide = mlp(0, hidden=33)
    with pytest.raises(StateMismatch, match=r"0.weight: snapshot float32\[32, 12\], model float32\[33, 12\]"):
        restore(snap, wide, torch.optim.SGD(wide.parameters(), lr=0.1))
    half = mlp(0).to(torch.float64)
    with pytest.raises(StateMismatch, match=r"3.bias: snapshot float32\[5\], model float64\[5\]"):
        restore(snap, half, torch.optim.SGD(half.parameters(), lr=0.1))
    extra_layer = nn.Sequential(*mlp(0), nn.Linear(5, 5))
    with pytest.raises(StateMismatch, match=r"not in the snapshot: 4.bias, 4.weight"):
        restore(snap, extra_layer, torch.optim.SGD(extra_layer.parameters(), lr=0.1))
    m = mlp(7)
    before = [p.clone() for p in m.parameters()]
    two_groups = torch.optim.SGD([{"params": list(m.parameters())[:2]}, {"params": list(m.parameters())[2:]}], lr=0.1)
    with pytest.raises(StateMismatch, match="snapshot optimizer has 1 param groups, this one 2"):
        restore(snap, m, two_groups)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(StateMismatch, match="snapshot has no scheduler state"):
        restore(snap, m, o, torch.optim.lr_scheduler.StepLR(o, 2))
    assert all(torch.equal(p, q) for p, q in zip(before, m.parameters(), strict=True))  # nothing half-loaded


def test_thesis_mlp_snapshot_restore_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """Figures for the report (not timed assertions): bytes and seconds for 407,050 params + momentum."""
    def thesis() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))

    a = thesis()
    assert sum(p.numel() for p in a.parameters()) == 407_050
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(100, 784), torch.randint(0, 10, (100,))
    nn.functional.cross_entropy(a(x), y).backward()
    opt.step()
    b = thesis()
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    t0 = time.perf_counter()
    snap = snapshot(a, opt)
    t1 = time.perf_counter()
    restore(snap.chunks(1 << 20), b, opt_b)
    t2 = time.perf_counter()
    same_bits(opt.state_dict(), opt_b.state_dict())
    assert len(snap.data) < 2 * 407_050 * 4 + 4096  # parameters + momentum + a small header
    with capsys.disabled():
        print(f"\nthesis MLP state: {len(snap.data):,} bytes, snapshot {1e3 * (t1 - t0):.1f} ms, "
              f"restore from 1 MiB chunks {1e3 * (t2 - t1):.1f} ms")


SYNC_WORKER = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    import fttree

    rank = int(os.environ["RANK"])
    dist.init_process_group("fttree")
    torch.manual_seed(rank)  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * (rank + 1), momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(rank + 1):  # and has taken a different number of steps
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        sched.step()
    from fttree.training.state import snapshot
    t0 = time.perf_counter()
    got = fttree.sync_state(model, opt, sched, src=2)  # from the rank that took the most steps
    first = {"digest": snapshot(model, opt, sched).hexdigest, "synced": got.digest, "lr": opt.param_groups[0]["lr"],
             "seconds": time.perf_counter() - t0}
    opt.zero_grad()
    model(torch.randn(4, 6)).sum().backward()  # ranks drift apart again
    opt.step()
    got = fttree.sync_state(model, opt, sched)  # default: the lowest rank
    second = {"digest": snapshot(model, opt, sched).hexdigest, "synced": got.digest}
    print(json.dumps({"rank": rank, "first": first, "second": second}), flush=True)
    dist.destroy_process_group()
''')


def test_sync_state_over_the_fttree_backend(tmp_path: Path) -> None:
    """3 ranks with different weights, learning rates and step counts: after sync_state all hold
    the source's state bit for bit (digests equal), first from rank 2, then from the default."""
    import json
    import os
    import socket

    script = tmp_path / "sync.py"
    script.write_text(SYNC_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for which in ("first", "second"):
        digests = {o[which]["digest"] for o in outs}
        assert len(digests) == 1, outs
        assert {o[which]["synced"] for o in outs} == digests
    assert {o["first"]["lr"] for o in outs} == {0.05 * (2 + 1) * 0.5}  # rank 2's lr, halved once by its StepLR
    assert outs[0]["first"]["digest"] != outs[0]["second"]["digest"]
