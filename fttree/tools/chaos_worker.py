"""One training worker of `fttree chaos`: the thesis MLP on fttree.ElasticJob, writing what it
sees as JSON lines for the chaos runner to check.

    FTTREE_RANK=r FTTREE_PEERS=... FTTREE_AUTH_KEY_FILE=... python -m fttree.tools.chaos_worker --records DIR

Each process writes DIR/rank-R-PID.jsonl (one file per process, so that a SIGKILL's torn last
line never sits in the middle of another process's records): an `up` record once its imports
and data are loaded, a `start` record once its node runs, a `ready` record once its model,
optimizer and job are built (a joiner asks for admission at its first step), one `step`
record per committed training step (its contributors and late ranks, the samples this process
trained in it, a digest of its parameters after the step's update, its RSS and the protocol
notes since the last step), one `epoch` record per epoch (its EpochSummary), and an `end` record
saying why it ended (done, left, evicted, or the error).

The runner steers it by signal and by file: SIGUSR1 asks it to leave the group gracefully after
the step under way; the file DIR/stop holding a step number K makes every member stop after
training step K (all read it well before K, so all stop at the same step).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from . import SOURCE_ROOT
from .chaos_files import EXIT_EVICTED, STOP_FILE

NOTES_PER_STEP = 16  # at most this many protocol notes in one step record


def mlp_common() -> Any:
    """examples/mlp_common.py: the thesis MLP and its data, as the training example builds them."""
    spec = importlib.util.spec_from_file_location("mlp_common", SOURCE_ROOT / "examples" / "mlp_common.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"examples/mlp_common.py not found under {SOURCE_ROOT}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mlp_common"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def digest(model: nn.Module) -> str:
    """A short digest of every parameter's bytes: equal on every rank after the same step."""
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Records:
    """This process's JSON lines, each written and flushed whole."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.rank, self.pid = rank, os.getpid()
        self.file: TextIO = open(directory / f"rank-{rank}-{self.pid}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def write(self, kind: str, **fields: Any) -> None:
        self.file.write(json.dumps({"kind": kind, "rank": self.rank, "pid": self.pid, "t": time.time(), **fields},
                                   separators=(",", ":")) + "\n")
        self.file.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, required=True, help="folder for the JSON records and the stop file")
    p.add_argument("--join", action="store_true", help="join the running group (a restarted or new process)")
    p.add_argument("--hidden", type=int, default=512, help="hidden units (default 512, the thesis's)")
    p.add_argument("--batch", type=int, default=100, help="samples per worker per step (default 100)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=0.5, help="backup-link timeout (s)")
    p.add_argument("--step-timeout", type=float, default=60.0, help="a step gives up after this (s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    import fttree
    from fttree.errors import GroupLeft

    common = mlp_common()
    data = common.load_data(None, None, 0)
    ar = fttree.FTTreeAllreduce.from_env(timeout_s=args.timeout, step_timeout_s=args.step_timeout, join=args.join)
    out = Records(args.records, ar.rank)
    out.write("up", join=args.join)  # imports done and data loaded
    ar.start()
    out.write("start", join=args.join)
    leave = [False]
    signal.signal(signal.SIGUSR1, lambda signum, frame: leave.__setitem__(0, True))
    notes: list[str] = []
    assert ar.node is not None
    ar.node.note_listeners.append(
        lambda n: notes.append(f"{n.cause.value}" + ("" if n.link is None else f" {n.link[0]}-{n.link[1]}"))
        if len(notes) < NOTES_PER_STEP else None)
    model = common.thesis_mlp(seed=args.seed, hidden=args.hidden)
    job = fttree.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=args.lr),
                            common.Samples(data.x_train, data.y_train), batch_size=args.batch, allreduce=ar,
                            seed=args.seed, joins=True)
    stop_at: list[int | None] = [None]
    stop_file = args.records / STOP_FILE

    def on_step(report: Any) -> None:
        if stop_at[0] is None and stop_file.exists():
            text = stop_file.read_text().strip()
            stop_at[0] = int(text) if text.isdigit() else None
        if stop_at[0] is not None and report.step >= stop_at[0]:
            job.stop()
        said, notes[:] = notes[:], []
        out.write("step", step=report.step, epoch=report.epoch, contributors=list(report.contributors),
                  late=list(report.late), trained=report.trained, waiting=report.waiting, skipped=report.skipped,
                  digest=None if report.waiting else digest(model), rss=rss_bytes(), notes=said)

    job.step_listeners.append(on_step)
    loss_fn = nn.CrossEntropyLoss()
    out.write("ready")  # model, optimizer and job built: the user's set-up is done, fttree's part begins
    try:
        for epoch in job.epochs():
            for x, y in epoch:
                loss_fn(model(x), y).backward()
                job.step()
                if leave[0]:
                    ar.leave()
                    out.write("end", why="left")
                    ar.close()
                    return 0
            out.write("epoch", **epoch.summary.to_dict())
    except GroupLeft as exc:
        out.write("end", why="evicted", error=str(exc))
        ar.close()
        return EXIT_EVICTED
    except Exception as exc:
        out.write("end", why="error", error=f"{type(exc).__name__}: {exc}")
        raise
    out.write("end", why="done")
    ar.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
