"""Wire compression (Config.compression = "bf16" | "fp16"): the codec, half the bytes, float32
accumulation at every hop, the same result bit for bit on every rank, and the error bound.

`python -m pytest -s tests/test_compression.py -k mlp` prints the error against float32 for the
thesis MLP's gradients.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np
import pytest

from fttree.core.config import Config
from fttree.core.messages import BF16, Kind, Message, decode, decode_bf16, encode, encode_bf16, from_wire, to_wire
from fttree.core.protocol import Complete, Submit, TreeMachine
from fttree.core.view import View
from fttree.errors import ConfigError, FrameError
from fttree.net.node import StepResult
from fttree.testing.sim import SimNetwork

# ---- the codec ---------------------------------------------------------------------------------


def _bf16_reference(x: float) -> int:
    """bfloat16 bits of a float32 by the definition: round to nearest, ties to even."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    if math.isnan(x):
        return (u >> 16) | 0x40
    upper, lower = u >> 16, u & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper


EDGES = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.3895314e38, 3.4028235e38, -3.4028235e38,
                  1e-45, -1e-45, 1.1754942e-38, 1.00390625, 1.01171875, 1.0078125 + 2**-23, 65504.0, 1e-8],
                 dtype=np.float32)


def test_bf16_rounds_to_nearest_even_like_the_definition() -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate([EDGES, (rng.standard_normal(3000) * 10.0 ** rng.integers(-30, 30, 3000)).astype(np.float32),
                        rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    bits = encode_bf16(x)
    assert bits.dtype == np.uint16
    assert [int(b) for b in bits] == [_bf16_reference(float(v)) for v in x]
    # ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> even (1); 1 + 3 * 2^-8 -> 1 + 2^-6
    assert decode_bf16(encode_bf16(np.array([1.00390625, 1.01171875], dtype=np.float32))).tolist() == [1.0, 1.015625]


def test_bf16_decodes_exactly_and_keeps_what_it_can_hold() -> None:
    bits = np.arange(2**16, dtype=np.uint16)
    back = decode_bf16(bits)
    assert back.dtype == np.float32
    finite = np.isfinite(back)
    assert np.array_equal(encode_bf16(back[finite]), bits[finite])  # round trip of every finite bf16
    assert np.isnan(back[~finite & (bits & 0x7F != 0)]).all()
    assert np.isnan(decode_bf16(encode_bf16(np.array([np.nan], dtype=np.float32)))).all()


def test_bf16_relative_error_is_at_most_half_an_ulp() -> None:
    x = np.random.default_rng(4).standard_normal(100_000).astype(np.float32)
    err = np.abs(decode_bf16(encode_bf16(x)).astype(np.float64) - x) / np.abs(x)
    assert err.max() <= 2.0**-8


def test_wire_forms_of_each_compression() -> None:
    x = np.linspace(-3, 3, 11, dtype=np.float32)
    for wire, item in ((BF16, 2), ("<f2", 2), ("<f4", 4)):
        enc = to_wire(x, wire)
        assert enc.nbytes == item * x.size
        back = from_wire(enc.data.cast("B"), wire, "<f4")
        assert back.dtype == np.float32
        assert np.allclose(back, x, rtol=2.0**-8)
    assert to_wire(x, "<f4") is x  # nothing encoded, nothing copied


def test_frames_carry_bf16_and_check_its_length() -> None:
    enc = encode_bf16(np.ones(5, dtype=np.float32))
    msg = Message(kind=Kind.DATA_BCAST, src=0, step=1, dtype=BF16, numel=5, signature="float32[5]",
                  payload=enc.data.cast("B"))
    back = decode(b"".join(bytes(b) for b in encode(msg)))
    assert back.dtype == BF16
    assert from_wire(back.payload, BF16, "<f4").tolist() == [1.0] * 5  # type: ignore[arg-type]
    bad = Message(kind=Kind.DATA_BCAST, src=0, step=1, dtype=BF16, numel=4, signature="float32[5]",
                  payload=enc.data.cast("B"))
    with pytest.raises(FrameError, match="does not hold 4 x bf16"):
        decode(b"".join(bytes(b) for b in encode(bad)))


def test_compression_setting_is_checked() -> None:
    assert Config().compression is None
    assert Config.build(compression="bf16").compression == "bf16"
    assert Config.build(compression="int8").compression == "int8"
    with pytest.raises(ConfigError, match="compression must be None, 'bf16', 'fp16' or 'int8'"):
        Config.build(compression="int4")


# ---- the protocol ------------------------------------------------------------------------------

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def run_one_step(world: int, data: list[np.ndarray], *, cuts: tuple[tuple[int, int], ...] = (),
          **kw: object) -> tuple[SimNetwork, list[StepResult]]:
    net = SimNetwork(world, timeout_policy="static", step_timeout_s=10.0, **kw)
    for a, b in cuts:
        net.cut(a, b)
    net.submit_all(0, data)
    net.run()
    outs = [net.outcome(r, 0) for r in range(world)]
    assert all(isinstance(o, StepResult) for o in outs), outs
    return net, outs  # type: ignore[return-value]


def _data(world: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * rng.uniform(0.1, 10)).astype(np.float32) for _ in range(world)]


def _depth(world: int) -> int:
    return max(0, world.bit_length() - 1)


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
@pytest.mark.parametrize(("world", "cuts"), [(7, ()), (7, ((1, 0),)), (15, ((3, 1), (5, 2))), (15, ((3, 1), (1, 0))),
                                             (4, ())])
def test_every_rank_gets_the_same_bits_within_the_bound(compression: str, world: int,
                                                         cuts: tuple[tuple[int, int], ...]) -> None:
    # Each hop rounds once to the wire format (leaf, every interior rank, the root's result), so
    # the error is at most (depth + 2) unit roundoffs of the magnitudes summed, plus float32's own.
    check_same_bits_within(world, cuts, compression,
                           lambda magnitude: (_depth(world) + 2) * UNIT_ROUNDOFF[compression] * magnitude)


def check_same_bits_within(world: int, cuts: tuple[tuple[int, int], ...], compression: str,
                           rounding: Callable[[np.ndarray], np.ndarray]) -> None:
    """Every rank holds the same bits, all contributors, and the exact sum within
    `rounding(the magnitudes summed)` plus float32's own error; and the format did round."""
    data = _data(world, 3000, seed=world)
    _net, outs = run_one_step(world, data, cuts=cuts, compression=compression, chunk_bytes=4096)
    first = outs[0].data.view(np.uint32)
    for o in outs:
        assert np.array_equal(o.data.view(np.uint32), first), "ranks disagree on the bits"
        assert o.contributors == tuple(range(world))
        assert o.data.dtype == np.float32
    exact = np.sum(np.array(data, dtype=np.float64), axis=0)
    magnitude = np.sum(np.abs(np.array(data, dtype=np.float64)), axis=0)
    bound = rounding(magnitude) + world * 2.0**-24 * magnitude
    assert (np.abs(outs[0].data - exact) <= bound).all()
    # ... and it did round: float32 data of this spread does not survive the format
    assert not np.array_equal(outs[0].data, exact.astype(np.float32))


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_half_the_bytes_on_the_wire(compression: str) -> None:
    world, n = 7, 20_000
    data = _data(world, n)
    plain, _ = run_one_step(world, data, chunk_bytes=16_384)
    packed, _ = run_one_step(world, data, chunk_bytes=16_384, compression=compression)
    assert packed.stats.data_bytes == plain.stats.data_bytes // 2


def test_integers_and_doubles_travel_as_they_are() -> None:
    world = 5
    ints = [np.arange(100, dtype=np.int64) * (r + 1) for r in range(world)]
    _, outs = run_one_step(world, ints, compression="bf16")
    assert all(np.array_equal(o.data, sum(ints)) for o in outs)
    doubles = [np.full(10, 1 / 3, dtype=np.float64) * r for r in range(world)]
    _, outs = run_one_step(world, doubles, compression="fp16")
    assert all(o.data.dtype == np.float64 and np.array_equal(o.data, outs[0].data) for o in outs)
    assert np.allclose(outs[0].data, sum(doubles), rtol=1e-15)


def test_integer_valued_data_that_fits_stays_exact() -> None:
    """Small integers are exact in bf16 (8 significant bits): partial sums up to 256 lose nothing."""
    world = 7
    data = [np.full(50, float(r), dtype=np.float32) for r in range(world)]
    _, outs = run_one_step(world, data, compression="bf16")
    assert all(np.array_equal(o.data, np.full(50, 21.0, dtype=np.float32)) for o in outs)


def test_a_crashed_rank_reruns_compressed_and_everyone_agrees() -> None:
    world = 7
    data = _data(world, 2000, seed=9)
    net = SimNetwork(world, compression="bf16", chunk_bytes=2048)
    net.crash(4)
    net.submit_all(0, data)
    net.run_until_finished(0, limit_s=30.0)
    outs = [net.outcome(r, 0) for r in range(world) if r != 4]
    assert all(isinstance(o, StepResult) for o in outs), outs
    results = [o for o in outs if isinstance(o, StepResult)]
    assert len({o.data.tobytes() for o in results}) == 1
    contributors = results[0].contributors
    assert 4 not in contributors
    exact = np.sum(np.array([data[c] for c in contributors], dtype=np.float64), axis=0)
    magnitude = np.sum(np.abs(np.array([data[c] for c in contributors], dtype=np.float64)), axis=0)
    assert (np.abs(results[0].data - exact) <= (_depth(world) + 2) * 2.0**-8 * magnitude * 1.01).all()


# ---- the thesis MLP's gradients ------------------------------------------------------------------


def _mlp_gradients(world: int) -> list[np.ndarray]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    grads = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        x, y = torch.rand(100, 784, generator=g), torch.randint(0, 10, (100,), generator=g)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy())
    return grads


@pytest.mark.parametrize(("compression", "limit"), [("bf16", 4e-3), ("fp16", 5e-4)])
def test_mlp_gradient_error_against_float32(compression: str, limit: float) -> None:
    world = 7
    grads = _mlp_gradients(world)
    assert grads[0].size == 407_050
    _, ref = run_one_step(world, grads)
    _, outs = run_one_step(world, grads, compression=compression)
    f32 = ref[0].data.astype(np.float64)
    got = outs[0].data.astype(np.float64)
    rel_norm = np.linalg.norm(got - f32) / np.linalg.norm(f32)
    cosine = float(got @ f32 / (np.linalg.norm(got) * np.linalg.norm(f32)))
    big = np.abs(f32) > 1e-3 * np.abs(f32).max()
    rel_big = float(np.max(np.abs(got - f32)[big] / np.abs(f32)[big]))
    print(f"\n{compression}: thesis MLP gradients summed over {world} workers: relative L2 error {rel_norm:.2e}, "
          f"cosine {cosine:.7f}, max relative error of the entries above 1e-3 of the largest {rel_big:.2e}")
    assert rel_norm < limit
    assert cosine > 1 - limit


def test_working_arrays_give_the_same_bits() -> None:
    """The pooled forms (an encoder's scratch array, decoding into a given array) are the same
    codec: every bf16 pattern and NaNs of both signs round trip as without them."""
    x = decode_bf16(np.arange(2**16, dtype=np.uint16))
    x[:3] = [np.nan, -np.nan, 1.00390625]
    scratch = np.full(x.size, 0xDEADBEEF, dtype=np.uint32)  # garbage a pool might hold
    assert np.array_equal(encode_bf16(x, scratch), encode_bf16(x))
    bits = encode_bf16(x)
    into = np.full(x.size, 7.0, dtype=np.float32)
    back = decode_bf16(bits, into)
    assert back is into or back.base is into
    assert np.array_equal(into.view(np.uint32), decode_bf16(bits).view(np.uint32))
    half = to_wire(np.linspace(-3, 3, 101, dtype=np.float32), "<f2")
    into16 = np.empty(half.size, dtype=np.float32)
    assert np.array_equal(from_wire(half.data.cast("B"), "<f2", "<f4", into=into16), half.astype(np.float32))


def test_compressed_sums_are_decoded_into_working_arrays_and_the_root_into_its_sum() -> None:
    """Every bf16 sum a rank adds is decoded into a pooled working array (as is its encoder's
    work): a rank with two children takes three per op, a leaf one. The root decodes its
    result into the buffer it summed in, not a fresh array, and all ranks get the same bits."""
    world, n, steps = 7, 40_000, 3  # 160 KB per chunk: pooled working arrays
    net = SimNetwork(world, timeout_policy="static", step_timeout_s=10.0, compression="bf16", chunk_bytes=1 << 20)
    rng = np.random.default_rng(8)
    for step in range(steps):
        net.submit_all(step, [rng.standard_normal(n).astype(np.float32) for _ in range(world)])
    net.run_until_finished(steps - 1)  # the results still linger: the root's are checked below
    outs = [net.outcome(r, s) for r in range(world) for s in range(steps)]
    assert all(isinstance(o, StepResult) for o in outs), outs
    takes = [m.scratch.reused + m.scratch.allocated for m in net.machines]
    assert takes[1] == takes[2] == 3 * steps  # interior: two decodes and one encoding per op
    assert takes[3:] == [steps] * 4  # leaves: their encoding only
    root = net.machines[0]
    for step in range(steps):
        ((_chunk, result, _contributors, _late, _sig),) = root.result_of(step)
        assert any(np.shares_memory(result, buf) for buf in root.buffers.lent), step
    net.run()


def test_a_compressed_root_without_children_leaves_its_contribution_alone() -> None:
    """A lone worker is a root with no children: its result is the decoding of its own
    encoding, in an array of its own. Its contribution is not overwritten with it (a step
    re-run in a new view, after a join, must add the value submitted, not its rounding)."""
    data = np.random.default_rng(9).standard_normal(40_000).astype(np.float32)
    submitted = data.copy()
    machine = TreeMachine(0, View.initial(1), Config(compression="bf16"))
    actions = machine.handle(Submit(step=0, data=submitted, signature="float32[40000]"), 0.0)
    (done,) = [a for a in actions if isinstance(a, Complete)]
    assert np.array_equal(done.result, decode_bf16(encode_bf16(data)))
    assert not np.array_equal(done.result, data)  # it did round
    assert np.array_equal(submitted, data)
    assert not np.shares_memory(done.result, submitted)
