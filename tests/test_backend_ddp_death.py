"""Unmodified DDP on the "fttree" backend when a rank dies mid-run (3 worker processes, this
file run as a script; rank 2 exits before its third step). With fttree.comm_hook registered
(state None: the backend's own handle) each step's gradient is the mean over the ranks it
holds, as one process training on the survivors' slices would compute it. Without the hook,
DDP's reducer divides the survivors' sum by the world size: the backend cannot tell DDP's sum
from any other, so it counts each such sum in the process group's `partial_sums` and warns
once, naming the hook; the test pins down that average too, so the docs' claim is checked."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

if __package__ in (None, ""):  # run as a worker script: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_torch_ddp import BATCH, STEPS, WORKER_IMPORTS, WORLD, data, mlp

DEATH = 2  # rank 2 exits before this step
VICTIM = 2


def expected(contributors: list[list[int]], divide_by_world: bool) -> list[torch.Tensor]:
    """One process: each step's loss is the mean over the contributors' slices; DDP's
    default reducer scales it by contributors / world (the survivors' sum over the world)."""
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    for step, who in enumerate(contributors):
        x, y = data(step)
        rows = torch.cat([torch.arange(r * BATCH, (r + 1) * BATCH) for r in who])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        (loss * (len(who) / WORLD if divide_by_world else 1.0)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# ---- worker side (run as a script) --------------------------------------------------------


def worker(scenario: str, rank: int, port: int, outdir: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fttree
    from fttree.training.backend import FTTreeProcessGroup, allreduce_of

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("fttree", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    ar = allreduce_of()
    ddp = DDP(mlp(0))
    if scenario == "hook":
        ddp.register_comm_hook(None, fttree.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.5)
    contributors = []
    for step in range(STEPS):
        if rank == VICTIM and step == DEATH:
            os._exit(0)  # dies as a killed process does: no goodbye, its connections reset
        x, y = data(step)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[sl]), y[sl]).backward()
        opt.step()
        assert ar.last is not None
        contributors.append(sorted(ar.last.contributors))
    group = dist.group.WORLD
    assert isinstance(group, FTTreeProcessGroup)
    torch.save({"params": [p.detach().clone() for p in ddp.module.parameters()], "contributors": contributors,
                "partial_sums": group.partial_sums}, outdir / f"rank{rank}.pt")
    if store.add("done", 1) == WORLD - 1:  # leave together: a result may still be queued for a peer
        store.set("all_done", "1")
    store.wait(["all_done"], timedelta(seconds=60))
    sys.stdout.flush()
    os._exit(0)


# ---- parent side --------------------------------------------------------------------------


def run(scenario: str, tmp_path: Path) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from .procs import run_all

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FTTREE_TIMEOUT": "0.2", "FTTREE_STEP_TIMEOUT": "60"}
    logs = run_all([[sys.executable, __file__, scenario, str(rank), str(store.port), str(tmp_path)]
                    for rank in range(WORLD)], env, 150, preload=WORKER_IMPORTS)  # imports once, ranks forked
    out = []
    for rank in range(WORLD):
        path = tmp_path / f"rank{rank}.pt"
        if rank == VICTIM:
            assert not path.exists()
            continue
        assert path.exists(), f"rank {rank} wrote no result; its output:\n{logs[rank][-3000:]}"
        out.append(torch.load(path))
    return out


@pytest.mark.parametrize("scenario", ["hook", "plain"])
def test_ddp_on_the_backend_after_a_rank_died(tmp_path: Path, scenario: str) -> None:
    survivors = run(scenario, tmp_path)
    every, left = list(range(WORLD)), [r for r in range(WORLD) if r != VICTIM]
    for res in survivors:
        assert res["contributors"] == [every] * DEATH + [left] * (STEPS - DEATH), res["contributors"]
    want = expected(survivors[0]["contributors"], divide_by_world=scenario == "plain")
    for res in survivors:
        for got, exp in zip(res["params"], want, strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)
        # the hook's steps are the FTTreeAllreduce's, not the process group's sums
        assert res["partial_sums"] == (0 if scenario == "hook" else STEPS - DEATH), res["partial_sums"]


if __name__ == "__main__":
    _scenario, _rank, _port, _outdir = sys.argv[1:5]
    worker(_scenario, int(_rank), int(_port), Path(_outdir))
