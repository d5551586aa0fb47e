"""DistributedDataParallel over fttree, both ways: fttree.comm_hook on a gloo group, and the
"fttree" torch.distributed backend. Each test starts 3 worker processes (this file, run as a
script) that train the same small MLP on their slice of the batch; the parent checks the final
parameters against one process training on the whole batch."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

WORLD = 3
# torch._dynamo too: each worker's first optimizer imports it (SGD's add_param_group), about a
# second of CPU per process, paid once in the fork server instead (it starts no thread)
WORKER_IMPORTS = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "fttree")
BATCH = 8
STEPS = 5


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(WORLD * BATCH, 12, generator=g), torch.randint(0, 4, (WORLD * BATCH,), generator=g)


def reference() -> list[torch.Tensor]:
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# ---- worker side (run as a script) --------------------------------------------------------


def train(model: nn.Module, rank: int, device: str = "cpu") -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    for step in range(STEPS):
        x, y = data(step)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[sl].to(device)), y[sl].to(device)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def collectives(rank: int) -> dict[str, Any]:
    """Every collective the backend implements, with results the parent can check."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
        t = torch.full((3, 2), rank + 1, dtype=dtype)
        dist.all_reduce(t)
        out[f"sum_{dtype}"] = t
    t = torch.full((5,), float(rank), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["avg"] = t
    work = dist.all_reduce(torch.ones(4), async_op=True)
    out["async_ok"] = work.wait()
    for dtype in (torch.float32, torch.int32, torch.bool):
        t = torch.arange(4).to(dtype) if rank == 1 else torch.zeros(4, dtype=dtype)
        if dtype == torch.float32 and rank == 1:
            t = torch.tensor([1.5, -2.25, float("inf"), 3e38])
        dist.broadcast(t, src=1)
        out[f"bcast_{dtype}"] = t
    signed = torch.tensor([-0.0, 0.0, -1.0, float("-inf")]) if rank == 2 else torch.full((4,), 7.0)
    dist.broadcast(signed, src=2)  # the source's bits, signed zeros included
    out["bcast_signed_bits"] = signed.view(torch.int32)
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(gathered, torch.tensor([rank, 10 * rank]))
    out["allgather"] = torch.stack(gathered)
    single = torch.zeros(WORLD * 2)
    dist.all_gather_into_tensor(single, torch.tensor([rank + 0.5, -float(rank)]))
    out["allgather_single"] = single
    t = torch.full((2,), float(rank + 1))
    dist.reduce(t, dst=2)
    out["reduce"] = t
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(WORLD * 2, dtype=torch.float32) * (rank + 1))
    out["reduce_scatter"] = rs
    empty = torch.empty(0, 4)
    dist.all_reduce(empty)  # a frozen layer's bucket: nothing to add, no wait
    out["empty_shape"] = tuple(empty.shape)
    dist.barrier()
    t = torch.tensor([float(rank), -float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t
    try:
        dist.send(torch.ones(1), dst=(rank + 1) % WORLD)
    except NotImplementedError as exc:  # at once, on the rank that calls it
        out["send_error"] = str(exc)
    return out


def cuda_collectives(rank: int) -> dict[str, Any]:
    """Collectives on GPU tensors: results must land back in the caller's GPU tensors."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    t = torch.full((3, 2), rank + 1.0, device="cuda")
    dist.all_reduce(t)
    out["sum"] = t.cpu()
    out["sum_device"] = t.device.type
    b = torch.tensor([1.5, float("nan"), 7.0], device="cuda") if rank == 1 else torch.zeros(3, device="cuda")
    dist.broadcast(b, src=1)
    out["bcast"] = b.cpu()
    gathered = [torch.zeros(2, device="cuda") for _ in range(WORLD)]
    dist.all_gather(gathered, torch.tensor([rank, 10.0 * rank], device="cuda"))
    out["allgather"] = torch.stack(gathered).cpu()
    return out


def worker(scenario: str, rank: int, port: int, peers: list[str], outdir: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fttree

    torch.set_num_threads(1)
    if os.environ.get("FTTREE_TEST_LOG"):  # debugging aid: the protocol's notes on stderr
        import logging

        logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)6d rank {rank} %(name)s %(message)s")
    result: dict[str, Any] = {}
    # the test process hosts the store (run_workers): no rank has to start first or stay last
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=120))
    ar = None
    if scenario.startswith("backend"):
        import fttree.training.backend

        dist.init_process_group("fttree", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
        ar = fttree.training.backend.allreduce_of()
        if scenario == "backend":
            result["collectives"] = collectives(rank)
        if scenario == "backend_cuda":
            result["collectives"] = cuda_collectives(rank)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
        ar = fttree.FTTreeAllreduce(rank, peers, timeout_s=0.2, faults=os.environ.get("FTTREE_FAULTS") or None,
                                    step_timeout_s=float(os.environ.get("FTTREE_STEP_TIMEOUT", "30"))).start()
    hidden_mismatch = scenario == "backend_mismatch" and rank == 2
    model = mlp(seed=0 if rank == 0 else 50 + rank)  # DDP must broadcast rank 0's start
    if hidden_mismatch:
        model = nn.Sequential(nn.Linear(12, 17), nn.Tanh(), nn.Linear(17, 4))
    if scenario == "backend_cuda":
        model = model.cuda()
    try:
        ddp = DDP(model)
        if scenario.startswith("hook"):
            ddp.register_comm_hook(ar, fttree.comm_hook)
        result["params"] = [p.cpu() for p in train(ddp, rank, "cuda" if scenario == "backend_cuda" else "cpu")]
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    assert ar is not None
    assert ar.node is not None
    result["recoveries"] = sum(n for kind, n in ar.node.note_counts.items() if kind.value == "recovery")
    torch.save(result, outdir / f"rank{rank}.pt")
    exit_together(store, rank)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: after a failure a peer may already be gone


def exit_together(store: Any, rank: int) -> None:
    """Leave only when every rank is done: closing fttree right after the last step could drop
    results still queued for peers. (The store lives in the test process, which outlasts them.)"""
    if store.add("done", 1) == WORLD:
        store.set("all_done", "1")
    store.wait(["all_done"], timedelta(seconds=60))


# ---- parent side --------------------------------------------------------------------------


def run_workers(scenario: str, tmp_path: Path, env: dict[str, str] | None = None,
                deadline_s: float = 150) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from .conftest import local_peers
    from .procs import run_all

    peers = local_peers(WORLD)
    # The store lives here, for as long as the workers run: a worker that starts late (a loaded
    # machine) finds it whatever the others did meanwhile. Before, rank 0 hosted it, and beside
    # two CPU burners rank 1 once spent its whole 120 s failing to connect to it.
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    args = [scenario, str(store.port), json.dumps(peers), str(tmp_path)]
    # a generous step timeout: on a loaded machine ranks can reach the first step seconds apart
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "FTTREE_STEP_TIMEOUT": "60", **(env or {})}
    # forked from one process that imported torch once: the workers need no fresh interpreter
    logs = run_all([[sys.executable, __file__, str(rank), *args] for rank in range(WORLD)], full_env, deadline_s,
                   preload=WORKER_IMPORTS)
    results = []
    for rank in range(WORLD):
        path = tmp_path / f"rank{rank}.pt"
        others = "".join(f"\n--- rank {r}:\n{logs[r][-1500:]}" for r in range(WORLD) if r != rank)
        assert path.exists(), f"rank {rank} wrote no result; its output:\n{logs[rank][-3000:]}{others}"
        results.append(torch.load(path))
    return results


def assert_trained_like_one_process(results: list[dict[str, Any]]) -> None:
    want = reference()
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}: {res['error']}"
        for i, (got, exp) in enumerate(zip(res["params"], want, strict=True)):
            torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5, msg=lambda m, r=rank, i=i: f"rank {r} p{i}: {m}")


def test_comm_hook_trains_like_one_process(tmp_path: Path) -> None:
    assert_trained_like_one_process(run_workers("hook", tmp_path))


def test_comm_hook_with_a_cut_link(tmp_path: Path) -> None:
    results = run_workers("hook_cut", tmp_path, {"FTTREE_FAULTS": "cut 1-0 @1..2"})
    assert_trained_like_one_process(results)
    assert results[0]["recoveries"] > 0, "the cut link was never worked around"


def test_comm_hook_failure_is_a_clear_error_on_every_worker(tmp_path: Path) -> None:
    results = run_workers("hook_fail", tmp_path, {"FTTREE_FAULTS": "isolate 2 @1..", "FTTREE_STEP_TIMEOUT": "2"})
    for rank, res in enumerate(results):
        err = res.get("error", "")
        assert f"fttree rank {rank}, DDP gradient bucket 0" in err, f"rank {rank}: {err or 'no error'}"
        # the isolated rank learns it is a minority of one (GroupLeft, a StepAborted); the others' step aborts
        assert "StepAborted: step " in err or "GroupLeft: step " in err, f"rank {rank}: {err}"


def test_backend_collectives_and_ddp(tmp_path: Path) -> None:
    results = run_workers("backend", tmp_path)
    assert_trained_like_one_process(results)
    for rank, res in enumerate(results):
        c = res["collectives"]
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
            assert torch.equal(c[f"sum_{dtype}"], torch.full((3, 2), 6, dtype=dtype)), (rank, dtype)
        assert torch.equal(c["avg"], torch.full((5,), 1.0, dtype=torch.float64))
        assert c["async_ok"] is True
        assert torch.equal(c["bcast_torch.float32"], torch.tensor([1.5, -2.25, float("inf"), 3e38]))
        assert torch.equal(c["bcast_torch.int32"], torch.arange(4, dtype=torch.int32))
        assert torch.equal(c["bcast_torch.bool"], torch.arange(4).bool())
        assert torch.equal(c["allgather"], torch.tensor([[0, 0], [1, 10], [2, 20]]))
        assert torch.equal(c["allgather_single"].view(torch.int32),  # to the bit: rank 0 sent -0.0
                           torch.tensor([0.5, -0.0, 1.5, -1.0, 2.5, -2.0]).view(torch.int32))
        assert torch.equal(c["bcast_signed_bits"], torch.tensor([-0.0, 0.0, -1.0, float("-inf")]).view(torch.int32))
        if rank == 2:
            assert torch.equal(c["reduce"], torch.full((2,), 6.0))
        assert torch.equal(c["reduce_scatter"], torch.tensor([2.0 * rank, 2.0 * rank + 1]) * 6)
        assert c["empty_shape"] == (0, 4)
        assert torch.equal(c["max"], torch.tensor([2.0, 0.0]))
        assert "send is not supported" in c["send_error"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_backend_on_cuda_tensors(tmp_path: Path) -> None:  # pragma: no cover - needs a GPU
    results = run_workers("backend_cuda", tmp_path)
    assert_trained_like_one_process(results)
    for res in results:
        c = res["collectives"]
        assert c["sum_device"] == "cuda"
        assert torch.equal(c["sum"], torch.full((3, 2), 6.0))
        torch.testing.assert_close(c["bcast"], torch.tensor([1.5, float("nan"), 7.0]), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(c["allgather"], torch.tensor([[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]]))


def test_backend_ddp_with_a_cut_link(tmp_path: Path) -> None:
    results = run_workers("backend_cut", tmp_path, {"FTTREE_FAULTS": "cut 1-0 @4..7", "FTTREE_TIMEOUT": "0.2"})
    assert_trained_like_one_process(results)
    assert results[0]["recoveries"] > 0, "the cut link was never worked around"


def test_backend_mismatched_models_fail_on_every_worker(tmp_path: Path) -> None:
    """DDP's own shape check (an allgather on the backend) stops rank 2; the others learn of it
    when rank 2 never joins the next collective, by the root's abort, not by a hang. Rank 2's
    node lives on and says it has not submitted yet: the others wait for it submit_wait_s."""
    results = run_workers("backend_mismatch", tmp_path, {"FTTREE_STEP_TIMEOUT": "4", "FTTREE_SUBMIT_WAIT": "6"})
    errors = [res.get("error", "") for res in results]
    assert "sizes [17, 12] appears not to match" in errors[2], errors[2]
    for rank in (0, 1):
        assert "StepAborted" in errors[rank], f"rank {rank}: {errors[rank] or 'no error'}"
        assert "no contribution from ranks [2]" in errors[rank], errors[rank]


if __name__ == "__main__":
    _rank, _scenario, _port, _peers, _outdir = sys.argv[1:6]
    worker(_scenario, int(_rank), int(_port), json.loads(_peers), Path(_outdir))
