"""The `fttree` command: worker, launch, topology."""

from __future__ import annotations

import json
import logging
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .. import logs
from ..core import topology as topo
from ..core.config import NODE_FAILURE_POLICIES, TIMEOUT_POLICIES, Config
from ..core.faults import FaultSchedule
from ..core.trees import TREE_FAMILIES
from ..errors import FTTreeError
from ..net.address import parse_peers
from ..status.cli import http_kwargs, launch_linger_s, launch_options, launch_worker_args, linger, worker_options
from .sizes import THESIS_MLP_PARAMS

if TYPE_CHECKING:
    from .units import UplinkSpec

F = TypeVar("F", bound=Callable[..., Any])


def _faults_option(f: F) -> F:
    return click.option("--faults", default="", metavar="SCHEDULE",
                        help='In-process faults, e.g. "cut 1-0 @5..10; loss 3 20% @12..15".')(f)


def _auth_options(f: F) -> F:
    f = click.option("--auth-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     envvar="FTTREE_AUTH_KEY_FILE",
                     help="The job's shared key (the same file on every worker; `fttree key --out FILE` makes "
                          "one): every connection proves it. Env FTTREE_AUTH_KEY_FILE.")(f)
    f = click.option("--tls-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     envvar="FTTREE_TLS_DIR",
                     help="Encrypt every connection (mutual TLS): a folder from `fttree certs` with ca.pem, "
                          "rank-R.pem and rank-R.key for this rank. Env FTTREE_TLS_DIR.")(f)
    for flag, what in (("--tls-cert", "This rank's TLS certificate (its rank in a URI SAN, urn:fttree:rank:R)."),
                       ("--tls-key", "This rank's TLS private key."),
                       ("--tls-ca", "The job CA's certificate: peers must show one it signed.")):
        f = click.option(flag, type=click.Path(dir_okay=False, path_type=Path), default=None,
                         help=what + " With --tls-cert, --tls-key and --tls-ca together instead of --tls-dir.")(f)
    f = click.option("--insecure", is_flag=True,
                     help="Run without a credential on addresses other machines can reach (a trusted network).")(f)
    return f


def _path(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _settings_option(f: F) -> F:
    return click.option("--set", "settings", multiple=True, metavar="NAME=VALUE",
                        help="Any setting by its Config name (docs/configuration.md), e.g. --set node_deadline_s=2; "
                             "repeatable.")(f)


def _parse_settings(items: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq:
            raise click.BadParameter(f"expected NAME=VALUE, got {item!r}", param_hint="--set")
        try:
            out[name.strip()] = Config.parse(name.strip(), text)
        except FTTreeError as exc:
            raise click.BadParameter(str(exc), param_hint="--set") from None
    return out


_DEFAULTS = Config()  # the flags' defaults and choices are Config's (docs/configuration.md)


def _job_options(f: F) -> F:
    f = click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
                     help="Allreduce steps to run.")(f)
    f = click.option("--size", type=click.IntRange(min=1), default=THESIS_MLP_PARAMS, show_default=True,
                     help="float32 elements per allreduce (default: the thesis MLP).")(f)
    f = click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=_DEFAULTS.timeout_s,
                     show_default=True, help="Backup-link watch timeout in seconds.")(f)
    f = click.option("--step-timeout", type=click.FloatRange(min=0, min_open=True), default=_DEFAULTS.step_timeout_s,
                     show_default=True, help="Give up on a step after this many seconds.")(f)
    f = click.option("--startup-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=_DEFAULTS.startup_timeout_s, show_default=True,
                     help="Wait this long for peers to come up.")(f)
    f = click.option("--no-ft", is_flag=True, help="Plain tree: no backup links (baseline).")(f)
    f = click.option("--chunk-bytes", type=click.IntRange(min=1), default=None,
                     help="A step travels as chunks of this many bytes (default 4 MiB).")(f)
    f = click.option("--trees", type=click.Choice(TREE_FAMILIES), default=_DEFAULTS.trees,
                     show_default=True,
                     help="The trees a step of two or more chunks spreads them over, the same on every worker: "
                          "rotated (p trees: each rank sends the ring's 2N(p-1)/p bytes), double (the double "
                          "binary tree: 2N) or single (interior ranks send 3N).")(f)
    f = click.option("--uplink", default=None, metavar="RATE",
                     help="A first guess of the workers' uplink speed in tc units (100mbit, 1gbit), the same on "
                          "every worker; never needed: each worker measures its own, and the group agrees on a pace "
                          "after the first step (default guess: a LAN's 50 MB/s). 100mbit,3=10mbit declares rank "
                          "3's uplink slower: the trees' shares then follow the uplinks, so rank 3 becomes a leaf.")(f)
    f = click.option("--timeout-policy", type=click.Choice(TIMEOUT_POLICIES), default=_DEFAULTS.timeout_policy,
                     show_default=True,
                     help="adaptive: learnt per link, --timeout is the first guess; static: always --timeout.")(f)
    f = click.option("--no-link-memory", is_flag=True,
                     help="Pay the timeout on every step of a failure (the thesis), no routing around.")(f)
    f = click.option("--on-node-failure", type=click.Choice(NODE_FAILURE_POLICIES),
                     default=_DEFAULTS.on_node_failure,
                     show_default=True,
                     help="A step in flight when a worker dies: finish it on the survivors, abort it, or run it "
                          "again (rollback: the demo job resubmits it).")(f)
    return _faults_option(f)


def uplink_settings(rate: str) -> dict[str, Any]:
    """Config fields of an --uplink spec ("100mbit" or "100mbit,3=10mbit"), or a usage error
    naming the flag."""
    from .units import parse_rate, parse_uplinks

    try:
        spec = parse_uplinks(rate)
        return {"uplink_bytes_per_s": spec.bps / 8,
                "uplinks_by_rank": tuple((r, parse_rate(text) / 8) for r, text in spec.by_rank)}
    except FTTreeError as exc:
        raise click.BadParameter(str(exc), param_hint="--uplink") from None


# Subcommands that live in their own modules (bench, status, ...) register here, so each
# feature keeps its CLI next to its code. Each is imported only when it runs (chaos's worker
# imports torch: 1.5 s of CPU that `fttree worker` and `fttree --help` need not pay); `--help`
# lists them with the one-line help below, which tests/test_cli_imports.py keeps equal to the
# command's own. A module that is missing is simply not offered.
PLUGIN_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("fttree.tools.bench_cli",
              "Reproduce the thesis's evaluation (Tables 1-2, Figures 11 and 14-17) against gloo and a plain tree, "
              "and measure node failures (a worker killed or stopped) beside the link patterns."),
    "analyze": ("fttree.tools.bench_cli",
                "Random link failures tolerated until some node is isolated, by tree height (thesis Figure 11)."),
    "status": ("fttree.status.cli", "Show every worker's tree position, step, step time and link health."),
    "netem": ("fttree.tools.realfaults",
              "Real faults with iptables and tc: see the rules fttree installed, remove them, find the scripts."),
    "yardstick": ("fttree.tools.yardstick",
                  "Run `fttree launch LAUNCH_ARGS` from this checkout and from the reference commit in alternating "
                  "pairs; print each pair and the median ratios (this / reference) of the median step and of the "
                  "CPU per step."),
    "chaos": ("fttree.tools.chaos",
              "Goodput under a seeded random mix of real faults, against a fault-free run of the same job."),
}


def _plugin_present(module_name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # its package is missing
        return False


def load_plugin(name: str) -> click.Command | None:
    """The subcommand NAME from its module (imported now), or None if the module is missing."""
    import importlib

    module_name = PLUGIN_COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None
    command = getattr(module, name, None)
    return command if isinstance(command, click.Command) else None


class _LazyGroup(click.Group):
    """`fttree`'s group: the plugin subcommands load when invoked, not at start-up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [name for name, (module, _) in PLUGIN_COMMANDS.items()
                if name not in self.commands and _plugin_present(module)]
        return sorted([*super().list_commands(ctx), *lazy])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in PLUGIN_COMMANDS:
            command = load_plugin(cmd_name)
            if command is not None:
                self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands: list[tuple[str, click.Command]] = []
        for name in self.list_commands(ctx):
            # a plugin not loaded yet: a stand-in with its stored one-line help
            command = self.commands.get(name) or click.Command(name, help=PLUGIN_COMMANDS[name][1])
            if not command.hidden:
                commands.append((name, command))
        if commands:
            limit = formatter.width - 6 - max(len(name) for name, _ in commands)  # as click.Group's
            with formatter.section("Commands"):
                formatter.write_dl([(name, command.get_short_help_str(limit)) for name, command in commands])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """fttree: fault-tolerant tree allreduce over unreliable links."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logs.setup(level)


@main.command()
@click.option("-n", "world", type=click.IntRange(min=1), required=True, help="Number of workers.")
def topology(world: int) -> None:
    """Print the tree of N workers with each rank's brother and uncle."""
    click.echo(topo.render(world))


@main.command()
@click.option("--rank", type=int, required=True, help="This worker's rank (line number in --peers).")
@click.option("--peers", "peers_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="File with one host:port per line; line i is rank i ('-' for a rank nobody can dial, "
                   "'host:port behind SITE' for one only its site-mates can: docs/nat.md).")
@click.option("--json", "as_json", is_flag=True, help="One JSON line per step (for launch).")
@click.option("--gate-dir", type=click.Path(file_okay=False, path_type=Path), default=None, hidden=True,
              help="Wait before --gate-steps for the real-fault runner (fttree launch --real-faults).")
@click.option("--gate-steps", default="", hidden=True, help="Comma-separated steps to wait before.")
@click.option("--node-gate-steps", default="", hidden=True,
              help="Steps before which this rank waits for the node-fault driver (fttree launch: crash, hang).")
@click.option("--join", "join", default=None, metavar="HOST:PORT",
              help="Join a running job through the member at HOST:PORT (a new rank; --peers names it too). "
                   "A restarted worker needs no flag: it finds the running group by itself.")
@_job_options
@_auth_options
@_settings_option
@worker_options
def worker(rank: int, peers_file: Path, as_json: bool, steps: int, size: int, timeout: float, step_timeout: float,
           startup_timeout: float, no_ft: bool, faults: str, gate_dir: Path | None, gate_steps: str,
           node_gate_steps: str, join: str | None, timeout_policy: str, no_link_memory: bool,
           on_node_failure: str, chunk_bytes: int | None, trees: str, uplink: str | None,
           auth_key_file: Path | None, tls_dir: Path | None, tls_cert: Path | None, tls_key: Path | None,
           tls_ca: Path | None, insecure: bool, settings: tuple[str, ...]) -> None:
    """Run one worker of a multi-machine job: checked allreduce steps of a known sum. SIGTERM
    makes it leave the group after the step in flight (the others pay no timeout)."""
    from ..api import FTTreeAllreduce
    from .demo import run_steps

    extra = _parse_settings(settings)
    try:
        peers = parse_peers(peers_file.read_text().splitlines())
        uplinks = {} if uplink is None else uplink_settings(uplink)
        fields: dict[str, Any] = dict(
            timeout_s=timeout, step_timeout_s=step_timeout, startup_timeout_s=startup_timeout,
            fault_tolerant=not no_ft, timeout_policy=timeout_policy, link_memory=not no_link_memory,
            on_node_failure=on_node_failure, trees=trees, chunk_bytes=chunk_bytes or Config().chunk_bytes,
            **uplinks, auth_key_file=_path(auth_key_file), tls_dir=_path(tls_dir),
            tls_cert_file=_path(tls_cert), tls_key_file=_path(tls_key), tls_ca_file=_path(tls_ca), insecure=insecure)
        fields.update(extra)  # --set NAME=VALUE wins over a flag of the same setting
        if as_json:  # for fttree launch: a restarted worker's heal from here is fttree's part
            click.echo(json.dumps({"up": rank}))
        ar = FTTreeAllreduce(rank, peers, faults=faults, join=join or False, **http_kwargs(rank, peers), **fields)
        ar.start()
    except FTTreeError as exc:
        raise click.ClickException(str(exc)) from None
    leave_asked: list[int] = []
    stopping = threading.Event()  # also ends a --linger

    def on_sigterm(signum: int, _frame: object) -> None:
        leave_asked.append(signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    gate = node_gate = None
    if gate_dir is not None:
        from .nodefaults import NODE_TAG, StepGate

        wait_s = max(startup_timeout, step_timeout) + 30
        if gate_steps:
            gate = StepGate(gate_dir, StepGate.parse_steps(gate_steps), rank, wait_s)
        if node_gate_steps:
            node_gate = StepGate(gate_dir, StepGate.parse_steps(node_gate_steps), rank, wait_s, tag=NODE_TAG)
    from .nodefaults import chain

    failed = False
    try:
        for rec in run_steps(ar, steps, size, before_step=chain(gate, node_gate)):
            failed |= not rec.exact
            if as_json:
                click.echo(rec.to_json())
            else:
                status = "exact" if rec.exact else f"FAILED: {rec.error or 'wrong sum'}"
                click.echo(f"rank {rank} step {rec.step:3d} {rec.duration_s * 1000:8.1f} ms {status}")
            if leave_asked:  # SIGTERM: leave after this step, so nobody waits for this rank
                ar.leave()
                click.echo(f"rank {rank} left the group after step {rec.step} (SIGTERM)", err=True)
                break
        if gate is not None:
            gate(steps)  # stay up (serving as a backup) until every rank has its last result
        linger(ar, stopping)
    except FTTreeError as exc:  # the real-fault gate; steps report their own errors
        raise click.ClickException(str(exc)) from None
    finally:
        ar.close()
    if ar.left_group is not None and not leave_asked and not failed:
        # left out after its last result: that result may not be the one the group settled on
        click.echo(f"rank {rank}: the group went on without this rank after step {steps - 1}: "
                   f"{ar.left_group}", err=True)
        sys.exit(1)
    if failed:
        sys.exit(1)


@main.command()
@click.option("-n", "world", type=click.IntRange(min=1, max=254), default=7, show_default=True,
              help="Number of local workers.")
@click.option("--host-base", default="127.0.0.1", show_default=True,
              help="Rank r listens on this address + r.")
@click.option("--port", type=click.IntRange(1, 65535), default=29500, show_default=True,
              help="Port every worker listens on (each on its own address).")
@click.option("--launch-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write peers.txt and each worker's log, worker-R.log (default: a new temp dir).")
@click.option("--real-faults", is_flag=True,
              help="Apply --faults with iptables (netem/ scripts) in a network namespace, not in-process. Needs root.")
@click.option("--netns", default=None, metavar="NAME",
              help="Namespace for --real-faults (default: a new fttree-PID, deleted afterwards).")
@click.option("--behind-nat", "behind_nat", multiple=True, metavar="RANKS",
              help="Put these ranks (3,4) behind a NAT router of their own (repeat for more sites), each rank in a "
                   "namespace of its own (netem/nat.sh). Needs root.")
@click.option("--nat-ports", type=click.Choice(["keep", "random", "random-fully", "route"]), default="keep",
              show_default=True,
              help="How the --behind-nat routers map source ports: keep (MASQUERADE, as most home routers: a hole "
                   "punch between sites connects), random or random-fully (a new port per connection, as carrier "
                   "NATs: punches fail and the relay stays); route: no NAT, the routers only route and every rank "
                   "dials every other (the control run: it differs from an all-public one by the routers' hop only).")
@click.option("--shape-uplink", "shape_uplink", default=None, metavar="RATE",
              help="Limit what each rank sends to RATE (tc units: 100mbit; 100mbit,3=10mbit: rank 3 at 10), each rank "
                   "in a namespace of its own (netem/nat.sh's network, all public unless --behind-nat) and limited on "
                   "its own interface (netem/uplink.sh), so ranks behind NATs and public ones are limited alike. The "
                   "workers are not told the rate (--uplink does that): they measure it. Needs root.")
@click.option("--no-key", is_flag=True,
              help="Make no job key: the workers prove nothing (loopback only, unless --insecure; a baseline "
                   "for what the key costs).")
@click.option("--tls", is_flag=True,
              help="Encrypt every connection: make a job CA and a certificate per rank (tls/ in the launch "
                   "directory), or use --tls-dir's.")
@_job_options
@_auth_options
@_settings_option
@launch_options
def launch(world: int, host_base: str, port: int, launch_dir: Path | None, real_faults: bool, netns: str | None,
           steps: int, size: int, timeout: float, step_timeout: float, startup_timeout: float, no_ft: bool,
           faults: str, timeout_policy: str, no_link_memory: bool, on_node_failure: str, chunk_bytes: int | None,
           trees: str, uplink: str | None, auth_key_file: Path | None, tls_dir: Path | None,
           tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None, insecure: bool, tls: bool,
           no_key: bool, behind_nat: tuple[str, ...], nat_ports: str, shape_uplink: str | None,
           settings: tuple[str, ...]) -> None:
    """Start N local workers on 127.0.0.x and print per-step times and exactness.

    crash and hang faults happen to the worker processes for real (SIGKILL; SIGSTOP, then
    SIGCONT); the other faults in-process, or with iptables under --real-faults. With
    --behind-nat, each rank runs in a namespace of its own and those named sit behind NATs
    (docs/nat.md); --shape-uplink limits each rank's uplink there. The workers
    prove a key made for this job (job.key in the launch directory) unless --auth-key-file
    names one; --tls also encrypts their connections."""
    from ..net.credentials import write_key
    from .launch import launch as run_launch
    from .nodefaults import link_schedule_text, node_faults

    try:
        schedule = FaultSchedule(faults, world=world, launcher=True)  # fail fast on a bad schedule, before spawning
        node_faults(schedule, steps)
    except FTTreeError as exc:
        raise click.BadParameter(str(exc), param_hint="--faults") from None
    if uplink is not None:
        uplink_settings(uplink)  # a bad rate fails here, not in every worker
    sites: list[list[int]] = []
    if nat_ports != "keep" and not behind_nat:
        raise click.UsageError("--nat-ports is how the --behind-nat routers map ports: give --behind-nat too")
    if behind_nat:
        from .realfaults import parse_sites

        if real_faults:
            raise click.UsageError("--behind-nat and --real-faults cannot be combined yet")
        try:
            sites = parse_sites(behind_nat, world)
        except FTTreeError as exc:
            raise click.BadParameter(str(exc), param_hint="--behind-nat") from None
    shaped = _shape_uplink_spec(shape_uplink, world, real_faults)
    _parse_settings(settings)  # likewise a bad setting
    args = ["--steps", str(steps), "--size", str(size), "--timeout", str(timeout), "--step-timeout",
            str(step_timeout), "--startup-timeout", str(startup_timeout), "--timeout-policy", timeout_policy,
            "--on-node-failure", on_node_failure]
    if no_link_memory:
        args.append("--no-link-memory")
    if chunk_bytes:
        args += ["--chunk-bytes", str(chunk_bytes)]
    args += ["--trees", trees]
    if uplink is not None:
        args += ["--uplink", uplink]
    in_process = link_schedule_text(schedule)
    if in_process and not real_faults:
        args += ["--faults", in_process]
    if no_ft:
        args.append("--no-ft")
    for item in settings:
        args += ["--set", item]
    launch_dir = launch_dir or Path(tempfile.mkdtemp(prefix="fttree-launch-"))
    if tls_cert or tls_key or tls_ca:
        raise click.UsageError("launch gives each worker its own certificate: use --tls or --tls-dir")
    if not no_key:
        args += ["--auth-key-file", str(auth_key_file or write_key(launch_dir / "job.key"))]
    elif auth_key_file is not None:
        raise click.UsageError("--no-key and --auth-key-file contradict each other")
    args += ["--insecure"] if insecure else []
    if tls and tls_dir is None:
        from ..net.certs import make

        tls_dir = launch_dir / "tls"
        make(tls_dir, range(world))
    if tls_dir is not None:
        args += ["--tls-dir", str(tls_dir)]
    args += launch_worker_args(world, host_base, port, launch_dir)
    if real_faults:
        from .realfaults import run_launch_cli

        run_launch_cli(schedule, world, args, steps=steps, netns=netns, host_base=host_base, port=port,
                       launch_dir=launch_dir,
                       deadline_s=startup_timeout + steps * (step_timeout + 5) + launch_linger_s(),
                       verbose=click.get_current_context().find_root().params.get("verbose", 0))
        return
    from .realfaults import sigterm_as_interrupt

    deadline_s = startup_timeout + steps * (step_timeout + 5) + launch_linger_s()
    verbose = click.get_current_context().find_root().params.get("verbose", 0)
    try:
        with sigterm_as_interrupt():  # so a stopped (hung) worker is continued even when we are terminated
            if sites or shaped is not None:
                from .realfaults import launch_behind_nat

                result = launch_behind_nat(sites, world, args, steps=steps, port=port, launch_dir=launch_dir,
                                           deadline_s=deadline_s, echo=click.echo, schedule=schedule, verbose=verbose,
                                           nat_ports=nat_ports, uplinks=shaped)
            else:
                result = run_launch(world, args, steps=steps, host_base=host_base, port=port, launch_dir=launch_dir,
                                    deadline_s=deadline_s, echo=click.echo, schedule=schedule, verbose=verbose)
    except FTTreeError as exc:
        raise click.ClickException(str(exc)) from None
    if not result.ok:
        sys.exit(1)


def _shape_uplink_spec(text: str | None, world: int, real_faults: bool) -> UplinkSpec | None:
    """`launch --shape-uplink`'s spec, checked against the job before anything is built."""
    if text is None:
        return None
    if real_faults:
        raise click.UsageError("--shape-uplink and --real-faults cannot be combined yet")
    from .rank_uplinks import check_spec
    from .units import parse_uplinks

    try:
        spec = parse_uplinks(text)
        check_spec(spec, world)
    except FTTreeError as exc:
        raise click.BadParameter(str(exc), param_hint="--shape-uplink") from None
    return spec


@main.command()
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the key (readable by its owner only).")
def key(out: Path) -> None:
    """Write a fresh shared key for a job: give the same file to every worker (--auth-key-file)."""
    from ..net.credentials import write_key

    click.echo(f"wrote a new job key to {write_key(out)}: copy it to every worker of the job, over a channel "
               f"you trust")


@main.command()
@click.option("-n", "world", type=click.IntRange(min=1), default=None,
              help="Make a new job CA and certificates for ranks 0..N-1.")
@click.option("--add", "add", type=click.IntRange(min=0), multiple=True, metavar="RANK",
              help="Sign a certificate for RANK with the CA already in --out (a rank that joins later); repeatable.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The job's certificate folder: ca.pem, ca.key, rank-R.pem, rank-R.key.")
def certs(world: int | None, add: tuple[int, ...], out: Path) -> None:
    """Make a job's TLS certificates: a CA of its own and one certificate per rank, naming the
    rank. Worker R needs ca.pem, rank-R.pem and rank-R.key (--tls-dir); keep ca.key where new
    ranks are signed."""
    from ..net.certs import make

    if (world is None) == (not add):
        raise click.UsageError("give either -n N (a new job CA) or --add RANK (a rank signed by the CA in --out)")
    try:
        made = make(out, range(world) if world is not None else list(add), add=bool(add))
    except FTTreeError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {len(made)} rank certificate(s) to {out}: give worker R ca.pem, rank-R.pem and rank-R.key; "
               f"keep ca.key where ranks are added")
