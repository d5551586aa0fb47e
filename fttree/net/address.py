"""Peer addresses: "host:port" per rank, as in a peers file (line i is rank i)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad peer address {text.strip()!r}: expected host:port")
    return Address(host.strip("[]"), int(port))


def parse_peers(lines: list[str]) -> list[Address]:
    """Peer addresses, line i for rank i; blank lines and '#' comments are skipped."""
    peers = [parse_address(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    if not peers:
        raise ConfigError("the peers list is empty")
    seen: dict[Address, int] = {}
    for rank, addr in enumerate(peers):
        if addr in seen:
            raise ConfigError(f"ranks {seen[addr]} and {rank} share the address {addr}: each rank needs its own")
        seen[addr] = rank
    return peers


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
