"""NATS decentralized JWTs (operator, account, user), signed with `nkeys`: what ``nsc``
writes, for ``hookbus auth init --jwt`` and ``hookbus auth issue`` (data and signing only;
the files are `hookbus.cli._auth_files`).

A JWT is ``base64url(header).base64url(claims).base64url(signature)`` (no padding), the
header ``{"typ":"JWT","alg":"ed25519-nkey"}``, the signature the signer's ed25519 signature
of ``header.claims`` (the first two parts as written). The claims are the standard ones
(``jti``, ``iat``, ``iss``: the signer's public key, ``sub``: the subject's public key,
``name``) and ``nats`` (``type``: ``operator``, ``account`` or ``user``; ``version``: 2).
``jti`` is the base32 (no padding) SHA-512/256 of the JSON of the standard claims without
it, as the NATS JWT library computes it. Limits use ``-1`` for "no limit".

A user's permissions are its role's `RolePermissions` (`hookbus.cli._permissions`),
mapped by `user_permissions`: ``pub`` / ``sub`` allow lists, ``resp`` for
``allow_responses`` (``ttl`` in nanoseconds).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import nacl.exceptions
import nacl.signing
import nkeys  # type: ignore[import-untyped]

from hookbus._core.base64url import b64url, unb64url
from hookbus.cli._permissions import RolePermissions

__all__ = [
    "NO_LIMIT",
    "JetStreamLimits",
    "JwtError",
    "KeyPair",
    "account_jwt",
    "creds_text",
    "decode",
    "new_key",
    "operator_jwt",
    "parse_creds",
    "user_jwt",
    "user_permissions",
]

NO_LIMIT: Final = -1
_HEADER: Final = {"typ": "JWT", "alg": "ed25519-nkey"}
_VERSION: Final = 2
_PREFIXES: Final = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}


class JwtError(ValueError):
    """A JWT, seed or creds file that is not what it should be."""


@dataclass(frozen=True)
class KeyPair:
    """An nkey: its seed (``SO...``, ``SA...``, ``SU...``; secret) and public key
    (``O...``, ``A...``, ``U...``)."""

    seed: str
    public_key: str

    @classmethod
    def from_seed(cls, seed: str) -> KeyPair:
        """The key pair of `seed`.

        Raises:
            JwtError: not an nkey seed.
        """
        try:
            kp = nkeys.from_seed(bytearray(seed.strip().encode()))
        except (nkeys.NkeysError, ValueError, TypeError) as exc:
            raise JwtError(f"not an nkey seed: {exc}") from None
        try:
            return cls(seed.strip(), bytes(kp.public_key).decode())
        finally:
            kp.wipe()

    def sign(self, data: bytes) -> bytes:
        """The ed25519 signature (64 bytes) of `data`."""
        kp = nkeys.from_seed(bytearray(self.seed.encode()))
        try:
            return bytes(kp.sign(data))
        finally:
            kp.wipe()


def new_key(kind: str) -> KeyPair:
    """A fresh nkey of `kind` (``operator``, ``account`` or ``user``) from 32 random bytes.

    Raises:
        KeyError: another kind.
    """
    seed = nkeys.encode_seed(secrets.token_bytes(32), _PREFIXES[kind])
    return KeyPair.from_seed(bytes(seed).decode())


@dataclass(frozen=True)
class JetStreamLimits:
    """An account's JetStream limits: bytes in memory and on disk over all its streams,
    streams, consumers (`NO_LIMIT`: none). Memory and disk both 0 would disable JetStream
    for the account (hookbus's buckets need it)."""

    mem_storage: int
    disk_storage: int
    streams: int
    consumer: int


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _go_json(value: Any) -> bytes:
    """JSON as Go's encoding/json writes it (UTF-8, ``<``, ``>``, ``&``, U+2028 and U+2029
    escaped), for a `jti` other NATS tools compute alike."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):  # fmt: skip
        text = text.replace(char, escaped)
    return text.encode()


def _jti(standard: Mapping[str, Any]) -> str:
    digest = hashlib.new("sha512_256", _go_json(dict(standard))).digest()
    return base64.b32encode(digest).decode().rstrip("=")


def _encode(
    signer: KeyPair, subject: str, name: str, nats: dict[str, Any], *, expires_at: int | None = None
) -> str:
    # the order of the NATS JWT library's claims data (its jti hashes these fields)
    standard: dict[str, Any] = {} if expires_at is None else {"exp": expires_at}
    standard.update(iat=int(time.time()), iss=signer.public_key)
    if name:
        standard["name"] = name
    standard["sub"] = subject
    claims = {"jti": _jti(standard), **standard, "nats": nats}
    signed = f"{b64url(_json(_HEADER))}.{b64url(_json(claims))}"
    return f"{signed}.{b64url(signer.sign(signed.encode()))}"


def decode(token: str) -> dict[str, Any]:
    """The claims of `token` once its signature is checked against its issuer (``iss``).

    Raises:
        JwtError: not three parts, not JSON, another algorithm, or a bad signature.
    """
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise JwtError("a JWT has three parts separated by '.'")
    try:
        header, claims = (json.loads(unb64url(p)) for p in parts[:2])
        sig = unb64url(parts[2])
    except (ValueError, TypeError) as exc:
        raise JwtError(f"not a JWT: {exc}") from None
    if not isinstance(header, dict) or header.get("alg") != _HEADER["alg"]:
        raise JwtError(f"not an nkey-signed JWT (header {header!r})")
    if not isinstance(claims, dict) or not isinstance(claims.get("iss"), str):
        raise JwtError("a JWT without an issuer")
    try:
        _verify_key(claims["iss"]).verify(f"{parts[0]}.{parts[1]}".encode(), sig)
    except (nacl.exceptions.BadSignatureError, ValueError) as exc:
        raise JwtError(f"bad JWT signature for issuer {claims['iss']}: {exc}") from None
    return claims


def _verify_key(public_key: str) -> nacl.signing.VerifyKey:
    """The ed25519 key of an nkey public key (base32: prefix byte, 32 bytes, CRC-16)."""
    raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    if len(raw) != 35 or nkeys.crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise ValueError(f"{public_key!r} is not an nkey public key")
    return nacl.signing.VerifyKey(raw[1:-2])


def operator_jwt(operator: KeyPair, name: str, *, system_account: str) -> str:
    """The operator's self-signed JWT, naming its system account (public key ``A...``)."""
    return _encode(
        operator,
        operator.public_key,
        name,
        {"system_account": system_account, "type": "operator", "version": _VERSION},
    )


def account_jwt(
    operator: KeyPair,
    account: str,
    name: str,
    *,
    jetstream: JetStreamLimits | None,
    signing_keys: Sequence[str] = (),
    revocations: Mapping[str, int] | None = None,
) -> str:
    """An account's JWT (public key `account`), signed by the operator: no connection,
    subscription or payload limit of its own (the server's apply), no import or export,
    `jetstream` (None: JetStream off, e.g. the system account), the public keys of the
    account's signing keys (which may then sign its users) and `revocations`: user public
    key -> Unix time (seconds); the server refuses that user's JWTs issued at or before it."""
    limits: dict[str, Any] = {
        "subs": NO_LIMIT,
        "data": NO_LIMIT,
        "payload": NO_LIMIT,
        "imports": NO_LIMIT,
        "exports": NO_LIMIT,
        "wildcards": True,
        "conn": NO_LIMIT,
        "leaf": NO_LIMIT,
    }
    if jetstream is not None:
        limits.update(
            mem_storage=jetstream.mem_storage,
            disk_storage=jetstream.disk_storage,
            streams=jetstream.streams,
            consumer=jetstream.consumer,
        )
    nats: dict[str, Any] = {"limits": limits}
    if signing_keys:
        nats["signing_keys"] = list(signing_keys)
    if revocations:
        nats["revocations"] = dict(revocations)
    nats.update(type="account", version=_VERSION)
    return _encode(operator, account, name, nats)


def _allow(subjects: Sequence[str]) -> dict[str, list[str]]:
    # an empty permission is no restriction at all in a user JWT: deny everything instead
    return {"allow": list(subjects)} if subjects else {"deny": [">"]}


def user_permissions(perms: RolePermissions) -> dict[str, Any]:
    """`perms` as a user JWT's permission claims: ``pub`` / ``sub`` allow lists (``"subject
    queue"`` entries kept: queue-only subscriptions), ``resp`` (``max`` answers per request,
    ``ttl`` nanoseconds) when the role answers requests. An empty list becomes ``deny: [">"]``
    (an empty one would allow everything)."""
    out: dict[str, Any] = {"pub": _allow(perms.publish), "sub": _allow(perms.subscribe)}
    r = perms.allow_responses
    if r is not None:
        out["resp"] = {"max": r.max_msgs, "ttl": int(r.expires_s * 1_000_000_000)}
    return out


def user_jwt(
    signer: KeyPair,
    user: str,
    name: str,
    perms: RolePermissions | None,
    *,
    issuer_account: str,
    expires_at: int | None = None,
    connection_types: Sequence[str] = (),
) -> str:
    """A user's JWT (public key `user`) with `perms`, signed by `signer`: the account's key
    or one of its signing keys (then `issuer_account`, the account's public key, is in the
    claims). No subscription, data or payload limit of its own (``-1``; the server's
    ``max_payload`` applies). `expires_at`: Unix seconds (claim ``exp``) from which
    nats-server refuses the credential and closes the connections made with it; None:
    it never expires. `perms` None: no publish or subscribe limit at all (only with
    `connection_types` that keep clients out, e.g. ``("LEAFNODE",)``). `connection_types`:
    the only kinds of connection the server accepts it for (claim
    ``allowed_connection_types``: ``STANDARD``, ``WEBSOCKET``, ``LEAFNODE``, ...); empty:
    any.

    Raises:
        JwtError: `user` is not a user public key, `expires_at` is not after its issue, or
            neither `perms` nor `connection_types` limits it.
    """
    if not user.startswith("U"):
        raise JwtError(f"{user!r} is not a user public key (U...)")
    if expires_at is not None and expires_at <= time.time():
        raise JwtError(f"the credential would expire before it is issued ({expires_at})")
    if perms is None and not connection_types:
        raise JwtError("a user without permissions must be limited to some connection types")
    nats: dict[str, Any] = {
        **(user_permissions(perms) if perms is not None else {}),
        "subs": NO_LIMIT,
        "data": NO_LIMIT,
        "payload": NO_LIMIT,
    }
    if connection_types:
        nats["allowed_connection_types"] = list(connection_types)
    if signer.public_key != issuer_account:
        nats["issuer_account"] = issuer_account
    nats.update(type="user", version=_VERSION)
    return _encode(signer, user, name, nats, expires_at=expires_at)


def creds_text(jwt: str, seed: str) -> str:
    """A NATS credentials file: the user JWT and its nkey seed (as ``nsc`` writes it)."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def parse_creds(text: str) -> tuple[str, str]:
    """``(user JWT, seed)`` of a credentials file's text.

    Raises:
        JwtError: no JWT or seed block.
    """
    found: list[str] = []
    for marker in ("BEGIN NATS USER JWT", "BEGIN USER NKEY SEED"):
        _, sep, rest = text.partition(marker)
        lines = [ln.strip() for ln in rest.splitlines()[1:] if ln.strip()] if sep else []
        if not lines or lines[0].startswith("--"):
            raise JwtError(f"not a NATS credentials file (no {marker.split(' ', 1)[1]} block)")
        found.append(lines[0])
    return found[0], found[1]
