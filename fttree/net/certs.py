"""A job's certificates for mutual TLS: one CA per job, one certificate and key per rank.

The rank travels in the certificate as a URI subject alternative name, `urn:fttree:rank:N`
(and in the common name, `fttree rank N`, for people reading it); a worker takes a peer's
rank from there, never from its address. The CA's key signs new ranks later (a joiner):
`fttree certs --out DIR --add 8` reuses DIR's CA. Written with the `cryptography` package.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..errors import ConfigError
from .credentials import RANK_URI, ca_file, rank_files

VALID_DAYS = 365


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _new_ca(out: Path, job: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fttree job CA {job}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    ca_file(out).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out / "ca.key", _key_pem(key))
    return cert, key


def _load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate(ca_file(out).read_bytes())
        key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the job CA in {out} (ca.pem, ca.key): {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{out / 'ca.key'} is not an EC key made by fttree certs")
    return cert, key


def _rank_cert(out: Path, rank: int, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fttree rank {rank}")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{RANK_URI}{rank}")]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = rank_files(out, rank)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_path, _key_pem(key))


def make(out: Path, ranks: range | list[int], *, add: bool = False) -> list[Path]:
    """A job CA in `out` (or, with `add`, the one already there) and a certificate and key for
    each of `ranks`. Returns the certificate paths."""
    if add:
        ca, ca_key = _load_ca(out)
    else:
        out.mkdir(parents=True, exist_ok=True)
        if ca_file(out).exists():
            raise ConfigError(f"{ca_file(out)} exists: a job CA is there already (use --add to sign more ranks "
                              f"with it, or another --out)")
        ca, ca_key = _new_ca(out, out.name)
    for rank in ranks:
        _rank_cert(out, rank, ca, ca_key)
    return [rank_files(out, r)[0] for r in ranks]
