"""Peer addresses: "host:port" per rank, as in a peers file (line i is rank i).

A rank that others cannot dial (behind a NAT or a firewall that lets it dial out only) is
listed as `-`: it listens nowhere, dials every rank it can, and they send to it on the
connections it opened (tcp.py). A rank that only the ranks of its own site can dial (behind
the same NAT) is listed as `host:port behind SITE`: its site-mates dial it at host:port (an
address of the site's own network), everyone else as for `-`. Two ranks neither of which can
dial the other (two `-`, or two sites) exchange frames through a rank both reach (relay.py).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

UNLISTED = "-"  # the peers-file entry of a rank nobody can dial
BEHIND = " behind "  # "host:port behind SITE": dialled only by the ranks behind SITE


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int
    behind: str = ""  # the site (NAT) only whose ranks can dial this address; "" for everyone

    def __str__(self) -> str:
        if not self.listed:
            return UNLISTED
        return f"{self.host}:{self.port}" + (f"{BEHIND}{self.behind}" if self.behind else "")

    @property
    def listed(self) -> bool:
        """Does this rank listen anywhere (False for `-`)?"""
        return self.host != UNLISTED

    def dialable_from(self, other: Address) -> bool:
        """Can the rank at `other` dial this address? Everyone can dial a public address, the
        ranks behind the same site a site-local one, nobody a `-`."""
        return self.listed and (not self.behind or other.behind == self.behind)


NOWHERE = Address(UNLISTED, 0)  # a rank that cannot be dialled at all


def parse_address(text: str) -> Address:
    text = text.strip()
    if text == UNLISTED:
        return NOWHERE
    words = text.split()
    site = ""
    if len(words) == 3 and words[1] == BEHIND.strip():
        text, site = words[0], words[2]
        if not all(c.isalnum() or c in "_.-" for c in site):
            raise ConfigError(f"bad site {site!r} in peer address {' '.join(words)!r}: a site is a name of letters, "
                              f"digits, '_', '.', '-'")
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad peer address {text.strip()!r}: expected host:port, host:port behind SITE, or - "
                          f"(a rank nobody can dial)")
    return Address(host.strip("[]"), int(port), site)


def parse_peers(lines: list[str]) -> list[Address]:
    """Peer addresses, line i for rank i; blank lines and '#' comments are skipped."""
    peers = [parse_address(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    if not peers:
        raise ConfigError("the peers list is empty")
    seen: dict[Address, int] = {}
    for rank, addr in enumerate(peers):
        if not addr.listed:  # (the same site address behind two sites is two machines)
            continue
        if addr in seen:
            raise ConfigError(f"ranks {seen[addr]} and {rank} share the address {addr}: each rank needs its own")
        seen[addr] = rank
    return peers


def reach_classes(addresses: Mapping[int, Address]) -> dict[int, str]:
    """Each rank's reachability class for the trees (core/reach.py): "" for a public address,
    its site for one behind a site, "-" for a rank nobody can dial."""
    return {r: (UNLISTED if not a.listed else a.behind) for r, a in addresses.items() if r >= 0}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ---- local jobs: rank r on 127.0.0.(r+1), one port for all -------------------------------


def local_peers(n: int, host_base: str = "127.0.0.1", port: int = 29500) -> list[str]:
    """Rank r at host_base + r (127.0.0.1, 127.0.0.2, ...), all on the same port."""
    parts = host_base.split(".")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--host-base must be an IPv4 address like 127.0.0.1, got {host_base!r}")
    last = int(parts[3])
    if last + n - 1 > 254:
        raise ConfigError(f"{n} workers from {host_base} run past .254: pick a lower --host-base")
    return [".".join([*parts[:3], str(last + r)]) + f":{port}" for r in range(n)]


def free_port(hosts: Sequence[str] = ("127.0.0.1",), also: Sequence[int] = ()) -> int:
    """A port free on every one of `hosts` right now, and with it port + each of `also` (a
    worker's control server listens at its port + 1000: the kernel hands out ports from the
    ephemeral range, where that twin can be any connection's). Local workers listen on
    127.0.0.(r+1) with one port, so a port free only on the first address is not enough: an
    earlier run's rank 2, say, may still hold it on 127.0.0.3 (a connection it bound there)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        if any(port + offset > 65535 for offset in also):
            continue
        try:
            for host in hosts:
                for offset in also:
                    with socket.socket() as s:
                        s.bind((host, port + offset))
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise ConfigError(f"no TCP port free on all of {hosts[0]}..{hosts[-1]}")


def local_hosts(n: int, host_base: str = "127.0.0.1") -> list[str]:
    """The addresses of `local_peers(n, host_base)`, without ports."""
    return [peer.rsplit(":", 1)[0] for peer in local_peers(n, host_base)]
