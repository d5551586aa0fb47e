"""The configuration reference (docs/configuration.md), generated from `Config` itself: each
setting's name, default, command-line flag, environment variable, whether every worker must
agree on it, and what it does (the comment beside or above it in core/config.py).

    python -m fttree.tools.configdoc > docs/configuration.md

A test fails when the file and `Config` disagree, so the reference cannot go stale.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize

from ..core import config as config_module
from ..core.config import SAME_ON_EVERY_WORKER, Config

# Settings with a flag of their own on `fttree worker` and `fttree launch`; every other one is
# `--set NAME=VALUE` there.
FLAGS = {
    "timeout_s": "--timeout", "step_timeout_s": "--step-timeout", "startup_timeout_s": "--startup-timeout",
    "fault_tolerant": "--no-ft", "timeout_policy": "--timeout-policy", "link_memory": "--no-link-memory",
    "on_node_failure": "--on-node-failure", "chunk_bytes": "--chunk-bytes", "trees": "--trees",
    "uplink_bytes_per_s": "--uplink", "uplinks_by_rank": "--uplink", "auth_key_file": "--auth-key-file",
    "insecure": "--insecure",
    "tls_dir": "--tls-dir", "tls_cert_file": "--tls-cert", "tls_key_file": "--tls-key", "tls_ca_file": "--tls-ca",
}

HEADER = """# Configuration

Every setting of a worker is a field of `fttree.Config`. Give it as a keyword of
`FTTreeAllreduce(rank, peers, name=value)`, as `Config(name=value)`, on the command line of
`fttree worker` and `fttree launch` (its own flag, or `--set name=value`), or in the environment
(read by `FTTreeAllreduce.from_env()` and the `fttree` torch.distributed backend). Durations are
seconds, sizes bytes. Settings marked "yes" must be the same on every worker of a job.

This file is generated from the code: `python -m fttree.tools.configdoc > docs/configuration.md`.

| setting | default | command line | environment | same on every worker | what it does |
|---|---|---|---|---|---|
"""


def descriptions() -> dict[str, str]:
    """Each field's comment in core/config.py: the one on its line, else the block just above."""
    source = inspect.getsource(config_module)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(Config)}
    out: dict[str, str] = {}
    in_class = False
    for number, line in enumerate(lines, start=1):
        if line.startswith("class Config"):
            in_class = True
            continue
        if in_class and line and not line.startswith(" "):
            break
        name = line.strip().split(":", 1)[0]
        if not in_class or name not in names or not line.startswith("    ") or line.startswith("     "):
            continue
        if number in comments and not line.strip().startswith("#"):
            out[name] = comments[number]
            continue
        above: list[str] = []
        at = number - 1
        while at in comments and lines[at - 1].strip().startswith("#") and not comments[at].startswith("--"):
            above.insert(0, comments[at])
            at -= 1
        out[name] = " ".join(above)
    return out


def _default(field: dataclasses.Field[object]) -> str:
    value = field.default
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value // (1 << 20)} MiB"
    return "none" if value is None else str(value)


def render() -> str:
    described = descriptions()
    rows = []
    for field in dataclasses.fields(Config):
        flag = f"`{FLAGS[field.name]}`" if field.name in FLAGS else f"`--set {field.name}=...`"
        what = described.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{field.name}` | {_default(field)} | {flag} | `{Config.env_name(field.name)}` | "
                    f"{'yes' if field.name in SAME_ON_EVERY_WORKER else ''} | {what} |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
