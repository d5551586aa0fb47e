"""fttree: fault-tolerant tree allreduce for data-parallel training on unreliable networks.

`import fttree` stays light (no torch import) yet makes `dist.init_process_group("fttree")`
work: the backend registers itself when torch is imported (see _torch_hook.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._torch_hook import install as _install_torch_backend
from .api import FTTreeAllreduce
from .errors import ConfigError, FrameError, FTTreeError, PeerError, ProtocolError, StepAborted, TensorMismatch

__version__ = "0.1.0"

_install_torch_backend()

# Names served by optional modules, imported on first use so that `import fttree` stays light
# (no torch import until a torch integration is asked for).
_LAZY = {
    "DistributedOptimizer": "fttree.optim",
    "attach": "fttree.optim",
    "synchronize": "fttree.optim",
    "comm_hook": "fttree.ddp",
    "broadcast_parameters": "fttree.optim",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fttree' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "ConfigError",
    "FTTreeAllreduce",
    "FTTreeError",
    "FrameError",
    "PeerError",
    "ProtocolError",
    "StepAborted",
    "TensorMismatch",
]
