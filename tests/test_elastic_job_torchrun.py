"""ElasticJob on the "fttree" torch.distributed backend (allreduce=None: the process group's
handle), under torchrun with fttree's guard: examples/train_ddp.py trains whole epochs with
every sample committed once; and a job whose every worker is SIGKILLed is restarted whole by
torchrun (--max-restarts 1) and resumes from its checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fttree.training import checkpoint as ckpt_file

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
SAMPLES, EPOCHS = 1500, 2


def torchrun(tmp_path: Path, *args: str, restarts: int = 0) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", str(restarts), "--monitor-interval", "0.2", "-m", "fttree.training.rendezvous",
           str(EXAMPLE), "--synthetic", str(SAMPLES), "--json", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    # a session of its own, so that a run past its deadline ends with every process it started
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _out, err = proc.communicate()
        raise AssertionError(f"torchrun still ran after {timeout:g} s:\n{err[-3000:]}") from None


def audits(text: str) -> dict[int, dict[str, Any]]:
    """Each epoch's last complete audit in the output."""
    out = {}
    for line in text.splitlines():
        if line.startswith('{"epoch_audit"'):
            a = json.loads(line)["epoch_audit"]
            if a["complete"]:
                out[a["epoch"]] = a
    return out


def assert_each_once(found: dict[int, dict[str, Any]]) -> None:
    assert sorted(found) == list(range(EPOCHS)), found
    for a in found.values():
        assert a["once"], a
        assert (a["committed"], a["repeated"], a["missing"], a["answered"]) == (SAMPLES, 0, 0, [0, 1, 2]), a


def test_train_ddp_under_torchrun_commits_every_sample_once(tmp_path: Path) -> None:
    out, _err = finish(torchrun(tmp_path, "--epochs", str(EPOCHS)))
    assert_each_once(audits(out))
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["workers_at_end"] == 3, summary


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _workers(torchrun_pid: int) -> list[int]:
    """The training workers: the processes running train_ddp.py below torchrun's guards."""
    found = []
    for pid in _descendants(torchrun_pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(part.endswith(b"train_ddp.py") for part in cmd) and b"fttree.training.rendezvous" not in cmd:
                found.append(pid)
    return found


def test_torchrun_restarts_a_killed_job_whole_and_it_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    proc = torchrun(tmp_path, "--epochs", str(EPOCHS), "--checkpoint-dir", str(directory), "--checkpoint-every",
                    "2", "--compute-s", "0.05", restarts=1)
    try:
        deadline = time.monotonic() + 180
        while (ckpt_file.latest(directory) is None or len(workers := _workers(proc.pid)) != 3):
            assert proc.poll() is None, "torchrun ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.02)  # polling: a --json run shows no progress but its checkpoint files
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        out, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["resumed_from_step"] is not None, summary  # torchrun's second start resumed
    assert summary["resumed_from_step"] >= 2, summary
    assert_each_once(audits(out))
