"""The training examples run end to end as documented (small sizes)."""

from __future__ import annotations

import importlib.util
import json
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, check=False)


def test_train_mlp_goes_on_through_a_cut_link() -> None:
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "3", "--steps", "6", "--timeout", "0.2",
                       "--faults", "cut 1-0 @4..6", "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6
    # Rank 1's data must reach rank 0 the other way round: lost and relayed (a recovery) at the
    # first step the cut bites, or the planned way once link memory marks 1->0 failed (a detour).
    assert summary["recoveries"] + summary["detours"] > 0, f"the cut link was never worked around: {summary}"
    # ...and no step may pay for the cut with a worker's batch: each sum holds all three.
    assert summary["fewest_contributors"] == 3, f"a step lost a worker's batch to a cut link: {summary}"
    assert summary["test_accuracy"] > 0.3  # 6 SGD steps on digits already beat chance (0.1)


def test_train_mlp_with_diloco_survives_a_crash_and_a_restart_and_uses_every_sample_once() -> None:
    """`--diloco 4 --compression int8`: a worker killed in round 3 leaves that round's average;
    its samples not yet committed go to the survivors; started again (--restart), it takes the
    state and the sampler's history from a peer and trains again; every epoch finished
    committed each sample exactly once, those the restarted process waited through included."""
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "4", "--steps", "40", "--diloco", "4",
                       "--compression", "int8", "--faults", "crash 2 @3", "--restart", "2", "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary, audits = json.loads(lines[-1]), json.loads(lines[-2])["audits"]
    assert summary["steps"] >= 10  # rounds: past --steps until the restarted rank is back
    assert summary["fewest_contributors"] == 3
    assert summary["last_contributors"] == [0, 1, 2, 3], summary
    assert summary["exactly_once"], audits
    left = next(i for i, a in enumerate(audits) if a["departed"] == [2] and a["complete"])
    assert audits[left]["answered"] == [0, 1, 3]
    assert audits[-1]["answered"] == [0, 1, 2, 3], audits[-1]
    assert all(a["repeated"] == 0 for a in audits), audits
    assert summary["test_accuracy"] > 0.6


def test_train_mlp_takes_a_restarted_worker_back_and_uses_every_sample_once() -> None:
    """Data-parallel `--restart`: rank 2 dies at step 3; its process started again waits inside
    ElasticJob.epochs() for the state and the sampler's history (taking part in the per-step
    flag and in the audits of the epochs that end meanwhile), then trains again; every epoch
    finished committed each sample exactly once."""
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "4", "--steps", "20", "--faults", "crash 2 @3",
                       "--restart", "2", "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary, audits = json.loads(lines[-1]), json.loads(lines[-2])["audits"]
    assert summary["last_contributors"] == [0, 1, 2, 3], summary
    assert summary["exactly_once"], audits
    assert any(a["departed"] == [2] and a["complete"] for a in audits), audits
    assert audits[-1]["answered"] == [0, 1, 2, 3], audits[-1]
    assert all(a["repeated"] == 0 for a in audits), audits


def train_mlp_module() -> Any:
    """examples/train_mlp.py as a module, to check its command line without starting a process
    (each would import torch again: seconds on a loaded machine)."""
    spec = importlib.util.spec_from_file_location("train_mlp_example", EXAMPLES / "train_mlp.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What train_mlp.py says on stderr when it refuses `argv` (it must exit non-zero)."""
    module = train_mlp_module()
    with pytest.MonkeyPatch.context() as env:
        for name in ("FTTREE_RANK", "RANK"):  # as the launching command, not a worker
            env.delenv(name, raising=False)
        with pytest.raises(SystemExit) as exited:
            module.parse_args(list(argv))
    assert exited.value.code != 0
    return capsys.readouterr().err


def test_train_mlp_refuses_a_restart_it_cannot_carry_out(capsys: pytest.CaptureFixture[str]) -> None:
    for extra, says in ((["--restart", "7"], "not a rank of 4 workers"),
                        (["--restart", "1", "--diloco", "4", "--overlap"], "--restart with --overlap"),
                        (["--restart", "1", "--comm", "gloo"], "--restart needs --comm fttree")):
        err = refused(capsys, "-n", "4", *extra)
        assert says in err, err
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "4", "--restart", "7")  # and as a command
    assert proc.returncode != 0
    assert "not a rank of 4 workers" in proc.stderr, proc.stderr


@pytest.mark.parametrize("script", ["train_mlp.py", "train_ddp.py", "bench_torch.py", "diloco_overlap.py"])
def test_examples_have_help(script: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each script run as `python SCRIPT --help` (as __main__, in this process: a process of
    its own would import torch again) prints its usage and exits 0."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put examples/ first
    for name in ("FTTREE_RANK", "RANK"):  # as the launching command, not a worker
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capsys.readouterr()
    assert exited.value.code in (0, None), out.err
    assert "usage:" in out.out


def test_train_mlp_leaves_a_straggler_out_and_deals_its_samples_again_exactly_once() -> None:
    """`--slow 2:2 --straggler-policy deadline`: rank 2 computes twice as slowly; steps close
    without it (it is the rank left out most), it skips the steps it is behind, nobody is
    evicted, and every finished epoch committed each sample exactly once (its batches dealt
    again to the others)."""
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "4", "--steps", "30", "--compute-s", "0.1",
                       "--slow", "2:2", "--straggler-policy", "deadline", "--straggler-grace", "0.05",
                       "--synthetic", "2000", "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary, audits = json.loads(lines[-1]), json.loads(lines[-2])["audits"]
    late = summary["late_steps"]
    assert late.get("2", 0) > 0, summary
    # the slow rank is the one left out most; on a loaded machine another rank may miss the 50 ms
    # grace now and then too (a CI run beside burners saw a step of 2), which the policy allows
    assert late["2"] == max(late.values()), summary
    assert summary["fewest_contributors"] >= 2, summary
    assert summary["exactly_once"], audits
    assert sum(a["complete"] for a in audits) >= 2, audits
    assert all(a["departed"] == [] and a["answered"] == [0, 1, 2, 3] for a in audits), audits  # nobody evicted


def test_train_mlp_waits_for_a_rank_computing_for_longer_than_the_step_deadline() -> None:
    """Slow is not broken, over TCP: with the wait policy rank 2 computes 4 s a step while the
    others give up on a step after 3 s (their root after 1.5 s). It says it is still computing
    when pinged, the others wait for it, and every step holds every rank's gradients."""
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "3", "--steps", "2", "--compute-s", "0.2",
                       "--slow", "2:20", "--step-timeout", "3", "--synthetic", "600", "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["fewest_contributors"] == 3, summary
    assert summary["notes"].get("still_computing", 0) >= 2, summary  # rank 0 waited past its deadline


def test_train_mlp_names_a_bad_straggler_setting(capsys: pytest.CaptureFixture[str]) -> None:
    for extra, says in ((["--slow", "9"], "not a rank of 4 workers"), (["--slow", "x"], "--slow 'x'"),
                        (["--slow", "1:0.5"], "factor >= 1"),
                        (["--straggler-policy", "deadline", "--comm", "gloo"], "fttree's")):
        err = refused(capsys, "-n", "4", *extra)
        assert says in err, err


def test_train_mlp_passes_sparse_options_and_names_bad_ones(capsys: pytest.CaptureFixture[str]) -> None:
    module = train_mlp_module()
    args = module.parse_args(["-n", "2", "--diloco", "4", "--compression", "sparse",
                              "--sparse", "density=0.125,bits=3,index=random"])
    import fttree
    assert module.compression_of(args) == fttree.Sparse(density=0.125, bits=3, index="random")
    for extra, says in ((["--compression", "sparse", "--sparse", "dense=1"], "'dense=1' is not one of"),
                        (["--compression", "sparse", "--sparse", "bits=two"], "'two' is not a int"),
                        (["--compression", "sparse", "--sparse", "bits=5"], "bits must be one of"),
                        (["--compression", "int8", "--sparse", "bits=3"], "it needs --compression sparse")):
        err = refused(capsys, "-n", "2", "--diloco", "4", *extra)
        assert says in err, err
    assert "--eval-global evaluates DiLoCo's global parameters" in refused(capsys, "-n", "2", "--eval-global")


def test_train_mlp_times_training_up_to_its_last_step_not_the_epoch_audit_after_it() -> None:
    """The compute share's wall time (`wall_s`) ends where rank 0 reported its last step: the
    audit of the epoch the run stops in (one allreduce of a count per sample: 4 MB for the
    bench's million samples, 6.5 s behind 10 Mbit/s) comes after and is not training. The last
    evaluation starts after that report, so its time `t` (evaluations left out alike) is at
    least `wall_s`; timed to the process's end, `wall_s` also held the audit and exceeded it."""
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "3", "--steps", "8", "--diloco", "4",
                       "--compression", "sparse", "--eager", "--synthetic", "400000", "--eval-every", "1",
                       "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    docs = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    evals = [d["eval"] for d in docs if "eval" in d]
    summary = docs[-1]
    assert [e["step"] for e in evals] == [1, 2]
    assert 0 < summary["compute_s"] <= summary["wall_s"] <= evals[-1]["t"] + 0.001, (summary, evals)


def _evals(*args: str) -> list[float]:
    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "3", "--steps", "8", "--diloco", "4", "--compression",
                       "sparse", "--eval-every", "1", "--json", "--warmup", "0", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads(line)["eval"]["accuracy"] for line in proc.stdout.splitlines() if line.startswith('{"eval"')]


@pytest.mark.parametrize("mode", [(), ("--eager",)])
def test_train_mlp_eval_global_evaluates_the_group_s_model_not_rank_0_s(mode: tuple[str, ...]) -> None:
    """Sparse sends nothing in its first round (no scale is known yet), so the global parameters
    after it are the start's: --eval-global reports the untrained model's accuracy there, where
    rank 0's own model already holds its round of training. With --eager the step is reported a
    round later, while the next one is in flight: the copy taken when it landed is evaluated."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from mlp_common import accuracy, load_data, thesis_mlp
    finally:
        sys.path.remove(str(EXAMPLES))
    data = load_data(None, None, 0)
    start = round(accuracy(thesis_mlp(seed=0, hidden=512), data.x_test, data.y_test), 4)
    own, group = _evals(*mode), _evals(*mode, "--eval-global")
    assert len(own) == len(group) == 2
    assert group[0] == start < own[0], (start, own, group)
    assert group[1] != start  # the second round sent the blocks the first one's levels chose
