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

The port serves at most MAX_CONNECTIONS connections at once, each its own file descriptor in the
worker's process (issue 41: 2,000 slow connections ran a worker at 1,024 open files out of
descriptors, and its data port with it). A connection must finish a request's headers within
IDLE_TIMEOUT_S of connecting or of its last response, a request's body within the same time,
and a reader that leaves a response unread for WRITE_STALL_S is cut. A connection beyond the
cap closes the one that has waited longest for its next request (a slowloris's, as a rule), or
is itself closed with a 503 when every slot is serving a request; /status counts both (`http`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web

from ..core.faults import NODE_KINDS, FaultRule, FaultSchedule, parse
from ..errors import ConfigError, PeerError
from . import metrics
from .listener import address_of, is_loopback
from .monitor import Monitor

if TYPE_CHECKING:
    from ..net.faulty import FaultyTransport
    from ..net.node import Node

log = logging.getLogger("fttree.status.control")

MAX_BODY_BYTES = 64 * 1024
MAX_CONNECTIONS = 64  # open status connections at once: readers are a scraper, `fttree status` and a person
IDLE_TIMEOUT_S = 5.0  # from connecting, or from a response, until the next request's headers are in
BODY_TIMEOUT_S = 5.0  # for a request's body (POST /faults), once its headers are in
WRITE_STALL_S = 5.0  # a response the reader leaves unread (its send buffer full) this long: cut
LINGER_S = 1.0  # after an answer, how long a body still coming is read and dropped before the close
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 36\r\n\r\ntoo many status connections; retry\n")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class _Connection(web.RequestHandler):
    """aiohttp's handler for one connection, let in (or not) by the port's _Gate, with the
    deadlines aiohttp lacks: a connection that sends no request, or part of one, is closed
    IDLE_TIMEOUT_S after it connected or was last answered (aiohttp's own keepalive timer is an
    hour by default, and older releases start it only after a first response), and one whose
    reader leaves a response unread is cut."""

    def __init__(self, gate: _Gate, manager: web.Server, loop: asyncio.AbstractEventLoop) -> None:
        # access_log as web.Server passes it from AppRunner(access_log=None); a body left unread
        # after the answer (a 408, a 401) is read and dropped for LINGER_S, not aiohttp's 10 s
        options: dict[str, Any] = {"access_log": None, "lingering_time": LINGER_S}
        super().__init__(manager, loop=loop, **options)
        self.gate, self.loop = gate, loop
        self.admitted = False
        self.headers_in = False  # the blank line that ends a request's headers came (since the last answer)
        self.in_request = False  # a handler is serving a request of this connection
        self._tail = b""
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.gate.admit(self):
            refused = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
            refused.write(BUSY)
            refused.close()
            return
        self.admitted = True
        self._arm()
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if not self.headers_in:  # a slowloris never sends it; aiohttp hands a request on a loop turn or two later
            self.headers_in = b"\r\n\r\n" in data or b"\r\n\r\n" in self._tail + data[:3]
            self._tail = (self._tail + data)[-3:]
        super().data_received(data)

    @property
    def waiting(self) -> bool:
        """Open, and no request of it whole or being served: the kind to close to make room."""
        return not self.headers_in and not self.in_request

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.admitted:
            return
        self.gate.release(self)
        for timer in (self._deadline, self._stall):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stall = self.loop.call_later(WRITE_STALL_S, self.shut)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().resume_writing()

    def request_began(self) -> None:
        self.in_request = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def request_ended(self) -> None:
        self.in_request = self.headers_in = False
        self._tail = b""
        self.gate.touch(self)
        self._arm()

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(IDLE_TIMEOUT_S, self._idle)

    def _idle(self) -> None:
        self._deadline = None
        if not self.in_request:
            self.shut()

    def shut(self) -> None:
        """Close now: at once when a response sits unread (a plain close waits to flush it)."""
        if self.writing_paused and self.transport is not None:
            self.transport.abort()
        else:
            self.force_close()


class _Gate:
    """The port's open connections, oldest-waiting first; at most `cap` of them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.rank = -1  # the node's, once the server starts
        self.open: dict[_Connection, None] = {}  # in order of the last time each was connected or answered
        self.shed = 0  # connections closed because the port was full (the waiting one, or the new one)
        self._full_since_shed: int | None = None  # `shed` when this spell of a full port began

    def admit(self, conn: _Connection) -> bool:
        """Make room for `conn` and let it in (closing the connection that has waited longest for
        its next request), or refuse it (False) when every open one is serving a request."""
        if len(self.open) >= self.cap:
            if self._full_since_shed is None:
                self._full_since_shed = self.shed
                log.warning("rank %d: %d status connections open, the most it serves: closing the one "
                            "waiting longest for a request as each new one comes (counted in /status)",
                            self.rank, self.cap)
            self.shed += 1
            waiting = next((c for c in self.open if c.waiting), None)
            if waiting is None:
                return False
            del self.open[waiting]
            waiting.shut()
        self.open[conn] = None
        return True

    def touch(self, conn: _Connection) -> None:
        if conn in self.open:  # answered: it now waits for its next request, the most recent to
            del self.open[conn]
            self.open[conn] = None

    def release(self, conn: _Connection) -> None:
        self.open.pop(conn, None)
        if self._full_since_shed is not None and len(self.open) <= self.cap // 2:
            log.info("rank %d: status port below its cap again; %d connections closed while it was full",
                     self.rank, self.shed - self._full_since_shed)
            self._full_since_shed = None


class _CappedSite(web.BaseSite):
    """web.TCPSite with _Gate in front of the app's handlers."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, gate: _Gate,
                 sock: socket.socket | None = None) -> None:
        super().__init__(runner)
        self.host, self.port, self.gate, self.sock = host, port, gate, sock

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        if self.sock is not None:  # bound by the worker's start (listener.py)
            self._server = await loop.create_server(lambda: _Connection(self.gate, server, loop), sock=self.sock)
        else:
            self._server = await loop.create_server(lambda: _Connection(self.gate, server, loop), self.host,
                                                    self.port, reuse_address=True)


@web.middleware
async def _mark_requests(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Tell the connection a request is being served: no idle deadline, not one to close for room."""
    conn = request.protocol
    if not isinstance(conn, _Connection):
        return await handler(request)
    conn.request_began()
    try:
        return await handler(request)
    finally:
        conn.request_ended()


class ControlServer:
    """Serves one node. `start()` and `close()` run on the node's loop."""

    def __init__(self, node: Node, monitor: Monitor, faults: FaultyTransport, *, world: int, host: str, port: int,
                 token: str | None = None, sock: socket.socket | None = None) -> None:
        self.node, self.monitor, self.faults = node, monitor, faults
        self.world = world
        self.host, self.port = host, port
        self.token = token or None
        self.sock = sock  # already bound and listening (the worker's start), else bound here
        self.admin_open = self.token is not None or is_loopback(host)
        self._runner: web.AppRunner | None = None
        self.address: str | None = None  # host:port actually bound
        self._gate = _Gate(MAX_CONNECTIONS)

    @property
    def connections(self) -> int:
        """Status connections open now."""
        return len(self._gate.open)

    @property
    def shed(self) -> int:
        """Connections closed because the port was full."""
        return self._gate.shed

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_mark_requests])
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/faults", self._faults_get)
        app.router.add_post("/faults", self._faults_post)
        app.router.add_delete("/faults", self._faults_delete)
        return app

    async def start(self) -> str:
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        self._gate.rank = self.node.rank
        site = _CappedSite(runner, self.host, self.port, self._gate, self.sock)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise PeerError(f"rank {self.node.rank} cannot serve HTTP on {self.host}:{self.port}: "
                            f"{exc.strerror or exc} (pick another --http-port, or --no-http)") from None
        self._runner = runner
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.address = address_of(sockets[0]) if sockets else f"{self.host}:{self.port}"
        log.info("rank %d: control server on http://%s (admin %s)", self.node.rank, self.address,
                 "with token" if self.token else "loopback only" if self.admin_open else "disabled: no token")
        return self.address

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- read endpoints ------------------------------------------------------------------

    async def _status(self, request: web.Request) -> web.Response:
        doc = self.monitor.snapshot().to_dict()
        doc["http"] = {"connections": self.connections, "max_connections": MAX_CONNECTIONS, "shed": self.shed}
        return web.json_response(doc)

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
            async with asyncio.timeout(BODY_TIMEOUT_S):
                raw = await request.text()
        except TimeoutError:
            return _error(408, f"the body did not arrive within {BODY_TIMEOUT_S:g} s")
        except (ConnectionError, RuntimeError) as exc:  # closed mid-body (aiohttp: "Connection closed.")
            return _error(400, f"the connection closed before the body was whole: {exc}")
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
