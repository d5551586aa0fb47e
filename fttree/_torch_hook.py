"""`import fttree` makes `dist.init_process_group("fttree")` work without importing torch itself.

Importing torch costs seconds, and most fttree commands never need it. So the backend is
registered the moment torch finishes importing: at once if torch is already loaded, else by a
one-shot import hook that wraps the loader of the top-level `torch` module. Not on
`torch.distributed` itself: `import torch` imports it half-way through its own initialisation.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

log = logging.getLogger("fttree")


def register_backend() -> None:
    """Register the "fttree" backend if this torch has torch.distributed (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from .training.backend import register

    register()


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of `torch` it lets the real finders find it and
    wraps the loader so that the backend is registered once torch is fully initialised."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        uninstall()
        spec = importlib.util.find_spec(fullname)
        loader: Any = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            try:
                register_backend()
            except Exception:  # never break `import torch` for the user
                log.warning("fttree: could not register the torch.distributed backend", exc_info=True)

        loader.exec_module = exec_then_register
        return spec


_HOOK = _AfterTorchImport()


def uninstall() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def install() -> None:
    """Register now if torch is loaded, else as soon as it is."""
    if "torch" in sys.modules and getattr(sys.modules["torch"], "distributed", None) is not None:
        register_backend()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
