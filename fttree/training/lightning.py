"""Lightning on fttree: `Trainer(strategy=FTTreeStrategy())`, Lightning's DDP strategy on the
"fttree" backend with the two averages a lost rank would otherwise make wrong.

DDP's default reducer, and Lightning's `self.log(..., sync_dist=True)` mean, divide a SUM by
the world size. Once a rank has died the sum holds fewer ranks than that, so the average is
too small, silently (the backend counts each such sum in `partial_sums` and warns once).
This strategy registers `fttree.comm_hook` on the DDP model, which divides each gradient
bucket's sum by the ranks it holds (Lightning's own `ddp_comm_hook=` is applied on CUDA only),
and reduces logged means with ReduceOp.AVG, which the backend divides the same way.

Needs the `[lightning]` extra (`pip install 'fttree[lightning]'`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from .backend import BACKEND
from .ddp import comm_hook

__all__ = ["FTTreeStrategy"]


class FTTreeStrategy(DDPStrategy):
    """`lightning.pytorch.strategies.DDPStrategy` on the "fttree" backend; takes DDPStrategy's
    other arguments (`find_unused_parameters`, `timeout`, ...)."""

    def __init__(self, **kwargs: Any) -> None:
        for name in ("process_group_backend", "ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if name in kwargs:
                raise ConfigError(f"FTTreeStrategy sets {name} itself (the fttree backend and fttree.comm_hook); "
                                  f"use lightning's DDPStrategy to choose your own")
        super().__init__(process_group_backend=BACKEND, **kwargs)

    def _register_ddp_hooks(self) -> None:
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(f"FTTreeStrategy: expected the DDP-wrapped model, got {type(model).__name__}")
        model.register_comm_hook(None, comm_hook)  # None: the fttree process group's own handle

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """A logged metric's mean over the ranks it holds (AVG), not a sum over the world size."""
        mean = reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")) \
            or reduce_op == dist.ReduceOp.AVG
        if not (isinstance(tensor, torch.Tensor) and mean and dist.is_available() and dist.is_initialized()):
            return super().reduce(tensor, group, reduce_op)
        out = tensor.detach().clone() if tensor.is_floating_point() else tensor.detach().double()
        dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group)
        return out
