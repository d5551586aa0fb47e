"""The package as a user imports it: what `import fttree` brings in, and what it makes work."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
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
    for first in ("import fttree\nimport torch", "import torch\nimport fttree"):
        out = run_python(first + "\n" + textwrap.dedent(body))
        assert out.strip() == "fttree [1.0, 1.0, 1.0]", (first, out)
