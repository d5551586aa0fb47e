"""`fttree status` against real workers: in-process nodes, and a `fttree launch` of 5 processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner

from fttree.status.cli import HTTP_PORT_OFFSET, merge_link, status, targets_from
from fttree.tools.demo import contribution, expected_sum

from .conftest import cluster, free_port


def _steps(handles: list[Any], steps: range, size: int = 2_000) -> None:
    for step in steps:
        futures = [h.allreduce_async(contribution(h.rank, step, size)) for h in handles]
        for fut in futures:
            assert np.array_equal(fut.result(timeout=30), expected_sum(len(handles), step, size))


def _line(output: str, *needles: str) -> str:
    found = [line for line in output.splitlines() if all(n in line for n in needles)]
    assert found, f"no line with {needles} in:\n{output}"
    return found[0]


def test_status_draws_the_tree_with_the_cut_link_and_the_recovery(tmp_path: Path) -> None:
    runner = CliRunner()
    # the cut outlasts the steps, so at close ranks 0 and 1 cannot tell each other they are done
    # (rank 2, which would pass it on, closed first): each waits its step timeout
    with cluster(3, timeout_s=0.1, step_timeout_s=5.0, http_port=0, faults="cut 1-0 @1") as hs:
        _steps(hs, range(2))
        (tmp_path / "http.txt").write_text("".join(f"{h.http_address}\n" for h in hs))
        result = runner.invoke(status, ["--launch-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        out = result.output
        assert "\x1b[" not in out  # not a terminal: plain text
        assert "3 workers  3/3 answering  step 1" in _line(out, "fttree status")
        assert _line(out, "rank 0").startswith("rank 0  step 1 idle")
        assert "failed" in _line(out, "1-0", "rank 1")
        assert "up" in _line(out, "2-0", "rank 2")
        assert _line(out, "↳").strip("│ ").startswith("↳ step 1:")
        assert "backup links: 2-1 up" in out
        assert "in-process faults on ranks [0, 1, 2]: cut 1-0 @1" in out
        assert "rank 0: step 1: data 1->0 lost, forwarded by 2" in out

        coloured = runner.invoke(status, ["--launch-dir", str(tmp_path), "--color"])
        assert "\x1b[31m" in _line(coloured.output, "1-0", "rank 1")  # failed is red

        raw = runner.invoke(status, ["--launch-dir", str(tmp_path), "--json"])
        docs = json.loads(raw.output)
        assert [d["rank"] for d in docs] == [0, 1, 2]

        watched = runner.invoke(status, ["--launch-dir", str(tmp_path), "--watch", "--count", "2", "--interval",
                                         "0.05"])
        assert watched.exit_code == 0
        assert watched.output.count("fttree status") == 2

        hs[2].close()
        gone = runner.invoke(status, ["--launch-dir", str(tmp_path), "--timeout", "2"])
        assert gone.exit_code == 1
        assert "2/3 answering" in gone.output
        assert "rank 2  unreachable" in gone.output


def test_targets_come_from_peers_with_the_port_offset(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("10.0.0.1:29500\n# comment\n10.0.0.2:29501\n")
    assert targets_from(peers, None, HTTP_PORT_OFFSET) == ["10.0.0.1:30500", "10.0.0.2:30501"]
    assert targets_from(None, tmp_path, 7) == ["10.0.0.1:29507", "10.0.0.2:29508"]  # no http.txt: peers.txt


def test_merge_trusts_the_ends_of_a_link_over_observers() -> None:
    up = {"name": "2-0", "state": "up", "since_step": None, "rtt_ms": 0.1}
    suspect = {"name": "2-0", "state": "suspect", "since_step": 3, "reason": "relayed", "rtt_ms": None}
    docs = {0: {"links": [up], "observed_links": []}, 1: {"links": [], "observed_links": [suspect]},
            2: {"links": [up], "observed_links": []}}
    assert merge_link("2-0", (2, 0), docs)["state"] == "up"
    del docs[0], docs[2]
    assert merge_link("2-0", (2, 0), docs)["state"] == "suspect"  # no end answered: the observer's view
    assert merge_link("2-0", (2, 0), {})["state"] == "unknown"


def _get(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            doc = json.loads(resp.read())
            return doc if isinstance(doc, dict) else None
    except OSError:
        return None


def test_status_of_a_five_worker_launch_with_a_cut_link(tmp_path: Path) -> None:
    world, steps = 5, 4
    cmd = [sys.executable, "-m", "fttree", "launch", "-n", str(world), "--steps", str(steps), "--size", "2000",
           "--timeout", "0.2", "--faults", f"cut 1-0 @2..{steps - 1}", "--launch-dir", str(tmp_path),
           "--port", str(free_port()), "--http-port", str(free_port()), "--linger", "60"]
    # Ctrl-C as from a terminal: a suite started in the background (nohup, `&` in a script)
    # passes SIGINT on ignored, and an ignored SIGINT stays ignored across exec.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        end = time.monotonic() + 90
        done: set[int] = set()
        while len(done) < world:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < end, f"only ranks {sorted(done)} finished {steps} steps"
            http = tmp_path / "http.txt"
            targets = http.read_text().split() if http.is_file() else []
            for rank, target in enumerate(targets):
                doc = _get(f"http://{target}/status")
                if doc is not None and doc["step"]["completed"] + doc["step"]["failed"] >= steps:
                    done.add(rank)
            time.sleep(0.2)
        result = CliRunner().invoke(status, ["--launch-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        out = result.output
        assert f"{world} workers  {world}/{world} answering  step {steps - 1}" in out
        assert "failed" in _line(out, "1-0", "rank 1")
        for rank in range(world):
            assert f"rank {rank}  step {steps - 1} idle" in out
        assert "rank 0: step 2: data 1->0 lost, forwarded by 2" in out
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C ends the lingering workers at once, not after --linger 60
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)  # launch's own cleanup stops the lingering workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
