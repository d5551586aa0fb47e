"""The torchrun guard (`-m fttree.training.rendezvous`) tells the truth about the job: torchrun
exits 0 when one worker died and the others finished, and fails when every worker failed.
One torchrun on this machine (--standalone), three workers that do no training: what is
tested is the guards' agreement in the agent's store, not fttree's allreduce."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

WORKER = textwrap.dedent("""
    import os, signal, sys
    rank, mode = int(os.environ["RANK"]), sys.argv[1]
    if mode == "all-fail":
        sys.exit(3)  # e.g. every rank misspelt the backend
    if mode == "one-killed" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
""")


def torchrun(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "0", "--monitor-interval", "0.2", "-m", "fttree.training.rendezvous", str(script), mode]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_torchrun_fails_when_every_worker_fails(tmp_path: Path) -> None:
    run = torchrun(tmp_path, "all-fail")
    assert run.returncode != 0, run.stderr[-3000:]
    assert "every one of the job's 3 workers failed" in run.stderr, run.stderr[-3000:]
    assert "went on" not in run.stderr


def test_torchrun_succeeds_when_one_worker_is_killed_and_the_rest_finish(tmp_path: Path) -> None:
    run = torchrun(tmp_path, "one-killed")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fttree guard: rank 1 (pid" in run.stderr, run.stderr[-3000:]
    assert "was killed by SIGKILL" in run.stderr
    assert "another worker finished well, the group went on without this one" in run.stderr
