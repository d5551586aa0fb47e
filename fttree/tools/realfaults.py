"""Real faults: a fault schedule applied by the kernel's firewall instead of the in-process layer.

`fttree launch --real-faults` runs the workers inside a network namespace and turns each rule
of the schedule into a call of a netem/ script (cut.sh, heal.sh, loss.sh) at the right step.
Steps and wall-clock time are tied together by a gate: before every step where the set of
active rules changes, each worker drops a `ready-S-R` file and waits for `go-S`; the runner
waits for all ranks, changes the firewall, then writes `go-S`. So a rule `cut 1-0 @5..10` is
in the kernel exactly while steps 5 to 10 run, whatever their speed, and the gate's wait is
not counted in any step's time. A last gate after the final step keeps every worker serving
as a backup until all ranks have their last result.

A `partition A,B,C @S..T` becomes a cut of every link between the two sides. `crash` and `hang`
are no firewall rules: they are signals to the worker processes (nodefaults.py), and the gates
stop waiting for a rank once it is killed or stopped.

Every rule goes away again: the runner resets the namespace when it stops, and a namespace it
created is deleted (with every rule in it) even when the run fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click

from ..core.faults import FaultKind, FaultRule, FaultSchedule
from ..errors import ConfigError, FTTreeError
from . import SOURCE_ROOT
from .nodefaults import GATE_POLL_S, NodeFaultDriver, RealFaultError, StepGate, node_faults
from .units import UplinkSpec

if TYPE_CHECKING:
    from .launch import LaunchResult

__all__ = ["GATE_POLL_S", "RealFaultError", "StepGate"]  # moved to nodefaults; still importable from here

SCRIPT_TIMEOUT_S = 30.0


# ---- the netem scripts ---------------------------------------------------------------------


def netem_dir() -> Path:
    """The netem/ scripts: FTTREE_NETEM_DIR, else the netem/ folder next to the package."""
    env = os.environ.get("FTTREE_NETEM_DIR")
    path = Path(env) if env else SOURCE_ROOT / "netem"
    if not (path / "cut.sh").is_file():
        where = "FTTREE_NETEM_DIR" if env else "the source tree"
        raise RealFaultError(f"netem scripts not found in {path} ({where}); set FTTREE_NETEM_DIR to the netem/ folder "
                             f"of an fttree checkout")
    return path


def run_script(name: str, *args: str, check: bool = True, timeout_s: float = SCRIPT_TIMEOUT_S) -> str:
    """Run netem/NAME with ARGS and return its stdout; a failure raises with the script's own words."""
    cmd = [str(netem_dir() / name), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RealFaultError(f"{name} {' '.join(args)} did not finish within {timeout_s:g} s") from None
    if check and proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        raise RealFaultError(f"{name} {' '.join(args)} failed (exit {proc.returncode}): {' / '.join(detail)}")
    return proc.stdout


def require_real_faults() -> None:
    """Raise RealFaultError saying what is missing unless this process can inject real faults."""
    if os.geteuid() != 0:
        raise RealFaultError("--real-faults needs root: iptables rules and network namespaces change the kernel's "
                             "network state. Run it with sudo, or drop --real-faults to inject the same schedule "
                             "in-process.")
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise RealFaultError(f"--real-faults needs the '{tool}' command: apt-get install {package}")
    netem_dir()


# ---- schedule -> script calls ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class Change:
    """One firewall state: a cut or a loss on a target ("0-1" link or "3" worker)."""

    kind: str  # "cut" or "loss"
    target: str
    percent: str = ""

    def install(self) -> list[str]:
        if self.kind == "cut":
            return ["cut.sh", self.target]
        return ["loss.sh", self.target, f"{self.percent}%"]

    def remove(self) -> list[str]:
        if self.kind == "cut":
            return ["heal.sh", self.target]
        return ["loss.sh", "--remove", self.target]

    def __str__(self) -> str:
        return f"{self.kind} {self.target}" + (f" {self.percent}%" if self.percent else "")


def changes_for(rule: FaultRule, world: int) -> list[Change]:
    """The firewall state a rule asks for. A partition cuts every link between its two sides;
    crash and hang change no rule (they are signals to processes, see nodefaults.py); delay has
    none (tc netem is per interface, not per link)."""
    target = str(rule.a) if rule.b is None else f"{min(rule.a, rule.b)}-{max(rule.a, rule.b)}"
    match rule.kind:
        case FaultKind.CUT | FaultKind.ISOLATE:
            return [Change("cut", target)]
        case FaultKind.DROP | FaultKind.LOSS:
            return [Change("loss", target, f"{rule.probability * 100:g}")]
        case FaultKind.PARTITION:
            inside = set(rule.group)
            return [Change("cut", f"{min(a, b)}-{max(a, b)}") for a in sorted(inside) for b in range(world)
                    if b not in inside]
        case FaultKind.CRASH | FaultKind.HANG:
            return []
        case FaultKind.DELAY:
            raise ConfigError(f"fault {str(rule)!r} cannot be a real fault: the kernel delays whole interfaces "
                              f"(netem/delay.sh, where tc netem exists), not one link. Run delays in-process "
                              f"(without --real-faults).")
    raise AssertionError(rule.kind)


def desired(rules: Sequence[FaultRule], step: int, world: int = 0) -> frozenset[Change]:
    world = world or 1 + max((r for rule in rules for r in rule.ranks()), default=0)
    return frozenset(c for r in rules if r.active(step) for c in changes_for(r, world))


def boundaries(schedule: FaultSchedule, steps: int,
               world: int = 0) -> dict[int, tuple[frozenset[Change], frozenset[Change]]]:
    """Steps before which the firewall must change, each with (to_remove, to_install)."""
    out: dict[int, tuple[frozenset[Change], frozenset[Change]]] = {}
    before: frozenset[Change] = frozenset()
    for step in range(steps):
        now = desired(schedule.rules, step, world)
        if now != before:
            out[step] = (before - now, now - before)
        before = now
    return out


# ---- the runner (launcher side) --------------------------------------------------------------


class RealFaultRunner:
    """Applies a schedule through the netem scripts inside `netns`, gated on the workers' steps."""

    def __init__(self, schedule: FaultSchedule, *, world: int, steps: int, netns: str, host_base: str = "127.0.0.1",
                 gate_dir: Path | None = None, echo: Callable[[str], None] = print,
                 gone: Callable[[], set[int]] = set) -> None:
        for rule in schedule.rules:
            changes_for(rule, world)  # a delay rule fails here, before anything starts
        self.world, self.netns, self.host_base, self.echo = world, netns, host_base, echo
        self.gone = gone  # ranks killed or stopped by node faults: nobody waits for them at a gate
        self.plan = boundaries(schedule, steps, world)
        # A last gate after the final step keeps every worker up until all have their result:
        # a rank whose primary link is still down needs its backups alive to get it.
        self.gates = [*sorted(self.plan), steps] if self.plan else []
        self.gate_dir = gate_dir or Path(tempfile.mkdtemp(prefix="fttree-gate-"))
        self.gate_dir.mkdir(parents=True, exist_ok=True)
        self.error: BaseException | None = None
        self.applied: list[tuple[int, str]] = []  # (step, "cut 0-1") in order, for tests and logs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fttree-real-faults", daemon=True)

    def worker_args(self) -> list[str]:
        if not self.gates:
            return []
        return ["--gate-dir", str(self.gate_dir), "--gate-steps", ",".join(map(str, self.gates))]

    def _script(self, name: str, *args: str) -> None:
        run_script(name, "--netns", self.netns, "--base", self.host_base, *args)

    def _all_ready(self, step: int) -> bool:
        gone = self.gone()
        return all((self.gate_dir / f"ready-{step}-{r}").exists() for r in range(self.world) if r not in gone)

    def _run(self) -> None:
        try:
            for step in self.gates:
                while not self._all_ready(step):
                    if self._stop.wait(GATE_POLL_S):
                        return
                if step not in self.plan:  # the final gate: nothing to change
                    (self.gate_dir / f"go-{step}").touch()
                    continue
                remove, install = self.plan[step]
                for change in sorted(remove):
                    self._script(*change.remove())
                    self.applied.append((step, f"heal {change}" if change.kind == "cut" else f"end {change}"))
                for change in sorted(install):
                    self._script(*change.install())
                    self.applied.append((step, str(change)))
                done = [f"{'-' if c in remove else '+'}{c}" for c in sorted(remove | install)]
                self.echo(f"real faults before step {step} in {self.netns}: {', '.join(done)}")
                (self.gate_dir / f"go-{step}").touch()
        except BaseException as exc:
            self.error = exc
            (self.gate_dir / "abort").write_text(str(exc))

    def __enter__(self) -> RealFaultRunner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=SCRIPT_TIMEOUT_S * 2)
        run_script("reset.sh", "--netns", self.netns)
        shutil.rmtree(self.gate_dir, ignore_errors=True)


# ---- namespaces ----------------------------------------------------------------------------


def namespace_exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return name in {line.split()[0] for line in out.splitlines() if line.strip()}


def namespace_pids(name: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False).stdout
    return {int(p) for p in out.split() if p.isdigit()}


def _ancestry() -> set[int]:
    """This process and its parents (a shell inside the namespace may have started us)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


@contextlib.contextmanager
def namespace(name: str | None, *, world: int, host_base: str = "127.0.0.1") -> Iterator[str]:
    """A namespace ready for `world` ranks. One this creates is deleted on exit, processes
    left inside included; an existing one (named by the user) is only reset."""
    name = name or f"fttree-{os.getpid()}"
    created = not namespace_exists(name)
    if not created:
        others = namespace_pids(name) - _ancestry()
        if others:
            raise RealFaultError(f"namespace {name} is in use by processes {sorted(others)} (another run?): its rules "
                                 f"would be reset under them. Pick another --netns, or leave it out for a fresh one.")
    try:
        run_script("cluster.sh", "up", name, "-n", str(world), "--base", host_base)
        yield name
    finally:
        if created:
            run_script("cluster.sh", "down", name, "--kill", check=False)
        else:
            run_script("reset.sh", "--netns", name, check=False)


def sigterm_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, so `finally` cleanup runs."""
    return signals_raise(lambda signum: KeyboardInterrupt(f"signal {signum}"))


@contextlib.contextmanager
def signals_raise(error: Callable[[int], BaseException]) -> Iterator[None]:
    """While inside: SIGTERM and SIGHUP raise `error(signum)` in the main thread, so `finally`
    blocks (firewall rules, tc limits, namespaces, worker processes) run on a kill as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise error(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


@dataclass
class RealFaultRun:
    result: LaunchResult
    netns: str
    applied: list[tuple[int, str]]  # (step, "cut 0-1" / "heal cut 0-1" / ...) in the order applied


def launch_with_real_faults(schedule: FaultSchedule, world: int, worker_args: Sequence[str], *, steps: int,
                            netns: str | None = None, host_base: str = "127.0.0.1", port: int = 29500,
                            launch_dir: Path | None = None, deadline_s: float = 600.0,
                            echo: Callable[[str], None] = print, verbose: int = 0) -> RealFaultRun:
    """`fttree launch` with the schedule applied by the kernel: workers in a namespace, rules
    installed and removed by the netem scripts at step boundaries."""
    for rule in schedule.rules:
        changes_for(rule, world)  # a delay rule fails here, before anything is created
    faults = node_faults(schedule, steps)
    require_real_faults()
    with sigterm_as_interrupt(), namespace(netns, world=world, host_base=host_base) as ns:
        gate_dir = Path(tempfile.mkdtemp(prefix="fttree-gate-"))
        driver = NodeFaultDriver(faults, world=world, gate_dir=gate_dir, echo=echo)
        runner = RealFaultRunner(schedule, world=world, steps=steps, netns=ns, host_base=host_base, echo=echo,
                                 gate_dir=gate_dir, gone=driver.gone_now)
        if schedule.rules:
            echo(f"real faults in namespace {ns}: {schedule} (firewall changes before steps "
                 f"{', '.join(map(str, sorted(runner.plan))) or 'none'})")
        with runner:
            from .launch import launch  # here, not at import: it pulls in numpy and the allreduce

            result = launch(world, [*worker_args, *runner.worker_args()], steps=steps,
                            host_base=host_base, port=port, launch_dir=launch_dir, deadline_s=deadline_s, echo=echo,
                            prefix=["ip", "netns", "exec", ns], schedule=schedule, driver=driver, verbose=verbose)
        if runner.error is not None:
            raise RealFaultError(f"applying real faults failed: {runner.error}") from runner.error
        return RealFaultRun(result=result, netns=ns, applied=runner.applied)


# ---- ranks behind NATs (netem/nat.sh) --------------------------------------------------------


def parse_sites(sites: Sequence[str], world: int) -> list[list[int]]:
    """`--behind-nat 3,4 --behind-nat 5`: each a site's ranks; at least one rank stays public
    (ranks of two sites reach each other through it: net/relay.py)."""
    parsed: list[list[int]] = []
    seen: set[int] = set()
    for text in sites:
        try:
            ranks = [int(r) for r in text.split(",")]
        except ValueError:
            raise ConfigError(f"--behind-nat takes ranks separated by commas (3,4), got {text!r}") from None
        for r in ranks:
            if not 0 <= r < world:
                raise ConfigError(f"--behind-nat {text}: rank {r} is not one of 0..{world - 1}")
            if r in seen:
                raise ConfigError(f"--behind-nat: rank {r} is behind two NATs")
            seen.add(r)
        parsed.append(ranks)
    if len(seen) == world:
        raise ConfigError("--behind-nat: every rank is behind a NAT; at least one must be public (the others dial it)")
    return parsed


NAT_PORTS = ("keep", "random", "random-fully", "route")  # how nat_network's routers treat a site's connections


@contextlib.contextmanager
def nat_network(sites: Sequence[Sequence[int]], world: int, name: str | None = None,
                nat_ports: str = "keep") -> Iterator[str]:
    """netem/nat.sh's network for `world` ranks, `sites` behind NATs of their own and the
    rest public; removed on exit, processes inside included. `nat_ports`: how the routers
    map source ports (keep, random, random-fully: nat.sh --nat-ports), or route: no NAT, the
    routers only route (nat.sh --routed), the control that measures their hop alone."""
    if nat_ports not in NAT_PORTS:
        raise ConfigError(f"nat_ports is one of {', '.join(NAT_PORTS)}: got {nat_ports!r}")
    name = name or f"fttreenat{os.getpid()}"
    behind = {r for site in sites for r in site}
    args = ["up", name, "--public", ",".join(str(r) for r in range(world) if r not in behind),
            *(["--routed"] if nat_ports == "route" else ["--nat-ports", nat_ports])]
    for site in sites:
        args += ["--site", ",".join(map(str, site))]
    try:
        run_script("nat.sh", *args)
        yield name
    finally:
        run_script("nat.sh", "down", name, check=False)


def launch_behind_nat(sites: Sequence[Sequence[int]], world: int, worker_args: Sequence[str], *, steps: int,
                      port: int = 29500, launch_dir: Path | None = None, deadline_s: float = 600.0,
                      echo: Callable[[str], None] = print, schedule: FaultSchedule | None = None,
                      site_local: bool = True, verbose: int = 0, name: str | None = None,
                      nat_ports: str = "keep", uplinks: UplinkSpec | None = None) -> LaunchResult:
    """`fttree launch --behind-nat`: each rank in a namespace of its own (netem/nat.sh), the
    ranks of each site behind a NAT router (no sites: all public, in the same network builder,
    so that a run with NATs differs from one without by the NATs only). The peers file lists a
    site rank as `HOST:PORT behind siteK` (its site-mates dial it there), or `-` without
    `site_local`. `name`: the network's (its namespaces' prefix); `nat_ports`: how the routers
    map ports (nat.sh); `uplinks` (`--shape-uplink`): each rank's egress limited on its own
    interface (rank_uplinks.py), what each sent through its limit in the result's `uplinks`."""
    from . import rank_uplinks

    if uplinks is not None:
        rank_uplinks.check_spec(uplinks, world)  # before anything is built
    if os.geteuid() != 0:
        raise RealFaultError("--behind-nat and --shape-uplink need root: they build network namespaces, NAT rules "
                             "and tc limits")
    needed = [("ip", "iproute2"), ("iptables", "iptables"), *([("tc", "iproute2")] if uplinks is not None else [])]
    for tool, package in needed:
        if shutil.which(tool) is None:
            raise RealFaultError(f"--behind-nat and --shape-uplink need the '{tool}' command: apt-get install "
                                 f"{package}")
    nat = str(netem_dir() / "nat.sh")
    with sigterm_as_interrupt(), nat_network(sites, world, name=name, nat_ports=nat_ports) as name:
        peers = run_script("nat.sh", "peers", name, "--port", str(port), *(["--site-local"] if site_local else []))
        if sites and nat_ports == "route":
            echo(f"ranks behind plain routers, no NAT: {'; '.join(','.join(map(str, s)) for s in sites)} "
                 f"(network {name}; every rank dials every other)")
        elif sites:
            echo(f"ranks behind NATs: {'; '.join(','.join(map(str, s)) for s in sites)} (network {name})")
        else:
            echo(f"every rank public, each in a namespace of its own (network {name})")
        if uplinks is not None:
            rates = rank_uplinks.shape(name, uplinks, world)
            echo(f"uplinks shaped on each rank's own interface (netem/uplink.sh): {uplinks.default} each"
                 + "".join(f", rank {r} {rate}" for r, rate in rates.items() if rate != uplinks.default))
        from .launch import launch

        result = launch(world, worker_args, steps=steps, port=port, launch_dir=launch_dir, deadline_s=deadline_s,
                        echo=echo, schedule=schedule, verbose=verbose, peers=peers.splitlines(),
                        rank_prefix=lambda rank: [nat, "exec", name, str(rank), "--"])
        if uplinks is not None:
            result.uplinks = rank_uplinks.counters(name, world)
            for line in rank_uplinks.describe(result.uplinks, steps):
                echo(line)
        return result


def run_launch_cli(schedule: FaultSchedule, world: int, worker_args: Sequence[str], *, steps: int,
                   netns: str | None, host_base: str, port: int, launch_dir: Path | None, deadline_s: float,
                   verbose: int = 0) -> None:
    """`fttree launch --real-faults`: errors become click errors, a failed run exit status 1."""
    try:
        run = launch_with_real_faults(schedule, world, worker_args, steps=steps, netns=netns, host_base=host_base,
                                      port=port, launch_dir=launch_dir, deadline_s=deadline_s, echo=click.echo,
                                      verbose=verbose)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--faults") from None
    except FTTreeError as exc:
        raise click.ClickException(str(exc)) from None
    if not run.result.ok:
        raise SystemExit(1)


# ---- `fttree netem ...` ----------------------------------------------------------------------


def _netns_options(f: Callable[..., None]) -> Callable[..., None]:
    f = click.option("--all", "all_ns", is_flag=True, help="The current namespace and every named one.")(f)
    return click.option("--netns", default=None, metavar="NAME", help="A network namespace (default: current).")(f)


def _scope(netns: str | None, all_ns: bool) -> list[str]:
    if netns and all_ns:
        raise click.UsageError("give --netns NAME or --all, not both")
    return ["--all"] if all_ns else ["--netns", netns] if netns else []


def _run_cli(name: str, *args: str) -> None:
    try:
        click.echo(run_script(name, *args), nl=False)
    except RealFaultError as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def netem() -> None:
    """Real faults with iptables and tc: see the rules fttree installed, remove them, find the scripts."""


@netem.command()
@_netns_options
def status(netns: str | None, all_ns: bool) -> None:
    """List the iptables rules and tc qdiscs the fttree netem scripts installed."""
    _run_cli("status.sh", *_scope(netns, all_ns))


@netem.command()
@_netns_options
def reset(netns: str | None, all_ns: bool) -> None:
    """Remove every rule the fttree netem scripts installed (and nothing else)."""
    _run_cli("reset.sh", *_scope(netns, all_ns))


@netem.command()
def path() -> None:
    """Print the folder holding the netem scripts (cut.sh, heal.sh, loss.sh, ...)."""
    try:
        click.echo(str(netem_dir()))
    except RealFaultError as exc:
        raise click.ClickException(str(exc)) from None
