"""Sparse, low-bit DiLoCo pseudo-gradients (fttree.training.sparse): the packed fields sum
exactly in any order, every worker chooses the same indices and scales from shared state, what
a worker does not send stays in its accumulator, and over real workers (threads of one process,
TCP on loopback) every rank holds the same global parameters bit for bit after every outer
step, through a worker killed and restarted (whose accumulator starts empty)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

import fttree
from fttree.errors import ConfigError, FTTreeError
from fttree.training.sparse import LEVEL_MAX, LEVEL_ZERO, Sparse, SparseCodec, block_levels, field_bits, pack, unpack
from tests.conftest import cluster, local_peers, run_threads
from tests.test_diloco import SETTINGS, H, Run, batch, digest, make_model
from tests.test_diloco import train as dense_train

RULES = ("random", "momentum", "energy")


def globals_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


# ---- the arithmetic, in one process ---------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packed_fields_of_every_worker_sum_exactly_in_any_order(bits: int) -> None:
    world = 7
    levels = 2 ** (bits - 1) - 1
    width = field_bits(levels, world)
    per_word = 53 // width
    gen = torch.Generator().manual_seed(bits)
    fields = [torch.randint(0, 2 * levels + 1, (1000,), generator=gen) for _ in range(world)]
    fields[0][:10] = 2 * levels  # the largest sum a field must hold
    for f in fields[1:]:
        f[:10] = 2 * levels
    words = -(-1000 // per_word)
    packed = [pack(f, width, per_word, words) for f in fields]
    forward = sum(packed[1:], packed[0].clone())
    backward = sum(reversed(packed[:-1]), packed[-1].clone())  # another order of the tree's hops
    assert torch.equal(forward, backward)
    assert torch.equal(unpack(forward, width, per_word, 1000), torch.stack(fields).sum(dim=0))


def codecs(config: Sparse, world: int) -> list[SparseCodec]:
    return [SparseCodec(config, globals_of(make_model()), world) for _ in range(world)]


def pseudo_of(rank: int, codec: SparseCodec, scale: float = 1e-2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(t.shape, generator=g) * scale for t in codec.globals]


def one_round(cs: list[SparseCodec], step: int, pseudos: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    for c, p in zip(cs, pseudos, strict=True):
        c.encode(p, step)
    total = sum((c.wire.grad for c in cs if c.wire.grad is not None), torch.zeros_like(cs[0].wire))
    return [c.decode(total, step) for c in cs]


@pytest.mark.parametrize("rule", RULES)
def test_the_sum_is_the_mean_of_what_each_sent_and_the_rest_stays_in_the_accumulator(rule: str) -> None:
    config = Sparse(density=1 / 16, bits=3, index=rule, block=16)
    cs = codecs(config, 3)
    pseudos = [pseudo_of(r, cs[r]) for r in range(3)]
    one_round(cs, 0, pseudos)  # round 0: no scale known yet, nothing is sent
    assert all(float(c.rms.min()) > 0 for c in cs)
    assert all(torch.equal(c.rms, cs[0].rms) for c in cs)
    for c, p in zip(cs, pseudos, strict=True):  # all of it waits in the accumulator
        assert torch.allclose(c.acc.view(-1)[:c.numel], torch.cat([t.reshape(-1) for t in p]))
    # the next round's distance from the global parameters: what was kept plus new progress
    pseudos = [[t + d for t, d in zip(c.residuals(), pseudo_of(10 + r, c), strict=True)] for r, c in enumerate(cs)]
    got = one_round(cs, 1, pseudos)
    assert all(all(torch.equal(a, b) for a, b in zip(g, got[0], strict=True)) for g in got)  # alike everywhere
    mean = torch.zeros(cs[0].padded)
    for c, p in zip(cs, pseudos, strict=True):
        had = torch.zeros(c.padded)
        had[:c.numel] = torch.cat([t.reshape(-1) for t in p])
        sent = had - c.acc.view(-1)  # what this worker took out of its accumulator
        assert int((sent != 0).sum()) <= c.values  # only the round's shared coordinates
        mean += sent / 3
    dense = torch.cat([t.reshape(-1) for t in got[0]])
    assert torch.allclose(dense, mean[:cs[0].numel], atol=1e-7)
    assert int((dense != 0).sum()) > 0
    idx, _, _ = cs[0].plan(1)
    assert all(torch.equal(c.plan(1)[0], idx) for c in cs)  # the same index set on every worker


def test_random_indices_change_every_round_and_reach_every_coordinate() -> None:
    config = Sparse(density=1 / 8, bits=2, index="random", block=8)
    c = codecs(config, 2)[0]
    seen = torch.zeros(c.padded, dtype=torch.bool)
    plans = []
    for step in range(160):  # a coordinate missed in 160 draws of 1/8: (7/8)**160, 5e-10
        idx = c.plan(step)[0]
        plans.append(idx)
        seen[idx] = True
    assert not torch.equal(plans[0], plans[1])
    assert bool(seen[:c.numel].all())
    assert not bool(seen[c.numel:].any())  # padding is never chosen


def test_the_momentum_rule_takes_the_largest_outer_momentum_in_each_chunk() -> None:
    config = Sparse(density=1 / 8, bits=2, index="momentum", block=8)
    c = codecs(config, 2)[0]
    momentum = [torch.zeros_like(t) for t in c.globals]
    flat = torch.zeros(c.numel)
    flat[torch.arange(0, c.numel, 97)] = 5.0  # one large coordinate in every 97
    offset = 0
    for m in momentum:
        m.view(-1).copy_(flat[offset:offset + m.numel()])
        offset += m.numel()
    c.momentum = lambda: momentum
    idx = c.plan(3)[0]
    chosen = torch.zeros(c.padded, dtype=torch.bool)
    chosen[idx] = True
    large = torch.zeros(c.padded, dtype=torch.bool)
    large[:c.numel] = flat > 0
    per_chunk = large.view(c.chunks, c.chunk).sum(dim=1)
    assert bool((per_chunk <= c.k // 2).all())  # so every large one fits in the top half
    assert bool(chosen[large].all())
    c.momentum = lambda: None  # before the first outer step there is no momentum: random
    assert not torch.equal(c.plan(4)[0], idx)


def test_the_energy_rule_sends_the_blocks_with_the_most_unsent_progress_and_then_others() -> None:
    config = Sparse(density=1 / 8, bits=4, index="energy", block=16)
    cs = codecs(config, 3)
    c0 = cs[0]
    loud = torch.arange(0, c0.chunks, 9)[:c0.picked]  # these blocks carry 3x the others' progress
    assert 0 < len(loud) <= c0.picked

    def pseudos(seed: int) -> list[list[torch.Tensor]]:
        out = []
        for r, c in enumerate(cs):
            flat = torch.randn(c.padded, generator=torch.Generator().manual_seed(seed + r)) * 1e-4
            flat.view(c.chunks, c.chunk)[loud] *= 3
            flat[c.numel:] = 0
            parts, offset = [], 0
            for t in c.globals:
                parts.append(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
            out.append(parts)
        return out

    one_round(cs, 0, pseudos(0))  # round 0: no level known yet, nothing is sent, the levels are learnt
    assert all(torch.equal(c.rms, c0.rms) for c in cs)
    assert float(c0.rms[loud].min()) > float(c0.rms.max()) - 1  # loud blocks report the highest levels
    idx = c0.plan(1)[0]
    blocks = torch.unique(idx // c0.chunk)
    assert len(blocks) == c0.picked
    assert len(idx) == c0.values
    assert set(loud.tolist()) <= set(blocks.tolist())
    before = [c.acc.clone() for c in cs]
    grown = [[t + d for t, d in zip(c.residuals(), p, strict=True)] for c, p in zip(cs, pseudos(10), strict=True)]
    one_round(cs, 1, grown)
    for c, b in zip(cs, before, strict=True):  # what was sent came out of the loud blocks' accumulators
        assert float(c.acc[loud].norm()) < 0.5 * float(b[loud].norm())
    later = torch.unique(c0.plan(2)[0] // c0.chunk)
    assert not set(loud.tolist()) <= set(later.tolist())  # a block just sent waits until it has grown again


def test_energy_levels_are_half_octaves_of_what_a_worker_keeps() -> None:
    acc = torch.zeros(4, 8)
    acc[1] = 1.0  # RMS 1: level 100
    acc[2] = 2.0 ** -10  # level 80
    acc[3] = 1e30  # beyond the top: level 127
    assert block_levels(acc).tolist() == [0, LEVEL_ZERO, LEVEL_ZERO - 20, LEVEL_MAX]


def test_workers_that_disagree_on_the_index_set_are_told() -> None:
    a = SparseCodec(Sparse(index="random", block=16, seed=1), globals_of(make_model()), 2)
    b = SparseCodec(Sparse(index="random", block=16, seed=2), globals_of(make_model()), 2)
    for c in (a, b):
        c.rms.fill_(1e-2)
    with pytest.raises(FTTreeError, match="different index sets"):
        one_round([a, b], 0, [pseudo_of(0, a), pseudo_of(1, b)])


def test_bad_sparse_settings_are_named() -> None:
    for kwargs, match in (({"density": 0.0}, "density must be in"), ({"bits": 8}, "bits must be one of"),
                          ({"index": "topk"}, "index must be one of"), ({"block": 0}, "block must be at least")):
        with pytest.raises(ConfigError, match=match):
            Sparse(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="more than a float64 holds"):
        SparseCodec(Sparse(bits=4), globals_of(make_model()), 2**50)


# ---- real workers ---------------------------------------------------------------------------


@dataclass
class SparseRun(Run):
    kept: dict[int, str] = field(default_factory=dict)  # digest of the global parameters less the accumulator


def train(rank: int, peers: list[str], run: SparseRun, *, rounds: int, compression: Sparse, join: bool = False,
          crash_in: int | None = None, joiner_rounds: int = 0, acc_at_sync: list[float] | None = None) -> None:
    """tests/test_diloco.py's train, sparse: it also records the global parameters less the
    accumulator, and `acc_at_sync` gets the accumulator's norm when a joiner's state arrives."""
    def after_round(opt: fttree.DiLoCo, r: int, was_syncing: bool) -> None:
        sparse = opt._sparse
        assert sparse is not None
        if was_syncing and not opt.syncing and acc_at_sync is not None:
            acc_at_sync.append(float(sparse.codec.acc.norm()))
        if not opt.syncing:
            kept = sparse.codec.residuals()
            run.kept[r] = digest([g - k for (_, g), k in zip(opt.global_parameters, kept, strict=True)])

    dense_train(rank, peers, run, rounds=rounds, join=join, crash_in=crash_in, compression=compression,
                joiner_rounds=joiner_rounds, after_round=after_round)


@pytest.mark.parametrize("rule", RULES)
def test_every_rank_holds_the_same_global_parameters_after_every_sparse_outer_step(rule: str) -> None:
    peers = local_peers(3)
    runs = [SparseRun() for _ in range(3)]
    config = Sparse(density=1 / 8, bits=2, index=rule, block=32)
    run_threads([lambda r=r: train(r, peers, runs[r], rounds=5, compression=config)  # type: ignore[misc]
                 for r in range(3)])
    assert [run.error for run in runs] == [None] * 3
    for r in range(5):
        assert len({run.global_[r] for run in runs}) == 1, f"ranks disagree after outer step {r}"
        assert all(run.model[r] == run.kept[r] for run in runs)  # the model keeps what it has not sent
        assert all(run.contributors[r] == (0, 1, 2) for run in runs)
    assert len({run.model[4] for run in runs}) == 3  # ...which is each worker's own
    assert len({runs[0].global_[r] for r in range(1, 5)}) == 4  # from round 1 on every step moves them


def test_a_restarted_worker_matches_bit_for_bit_and_its_accumulator_starts_empty() -> None:
    peers = local_peers(3)
    runs = [SparseRun() for _ in range(3)]
    rejoined = SparseRun()
    killed = threading.Event()
    acc: list[float] = []
    config = Sparse(density=1 / 8, bits=3, index="momentum", block=32)

    def member(rank: int) -> None:
        train(rank, peers, runs[rank], rounds=3, compression=config, joiner_rounds=2)

    def victim() -> None:
        train(2, peers, runs[2], rounds=100, compression=config, crash_in=1)
        killed.set()

    def restarted() -> None:
        assert killed.wait(60)
        train(2, peers, rejoined, rounds=0, compression=config, join=True, joiner_rounds=2, acc_at_sync=acc)

    run_threads([lambda: member(0), lambda: member(1), victim, restarted])
    assert [runs[0].error, runs[1].error, rejoined.error] == [None, None, None]
    assert rejoined.synced_from is not None
    assert acc == [0.0]  # nothing of the rounds it waited through, nothing of a peer's
    for r, mine in rejoined.global_.items():
        assert mine == runs[0].global_[r] == runs[1].global_[r], f"the restarted worker differs at outer step {r}"
        assert rejoined.model[r] == rejoined.kept[r]
    last = max(rejoined.global_)
    assert 2 in runs[0].contributors[last]


def test_sparse_sends_a_fraction_of_int8s_bytes() -> None:
    """The wire vector's size against int8's dense pseudo-gradient, for a model of 10M values."""
    model = torch.nn.Linear(3200, 3125)  # 10,003,125 parameters
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    numel = sum(p.numel() for _, p in named)
    int8 = numel + 4 * -(-numel // 256)
    # "energy" also reports a level per block of 256: about 1/200 of int8's bytes on top
    for config, most in ((Sparse(), 1 / 16), (Sparse(bits=4), 1 / 8), (Sparse(density=1 / 64), 1 / 48),
                         (Sparse(index="random"), 1 / 16), (Sparse(density=1 / 64, index="random"), 1 / 64)):
        codec = SparseCodec(config, named, 7)
        assert codec.wire_bytes <= int8 * most, (config, codec.wire_bytes / int8)


def test_sparse_is_named_among_the_compressions() -> None:
    model = make_model()
    with cluster(1, **SETTINGS) as (ar,):
        with pytest.raises(ConfigError, match="sparse"):
            fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), allreduce=ar, sync_every=4,
                          compression="int4")
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), allreduce=ar, sync_every=4,
                            compression="sparse")
        assert opt._sparse is not None
        assert opt._sparse.codec.config == Sparse()


def test_an_empty_contribution_sends_zeros_and_keeps_the_accumulator() -> None:
    config = Sparse(density=1 / 8, bits=2, block=16)
    cs = codecs(config, 2)
    one_round(cs, 0, [pseudo_of(r, cs[r]) for r in range(2)])  # learns the scales
    kept = cs[1].acc.clone()
    cs[0].encode(pseudo_of(5, cs[0]), 1)
    cs[1].encode(None, 1)
    assert cs[1].wire.grad is not None
    assert not bool(cs[1].wire.grad.any())
    assert torch.equal(cs[1].acc, kept)
    total = cs[0].wire.grad + cs[1].wire.grad  # type: ignore[operator]
    assert round(float(total[cs[0].count_at])) == 1  # an average over the one worker that sent
    got = cs[1].decode(total, 1)
    assert any(bool(t.any()) for t in got)


def test_values_the_sum_left_out_go_back_into_the_accumulator() -> None:
    config = Sparse(density=1 / 8, bits=4, index="random", block=16)  # scales as RMS: set by hand below
    (c,) = codecs(config, 1)
    c.rms.fill_(1e-2)
    pseudo = pseudo_of(0, c)
    c.encode(pseudo, 0)
    assert not torch.equal(c.acc.view(-1)[:c.numel], torch.cat([t.reshape(-1) for t in pseudo]))
    c.left_out()
    assert torch.equal(c.acc.view(-1)[:c.numel], torch.cat([t.reshape(-1) for t in pseudo]))


def test_loading_a_checkpoint_starts_the_accumulator_and_the_scales_over() -> None:
    model = make_model()
    with cluster(1, **SETTINGS) as (ar,):
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H,
                            compression=Sparse(density=1 / 8, block=32))
        assert opt._sparse is not None
        for step in range(3 * H):
            x, y = batch(0, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        codec = opt._sparse.codec
        assert float(codec.acc.norm()) > 0
        assert float(codec.rms.norm()) > 0
        opt.load_state_dict(opt.state_dict())
        assert float(codec.acc.norm()) == 0
        assert float(codec.rms.norm()) == 0
        assert all(torch.equal(p, g) for p, (_, g) in zip(model.parameters(), opt.global_parameters, strict=True))


def test_overlap_keeps_the_global_parameters_alike_and_the_model_is_them_less_the_accumulator() -> None:
    """Sparse with the outer step behind the next round: the model goes on from the new global
    parameters less what the worker has not sent, plus its progress since."""
    peers = local_peers(3)
    finals: dict[int, tuple[str, str, str]] = {}
    errors: dict[int, BaseException] = {}

    def worker(rank: int) -> None:
        ar = fttree.FTTreeAllreduce(rank, peers, **SETTINGS).start()  # type: ignore[arg-type]
        try:
            with lock:
                model = make_model()
            opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H,
                                overlap=True, compression=Sparse(density=1 / 8, block=32))
            assert opt._sparse is not None
            for step in range(5 * H):
                x, y = batch(rank, step)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            opt.flush()
            kept = opt._sparse.codec.residuals()
            finals[rank] = (digest([g for _, g in opt.global_parameters]), digest(list(model.parameters())),
                            digest([g - k for (_, g), k in zip(opt.global_parameters, kept, strict=True)]))
            assert opt.stats.outer_steps == 5
        except BaseException as exc:
            errors[rank] = exc
        finally:
            ar.close()

    lock = threading.Lock()
    run_threads([lambda r=r: worker(r) for r in range(3)])  # type: ignore[misc]
    assert errors == {}
    assert len({finals[r][0] for r in range(3)}) == 1
    assert all(finals[r][1] == finals[r][2] for r in range(3))
    assert finals[0][0] != digest([p for p in make_model().parameters()])  # it trained
