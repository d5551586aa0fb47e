"""How much of DiLoCo's outer step hides behind the next round's local steps (overlap=True).

    python examples/diloco_overlap.py -n 3 --sync-every 8 --rounds 6

Runs N workers as threads of this process over loopback TCP (no data set: a fixed synthetic
batch, since only the time matters), a 784-2048-2048-10 MLP (5.8M parameters), and prints per
worker how long its outer steps took and how much of that it waited for."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

import fttree
from fttree.net.address import local_peers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import free_port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--workers", type=int, default=3)
    p.add_argument("--sync-every", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--no-overlap", action="store_true", help="the outer step blocks (for comparison)")
    p.add_argument("--compression", choices=["bf16", "fp16", "int8"], default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    peers = local_peers(args.workers, port=free_port(args.workers))
    stats: dict[int, fttree.training.diloco.OuterStats] = {}

    def worker(rank: int) -> None:
        with fttree.FTTreeAllreduce(rank, peers) as ar:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                        torch.nn.ReLU(), torch.nn.Linear(2048, 10))
            opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.01), allreduce=ar,
                                sync_every=args.sync_every, overlap=not args.no_overlap,
                                compression=args.compression)
            g = torch.Generator().manual_seed(rank)
            x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
            for _ in range(args.sync_every * args.rounds):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            opt.flush()
            stats[rank] = opt.stats

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, s in sorted(stats.items()):
        print(f"rank {rank}: {s.outer_steps} outer steps took {s.sync_s:.2f} s, of which the caller waited "
              f"{s.waited_s:.2f} s: {s.hidden:.0%} hidden")


if __name__ == "__main__":
    main()
