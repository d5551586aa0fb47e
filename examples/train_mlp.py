"""Data-parallel training of the thesis's MLP (784-512-10, 407,050 parameters, batch 100 per
worker, SGD) with fttree.ElasticJob, on N local workers.

    python examples/train_mlp.py -n 7 --steps 50
    python examples/train_mlp.py -n 7 --steps 50 --faults "cut 1-0 @5..10" --timeout 0.2
    python examples/train_mlp.py -n 7 --steps 50 --comm gloo      # same script on gloo DDP
    python examples/train_mlp.py -n 7 --steps 256 --diloco 32 --compression int8   # fttree.DiLoCo
    python examples/train_mlp.py -n 7 --steps 256 --diloco 32 --eager   # outer steps behind the next round

Without --images the data is scikit-learn's bundled digits upsampled to 28x28 (no download);
--images/--labels take MNIST idx files (.gz or not). Fault windows count training steps
(DistributedOptimizer marks them; its setup collectives are never hit).

With fttree the loop is fttree.ElasticJob's (train_elastic below): every sample goes to
exactly one worker per epoch, and when a worker dies (--faults "crash 4 @12") its samples not
yet trained go to the survivors. After each epoch the workers add up which samples they
trained in committed steps (one allreduce of a count per sample) and rank 0 prints the
epoch's summary: how many were committed and whether each was committed once. --cache-dir keeps each worker's samples on
local disk (fttree.CachedDataset) and reports how many had to be fetched.

With --diloco H each worker takes H local SGD steps and the workers average their parameter
change once per round (fttree.DiLoCo; --steps counts the local steps). A round is a training
step then: the sampler deals H batches per worker per round, a round's samples are committed
when its outer step completes, and fault windows count rounds.

With --checkpoint-dir DIR the job writes a checkpoint every --checkpoint-every training steps
and at each epoch's end; if every worker dies (killed, a power cut), the same command run again
resumes from it, and each epoch's samples are still committed exactly once overall:
    python examples/train_mlp.py -n 4 --epochs 3 --checkpoint-dir ckpt     # killed? run it again

On several machines run one worker per machine yourself:
    FTTREE_RANK=r FTTREE_PEERS=peers.txt python examples/train_mlp.py --steps 50
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import (
    BATCH,
    RESTARTED,
    Dataset,
    Progress,
    Samples,
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
    p.add_argument("--epochs", type=int, default=0, metavar="E",
                   help="train E whole epochs instead of --steps (each sample committed once per epoch)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write whole-job checkpoints to DIR, and resume from the newest one there if any "
                        "(fttree: ElasticJob(checkpoint_dir=DIR))")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="K",
                   help="with --checkpoint-dir: a checkpoint every K training steps, and at each epoch's end "
                        "(default 10)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--comm", choices=["fttree", "gloo"], default="fttree",
                   help="fttree DistributedOptimizer (default) or torch DDP on gloo, for comparison")
    p.add_argument("--faults", default="", help='fttree fault schedule, e.g. "cut 1-0 @5..10"')
    p.add_argument("--timeout", type=float, default=0.5, help="fttree backup-link timeout in seconds (default 0.5)")
    p.add_argument("--step-timeout", type=float, default=30.0, help="fttree gives up on a step after this (s)")
    p.add_argument("--compression", choices=["bf16", "fp16", "int8", "sparse"], default=None,
                   help="fttree wire compression of the gradients, or with --diloco of the pseudo-gradients "
                        "(float32 sums at every hop; default none; sparse: --diloco only, fttree.Sparse's "
                        "defaults unless --sparse says otherwise)")
    p.add_argument("--sparse", default="", metavar="K=V,...",
                   help="fttree.Sparse's options for --compression sparse, e.g. density=0.125,bits=3,index=random")
    p.add_argument("--diloco", type=int, default=0, metavar="H",
                   help="fttree.DiLoCo: H local steps per averaged outer step (default 0: data-parallel)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="DiLoCo's outer Nesterov momentum (default 0.9; 0: plain outer SGD)")
    p.add_argument("--hidden", type=int, default=512, help="hidden units of the MLP (default 512, the thesis's)")
    p.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="rank 0 prints the held-out accuracy every K training steps (with --json: a JSON line "
                        "{\"eval\": ...} with the seconds since training began)")
    p.add_argument("--eval-global", action="store_true",
                   help="with --diloco: evaluate DiLoCo's global parameters as of the outer step reported (the "
                        "group's model, alike on every worker) instead of rank 0's model, which also holds its "
                        "eager correction and, with --compression sparse, its progress not yet sent")
    p.add_argument("--gloo-bind", action="store_true",
                   help="with --comm gloo: rank r's connections leave from 127.0.0.(r+1), as fttree's do, so that "
                        "uplinks shaped by source address (fttree bench) limit gloo alike")
    p.add_argument("--overlap", action="store_true",
                   help="with --diloco: run each outer step behind the next round's local steps")
    p.add_argument("--eager", action="store_true",
                   help="with --diloco: --overlap with the eager update (each worker goes on from the global "
                        "parameters plus its own pseudo-gradient standing in for its term of the average in flight)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (default 25)")
    p.add_argument("--images", help="MNIST idx images file (default: sklearn digits)")
    p.add_argument("--labels", help="MNIST idx labels file")
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="train on N samples of a synthetic task (10 Gaussian classes) instead, made on the fly")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON summary line instead of progress lines")
    p.add_argument("--deadline", type=float, default=600.0, help="stop the local workers after this many seconds")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="DataLoader worker processes per training worker (default 0: load in-process)")
    p.add_argument("--cache-dir", help="keep each worker's samples in DIR/rank<r> (fttree.CachedDataset); "
                                       "implies --stable")
    p.add_argument("--stable", action="store_true",
                   help="sampler stable mode: each sample stays on its worker across epochs")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the sampler (default 0)")
    p.add_argument("--restart", type=int, default=None, metavar="R",
                   help="with --faults \"crash R @S\": start rank R again once its process ended; it rejoins, takes "
                        "the training state from a peer, and the run goes on past --steps until R is back among "
                        "a step's contributors")
    p.add_argument("--compute-s", type=float, default=0.0, metavar="S",
                   help="every worker also waits S seconds per local step, as a device whose compute takes that "
                        "long would (one machine's few cores cannot run many real devices side by side)")
    p.add_argument("--slow", default=None, metavar="R[:F]",
                   help="rank R computes F times as slowly as the others (default F 2): after its forward and "
                        "backward it waits F-1 times what they took, as an older device would")
    p.add_argument("--straggler-policy", choices=["wait", "deadline"], default=None,
                   help="fttree's straggler_policy (default: the library's, wait): deadline closes a step without "
                        "a late rank, which skips the steps it is behind (opt.steps_behind) and whose batches are "
                        "dealt again")
    p.add_argument("--straggler-grace", type=float, default=None, metavar="S",
                   help="fttree's straggler_grace_s: how long past the median arrival a step waits for a late rank")
    args = p.parse_args(argv)
    if args.sparse:
        if args.compression != "sparse":
            p.error("--sparse sets fttree.Sparse's options: it needs --compression sparse")
        try:
            import fttree
            fttree.Sparse(**sparse_options(args.sparse))
        except (ValueError, fttree.ConfigError) as exc:
            p.error(f"--sparse {args.sparse}: {exc}")
    args.slow_rank, args.slow_factor = parse_slow(p, args.slow)
    if args.straggler_policy is not None and args.comm != "fttree":
        p.error("--straggler-policy is fttree's (gloo waits for every rank)")
    if args.epochs < 0 or args.checkpoint_every < 1:
        p.error("--epochs must be >= 0 and --checkpoint-every >= 1")
    if (args.checkpoint_dir is not None or args.epochs) and args.comm != "fttree":
        p.error("--checkpoint-dir and --epochs are fttree.ElasticJob's (--comm fttree)")
    if is_worker():
        return args  # the group's size is the launcher's, checked there
    n = args.workers
    if args.slow_rank is not None and not 0 <= args.slow_rank < n:
        p.error(f"--slow {args.slow}: not a rank of {n} workers")
    if args.restart is not None and not 0 <= args.restart < n:
        p.error(f"--restart {args.restart}: not a rank of {n} workers")
    if args.restart is not None and args.comm != "fttree":
        p.error("--restart needs --comm fttree: a gloo group cannot take a worker back")
    if args.restart is not None and args.epochs:
        p.error("--restart with --epochs: --restart runs past --steps until the restarted rank is back, but a job of "
                "whole epochs may end before it is; use --steps")
    if args.eval_global and not (args.diloco and args.comm == "fttree"):
        p.error("--eval-global evaluates DiLoCo's global parameters: it needs --diloco H")
    if (args.overlap or args.eager) and not args.diloco:
        p.error("--overlap and --eager overlap DiLoCo's outer steps: they need --diloco H")
    if args.restart is not None and (args.overlap or args.eager):
        p.error("--restart with --overlap or --eager: this example commits an overlapped round a round late and "
                "cannot tell a restarted process when an epoch ends; use one or the other")
    return args


class GlobalModel:
    """--eval-global: a copy of the model holding DiLoCo's global parameters as of the outer step
    the job reports. Each outer step's are copied on the thread that took it (with overlap a
    background one, before the next outer step writes them); the job reports a step on the
    training thread after that, with overlap a round later, while the next step is in flight."""

    KEEP = 4  # outer steps whose copies are kept: the one reported, and those finished since

    def __init__(self, model: nn.Module, opt: Any) -> None:
        self.model, self.opt = copy.deepcopy(model), opt
        self._lock = threading.Lock()
        self._copies: dict[int, dict[str, torch.Tensor]] = {}
        opt.outer_listeners.append(self._copy)

    def _copy(self, opt: Any) -> None:
        step = opt.last_step
        if step is None:
            return
        copies = {name: g.clone() for name, g in opt.global_parameters}
        with self._lock:
            self._copies[step.step] = copies
            while len(self._copies) > self.KEEP:
                del self._copies[min(self._copies)]

    def settled(self) -> nn.Module:
        step = self.opt.settled_step
        with self._lock:
            copies = None if step is None else self._copies.get(step.step)
        if copies is None:
            raise RuntimeError(f"--eval-global: no copy of the global parameters of outer step "
                               f"{None if step is None else step.step} (kept: {sorted(self._copies)})")
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(copies[name])
        return self.model


def device_time(args: argparse.Namespace, rank: int, computed_s: float) -> None:
    """The rest of a local step's compute on the device this worker plays: --compute-s, and for
    the --slow rank its factor times everything its step took."""
    factor = args.slow_factor if rank == args.slow_rank else 1.0
    wait = factor * (computed_s + args.compute_s) - computed_s
    if wait > 0:
        time.sleep(wait)


def parse_slow(p: argparse.ArgumentParser, text: str | None) -> tuple[int | None, float]:
    """--slow R[:F] -> (R, F)."""
    if text is None:
        return None, 1.0
    rank, _, factor = text.partition(":")
    try:
        r, f = int(rank), float(factor or 2.0)
    except ValueError:
        p.error(f"--slow {text!r}: expected a rank and an optional factor, e.g. 3 or 3:2.5")
    if r < 0 or not f >= 1.0:
        p.error(f"--slow {text!r}: the rank must be >= 0 and the factor >= 1")
    return r, f


def launch(args: argparse.Namespace) -> int:
    from fttree.net.address import local_peers

    n = args.workers
    if args.comm == "fttree":
        peers = ",".join(local_peers(n, port=free_port(n)))
        envs = {r: {"FTTREE_RANK": str(r), "FTTREE_PEERS": peers} for r in range(n)}
    else:
        port = str(free_port())
        envs = {r: {"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port} for r in range(n)}
    return launch_local(__file__, n, sys.argv[1:], envs, args.deadline, restart=args.restart)


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    data = load_data(args.images, args.labels, args.synthetic)
    loss_fn = nn.CrossEntropyLoss()
    recoveries: list[Any] = []  # notes of data that went around a link (lost or by plan), and of link memory
    if args.comm == "fttree":
        import fttree
        from fttree.core.protocol import NoteKind

        restarted = os.environ.get(RESTARTED) == "1"  # the crash is behind this process: no --faults
        stragglers = {k: v for k, v in (("straggler_policy", args.straggler_policy),
                                        ("straggler_grace_s", args.straggler_grace)) if v is not None}
        ar = fttree.FTTreeAllreduce.from_env(timeout_s=args.timeout, step_timeout_s=args.step_timeout,
                                             faults=None if restarted else args.faults or None, **stragglers).start()
        rank, world = ar.rank, ar.world
        assert ar.node is not None
        ar.node.note_listeners.append(lambda note: recoveries.append(note)
                                      if note.kind in (NoteKind.RECOVERY, NoteKind.DETOUR, NoteKind.LINK, NoteKind.WAIT)
                                      else None)
        model = thesis_mlp(seed=args.seed, hidden=args.hidden)  # one seed: the start compares a digest and copies
        # nothing (a model built otherwise would be copied from rank 0)
        # the job wraps the optimizer and runs its setup collectives here, before the clock starts
        job = make_job(args, ar, model, torch.optim.SGD(model.parameters(), lr=args.lr), data)
        net: nn.Module = model
        global_model = GlobalModel(model, job.opt) if args.eval_global else None

        def close() -> None:
            fttree.training.optim.close_gracefully(ar)  # let the last results reach the other ranks first
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        backend = "gloo"
        if args.gloo_bind:
            from fttree.tools.bindshim import shim_active
            from fttree.tools.gloo_baseline import reexec_with_shim, register_bound_gloo

            addr = f"127.0.0.{int(os.environ['RANK']) + 1}"
            if not shim_active(addr):
                reexec_with_shim(addr)  # this process again, with the connect() wrapper loaded
            backend = register_bound_gloo(addr)
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        model = thesis_mlp(seed=args.seed, hidden=args.hidden)
        net = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        close = dist.destroy_process_group
        global_model = None
    evaluated_model: Callable[[], nn.Module] = global_model.settled if global_model is not None else lambda: model
    if rank == 0 and not args.json:
        print(f"{world} workers ({args.comm}), {data.name}: {len(data.x_train)} train / {len(data.x_test)} test, "
              f"batch {BATCH} per worker, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    rounds = -(-args.steps // args.diloco) if args.diloco and args.comm == "fttree" else args.steps
    if args.epochs and args.comm == "fttree":  # for the progress bar: the steps of that many epochs, all there
        rounds = args.epochs * -(-len(data.x_train) // (world * BATCH * (args.diloco or 1)))
    progress = Progress(rounds, enabled=rank == 0, as_json=args.json)
    began = time.perf_counter()
    computed = [0.0]  # forward and backward seconds (with --compute-s): the compute share's numerator
    evaluated = [0.0]  # seconds spent evaluating: not training, so not in the compute share's wall time
    # when the last training step was reported, and the evaluating seconds by then: the training's end. The
    # epoch audit that follows (one allreduce of a count per sample) is the job's, not training; the bench
    # stops inside an epoch of a million samples, whose audit took 6.5 s behind 10 Mbit/s, a round's worth
    trained = [0.0, 0.0]

    def evaluate(step: int) -> None:
        """Rank 0, every --eval-every training steps: the held-out accuracy, and when."""
        if rank != 0 or not args.eval_every or (step + 1) % args.eval_every:
            return
        t0 = time.perf_counter()
        info = {"t": round(t0 - began - evaluated[0], 3), "at": round(time.time(), 3), "step": step + 1,
                "local_steps": (step + 1) * (args.diloco or 1) if args.comm == "fttree" else step + 1,
                "accuracy": round(accuracy(evaluated_model(), data.x_test, data.y_test), 4)}
        evaluated[0] += time.perf_counter() - t0
        print(json.dumps({"eval": info}) if args.json else f"eval after step {step}: {info}", flush=True)

    def reported() -> None:
        trained[:] = [time.perf_counter(), evaluated[0]]

    if args.comm == "fttree":
        try:
            audits = train_elastic(args, job, model, progress, recoveries, evaluate, computed, reported)
        except Exception as exc:
            if ar.crashed is not None:  # the crash this run asked for (--faults): the others go on
                print(f"rank {rank}: {ar.crashed}; the other workers go on without it", file=sys.stderr, flush=True)
                return 0
            print(f"rank {rank}: training stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        if rank == 0 and args.json:
            print(json.dumps({"audits": [a.to_dict() for a in audits]}), flush=True)  # the summary stays last
        last = job.last_step
        ended, evaluating = trained if trained[0] else (time.perf_counter(), evaluated[0])
        wall_s = ended - began - evaluating
        progress.summary(args.warmup, {"comm": args.comm, "workers": world,
                                       "test_accuracy": round(accuracy(model, data.x_test, data.y_test), 4),
                                       "recoveries": sum(n.kind.value == "recovery" for n in recoveries),
                                       "detours": sum(n.kind.value == "detour" for n in recoveries),
                                       "notes": dict(Counter(n.cause.value for n in recoveries)),
                                       "fewest_contributors": job.fewest_contributors or world,
                                       "late_steps": {str(r): n for r, n in sorted(job.late.items())},
                                       "epochs": len(audits),
                                       "exactly_once": all(a.once for a in audits if a.complete),
                                       "last_contributors": list(last.contributors) if last else [],
                                       "resumed_from_step": job.resumed_step,
                                       "compute_s": round(computed[0], 3), "wall_s": round(wall_s, 3),
                                       **({"outer_hidden": round(job.opt.stats.hidden, 3),
                                           "outer_waited_s": round(job.opt.stats.waited_s, 3),
                                           "outer_sync_s": round(job.opt.stats.sync_s, 3)}
                                          if isinstance(job.opt, fttree.DiLoCo) else {})})
        close()
        return 0
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
            device_time(args, rank, time.perf_counter() - t0)
            opt.step()
            seconds = time.perf_counter() - t0
            acc = float((out.argmax(1) == y).float().mean())
            new = recoveries[seen:]
            note = "; ".join(sorted({describe_note(n) for n in new}))
            progress.step(step, seconds, loss.item(), acc, note)
            evaluate(step)
    except Exception as exc:
        print(f"rank {rank}: training stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    progress.summary(args.warmup, {"comm": args.comm, "workers": world,
                                   "test_accuracy": round(accuracy(model, data.x_test, data.y_test), 4),
                                   "recoveries": sum(n.kind.value == "recovery" for n in recoveries),
                                   "detours": sum(n.kind.value == "detour" for n in recoveries)})
    close()
    return 0


def make_job(args: argparse.Namespace, ar: Any, model: nn.Module, inner: torch.optim.Optimizer, data: Dataset) -> Any:
    """fttree.ElasticJob over the training set: it wraps `inner` (fttree.DistributedOptimizer,
    or fttree.DiLoCo with --diloco) and deals the samples, each once per epoch."""
    import fttree

    dataset: Any = Samples(data.x_train, data.y_train)
    if args.cache_dir:
        dataset = fttree.CachedDataset(dataset, Path(args.cache_dir) / f"rank{ar.rank}")
    return fttree.ElasticJob(model, inner, dataset, batch_size=BATCH, allreduce=ar, diloco=args.diloco,
                             overlap="eager" if args.eager else args.overlap, compression=compression_of(args),
                             outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                             bucket_mb=args.bucket_mb,
                             seed=args.seed, stable=args.stable, num_workers=args.loader_workers,
                             joins=args.restart is not None,  # --restart: a process comes back mid-job
                             checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)


SPARSE_OPTIONS = {"density": float, "bits": int, "index": str, "block": int, "seed": int}


def sparse_options(text: str) -> dict[str, Any]:
    """--sparse's "K=V,..." as fttree.Sparse's keyword arguments; ValueError names what is wrong."""
    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in SPARSE_OPTIONS or not value:
            raise ValueError(f"{item!r} is not one of {', '.join(k + '=...' for k in SPARSE_OPTIONS)}")
        try:
            options[key] = SPARSE_OPTIONS[key](value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a {SPARSE_OPTIONS[key].__name__}") from None
    return options


def compression_of(args: argparse.Namespace) -> Any:
    """--compression, with --sparse's options when it is sparse."""
    if args.compression != "sparse" or not args.sparse:
        return args.compression
    import fttree
    return fttree.Sparse(**sparse_options(args.sparse))


def train_elastic(args: argparse.Namespace, job: Any, model: nn.Module, progress: Progress, recoveries: list[Any],
                  evaluate: Any, computed: list[float], reported: Callable[[], None]) -> list[Any]:
    """The fttree loop: the job deals the samples (each once per epoch, whoever dies, lags or
    restarts) and does the protocol; what is left here is the model's step and this example's
    reporting. Adds the forward and backward seconds to `computed[0]`; calls `reported` as each
    step is reported, before its evaluation. Returns the epochs' summaries."""
    rank = job.rank
    rounds = -(-args.steps // (args.diloco or 1))  # training steps: DiLoCo rounds count as one
    if args.epochs:
        rounds = 1 << 62  # whole epochs: no step limit
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    hits, seen = [0, 0], [0, 0.0]  # hits/samples of the step's batches; notes seen, the last step's end
    # --restart R: every worker goes on past --steps until R, once missing from a step, is back
    # among a step's contributors; all see the same contributors, so all stop at the same step
    missed, back = [False], [args.restart is None]

    def on_step(report: Any) -> None:
        """Every committed training step, empty ones included: progress, evaluation, --restart's stop."""
        if args.restart is not None:
            missed[0] = missed[0] or args.restart not in report.contributors
            back[0] = back[0] or (missed[0] and args.restart in report.contributors)
            if report.step + 1 >= rounds and back[0]:
                job.stop()
        if report.waiting:
            return
        now = time.perf_counter()
        new, seen[0] = recoveries[int(seen[0]):], len(recoveries)
        own = "late: skipped a step closed without this rank" if report.skipped else \
            "no batch left: empty contribution" if not report.trained and rank in report.contributors else ""
        note = "; ".join(sorted({describe_note(n) for n in new} | ({own} if own else set())))
        loss_value = sum(losses) / len(losses) if losses and report.trained else float("nan")
        acc = hits[0] / hits[1] if hits[1] and report.trained else float("nan")
        progress.step(report.step, now - seen[1], loss_value, acc, note)
        losses.clear()
        hits[:] = [0, 0]
        seen[1] = now
        reported()
        evaluate(report.step)

    job.step_listeners.append(on_step)
    missed[0] = job.joining  # a restarted process: the crash is behind it
    seen[1] = time.perf_counter()
    limit = None if args.restart is not None or args.epochs else rounds
    for epoch in job.epochs(args.epochs or None, steps=limit):
        for x, y in epoch:
            began = time.perf_counter()
            if not hits[1]:  # a round's first batch: its time counts from here, not from the loader's fetch
                seen[1] = began
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            device_time(args, rank, time.perf_counter() - began)
            computed[0] += time.perf_counter() - began
            losses.append(loss.item())
            hits[0] += int((out.argmax(1) == y).sum())
            hits[1] += len(y)
            job.step()
        if rank == 0:  # before the epoch's checkpoint (written when the loop asks for the next epoch)
            print(json.dumps({"epoch_audit": epoch.summary.to_dict()}) if args.json else epoch.summary, flush=True)
    return list(job.summaries)


def is_worker() -> bool:
    """Started as one worker of a group (by this script's launcher, fttree launch or torchrun),
    not as the command that launches them."""
    return "FTTREE_RANK" in os.environ or "RANK" in os.environ


def main() -> int:
    args = parse_args()
    if is_worker():
        return train(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
