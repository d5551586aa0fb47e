"""Shared by the training examples: the thesis's MLP, its data, the batch schedule, a local
launcher and the progress line. Nothing here touches the network."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fttree.net import address
from fttree.net.credentials import write_key

BATCH = 100  # per worker, as in the thesis


def thesis_mlp(seed: int = 0, hidden: int = 512) -> nn.Module:
    """784-512-10 MLP: 407,050 parameters (784-1280-10 with hidden=1280: 1,017,610)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@dataclass
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    name: str


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise SystemExit(f"{path} is not an MNIST idx file of unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


class Synthetic:
    """A learnable synthetic task as big as asked, at no memory: sample i is its class's mean
    (10 classes, fixed random means in 784 dimensions) plus unit Gaussian noise, both made from
    i, so every worker computes the same sample. `part[i]` is one sample or a batch (an index
    tensor); `labels[i]` likewise."""

    def __init__(self, count: int, first: int = 0, seed: int = 0, separation: float = 0.15) -> None:
        self.count, self.first, self.seed = count, first, seed
        self.means = torch.randn(10, 784, generator=torch.Generator().manual_seed(seed)) * separation
        self.labels = _SyntheticLabels(self)

    def __len__(self) -> int:
        return self.count

    def label_of(self, i: torch.Tensor) -> torch.Tensor:
        return ((i + self.first) * 2654435761 % 4294967296) % 10

    def __getitem__(self, i: Any) -> torch.Tensor:
        index = torch.as_tensor(i, dtype=torch.int64)
        flat = index.reshape(-1)
        noise = torch.stack([torch.randn(784, generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + int(k) + self.first)) for k in flat])
        x = self.means[self.label_of(flat)] + noise
        return x[0] if index.dim() == 0 else x


class _SyntheticLabels:
    def __init__(self, data: Synthetic) -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.count

    def __getitem__(self, i: Any) -> torch.Tensor:
        return self.data.label_of(torch.as_tensor(i, dtype=torch.int64))


def load_data(images: str | None, labels: str | None, synthetic: int = 0) -> Dataset:
    """MNIST idx files when given, a synthetic task of `synthetic` samples (Synthetic), else
    scikit-learn's bundled 8x8 digits upsampled to 28x28 (no download)."""
    if synthetic:
        train = Synthetic(synthetic)
        test = Synthetic(2000, first=synthetic)
        every = torch.arange(2000)
        return Dataset(train, train.labels, test[every], test.labels[every],  # type: ignore[arg-type]
                       f"synthetic: 10 Gaussian classes in 784 dimensions, {synthetic:,} samples")
    if images:
        x = torch.from_numpy(_read_idx(Path(images)).astype(np.float32) / 255.0).reshape(-1, 784)
        if not labels:
            guess = images.replace("images-idx3", "labels-idx1")
            if guess == images or not Path(guess).exists():
                raise SystemExit("give --labels for the MNIST images file")
            labels = guess
        y = torch.from_numpy(_read_idx(Path(labels)).astype(np.int64))
        name = Path(images).name
    else:
        images8, target = _digits()
        small = torch.from_numpy(images8.astype(np.float32) / 16.0).unsqueeze(1)
        x = nn.functional.interpolate(small, size=(28, 28), mode="bilinear", align_corners=False).reshape(-1, 784)
        y = torch.from_numpy(target.astype(np.int64))
        name = "sklearn digits upsampled to 28x28"
    n_test = max(1, len(x) // 6)
    return Dataset(x[:-n_test], y[:-n_test], x[-n_test:], y[-n_test:], name)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (images, labels) as load_digits() gives them, read from
    its data file without importing scikit-learn: that import costs each worker process about
    1 s of CPU, as much as its training steps in a short run. load_digits() if the file moved."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


class Samples(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image, label) pairs over the training tensors (or the synthetic task), for a DataLoader."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def batch_indices(n_train: int, step: int, world: int, rank: int, batch: int = BATCH) -> torch.Tensor:
    """Rank `rank`'s slice of the global batch of `step`: one shuffle per epoch, shared by all
    workers, so N workers see exactly what one process with batch N x `batch` would."""
    global_batch = world * batch
    per_epoch = max(1, n_train // global_batch)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(epoch))
    start = k * global_batch + rank * batch
    return perm[start:start + batch]


def free_port(workers: int = 16) -> int:
    """A port free on 127.0.0.1 up to 127.0.0.(workers), where local workers listen, all on
    the same port (at least 16 addresses: the default suits a master port as well)."""
    return address.free_port(address.local_hosts(max(16, workers)))


RESTARTED = "TRAIN_MLP_RESTARTED"  # set for a process the launcher started again (--restart)
OUTPUT_LINES = 400  # a worker's last lines, shown if it fails


def launch_local(script: str, n: int, worker_args: Sequence[str], env_for_rank: dict[int, dict[str, str]],
                 deadline_s: float, restart: int | None = None) -> int:
    """Run n copies of `script` on this machine; rank 0's output is shown, the others' only
    if they fail. Returns the worst exit code. The workers prove a key made for this job
    (FTTREE_AUTH_KEY_FILE), unless the environment names one already. `restart`: once that
    rank's process has ended (its --faults crash), start it again, with RESTARTED set."""
    keys = tempfile.TemporaryDirectory(prefix="fttree-job-")
    job = {} if os.environ.get("FTTREE_AUTH_KEY_FILE") else \
        {"FTTREE_AUTH_KEY_FILE": str(write_key(Path(keys.name) / "job.key"))}

    def start(rank: int, extra: dict[str, str]) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **job, **env_for_rank[rank], **extra}
        return subprocess.Popen([sys.executable, script, *worker_args], env=env,
                                stdout=None if rank == 0 else subprocess.PIPE,
                                stderr=None if rank == 0 else subprocess.STDOUT, text=True)

    procs = {rank: start(rank, {}) for rank in range(n)}
    outputs: dict[int, deque[str]] = {rank: deque(maxlen=OUTPUT_LINES) for rank in range(1, n)}
    readers = [threading.Thread(target=_drain, args=(proc, outputs[rank]), daemon=True)
               for rank, proc in procs.items() if rank]
    for reader in readers:
        reader.start()
    end, worst = time.monotonic() + deadline_s, 0
    try:
        while procs:
            for rank, proc in list(procs.items()):
                if proc.poll() is None:
                    continue
                del procs[rank]
                if proc.returncode:
                    worst = worst or proc.returncode
                    out = "".join(outputs.get(rank, []))
                    if out:
                        print(f"--- rank {rank} exited with {proc.returncode}:\n{out[-4000:]}", file=sys.stderr)
                elif rank == restart:
                    restart = None
                    procs[rank] = start(rank, {RESTARTED: "1"})
                    outputs[rank].clear()
                    reader = threading.Thread(target=_drain, args=(procs[rank], outputs[rank]), daemon=True)
                    reader.start()
            if procs and time.monotonic() > end:
                print(f"workers still running after {deadline_s:g} s: stopping them", file=sys.stderr)
                worst = 124
                break
            time.sleep(0.05)  # polling the children's exits: nothing else to wait on for several at once
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        keys.cleanup()
    return worst


def _drain(proc: subprocess.Popen[str], into: deque[str]) -> None:
    """A worker's combined output, kept for the report if it fails."""
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append(line)


class Progress:
    """One line per step with a bar, the step time, loss and batch accuracy. Steps are numbered
    from 0, as fault windows count them (`--faults "cut 1-0 @5..10"` hits steps 5 to 10)."""

    def __init__(self, steps: int, enabled: bool, as_json: bool = False) -> None:
        self.steps, self.enabled, self.as_json = steps, enabled, as_json
        self.times: list[float] = []

    def step(self, step: int, seconds: float, loss: float, acc: float, note: str = "") -> None:
        self.times.append(seconds)
        if not self.enabled or self.as_json:
            return
        width = 20
        done = round(width * (step + 1) / self.steps)
        bar = "#" * done + "-" * (width - done)
        scores = "loss      -  acc    -" if loss != loss else f"loss {loss:.4f}  acc {acc:.2f}"  # nan: no batch
        print(f"step {step:4d} of {self.steps} [{bar}] {seconds * 1000:8.1f} ms  {scores}"
              f"{'  ' + note if note else ''}", flush=True)

    def summary(self, warmup: int, extra: dict[str, object]) -> None:
        if not self.enabled:
            return
        timed = sorted(self.times[warmup:] or self.times)
        median = timed[len(timed) // 2] if timed else float("nan")
        info = {"median_step_s": median, "steps": len(self.times), **extra}
        if self.as_json:
            print(json.dumps(info), flush=True)
        else:
            print(f"median step {median * 1000:.1f} ms over {len(timed)} steps; "
                  + ", ".join(f"{k} {v}" for k, v in extra.items()), flush=True)


def describe_note(note: Any) -> str:
    """A short line about a protocol note, from its structured fields (fttree.core.protocol.Note)."""
    link = "" if note.link is None else f"link {note.link[0]}-{note.link[1]}"
    what = {"data_came_around": "data lost, relayed", "data_relayed": "relayed a neighbour's data",
            "result_came_around": "result came through a backup", "result_pushed": "pushed the result",
            "detour": "detour (link memory: marked failed)", "watch_expired": "no confirmation in time"}
    return f"{link}: {what.get(note.cause.value, note.cause.value)}"


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
