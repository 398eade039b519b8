"""A local certificate authority and a server certificate for ``hookbus auth init``.

By default ``hookbus auth init`` secures the client port with TLS: it makes a CA (ECDSA
P-256, self-signed, 10 years) and a server certificate signed by it (ECDSA P-256, 825 days,
``serverAuth``) for the listen host, any other names asked for (``--san``: the DNS names
clients use, e.g. a Kubernetes service's), ``127.0.0.1``, ``::1`` and ``localhost``, and
writes into the output folder:

- ``ca.pem``: the CA certificate, what clients verify the server with (every context's
  ``ca``, the CLI's ``--tls-ca``);
- ``server-cert.pem`` and ``server-key.pem`` (mode 0600): the server's, named in
  ``tls.conf``'s ``tls`` block (which ``server.conf`` includes).

The CA's private key is not kept: a certificate for another name means a new CA (run
``hookbus auth init`` into a new folder, or give your own files with ``--tls-cert``,
``--tls-key`` and ``--tls-ca``). Clients authenticate with their nkeys, not with
certificates (the server's ``verify`` is off).

Source: RFC 5280 (basicConstraints, keyUsage, extendedKeyUsage, subjectAltName), the
``cryptography`` library's X.509 tutorial.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509

__all__ = [
    "CA_FILE",
    "CERT_FILE",
    "KEY_FILE",
    "LocalTls",
    "check_san",
    "make_local_tls",
    "server_names",
]

CA_FILE = "ca.pem"
CERT_FILE = "server-cert.pem"
KEY_FILE = "server-key.pem"

CA_DAYS = 3650
SERVER_DAYS = 825
"""Validity of the server certificate, days (the longest some clients accept)."""

_WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")


@dataclass(frozen=True)
class LocalTls:
    """The files `make_local_tls` wrote (absolute paths)."""

    ca: Path
    cert: Path
    key: Path


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"(?:\*\.)?{_LABEL}(?:\.{_LABEL})*")


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    """Digital signatures, and with `signs_certificates` (a CA) certificate and CRL signing."""
    from cryptography import x509  # the tls extra, as every certificate here

    signs = signs_certificates
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=signs, crl_sign=signs,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip


def check_san(name: str) -> str:
    """`name` as a subjectAltName: an IP address or a DNS name (a leading ``*.`` allowed).

    Raises:
        ValueError: neither.
    """
    name = name.strip().strip("[]") if ":" in name else name.strip()
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(name))
    if len(name) > 253 or not _DNS_NAME.fullmatch(name):
        raise ValueError(f"not a DNS name or an IP address: {name!r}")
    return name


def server_names(host: str, extra: Iterable[str] = ()) -> list[str]:
    """The names the server certificate is for: `host` (unless a wildcard address), the
    `extra` names (`check_san`), ``127.0.0.1``, ``::1`` and ``localhost``, each once.

    Raises:
        ValueError: an `extra` name that is neither a DNS name nor an IP address.
    """
    names = [] if host.strip() in _WILDCARDS else [host.strip().strip("[]")]
    names += [check_san(name) for name in extra]
    return list(dict.fromkeys([*names, "127.0.0.1", "::1", "localhost"]))


def _san(names: Iterable[str]) -> list[x509.GeneralName]:
    from cryptography import x509

    out: list[x509.GeneralName] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _write(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with `mode` (refusing to overwrite one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_local_tls(
    out: Path, host: str, *, sans: Iterable[str] = (), now: datetime.datetime | None = None
) -> LocalTls:
    """Make a CA and a server certificate for `host` and the names `sans` (see
    `server_names`) and write ``ca.pem``, ``server-cert.pem`` and ``server-key.pem`` (0600)
    into `out`.

    Raises:
        FileExistsError: one of the files exists (never overwritten).
        ValueError: a name in `sans` is neither a DNS name nor an IP address.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    start = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hookbus"),
        x509.NameAttribute(NameOID.COMMON_NAME, "hookbus local CA"),
    ])  # fmt: skip
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    names = server_names(host, sans)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hookbus"),
                    x509.NameAttribute(NameOID.COMMON_NAME, names[0]),
                ]
            )
        )
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(_san(names)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    files = LocalTls(
        (out / CA_FILE).resolve(), (out / CERT_FILE).resolve(), (out / KEY_FILE).resolve()
    )
    for path in (files.ca, files.cert, files.key):
        if path.exists():
            raise FileExistsError(f"{path} exists: not overwriting it")
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(files.key, key_pem, 0o600)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files.ca, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files
