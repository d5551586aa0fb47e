"""DiLoCo's eager outer step (overlap="eager"): the outer step runs behind the next round and each
worker goes on from the global parameters plus its eager correction (its own pseudo-gradient
standing in for its term of the average in flight). Against the paper's per-worker arithmetic
in one process; the global parameters alike bit for bit on every worker after every outer step;
a worker process killed mid-run leaves the others alike; bad settings refused by name."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import fttree
from fttree.errors import ConfigError
from tests.conftest import cluster, local_peers, run_threads
from tests.procs import run_all
from tests.test_diloco import SETTINGS, H, local_round, make_model

WORKERS, ROUNDS = 3, 3
LR, MU = 0.7, 0.9  # DiLoCo's default outer SGD, Nesterov


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()


def paper_reference() -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[list[torch.Tensor]]]:
    """The eager update as the paper writes it, in one process: worker k keeps its own
    parameters and its own outer Nesterov SGD, stepped at each round's end with
    avg(t-1) + (own(t) - own(t-1)) / M (at the first round own(0) / M); the global parameters
    take the averages only. Returns each worker's model after the last round (before flush),
    the global parameters then (the last average still in flight), and each worker's model as
    overlap=True would leave it (the global parameters plus its last round's progress)."""
    start = [p.detach().clone() for p in make_model().parameters()]
    glob = [torch.nn.Parameter(s.clone()) for s in start]
    shared = torch.optim.SGD(glob, lr=LR, momentum=MU, nesterov=True)
    theta = [[torch.nn.Parameter(s.clone()) for s in start] for _ in range(WORKERS)]
    own_opt = [torch.optim.SGD(t, lr=LR, momentum=MU, nesterov=True) for t in theta]
    previous: list[list[torch.Tensor]] | None = None
    pending: list[torch.Tensor] | None = None
    progress: list[list[torch.Tensor]] = []
    for r in range(ROUNDS):
        own, progress = [], []
        for k in range(WORKERS):
            model = make_model()
            with torch.no_grad():
                for p, t in zip(model.parameters(), theta[k], strict=True):
                    p.copy_(t)
            local_round(torch.optim.SGD(model.parameters(), lr=0.05), model, k, r)
            own.append([t.detach() - p.detach() for t, p in zip(theta[k], model.parameters(), strict=True)])
            progress.append([-d for d in own[k]])
        if pending is not None:  # the previous round's average lands
            for g, a in zip(glob, pending, strict=True):
                g.grad = a.clone()
            shared.step()
        for k in range(WORKERS):
            for i, t in enumerate(theta[k]):
                mixed = own[k][i] / WORKERS
                if previous is not None and pending is not None:
                    mixed = pending[i] + (own[k][i] - previous[k][i]) / WORKERS
                t.grad = mixed
            own_opt[k].step()
        pending = [sum(own[k][i].double() for k in range(WORKERS)).float() / WORKERS for i in range(len(start))]
        previous = own
    overlap = [[g.detach() + d for g, d in zip(glob, progress[k], strict=True)] for k in range(WORKERS)]
    return [[t.detach().clone() for t in th] for th in theta], [g.detach().clone() for g in glob], overlap


def test_eager_follows_the_papers_update_and_keeps_the_global_parameters_alike() -> None:
    want, glob_before, overlap_model = paper_reference()
    models = [make_model() for _ in range(WORKERS)]
    got: dict[int, list[torch.Tensor]] = {}
    flushed: dict[int, list[torch.Tensor]] = {}
    globals_after: dict[int, list[str]] = {k: [] for k in range(WORKERS)}

    def worker(rank: int, ar: fttree.FTTreeAllreduce) -> None:
        model = models[rank]
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H,
                            overlap="eager")
        opt.outer_listeners.append(lambda o: globals_after[rank].append(digest([g for _, g in o.global_parameters])))
        for r in range(ROUNDS):
            local_round(opt, model, rank, r)
        got[rank] = [p.detach().clone() for p in model.parameters()]
        opt.flush()
        flushed[rank] = [p.detach().clone() for p in model.parameters()]
        assert opt.stats.outer_steps == ROUNDS

    with cluster(WORKERS, **SETTINGS) as ars:
        run_threads([lambda r=r: worker(r, ars[r]) for r in range(WORKERS)])  # type: ignore[misc]
    # every outer step left the same global parameters on every worker, bit for bit
    assert all(len(globals_after[k]) == ROUNDS for k in range(WORKERS))
    assert len({tuple(globals_after[k]) for k in range(WORKERS)}) == 1
    for k in range(WORKERS):
        assert all(torch.equal(a, b) for a, b in zip(flushed[k], flushed[0], strict=True))
        for mine, ref in zip(got[k], want[k], strict=True):
            # the paper's worker, to float32 rounding of the tree's sums
            assert torch.allclose(mine, ref, rtol=1e-4, atol=1e-5), (k, float((mine - ref).abs().max()))
        # ...and not what dropping the correction (the bare global parameters) or overlap=True gives
        for other in (glob_before, overlap_model[k]):
            far = max(float((mine - o).abs().max()) for mine, o in zip(got[k], other, strict=True))
            near = max(float((mine - ref).abs().max()) for mine, ref in zip(got[k], want[k], strict=True))
            assert far > 100 * max(near, 1e-6), (k, far, near)


def test_bad_overlap_values_are_refused_by_name() -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 32), torch.randint(0, 4, (8,)))
    with cluster(1, **SETTINGS) as (ar,):
        for bad in ("Eager", "delayed", 1, None):
            with pytest.raises(ConfigError, match=r"overlap must be one of \(False, True, 'eager'\)"):
                fttree.DiLoCo(model, inner, allreduce=ar, sync_every=4, overlap=bad)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match=r"overlap must be one of"):
                fttree.ElasticJob(model, inner, data, batch_size=2, allreduce=ar, diloco=4,
                                  overlap=bad)  # type: ignore[arg-type]
        # eager with sparse is built (tests/test_diloco_eager_sparse.py); the refusals below stay
        assert fttree.DiLoCo(model, inner, allreduce=ar, sync_every=4, overlap="eager", compression="sparse").eager
        with pytest.raises(ConfigError, match="overlap='eager' overlaps DiLoCo's outer steps: it needs diloco"):
            fttree.ElasticJob(model, inner, data, batch_size=2, allreduce=ar, overlap="eager")


def test_elastic_job_refuses_checkpoints_and_joins_with_eager(tmp_path: Path) -> None:
    """An eager round's outer step is in flight while the next trains, as with overlap=True: no
    step boundary holds a model matching the committed samples, and a joiner could not tell
    when an epoch ends."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 32), torch.randint(0, 4, (8,)))
    with cluster(1, **SETTINGS) as (ar,):
        for compression in (None, "sparse"):  # sparse compression changes neither
            with pytest.raises(ConfigError, match="checkpoint_dir with overlap='eager'"):
                fttree.ElasticJob(model, inner, data, batch_size=2, allreduce=ar, diloco=4, overlap="eager",
                                  checkpoint_dir=tmp_path, compression=compression)
            with pytest.raises(ConfigError, match="joins=True with overlap='eager'"):
                fttree.ElasticJob(model, inner, data, batch_size=2, allreduce=ar, diloco=4, overlap="eager",
                                  joins=True, compression=compression)


@pytest.mark.parametrize("compression", [None, "sparse"])
def test_a_killed_worker_process_leaves_the_others_alike_with_eager(compression: str | None) -> None:
    """Four worker processes; rank 3 kills itself (SIGKILL) in round 2's local steps. The
    three others finish every round, and hold the same global parameters bit for bit, with the
    last outer steps' average over the three of them (sparse: each model is then the global
    parameters less what that worker has not sent)."""
    peers = ",".join(local_peers(4))
    worker = str(Path(__file__).resolve().parent / "eager_worker.py")
    commands = [[sys.executable, worker, "--rank", str(r), "--peers", peers, "--rounds", "6",
                 *(["--die", "2"] if r == 3 else []), *(["--compression", compression] if compression else [])]
                for r in range(4)]
    # forked from one server that imported torch (and torch._dynamo, which each worker's first
    # optimizer imports) once: the workers seed everything they draw, so need no fresh interpreter
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
    if "PYTHONPATH" in os.environ:  # the checkout under test, not whichever fttree the interpreter has installed
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    logs = run_all(commands, env=env, deadline_s=180,
                   preload=("torch", "torch._dynamo", "fttree"))
    results = {}
    for r, log in enumerate(logs[:3]):
        lines = [line for line in log.splitlines() if line.startswith("{")]
        assert lines, f"rank {r} printed no result:\n{log[-3000:]}"
        results[r] = json.loads(lines[-1])
    assert not any(line.startswith("{") for line in logs[3].splitlines()), logs[3][-2000:]
    assert len({res["global"] for res in results.values()}) == 1, results
    assert all(res["contributors"] == [0, 1, 2] for res in results.values()), results
    assert all(res["outer_steps"] == 6 and res["model_is_global"] for res in results.values()), results
    assert all((res["unsent"] > 0) == (compression == "sparse") for res in results.values()), results


def test_train_mlp_trains_with_eager_outer_steps_and_uses_every_sample_once() -> None:
    """`examples/train_mlp.py --diloco 4 --eager`: ElasticJob with overlap="eager" on real
    worker processes; every epoch audited committed each sample once, and the model learned."""
    from tests.test_torch_examples import EXAMPLES, run_example

    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "3", "--steps", "24", "--diloco", "4", "--eager",
                       "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6, summary
    assert summary["epochs"] >= 1, summary
    assert summary["exactly_once"], summary
    assert summary["fewest_contributors"] == 3, summary
    assert summary["outer_sync_s"] > 0, summary
    assert summary["test_accuracy"] > 0.5, summary
    bad = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "3", "--steps", "8", "--eager")
    assert bad.returncode == 2, bad.stderr
    assert "--eager overlap DiLoCo's outer steps: they need --diloco H" in bad.stderr


def test_overlap_compare_times_every_mode_to_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m fttree.tools.overlap_compare` (the figures in docs/diloco.md): one table row per
    mode, with the outer steps to a target every mode reaches (the first step's loss)."""
    from fttree.tools.overlap_compare import main

    main(["--workers", "2", "--rounds", "3", "--dim", "16", "--hidden", "8", "--target", "9", "--json"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| sync") or line.startswith("| overlap")
            or line.startswith("| eager")]
    assert len(rows) == 3, out
    assert all(row.split("|")[3].strip() == "1" for row in rows), out  # loss 9 is reached at once
    runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [len(r["losses"]) for r in runs] == [3, 3, 3], out  # every outer step's global parameters
