"""Data-parallel training of the thesis's MLP (784-512-10, 407,050 parameters, batch 100 per
worker, SGD) with fttree.DistributedOptimizer, on N local workers.

    python examples/train_mlp.py -n 7 --steps 50
    python examples/train_mlp.py -n 7 --steps 50 --faults "cut 1-0 @5..10" --timeout 0.2
    python examples/train_mlp.py -n 7 --steps 50 --comm gloo      # same script on gloo DDP
    python examples/train_mlp.py -n 7 --steps 256 --diloco 32 --compression int8   # fttree.DiLoCo

Without --images the data is scikit-learn's bundled digits upsampled to 28x28 (no download);
--images/--labels take MNIST idx files (.gz or not). Fault windows count training steps
(DistributedOptimizer marks them; its setup collectives are never hit).

With fttree the data comes from fttree.ElasticSampler: every sample goes to exactly one
worker per epoch, and when a worker dies (--faults "crash 4 @12") its samples not yet trained
go to the survivors. After each epoch the workers add up which samples they trained in
committed steps (one allreduce of a count per sample) and rank 0 prints how many were
committed and whether each was committed once. --cache-dir keeps each worker's samples on
local disk (fttree.CachedDataset) and reports how many had to be fetched.

With --diloco H each worker takes H local SGD steps and the workers average their parameter
change once per round (fttree.DiLoCo; --steps counts the local steps). A round is a training
step then: the sampler deals H batches per worker per round, a round's samples are committed
when its outer step completes, and fault windows count rounds.

On several machines run one worker per machine yourself:
    FTTREE_RANK=r FTTREE_PEERS=peers.txt python examples/train_mlp.py --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_common import (
    BATCH,
    RESTARTED,
    Dataset,
    IndexedSamples,
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
    p.add_argument("--compression", choices=["bf16", "fp16", "int8"], default=None,
                   help="fttree wire compression of the gradients, or with --diloco of the pseudo-gradients "
                        "(float32 sums at every hop; default none)")
    p.add_argument("--diloco", type=int, default=0, metavar="H",
                   help="fttree.DiLoCo: H local steps per averaged outer step (default 0: data-parallel)")
    p.add_argument("--hidden", type=int, default=512, help="hidden units of the MLP (default 512, the thesis's)")
    p.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="rank 0 prints the held-out accuracy every K training steps (with --json: a JSON line "
                        "{\"eval\": ...} with the seconds since training began)")
    p.add_argument("--gloo-bind", action="store_true",
                   help="with --comm gloo: rank r's connections leave from 127.0.0.(r+1), as fttree's do, so that "
                        "uplinks shaped by source address (fttree bench) limit gloo alike")
    p.add_argument("--overlap", action="store_true",
                   help="with --diloco: run each outer step behind the next round's local steps")
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
    args.slow_rank, args.slow_factor = parse_slow(p, args.slow)
    if args.straggler_policy is not None and args.comm != "fttree":
        p.error("--straggler-policy is fttree's (gloo waits for every rank)")
    if is_worker():
        return args  # the group's size is the launcher's, checked there
    n = args.workers
    if args.slow_rank is not None and not 0 <= args.slow_rank < n:
        p.error(f"--slow {args.slow}: not a rank of {n} workers")
    if args.restart is not None and not 0 <= args.restart < n:
        p.error(f"--restart {args.restart}: not a rank of {n} workers")
    if args.restart is not None and args.comm != "fttree":
        p.error("--restart needs --comm fttree: a gloo group cannot take a worker back")
    if args.restart is not None and args.overlap:
        p.error("--restart with --overlap: this example commits an overlapped round a round late and cannot tell "
                "a restarted process when an epoch ends; use one or the other")
    return args


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
        inner = torch.optim.SGD(model.parameters(), lr=args.lr)
        opt: Any
        if args.diloco:
            opt = fttree.DiLoCo(model, inner, allreduce=ar, sync_every=args.diloco, compression=args.compression,
                                overlap=args.overlap, bucket_mb=args.bucket_mb)
        else:
            opt = fttree.DistributedOptimizer(inner, model, allreduce=ar, bucket_mb=args.bucket_mb,
                                              compression=args.compression)
        net: nn.Module = model

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
    if rank == 0 and not args.json:
        print(f"{world} workers ({args.comm}), {data.name}: {len(data.x_train)} train / {len(data.x_test)} test, "
              f"batch {BATCH} per worker, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    rounds = -(-args.steps // args.diloco) if args.diloco and args.comm == "fttree" else args.steps
    progress = Progress(rounds, enabled=rank == 0, as_json=args.json)
    began = time.perf_counter()

    def evaluate(step: int) -> None:
        """Rank 0, every --eval-every training steps: the held-out accuracy, and when."""
        if rank != 0 or not args.eval_every or (step + 1) % args.eval_every:
            return
        info = {"t": round(time.perf_counter() - began, 3), "at": round(time.time(), 3), "step": step + 1,
                "local_steps": (step + 1) * (args.diloco or 1) if args.comm == "fttree" else step + 1,
                "accuracy": round(accuracy(model, data.x_test, data.y_test), 4)}
        print(json.dumps({"eval": info}) if args.json else f"eval after step {step}: {info}", flush=True)

    if args.comm == "fttree":
        try:
            audits, fewest, late = train_with_sampler(args, ar, opt, model, data, progress, recoveries, evaluate)
        except Exception as exc:
            if ar.crashed is not None:  # the crash this run asked for (--faults): the others go on
                print(f"rank {rank}: {ar.crashed}; the other workers go on without it", file=sys.stderr, flush=True)
                return 0
            print(f"rank {rank}: training stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        if rank == 0 and args.json:
            print(json.dumps({"audits": audits}), flush=True)  # before the summary: that stays the last line
        progress.summary(args.warmup, {"comm": args.comm, "workers": world,
                                       "test_accuracy": round(accuracy(model, data.x_test, data.y_test), 4),
                                       "recoveries": sum(n.kind.value == "recovery" for n in recoveries),
                                       "detours": sum(n.kind.value == "detour" for n in recoveries),
                                       "notes": dict(Counter(n.cause.value for n in recoveries)),
                                       "fewest_contributors": fewest,
                                       "late_steps": {str(r): n for r, n in sorted(late.items())},
                                       "epochs": len(audits),
                                       "exactly_once": all(a["once"] for a in audits if a["complete"]),
                                       "last_contributors": list(opt.last_step.contributors) if opt.last_step else [],
                                       **({"outer_hidden": round(opt.stats.hidden, 3),
                                           "outer_waited_s": round(opt.stats.waited_s, 3),
                                           "outer_sync_s": round(opt.stats.sync_s, 3)} if args.diloco else {})})
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


def train_with_sampler(args: argparse.Namespace, ar: Any, opt: Any, model: nn.Module, data: Dataset,
                       progress: Progress, recoveries: list[Any],
                       evaluate: Any = None) -> tuple[list[dict[str, Any]], int, dict[int, int]]:
    """The fttree loop: an ElasticSampler deals the samples, each step is committed from the
    optimizer (`commit_from`), a worker with nothing left contributes empty, and every epoch
    ends with an audit of what was committed. Returns the audits, the fewest workers whose
    batches one step's sum held, and per rank the steps that closed without it (late)."""
    import numpy as np
    from torch.utils.data import DataLoader

    import fttree

    rank, n_train, restart = ar.rank, len(data.x_train), args.restart
    dataset: Any = IndexedSamples(data.x_train, data.y_train)
    cache = None
    if args.cache_dir:
        cache = dataset = fttree.CachedDataset(dataset, Path(args.cache_dir) / f"rank{rank}")
    inner_steps = args.diloco or 1  # local steps per training step (a DiLoCo round)
    steps = -(-args.steps // inner_steps)
    lag = 1 if args.diloco and args.overlap else 0  # an overlapped round is committed when the next one ends
    # follow(): a restarted process takes the epoch history from a peer with the training state
    sampler = fttree.ElasticSampler.follow(opt, n_train, BATCH * inner_steps, seed=args.seed,
                                           stable=args.stable or cache is not None,
                                           horizon=fttree.loader_horizon(args.loader_workers) + lag)
    in_flight: dict[int, list[int]] = {}  # round -> this rank's samples in it, until its outer step is committed
    committed = -1  # the newest training step committed
    # --restart R: every worker goes on past --steps until R, once missing from a step, is back
    # among a step's contributors; all see the same contributors, so all stop at the same step
    missed, back = opt.syncing, restart is None
    late: Counter[int] = Counter()  # rank -> training steps that closed without it (--straggler-policy)

    def commit_done(trained: list[int]) -> None:
        """Commit the newest step if its outer step finished here and it is not committed yet."""
        nonlocal fewest, committed, missed, back
        done = opt.last_step
        if done is None or done.step <= committed:
            return
        committed = done.step
        if restart is not None:
            missed = missed or restart not in done.contributors
            back = back or (missed and restart in done.contributors)
        if not opt.syncing:  # a restarted process counts from when it holds the group's model
            fewest = min(fewest, len(done.contributors))
        late.update(done.late)
        if rank in done.contributors:
            trained.extend(in_flight.get(done.step, []))
        in_flight.pop(done.step, None)
        sampler.commit_from(opt)

    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.loader_workers,
                        collate_fn=fttree.CollateOrNone(), timeout=120 if args.loader_workers else 0)
    loss_fn = nn.CrossEntropyLoss()
    audits: list[dict[str, Any]] = []
    fewest = ar.world  # the fewest workers whose batches one step's sum held (fewer: one died, or was lost)
    step, epoch = 0, 0
    carried: list[int] = []  # a restarted process: what its earlier process committed in this epoch
    resumed = opt.syncing  # a restarted process comes in mid-epoch: its sampler is in that epoch already

    def audit_now(members_audit: bool) -> bool:
        """--restart: one number after each round tells every process whether the members audit
        an epoch now. A restarted process still waiting for the group's history cannot know
        when an epoch ends, yet must take part in the audit's allreduce like any member."""
        if restart is None:
            return members_audit
        ar.mark_step(None)  # not a training step
        return float(ar.allreduce(np.array([1.0 if members_audit else 0.0], dtype=np.float32))[0]) > 0

    if opt.syncing:
        while not sampler.member:  # no batch until the sampler, with the group's history, deals to it
            for _ in range(inner_steps):
                opt.zero_grad()
                opt.step(contribute=False)
            commit_done([])
            if audit_now(False):  # an epoch ended while this process waited: its part is nothing
                ar.mark_step(None)
                ar.allreduce(np.zeros(n_train + ar.world, dtype=np.int32))
        assert opt.last_step is not None
        step, epoch = opt.last_step.step + 1 + lag, sampler.epoch
        carried = sampler.committed(rank).tolist()
    while step < steps or not back:
        if not resumed:
            sampler.set_epoch(epoch)
        trained: list[int] = carried  # samples this rank trained in steps that list it as a contributor
        carried, resumed = [], False
        fetched_before = cache.stats().fetched if cache is not None else 0
        for batch in loader:
            seen = len(recoveries)
            t0 = time.perf_counter()
            if batch is not None and not args.diloco and opt.steps_behind:
                # a straggler (--straggler-policy deadline): the group closed this step without it
                # already; computing it would be wasted. Take the others' average; the sampler
                # deals this batch again
                opt.zero_grad()
                opt.step(contribute=False)
                loss_value, acc, note = float("nan"), float("nan"), "late: skipped a step closed without this rank"
                batch = None
            elif batch is None:  # nothing left for this rank this epoch: take part, counted in no average
                for _ in range(inner_steps):
                    opt.zero_grad()
                    opt.step(contribute=False)
                loss_value, acc, note = float("nan"), float("nan"), "no batch left: empty contribution"
            else:
                x, y, idx = batch
                losses, hits = [], 0
                for part in torch.arange(len(y)).tensor_split(inner_steps):  # a round's local batches
                    opt.zero_grad()
                    if not len(part):
                        opt.step(contribute=False)
                        continue
                    began = time.perf_counter()
                    out = model(x[part])
                    loss = loss_fn(out, y[part])
                    loss.backward()
                    device_time(args, rank, time.perf_counter() - began)
                    opt.step()
                    losses.append(loss.item())
                    hits += int((out.argmax(1) == y[part]).sum())
                loss_value, acc, note = sum(losses) / len(losses), hits / len(y), ""
            in_flight[step] = idx.tolist() if batch is not None else []
            commit_done(trained)
            if restart is not None:  # the loop below stops after this round at an epoch's end or at the last step
                audit_now(sampler.finished or (step + 1 >= steps and back))
            seconds = time.perf_counter() - t0
            new = recoveries[seen:]
            note = "; ".join(sorted({describe_note(n) for n in new} | ({note} if note else set())))
            progress.step(step, seconds, loss_value, acc, note)
            if evaluate is not None:
                evaluate(step)
            step += 1
            if step >= steps and back:
                break
        if lag:  # the epoch's last round is in flight: take it in before the audit
            opt.flush()
            commit_done(trained)
        fetched = (cache.stats().fetched if cache is not None else 0) - fetched_before
        audits.append(audit_epoch(ar, sampler, np.asarray(trained, dtype=np.int64), fetched, epoch, n_train,
                                  quiet=args.json))
        epoch += 1
    return audits, fewest, dict(late)


def audit_epoch(ar: Any, sampler: Any, trained: Any, fetched: int, epoch: int, n_train: int,
                quiet: bool) -> dict[str, Any]:
    """Add up, over all workers, how often each sample was trained in a committed step: one
    allreduce of a count per sample (plus each rank's cache fetches). Workers that left the
    view cannot answer; what they committed comes from the survivors' samplers (every member
    computes the same history), added once, by the lowest surviving rank."""
    import numpy as np

    world = ar.world
    counts = np.zeros(n_train + world, dtype=np.int32)
    np.add.at(counts, trained, 1)
    departed = sorted(set(sampler.history().members) - set(sampler.members))
    gone: dict[int, int] = {}
    if ar.rank == min(sampler.members):
        for r in departed:
            theirs = sampler.committed(r)
            gone[r] = len(theirs)
            np.add.at(counts, theirs, 1)
    counts[n_train + ar.rank] = fetched
    ar.mark_step(None)  # an audit, not a training step: fault windows do not count it
    total = ar.allreduce(counts)
    per_sample, fetches = total[:n_train], total[n_train:]
    answered = ar.last.contributors if ar.last is not None else ()
    complete = sampler.finished
    info = {"epoch": epoch, "complete": complete, "committed": int(per_sample.sum()),
            "distinct": int((per_sample > 0).sum()), "repeated": int((per_sample > 1).sum()),
            "missing": int((per_sample == 0).sum()), "once": bool(complete and (per_sample == 1).all()),
            "departed": departed, "answered": list(answered), "fetched": int(fetches.sum()),
            "moved": sum(e.pool for e in sampler.stats().events)}
    if ar.rank == 0 and not quiet:
        left = f"; ranks {departed} left the view ({info['moved']} of their samples went to the survivors; " \
               f"{sum(gone.values())} they had committed are counted from the survivors' samplers)" if departed else ""
        cache = f"; cache fetches {info['fetched']}" if fetches.any() else ""
        if complete:
            verdict = "each once" if info["once"] else \
                f"NOT exactly once: {info['repeated']} repeated, {info['missing']} missing"
            print(f"epoch {epoch}: {info['committed']} of {n_train} samples committed, {verdict}{left}{cache}",
                  flush=True)
        else:
            verdict = "none twice" if not info["repeated"] else f"{info['repeated']} TWICE"
            print(f"epoch {epoch} stopped at --steps: {info['committed']} of {n_train} samples committed so far, "
                  f"{verdict}{left}{cache}", flush=True)
    return info


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
