"""The package as a user imports it: what `import fttree` brings in, and what it makes work."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # an error swallowed by an import hook is still an error
    return done.stdout


def test_import_fttree_does_not_import_torch() -> None:
    assert run_python("import sys, fttree; print('torch' in sys.modules)").strip() == "False"


def test_import_fttree_alone_makes_the_backend_work_whichever_is_imported_first() -> None:
    body = """
        import torch.distributed as dist
        dist.init_process_group("fttree", store=dist.HashStore(), rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        print(dist.get_backend(), t.tolist())
        dist.destroy_process_group()
    """
    for first in ("import fttree\nimport torch", "import torch\nimport fttree",
                  "import fttree.training.optim\nimport torch"):  # a submodule that imports torch itself
        out = run_python(first + "\n" + textwrap.dedent(body))
        assert out.strip() == "fttree [1.0, 1.0, 1.0]", (first, out)


FORBIDDEN_IN_CORE = {"asyncio", "socket", "threading", "time", "torch", "uvloop", "aiohttp", "concurrent"}
PACKAGE = Path(__file__).resolve().parents[1] / "fttree"


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(module, line) for every import statement in a file, relative ones resolved inside fttree."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ('fttree', 'core')
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.append((module, node.lineno))
    return found


def test_the_core_imports_no_io_clock_threads_or_torch() -> None:
    offenders = []
    for path in sorted((PACKAGE / "core").glob("*.py")):
        for module, line in imports_of(path):
            root = module.split(".")[0]
            outside = module.startswith("fttree.") and not module.startswith(("fttree.core", "fttree.errors"))
            if root in FORBIDDEN_IN_CORE or outside:
                offenders.append(f"{path.name}:{line} imports {module}")
    assert not offenders, "the core must stay pure:\n" + "\n".join(offenders)


def test_importing_the_core_loads_no_network_stack() -> None:
    out = run_python("""
        import importlib, pkgutil, sys
        import fttree.core
        for module in pkgutil.iter_modules(fttree.core.__path__):
            importlib.import_module(f"fttree.core.{module.name}")
        roots = {"asyncio", "uvloop", "aiohttp", "socket", "torch"}
        print(sorted(m for m in sys.modules if m.split(".")[0] in roots or m.startswith("fttree.net")))
    """)
    assert out.strip() == "[]"
