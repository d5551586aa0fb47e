"""`fttree status`: poll every worker's /status and draw the tree with each link's health.

Also the control-plane options `fttree worker` and `fttree launch` share (--http-port, --no-http,
--log-json, --linger). They are stored in the click context instead of being passed as
parameters, so the worker and launch commands only call `http_kwargs()` / `launch_worker_args()`.
Kept free of aiohttp at import time: every `fttree` command imports this module.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from .. import logs
from ..errors import ConfigError
from ..net.address import UNLISTED, Address, parse_address, parse_peers

HTTP_PORT_OFFSET = 1000  # a worker's default control port: its data port + this
_OPTS = "fttree.observability"

# ---- options shared by `fttree worker` and `fttree launch` ---------------------------------------


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    ctx.meta.setdefault(_OPTS, {})[param.name] = value
    return value


def _store_log_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        logs.setup(None, json_lines=True)
    return bool(_store(ctx, param, value))


def _common(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--no-http", is_flag=True, expose_value=False, callback=_store,
                     help="Serve no /status, /metrics or /faults.")(f)
    f = click.option("--log-json", is_flag=True, expose_value=False, callback=_store_log_json,
                     help="Log one JSON object per line (with rank and step) to stderr.")(f)
    return click.option("--linger", type=click.FloatRange(min=0), default=0.0, expose_value=False,
                        callback=_store, metavar="SECONDS",
                        help="Keep serving HTTP this long after the last step (for fttree status).")(f)


def worker_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = _common(f)
    f = click.option("--http-port", type=click.IntRange(0, 65535), default=None, expose_value=False,
                     callback=_store, help=f"Control server port (default: this rank's port + {HTTP_PORT_OFFSET}; "
                                           "0: any free port).")(f)
    f = click.option("--http-port-base", type=click.IntRange(1, 65535), default=None, expose_value=False,
                     callback=_store, hidden=True, help="Control server port = this + rank (for launch).")(f)
    f = click.option("--http-host", default=None, expose_value=False, callback=_store,
                     help="Control server address (default: this rank's address if loopback, else 127.0.0.1). "
                          "Off loopback, /faults needs --http-token.")(f)
    return click.option("--http-token", default=None, envvar="FTTREE_HTTP_TOKEN", expose_value=False,
                        callback=_store, help="Bearer token for POST/DELETE /faults (env FTTREE_HTTP_TOKEN).")(f)


def launch_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = _common(f)
    return click.option("--http-port", type=click.IntRange(1, 65535), default=None, expose_value=False,
                        callback=_store, metavar="BASE",
                        help=f"Rank r serves HTTP on BASE + r (default: --port + {HTTP_PORT_OFFSET}).")(f)


def _opts() -> dict[str, Any]:
    ctx = click.get_current_context(silent=True)
    return {} if ctx is None else dict(ctx.meta.get(_OPTS, {}))


def http_kwargs(rank: int, peers: Sequence[Address]) -> dict[str, Any]:
    """FTTreeAllreduce keyword arguments for the control server of a `fttree worker`."""
    o = _opts()
    if o.get("no_http") or not 0 <= rank < len(peers):
        return {}  # a bad rank is FTTreeAllreduce's to report
    if o.get("http_port") is not None:
        port = int(o["http_port"])
    elif o.get("http_port_base") is not None:
        port = int(o["http_port_base"]) + rank
    else:
        port = peers[rank].port + HTTP_PORT_OFFSET
    if port > 65535:
        raise ConfigError(f"rank {rank}'s control port {port} is above 65535: set --http-port")
    return {"http_port": port, "http_host": o.get("http_host"), "http_token": o.get("http_token")}


def linger(ar: Any, stop: threading.Event | None = None) -> None:
    """Keep a finished worker's control server up for --linger seconds, or until `stop` is set
    (SIGTERM: `fttree launch` ending its workers, on Ctrl-C or at its end)."""
    seconds = float(_opts().get("linger") or 0.0)
    if seconds > 0 and getattr(ar, "http_address", None):
        (stop or threading.Event()).wait(seconds)


def launch_linger_s() -> float:
    return float(_opts().get("linger") or 0.0)


def launch_worker_args(world: int, host_base: str, port: int, launch_dir: Path) -> list[str]:
    """Worker flags for `fttree launch`; writes the control addresses to launch_dir/http.txt."""
    from ..net.address import local_peers

    o = _opts()
    args = ["--log-json"] if o.get("log_json") else []
    if o.get("linger"):
        args += ["--linger", str(o["linger"])]
    if o.get("no_http"):
        return [*args, "--no-http"]
    base = int(o.get("http_port") or port + HTTP_PORT_OFFSET)
    if base + world - 1 > 65535:
        raise click.BadParameter(f"ports {base}..{base + world - 1} run past 65535", param_hint="--http-port")
    hosts = [parse_address(p).host for p in local_peers(world, host_base, port)]
    launch_dir.mkdir(parents=True, exist_ok=True)
    http_file = launch_dir / "http.txt"
    http_file.write_text("".join(f"{h}:{base + r}\n" for r, h in enumerate(hosts)))
    click.echo(f"control servers listed in {http_file}; watch them with: fttree status --launch-dir {launch_dir}")
    return [*args, "--http-port-base", str(base)]


# ---- polling ------------------------------------------------------------------------------


def targets_from(peers_file: Path | None, launch_dir: Path | None, offset: int) -> list[str]:
    """Control addresses, one per rank: launch_dir/http.txt, else peers' host and port + offset."""
    if launch_dir is not None:
        http_file = launch_dir / "http.txt"
        if http_file.is_file():
            return [str(a) for a in parse_peers(http_file.read_text().splitlines())]
        peers_file = launch_dir / "peers.txt"
        if not peers_file.is_file():
            raise click.ClickException(f"{launch_dir} has neither http.txt nor peers.txt: is it a launch dir?")
    if peers_file is None:
        raise click.UsageError("give --peers FILE or --launch-dir DIR")
    peers = parse_peers(peers_file.read_text().splitlines())
    return [f"{p.host}:{p.port + offset}" if p.listed else str(p) for p in peers]


Report = dict[str, Any] | str  # a /status document, or why the worker did not answer


async def _fetch(session: Any, target: str, timeout_s: float) -> Report:
    import aiohttp

    if target == UNLISTED:
        return "listed as '-' (behind a NAT): its control server answers on its own machine only"
    try:
        async with session.get(f"http://{target}/status", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return f"{target}: HTTP {resp.status}"
            doc = await resp.json()
            return doc if isinstance(doc, dict) else f"{target}: not a status document"
    except TimeoutError:
        return f"{target}: no answer within {timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return f"{target}: {exc.__class__.__name__}: {exc}"


async def poll(targets: Sequence[str], timeout_s: float = 2.0, token: str | None = None) -> list[Report]:
    """Every worker's /status at once; a worker that does not answer gives the reason instead."""
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        return list(await asyncio.gather(*(_fetch(session, t, timeout_s) for t in targets)))


# ---- rendering ----------------------------------------------------------------------------

SEVERITY = {"up": 0, "suspect": 1, "probing": 2, "failed": 3}
COLOURS = {"up": "green", "suspect": "yellow", "probing": "cyan", "failed": "red", "unknown": "bright_black"}


def _badge(state: str, width: int = 7) -> str:
    return click.style(f"{state:<{width}}", fg=COLOURS.get(state, "white"), bold=state != "up")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def merge_link(name: str, ends: tuple[int, int], docs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One view of a link from everyone's reports: its two ends know best; observers fill in
    when both ends are silent. The worst state wins, then the newest change."""
    views = [lk for r in ends if r in docs for lk in docs[r].get("links", []) if lk.get("name") == name]
    if not views:
        views = [lk for doc in docs.values() for lk in doc.get("observed_links", []) if lk.get("name") == name]
    if not views:
        return {"name": name, "state": "unknown", "reason": "no worker at either end answered", "rtt_ms": None}
    worst = max(views, key=lambda v: (SEVERITY.get(v.get("state", ""), 0), v.get("since_step") or -1))
    rtts = [v["rtt_ms"] for v in views if v.get("rtt_ms") is not None]
    return {**worst, "rtt_ms": min(rtts) if rtts else None}


def _rank_line(rank: int, report: Report | None) -> str:
    if not isinstance(report, dict):
        return click.style(f"rank {rank}  unreachable ({report})", fg="red", bold=True)
    step = report.get("step", {})
    durations = [s["duration_s"] for s in report.get("last_steps", [])]
    current = step.get("current")
    parts = [click.style(f"rank {rank}", bold=True),
             f"step {'-' if current is None else current} {step.get('phase', '?')}",
             f"last {_ms(durations[-1] if durations else None)}"]
    if durations:
        parts.append(f"median {_ms(statistics.median(durations))}")
    counts = report.get("counts", {})
    extra = [f"{k} {counts[k]}" for k in ("timeouts", "recoveries", "retransmissions") if counts.get(k)]
    if extra:
        parts.append(click.style(", ".join(extra), fg="yellow"))
    if step.get("failed"):
        last = str(step.get("last_error", "")).split(":", 1)[0]
        parts.append(click.style(f"{step['failed']} failed step(s), last {last}", fg="red"))
    return "  ".join(parts)


def _first_clause(error: str, limit: int = 160) -> str:
    """An abort reason without the per-rank tail, so the same failure reads the same everywhere."""
    head = error.split("; ", 1)[0]
    return head if len(head) <= limit else head[:limit - 3] + "..."


def _newest_view(docs: dict[int, dict[str, Any]], world: int) -> tuple[int, tuple[int, ...]]:
    """The newest membership view any answering worker reports (epoch, ranks in tree slots)."""
    views = [(d["view"]["epoch"], tuple(d["view"]["members"])) for d in docs.values()
             if isinstance(d.get("view"), dict) and d.get("membership", {}).get("state") != "evicted"]
    return max(views) if views else (0, tuple(range(world)))


def _name(a: int, b: int) -> str:
    return f"{max(a, b)}-{min(a, b)}"  # the fault language's spelling, as the workers report links


def _other_tree_lines(docs: dict[int, dict[str, Any]]) -> list[str]:
    """The other trees (Config.trees) run over other links than tree 0, drawn above (they carry
    chunks of large steps): their uplinks that link memory holds failed or probing."""
    lines = []
    for rank, d in sorted(docs.items()):
        for t in d.get("trees", []):
            if t.get("tree", 0) > 0 and t.get("uplink") in ("failed", "probing"):
                via = " and ".join(map(str, t.get("relays", [])))
                lines.append(click.style(f"tree {t['tree']}: link {rank}->{t.get('parent')} {t['uplink']}; its "
                                         f"chunks go through rank {via}", fg=COLOURS[t["uplink"]]))
    return lines


def render(reports: Sequence[Report], *, now: float | None = None, max_events: int = 8) -> list[str]:
    """The tree of workers (the newest view's) with their links' health, and the workers the
    group left out, as lines (styled with click.style)."""
    from ..core.view import View

    world = len(reports)
    docs = {r: rep for r, rep in enumerate(reports) if isinstance(rep, dict)}
    current = [d["step"]["current"] for d in docs.values() if d.get("step", {}).get("current") is not None]
    steps = "-" if not current else str(max(current)) if min(current) == max(current) else \
        f"{min(current)}..{max(current)}"
    answering = click.style(f"{len(docs)}/{world} answering", fg="green" if len(docs) == world else "red", bold=True)
    stamp = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    epoch, members = _newest_view(docs, world)
    view = View(epoch, members)
    in_view = f"view {epoch}: {len(members)} of {world}" if epoch else ""
    lines = [f"fttree status  {world} workers  {answering}  step {steps}  {in_view}  {stamp}".replace("    ", "  ")]
    wrong_world = sorted(r for r, d in docs.items() if d.get("world") != world)
    if wrong_world:
        lines.append(click.style(f"ranks {wrong_world} report another world size: is the peers list right?",
                                 fg="red"))

    def walk(rank: int, prefix: str, last: bool, top: bool) -> None:
        line = _rank_line(rank, reports[rank] if rank < world else "not in the peers list")
        kids = view.neighbours(rank).children
        if top:
            lines.append(line)
            child_prefix = ""
        else:
            parent = view.neighbours(rank).parent
            assert parent is not None
            link = merge_link(_name(rank, parent), (rank, parent), docs)
            rtt = "" if link.get("rtt_ms") is None else f" rtt {link['rtt_ms']:.2f} ms"
            lines.append(f"{prefix}{'└── ' if last else '├── '}{_badge(link['state'])} {rank}-{parent}{rtt}  {line}")
            child_prefix = prefix + ("    " if last else "│   ")
            if link["state"] != "up":
                lines.append(f"{child_prefix}{'    ' if not kids else '│   '}"
                             f"{click.style('↳ ' + str(link.get('reason', '')), fg=COLOURS[link['state']])}")
        for i, c in enumerate(kids):
            walk(c, child_prefix, i == len(kids) - 1, False)

    if members:
        walk(view.root, "", True, True)
    pairs = {tuple(sorted((r, o))) for r in members for o in (view.neighbours(r).brother, view.neighbours(r).uncle)
             if o is not None}
    backups = [merge_link(_name(a, b), (a, b), docs) for a, b in sorted(pairs)]
    if backups:
        lines.append("backup links: " + "  ".join(f"{lk['name']} {_badge(lk['state'], 0)}" for lk in backups))
        lines.extend(f"  {lk['name']}: " + click.style(str(lk.get("reason", "")), fg=COLOURS[lk["state"]])
                     for lk in backups if lk["state"] != "up")
    lines.extend(_other_tree_lines(docs))
    evicted: dict[int, dict[str, Any]] = {}
    for d in docs.values():
        for e in d.get("membership", {}).get("evictions", []):
            evicted.setdefault(e["rank"], e)
    for rank in sorted(set(range(world)) - set(members)):
        e = evicted.get(rank)
        why = (f"left out of view {e['epoch']} after {e['detected_after_s']:.2f} s: {e['reason']}" if e
               else "not in the newest view")
        lines.append(click.style(f"rank {rank}  dead  {why}", fg="red", bold=True))
    for r, d in sorted(docs.items()):
        stopped = d.get("membership", {}).get("stopped")
        if stopped and r in members:
            lines.append(click.style(f"rank {r}  stopped: {stopped}", fg="red"))
    faults: dict[str, list[int]] = {}
    for r, d in docs.items():
        if d.get("faults"):
            faults.setdefault(d["faults"], []).append(r)
    for text, ranks in faults.items():
        lines.append(click.style(f"in-process faults on ranks {ranks}: {text}", fg="magenta"))
    failures: dict[str, list[int]] = {}
    for r, d in docs.items():
        if d.get("step", {}).get("last_error"):
            failures.setdefault(_first_clause(d["step"]["last_error"]), []).append(r)
    if failures:
        lines.append("last failed step:")
        lines.extend(click.style(f"  ranks {ranks}: {text}", fg="red") for text, ranks in failures.items())
    events = sorted({(e["step"], e.get("at", 0.0), r, e["text"]) for r, d in docs.items()
                     for e in d.get("recent_events", [])})
    if events:
        lines.append("recent events:")
        lines.extend(f"  rank {r}: {text}" for _step, _at, r, text in events[-max_events:])
    return lines


# ---- the command --------------------------------------------------------------------------


@click.command("status")
@click.option("--peers", "peers_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help=f"The job's peers file; rank r's control server is at its host, port + {HTTP_PORT_OFFSET}.")
@click.option("--launch-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A `fttree launch` directory (reads its http.txt).")
@click.option("--http-offset", type=int, default=HTTP_PORT_OFFSET, show_default=True,
              help="Control port = data port + this, with --peers.")
@click.option("--token", default=None, envvar="FTTREE_HTTP_TOKEN", help="Bearer token (env FTTREE_HTTP_TOKEN).")
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True, help="Seconds.")
@click.option("--count", type=click.IntRange(min=0), default=0, help="With --watch: stop after this many frames.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Seconds to wait for each worker.")
@click.option("--json", "as_json", is_flag=True, help="Print the workers' /status documents as a JSON list.")
@click.option("--color/--no-color", default=None, help="Colour (default: only on a terminal).")
def status(peers_file: Path | None, launch_dir: Path | None, http_offset: int, token: str | None, watch: bool,
           interval: float, count: int, timeout: float, as_json: bool, color: bool | None) -> None:
    """Show every worker's tree position, step, step time and link health.

    Exits 1 if some worker did not answer (without --watch)."""
    try:
        targets = targets_from(peers_file, launch_dir, http_offset)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        reports = _show(targets, timeout, token, watch, interval, count, as_json, color)
    except KeyboardInterrupt:
        return
    if not watch and any(not isinstance(rep, dict) for rep in reports):
        raise SystemExit(1)


def _show(targets: Sequence[str], timeout: float, token: str | None, watch: bool, interval: float, count: int,
          as_json: bool, color: bool | None) -> list[Report]:
    frames = 0
    while True:
        reports = asyncio.run(poll(targets, timeout, token))
        if as_json:
            click.echo(json.dumps([rep if isinstance(rep, dict) else {"rank": r, "error": rep}
                                   for r, rep in enumerate(reports)], indent=1))
        else:
            if watch and frames and sys.stdout.isatty():
                click.clear()
            elif frames:
                click.echo("")
            for line in render(reports):
                click.echo(line, color=color)
        frames += 1
        if not watch or (count and frames >= count):
            return reports
        time.sleep(interval)
