"""Data-parallel training of the thesis's MLP (784-512-10, 407,050 parameters, batch 100 per
worker, SGD) with fttree.DistributedOptimizer, on N local workers.

    python examples/train_mlp.py -n 7 --steps 50
    python examples/train_mlp.py -n 7 --steps 50 --faults "cut 1-0 @5..10" --timeout 0.2
    python examples/train_mlp.py -n 7 --steps 50 --comm gloo      # same script on gloo DDP

Without --images the data is scikit-learn's bundled digits upsampled to 28x28 (no download);
--images/--labels take MNIST idx files (.gz or not). Fault windows count training steps
(DistributedOptimizer marks them; its setup collectives are never hit).

On several machines run one worker per machine yourself:
    FTTREE_RANK=r FTTREE_PEERS=peers.txt python examples/train_mlp.py --steps 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import (
    BATCH,
    Progress,
    accuracy,
    batch_indices,
    describe_note,
    free_port,
    launch_local,
    load_data,
    thesis_mlp,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--workers", type=int, default=3, help="local workers to start (default 3)")
    p.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--comm", choices=["fttree", "gloo"], default="fttree",
                   help="fttree DistributedOptimizer (default) or torch DDP on gloo, for comparison")
    p.add_argument("--faults", default="", help='fttree fault schedule, e.g. "cut 1-0 @5..10"')
    p.add_argument("--timeout", type=float, default=0.5, help="fttree backup-link timeout in seconds (default 0.5)")
    p.add_argument("--step-timeout", type=float, default=30.0, help="fttree gives up on a step after this (s)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (default 25)")
    p.add_argument("--images", help="MNIST idx images file (default: sklearn digits)")
    p.add_argument("--labels", help="MNIST idx labels file")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON summary line instead of progress lines")
    p.add_argument("--deadline", type=float, default=600.0, help="stop the local workers after this many seconds")
    return p.parse_args(argv)


def launch(args: argparse.Namespace) -> int:
    from fttree.tools.launch import local_peers

    n = args.workers
    if args.comm == "fttree":
        peers = ",".join(local_peers(n, port=free_port()))
        envs = {r: {"FTTREE_RANK": str(r), "FTTREE_PEERS": peers} for r in range(n)}
    else:
        port = str(free_port())
        envs = {r: {"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port} for r in range(n)}
    return launch_local(__file__, n, sys.argv[1:], envs, args.deadline)


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    data = load_data(args.images, args.labels)
    loss_fn = nn.CrossEntropyLoss()
    recoveries: list[Any] = []  # notes of data that went around a link, lost or by plan
    if args.comm == "fttree":
        import fttree
        from fttree.core.protocol import NoteKind

        ar = fttree.FTTreeAllreduce.from_env(timeout_s=args.timeout, step_timeout_s=args.step_timeout,
                                             faults=args.faults or None).start()
        rank, world = ar.rank, ar.world
        assert ar.node is not None
        ar.node.note_listeners.append(lambda note: recoveries.append(note)
                                      if note.kind in (NoteKind.RECOVERY, NoteKind.DETOUR) else None)
        model = thesis_mlp(seed=rank)  # different on purpose: the broadcast makes rank 0's start everyone's
        opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr), model,
                                          allreduce=ar, bucket_mb=args.bucket_mb)
        net: nn.Module = model

        def close() -> None:
            fttree.training.optim.close_gracefully(ar)  # let the last results reach the other ranks first
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = thesis_mlp(seed=0)
        net = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        close = dist.destroy_process_group
    if rank == 0 and not args.json:
        print(f"{world} workers ({args.comm}), {data.name}: {len(data.x_train)} train / {len(data.x_test)} test, "
              f"batch {BATCH} per worker, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    progress = Progress(args.steps, enabled=rank == 0, as_json=args.json)
    try:
        for step in range(args.steps):
            idx = batch_indices(len(data.x_train), step, world, rank)
            x, y = data.x_train[idx], data.y_train[idx]
            seen = len(recoveries)
            t0 = time.perf_counter()
            opt.zero_grad()
            out = net(x)
            loss = loss_fn(out, y)
            loss.backward()
            opt.step()
            seconds = time.perf_counter() - t0
            acc = float((out.argmax(1) == y).float().mean())
            new = recoveries[seen:]
            note = "; ".join(sorted({describe_note(n) for n in new}))
            progress.step(step, seconds, loss.item(), acc, note)
    except Exception as exc:
        print(f"rank {rank}: training stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    progress.summary(args.warmup, {"comm": args.comm, "workers": world,
                                   "test_accuracy": round(accuracy(model, data.x_test, data.y_test), 4),
                                   "recoveries": sum(n.kind.value == "recovery" for n in recoveries),
                                   "detours": sum(n.kind.value == "detour" for n in recoveries)})
    close()
    return 0


def main() -> int:
    args = parse_args()
    if "FTTREE_RANK" in os.environ or "RANK" in os.environ:
        return train(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
