"""DiLoCo's eager outer step with sparse pseudo-gradients (overlap="eager", compression=Sparse):
each worker's stand-in for its term of the average in flight is what it sent (the dequantised
values on the round's shared indices of its accumulator plus its round's pseudo-gradient), the
rest stays in its accumulator, and its model is the global parameters plus its correction less
its accumulator (docs/diloco.md, "Eager with sparse"). Checked against those formulas written
out in numpy; the global parameters alike bit for bit after every outer step; a diverged worker
skipped for one round as without eager."""

from __future__ import annotations

import json

import numpy as np
import torch

import fttree
from fttree.training.sparse import hash_seed
from tests.conftest import cluster, run_threads
from tests.test_diloco import SETTINGS
from tests.test_diloco_eager import digest

WORKERS, ROUNDS, H = 3, 5, 4
INNER_LR, OUTER_LR, MU = 0.1, 0.7, 0.9
CONFIG = fttree.Sparse(density=1 / 4, bits=3, index="random", block=8, seed=5)  # the formulas below are its rule
Q, STEP_PER_RMS = 3, 0.6  # 3 bits: levels -3..3, a level is 0.6 of the chunk's mean RMS
SHAPES = [(8, 32), (8,)]  # torch.nn.Linear(32, 8): 264 values, 9 chunks of 32 (the last one padded)
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
CHUNK = 32  # block / density
K = 8  # coordinates sent per chunk: block
CHUNKS = -(-NUMEL // CHUNK)


def start() -> np.ndarray:
    return np.random.default_rng(0).normal(size=NUMEL) * 0.3


def target(rank: int, step: int) -> np.ndarray:
    """Where rank's step pulls its parameters: its own place plus noise (the inner loss is
    half the squared distance to it, so the gradient is the parameters minus it)."""
    own = np.random.default_rng(1000 + rank).normal(size=NUMEL)
    return own + 0.3 * np.random.default_rng(rank * 100_003 + step).normal(size=NUMEL)


def indices(step: int) -> np.ndarray:
    """The round's shared index set, [CHUNKS, K] into each chunk: the codec's random rule (K
    per chunk, drawn from the seed and the outer step count, never the padding), which
    tests/test_diloco_sparse.py checks to be alike on every worker."""
    g = torch.Generator().manual_seed(hash_seed(CONFIG.seed, step))
    scores = torch.rand(CHUNKS, CHUNK, generator=g)
    scores.view(-1)[NUMEL:] = -3.0
    return scores.topk(K, dim=1).indices.sort(dim=1).values.numpy()


class OuterSGD:
    """SGD with Nesterov momentum, as torch.optim.SGD steps it."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None

    def delta(self, grad: np.ndarray) -> np.ndarray:
        self.buf = grad.copy() if self.buf is None else MU * self.buf + grad
        return -OUTER_LR * (grad + MU * self.buf)


def reference(stand_in: str = "sent", keep_accumulator: bool = True) -> tuple[list[np.ndarray], np.ndarray]:
    """ROUNDS rounds of eager sparse DiLoCo, every worker in every average. Worker k, round t:
    trains from theta to theta', own = theta - theta'; u = a + own; it sends s = Q-level
    multiples of the shared scale at the round's indices, a = u - s. When the average of round
    t-1 lands the global parameters G take the shared outer step on it and the shared scale
    becomes 0.6 x the workers' mean RMS of u in each chunk; the correction c takes its own outer
    SGD on e = s(t) / n - s(t-1) / n; the model is G + c - a.
    `stand_in="own"` stands the raw pseudo-gradient in (and takes it out) instead of the sent
    part; `keep_accumulator=False` leaves the accumulator out of the model: the two ways of
    getting it wrong. Returns each worker's model after the last round and G then (the last
    average still in flight)."""
    pad = CHUNKS * CHUNK - NUMEL
    glob, outer = start(), OuterSGD()
    theta = [start() for _ in range(WORKERS)]
    acc = [np.zeros(NUMEL + pad) for _ in range(WORKERS)]
    corr = [np.zeros(NUMEL) for _ in range(WORKERS)]
    corr_sgd = [OuterSGD() for _ in range(WORKERS)]
    previous: list[np.ndarray | None] = [None] * WORKERS
    scale = np.zeros(CHUNKS)
    pending: tuple[np.ndarray, np.ndarray] | None = None  # the average in flight, the RMS it carries
    for t in range(ROUNDS):
        sent, rms = [], []
        if pending is not None:  # round t-1's average lands
            glob = glob + outer.delta(pending[0])
            scale = STEP_PER_RMS * pending[1]
        idx = indices(t)
        for k in range(WORKERS):
            end = theta[k].copy()
            for i in range(t * H, t * H + H):
                end = end - INNER_LR * (end - target(k, i))
            own = np.concatenate([theta[k] - end, np.zeros(pad)])
            u = (acc[k] + own).reshape(CHUNKS, CHUNK)
            rms.append(np.sqrt((u ** 2).mean(axis=1)))
            s = np.zeros_like(u)
            if scale.any():
                vals = np.take_along_axis(u, idx, axis=1)
                np.put_along_axis(s, idx, np.clip(np.round(vals / scale[:, None]), -Q, Q) * scale[:, None], axis=1)
            acc[k] = (u - s).reshape(-1)
            sent.append(s.reshape(-1))
            mine = sent[k][:NUMEL] if stand_in == "sent" else own[:NUMEL]
            e = mine / WORKERS - (previous[k] / WORKERS if previous[k] is not None else 0.0)
            previous[k] = mine
            corr[k] = corr[k] + corr_sgd[k].delta(e)
            theta[k] = glob + corr[k] - (acc[k][:NUMEL] if keep_accumulator else 0.0)
        pending = (sum(sent) / WORKERS)[:NUMEL], np.mean(rms, axis=0)
    return theta, glob


def set_flat(params: list[torch.Tensor], flat: np.ndarray) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(torch.from_numpy(flat[offset:offset + p.numel()].reshape(p.shape)))
            offset += p.numel()


def flat_of(params: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in params]).double().numpy()


def make_linear() -> torch.nn.Linear:
    model = torch.nn.Linear(32, 8)
    set_flat(list(model.parameters()), start())
    return model


def test_eager_sparse_follows_the_formulas_and_keeps_the_global_parameters_alike() -> None:
    want, glob_before = reference()
    wrong = {"stand-in = raw pseudo-gradient": reference(stand_in="own")[0],
             "model without its accumulator": reference(keep_accumulator=False)[0]}
    got: dict[int, np.ndarray] = {}
    flushed: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    after_step: dict[int, list[str]] = {k: [] for k in range(WORKERS)}

    def worker(rank: int, ar: fttree.FTTreeAllreduce) -> None:
        model = make_linear()
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=INNER_LR), allreduce=ar, sync_every=H,
                            outer_lr=OUTER_LR, outer_momentum=MU, overlap="eager", compression=CONFIG)
        opt.outer_listeners.append(lambda o: after_step[rank].append(digest([g for _, g in o.global_parameters])))
        params = list(model.parameters())
        for i in range(ROUNDS * H):
            goal = torch.from_numpy(target(rank, i)).float()
            opt.zero_grad()
            flat = torch.cat([p.reshape(-1) for p in params])
            (0.5 * ((flat - goal) ** 2).sum()).backward()
            opt.step()
            if (i + 1) % H == 0 and i + 1 > H:  # a round's end after the first: the previous average landed
                assert opt.settled_step is not None
                assert opt.settled_step.contributors == tuple(range(WORKERS))
        got[rank] = flat_of(params)
        opt.flush()
        assert opt._sparse is not None
        kept = torch.cat([r.reshape(-1) for r in opt._sparse.codec.residuals()]).double().numpy()
        flushed[rank] = (flat_of(params), flat_of([g for _, g in opt.global_parameters]), kept)
        assert opt.stats.outer_steps == ROUNDS

    with cluster(WORKERS, **SETTINGS) as ars:
        run_threads([lambda r=r: worker(r, ars[r]) for r in range(WORKERS)])  # type: ignore[misc]
    # every outer step left the same global parameters on every worker, bit for bit
    assert all(len(after_step[k]) == ROUNDS for k in range(WORKERS)), after_step
    assert len({tuple(after_step[k]) for k in range(WORKERS)}) == 1
    assert after_step[0][0] == digest(list(make_linear().parameters()))  # round 0 sends nothing (no scale yet)
    assert len(set(after_step[0])) == ROUNDS  # ...and every later one moves them
    # float32 arithmetic against float64; a flipped quantisation level would differ by a whole
    # level (0.6 x the chunk's RMS, about 1e-2 here), far above this
    tolerance = 1e-5
    for k in range(WORKERS):
        near = float(np.abs(got[k] - want[k]).max())
        assert near < tolerance, (k, near)
        for name, other in wrong.items():
            far = float(np.abs(got[k] - other[k]).max())
            assert far > 100 * tolerance, (k, name, far)
        model, glob, kept = flushed[k]
        assert np.array_equal(glob, flushed[0][1])
        assert np.array_equal(model, (torch.from_numpy(glob).float() - torch.from_numpy(kept).float()).double()
                              .numpy())  # flush: the global parameters less the accumulator, no correction
    far = float(np.abs(flushed[0][1] - glob_before).max())  # the last average landed in the flush
    assert far > 100 * tolerance


def test_a_diverged_eager_sparse_worker_is_left_out_of_one_round_and_goes_on_finite() -> None:
    """Rank 1's model turns NaN in round 2's last local step: its accumulator starts over, it
    sends nothing (no stand-in), the average leaves it out of round 2 only, and every model and
    the global parameters stay finite and alike."""
    contributors: dict[int, list[tuple[int, ...]]] = {r: [] for r in range(WORKERS)}
    finals: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def worker(rank: int, ar: fttree.FTTreeAllreduce) -> None:
        model = make_linear()
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=INNER_LR), allreduce=ar, sync_every=H,
                            overlap="eager", compression=CONFIG)
        opt.outer_listeners.append(lambda o: contributors[rank].append(
            o.last_step.contributors if o.last_step is not None else ()))
        params = list(model.parameters())
        for i in range(6 * H):
            goal = torch.from_numpy(target(rank, i)).float()
            opt.zero_grad()
            (0.5 * ((torch.cat([p.reshape(-1) for p in params]) - goal) ** 2).sum()).backward()
            if rank == 1 and i == 3 * H - 1:
                with torch.no_grad():
                    params[0][0, 0] = float("nan")  # the inner training diverged
            opt.step()
            assert all(bool(torch.isfinite(p).all()) for p in params), (rank, i)  # the round's end rebuilt it
        opt.flush()
        finals[rank] = (flat_of(params), flat_of([g for _, g in opt.global_parameters]))

    with cluster(WORKERS, nonfinite="skip", **SETTINGS) as ars:
        run_threads([lambda r=r: worker(r, ars[r]) for r in range(WORKERS)])  # type: ignore[misc]
    everyone = (0, 1, 2)
    for rank in range(WORKERS):
        assert contributors[rank] == [everyone, everyone, (0, 2), everyone, everyone, everyone], contributors
        assert np.isfinite(finals[rank][0]).all()
        assert np.isfinite(finals[rank][1]).all()
        assert np.array_equal(finals[rank][1], finals[0][1])


def test_train_mlp_trains_with_eager_sparse_outer_steps_and_uses_every_sample_once() -> None:
    """`examples/train_mlp.py --diloco 4 --eager --compression sparse`: ElasticJob with eager
    sparse outer steps on real worker processes; every epoch audited committed each sample
    once, and the model learned (the first outer step sends nothing: no scale yet)."""
    from tests.test_torch_examples import EXAMPLES, run_example

    proc = run_example(str(EXAMPLES / "train_mlp.py"), "-n", "3", "--steps", "24", "--diloco", "4", "--eager",
                       "--compression", "sparse", "--json", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6, summary
    assert summary["epochs"] >= 1, summary
    assert summary["exactly_once"], summary
    assert summary["fewest_contributors"] == 3, summary
    assert summary["test_accuracy"] > 0.5, summary
    assert 0 < summary["compute_s"] < summary["wall_s"], summary  # the bench's compute share: a share
