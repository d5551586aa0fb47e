"""What a worker proves itself with, and what it asks of its peers: the job's shared key, its
rank's TLS certificate, both, or neither.

A key is a file of at least 16 bytes (`fttree key --out FILE` writes 32 random ones); its
whitespace is ignored so that a hex or base64 line works too. Every member of a job must read
the same key. With TLS (`fttree certs`), every connection is encrypted and each side shows a
certificate of the job's CA that names its rank. Without either, a job may only use loopback
addresses, unless the user says `insecure=True`: any process that reaches a worker's port
could otherwise join, forge frames or take the model (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .address import Address
from .handshake import job_id

MIN_KEY_BYTES = 16
RANK_URI = "urn:fttree:rank:"  # a rank certificate's subject alternative name is RANK_URI + rank


def ca_file(folder: Path) -> Path:
    """The job CA's certificate in a folder made by `fttree certs`."""
    return folder / "ca.pem"


def rank_files(folder: Path, rank: int) -> tuple[Path, Path]:
    """(certificate, key) of `rank` in a folder made by `fttree certs`."""
    return folder / f"rank-{rank}.pem", folder / f"rank-{rank}.key"


def rank_of(peercert: Any) -> int | None:
    """The rank a verified peer certificate names (ssl's getpeercert() form), or None."""
    if not isinstance(peercert, dict):
        return None
    for kind, value in peercert.get("subjectAltName", ()) or ():
        if kind == "URI" and isinstance(value, str) and value.startswith(RANK_URI):
            tail = value[len(RANK_URI):]
            if tail.isdigit():
                return int(tail)
    return None


def tls_contexts(cert: Path, key: Path, ca: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts of mutual TLS 1.3: each side presents its rank's certificate
    and accepts only certificates of the job's CA. Host names are not checked: the rank is."""
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_cert_chain(str(cert), str(key))
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        client.check_hostname = False
        client.verify_mode = ssl.CERT_REQUIRED
        client.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS files (cert {cert}, key {key}, CA {ca}): {exc}") from None
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return server, client


def ca_fingerprint(ca: Path) -> str:
    """The job CA's SHA-256 fingerprint (hex): names the job in a HELLO when there is no key."""
    try:
        der = ssl.PEM_cert_to_DER_cert(ca.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"job CA {str(ca)!r}: {exc}") from None
    return hashlib.sha256(der).hexdigest()


@dataclass(frozen=True, slots=True)
class Tls:
    """This rank's side of mutual TLS: contexts to accept and to dial with, and the job CA's
    fingerprint (which names the job when there is no key)."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    ca_fingerprint: str

    @classmethod
    def from_dir(cls, folder: str | os.PathLike[str], rank: int) -> Tls:
        """This rank's files in a folder made by `fttree certs`."""
        root = Path(folder)
        cert, key = rank_files(root, rank)
        missing = [p.name for p in (ca_file(root), cert, key) if not p.is_file()]
        if missing:
            raise ConfigError(f"tls_dir {str(folder)!r} lacks {', '.join(missing)} for rank {rank} (make them with "
                              f"`fttree certs --out {folder} --add {rank}` where the job CA's key is)")
        return cls.from_files(cert, key, ca_file(root))

    @classmethod
    def from_files(cls, cert: str | os.PathLike[str], key: str | os.PathLike[str],
                   ca: str | os.PathLike[str]) -> Tls:
        server, client = tls_contexts(Path(cert), Path(key), Path(ca))
        return cls(server=server, client=client, ca_fingerprint=ca_fingerprint(Path(ca)))


@dataclass(frozen=True, slots=True)
class Credentials:
    """The job's shared key (b"": none) and TLS (None: plain TCP). `job` names the job in
    every handshake."""

    key: bytes = b""
    tls: Tls | None = None

    @property
    def job(self) -> str:
        if self.key:
            return job_id(self.key)
        return self.tls.ca_fingerprint[:16] if self.tls is not None else ""

    @property
    def secured(self) -> bool:
        return bool(self.key) or self.tls is not None

    def with_tls(self, tls: Tls | None) -> Credentials:
        return Credentials(key=self.key, tls=tls)

    @classmethod
    def from_key(cls, key: bytes, source: str = "a job key") -> Credentials:
        """A key's bytes, whitespace ignored; at least MIN_KEY_BYTES of them."""
        key = b"".join(key.split())
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"{source} holds {len(key)} bytes; a key needs at least {MIN_KEY_BYTES} "
                              f"(make one with `fttree key --out FILE`)")
        return cls(key=key)

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str] | None) -> Credentials:
        if path is None:
            return cls()
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"auth_key_file {str(path)!r}: {exc.strerror or exc}") from None
        return cls.from_key(raw, f"auth_key_file {str(path)!r}")


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
    addresses = list(addresses)
    hidden = [str(a) for a in addresses if not a.listed or a.behind]
    if hidden:
        raise ConfigError(
            f"ranks listed as {' and '.join(sorted(set(hidden))[:2])} dial from behind a NAT: their connections come "
            f"from the NAT's address, which proves nothing, so only a key tells them from anyone else. Give every "
            f"worker the same key (auth_key_file=, --auth-key-file, FTTREE_AUTH_KEY_FILE; `fttree key --out FILE` "
            f"makes one), or pass insecure=True (--insecure) on a network you trust")
    exposed = sorted({str(a) for a in addresses if not is_loopback(a)})
    if exposed:
        raise ConfigError(
            f"workers at {', '.join(exposed[:3])}{' ...' if len(exposed) > 3 else ''} are reachable beyond this "
            f"machine, and no credential was given: any process that reaches a port could join the job, forge "
            f"its sums or take its model. Give every worker the same key (auth_key_file=, --auth-key-file, "
            f"FTTREE_AUTH_KEY_FILE; `fttree key --out FILE` makes one), or pass insecure=True (--insecure) on a "
            f"network you trust")
