"""`fttree` starts without torch and without its plugins' modules: every worker, launch and
test that runs the CLI would pay them (torch alone is 1.5 s of CPU per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from fttree.tools.cli import PLUGIN_COMMANDS, load_plugin, main

_HEAVY = ("torch", "fttree.tools.chaos", "fttree.tools.chaos_worker", "fttree.tools.bench_cli", "fttree.api")


def _loaded_after(code: str) -> set[str]:
    """Which of _HEAVY a fresh interpreter has imported after CODE (sys.modules, not timing)."""
    probe = (f"import sys\n{code}\nimport json\n"
             f"print(json.dumps([m for m in {list(_HEAVY)!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_loads_no_torch_nor_plugin() -> None:
    assert _loaded_after("import fttree.tools.cli") == set()


def test_fttree_help_loads_no_torch_nor_plugin_and_lists_every_plugin() -> None:
    code = ("import contextlib, io\nfrom fttree.tools.cli import main\nbuf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    try:\n        main(['--help'])\n"
            "    except SystemExit as exc:\n        assert exc.code == 0, exc.code\n"
            "assert all(name in buf.getvalue() for name in ('bench', 'chaos', 'status', 'worker')), buf.getvalue()")
    assert _loaded_after(code) == set()


def test_a_plugin_loads_when_invoked() -> None:
    code = ("from fttree.tools.cli import main\ntry:\n    main(['analyze', '--help'])\n"
            "except SystemExit as exc:\n    assert exc.code == 0, exc.code")
    assert "fttree.tools.bench_cli" in _loaded_after(code)


@pytest.mark.parametrize("name", sorted(PLUGIN_COMMANDS))
def test_stored_one_line_help_is_the_commands_own(name: str) -> None:
    command = load_plugin(name)
    assert command is not None, f"{PLUGIN_COMMANDS[name][0]} has no command {name}"
    assert PLUGIN_COMMANDS[name][1] == command.get_short_help_str(10**6)


def test_every_plugin_is_reachable_through_the_group() -> None:
    ctx = click.Context(main)
    assert set(PLUGIN_COMMANDS) <= set(main.list_commands(ctx))
    for name in PLUGIN_COMMANDS:
        assert main.get_command(ctx, name) is not None
