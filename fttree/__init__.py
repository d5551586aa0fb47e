"""fttree: fault-tolerant tree allreduce for data-parallel training on unreliable networks.

`import fttree` stays light (no torch import) yet makes `dist.init_process_group("fttree")`
work: the backend registers itself when torch is imported (see _torch_hook.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._torch_hook import install as _install_torch_backend
from .errors import (
    ConfigError,
    FrameError,
    FTTreeError,
    GroupLeft,
    PeerError,
    ProtocolError,
    StepAborted,
    StepRetry,
    TensorMismatch,
)

if TYPE_CHECKING:
    from .api import FTTreeAllreduce
    from .core.config import Config
    from .data.cache import CachedDataset
    from .data.sampler import CollateOrNone, ElasticSampler, loader_horizon
    from .net.node import StepResult
    from .training.backend import allreduce_of
    from .training.ddp import comm_hook
    from .training.diloco import DiLoCo
    from .training.job import ElasticJob, EpochSummary
    from .training.optim import DistributedOptimizer, attach, broadcast_parameters, synchronize
    from .training.sparse import Sparse
    from .training.state import sync_state

__version__ = "0.1.0"

_install_torch_backend()

# Public names served by other modules, imported on first use so that `import fttree` (and
# `import fttree.core...`) stays light: no event loop or network stack until a handle is asked
# for, no torch until a torch integration is.
_LAZY = {
    "FTTreeAllreduce": "fttree.api",
    "StepResult": "fttree.net.node",
    "DistributedOptimizer": "fttree.training.optim",
    "DiLoCo": "fttree.training.diloco",
    "Sparse": "fttree.training.sparse",
    "ElasticJob": "fttree.training.job",
    "EpochSummary": "fttree.training.job",
    "attach": "fttree.training.optim",
    "synchronize": "fttree.training.optim",
    "comm_hook": "fttree.training.ddp",
    "allreduce_of": "fttree.training.backend",
    "Config": "fttree.core.config",
    "broadcast_parameters": "fttree.training.optim",
    "ElasticSampler": "fttree.data.sampler",
    "CollateOrNone": "fttree.data.sampler",
    "loader_horizon": "fttree.data.sampler",
    "CachedDataset": "fttree.data.cache",
    "sync_state": "fttree.training.state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fttree' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CachedDataset",
    "CollateOrNone",
    "Config",
    "ConfigError",
    "DiLoCo",
    "DistributedOptimizer",
    "ElasticJob",
    "ElasticSampler",
    "EpochSummary",
    "FTTreeAllreduce",
    "FTTreeError",
    "FrameError",
    "GroupLeft",
    "PeerError",
    "ProtocolError",
    "Sparse",
    "StepAborted",
    "StepResult",
    "StepRetry",
    "TensorMismatch",
    "allreduce_of",
    "attach",
    "broadcast_parameters",
    "comm_hook",
    "loader_horizon",
    "sync_state",
    "synchronize",
]
