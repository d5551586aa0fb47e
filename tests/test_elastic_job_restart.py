"""A whole job killed and started again, with real processes: examples/train_mlp.py with
--checkpoint-dir, every worker SIGKILLed (by pid) at a random step, then the same command run
again. It resumes from the newest checkpoint and finishes, and over both runs each epoch's
samples were committed exactly once (the epochs' audits, read as JSON)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fttree.training import checkpoint as ckpt_file

from .procs import Output

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_mlp.py"
EPOCHS, SAMPLES, WORKERS = 3, 1500, 3


def command(directory: Path, diloco: int) -> list[str]:
    return [sys.executable, str(EXAMPLE), "-n", str(WORKERS), "--epochs", str(EPOCHS), "--synthetic", str(SAMPLES),
            "--hidden", "64", "--checkpoint-dir", str(directory), "--checkpoint-every", "3", "--diloco", str(diloco),
            "--compute-s", "0.05", "--json"]


def checkpointed_step(directory: Path) -> int:
    path = ckpt_file.latest(directory)
    return -1 if path is None else int(path.name.split("-")[1].split(".")[0])


def workers_of(launcher: subprocess.Popen[str]) -> list[int]:
    """The launcher's child processes: the training workers."""
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        return [int(p) for p in f.read().split()]


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


@pytest.mark.parametrize("diloco", [0, 2])
def test_a_job_whose_every_worker_was_killed_resumes_and_commits_each_sample_once(tmp_path: Path,
                                                                                 diloco: int) -> None:
    steps_per_epoch = -(-SAMPLES // (WORKERS * 100 * (diloco or 1)))
    target = random.Random().randint(1, EPOCHS * steps_per_epoch - 4)  # kill once a checkpoint is past this,
    # with steps left to kill the workers in (the last checkpoint is the finished job's)
    launcher = subprocess.Popen(command(tmp_path, diloco), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    first = Output(launcher)
    try:
        # The checkpoint files are the only sign of progress a --json run gives while it trains:
        # poll for them (with a deadline), then kill every worker at once, wherever they are.
        deadline = time.monotonic() + 180
        while checkpointed_step(tmp_path) < target:
            assert launcher.poll() is None, f"the job ended before step {target}: {first.text_now()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint past step {target} within 180 s"
            time.sleep(0.02)
        pids = workers_of(launcher)
        assert len(pids) == WORKERS, pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert launcher.wait(timeout=60) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    killed = json_lines(first.text())
    assert not any("median_step_s" in d for d in killed), "the first run finished before it was killed"
    at = checkpointed_step(tmp_path)

    again = subprocess.run(command(tmp_path, diloco), capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    resumed = json_lines(again.stdout)
    summary = resumed[-1]
    assert summary["resumed_from_step"] == at >= target, (summary, at, target)
    audits: dict[int, dict[str, Any]] = {}  # epoch -> its last complete audit, over both runs
    for doc in killed + resumed:
        if "epoch_audit" in doc and doc["epoch_audit"]["complete"]:
            audits[doc["epoch_audit"]["epoch"]] = doc["epoch_audit"]
    assert sorted(audits) == list(range(EPOCHS)), (target, at, audits)
    for a in audits.values():
        assert a["once"], (target, at, a)
        assert (a["committed"], a["distinct"], a["repeated"], a["missing"]) == (SAMPLES, SAMPLES, 0, 0), a
        assert a["answered"] == list(range(WORKERS)), a
