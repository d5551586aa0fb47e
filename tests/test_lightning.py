"""Lightning on fttree in one line: `Trainer(strategy=FTTreeStrategy())`, on CPU with
Lightning's own launcher (devices=3 processes). The run's collectives go through fttree, every
rank ends with the same parameters, and they match DDP's training computed in one process (each
step's gradient the mean over the ranks' batches); after a worker died, the survivors go on and
each step's gradient is their mean. Skipped, with the reason,
when `lightning` (the [lightning] extra) is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="lightning is not installed (pip install 'fttree[lightning]')")

SCRIPT = '''
import json, os, sys
import torch
from torch import nn
import lightning as L
from lightning.pytorch.strategies import DDPStrategy
import fttree  # registers the "fttree" torch.distributed backend


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, i):
        if DIE and self.global_rank == 2 and self.current_epoch == 0 and i == 3:
            os._exit(0)  # a worker dies mid-epoch, as a killed process does
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # a Lightning collective of its own, on the same backend
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


backend, DIE = sys.argv[1], sys.argv[2:] == ["die"]
g = torch.Generator().manual_seed(3)
data = torch.utils.data.TensorDataset(torch.randn(240, 12, generator=g), torch.randint(0, 4, (240,), generator=g))
model = Model()
if backend == "fttree":  # its comm hook divides each gradient sum by the ranks it holds
    from fttree.training.lightning import FTTreeStrategy
    strategy = FTTreeStrategy()
else:
    strategy = DDPStrategy(process_group_backend=backend)
trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy,
                    max_epochs=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
                    enable_checkpointing=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=10))
steps = fttree.allreduce_of().step if backend == "fttree" else None
partial = torch.distributed.group.WORLD.partial_sums if backend == "fttree" else None
with open(f"{backend}-{trainer.global_rank}.json", "w") as f:  # one file each: the ranks share stdout
    json.dump({"rank": trainer.global_rank, "backend": torch.distributed.get_backend(), "fttree_steps": steps,
               "partial_sums": partial,
               "params": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
'''


def run(tmp_path: Path, backend: str, *extra: str) -> dict[int, dict[str, object]]:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FTTREE_TIMEOUT": "0.2"}
    proc = subprocess.run([sys.executable, str(script), backend, *extra], capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob(f"{backend}-*.json"))]
    return {int(r["rank"]): r for r in results}


def serial_params(died_at: int | None = None) -> list[Any]:
    """The model's parameters after SCRIPT's training as DDP's arithmetic makes it, computed in
    this process: each step's gradient is the mean over the ranks' batches of 10 (Lightning's
    DistributedSampler: one shuffle per epoch, rank r takes every third sample from r), with
    rank 2 gone from its batch `died_at` of the first epoch on."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(240, 12, generator=g), torch.randint(0, 4, (240,), generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        perm = torch.randperm(240, generator=torch.Generator().manual_seed(epoch)).tolist()
        for k in range(8):
            ranks = (0, 1) if died_at is not None and (epoch > 0 or k >= died_at) else (0, 1, 2)
            rows = torch.tensor([perm[r::3][10 * k + j] for r in ranks for j in range(10)])
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
            opt.step()
    return list(net.parameters())


def assert_params_match(got: object, want: list[Any]) -> None:
    import torch

    assert isinstance(got, list)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(a).view(b.shape), b.detach(), rtol=1e-5, atol=1e-6)


def test_lightning_trains_on_the_fttree_backend_as_ddp_computes_it(tmp_path: Path) -> None:
    """Every rank ends alike, to the bit, with the parameters of DDP's arithmetic (the mean
    gradient over the three ranks' batches each step), computed in this process: what the same
    run on gloo gave before, without three more Lightning processes (seconds of CPU each)."""
    ft = run(tmp_path, "fttree")
    assert sorted(ft) == [0, 1, 2], ft.keys()
    assert all(r["backend"] == "fttree" for r in ft.values())
    assert all(isinstance(r["fttree_steps"], int) and r["fttree_steps"] >= 16 for r in ft.values()), \
        [r["fttree_steps"] for r in ft.values()]  # 2 epochs x 8 steps of gradients went through the tree
    assert ft[0]["params"] == ft[1]["params"] == ft[2]["params"]  # every rank alike, to the bit
    assert_params_match(ft[0]["params"], serial_params())


def test_lightning_goes_on_after_a_worker_died_with_the_survivors_mean(tmp_path: Path) -> None:
    """Rank 2 exits at its 4th batch. Lightning's other two processes finish both epochs; each
    later step's gradient is the mean over the two survivors' batches (fttree.comm_hook divides
    by the contributors), as one process training on their batches computes it."""
    ft = run(tmp_path, "fttree", "die")
    assert sorted(ft) == [0, 1], ft.keys()
    assert ft[0]["params"] == ft[1]["params"]
    assert ft[0]["partial_sums"] == ft[1]["partial_sums"] == 0
    assert_params_match(ft[0]["params"], serial_params(died_at=3))
