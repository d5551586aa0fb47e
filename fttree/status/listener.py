"""The control server's listening socket, bound without aiohttp.

A worker binds its status port when it starts, so a port in use is an error from `start()` that
names it, and the address is known at once; aiohttp, which takes a second to import on a loaded
machine, then serves that socket from the background, and a restarted worker's join does not
wait for it (connections made meanwhile wait in the socket's backlog)."""

from __future__ import annotations

import ipaddress
import socket

from ..errors import PeerError


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


def bind(rank: int, host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one), or PeerError naming the port."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=128, reuse_port=False)
    except OSError as exc:
        raise PeerError(f"rank {rank} cannot serve HTTP on {host}:{port}: {exc.strerror or exc} "
                        f"(pick another --http-port, or --no-http)") from None


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"
