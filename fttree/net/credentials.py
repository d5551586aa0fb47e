"""What a worker proves itself with, and what it asks of its peers: the job's shared key, or none.

A key is a file of at least 16 bytes (`fttree key --out FILE` writes 32 random ones); its
whitespace is ignored so that a hex or base64 line works too. Every member of a job must read
the same key. Without one a job may only use loopback addresses, unless the user says
`insecure=True`: any process that reaches a worker's port could otherwise join, forge frames
or take the model (README, "Security").
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .address import Address
from .handshake import job_id

MIN_KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Credentials:
    """The job's shared key (b"": none). `job` names the job in every handshake."""

    key: bytes = b""

    @property
    def job(self) -> str:
        return job_id(self.key)

    @property
    def secured(self) -> bool:
        return bool(self.key)

    @classmethod
    def from_key(cls, key: bytes) -> Credentials:
        key = b"".join(key.split())
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"a job key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        return cls(key=key)

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str] | None) -> Credentials:
        if path is None:
            return cls()
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"auth_key_file {str(path)!r}: {exc.strerror or exc}") from None
        key = b"".join(raw.split())
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"auth_key_file {str(path)!r} holds {len(key)} bytes; a key needs at least "
                              f"{MIN_KEY_BYTES} (make one with `fttree key --out FILE`)")
        return cls(key=key)


def http_token(key: bytes) -> str | None:
    """The admin token a job key implies (None without a key): whoever holds the key may drive
    the workers' /faults, and nobody else."""
    return hmac.new(key, b"fttree http token", hashlib.sha256).hexdigest() if key else None


def new_key() -> bytes:
    """A fresh key, as the text a key file holds (64 hex digits)."""
    return secrets.token_hex(32).encode()


def write_key(path: str | Path) -> Path:
    """Write a fresh key to `path`, readable by its owner only."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch(mode=0o600, exist_ok=True)
    out.chmod(0o600)
    out.write_bytes(new_key() + b"\n")
    return out


def is_loopback(address: Address) -> bool:
    """An address only this machine can reach (127.0.0.0/8, ::1, "localhost")."""
    if address.host == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(credentials: Credentials, addresses: Iterable[Address], insecure: bool) -> None:
    """Refuse a job without a credential on addresses others can reach, naming the options."""
    if credentials.secured or insecure:
        return
    exposed = sorted({str(a) for a in addresses if not is_loopback(a)})
    if exposed:
        raise ConfigError(
            f"workers at {', '.join(exposed[:3])}{' ...' if len(exposed) > 3 else ''} are reachable beyond this "
            f"machine, and no credential was given: any process that reaches a port could join the job, forge "
            f"its sums or take its model. Give every worker the same key (auth_key_file=, --auth-key-file, "
            f"FTTREE_AUTH_KEY_FILE; `fttree key --out FILE` makes one), or pass insecure=True (--insecure) on a "
            f"network you trust")
