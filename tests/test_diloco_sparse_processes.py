"""Sparse DiLoCo across real worker processes (examples/train_mlp.py): a worker killed in its
round leaves that round's average, the process started again takes the global parameters, the
outer momentum and the shared scales from a peer (its accumulator starts empty) and contributes
again, and every epoch finished used each sample exactly once."""

from __future__ import annotations

import json

from tests.test_torch_examples import EXAMPLES, run_example


def test_train_mlp_with_sparse_diloco_survives_a_crash_and_a_restart() -> None:
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "4", "--steps", "40", "--diloco", "4",
                       "--compression", "sparse", "--faults", "crash 2 @3", "--restart", "2", "--json",
                       "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary, audits = json.loads(lines[-1]), json.loads(lines[-2])["audits"]
    assert summary["steps"] >= 10  # rounds: past --steps until the restarted rank is back
    assert summary["fewest_contributors"] == 3
    assert summary["last_contributors"] == [0, 1, 2, 3], summary
    assert summary["exactly_once"], audits
    assert all(a["repeated"] == 0 for a in audits), audits
    assert summary["test_accuracy"] > 0.6, summary
