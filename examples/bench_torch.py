"""Benchmark of the PyTorch integration; prints ratios (not a test: nothing is asserted).

1. Hook path against one flat allreduce, on N local workers with the thesis's MLP: each
   iteration is forward + backward + gradient averaging, done alternately
     - flat: backward without hooks, then one FTTreeAllreduce.allreduce of all gradients
       concatenated (407,050 floats), then the average copied back into .grad;
     - hook: backward with fttree's per-parameter hooks (buckets submitted during backward),
       then synchronize().
   Printed: median iteration time of each and their ratio (also the median of the ratios of
   adjacent iterations, which resists load drift), and the ratio of the averaging part alone
   (iteration minus the median forward+backward time without hooks).
2. examples/train_mlp.py on 7 workers: fttree DistributedOptimizer against gloo DDP
   (median step time ratio), and examples/train_ddp.py on the fttree backend against gloo.

    python examples/bench_torch.py                 # everything, 7 workers
    python examples/bench_torch.py --skip-train -n 3 --iters 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import BATCH, free_port, launch_local, load_data, thesis_mlp

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--workers", type=int, default=7, help="workers for every part (default 7)")
    p.add_argument("--iters", type=int, default=30, help="iterations of each kind in part 1 (default 30)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run in part 2 (default 40)")
    p.add_argument("--skip-hook", action="store_true", help="skip part 1")
    p.add_argument("--skip-train", action="store_true", help="skip part 2")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--part", choices=["hook-worker", "hook"], help=argparse.SUPPRESS)
    return p.parse_args()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def hook_worker(args: argparse.Namespace) -> int:
    """One worker of part 1; rank 0 prints a JSON line."""
    import fttree
    from fttree.training.optim import GradientSync

    torch.set_num_threads(args.threads)
    ar = fttree.FTTreeAllreduce.from_env().start()
    data = load_data(None, None)
    x, y = data.x_train[:BATCH], data.y_train[:BATCH]
    loss_fn = nn.CrossEntropyLoss()
    flat_model, hook_model = thesis_mlp(0), thesis_mlp(0)
    sync = GradientSync(ar, hook_model.named_parameters())
    flat_params = list(flat_model.parameters())
    times: dict[str, list[float]] = {"flat": [], "hook": [], "fwd_bwd": []}
    for it in range(args.iters + 3):
        for kind in ("flat", "hook") if it % 2 else ("hook", "flat"):  # alternate to cancel order effects
            model = flat_model if kind == "flat" else hook_model
            model.zero_grad()
            t0 = time.perf_counter()
            loss_fn(model(x), y).backward()
            t1 = time.perf_counter()
            if kind == "flat":
                grads = torch.cat([p.grad.reshape(-1) for p in flat_params])  # type: ignore[union-attr]
                avg = ar.allreduce(grads, average=True)
                offset = 0
                for p in flat_params:
                    p.grad.copy_(avg[offset:offset + p.numel()].view_as(p))  # type: ignore[union-attr]
                    offset += p.numel()
            else:
                sync.synchronize()
            t2 = time.perf_counter()
            if it >= 3:
                times[kind].append(t2 - t0)
                if kind == "flat":
                    times["fwd_bwd"].append(t1 - t0)
    if ar.rank == 0:
        summary = {k: median(v) for k, v in times.items()}
        summary["paired"] = median([h / f for h, f in zip(times["hook"], times["flat"], strict=True)])
        print(json.dumps(summary), flush=True)
    fttree.training.optim.close_gracefully(ar)
    return 0


def run_hook_part(args: argparse.Namespace) -> int:
    from fttree.net.address import local_peers

    peers = ",".join(local_peers(args.workers, port=free_port(args.workers)))
    envs = {r: {"FTTREE_RANK": str(r), "FTTREE_PEERS": peers} for r in range(args.workers)}
    argv = ["--part", "hook-worker", "--iters", str(args.iters), "--threads", str(args.threads)]
    return launch_local(__file__, args.workers, argv, envs, deadline_s=600)


def last_json(text: str) -> dict[str, float]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise SystemExit(f"no JSON summary in the output:\n{text[-3000:]}")


def run(cmd: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    info = last_json(proc.stdout)
    info["wall_s"] = time.perf_counter() - t0
    return info


def main() -> int:
    args = parse_args()
    if args.part == "hook-worker":
        return hook_worker(args)
    if args.part == "hook":
        return run_hook_part(args)
    py = sys.executable
    print(f"fttree PyTorch benchmark: {args.workers} local workers, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {args.threads} torch thread(s) per worker", flush=True)
    if not args.skip_hook:
        res = run([py, __file__, "--part", "hook", "-n", str(args.workers), "--iters", str(args.iters),
                   "--threads", str(args.threads)])
        flat, hook, fb = res["flat"], res["hook"], res["fwd_bwd"]
        print(f"[hook vs flat] iteration (fwd+bwd+average): flat {flat * 1e3:.1f} ms, hook {hook * 1e3:.1f} ms, "
              f"ratio hook/flat {hook / flat:.3f} (median of per-iteration ratios {res['paired']:.3f})")
        print(f"[hook vs flat] averaging only (iteration - fwd+bwd {fb * 1e3:.1f} ms): "
              f"flat {(flat - fb) * 1e3:.1f} ms, hook {(hook - fb) * 1e3:.1f} ms, "
              f"ratio {(hook - fb) / (flat - fb):.3f}   (target <= 1.10)")
    if not args.skip_train:
        common = ["-n", str(args.workers), "--steps", str(args.steps), "--json", "--threads", str(args.threads)]
        ft = run([py, str(HERE / "train_mlp.py"), *common, "--comm", "fttree"])
        gl = run([py, str(HERE / "train_mlp.py"), *common, "--comm", "gloo"])
        print(f"[train_mlp.py] median step: fttree {ft['median_step_s'] * 1e3:.1f} ms, gloo DDP "
              f"{gl['median_step_s'] * 1e3:.1f} ms, ratio fttree/gloo {ft['median_step_s'] / gl['median_step_s']:.3f}"
              f"   (target <= 1.2); test accuracy {ft['test_accuracy']} vs {gl['test_accuracy']}")
        dd = run([py, str(HERE / "train_ddp.py"), *common, "--backend", "fttree"])
        dg = run([py, str(HERE / "train_ddp.py"), *common, "--backend", "gloo"])
        print(f"[train_ddp.py] median step: DDP on fttree backend {dd['median_step_s'] * 1e3:.1f} ms, on gloo "
              f"{dg['median_step_s'] * 1e3:.1f} ms, ratio {dd['median_step_s'] / dg['median_step_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
