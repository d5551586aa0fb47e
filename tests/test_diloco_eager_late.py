"""The eager update (overlap="eager") for a worker whose term an average does not hold: its
contribution did not make the sum, as a straggler's under straggler_policy="deadline" does not
(the others' sum, contributors without it; the worker itself thinks it contributed). When that
average lands the worker's correction takes out w(t-1) (docs/diloco.md, "Eager with sparse"):
1/|S(t-1)| where the average holds the worker; where it left it out, with sparse the weight its
stand-in went in with (settle put the sent part back into the accumulator, to be sent and stood
in again), dense nothing (it keeps its stand-in: its round is lost otherwise).

Which rank is late is decided explicitly, never by timing: the late rank's handle submits that
outer step as an empty contribution (contribute=False at the allreduce), or, under the deadline
policy, only once the others have finished the step without it. Every worker's model is checked
against the formulas written out in numpy, the late rank's against taking 1/|S(t-1)| out (what
it must not be), and the global parameters alike bit for bit on every worker after every outer
step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import fttree
from fttree.net.node import StepResult
from tests.conftest import cluster, run_threads
from tests.test_diloco import SETTINGS
from tests.test_diloco_eager import digest
from tests.test_diloco_eager_sparse import (
    CHUNK,
    CHUNKS,
    CONFIG,
    INNER_LR,
    MU,
    NUMEL,
    OUTER_LR,
    STEP_PER_RMS,
    OuterSGD,
    Q,
    flat_of,
    indices,
    make_linear,
    start,
    target,
)

WORKERS, ROUNDS, H = 3, 5, 4
LATE_RANK, LATE_STEP = 2, 2  # round 2's average leaves rank 2 out (round 0 sends nothing with sparse)
EVERYONE = tuple(range(WORKERS))
CONTRIBUTORS = [EVERYONE if t != LATE_STEP else tuple(k for k in EVERYONE if k != LATE_RANK)
                for t in range(ROUNDS)]
GRACE_S = 0.2  # straggler_grace_s: how long past the others the root waits for the late rank
DEADLINE_S = 60.0  # how long the late rank waits for the others to finish its late step


def reference(sparse: bool, left_out_weight: str = "docs",
              contributors: list[tuple[int, ...]] = CONTRIBUTORS) -> list[np.ndarray]:
    """ROUNDS rounds of eager DiLoCo (sparse: eager sparse), round t's average holding the
    workers S(t) = contributors[t]. Worker k, round t, n = |S(t-1)| (WORKERS at t = 0): it trains
    from theta to theta', own = theta - theta'; dense s = own; sparse u = a + own (a with its
    sent part put back if S(t-1) left it out), s = Q-level multiples of the shared scale at the
    round's indices, a = u - s. When round t-1's average (over S(t-1)) lands, G takes the shared
    outer step on it and the scale becomes 0.6 x the mean RMS of u over S(t-1); the correction
    takes its own outer SGD on e = s(t) / n - s(t-1) * w(t-1); the model is G + c - a.
    w(t-1) = 1 / |S(t-1)| if S(t-1) holds k, else by `left_out_weight`: "docs" (sparse: the
    weight its stand-in went in with; dense: 0), "share" (1 / |S(t-1)|, as if the average held
    it) or "stand-in" (the weight its stand-in went in with, dense too). Returns each worker's
    model after the last round."""
    pad = CHUNKS * CHUNK - NUMEL if sparse else 0
    glob, outer = start(), OuterSGD()
    theta = [start() for _ in range(WORKERS)]
    acc = [np.zeros(NUMEL + pad) for _ in range(WORKERS)]
    corr = [np.zeros(NUMEL) for _ in range(WORKERS)]
    corr_sgd = [OuterSGD() for _ in range(WORKERS)]
    previous: list[tuple[np.ndarray, float] | None] = [None] * WORKERS  # s(t-1), the weight it went in with
    last_sent: list[np.ndarray] = [np.zeros(NUMEL + pad) for _ in range(WORKERS)]
    scale = np.zeros(CHUNKS)
    pending: tuple[np.ndarray, np.ndarray] | None = None  # the average in flight, the RMS it carries
    for t in range(ROUNDS):
        if pending is not None:  # round t-1's average lands
            glob = glob + outer.delta(pending[0])
            scale = STEP_PER_RMS * pending[1]
        held = contributors[t - 1] if t > 0 else EVERYONE
        n = len(held)
        idx = indices(t)
        sent, rms = [], []
        for k in range(WORKERS):
            if sparse and k not in held:  # settle: the sum left its sent part out, it goes back
                acc[k] = acc[k] + last_sent[k]
            end = theta[k].copy()
            for i in range(t * H, t * H + H):
                end = end - INNER_LR * (end - target(k, i))
            own = np.concatenate([theta[k] - end, np.zeros(pad)])
            if sparse:
                u = (acc[k] + own).reshape(CHUNKS, CHUNK)
                rms.append(np.sqrt((u ** 2).mean(axis=1)))
                s = np.zeros_like(u)
                if scale.any():
                    vals = np.take_along_axis(u, idx, axis=1)
                    levels = np.clip(np.round(vals / scale[:, None]), -Q, Q) * scale[:, None]
                    np.put_along_axis(s, idx, levels, axis=1)
                acc[k] = (u - s).reshape(-1)
                s = s.reshape(-1)
            else:
                s = own
            sent.append(s)
            last_sent[k] = s
            e = s[:NUMEL] / n
            if previous[k] is not None:
                before, went_in = previous[k]  # type: ignore[misc]
                if k in held or left_out_weight == "share":
                    w = 1.0 / n
                elif left_out_weight == "stand-in" or sparse:
                    w = went_in
                else:
                    w = 0.0
                e = e - before * w
            previous[k] = (s[:NUMEL], 1.0 / n)
            corr[k] = corr[k] + corr_sgd[k].delta(e)
            theta[k] = glob + corr[k] - acc[k][:NUMEL]
        members = contributors[t]
        pending = ((sum(sent[k] for k in members) / len(members))[:NUMEL],
                   np.mean([rms[k] for k in members], axis=0) if sparse else np.zeros(CHUNKS))
    return theta


def left_out_of(ar: fttree.FTTreeAllreduce, outer_steps: Callable[[], int]) -> Callable[..., Future[StepResult]]:
    """`ar.submit_array` that submits the outer step LATE_STEP's buckets (closable: averaged
    gradients) as an empty contribution: the sum and its contributors leave this rank out, as
    they leave out a straggler's contribution that came after the step closed."""
    submit = ar.submit_array

    def submit_array(flat: np.ndarray, signature: str, *, contribute: bool = True, closable: bool = False,
                     **kwargs: Any) -> Future[StepResult]:
        if closable and outer_steps() == LATE_STEP:
            contribute = False
        return submit(flat, signature, contribute=contribute, closable=closable, **kwargs)
    return submit_array


def after(ar: fttree.FTTreeAllreduce, outer_steps: Callable[[], int], others_done: threading.Event
          ) -> Callable[..., Future[StepResult]]:
    """`ar.submit_array` that submits the outer step LATE_STEP's buckets only once every other
    rank has finished that outer step: under straggler_policy="deadline" the group closed it
    without this rank, which is late for it whatever the machine's load."""
    submit = ar.submit_array

    def submit_array(flat: np.ndarray, signature: str, **kwargs: Any) -> Future[StepResult]:
        if kwargs.get("closable") and outer_steps() == LATE_STEP and not others_done.wait(DEADLINE_S):
            raise AssertionError(f"the other ranks did not finish outer step {LATE_STEP} without rank {ar.rank} "
                                 f"within {DEADLINE_S} s")
        return submit(flat, signature, **kwargs)
    return submit_array


@dataclass
class Run:
    models: dict[int, np.ndarray] = field(default_factory=dict)  # each worker's model after the last round
    globals_after: dict[int, list[str]] = field(default_factory=lambda: {k: [] for k in EVERYONE})
    contributors: dict[int, list[tuple[int, ...]]] = field(default_factory=lambda: {k: [] for k in EVERYONE})
    late: dict[int, list[tuple[int, ...]]] = field(default_factory=lambda: {k: [] for k in EVERYONE})


def run(sparse: bool, monkeypatch: pytest.MonkeyPatch, lateness: str, **settings: Any) -> Run:
    """WORKERS workers (threads) for ROUNDS eager rounds, LATE_RANK left out of outer step
    LATE_STEP by `lateness`: "explicit" (left_out_of) or "deadline" (after)."""
    out = Run()
    others_done = threading.Event()
    finished: set[int] = set()
    lock = threading.Lock()

    def record(rank: int, o: fttree.DiLoCo) -> None:
        assert o.last_step is not None
        out.globals_after[rank].append(digest([g for _, g in o.global_parameters]))
        out.contributors[rank].append(o.last_step.contributors)
        out.late[rank].append(o.last_step.late)
        if rank != LATE_RANK and len(out.contributors[rank]) == LATE_STEP + 1:
            with lock:
                finished.add(rank)
                if len(finished) == WORKERS - 1:
                    others_done.set()

    def worker(rank: int, ar: fttree.FTTreeAllreduce) -> None:
        model = make_linear()
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=INNER_LR), allreduce=ar, sync_every=H,
                            outer_lr=OUTER_LR, outer_momentum=MU, overlap="eager",
                            compression=CONFIG if sparse else None)
        opt.outer_listeners.append(lambda o: record(rank, o))
        if rank == LATE_RANK:
            def steps() -> int:
                return opt.outer_steps
            late = left_out_of(ar, steps) if lateness == "explicit" else after(ar, steps, others_done)
            monkeypatch.setattr(ar, "submit_array", late)
        params = list(model.parameters())
        for i in range(ROUNDS * H):
            goal = torch.from_numpy(target(rank, i)).float()
            opt.zero_grad()
            (0.5 * ((torch.cat([p.reshape(-1) for p in params]) - goal) ** 2).sum()).backward()
            opt.step()
        out.models[rank] = flat_of(params)
        opt.flush()

    with cluster(WORKERS, **SETTINGS, **settings) as ars:
        run_threads([lambda r=r: worker(r, ars[r]) for r in range(WORKERS)])  # type: ignore[misc]
    # every outer step left the same global parameters on every worker, bit for bit, and the
    # same contributors
    assert all(len(out.globals_after[k]) == ROUNDS for k in EVERYONE), out.globals_after
    assert len({tuple(out.globals_after[k]) for k in EVERYONE}) == 1, out.globals_after
    assert len({tuple(out.contributors[k]) for k in EVERYONE}) == 1, out.contributors
    return out


def check_models(sparse: bool, got: dict[int, np.ndarray], contributors: list[tuple[int, ...]]) -> list[str]:
    """Every worker's model is what the formulas give for these contributors, and a left-out
    worker's is far from what taking 1/|S| (or, dense, its stand-in weight) out would give,
    wherever the formulas differ (with sparse they do not where 1/|S(t-1)| is the weight the
    stand-in went in with, 1/|S(t-2)|). Returns the wrong weights told apart, once per worker."""
    want = reference(sparse, contributors=contributors)
    wrong = {"left-out weight 1/|S|": reference(sparse, "share", contributors)}
    if not sparse:  # dense keeps the stand-in of a round the average left out
        wrong["dense stand-in taken out"] = reference(sparse, "stand-in", contributors)
    tolerance = 1e-5  # float32 arithmetic against float64 (a flipped sparse level would be about 1e-2 off)
    for k in EVERYONE:
        near = float(np.abs(got[k] - want[k]).max())
        assert near < tolerance, (k, near)
    told_apart = []
    for name, other in wrong.items():
        for k in EVERYONE:
            apart = float(np.abs(other[k] - want[k]).max())
            if apart > 1000 * tolerance:
                far = float(np.abs(got[k] - other[k]).max())
                assert far > 100 * tolerance, (name, k, far)
                told_apart.append(name)
    return told_apart


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_worker_left_out_of_an_eager_average_follows_the_formulas(
        sparse: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 is left out of round 2's average (the first whose sparse messages carry values):
    its stand-in went in with 1/3, the average it missed has |S| = 2, and round 3's stand-ins
    go in with 1/2 and come out with 1/3."""
    out = run(sparse, monkeypatch, "explicit")
    # the average of round LATE_STEP left the late rank out, on every rank; every other held everyone
    assert all(out.contributors[k] == CONTRIBUTORS for k in EVERYONE), out.contributors
    # ...and each wrong weight changes the late rank's model, and only its
    assert check_models(sparse, out.models, CONTRIBUTORS) == (["left-out weight 1/|S|"] if sparse else
                                                                ["left-out weight 1/|S|", "dense stand-in taken out"])


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_an_eager_straggler_under_the_deadline_policy_follows_the_formulas(
        sparse: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through the straggler path: LATE_RANK submits outer step LATE_STEP only after
    the others have finished it (closed without it after straggler_grace_s). A load that makes
    some rank late for another step too only changes the contributors the formulas follow."""
    out = run(sparse, monkeypatch, "deadline", straggler_policy="deadline", straggler_grace_s=GRACE_S)
    seen = out.contributors[0]
    assert seen[LATE_STEP] == tuple(k for k in EVERYONE if k != LATE_RANK), seen
    assert all(LATE_RANK in out.late[k][LATE_STEP] for k in EVERYONE), out.late
    told_apart = check_models(sparse, out.models, seen)
    if seen == CONTRIBUTORS:  # no rank late by accident: 1/|S| = 1/2 is not the stand-in's 1/3
        assert "left-out weight 1/|S|" in told_apart
