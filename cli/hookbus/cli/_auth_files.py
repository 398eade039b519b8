"""The auth folder of `hookbus auth`: nkey users with hookbus's role permissions, as
nats-server config, written and read back (the click commands are `hookbus.cli._auth_cmd`).

``hookbus auth init --out DIR`` writes, for every identity (role, name, tenant):

- ``<role>-<name>.nk``: its nkey seed (mode 0600; the only secret; never rewritten);
- ``<role>-<name>.json``: a nats CLI context (url, nkey path, inbox prefix);

and for the server:

- ``auth.conf``: one NATS account per tenant, each with its users (public keys) and their
  permissions (`hookbus.cli._permissions`); no user without a key, so anonymous
  clients are refused;
- ``tls.conf``: the client port's ``tls`` block, or a comment only with ``--no-tls`` (a
  node config includes it in either case);
- ``server.conf``: listen address, JetStream store, ``include "tls.conf"`` and
  ``include "auth.conf"``;
- ``ca.pem``, ``server-cert.pem`` and ``server-key.pem`` (mode 0600): a local CA and the
  server's certificate and key, made unless ``--no-tls`` or your own ``--tls-cert`` /
  ``--tls-key`` (`hookbus.cli._tls`); every context then names the CA (``ca``) and a
  ``tls://`` URL;
- ``cluster-auth.conf`` / ``cluster-auth-<CLUSTER>.conf`` (``--route``) and
  ``gateway-auth.conf`` (``--gateway``), mode 0600: the route and gateway passwords and
  URLs, for the ``cluster`` and ``gateway`` blocks of every node (`hookbus.cli._auth_links`);
- ``hookbus-auth.json``: the identities (role, name, tenant, public key, handlers), read
  back by ``hookbus auth add`` to add one and write ``auth.conf`` again;
- ``.gitignore`` (``*``) when it made DIR: seeds are never committed by accident.

Files of the default tenant (``HOOKBUS``) are in DIR; those of any other tenant T in DIR/T/.
``<name>`` in file names is `encode_token(name)`. Seeds are made with `nkeys` from 32
random bytes; nats-server stores only the public keys.

``hookbus auth init --jwt`` (NATS decentralized JWT authentication, `hookbus.cli._jwt`)
writes instead, with the same server.conf and TLS files:

- ``operator.nk`` (mode 0600): the operator's seed; it signs the accounts' JWTs;
- ``system-account.nk`` (0600): the system account's seed (the server's own account);
- per tenant, in its folder: ``account.nk`` and ``account-signing.nk`` (0600): the
  account's identity seed and its signing key's seed (which signs the users);
- ``<role>-<name>.creds`` (0600): the user's JWT (its role's permissions) and its seed;
  ``<role>-<name>.json``: its nats CLI context (url, creds path, inbox prefix);
- ``auth.conf``: ``operator``, ``system_account`` and ``resolver: MEMORY`` with every
  account's JWT preloaded (its size depends on the tenants, never on the users), and
  ``max_control_line`` raised for the users' JWTs;
- ``hookbus-auth.json``: also the operator's and accounts' public keys and JWTs.

``hookbus auth issue`` then signs a new user's JWT with its tenant's signing key and writes
its ``.creds`` and context only: no server file changes and the server needs no reload (it
trusts every user its accounts' keys signed). Issued users are not listed in the manifest.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import click
import nkeys  # type: ignore[import-untyped]

from hookbus._core.consumer_slots import CONSUMER_SLOTS
from hookbus.cli._permissions import Role as RoleName
from hookbus.cli._permissions import (
    RolePermissions,
    inbox_prefix,
    parse_worker_handler,
    permission_table,
    permissions_for,
)
from hookbus.schemas import BadRequestError, encode_token, is_js_domain_name

from ._auth_links import CLUSTER_CONF, parse_gateways, parse_routes, write_link_files

__all__ = [
    "AUTH_CONF",
    "CLUSTER_CONF",
    "CREDS_SUFFIX",
    "DEFAULT_TENANT",
    "MANIFEST",
    "SERVER_CONF",
    "TLS_CONF",
    "AuthSetup",
    "Identity",
    "NewIdentity",
    "account_signer",
    "issue_identity",
    "load_setup",
    "render_accounts",
    "render_server",
    "render_tls",
    "revoke_identity",
]

DEFAULT_TENANT: Final = "HOOKBUS"
MANIFEST: Final = "hookbus-auth.json"
AUTH_CONF: Final = "auth.conf"
SERVER_CONF: Final = "server.conf"
TLS_CONF: Final = "tls.conf"
_TENANT = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
CREDS_SUFFIX: Final = ".creds"
OPERATOR_SEED: Final = "operator.nk"
SYSTEM_ACCOUNT_SEED: Final = "system-account.nk"
ACCOUNT_SEED: Final = "account.nk"
ACCOUNT_SIGNING_SEED: Final = "account-signing.nk"


@dataclass
class Identity:
    """One nkey user: its role, name, tenant, public key, (workers) the ``EVENT/HANDLER``
    pairs it serves and (agents) whether it runs an embedded dispatcher."""

    role: RoleName
    name: str
    tenant: str
    public_key: str
    handlers: list[str] = field(default_factory=list)
    embedded: bool = False

    @property
    def stem(self) -> str:
        """File name without extension: ``<role>-<encoded name>``."""
        return f"{self.role}-{encode_token(self.name)}"

    def folder(self, out: Path) -> Path:
        return out if self.tenant == DEFAULT_TENANT else out / self.tenant

    def seed_path(self, out: Path) -> Path:
        return self.folder(out) / f"{self.stem}.nk"

    def context_path(self, out: Path) -> Path:
        return self.folder(out) / f"{self.stem}.json"

    def creds_path(self, out: Path) -> Path:
        """Its credentials file (JWT mode): user JWT and seed."""
        return self.folder(out) / f"{self.stem}{CREDS_SUFFIX}"

    def secret_path(self, out: Path, setup: AuthSetup) -> Path:
        """What it connects with: its ``.creds`` (JWT mode) or its ``.nk`` seed."""
        return self.creds_path(out) if setup.jwt else self.seed_path(out)

    def permissions(self, js_domains: Sequence[str] = ()) -> RolePermissions:
        """Its permissions (also through JetStream domains `js_domains`).

        Raises:
            click.ClickException: a worker recorded with a handler that is not
                ``EVENT/HANDLER`` (a manifest from before workers named their events).
        """
        try:
            return permissions_for(
                self.role,
                self.name,
                handlers=self.handlers if self.role == "worker" else None,
                embedded=self.embedded,
                public_key=self.public_key,
                js_domains=js_domains,
            )
        except BadRequestError as exc:
            raise click.ClickException(f"{self.role} {self.name!r}: {exc}") from None


@dataclass
class AuthSetup:
    """What ``hookbus-auth.json`` holds: the server's listen settings and the identities."""

    host: str = "127.0.0.1"
    port: int = 4222
    store_dir: str = "jetstream"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tenants: list[str] = field(default_factory=lambda: [DEFAULT_TENANT])
    routes: list[str] = field(default_factory=list)
    """``host:port`` of every node's cluster port (``cluster-auth.conf``), if a cluster."""
    clusters: dict[str, list[str]] = field(default_factory=dict)
    """Named clusters' route addresses (``host:port``; ``cluster-auth-<name>.conf``)."""
    gateways: dict[str, list[str]] = field(default_factory=dict)
    """Every cluster's gateway addresses (``host:port``; ``gateway-auth.conf``)."""
    js_max_file: str = "8G"
    """JetStream file storage one tenant (account) may use in all (nats-server size)."""
    js_max_mem: str = "256M"
    """JetStream memory storage one tenant may use in all (hookbus keeps no bucket in memory: its
    watches' consumers)."""
    js_domain: str | None = None
    """This server's JetStream domain (``jetstream { domain }``): the hub of a fleet over
    leaf nodes. Every identity may then reach the buckets as ``$JS.<domain>.API`` too (from
    a leaf), and every context names it (``jetstream_domain``)."""
    identities: list[Identity] = field(default_factory=list)
    jwt: dict[str, Any] | None = None
    """JWT mode (``init --jwt``): ``operator`` (public key and ``jwt``), ``system_account``
    (same) and ``accounts`` (per tenant: ``public_key``, ``signing_key``, ``jwt``); None:
    static nkey users in ``auth.conf``."""

    def find(self, tenant: str, role: str, name: str) -> Identity | None:
        for ident in self.identities:
            if (ident.tenant, ident.role, ident.name) == (tenant, role, name):
                return ident
        return None

    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host:  # IPv6
            host = f"[{host}]"
        scheme = "tls" if self.tls_cert else "nats"
        return f"{scheme}://{host}:{self.port}"

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, **asdict(self)}


def load_setup(out: Path) -> AuthSetup:
    """Read ``DIR/hookbus-auth.json``.

    Raises:
        click.ClickException: missing or not a hookbus auth manifest.
    """
    path = out / MANIFEST
    try:
        raw = json.loads(path.read_text())
        idents = [Identity(**i) for i in raw.pop("identities")]
        raw.pop("version", None)
        return AuthSetup(**raw, identities=idents)
    except FileNotFoundError:
        raise click.ClickException(
            f"{path} not found: run `hookbus auth init --out {out}`"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise click.ClickException(f"{path} is not a hookbus auth manifest: {exc}") from exc


# -- rendering (pure) -------------------------------------------------------------------


def _q(text: str) -> str:
    """A quoted string for the NATS config format (JSON escaping is a subset it reads)."""
    return json.dumps(text)


def _allow_block(kind: str, subjects: Sequence[str], indent: str) -> list[str]:
    lines = [f"{indent}{kind}: {{ allow: ["]
    lines += [f"{indent}  {_q(s)}" for s in subjects]
    lines.append(f"{indent}] }}")
    return lines


def _user_block(ident: Identity, indent: str, js_domain: str | None = None) -> list[str]:
    perms = ident.permissions([js_domain] if js_domain else [])
    for subject in [*perms.publish, *perms.subscribe]:
        if "<" in subject or ">" in subject.replace(".>", "") or not subject.strip():
            raise ValueError(f"not a subject for a config: {subject!r}")
    label = f"{ident.role} {ident.name!r}" + (" (embedded dispatcher)" if ident.embedded else "")
    if ident.handlers:
        label += f" (handlers: {', '.join(ident.handlers)})"
    inner = indent + "  "
    lines = [f"{indent}# {label}", f"{indent}{{", f"{inner}nkey: {_q(ident.public_key)}"]
    lines.append(f"{inner}permissions: {{")
    lines += _allow_block("publish", perms.publish, inner + "  ")
    lines += _allow_block("subscribe", perms.subscribe, inner + "  ")
    if perms.allow_responses is not None:
        r = perms.allow_responses
        lines.append(
            f"{inner}  allow_responses: {{ max: {r.max_msgs}, expires: {_q(f'{r.expires_s:g}s')} }}"
        )
    lines.append(f"{inner}}}")
    lines.append(f"{indent}}}")
    return lines


def render_accounts(setup: AuthSetup) -> str:
    """``auth.conf``: one account per tenant with its nkey users and their permissions
    (JWT mode: the operator, the system account and a resolver preloaded with every
    account's JWT; no user)."""
    if setup.jwt:
        return _render_jwt_auth(setup.jwt)
    lines = [
        "# hookbus identities: one NATS account per tenant, one nkey user per identity.",
        "# Written by `hookbus auth init` / `hookbus auth add` from hookbus-auth.json;",
        "# add identities with `hookbus auth add`, then reload the server (SIGHUP).",
        "# Every client must present an nkey: there is no anonymous user.",
        "accounts {",
    ]
    for tenant in setup.tenants:
        users = sum(1 for i in setup.identities if i.tenant == tenant)
        lines += [
            f"  {tenant} {{",
            f"    # JetStream limits of the tenant: {_JS_LIMITS_WHY}",
            f"    jetstream: {{ max_file: {setup.js_max_file}, max_mem: {setup.js_max_mem},"
            f" max_streams: {MAX_STREAMS}, max_consumers: {max_consumers(users)} }}",
            "    users: [",
        ]
        for ident in setup.identities:
            if ident.tenant == tenant:
                lines += _user_block(ident, "      ", setup.js_domain)
        lines += ["    ]", "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _render_jwt_auth(keys: dict[str, Any]) -> str:
    lines = [
        "# hookbus identities, NATS JWT mode: an operator, one account per tenant; users are",
        "# JWTs signed by their account's signing key (`hookbus auth issue`), which this server",
        "# trusts without knowing them: no user here, no reload to add one.",
        "# Written by `hookbus auth init --jwt` from hookbus-auth.json.",
        "# A client's CONNECT carries its user JWT (its permissions: up to ~10 KB).",
        f"max_control_line: {JWT_MAX_CONTROL_LINE}",
        f"operator: {_q(keys['operator']['jwt'])}",
        f"system_account: {_q(keys['system_account']['public_key'])}",
        "resolver: MEMORY",
        "resolver_preload: {",
        f"  # system account\n  {keys['system_account']['public_key']}:"
        f" {_q(keys['system_account']['jwt'])}",
    ]
    for tenant, acct in keys["accounts"].items():
        lines.append(f"  # tenant {tenant}\n  {acct['public_key']}: {_q(acct['jwt'])}")
    lines.append("}")
    return "\n".join(lines) + "\n"


MAX_STREAMS: Final = 8
"""Streams of a tenant: hookbus's four buckets and its audit stream, with room to spare."""

_JS_LIMITS_WHY: Final = (
    "storage, streams (only the admin creates any) and consumers (every identity but the"
    " dispatcher has 8 named slots per stream it reads)"
)


def max_consumers(identities: int) -> int:
    """A tenant's consumer limit: every identity's slots on the streams it may read (at
    most 3 each), and 256 for the dispatcher service's own watches and listings."""
    return 256 + identities * CONSUMER_SLOTS * 3


TLS_HANDSHAKE_TIMEOUT_S = 5.0
"""How long the server waits for a client's TLS handshake (nats-server's ``tls { timeout }``,
default 2 s). Thousands of agents connecting at once queue their handshakes on the server's and
their own cores; past 2 s the server closes them, and each retry adds to the queue."""


def render_tls(setup: AuthSetup) -> str:
    """``tls.conf``: the client port's ``tls { }`` block (certificate, key, CA; clients are
    not asked for certificates), or only a comment without TLS (``--no-tls``): a node
    config includes it at its top level in either case."""
    if not setup.tls_cert:
        return "# plain TCP: `hookbus auth init --no-tls` (no tls block)\n"
    lines = [
        "# TLS of the client port, written by `hookbus auth init`.",
        "tls {",
        f"  cert_file: {_q(setup.tls_cert)}",
        f"  key_file: {_q(setup.tls_key or '')}",
    ]
    if setup.tls_ca:
        lines.append(f"  ca_file: {_q(setup.tls_ca)}")
    lines += [
        "  verify: false  # clients authenticate with their nkeys",
        f"  timeout: {TLS_HANDSHAKE_TIMEOUT_S:g}  # s: a fleet starting at once queues handshakes",
        "}",
    ]
    return "\n".join(lines) + "\n"


def render_server(setup: AuthSetup, out: Path) -> str:
    """``server.conf``: listen, JetStream, ``include "tls.conf"`` and ``include
    "auth.conf"``."""
    store = Path(setup.store_dir)
    if not store.is_absolute():
        store = (out / store).resolve()
    lines = [
        "# nats-server for hookbus, written by `hookbus auth init`.",
        "# Run: hookbus server --config server.conf   (or: nats-server -c server.conf)",
        f"host: {_q(setup.host)}",
        f"port: {setup.port}",
        "",
        "jetstream {",
        f"  store_dir: {_q(str(store))}",
        *([f"  domain: {_q(setup.js_domain)}"] if setup.js_domain else []),
        "}",
        "",
        "max_payload: 1MB",
    ]
    lines += ["", f"include {_q(TLS_CONF)}", f"include {_q(AUTH_CONF)}"]
    return "\n".join(lines) + "\n"


def context_json(ident: Identity, setup: AuthSetup, out: Path) -> dict[str, Any]:
    """A nats CLI context for `ident` (``nats --context FILE``-style fields)."""
    ctx: dict[str, Any] = {
        "description": f"hookbus {ident.role} {ident.name} (tenant {ident.tenant})",
        "url": setup.url(),
        ("creds" if setup.jwt else "nkey"): str(ident.secret_path(out, setup).resolve()),
        "inbox_prefix": inbox_prefix(ident.public_key),
    }
    if setup.tls_ca:
        ctx["ca"] = setup.tls_ca
    if setup.js_domain:
        ctx["jetstream_domain"] = setup.js_domain
    return ctx


# -- files --------------------------------------------------------------------------------


def new_user_seed() -> tuple[str, str]:
    """A fresh nkey user: ``(seed, public key)`` (``SU...``, ``U...``)."""
    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    try:
        return bytes(seed).decode(), bytes(kp.public_key).decode()
    finally:
        kp.wipe()


def public_key_of(seed_file: Path) -> str:
    """The public key of the seed in `seed_file`."""
    kp = nkeys.from_seed(bytearray(seed_file.read_bytes().strip()))
    try:
        return bytes(kp.public_key).decode()
    finally:
        kp.wipe()


def _write_new_secret(path: Path, text: str) -> None:
    """Create `path` (mode 0600); never overwrite one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _checked_role_options(
    role: RoleName, name: str, handlers: Sequence[str], embedded: bool
) -> list[str]:
    """The worker's handlers without repeats, once the role's options are checked.

    Raises:
        click.BadParameter: `embedded` for a non-agent, handlers for a non-worker, a
            worker without handlers or with one not ``EVENT/HANDLER``, an empty name.
    """
    if embedded and role != "agent":
        raise click.BadParameter(f"only an agent runs an embedded dispatcher, not a {role}")
    if role == "worker":
        handlers = list(dict.fromkeys(handlers))
    elif handlers:
        raise click.BadParameter(f"only a worker has handlers, not a {role}")
    try:
        permissions_for(role, name, handlers=handlers or None, embedded=embedded)
    except BadRequestError as exc:
        raise click.BadParameter(str(exc)) from None
    return list(handlers)


def _new_identity(
    setup: AuthSetup,
    out: Path,
    role: RoleName,
    name: str,
    tenant: str,
    handlers: Sequence[str],
    *,
    embedded: bool = False,
    expires_s: float | None = None,
) -> Identity:
    """A new user key, once its role's options are checked: its seed written (``.nk``), or
    in JWT mode its signed ``.creds`` (valid for `expires_s` seconds from now; None: no
    expiry). Not recorded in `setup` (the caller appends it to ``setup.identities``).

    Raises:
        click.ClickException: it exists in `tenant` already, or its credential file does.
        click.BadParameter: see `_checked_role_options`.
    """
    if setup.find(tenant, role, name) is not None:
        raise click.ClickException(f"{role} {name!r} already exists in tenant {tenant}")
    handlers = _checked_role_options(role, name, handlers, embedded)
    seed, public = new_user_seed()
    ident = Identity(role, name, tenant, public, list(handlers), embedded=embedded)
    path = ident.secret_path(out, setup)
    if path.exists():
        raise click.ClickException(f"{path} exists: not overwriting a credential")
    if setup.jwt:
        from ._jwt import creds_text, user_jwt

        signer, account = account_signer(setup, ident.folder(out), tenant)
        perms = ident.permissions([setup.js_domain] if setup.js_domain else [])
        expires_at = None if expires_s is None else math.ceil(time.time() + expires_s)
        token = user_jwt(
            signer, public, name, perms, issuer_account=account["public_key"], expires_at=expires_at
        )
        _write_new_secret(path, creds_text(token, seed))
    else:
        _write_new_secret(path, seed + "\n")
    return ident


def account_signer(setup: AuthSetup, folder: Path, tenant: str) -> tuple[Any, dict[str, Any]]:
    """The signing key pair of `tenant`'s account (its seed in `folder`) and the account's
    entry of the manifest (``public_key``, ``signing_key``, ...), in a JWT-mode setup.

    Raises:
        click.ClickException: the seed is missing or unreadable, or is not the signing key
            the manifest names.
    """
    account = setup.jwt["accounts"][tenant]
    signer = _read_key(folder / ACCOUNT_SIGNING_SEED, f"tenant {tenant}'s signer")
    if signer.public_key != account["signing_key"]:
        raise click.ClickException(
            f"{folder / ACCOUNT_SIGNING_SEED} is not the signing key of tenant {tenant}'s"
            " account (hookbus-auth.json names another)"
        )
    return signer, account


def _read_key(path: Path, what: str) -> Any:
    """The key pair whose seed is in `path` (a `hookbus.cli._jwt.KeyPair`).

    Raises:
        click.ClickException: missing, unreadable or not a seed.
    """
    from ._jwt import JwtError, KeyPair

    try:
        return KeyPair.from_seed(path.read_text())
    except OSError as exc:
        raise click.ClickException(f"cannot read {path} ({what}): {exc.strerror or exc}") from None
    except JwtError as exc:
        raise click.ClickException(f"{path}: {exc}") from None


def write_setup(setup: AuthSetup, out: Path) -> None:
    """Write ``auth.conf``, ``tls.conf``, ``server.conf``, every context and the manifest
    (not seeds)."""
    for ident in setup.identities:
        _write_atomic(
            ident.context_path(out), json.dumps(context_json(ident, setup, out), indent=2) + "\n"
        )
    _write_atomic(out / AUTH_CONF, render_accounts(setup))
    _write_atomic(out / TLS_CONF, render_tls(setup))
    _write_atomic(out / SERVER_CONF, render_server(setup, out))
    _write_atomic(out / MANIFEST, json.dumps(setup.to_json(), indent=2) + "\n")


def parse_worker(spec: str) -> tuple[str, list[str]]:
    """``NAME:EVENT/HANDLER,EVENT/HANDLER`` -> ``(NAME, ["EVENT/HANDLER", ...])``.

    Raises:
        click.BadParameter: no name, no pair, or a pair that is not ``EVENT/HANDLER``.
    """
    name, sep, rest = spec.partition(":")
    handlers = [h.strip() for h in rest.split(",") if h.strip()] if sep else []
    if not name or not handlers:
        raise click.BadParameter(
            f"a worker is NAME:EVENT/HANDLER[,EVENT/HANDLER] (e.g."
            f" security:tool:pre/security_policy), got {spec!r}",
            param_hint="--worker",
        )
    try:
        for h in handlers:
            parse_worker_handler(h)
    except BadRequestError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker") from None
    return name, handlers


def worker_pairs(ref: str) -> list[str]:
    """The ``EVENT/HANDLER`` pairs the `HookWorker` at ``FILE.py:ATTR`` (or
    ``module:attr``) declares.

    Raises:
        click.BadParameter: it cannot be loaded, is not a HookWorker, or declares nothing.
    """
    from hookbus.workers import HookWorker

    from ._command_support import load_object

    obj = load_object(ref)
    if not isinstance(obj, HookWorker):
        raise click.BadParameter(f"{ref} is a {type(obj).__name__}, not a HookWorker")
    pairs = [f"{h.declaration.event}/{h.declaration.name}" for h in obj.handlers]
    if not pairs:
        raise click.BadParameter(f"{ref} declares no handler")
    return pairs


def _check_tenant(name: str) -> str:
    if not _TENANT.fullmatch(name):
        raise click.BadParameter(
            f"tenant {name!r}: a letter, then up to 63 letters, digits, '_' or '-'"
        )
    return name


def init_setup(
    out: Path,
    *,
    tenants: Iterable[str] = (),
    agents: Iterable[str] = (),
    embedded_agents: Iterable[str] = (),
    workers: Iterable[str] = (),
    approvers: Iterable[str] = (),
    auditors: Iterable[str] = (),
    routes: Iterable[str] = (),
    gateways: Iterable[str] = (),
    host: str = "127.0.0.1",
    port: int = 4222,
    store_dir: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_ca: str | None = None,
    tls: bool = True,
    sans: Iterable[str] = (),
    js_domain: str | None = None,
    jwt: bool = False,
) -> AuthSetup:
    """What ``hookbus auth init`` does (see its help). Returns the setup written.

    With `tls` and no `tls_cert`, a local CA and a server certificate are made into `out`
    (`hookbus.cli._tls.make_local_tls`; for `host`, the names `sans` and loopback); `tls`
    False and no `tls_cert`: plain TCP. `jwt`: NATS JWT mode (an operator, an account per
    tenant, a ``.creds`` per identity; see the module's doc)."""
    if (out / MANIFEST).exists():
        raise click.ClickException(
            f"{out / MANIFEST} exists: add identities with `hookbus auth add --dir {out}`"
        )
    if bool(tls_cert) != bool(tls_key):
        raise click.BadParameter("--tls-cert and --tls-key go together")
    if js_domain is not None and not is_js_domain_name(js_domain):
        raise click.BadParameter(f"{js_domain!r} is not a JetStream domain name")
    tenant_list = list(dict.fromkeys(_check_tenant(t) for t in tenants)) or [DEFAULT_TENANT]
    abs_tls = [str(Path(p).resolve()) if p else None for p in (tls_cert, tls_key, tls_ca)]
    route_groups = parse_routes(routes)
    setup = AuthSetup(
        host=host,
        port=port,
        store_dir=store_dir or str((out / "jetstream").resolve()),
        tls_cert=abs_tls[0],
        tls_key=abs_tls[1],
        tls_ca=abs_tls[2],
        tenants=tenant_list,
        routes=route_groups.pop(None, []),
        clusters={str(c): a for c, a in route_groups.items()},
        gateways=parse_gateways(gateways),
        js_domain=js_domain,
    )
    wanted: list[tuple[RoleName, str, list[str], bool]] = [
        ("admin", "admin", [], False),
        ("dispatcher", "dispatcher", [], False),
    ]
    wanted += [("agent", a, [], False) for a in agents]
    wanted += [("agent", a, [], True) for a in embedded_agents]
    for spec in workers:
        name, handlers = parse_worker(spec)
        wanted.append(("worker", name, handlers, False))
    wanted += [("approver", a, [], False) for a in approvers]
    wanted += [("auditor", a, [], False) for a in auditors]
    if not out.exists():
        out.mkdir(parents=True)
        (out / ".gitignore").write_text("# seeds: never commit\n*\n")
    if tls and not setup.tls_cert:
        from ._tls import make_local_tls  # cryptography: only when it makes certificates

        made = make_local_tls(out, host, sans=sans)
        setup.tls_cert, setup.tls_key, setup.tls_ca = str(made.cert), str(made.key), str(made.ca)
    route_files: dict[str | None, list[str]] = {None: setup.routes} if setup.routes else {}
    write_link_files(
        out, {**route_files, **setup.clusters}, setup.gateways, _write_new_secret
    )  # fmt: skip
    if jwt:
        setup.jwt = _make_jwt_keys(setup, out)
    for tenant in tenant_list:
        for role, name, handlers, embedded in wanted:
            if setup.find(tenant, role, name) is None:
                ident = _new_identity(setup, out, role, name, tenant, handlers, embedded=embedded)
                setup.identities.append(ident)
    write_setup(setup, out)
    return setup


def size_bytes(size: str) -> int:
    """A size as nats-server's config reads it, in bytes: ``K``, ``M``, ``G``, ``T`` are
    powers of 1000 (``8G`` = 8,000,000,000), ``KB``, ``MB``, ``GB``, ``TB`` powers of 1024;
    no unit: bytes. Case is ignored.

    Raises:
        click.BadParameter: not a size.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(B?)\s*", size.upper())
    if not m or (m[3] and not m[2]):
        raise click.BadParameter(f"not a size: {size!r} (e.g. 8G, 256M, 1GB)")
    power = " KMGT".index(m[2] or " ")
    return int(m[1]) * int((1024 if m[3] else 1000) ** power)


JWT_MAX_CONTROL_LINE: Final = "64KB"
"""The server's protocol line limit in JWT mode (default 4 KB): a client's CONNECT line holds
its user JWT, and the dispatcher's or an embedded agent's permissions make one of 4-6 KB."""

JWT_MAX_CONSUMERS: Final = 65536
"""A JWT-mode tenant's consumer limit. Users are issued after the account's JWT is signed,
so it cannot follow their number (`max_consumers`): room for about 2,700 identities holding
every one of their slots at once (agents' watches are released when idle)."""


def _jetstream_limits(setup: AuthSetup) -> Any:
    from ._jwt import JetStreamLimits

    return JetStreamLimits(
        mem_storage=size_bytes(setup.js_max_mem),
        disk_storage=size_bytes(setup.js_max_file),
        streams=MAX_STREAMS,
        consumer=JWT_MAX_CONSUMERS,
    )


def _make_jwt_keys(setup: AuthSetup, out: Path) -> dict[str, Any]:
    """The operator, the system account and one account per tenant (with a signing key):
    seeds written (0600), public keys and JWTs returned for the manifest."""
    from ._jwt import account_jwt, new_key, operator_jwt

    operator, system = new_key("operator"), new_key("account")
    _write_new_secret(out / OPERATOR_SEED, operator.seed + "\n")
    _write_new_secret(out / SYSTEM_ACCOUNT_SEED, system.seed + "\n")
    limits = _jetstream_limits(setup)
    accounts: dict[str, Any] = {}
    for tenant in setup.tenants:
        account, signing = new_key("account"), new_key("account")
        folder = out if tenant == DEFAULT_TENANT else out / tenant
        _write_new_secret(folder / ACCOUNT_SEED, account.seed + "\n")
        _write_new_secret(folder / ACCOUNT_SIGNING_SEED, signing.seed + "\n")
        accounts[tenant] = {
            "public_key": account.public_key,
            "signing_key": signing.public_key,
            "jwt": account_jwt(
                operator,
                account.public_key,
                tenant,
                jetstream=limits,
                signing_keys=[signing.public_key],
            ),
        }
    return {
        "operator": {
            "public_key": operator.public_key,
            "jwt": operator_jwt(operator, "hookbus", system_account=system.public_key),
        },
        "system_account": {
            "public_key": system.public_key,
            "jwt": account_jwt(operator, system.public_key, "SYS", jetstream=None),
        },
        "accounts": accounts,
    }


@dataclass(frozen=True)
class NewIdentity:
    """An identity to add to a folder (``hookbus auth add``) or issue (``auth issue``)."""

    out: Path
    """The folder ``hookbus auth init`` wrote."""
    role: RoleName
    name: str
    tenant: str | None = None
    """Its tenant (None: the default, or the only one)."""
    handlers: Sequence[str] = ()
    """The ``EVENT/HANDLER`` pairs a worker serves."""
    embedded: bool = False
    """An agent that runs its own HookDispatcher."""


def issue_identity(new: NewIdentity, *, expires_s: float | None = None) -> Identity:
    """What ``hookbus auth issue`` does: a new user of a JWT-mode folder, signed by its
    tenant's account signing key; writes its ``.creds`` (0600) and context only (no server
    file, no manifest entry: the server trusts it without a reload). `expires_s`: seconds
    from now (by this host's clock) until the server refuses it (the JWT's ``exp``); None:
    until revoked.

    Raises:
        click.ClickException: `out` is not a JWT-mode folder, the credential exists, or
            the signing key cannot be read.
        click.BadParameter: unknown tenant, several tenants and none given, or the role's
            options are wrong (handlers for a non-worker, a worker without one, ...).
    """
    out = new.out
    setup = load_setup(out)
    if not setup.jwt:
        raise click.ClickException(
            f"{out} holds static nkey users (made without --jwt): add one with"
            f" `hookbus auth add --dir {out}` and reload the server"
        )
    tenant = _pick_tenant(setup, new.tenant)
    ident = _new_identity(
        setup, out, new.role, new.name, tenant, new.handlers, embedded=new.embedded,
        expires_s=expires_s,
    )  # fmt: skip
    _write_atomic(
        ident.context_path(out), json.dumps(context_json(ident, setup, out), indent=2) + "\n"
    )
    return ident


def revoke_identity(out: Path, who: str, *, tenant: str | None = None) -> tuple[str, str]:
    """What ``hookbus auth revoke`` does: list a user's public key in its tenant account's
    ``revocations`` (with the current time: every JWT of that key issued until now is
    refused), sign the account's JWT again with the operator's key and write ``auth.conf``
    and the manifest. The server applies it on its next reload (SIGHUP), and then closes
    the revoked user's connections.

    Args:
        who: a ``.creds`` file (its tenant is the account that signed it) or a user public
            key (``U...``; its tenant `tenant`, or the default one).
    Returns:
        ``(tenant, user public key)``.
    Raises:
        click.ClickException: not a JWT-mode folder, a creds file no account of `out`
            signed, or the operator's seed cannot be read.
        click.BadParameter: `who` is neither a readable creds file nor a user public key,
            or the tenant is unknown.
    """
    from ._jwt import JwtError, KeyPair, account_jwt, decode, parse_creds

    setup = load_setup(out)
    if not setup.jwt:
        raise click.ClickException(
            f"{out} holds static nkey users (made without --jwt): `hookbus auth revoke` is"
            " for JWT mode (`hookbus auth init --jwt`)"
        )
    accounts = setup.jwt["accounts"]
    path = Path(who)
    if path.is_file():
        try:
            token, seed = parse_creds(path.read_text(errors="replace"))
            claims = decode(token)
            user = KeyPair.from_seed(seed).public_key
        except (OSError, JwtError) as exc:
            raise click.BadParameter(f"{who}: {exc}") from None
        nats_claims = claims.get("nats") or {}
        account = nats_claims.get("issuer_account") or claims.get("iss")
        found = [t for t, a in accounts.items() if a["public_key"] == account]
        if not found or claims.get("sub") != user:
            raise click.ClickException(f"{who} was not issued by an account of {out}")
        if tenant is not None and tenant != found[0]:
            raise click.BadParameter(f"{who} is a credential of tenant {found[0]}, not {tenant}")
        tenant = found[0]
    elif re.fullmatch(r"U[A-Z2-7]{55}", who):
        user = who
        tenant = _pick_tenant(setup, tenant)
    else:
        raise click.BadParameter(f"{who!r} is neither a .creds file nor a user public key (U...)")
    operator = _read_key(out / OPERATOR_SEED, "the operator's key")
    acct = accounts[tenant]
    revocations = dict(acct.get("revocations") or {})
    revocations[user] = int(time.time())
    acct["revocations"] = revocations
    acct["jwt"] = account_jwt(
        operator,
        acct["public_key"],
        tenant,
        jetstream=_jetstream_limits(setup),
        signing_keys=[acct["signing_key"]],
        revocations=revocations,
    )
    write_setup(setup, out)
    return tenant, user


def _pick_tenant(setup: AuthSetup, tenant: str | None) -> str:
    if tenant is None:
        tenant = DEFAULT_TENANT if DEFAULT_TENANT in setup.tenants else setup.tenants[0]
        if len(setup.tenants) > 1 and DEFAULT_TENANT not in setup.tenants:
            raise click.BadParameter(f"several tenants: pick one with --tenant ({setup.tenants})")
    if tenant not in setup.tenants:
        raise click.BadParameter(f"unknown tenant {tenant!r}; known: {', '.join(setup.tenants)}")
    return tenant


def add_identity(new: NewIdentity) -> Identity:
    """What ``hookbus auth add`` does: a new identity; other seeds are left as they are."""
    out = new.out
    setup = load_setup(out)
    if setup.jwt:
        raise click.ClickException(
            f"{out} is a JWT-mode folder: issue a credential with `hookbus auth issue"
            f" ROLE NAME --dir {out}` (no server file changes)"
        )
    tenant = _pick_tenant(setup, new.tenant)
    ident = _new_identity(
        setup, out, new.role, new.name, tenant, list(new.handlers), embedded=new.embedded
    )
    setup.identities.append(ident)
    write_setup(setup, out)
    return ident


def markdown_table() -> str:
    """The role table of docs/security.md, from `permission_table`."""
    lines = ["| role | direction | subject | why |", "| --- | --- | --- | --- |"]
    for row in permission_table():
        subject = row.subject if row.direction == "responses" else f"`{row.subject}`"
        lines.append(f"| {row.role} | {row.direction} | {subject} | {row.why} |")
    return "\n".join(lines) + "\n"
