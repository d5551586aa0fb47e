"""The configuration reference and the ways to give a setting: docs/configuration.md is what
`Config` says, every flag it names exists, and every setting is reachable by its variable."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fttree import ConfigError
from fttree.core.config import SAME_ON_EVERY_WORKER, Config
from fttree.tools import configdoc
from fttree.tools.cli import main as cli

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_the_reference_is_generated_from_config() -> None:
    assert DOC.read_text() == configdoc.render(), (
        "docs/configuration.md is stale: python -m fttree.tools.configdoc > docs/configuration.md")


def test_every_setting_is_described_and_every_flag_exists() -> None:
    described = configdoc.descriptions()
    names = [f.name for f in dataclasses.fields(Config)]
    assert [n for n in names if not described.get(n)] == []
    assert set(names) >= SAME_ON_EVERY_WORKER
    for command in ("worker", "launch"):
        flags = {opt for p in cli.commands[command].params for opt in p.opts}
        assert set(configdoc.FLAGS.values()) <= flags, (command, set(configdoc.FLAGS.values()) - flags)
        assert "--set" in flags
    assert set(configdoc.FLAGS) <= set(names)


def test_the_flags_defaults_and_choices_are_configs() -> None:
    """A flag of a setting defaults to the setting's default and offers the choices Config
    accepts, so the two cannot drift apart."""
    defaults = Config()
    for command in ("worker", "launch"):
        params = {opt: p for p in cli.commands[command].params for opt in p.opts}
        for name, flag in configdoc.FLAGS.items():
            param = params[flag]
            if isinstance(param, click.Option) and not param.is_flag and param.default is not None:
                assert param.default == getattr(defaults, name), (command, flag)
            if isinstance(param.type, click.Choice):
                for choice in param.type.choices:
                    Config.build(Config(), **{name: choice})  # every choice is one Config takes


def test_every_setting_reads_from_its_variable() -> None:
    env = {}
    for f in dataclasses.fields(Config):
        default = f.default
        text = "none" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        env[Config.env_name(f.name)] = text
    assert Config.from_env(env) == {f.name: f.default for f in dataclasses.fields(Config)}
    assert Config.env_name("step_timeout_s") == "FTTREE_STEP_TIMEOUT"
    assert Config.env_name("uplink_bytes_per_s") == "FTTREE_UPLINK_BYTES_PER_S"
    with pytest.raises(ConfigError, match="FTTREE_CHUNK_BYTES: chunk_bytes must be int, got 'big'"):
        Config.from_env({"FTTREE_CHUNK_BYTES": "big"})
    with pytest.raises(ConfigError, match="link_memory must be bool"):
        Config.parse("link_memory", "maybe")


def test_from_env_takes_any_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from fttree import FTTreeAllreduce

    from .conftest import local_peers

    monkeypatch.setenv("FTTREE_RANK", "0")
    monkeypatch.setenv("FTTREE_PEERS", ",".join(local_peers(2)))
    monkeypatch.setenv("FTTREE_NODE_DEADLINE", "2.5")
    monkeypatch.setenv("FTTREE_TREES", "double")
    ar = FTTreeAllreduce.from_env(trees="single")  # an argument wins over the environment
    assert ar.config.node_deadline_s == 2.5
    assert ar.config.trees == "single"


def test_set_on_the_command_line_is_checked(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(cli, ["launch", "-n", "2", "--set", "bogus=1"])
    assert bad.exit_code != 0
    assert "unknown setting bogus" in bad.output
    shape = runner.invoke(cli, ["launch", "-n", "2", "--set", "node_deadline_s"])
    assert shape.exit_code != 0
    assert "expected NAME=VALUE" in shape.output
