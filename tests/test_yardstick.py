"""fttree yardstick (tools/yardstick.py): what it reads from a launch, and the ratios it prints.
Running two commits' launches takes minutes; these check its arithmetic and its refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fttree.tools.yardstick import parse_launch, ratio_line

SITE = Path(__file__).resolve().parent.parent / "fttree" / "tools" / "yardstick_site"


def test_the_closing_line_of_a_launch_gives_steps_workers_and_median() -> None:
    out = "step   9  50.1 ms  exact 7/7\n60 steps done on all 7 workers; median 51.7 ms, max 306.2 ms; all exact: yes\n"
    assert parse_launch(out) == (60, 7, 51.7)


def test_a_launch_without_its_closing_line_is_named() -> None:
    with pytest.raises(ValueError, match="no closing"):
        parse_launch("Error: --real-faults needs the 'iptables' command\n")


def test_the_ratio_is_the_median_of_the_pairs_ratios() -> None:
    line = ratio_line("median step (ms)", [51.9, 51.0, 51.5, 57.9], [46.8, 50.2, 48.0, 44.2])
    assert "ratio median 1.09" in line
    assert "pairs 1.11, 1.02, 1.07, 1.31" in line


def _fake_api(tmp_path: Path) -> Path:
    """A package whose FTTreeAllreduce sums on a thread of its own, as the real one's event loop does."""
    fake = tmp_path / "fake"
    (fake / "fttree").mkdir(parents=True)
    (fake / "fttree" / "__init__.py").write_text("")
    (fake / "fttree" / "api.py").write_text(
        "import queue, threading\n"
        "class FTTreeAllreduce:\n"
        "    def __init__(self):\n"
        "        self._jobs, self._done = queue.Queue(), queue.Queue()\n"
        "        self._thread = threading.Thread(target=self._run_loop, daemon=True)\n"
        "        self._thread.start()\n"
        "    def _run_loop(self):\n"
        "        while True:\n"
        "            self._done.put(sum(range(self._jobs.get())))\n"
        "    def submit_array(self, n):\n"
        "        self._jobs.put(n)\n"
        "        return self._done.get(timeout=60)\n")
    return fake


def _run_fake(tmp_path: Path, warmup: int) -> list[str]:
    """Five submits through the sitecustomize, with `warmup` of them before the window."""
    script = "from fttree.api import FTTreeAllreduce as A\na = A()\nfor _ in range(5): a.submit_array(400000)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(SITE), str(_fake_api(tmp_path)))),
               FTTREE_YARDSTICK_DIR=str(tmp_path), FTTREE_YARDSTICK_WARMUP=str(warmup))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60, cwd=tmp_path)
    written = list(tmp_path.glob("cpu-*"))
    return written[0].read_text().split() if written else []


def test_each_worker_counts_its_cpu_from_its_first_submit_to_its_last(tmp_path: Path) -> None:
    """The sitecustomize both commits' workers load: it wraps FTTreeAllreduce.submit_array
    when fttree.api is imported and writes 'seconds calls-1 loop_seconds' at exit, the last
    being the CPU time of the object's event-loop thread (`_thread`) over the same span."""
    seconds, calls, loop_seconds = _run_fake(tmp_path, warmup=0)
    assert int(calls) == 4  # the steps between the first submit and the last
    assert float(seconds) > 0
    # the sums of submits 1 to 4 ran on the thread within the span (the 5th after its mark)
    assert 0 < float(loop_seconds) <= float(seconds)


def test_the_warm_up_submits_are_left_out_of_the_window(tmp_path: Path) -> None:
    """With a warm-up of 2 the window opens at the third submit: two steps between it and the
    fifth; a warm-up as long as the run leaves no window, and the worker reports nothing."""
    for name in ("two", "all"):
        (tmp_path / name).mkdir()
    seconds, calls, _loop = _run_fake(tmp_path / "two", warmup=2)
    assert int(calls) == 2
    assert float(seconds) > 0
    assert _run_fake(tmp_path / "all", warmup=5) == []
