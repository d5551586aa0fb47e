"""int8 wire compression (Config.compression or a step's `compression="int8"`): per block of 256
values a float32 scale and int8 values, float32 accumulation at every hop, re-quantized on the
way up and once for the broadcast, the same result bit for bit on every rank, and its error.

`python -m pytest -s tests/test_int8.py -k depth` prints the error against float32 per tree depth.
"""

from __future__ import annotations

import numpy as np
import pytest

from fttree.core.messages import (
    INT8,
    INT8_BLOCK,
    Kind,
    Message,
    decode,
    decode_int8,
    encode,
    encode_int8,
    from_wire,
    wire_nbytes,
    wire_numel,
)
from fttree.errors import FrameError
from fttree.net.node import StepResult
from fttree.testing.sim import SimNetwork

from .conftest import cluster
from .test_compression import _data, _depth, check_same_bits_within
from .test_compression import run_one_step as _run

# ---- the codec ---------------------------------------------------------------------------------


def _block_max(x: np.ndarray) -> np.ndarray:
    """Each element's block's largest magnitude (what its scale is made of)."""
    pad = np.zeros(-(-x.size // INT8_BLOCK) * INT8_BLOCK)
    pad[: x.size] = np.abs(x)
    return np.repeat(pad.reshape(-1, INT8_BLOCK).max(axis=1), INT8_BLOCK)[: x.size]


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 65_536 + 3])
def test_each_value_is_within_half_a_step_of_its_block(n: int) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.repeat(rng.uniform(1e-4, 1e3, -(-n // INT8_BLOCK)), INT8_BLOCK)[:n])
    x = x.astype(np.float32)
    enc = encode_int8(x)
    assert enc.dtype == np.uint8
    assert enc.size == wire_nbytes(INT8, n) == n + 4 * -(-n // INT8_BLOCK)
    assert wire_numel(INT8, enc) == n
    back = decode_int8(enc, n)
    step = _block_max(x) / 127
    assert (np.abs(back.astype(np.float64) - x) <= step / 2 * (1 + 1e-6) + 1e-30).all()
    # the largest value of every block is exact up to float32 rounding of its scale
    assert np.allclose(np.abs(back)[np.abs(x) == _block_max(x)], np.abs(x)[np.abs(x) == _block_max(x)], rtol=1e-6)


def test_zeros_stay_zeros_and_a_nonfinite_block_decodes_to_nan() -> None:
    x = np.zeros(3 * INT8_BLOCK, dtype=np.float32)
    x[INT8_BLOCK + 5] = np.inf  # block 1
    x[2 * INT8_BLOCK :] = 2.0
    x[2 * INT8_BLOCK + 7] = np.nan  # block 2
    back = decode_int8(encode_int8(x), x.size)
    assert (back[:INT8_BLOCK] == 0).all()
    assert np.isnan(back[INT8_BLOCK : 2 * INT8_BLOCK]).all()  # never a finite wrong value
    assert np.isnan(back[2 * INT8_BLOCK :]).all()


def test_decoding_into_a_working_array_gives_the_same_values() -> None:
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    enc = encode_int8(x)
    into = np.full(1000, 7.0, dtype=np.float32)
    assert decode_int8(enc, 1000, into) is into
    assert np.array_equal(into, decode_int8(enc, 1000))
    assert np.array_equal(from_wire(enc.data.cast("B"), INT8, "<f4"), into)


def test_frames_carry_int8_and_check_its_length() -> None:
    enc = encode_int8(np.ones(300, dtype=np.float32))
    msg = Message(kind=Kind.DATA_BCAST, src=0, step=1, dtype=INT8, numel=300, signature="float32[300]",
                  payload=enc.data.cast("B"))
    back = decode(b"".join(bytes(b) for b in encode(msg)))
    assert from_wire(back.payload, INT8, "<f4").tolist() == [1.0] * 300  # type: ignore[arg-type]
    for numel in (299, 301, 0):
        bad = Message(kind=Kind.DATA_BCAST, src=0, step=1, dtype=INT8, numel=numel, signature="float32[300]",
                      payload=enc.data.cast("B"))
        with pytest.raises(FrameError, match=f"does not hold {numel} x int8"):
            decode(b"".join(bytes(b) for b in encode(bad)))


# ---- the protocol ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4, 7, 15])
def test_every_rank_gets_the_same_bits_within_the_bound(world: int) -> None:
    # Each hop rounds once (leaf, every interior rank, the root's result) by at most half a step
    # of its block, and a partial sum's block holds no more than the block's sum of magnitudes.
    check_same_bits_within(world, (), "int8", lambda magnitude: (_depth(world) + 2) * _block_max(magnitude) / 254)


def test_about_a_quarter_of_the_bytes_on_the_wire() -> None:
    world, n = 7, 20_000
    data = _data(world, n)
    plain, _ = _run(world, data, chunk_bytes=16_384)
    packed, _ = _run(world, data, chunk_bytes=16_384, compression="int8")
    ratio = packed.stats.data_bytes / plain.stats.data_bytes
    assert 0.25 < ratio < 0.25 * (1 + 4 / INT8_BLOCK) + 0.01, ratio


def test_a_crashed_rank_reruns_quantized_and_everyone_agrees() -> None:
    world = 7
    data = _data(world, 2000, seed=9)
    net = SimNetwork(world, compression="int8", chunk_bytes=2048)
    net.crash(4)
    net.submit_all(0, data)
    net.run_until_finished(0, limit_s=30.0)
    results = [net.outcome(r, 0) for r in range(world) if r != 4]
    assert all(isinstance(o, StepResult) for o in results), results
    assert len({o.data.tobytes() for o in results}) == 1  # type: ignore[union-attr]
    assert 4 not in results[0].contributors  # type: ignore[union-attr]


def test_a_step_may_ask_for_int8_while_the_others_travel_as_they_are() -> None:
    """`allreduce(..., compression="int8")` quantizes that step alone; ranks may even differ."""
    with cluster(3) as ars:
        x = [np.linspace(-1, 1, 1000, dtype=np.float32) * (r + 1) for r in range(3)]
        plain = [ar.allreduce_async(x[r]) for r, ar in enumerate(ars)]
        packed = [ar.allreduce_async(x[r], compression="int8" if r != 1 else None) for r, ar in enumerate(ars)]
        exact = sum(x)
        assert all(np.array_equal(f.result(30), exact) for f in plain)
        got = [f.result(30) for f in packed]
        assert all(np.array_equal(g, got[0]) for g in got)
        assert not np.array_equal(got[0], exact)
        assert np.max(np.abs(got[0] - exact)) <= 4 * 6 / 254
        with pytest.raises(ValueError, match="compression must be one of bf16, fp16, int8 and the data float32"):
            ars[0].allreduce(np.arange(4), compression="int8")


# ---- the error for real pseudo-gradients, per tree depth ------------------------------------------


def _pseudo_gradients(world: int) -> list[np.ndarray]:
    """What DiLoCo averages: each worker's parameters after 8 local SGD steps on its own data,
    subtracted from the common start (the thesis MLP, synthetic digits-like data)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    start = [p.detach().clone() for p in model.parameters()]
    out = []
    for r in range(world):
        with torch.no_grad():
            for p, s in zip(model.parameters(), start, strict=True):
                p.copy_(s)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + r)
        for _ in range(8):
            x, y = torch.rand(16, 784, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out.append(torch.cat([(s - p.detach()).reshape(-1) for p, s in zip(model.parameters(), start,
                                                                              strict=True)]).numpy().copy())
    return out


def test_pseudo_gradient_error_against_float32_per_tree_depth() -> None:
    lines = []
    every = _pseudo_gradients(15)  # worker r's are the same in every world
    for world in (3, 7, 15):
        grads = every[:world]
        _, ref = _run(world, grads, chunk_bytes=1 << 20)
        _, outs = _run(world, grads, compression="int8", chunk_bytes=1 << 20)
        f32, got = ref[0].data.astype(np.float64), outs[0].data.astype(np.float64)
        rel = float(np.linalg.norm(got - f32) / np.linalg.norm(f32))
        cosine = float(got @ f32 / (np.linalg.norm(got) * np.linalg.norm(f32)))
        lines.append(f"{world:>3} workers (depth {_depth(world)}): relative L2 error {rel:.2e}, cosine {cosine:.6f}")
        assert rel < 0.01 * (_depth(world) + 2)
        assert cosine > 0.999
    print("\nint8 pseudo-gradients of the thesis MLP (8 local SGD steps), summed over the tree:\n  "
          + "\n  ".join(lines))
