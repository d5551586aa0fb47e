"""The thesis's MLP under torchrun on the "fttree" torch.distributed backend, trained with
fttree.ElasticJob: every sample once per epoch over the group, whoever dies, and a job whose
every worker died resumes from --checkpoint-dir. The job takes the process group's fttree
handle (ElasticJob(..., allreduce=None) after init_process_group("fttree")):

    dist.init_process_group("fttree")
    job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, batch_size=100)
    for epoch in job.epochs(2):
        for x, y in epoch:
            loss_fn(model(x), y).backward()
            job.step()
        print(epoch.summary)

    torchrun --nproc-per-node 3 -m fttree.training.rendezvous examples/train_ddp.py --epochs 2
    python examples/train_ddp.py -n 3 --steps 30                      # starts the workers itself
    python examples/train_ddp.py -n 3 --steps 30 --faults "cut 1-0 @8..12" --timeout 0.2
    python examples/train_ddp.py -n 7 --steps 30 --faults "crash 4 @12"   # rank 4 dies, the others go on
    python examples/train_ddp.py -n 3 --epochs 2 --checkpoint-dir ckpt    # killed? the same again resumes
    python examples/train_ddp.py -n 3 --backend gloo                  # stock DDP on gloo, for comparison

Settings reach the backend as FTTREE_* environment variables (FTTREE_FAULTS, FTTREE_TIMEOUT,
FTTREE_STEP_TIMEOUT), so torchrun users can set those directly. Fault windows count training
steps (the job's optimizer marks them).

A worker that dies (`crash R @S`: in-process, its sockets reset as a SIGKILL would) leaves the
others training on: fttree finishes the step on the survivors, the step's average holds the
ranks that contributed, and the samples the dead rank had not committed are dealt to the
survivors. The crashed rank itself ends quietly with exit code 0 (it is the fault the run asked
for). Under torchrun, `--max-restarts N` with --checkpoint-dir restarts a failed job whole, and
the restarted workers resume from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fttree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import (
    BATCH,
    Progress,
    Samples,
    accuracy,
    batch_indices,
    free_port,
    launch_local,
    load_data,
    thesis_mlp,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--workers", type=int, default=3, help="local workers to start when not under torchrun")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--epochs", type=int, default=0, metavar="E",
                   help="fttree: train E whole epochs instead of --steps")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="fttree: whole-job checkpoints in DIR; a job started again resumes from the newest")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="K",
                   help="with --checkpoint-dir: a checkpoint every K training steps and at each epoch's end")
    p.add_argument("--compute-s", type=float, default=0.0, metavar="S",
                   help="fttree: every worker also waits S seconds per step, as a device whose compute takes that long")
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="train on N samples of a synthetic task (10 Gaussian classes) instead")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--backend", choices=["fttree", "gloo"], default="fttree", help="torch.distributed backend")
    p.add_argument("--faults", default="",
                   help='fttree fault schedule (sets FTTREE_FAULTS), e.g. "cut 1-0 @8..12" or "crash 4 @12"')
    p.add_argument("--timeout", type=float, default=None, help="fttree backup-link timeout in s (FTTREE_TIMEOUT)")
    p.add_argument("--images", help="MNIST idx images file (default: sklearn digits)")
    p.add_argument("--labels", help="MNIST idx labels file")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    p.add_argument("--json", action="store_true", help="print one JSON summary line instead of progress lines")
    p.add_argument("--deadline", type=float, default=600.0, help="stop the local workers after this many seconds")
    args = p.parse_args()
    if args.backend == "gloo" and (args.epochs or args.checkpoint_dir):
        p.error("--epochs and --checkpoint-dir are fttree.ElasticJob's (--backend fttree)")
    return args


def train(args: argparse.Namespace) -> int:
    if args.faults:
        os.environ["FTTREE_FAULTS"] = args.faults
    if args.timeout is not None:
        os.environ["FTTREE_TIMEOUT"] = str(args.timeout)
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data(args.images, args.labels, args.synthetic)
    if rank == 0 and not args.json:
        how = "stock DDP" if args.backend == "gloo" else "fttree.ElasticJob"
        print(f"{world} workers on the {args.backend} backend ({how}), {data.name}, batch {BATCH} per worker",
              flush=True)
    try:
        model, progress, resumed = train_elastic(args, data) if args.backend == "fttree" else train_ddp(args, data)
    except Exception as exc:
        crashed = injected_crash()
        if crashed:  # the fault this run asked for: this rank is "dead", the others go on
            print(f"rank {rank}: {crashed}; the other workers go on without it", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # Gone as a dead process is: no interpreter teardown (tearing torch down with a live
            # process group and a failed step once aborted in C++, exit -6, in CI).
            os._exit(0)
        print(f"rank {rank}: training stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    extra: dict[str, object] = {"backend": args.backend, "workers": world,
                                "test_accuracy": round(accuracy(model, data.x_test, data.y_test), 4),
                                "params_digest": params_digest(model)}
    if args.backend == "fttree":
        ar = fttree.allreduce_of()
        node = ar.node
        assert node is not None
        extra["recoveries"] = sum(n for kind, n in node.note_counts.items() if kind.value in ("recovery", "detour"))
        extra["workers_at_end"] = len(ar.view.members)  # fewer than `workers` when some died
        extra["resumed_from_step"] = resumed
    progress.summary(args.warmup, extra)
    dist.destroy_process_group()
    return 0


def train_elastic(args: argparse.Namespace, data: Any) -> tuple[nn.Module, Progress, int | None]:
    """fttree.ElasticJob on the process group's fttree handle: the loop is the README's."""
    model = thesis_mlp(seed=0)
    job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=args.lr), Samples(data.x_train, data.y_train),
                            batch_size=BATCH, checkpoint_dir=args.checkpoint_dir,
                            checkpoint_every=args.checkpoint_every)  # allreduce: the process group's
    steps = args.epochs * len(job.sampler) if args.epochs else args.steps
    progress = Progress(steps, enabled=job.rank == 0, as_json=args.json)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    hits, began = [0, 0], [time.perf_counter()]

    def on_step(report: Any) -> None:  # every committed step, alike on every member
        now = time.perf_counter()
        loss = sum(losses) / len(losses) if losses else float("nan")  # nan: this rank had no batch
        progress.step(report.step, now - began[0], loss, hits[0] / hits[1] if hits[1] else float("nan"))
        losses.clear()
        hits[:], began[0] = [0, 0], now

    job.step_listeners.append(on_step)
    for epoch in job.epochs(args.epochs or None, steps=None if args.epochs else args.steps):
        for x, y in epoch:
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            losses.append(loss.item())
            hits[0] += int((out.argmax(1) == y).sum())
            hits[1] += len(y)
            if args.compute_s:
                time.sleep(args.compute_s)  # the rest of the step on the device this worker plays
            job.step()
        if job.rank == 0:
            print(json.dumps({"epoch_audit": epoch.summary.to_dict()}) if args.json else epoch.summary, flush=True)
    return model, progress, job.resumed_step


def train_ddp(args: argparse.Namespace, data: Any) -> tuple[nn.Module, Progress, None]:
    """Stock DDP on gloo, for comparison: each rank's batches by a fixed split, and no worker
    may die."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = thesis_mlp(seed=rank)  # DDP broadcasts rank 0's parameters at construction
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    progress = Progress(args.steps, enabled=rank == 0, as_json=args.json)
    for step in range(args.steps):
        idx = batch_indices(len(data.x_train), step, world, rank)
        x, y = data.x_train[idx], data.y_train[idx]
        t0 = time.perf_counter()
        opt.zero_grad()
        out = ddp(x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        progress.step(step, time.perf_counter() - t0, loss.item(), float((out.argmax(1) == y).float().mean()))
    return model, progress, None


def params_digest(model: nn.Module) -> str:
    """A digest of the parameters' bits: two runs with the same seeds and data print the same
    one when their sums are bit-reproducible."""
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def injected_crash() -> str:
    """Why this rank stopped, if a `crash` fault in FTTREE_FAULTS stopped it ('' otherwise)."""
    if not dist.is_initialized() or dist.get_backend() != "fttree":
        return ""
    return fttree.allreduce_of().crashed or ""


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:  # under torchrun, or started by launch_local below
        return train(args)
    port = str(free_port())
    envs = {r: {"RANK": str(r), "WORLD_SIZE": str(args.workers), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port} for r in range(args.workers)}
    return launch_local(__file__, args.workers, sys.argv[1:], envs, args.deadline)


if __name__ == "__main__":
    sys.exit(main())
