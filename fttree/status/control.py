"""The worker's HTTP control plane: aiohttp on the node's own event loop.

    GET    /status   JSON snapshot: tree neighbours, link states, step, counts, recent recoveries
    GET    /metrics  Prometheus text format
    GET    /healthz  liveness: 200 while the event loop answers
    GET    /faults   the in-process fault schedule now in force
    POST   /faults   add rules in the --faults language (text body, or JSON {"faults": "..."})
    DELETE /faults   clear every in-process fault on this worker

Handlers run on the node's loop between protocol events, so they read one consistent snapshot
and swap the transport's FaultSchedule without locks. /status, /metrics and /healthz are read
without a token (Prometheus convention). The admin routes (/faults) refuse any request that a
browser made (it carries an `Origin`: a web page open on this machine can reach 127.0.0.x),
need the token when one is set (with a job key, one derived from the key unless --http-token
gives one), and are off on a non-loopback bind without a token. A fault the worker cannot
carry out in-process (crash, hang: they happen to its process) is refused, never acknowledged.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..core.faults import NODE_KINDS, FaultRule, FaultSchedule, parse
from ..errors import ConfigError, PeerError
from . import metrics
from .monitor import Monitor

if TYPE_CHECKING:
    from ..net.faulty import FaultyTransport
    from ..net.node import Node

log = logging.getLogger("fttree.status.control")

MAX_BODY_BYTES = 64 * 1024


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_http_host(data_host: str) -> str:
    """The worker's own address when it is a loopback one (127.0.0.x launches), else 127.0.0.1."""
    return data_host if is_loopback(data_host) else "127.0.0.1"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class ControlServer:
    """Serves one node. `start()` and `close()` run on the node's loop."""

    def __init__(self, node: Node, monitor: Monitor, faults: FaultyTransport, *, world: int, host: str, port: int,
                 token: str | None = None) -> None:
        self.node, self.monitor, self.faults = node, monitor, faults
        self.world = world
        self.host, self.port = host, port
        self.token = token or None
        self.admin_open = self.token is not None or is_loopback(host)
        self._runner: web.AppRunner | None = None
        self.address: str | None = None  # host:port actually bound

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/faults", self._faults_get)
        app.router.add_post("/faults", self._faults_post)
        app.router.add_delete("/faults", self._faults_delete)
        return app

    async def start(self) -> str:
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise PeerError(f"rank {self.node.rank} cannot serve HTTP on {self.host}:{self.port}: "
                            f"{exc.strerror or exc} (pick another --http-port, or --no-http)") from None
        self._runner = runner
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        port = sockets[0].getsockname()[1] if sockets else self.port
        self.address = f"{self.host}:{port}"
        log.info("rank %d: control server on http://%s (admin %s)", self.node.rank, self.address,
                 "with token" if self.token else "loopback only" if self.admin_open else "disabled: no token")
        return self.address

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- read endpoints ------------------------------------------------------------------

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.monitor.snapshot().to_dict())

    async def _metrics(self, request: web.Request) -> web.Response:
        body = metrics.render(self.monitor.snapshot())
        return web.Response(body=body.encode(), headers={"Content-Type": metrics.CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "rank": self.node.rank, "step": self.monitor.current_step()})

    async def _faults_get(self, request: web.Request) -> web.Response:
        refused = self._from_a_web_page(request)  # readable without the token, as /status is
        if refused is not None:
            return refused
        return web.json_response(self._faults_doc())

    # ---- admin endpoints -----------------------------------------------------------------

    def _from_a_web_page(self, request: web.Request) -> web.Response | None:
        """403 for a request a browser made (it names its page's Origin): any page open on this
        machine can send a simple POST to 127.0.0.x. None otherwise."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        log.warning("rank %d: refused %s %s from a web page (Origin: %s)", self.node.rank, request.method,
                    request.path, origin[:100])
        return _error(403, f"admin requests from a web page are refused (Origin: {origin[:100]}); use curl or "
                           f"the fttree CLI")

    def _refusal(self, request: web.Request) -> web.Response | None:
        """401/403 when this request may not use an admin route, else None."""
        from_page = self._from_a_web_page(request)
        if from_page is not None:
            return from_page
        if not self.admin_open:
            return _error(403, f"admin endpoints are off: rank {self.node.rank} listens on {self.host}, "
                               f"which is not loopback, and no token was set (--http-token)")
        if self.token is None:
            return None
        header = request.headers.get("Authorization", "")
        given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            return web.json_response({"error": "missing or wrong token: send 'Authorization: Bearer <token>'"},
                                     status=401, headers={"WWW-Authenticate": 'Bearer realm="fttree"'})
        return None

    async def _read_rules(self, request: web.Request) -> list[FaultRule] | web.Response:
        try:
            raw = await request.text()
        except (web.HTTPRequestEntityTooLarge, UnicodeDecodeError) as exc:
            return _error(400, f"unreadable body: {exc}")
        text: Any = raw
        if request.content_type == "application/json":
            try:
                doc = json.loads(raw)
            except ValueError as exc:
                return _error(400, f"body is not valid JSON: {exc}")
            text = doc.get("faults") if isinstance(doc, dict) else None
            if not isinstance(text, str):
                return _error(400, 'JSON body must be an object with a "faults" string, e.g. {"faults": "cut 1-0"}')
        try:
            rules = parse(text)
            FaultSchedule(rules, world=self.world)  # ranks inside the world
        except ConfigError as exc:
            return _error(400, str(exc))
        if not rules:
            return _error(400, 'empty fault schedule: send rules like "cut 1-0; delay 2-0 50ms"')
        node_faults = [str(r) for r in rules if r.kind in NODE_KINDS]
        if node_faults:
            return _error(400, f"{'; '.join(node_faults)}: crash and hang happen to a worker's process (SIGKILL, "
                               f"SIGSTOP), which /faults cannot do; use fttree launch --faults, or signal the process")
        return rules

    async def _faults_post(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        rules = await self._read_rules(request)
        if isinstance(rules, web.Response):
            return rules
        me = self.node.rank
        applied = [r for r in rules if me in r.ranks()]
        ignored = [r for r in rules if me not in r.ranks()]
        self.faults.schedule = FaultSchedule([*self.faults.schedule.rules, *applied], world=self.world, seed=me)
        log.warning("rank %d: fault injection from %s: %s", me, request.remote, "; ".join(map(str, applied)) or "-")
        doc = self._faults_doc()
        doc["applied"] = [str(r) for r in applied]
        doc["ignored"] = [f"{r}: does not touch rank {me}'s links" for r in ignored]
        return web.json_response(doc)

    async def _faults_delete(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        cleared = [str(r) for r in self.faults.schedule.rules]
        self.faults.schedule = FaultSchedule(seed=self.node.rank)
        log.warning("rank %d: faults cleared from %s: %s", self.node.rank, request.remote, "; ".join(cleared) or "-")
        doc = self._faults_doc()
        doc["cleared"] = cleared
        return web.json_response(doc)

    def _faults_doc(self) -> dict[str, Any]:
        faults = self.faults.schedule
        return {"rank": self.node.rank, "step": self.monitor.current_step(), "faults": str(faults),
                "rules": [str(r) for r in faults.rules]}
