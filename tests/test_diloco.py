"""DiLoCo over the fault-tolerant tree, with real workers over TCP (threads of one process):
every rank holds the same global parameters bit for bit after every outer step and the model
is exactly them; the outer step is the averaged pseudo-gradient put through Nesterov SGD; a
worker killed during its local steps is missing from that average; a restarted one takes the
global parameters and the outer momentum from a peer; int8 pseudo-gradients keep all that."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import fttree
from fttree.errors import ConfigError, GroupLeft
from fttree.training.sparse import Sparse
from tests.conftest import cluster, local_peers, run_threads

SETTINGS = dict(timeout_s=0.2, step_timeout_s=10.0)
H = 4  # inner steps per outer step


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()


@dataclass
class Run:
    """What one worker saw after each outer step (by the group's round number)."""

    model: dict[int, str] = field(default_factory=dict)  # digest of the model's parameters
    global_: dict[int, str] = field(default_factory=dict)  # digest of the global parameters
    contributors: dict[int, tuple[int, ...]] = field(default_factory=dict)
    synced_from: int | None = None
    error: BaseException | None = None


def train(rank: int, peers: list[str], run: Run, *, rounds: int, join: bool = False, crash_in: int | None = None,
          compression: str | Sparse | None = None, joiner_rounds: int = 0,
          after_round: Callable[[fttree.DiLoCo, int, bool], None] | None = None) -> None:
    """`rounds` outer steps; with `joiner_rounds`, go on until a joiner has held the global
    parameters for that many (every worker learns it from the same allreduce, so all stop at
    the same outer step). `after_round(opt, round, was_syncing)` records more after each."""
    ar = fttree.FTTreeAllreduce(rank, peers, join=join, **SETTINGS).start()  # type: ignore[arg-type]
    try:
        model = make_model()
        if join:  # a restarted process does not start where the group started
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = fttree.DiLoCo(model, inner, allreduce=ar, sync_every=H, compression=compression)
        opt.sync.next_round()  # a joiner is admitted here
        synced_rounds = 0
        while opt.sync.rounds < rounds or synced_rounds < joiner_rounds:
            r = opt.sync.rounds
            was_syncing = opt.syncing
            for i in range(H):
                if crash_in is not None and r == crash_in and i == H // 2:
                    ar.crash(f"test: rank {rank} killed in its local steps of round {r}")
                x, y = batch(rank, r * H + i)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            assert opt.last_step is not None
            if not opt.syncing:
                run.synced_from = r if run.synced_from is None else run.synced_from
                run.model[r] = digest(list(model.parameters()))
                run.global_[r] = digest([g for _, g in opt.global_parameters])
            if after_round is not None:
                after_round(opt, r, was_syncing)
            run.contributors[r] = opt.last_step.contributors
            if joiner_rounds:
                flag = torch.tensor([1.0 if join and not opt.syncing else 0.0])
                synced_rounds += float(ar.allreduce(flag)[0]) >= 1
    except GroupLeft as exc:
        if crash_in is None:
            run.error = exc
    except BaseException as exc:  # reported by the test
        run.error = exc
    finally:
        ar.close()



def test_every_rank_holds_the_same_global_parameters_and_the_model_is_them() -> None:
    peers = local_peers(3)
    runs = [Run() for _ in range(3)]
    run_threads([lambda r=r: train(r, peers, runs[r], rounds=4) for r in range(3)])  # type: ignore[misc]
    assert [run.error for run in runs] == [None] * 3
    for r in range(4):
        assert len({run.global_[r] for run in runs}) == 1, f"ranks disagree after outer step {r}"
        assert all(run.model[r] == run.global_[r] for run in runs)
        assert all(run.contributors[r] == (0, 1, 2) for run in runs)
    assert len({runs[0].global_[r] for r in range(4)}) == 4  # it trained


def test_an_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient() -> None:
    """One round on 3 workers against the same arithmetic in one process."""
    local = []
    for rank in range(3):  # what each worker's local steps produce from the common start
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        for i in range(H):
            x, y = batch(rank, i)
            inner.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
        local.append([p.detach().clone() for p in model.parameters()])
    start = [p.detach().clone() for p in make_model().parameters()]
    ref = [torch.nn.Parameter(s.clone()) for s in start]
    outer = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for i, g in enumerate(ref):
        g.grad = sum(start[i].double() - local[r][i].double() for r in range(3)).float() / 3
    outer.step()

    got: list[list[torch.Tensor]] = [[] for _ in range(3)]
    models = [make_model() for _ in range(3)]  # here: torch's seed is one for all threads

    def worker(rank: int, ar: fttree.FTTreeAllreduce) -> None:
        model = models[rank]
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H)
        for i in range(H):
            x, y = batch(rank, i)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        got[rank] = [p.detach().clone() for p in model.parameters()]

    with cluster(3, **SETTINGS) as ars:
        run_threads([lambda r=r: worker(r, ars[r]) for r in range(3)])  # type: ignore[misc]
    for rank in range(3):
        for mine, want in zip(got[rank], ref, strict=True):
            assert torch.allclose(mine, want.detach(), rtol=1e-5, atol=1e-6)


def test_a_worker_killed_in_its_local_steps_is_missing_from_that_average() -> None:
    peers = local_peers(4)
    runs = [Run() for _ in range(4)]
    run_threads([lambda r=r: train(r, peers, runs[r], rounds=4, crash_in=2 if r == 3 else None)  # type: ignore[misc]
                 for r in range(4)])
    assert [run.error for run in runs[:3]] == [None] * 3
    for r in range(4):
        assert len({run.global_[r] for run in runs[:3]}) == 1, f"survivors disagree after outer step {r}"
        assert all(run.model[r] == run.global_[r] for run in runs[:3])
    assert runs[0].contributors[1] == (0, 1, 2, 3)
    assert runs[0].contributors[2] == (0, 1, 2)  # it died during round 2
    assert runs[0].contributors[3] == (0, 1, 2)


def test_a_restarted_worker_takes_the_global_parameters_and_matches_bit_for_bit() -> None:
    peers = local_peers(3)
    runs = [Run() for _ in range(3)]
    rejoined = Run()
    killed = threading.Event()

    def member(rank: int) -> None:
        train(rank, peers, runs[rank], rounds=3, joiner_rounds=2)

    def victim() -> None:
        train(2, peers, runs[2], rounds=100, crash_in=1)
        killed.set()

    def restarted() -> None:
        assert killed.wait(60)
        train(2, peers, rejoined, rounds=0, join=True, joiner_rounds=2)

    run_threads([lambda: member(0), lambda: member(1), victim, restarted])
    assert [runs[0].error, runs[1].error, rejoined.error] == [None, None, None]
    assert rejoined.synced_from is not None
    for r, mine in rejoined.global_.items():
        assert mine == runs[0].global_[r] == runs[1].global_[r], f"the restarted worker differs at outer step {r}"
        assert rejoined.model[r] == mine
    last = max(rejoined.global_)
    assert 2 in runs[0].contributors[last]  # it contributes again


def test_int8_pseudo_gradients_keep_every_rank_alike() -> None:
    peers = local_peers(3)
    runs = [Run() for _ in range(3)]
    plain = [Run() for _ in range(3)]
    run_threads([lambda r=r: train(r, peers, runs[r], rounds=3, compression="int8") for r in range(3)])  # type: ignore[misc]
    again = local_peers(3)
    run_threads([lambda r=r: train(r, again, plain[r], rounds=3) for r in range(3)])  # type: ignore[misc]
    assert [run.error for run in runs + plain] == [None] * 6
    for r in range(3):
        assert len({run.global_[r] for run in runs}) == 1
        assert runs[0].model[r] == runs[0].global_[r]
    assert runs[0].global_[2] != plain[0].global_[2]  # it was quantized


def test_bad_settings_are_named() -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with cluster(1, **SETTINGS) as (ar,):
        for kwargs, match in (({"sync_every": 0}, "sync_every must be at least 1"),
                              ({"sync_every": 4, "outer_lr": 0.0}, "outer_lr must be positive"),
                              ({"sync_every": 4, "outer_momentum": 1.0}, "outer_momentum must be in"),
                              ({"sync_every": 4, "compression": "int4"}, "compression must be one of")):
            with pytest.raises(ConfigError, match=match):
                fttree.DiLoCo(model, inner, allreduce=ar, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"takes a torch\.optim\.Optimizer"):
            fttree.DiLoCo(model, object(), allreduce=ar, sync_every=4)  # type: ignore[arg-type]


# ---- overlap: the outer sync behind the next local steps ----------------------------------------


def local_round(opt: torch.optim.Optimizer | fttree.DiLoCo, model: torch.nn.Module, rank: int, r: int) -> None:
    """Round `r`'s H local steps on this rank's batches (`opt` a plain optimizer or a DiLoCo)."""
    for i in range(r * H, r * H + H):
        x, y = batch(rank, i)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_overlap_applies_each_outer_step_one_round_late_on_top_of_the_local_progress() -> None:
    """Two rounds on 3 workers against the same arithmetic in one process: round 0's outer
    step runs while round 1 trains; at round 1's end each worker goes on from the new global
    parameters plus its round-1 progress, and sends that progress as round 1's pseudo-gradient."""
    ends: list[list[list[torch.Tensor]]] = []  # [rank][round] -> parameters at the round's end
    for rank in range(3):
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        ends.append([])
        for r in range(2):
            local_round(inner, model, rank, r)
            ends[rank].append([p.detach().clone() for p in model.parameters()])
    start = [p.detach().clone() for p in make_model().parameters()]
    ref = [torch.nn.Parameter(s.clone()) for s in start]
    outer = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for i, g in enumerate(ref):  # round 0: from the common start
        g.grad = sum(start[i].double() - ends[r][0][i].double() for r in range(3)).float() / 3
    outer.step()
    for i, g in enumerate(ref):  # round 1: each worker's progress over the round
        g.grad = sum(ends[r][0][i].double() - ends[r][1][i].double() for r in range(3)).float() / 3
    outer.step()

    got: list[list[torch.Tensor]] = [[] for _ in range(3)]
    models = [make_model() for _ in range(3)]

    def worker(rank: int, ar: fttree.FTTreeAllreduce) -> None:
        model = models[rank]
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H,
                            overlap=True)
        for r in range(2):
            local_round(opt, model, rank, r)
        opt.flush()
        got[rank] = [p.detach().clone() for p in model.parameters()]
        assert opt.stats.outer_steps == 2
        assert 0 <= opt.stats.waited_s <= opt.stats.sync_s

    with cluster(3, **SETTINGS) as ars:
        run_threads([lambda r=r: worker(r, ars[r]) for r in range(3)])  # type: ignore[misc]
    for rank in range(3):
        assert all(torch.equal(a, b) for a, b in zip(got[rank], got[0], strict=True)), f"rank {rank} differs"
        for mine, want in zip(got[rank], ref, strict=True):
            assert torch.allclose(mine, want.detach(), rtol=1e-5, atol=1e-6)


def test_overlap_with_a_worker_killed_mid_run_keeps_the_survivors_alike() -> None:
    peers = local_peers(4)
    finals: dict[int, str] = {}
    last: dict[int, tuple[int, ...]] = {}
    errors: dict[int, BaseException] = {}

    def worker(rank: int) -> None:
        ar = fttree.FTTreeAllreduce(rank, peers, **SETTINGS).start()  # type: ignore[arg-type]
        try:
            model = make_model()
            opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H,
                                overlap=True)
            for r in range(5):
                if rank == 3 and r == 2:
                    ar.crash("test: rank 3 killed in round 2")
                local_round(opt, model, rank, r)
            opt.flush()
            finals[rank] = digest(list(model.parameters()))
            assert opt.last_step is not None
            last[rank] = opt.last_step.contributors
        except fttree.FTTreeError as exc:  # rank 3 was killed: its steps fail, whichever error says so
            if rank != 3:
                errors[rank] = exc
        except BaseException as exc:
            errors[rank] = exc
        finally:
            ar.close()

    run_threads([lambda r=r: worker(r) for r in range(4)])  # type: ignore[misc]
    assert errors == {}
    assert len({finals[r] for r in range(3)}) == 1
    assert all(last[r] == (0, 1, 2) for r in range(3))
