"""Sparse DiLoCo when a worker's training diverges: NaN or Inf in its error-feedback accumulator
meets the allreduce's nonfinite policy as a non-finite dense pseudo-gradient does ("skip": that
worker is left out of the round, starts over from the global parameters and is counted again
the next round; "abort": the round fails on every worker, naming it; "allow": the sum refuses it
by name), instead of zeroing the chunk's shared scale or keeping the worker out for good."""

from __future__ import annotations

import pytest
import torch

import fttree
from tests.conftest import cluster, run_threads
from tests.test_diloco import SETTINGS, H, batch, make_model

WORKERS, ROUNDS, BAD_RANK, BAD_ROUND = 3, 5, 1, 2


def run(nonfinite: str) -> tuple[dict[int, list[tuple[int, ...]]], dict[int, list[torch.Tensor]],
                                 dict[int, torch.Tensor], dict[int, BaseException]]:
    """ROUNDS outer steps of sparse DiLoCo; BAD_RANK's model turns NaN at one coordinate in
    BAD_ROUND's last local step. Returns each rank's contributors per round, its global
    parameters and model at the end, and what each raised."""
    contributors: dict[int, list[tuple[int, ...]]] = {r: [] for r in range(WORKERS)}
    globals_: dict[int, list[torch.Tensor]] = {}
    models: dict[int, torch.Tensor] = {}
    errors: dict[int, BaseException] = {}

    def worker(rank: int, ar: fttree.FTTreeAllreduce) -> None:
        try:
            model = make_model()
            opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H,
                                compression=fttree.Sparse(density=1 / 4, block=8))
            for r in range(ROUNDS):
                for i in range(H):
                    x, y = batch(rank, r * H + i)
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    if rank == BAD_RANK and r == BAD_ROUND and i == H - 1:
                        with torch.no_grad():
                            next(model.parameters())[0, 0] = float("nan")  # the inner training diverged
                    opt.step()
                assert opt.last_step is not None
                contributors[rank].append(opt.last_step.contributors)
            globals_[rank] = [g.clone() for _, g in opt.global_parameters]
            models[rank] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        except BaseException as exc:
            errors[rank] = exc

    with cluster(WORKERS, nonfinite=nonfinite, **SETTINGS) as ars:
        run_threads([lambda r=r: worker(r, ars[r]) for r in range(WORKERS)])  # type: ignore[misc]
    return contributors, globals_, models, errors


def test_skip_leaves_the_diverged_worker_out_of_that_round_only() -> None:
    contributors, globals_, models, errors = run("skip")
    assert errors == {}
    everyone = tuple(range(WORKERS))
    for rank in range(WORKERS):
        rounds = contributors[rank]
        assert rounds[BAD_ROUND] == tuple(r for r in everyone if r != BAD_RANK), rounds
        assert rounds[BAD_ROUND + 1:] == [everyone] * (ROUNDS - BAD_ROUND - 1), rounds  # counted again
        assert all(torch.equal(a, b) for a, b in zip(globals_[rank], globals_[0], strict=True))
        assert all(bool(torch.isfinite(g).all()) for g in globals_[rank])
        assert bool(torch.isfinite(models[rank]).all()), f"rank {rank}'s model is not finite"


def test_abort_fails_the_round_on_every_worker_naming_the_diverged_one() -> None:
    _, _, _, errors = run("abort")
    assert set(errors) == set(range(WORKERS))
    for exc in errors.values():
        assert isinstance(exc, fttree.FTTreeError), repr(exc)
        assert f"rank {BAD_RANK}" in str(exc)
        assert "NaN or Inf" in str(exc)


def test_allow_is_refused_by_the_sum_instead_of_zeroing_a_shared_scale() -> None:
    _, _, _, errors = run("allow")
    assert set(errors) == set(range(WORKERS))
    for exc in errors.values():
        assert isinstance(exc, fttree.FTTreeError), repr(exc)
        assert "error-feedback accumulator held NaN or Inf" in str(exc)


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_an_infinite_accumulator_is_skipped_as_a_nan_one(value: float) -> None:
    from fttree.training.sparse import Sparse, SparseCodec

    glob = [("w", torch.zeros(64))]
    codec = SparseCodec(Sparse(density=1 / 4, block=8), glob, world=3)
    codec.rms.fill_(1.0)  # scales known: a real message
    pseudo = torch.full((64,), 0.5)
    pseudo[3] = value
    codec.encode([pseudo], step=1)
    assert codec.wire.grad is not None
    assert not bool(torch.isfinite(codec.wire.grad).all())  # the allreduce's policy sees it
    assert bool((codec.acc == 0).all())  # and the accumulator starts over
    assert codec.nonfinite_rounds == 1
