"""Stock DistributedDataParallel training of the thesis's MLP over the "fttree"
torch.distributed backend. The training code is plain torch; `import fttree` (which registers
the backend), the backend name and one `mark_step` per iteration are the only fttree lines.

    torchrun --nproc-per-node 3 examples/train_ddp.py --steps 30
    python examples/train_ddp.py -n 3 --steps 30                      # starts the workers itself
    python examples/train_ddp.py -n 3 --steps 30 --faults "cut 1-0 @8..12" --timeout 0.2
    python examples/train_ddp.py -n 7 --steps 30 --faults "crash 4 @12"   # rank 4 dies, the others go on
    python examples/train_ddp.py -n 3 --backend gloo                  # the same on gloo

Fault windows count training steps: the loop marks each one on the fttree handle
(`allreduce_of().mark_step(step)`), because DDP issues a varying number of collectives per
step (its setup and bucket rebuild come first). Settings reach the backend as FTTREE_*
environment variables (FTTREE_FAULTS, FTTREE_TIMEOUT, FTTREE_STEP_TIMEOUT), so torchrun users
can set those directly.

A worker that dies (`crash R @S`: in-process, its sockets reset as a SIGKILL would) leaves the
others training on: fttree finishes the step on the survivors, averages each gradient bucket
over the ranks in it, and later steps run on a tree of the survivors. DDP and the training code
notice nothing. The crashed rank itself ends quietly with exit code 0 (it is the fault the run
asked for); under torchrun a real SIGKILL of a worker does the same to the others.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fttree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import BATCH, Progress, accuracy, batch_indices, free_port, launch_local, load_data, thesis_mlp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--workers", type=int, default=3, help="local workers to start when not under torchrun")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
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
    return p.parse_args()


def train(args: argparse.Namespace) -> int:
    if args.faults:
        os.environ["FTTREE_FAULTS"] = args.faults
    if args.timeout is not None:
        os.environ["FTTREE_TIMEOUT"] = str(args.timeout)
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mark = fttree.allreduce_of().mark_step if args.backend == "fttree" else None
    if mark is not None:
        mark(None)  # DDP's setup collectives: no fault window hits them
    data = load_data(args.images, args.labels)
    model = thesis_mlp(seed=rank)  # DDP broadcasts rank 0's parameters at construction
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    if rank == 0 and not args.json:
        print(f"{world} workers, DDP on the {args.backend} backend, {data.name}, batch {BATCH} per worker", flush=True)
    progress = Progress(args.steps, enabled=rank == 0, as_json=args.json)
    try:
        for step in range(args.steps):
            idx = batch_indices(len(data.x_train), step, world, rank)
            x, y = data.x_train[idx], data.y_train[idx]
            if mark is not None:
                mark(step)
            t0 = time.perf_counter()
            opt.zero_grad()
            out = ddp(x)
            loss = loss_fn(out, y)
            loss.backward()
            opt.step()
            progress.step(step, time.perf_counter() - t0, loss.item(), float((out.argmax(1) == y).float().mean()))
    except Exception as exc:
        crashed = injected_crash()
        if crashed:  # the fault this run asked for: this rank is "dead", the others go on
            print(f"rank {rank}: {crashed}; the other workers go on without it", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # Gone as a dead process is: no interpreter teardown. Tearing down torch with a
            # failed DDP backward and a live process group once aborted in C++ ("terminate
            # called without an active exception", exit -6) in CI, failing the whole run.
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
    progress.summary(args.warmup, extra)
    dist.destroy_process_group()
    return 0


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
