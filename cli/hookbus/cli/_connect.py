"""How every CLI command connects to NATS: the URL, the credentials (a creds file, an nkey
seed, user and password, a token), TLS, the inbox prefix, or a `nats` CLI context holding
them; and one clear error line when the server refuses the connection.

Where to connect, as the `nats` CLI decides it: ``--url``, else ``NATS_URL``, else the
NATS context (``--context``, ``NATS_CONTEXT``, else the one `nats context select` chose,
named in ``$XDG_CONFIG_HOME/nats/context.txt``), else ``nats://127.0.0.1:4222`` if a
server answers there. ``--embedded`` asks for a private server instead. A URL that did
not come from ``--url`` is named in one line on stderr once connected.

Authentication is nats-py's own (``user_credentials``, ``nkeys_seed``, ``user``/``password``,
``token``, ``tls``); this module only gathers the settings, checks the files can be read,
derives the inbox prefix of an nkey user, and words the refusals. A seed of a ``hookbus
auth init`` folder also gives the CA to verify the server with (the folder's, unless
``--tls-ca`` or a context's ``ca`` says otherwise) and the identity's role and name, which
label the connection's refusals (`hookbus._core.nats_guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar, overload
from urllib.parse import urlsplit, urlunsplit

import click
import nats
import nats.errors
from nats.aio.client import Client as NATS

from hookbus._core.nats_guard import harden_connection, refusal_raised

__all__ = [
    "DEFAULT_MAX_RECONNECTS",
    "FIRST_CONNECT_WAIT_S",
    "LOCAL_URL",
    "NATS_SCHEMES",
    "RECONNECT_WAIT_S",
    "AuthIdentity",
    "ConnectionSettings",
    "auth_ca",
    "auth_identity",
    "auth_ssl_context",
    "connect",
    "connection_options",
    "load_context",
    "nkey_inbox_prefix",
    "resolve_connection",
    "selected_context",
]

log = logging.getLogger("hookbus.cli")

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_CONTEXT_URL = "nats://localhost:4222"
"""A context without a URL means the local server, as for the `nats` CLI."""

LOCAL_URL = "nats://127.0.0.1:4222"
"""Where a command connects when nothing says where (no URL, no context)."""

DEFAULT_MAX_RECONNECTS = 60
"""Reconnect attempts after a lost connection before a command gives up (about two
minutes at `RECONNECT_WAIT_S`; nats-py's own default). -1: forever."""

RECONNECT_WAIT_S = 2.0
"""Seconds between two reconnect attempts to the same server."""

# `nats` CLI context fields hookbus reads, and the settings they fill.
_CONTEXT_FIELDS = {
    "url": "url",
    "user": "user",
    "password": "password",
    "creds": "creds",
    "nkey": "nkey",
    "token": "token",
    "ca": "tls_ca",
    "cert": "tls_cert",
    "key": "tls_key",
    "inbox_prefix": "inbox_prefix",
    "jetstream_domain": "js_domain",
}
# Context fields that change where or as whom a client connects: refused rather than ignored.
_UNSUPPORTED_CONTEXT_FIELDS = (
    "user_jwt",
    "nsc",
    "jetstream_api_prefix",
    "socks_proxy",
    "windows_cert_store",
    "windows_cert_match_by",
    "windows_cert_match",
    "windows_ca_certs_match",
)
_AUTH_FIELDS = ("creds", "nkey", "user", "password", "token")
_AUTH_KINDS = {
    "creds": "creds",
    "nkey": "nkey",
    "user": "user",
    "password": "user",
    "token": "token",
}
_PATH_FIELDS = ("creds", "nkey", "tls_ca", "tls_cert", "tls_key")
_OPTION_NAMES = {
    "url": "--url",
    "creds": "--creds",
    "nkey": "--nkey",
    "user": "--user",
    "password": "--password",
    "token": "--token",
    "tls_ca": "--tls-ca",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "inbox_prefix": "--inbox-prefix",
    "js_domain": "--js-domain",
}
# The environment variable of each option (the `nats` CLI's names).
ENV_VARS = {
    "url": "NATS_URL",
    "creds": "NATS_CREDS",
    "nkey": "NATS_NKEY",
    "user": "NATS_USER",
    "password": "NATS_PASSWORD",
    "token": "NATS_TOKEN",
    "tls_ca": "NATS_CA",
    "tls_cert": "NATS_CERT",
    "tls_key": "NATS_KEY",
    "inbox_prefix": "NATS_INBOX_PREFIX",
    "js_domain": "NATS_JS_DOMAIN",
    "context": "NATS_CONTEXT",
}
_PERMISSIONS = re.compile(r"permissions violation for (\w+) to \"?([^\"]*)\"?", re.IGNORECASE)


@dataclass(frozen=True)
class ConnectionSettings:
    """Where and how to connect: what the connection options and a context gave.

    `url` None means nothing said where: `connect` tries `LOCAL_URL`. `embedded` asks for
    a private embedded server (the caller starts it and sets `url`). Secrets are kept out
    of `repr`.
    """

    url: str | None = None
    creds: str | None = None
    nkey: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_first: bool = False
    inbox_prefix: str | None = None
    js_domain: str | None = None
    """The JetStream domain holding hookbus's buckets (a leaf site: the hub's); None: the
    server's own JetStream."""
    context: str | None = None
    """The context the settings were read from (for messages)."""
    source: str = ""
    """Where the URL came from, for messages: ``--url``, ``NATS_URL``, ``the NATS context
    'dev'``, ``the selected NATS context 'dev'``; empty when a program set it."""
    embedded: bool = False
    """``--embedded``: a private embedded nats-server instead of any URL."""

    def with_url(self, url: str) -> ConnectionSettings:
        return replace(self, url=url)

    @property
    def has_credentials(self) -> bool:
        return any(getattr(self, name) for name in _AUTH_FIELDS)

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_first)

    @property
    def identity(self) -> str:
        """Who this connects as, for messages (never a secret)."""
        if self.creds:
            return f"creds {self.creds}"
        if self.nkey:
            try:
                return f"nkey {_nkey_public_key(self.nkey)}"
            except click.ClickException:
                return f"nkey {self.nkey}"
        if self.user:
            return f"user {self.user!r}"
        if self.token:
            return "token"
        user = _url_user(self.url or "")
        return f"user {user!r} from the URL" if user else "no credentials"

    def check(self) -> None:
        """Read every file the connection needs, so a bad one fails before anything starts.

        Raises:
            click.ClickException: a file is missing or unreadable, or not what it should be.
        """
        if self.creds:
            _check_creds_file(self.creds)
        if self.nkey:
            _nkey_public_key(self.nkey)
        self.ssl_context()

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context from the CA, certificate and key (None when none is given).

        Raises:
            click.ClickException: a file cannot be read or is not a certificate / key.
        """
        if not self.uses_tls:
            return None
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise click.ClickException(
                f"cannot load the TLS CA {self.tls_ca}: {_os_reason(exc)}"
            ) from exc
        if self.tls_cert:
            try:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise click.ClickException(
                    f"cannot load the TLS certificate {self.tls_cert}"
                    f" (key {self.tls_key or 'in the same file'}): {_os_reason(exc)}"
                ) from exc
        return ctx

    def inbox(self) -> str | None:
        """The inbox prefix: the one given, else ``_INBOX_<public key>`` for an nkey user
        and for a creds file of a ``hookbus auth init --jwt`` folder (another creds file
        keeps the client's default inbox)."""
        if self.inbox_prefix:
            return self.inbox_prefix
        if self.nkey:
            return nkey_inbox_prefix(self.nkey)
        if self.creds and _manifest_of_seed(self.creds) is not None:
            return f"_INBOX_{_creds_public_key(self.creds)}"
        return None

    def nats_options(self) -> dict[str, Any]:
        """The `nats.connect` keyword arguments for these settings.

        Raises:
            click.ClickException: a file cannot be read.
        """
        options: dict[str, Any] = {}
        if self.creds:
            options["user_credentials"] = self.creds
        elif self.nkey:
            options["nkeys_seed"] = self.nkey
        elif self.user:
            options["user"] = self.user
            options["password"] = self.password
        elif self.token:
            options["token"] = self.token
        tls = self.ssl_context()
        if tls is not None:
            options["tls"] = tls
        if self.tls_first:
            options["tls_handshake_first"] = True
        inbox = self.inbox()
        if inbox:
            options["inbox_prefix"] = inbox
        return options

    def child_env(self) -> dict[str, str]:
        """Environment variables that give a child ``hookbus`` process these settings
        (the URL excluded: pass it with ``--url``). The child reads the same context, if
        any, and these values win over it as they did here; without one, ``NATS_CONTEXT``
        is emptied (click ignores an empty variable)."""
        env = {
            ENV_VARS[f.name]: str(getattr(self, f.name))
            for f in fields(self)
            if f.name in ENV_VARS and f.name != "url" and getattr(self, f.name)
        }
        env.setdefault("NATS_CONTEXT", "")
        return env


@dataclass(frozen=True)
class AuthIdentity:
    """An identity of a ``hookbus auth init`` folder: its role, name and tenant."""

    role: str
    name: str
    tenant: str
    public_key: str

    @property
    def label(self) -> str:
        """``<role> <name>``, e.g. ``worker sec``, for messages."""
        return f"{self.role} {self.name}"


_MANIFEST = "hookbus-auth.json"


def _manifest_of_seed(seed_file: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(manifest, identity)``: the ``hookbus-auth.json`` beside `seed_file` (or in its
    parent folder: a tenant's seeds are in DIR/T/) that names the seed's public key. A
    creds file of a JWT-mode folder: the manifest whose tenant account signed it, and its
    identity there (``{}`` for one issued later, which no manifest lists)."""
    account = None
    try:
        if Path(seed_file).suffix == ".creds":
            public = _creds_public_key(seed_file)
            account = _creds_account(seed_file)
        else:
            public = _nkey_public_key(seed_file)
    except click.ClickException:
        return None
    folder = Path(seed_file).resolve().parent
    for where in (folder, folder.parent):
        try:
            raw = json.loads((where / _MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(raw, dict):
            continue
        for ident in raw.get("identities", []):
            if isinstance(ident, dict) and ident.get("public_key") == public:
                return raw, ident
        jwt = raw.get("jwt")
        accounts = jwt.get("accounts", {}) if isinstance(jwt, dict) else {}
        if account and any(
            isinstance(a, dict) and a.get("public_key") == account for a in accounts.values()
        ):
            return raw, {}
    return None


def auth_identity(settings: ConnectionSettings) -> AuthIdentity | None:
    """The ``hookbus auth`` identity `settings` connect as: the nkey seed's (or creds
    file's) public key looked up in the ``hookbus-auth.json`` of the seed's folder (or its
    parent: a tenant's folder); None when there is no seed or no such manifest names the
    key (a credential issued after ``init --jwt`` is in no manifest)."""
    secret = settings.nkey or settings.creds
    found = _manifest_of_seed(secret) if secret else None
    if found is None or not found[1]:
        return None
    ident = found[1]
    return AuthIdentity(
        str(ident.get("role", "")),
        str(ident.get("name", "")),
        str(ident.get("tenant", "")),
        str(ident.get("public_key", "")),
    )


def auth_ca(seed_file: str) -> str | None:
    """The CA of the ``hookbus auth init`` folder that holds `seed_file` (its manifest's
    ``tls_ca``, when that file exists); None when the folder has none."""
    found = _manifest_of_seed(seed_file)
    ca = found[0].get("tls_ca") if found is not None else None
    return ca if isinstance(ca, str) and ca and Path(ca).is_file() else None


def auth_ssl_context(source: str | os.PathLike[str]) -> ssl.SSLContext | None:
    """The client TLS context that verifies a server made by ``hookbus auth init``, from
    `source`: the auth folder (its ``hookbus-auth.json``), one of its contexts (a .json
    file with ``ca``) or one of its nkey seeds; None when that setup has no TLS.

    Raises:
        click.ClickException: `source` is none of those, or the CA cannot be read.
    """
    path = Path(source)
    if path.is_dir():
        path = path / _MANIFEST
    ca: str | None
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise click.ClickException(f"{path} is not a JSON object")
        ca = raw.get("tls_ca") if path.name == _MANIFEST else raw.get("ca")
        if ca and path.name != _MANIFEST:
            ca = _context_file(path, "ca", ca)
    else:
        if _manifest_of_seed(str(path)) is None:
            raise click.ClickException(f"no {_MANIFEST} beside {path} names its key")
        ca = auth_ca(str(path))
    if not ca:
        return None
    return ConnectionSettings(tls_ca=str(ca)).ssl_context()


def nkey_inbox_prefix(seed_file: str) -> str:
    """``_INBOX_<public key>``: the inbox prefix of the nkey user whose seed is in `seed_file`.

    Raises:
        click.ClickException: the file cannot be read or holds no user seed.
    """
    return f"_INBOX_{_nkey_public_key(seed_file)}"


@functools.lru_cache(maxsize=16)
def _nkey_public_key(seed_file: str) -> str:
    import nkeys  # type: ignore[import-untyped]  # when used: the Claude Code hook starts faster

    try:
        seed = bytearray(Path(seed_file).read_bytes().strip())
    except OSError as exc:
        raise click.ClickException(
            f"cannot read the nkey seed file {seed_file}: {_os_reason(exc)}"
        ) from exc
    try:
        kp = nkeys.from_seed(seed)
        public = str(kp.public_key.decode())
        kp.wipe()
    except (nkeys.NkeysError, ValueError, UnicodeDecodeError) as exc:
        raise click.ClickException(
            f"the nkey seed file {seed_file} holds no valid nkey seed"
        ) from exc
    finally:
        seed[:] = b"\0" * len(seed)
    if not public.startswith("U"):
        raise click.ClickException(
            f"the nkey seed file {seed_file} holds a {public[:1]}... seed, not a user seed (SU...)"
        )
    return public


def _creds_public_key(path: str) -> str:
    """The public key of the user seed in the creds file `path`.

    Raises:
        click.ClickException: unreadable, or no valid user seed in it.
    """
    from ._jwt import JwtError, KeyPair, parse_creds

    _check_creds_file(path)
    try:
        _, seed = parse_creds(Path(path).read_text(errors="replace"))
        public = KeyPair.from_seed(seed).public_key
    except (OSError, JwtError) as exc:
        raise click.ClickException(f"the creds file {path}: {exc}") from None
    if not public.startswith("U"):
        raise click.ClickException(f"the creds file {path} holds no user seed (SU...)")
    return public


def _creds_account(path: str) -> str | None:
    """The account that signed the creds file's user JWT (its ``issuer_account``, else its
    issuer); None when the JWT cannot be read."""
    from ._jwt import JwtError, decode, parse_creds

    try:
        claims = decode(parse_creds(Path(path).read_text(errors="replace"))[0])
    except (OSError, JwtError):
        return None
    nats = claims.get("nats")
    account = nats.get("issuer_account") if isinstance(nats, dict) else None
    return str(account or claims.get("iss") or "") or None


def _check_creds_file(path: str) -> None:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise click.ClickException(f"cannot read the creds file {path}: {_os_reason(exc)}") from exc
    if "BEGIN NATS USER JWT" not in text or "BEGIN USER NKEY SEED" not in text:
        raise click.ClickException(
            f"{path} is not a NATS credentials file (no user JWT and nkey seed)"
        )


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).replace("_", " ").lower()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# -- `nats` CLI contexts ----------------------------------------------------------------
def _context_path(ref: str) -> Path:
    if ref.endswith(".json") or os.sep in ref:
        return Path(ref).expanduser()
    if ref in (".", "..") or ".." in ref:
        raise click.ClickException(f"{ref!r} is not a valid NATS context name")
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "nats" / "context" / f"{ref}.json"


def load_context(ref: str) -> dict[str, Any]:
    """The settings of a `nats` CLI context, by name (``$XDG_CONFIG_HOME/nats/context/
    NAME.json``, default ``~/.config/nats/context/NAME.json``) or by the path of a .json
    file, as `ConnectionSettings` field names; empty fields are left out.

    Raises:
        click.ClickException: no such context, unreadable or invalid JSON, a field hookbus
            does not support (e.g. ``user_jwt``, ``jetstream_api_prefix``); its
            ``jetstream_domain`` is read as ``js_domain``.
    """
    path = _context_path(ref)
    try:
        raw = path.read_text()
    except FileNotFoundError as exc:
        raise click.ClickException(f"no NATS context {ref!r} (no file {path})") from exc
    except OSError as exc:
        raise click.ClickException(
            f"cannot read the NATS context {ref!r} ({path}): {_os_reason(exc)}"
        ) from exc
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise click.ClickException(
            f"the NATS context {path} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from exc
    if not isinstance(data, dict):
        raise click.ClickException(f"the NATS context {path} is not a JSON object")
    unsupported = [k for k in _UNSUPPORTED_CONTEXT_FIELDS if data.get(k)]
    if unsupported:
        raise click.ClickException(
            f"the NATS context {path} sets {', '.join(unsupported)}, which hookbus does not support"
        )
    out: dict[str, Any] = {}
    for key, name in _CONTEXT_FIELDS.items():
        value = data.get(key)
        if value in (None, ""):
            continue
        if not isinstance(value, str):
            raise click.ClickException(f"the NATS context {path}: {key} must be a string")
        if name in _PATH_FIELDS:
            value = _context_file(path, key, value)
        out[name] = value
    if data.get("tls_first"):
        out["tls_first"] = True
    return out


def _context_file(path: Path, key: str, value: str) -> str:
    if value.startswith("file://"):
        value = value[len("file://") :]
    elif re.match(r"^[a-z][a-z0-9+.-]*:", value) and not re.match(r"^[A-Za-z]:[\\/]", value):
        raise click.ClickException(
            f"the NATS context {path}: {key} {value.split(':', 1)[0]}: URIs are not supported"
            " (give a file path)"
        )
    return str(Path(value).expanduser())


def _config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config"))


def selected_context() -> str | None:
    """The context `nats context select` chose: the name in
    ``$XDG_CONFIG_HOME/nats/context.txt`` (default ``~/.config/nats/context.txt``), or
    None when there is none. Source: NATS ADR-21, configuration contexts."""
    try:
        name = (_config_home() / "nats" / "context.txt").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name or None


def resolve_connection(
    *,
    context: str | None = None,
    url_source: str = "--url",
    context_source: str = "the NATS context",
    embedded: bool = False,
    **given: str | None,
) -> ConnectionSettings:
    """Merge the options given (flags or their environment variables) over a context's.

    A credential given explicitly replaces the context's credentials of another kind (a
    ``--token`` drops the context's user and password); within one kind (user and
    password) and for the URL, the TLS files and the inbox prefix, each option given
    wins over the context's value.

    Args:
        context: a context name or .json path (None: none).
        url_source: how the URL was given (``--url`` or ``NATS_URL``), for messages.
        context_source: how the context was chosen, for messages.
        embedded: ``--embedded``: a private server; the URL and context are not used.
        given: the options, by `ConnectionSettings` field name.
    Raises:
        click.ClickException: a bad context, or an unreadable or invalid file.
        click.UsageError: options that do not go together.
    """
    values: dict[str, Any] = {k: v for k, v in given.items() if v}
    if embedded:
        values.pop("url", None)
        values.update(embedded=True, source="--embedded")
        context = None
    elif values.get("url"):
        values["source"] = url_source
    if context:
        from_context = load_context(context)
        kinds = {_AUTH_KINDS[k] for k in _AUTH_FIELDS if values.get(k)}
        if kinds:
            from_context = {
                k: v
                for k, v in from_context.items()
                if k not in _AUTH_KINDS or _AUTH_KINDS[k] in kinds
            }
        values = {**from_context, **values}
        if "url" not in values:
            values["url"] = DEFAULT_CONTEXT_URL
            values["source"] = f"{context_source} {context!r}"
        elif "source" not in values:
            values["source"] = f"{context_source} {context!r}"
        values["context"] = context
    settings = ConnectionSettings(**values)
    where = f" (with the NATS context {context!r})" if context else ""
    methods = [_OPTION_NAMES[k] for k in ("creds", "nkey", "user", "token") if getattr(settings, k)]
    if len(methods) > 1:
        raise click.UsageError(f"{' and '.join(methods)} do not go together{where}")
    if settings.password and not settings.user:
        raise click.UsageError(f"--password needs --user{where}")
    if settings.user and settings.password is None:
        raise click.UsageError(f"--user needs --password (or NATS_PASSWORD){where}")
    if settings.tls_key and not settings.tls_cert:
        raise click.UsageError(f"--tls-key needs --tls-cert{where}")
    secret = settings.nkey or settings.creds
    if secret and not settings.tls_ca and (ca := auth_ca(secret)):
        settings = replace(settings, tls_ca=ca)  # a seed of `hookbus auth init`: its CA
    settings.check()
    return settings


def _from_env(name: str) -> bool:
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    return ctx.get_parameter_source(name) == click.core.ParameterSource.ENVIRONMENT


_GROUP_CONNECTION = "hookbus.group_connection"
"""`click.Context.meta` key: the settings given to a group's connection options."""


def _given_here(embedded: bool) -> bool:
    """Whether a connection option was given on the command line to the current command."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    names = [*_OPTION_NAMES, "context", *(["embedded"] if embedded else [])]
    return any(
        ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE for name in names
    )


def _group_connection() -> ConnectionSettings | None:
    """The settings a group above the current command was given on the command line."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or isinstance(ctx.command, click.Group):
        return None
    found = ctx.meta.get(_GROUP_CONNECTION)  # meta is shared by a context and its children
    return found if isinstance(found, ConnectionSettings) else None


def _keep_for_subcommands(settings: ConnectionSettings, embedded: bool) -> None:
    """In a group given connection options: keep them for its subcommand (which has the
    same options; given there too, its own win)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and isinstance(ctx.command, click.Group) and _given_here(embedded):
        ctx.meta[_GROUP_CONNECTION] = settings


@overload
def connection_options(f: F) -> F: ...


@overload
def connection_options(f: None = None, *, embedded: bool = True) -> Callable[[F], F]: ...


def connection_options(f: F | None = None, *, embedded: bool = True) -> Any:
    """Add the connection options (``--url``, ``--creds``, ``--nkey``, ``--user``,
    ``--password``, ``--token``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``,
    ``--inbox-prefix``, ``--js-domain``, ``--context``; each also from its ``NATS_*``
    variable; and
    ``--embedded`` unless `embedded` is False) to a command, which gets them as one
    `ConnectionSettings` argument named ``conn``. Use as ``@connection_options`` or
    ``@connection_options(embedded=False)``.

    Where to connect: ``--url``, else ``NATS_URL``, else the context (``--context``,
    ``NATS_CONTEXT``, else the selected one: `selected_context`), else nothing (`connect`
    tries `LOCAL_URL`). ``--embedded`` with ``--url`` is a usage error; it wins over the
    variables and contexts."""
    if f is None:
        return functools.partial(connection_options, embedded=embedded)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name, None) for name in _OPTION_NAMES}
        context = kwargs.pop("context", None)
        private = bool(kwargs.pop("embedded", False)) if embedded else False
        inherited = _group_connection()
        if "conn" not in kwargs and inherited is not None and not _given_here(embedded):
            kwargs["conn"] = inherited  # given to the group: `hookbus suspensions --url U list`
        if "conn" not in kwargs:  # `ctx.invoke(command, conn=...)` hands settings on
            if private and given["url"] and not _from_env("url"):
                raise click.UsageError("--embedded and --url do not go together")
            chosen = "the NATS context"
            if not context:
                context = selected_context()
                chosen = "the selected NATS context"
            elif _from_env("context"):
                chosen = "the NATS context (NATS_CONTEXT)"
            kwargs["conn"] = resolve_connection(
                context=context,
                url_source="NATS_URL" if _from_env("url") else "--url",
                context_source=chosen,
                embedded=private,
                **given,
            )
            _keep_for_subcommands(kwargs["conn"], embedded)
        return f(*args, **kwargs)

    def file_option(name: str, envvar: str, metavar: str, help: str) -> Callable[[F], F]:
        """An option naming a file, given as text: read by `ConnectionSettings.check` (a
        missing or unreadable one is one error line)."""
        return click.option(name, envvar=envvar, default=None, metavar=metavar, help=help)

    options = [
        click.option(
            "--url",
            envvar="NATS_URL",
            default=None,
            metavar="URL[,URL...]",
            help="NATS server URL, or a comma-separated server list (env NATS_URL). Without "
            "one: the NATS context (--context, NATS_CONTEXT, else the one `nats context "
            f"select` chose), else {LOCAL_URL} if a server answers there.",
        ),
        file_option(
            "--creds",
            "NATS_CREDS",
            "FILE",
            "User credentials file: JWT and nkey seed (env NATS_CREDS).",
        ),
        file_option(
            "--nkey",
            "NATS_NKEY",
            "SEED_FILE",
            "Nkey user seed file (env NATS_NKEY); the inbox prefix becomes "
            "_INBOX_<public key> unless --inbox-prefix is given.",
        ),
        click.option("--user", envvar="NATS_USER", default=None, help="User (env NATS_USER)."),
        click.option(
            "--password",
            envvar="NATS_PASSWORD",
            default=None,
            help="Password (env NATS_PASSWORD, which keeps it out of the process list).",
        ),
        click.option(
            "--token", envvar="NATS_TOKEN", default=None, help="Auth token (env NATS_TOKEN)."
        ),
        file_option(
            "--tls-ca",
            "NATS_CA",
            "FILE",
            "CA certificates (PEM) to verify the server with (env NATS_CA; a context's "
            "ca). Default with an --nkey seed of a `hookbus auth init` folder: its CA.",
        ),
        file_option(
            "--tls-cert",
            "NATS_CERT",
            "FILE",
            "Client certificate (PEM) for TLS client auth (env NATS_CERT).",
        ),
        file_option(
            "--tls-key",
            "NATS_KEY",
            "FILE",
            "Private key (PEM) of --tls-cert (env NATS_KEY).",
        ),
        click.option(
            "--inbox-prefix",
            envvar="NATS_INBOX_PREFIX",
            default=None,
            help="Prefix of the reply subjects (env NATS_INBOX_PREFIX).",
        ),
        click.option(
            "--js-domain",
            envvar="NATS_JS_DOMAIN",
            default=None,
            metavar="DOMAIN",
            help="JetStream domain holding hookbus's buckets (env NATS_JS_DOMAIN; a context's "
            "jetstream_domain): at a leaf node, the hub's domain. Default: the server's own "
            "JetStream; a bucket missing from a JetStream of another domain is never created.",
        ),
        click.option(
            "--context",
            envvar="NATS_CONTEXT",
            default=None,
            metavar="NAME|FILE",
            help="A `nats` CLI context: NAME in $XDG_CONFIG_HOME/nats/context/ (default "
            "~/.config/nats/context/), or a .json file (env NATS_CONTEXT; default: the "
            "selected one). Options given explicitly win over it.",
        ),
    ]
    if embedded:
        options.append(
            click.option(
                "--embedded",
                is_flag=True,
                help="Start a private nats-server (JetStream, temporary data, loopback) for "
                "this command and stop it on exit, instead of connecting to one.",
            )
        )
    decorated: Any = wrapper
    for option in reversed(options):
        decorated = option(decorated)
    return decorated


# -- connecting ---------------------------------------------------------------------------
def _url_user(url: str) -> str | None:
    for server in url.split(","):
        with contextlib.suppress(ValueError):
            if user := urlsplit(server.strip()).username:
                return user
    return None


def _redacted(url: str) -> str:
    """`url` with any password in it replaced by ``***``."""
    out = []
    for server in url.split(","):
        server = server.strip()
        try:
            parts = urlsplit(server)
        except ValueError:
            out.append(server)
            continue
        if parts.password is not None:
            host = parts.netloc.rpartition("@")[2]
            parts = parts._replace(netloc=f"{parts.username}:***@{host}")
            server = urlunsplit(parts)
        out.append(server)
    return ",".join(out)


class _DropTlsEofNote(logging.Filter):
    """asyncio warns when a TLS peer closes and the stream protocol asks to keep its half
    open; a server closing a refused connection says nothing more than the error does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


_TLS_EOF_FILTER = _DropTlsEofNote()


def _quiet_asyncio_tls_eof() -> None:
    logging.getLogger("asyncio").addFilter(_TLS_EOF_FILTER)  # a no-op when already added


def _most_telling(errors: list[BaseException]) -> BaseException:
    """The error that says most about a failed connect: each server is tried more than
    once, and a refusal (authorization, TLS) is often followed by a plain reset."""

    def rank(exc: BaseException) -> int:
        text = str(exc).lower()
        if isinstance(exc, nats.errors.AuthorizationError) or "authorization" in text:
            return 0
        if isinstance(exc, ssl.SSLError):
            return 1
        if isinstance(exc, nats.errors.NoServersError):
            return 4
        if isinstance(exc, nats.errors.Error):
            return 2
        return 3

    return min(errors, key=rank)  # the first of the best rank


def describe_refusal(url: str, settings: ConnectionSettings, exc: BaseException) -> str:
    """One line: why NATS at `url` could not be connected to, naming who asked."""
    where = f"NATS at {_redacted(url)}"
    text = str(exc).removeprefix("nats: ").strip().strip("'")
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization" in text.lower():
        return f"{where} refused the connection: authorization violation ({settings.identity})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        trusted = f"CA {settings.tls_ca}" if settings.tls_ca else "the system's CAs"
        reason = exc.verify_message or _os_reason(exc)
        return f"TLS with {where} failed: {reason} (verified with {trusted})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS with {where} failed: {_os_reason(exc)}"
    if "tls" in text.lower() or "secure" in text.lower():
        return f"TLS with {where} failed: {text}"
    if isinstance(exc, ConnectionRefusedError):
        return f"cannot connect to {where}: connection refused"
    if isinstance(exc, TimeoutError):
        return f"cannot connect to {where}: no answer within the connect timeout"
    if isinstance(exc, nats.errors.UnexpectedEOF):
        return (
            f"{where} closed the connection while connecting ({settings.identity};"
            " TLS or credentials it expects may be missing)"
        )
    if isinstance(exc, OSError):
        return f"cannot connect to {where}: {_os_reason(exc)}"
    return f"cannot connect to {where}: {text or type(exc).__name__}"


_announced: set[str] = set()


def _no_server(exc: BaseException) -> bool:
    """Whether a failed connect means nothing listens (rather than a refusal)."""
    if isinstance(exc, nats.errors.AuthorizationError | ssl.SSLError):
        return False
    if "authorization" in str(exc).lower():
        return False
    return isinstance(
        exc, OSError | TimeoutError | nats.errors.NoServersError | nats.errors.TimeoutError
    )


NATS_SCHEMES = ("nats", "tls", "ws", "wss")
"""The URL schemes nats-py connects with (ws and wss: NATS over websocket, with aiohttp)."""

FIRST_CONNECT_WAIT_S = 10.0
"""How long a long-running command (worker, dispatcher, console, gateway) waits for a
server that does not answer yet (one started just before it) before failing."""

_FIRST_CONNECT_RETRY_S = 0.25
"""Seconds between two first-connect attempts while waiting for a server."""


class _NothingListens(click.ClickException):
    """A first connect failed because nothing answered (rather than a refusal)."""


async def connect(
    settings: str | ConnectionSettings,
    *,
    name: str,
    service: bool = False,
    max_reconnects: int = DEFAULT_MAX_RECONNECTS,
    wait_for_server_s: float = 0.0,
) -> NATS:
    """Connect with `settings` (or just a URL): fail fast at start (each server tried
    twice), then, once connected, reconnect up to `max_reconnects` times
    `RECONNECT_WAIT_S` apart (-1: forever) before nats-py closes the connection for good;
    20 s pings. A URL that did not come from ``--url`` is named on stderr once. A
    permissions violation later is logged as one warning line naming the subject; with
    `service`, so are a lost connection and a reconnection.

    With `wait_for_server_s` above 0 (long-running commands: `FIRST_CONNECT_WAIT_S`), a
    first connect that nothing answers (connection refused, no answer) is retried for up
    to that many seconds, after one line on stderr saying it waits; a refusal
    (credentials, TLS) still fails at once.

    Raises:
        click.ClickException: the URL is malformed, no server answers (with no URL given:
            one line saying so and how to give one), or the server refused the connection
            (credentials, TLS): one line saying so.
    """
    if isinstance(settings, str):
        settings = ConnectionSettings(url=settings)
    url = settings.url or LOCAL_URL
    servers = [s.strip() for s in url.split(",") if s.strip()]
    if not servers:
        raise click.BadParameter("no NATS URL", param_hint="--url")
    for server in servers:
        if "://" not in server:
            raise click.BadParameter(
                f"{server!r} is not a NATS URL (nats://host:port)", param_hint="--url"
            )
        scheme = server.partition("://")[0]
        if scheme not in NATS_SCHEMES:
            raise click.BadParameter(
                f"{_redacted(server)!r} is not a NATS URL: {scheme}:// is not a NATS scheme;"
                f" use {', '.join(f'{s}://' for s in NATS_SCHEMES)}",
                param_hint="--url",
            )
        try:
            host, port = (split := urlsplit(server)).hostname, split.port
        except ValueError as exc:  # a port that is not a number, or out of range
            raise click.BadParameter(
                f"{_redacted(server)!r} is not a NATS URL: {exc}", param_hint="--url"
            ) from exc
        if not host or port == 0:
            raise click.BadParameter(
                f"{_redacted(server)!r} is not a NATS URL: "
                + ("it names no host" if not host else "port 0"),
                param_hint="--url",
            )
        if scheme in ("ws", "wss") and importlib.util.find_spec("aiohttp") is None:
            raise click.BadParameter(
                f"{_redacted(server)!r}: NATS over {scheme}:// (websocket) needs the aiohttp"
                " package (pip install aiohttp)",
                param_hint="--url",
            )
    options = settings.nats_options()
    _quiet_asyncio_tls_eof()
    if wait_for_server_s <= 0:
        nc = await _connect_once(
            settings, url, servers, options, name=name, service=service,
            max_reconnects=max_reconnects,
        )  # fmt: skip
    else:
        # only the long-running commands wait: the Claude Code hook's start-up (which shares
        # this module) does not load the retry library
        from tenacity import (
            AsyncRetrying,
            RetryCallState,
            retry_if_exception_type,
            stop_after_delay,
            wait_fixed,
        )

        def waiting(state: RetryCallState) -> None:
            if state.attempt_number == 1:
                exc = state.outcome.exception() if state.outcome else None
                click.echo(
                    f"waiting up to {wait_for_server_s:g} s for NATS at {_redacted(url)}"
                    f" ({exc.format_message() if isinstance(exc, click.ClickException) else exc})",
                    err=True,
                )

        retrying = AsyncRetrying(
            stop=stop_after_delay(wait_for_server_s),
            wait=wait_fixed(_FIRST_CONNECT_RETRY_S),
            retry=retry_if_exception_type(_NothingListens),
            before_sleep=waiting,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    nc = await _connect_once(
                        settings, url, servers, options, name=name, service=service,
                        max_reconnects=max_reconnects,
                    )  # fmt: skip
        except _NothingListens as exc:
            raise click.ClickException(
                f"{exc.format_message()} (waited {wait_for_server_s:g} s)"
            ) from exc
    if settings.js_domain:
        from hookbus._core.jetstream import bind_js_domain  # loads tenacity: only when asked
        from hookbus.schemas import HookbusError

        try:
            bind_js_domain(nc, settings.js_domain)
        except HookbusError as exc:
            await nc.close()
            raise click.BadParameter(str(exc), param_hint="--js-domain") from exc
    source = settings.source if settings.url else "nothing else given: the local default"
    if source and source not in ("--url", "--embedded") and url not in _announced:
        _announced.add(url)
        click.echo(f"NATS at {_redacted(url)} (from {source})", err=True)
    return nc


async def _connect_once(
    settings: ConnectionSettings,
    url: str,
    servers: list[str],
    options: dict[str, Any],
    *,
    name: str,
    service: bool,
    max_reconnects: int,
) -> NATS:
    """One first connect (`connect`'s). Raises `_NothingListens` when nothing answered."""
    connecting = True
    seen: list[BaseException] = []
    tls_failed = asyncio.Event()
    client: list[NATS] = []

    async def on_error(exc: Exception) -> None:
        if connecting:
            seen.append(exc)
            if isinstance(exc, ssl.SSLError):
                tls_failed.set()
            return
        text = str(exc).removeprefix("nats: ")
        if client and refusal_raised(client[0]):  # raised to its caller, which tells it
            log.debug("NATS: %s (%s)", text, settings.identity)
        elif match := _PERMISSIONS.search(text):  # nats-py lowercases it, subject included
            log.warning(
                "NATS refused %s to %r: permissions violation (%s)",
                match.group(1),
                match.group(2),
                settings.identity,
            )
        elif isinstance(exc, nats.errors.AuthorizationError):
            log.warning("%s", describe_refusal(url, settings, exc))
        elif isinstance(exc, nats.errors.UnexpectedEOF | nats.errors.StaleConnectionError) or (
            client and client[0].is_reconnecting and isinstance(exc, OSError | TimeoutError)
        ):
            log.debug("NATS: %r", exc)  # a lost connection is said once, on disconnect
        else:
            log.warning("NATS: %s", exc)

    async def on_disconnected() -> None:
        if service and client and client[0].is_reconnecting:
            tries = "forever" if max_reconnects < 0 else f"up to {max_reconnects} times"
            log.warning(
                "lost the connection to NATS at %s; reconnecting (%s, %gs apart)",
                _redacted(url), tries, RECONNECT_WAIT_S,
            )  # fmt: skip

    async def on_reconnected() -> None:
        if service and client:
            log.warning("reconnected to NATS at %s", _redacted(url))

    connecting_task = asyncio.ensure_future(
        nats.connect(
            servers,
            name=name,
            connect_timeout=3,
            max_reconnect_attempts=1,  # fail fast on a bad URL at start ...
            reconnect_time_wait=0.2,
            ping_interval=20,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            allow_reconnect=True,
            **options,
        )
    )
    tls_failure = asyncio.ensure_future(tls_failed.wait())
    try:
        # nats-py never returns from a failed TLS handshake (closing the half-upgraded
        # socket waits forever), and a certificate refused is refused on every retry:
        # stop at the first TLS error.
        await asyncio.wait({connecting_task, tls_failure}, return_when=asyncio.FIRST_COMPLETED)
        if not connecting_task.done():
            connecting_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting_task
            raise click.ClickException(describe_refusal(url, settings, _most_telling(seen)))
        nc = connecting_task.result()
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        cause = _most_telling([*seen, exc])
        if settings.url is None and _no_server(cause):
            raise _NothingListens(
                f"no NATS server: nothing answers at {LOCAL_URL} and no --url, NATS_URL or"
                " NATS context says where one is; give --url, start one with `hookbus"
                " server`, or add --embedded for a private one"
            ) from exc
        if _no_server(cause):
            raise _NothingListens(describe_refusal(url, settings, cause)) from exc
        raise click.ClickException(describe_refusal(url, settings, cause)) from exc
    finally:
        connecting = False
        tls_failure.cancel()
        if not connecting_task.done():  # cancelled from outside
            connecting_task.cancel()
    client.append(nc)
    # a refused request or subscription fails at once, naming who was refused
    known = auth_identity(settings)
    harden_connection(nc, identity=known.label if known else None)
    # ... then, once connected, reconnect a bounded number of times (nats-py's default
    # 60, 2 s apart), or forever with -1.
    nc.options["max_reconnect_attempts"] = max_reconnects
    nc.options["reconnect_time_wait"] = RECONNECT_WAIT_S
    return nc
