"""`fttree --help` and every subcommand's --help stay free of torch and numpy (issue 43).

Many tests run the CLI as a subprocess; importing torch at start-up cost each of them
about 2 s of CPU. Each check runs in a fresh interpreter, so what an earlier test imported
cannot hide a regression.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "fttree.api", "fttree.net.node")

_PROBE = """
import json, sys
from fttree.tools.cli import main
args = json.loads(sys.argv[1])
try:
    main(args, prog_name="fttree")
except SystemExit as exc:
    if exc.code not in (0, None):
        raise
heavy = json.loads(sys.argv[2])
import click
listed = main.list_commands(click.Context(main))  # the plugin subcommands load only when invoked
print(json.dumps({"loaded": [m for m in heavy if m in sys.modules], "commands": sorted(listed)}))
"""

COMMANDS = ("analyze", "bench", "certs", "chaos", "key", "launch", "netem", "status", "topology", "worker",
            "yardstick")


def _probe(args: list[str]) -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, list[str]] = json.loads(proc.stdout.splitlines()[-1])
    return result


def test_top_level_help_imports_nothing_heavy_and_lists_every_subcommand() -> None:
    result = _probe(["--help"])
    assert result["loaded"] == []
    assert set(COMMANDS) <= set(result["commands"])


@pytest.mark.parametrize("command", COMMANDS)
def test_subcommand_help_imports_nothing_heavy(command: str) -> None:
    assert _probe([command, "--help"])["loaded"] == []


def test_help_lists_every_subcommand() -> None:
    proc = subprocess.run([sys.executable, "-m", "fttree", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0] for line in proc.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == set(COMMANDS)
