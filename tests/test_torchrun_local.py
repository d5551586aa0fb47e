"""torchrun on this machine (--standalone): the guard (`-m fttree.training.rendezvous`) tells
the truth about the job (torchrun exits 0 when one worker died and the others finished, and
fails when every worker failed: workers that do no training, what is tested is the guards'
agreement in the agent's store), and the fttree backend can be destroyed and made again."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

WORKER = textwrap.dedent("""
    import os, signal, sys
    rank, mode = int(os.environ["RANK"]), sys.argv[1]
    open(f"pid-{rank}", "w").write(str(os.getpid()))  # torchrun starts each worker in a session of its own
    if mode == "all-fail":
        sys.exit(3)  # e.g. every rank misspelt the backend
    if mode == "one-killed" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "reinit":  # made, used and destroyed twice, as a script may do
        import torch, torch.distributed as dist
        import fttree.training.backend
        for round_ in range(2):
            if round_ == 1 and rank > 0:
                open(f"again-{rank}", "w").close()
            if round_ == 1 and rank == 0:  # the others look for rank 0's address first
                import pathlib, time
                deadline = time.monotonic() + 30
                while len(list(pathlib.Path().glob("again-*"))) < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
            dist.init_process_group("fttree")
            t = torch.full((3,), float(rank + round_))
            dist.all_reduce(t)
            print(f"rank {rank} round {round_} sum {t.tolist()}", flush=True)
            dist.destroy_process_group()
""")


def torchrun(tmp_path: Path, mode: str, *, guard: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "0", "--monitor-interval", "0.2",
           *(["-m", "fttree.training.rendezvous"] if guard else []), str(script), mode]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    # its own process group, so that a run past its deadline ends with every worker it started
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid_file in tmp_path.glob("pid-*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun ({mode}) still ran after {timeout:g} s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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


def test_the_backend_destroyed_and_made_again_under_torchrun(tmp_path: Path) -> None:
    """torch names the new group as the one before, and torchrun's agent store keeps the old
    group's addresses: the new group must not read them (it waited 45 s and split)."""
    run = torchrun(tmp_path, "reinit", guard=False, timeout=50)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(3):
        assert f"rank {rank} round 0 sum [3.0, 3.0, 3.0]" in run.stdout, run.stdout
        assert f"rank {rank} round 1 sum [6.0, 6.0, 6.0]" in run.stdout, run.stdout
