"""``hookbus gateway http`` / ``hookbus gateway aos``: the HTTP gateway, served by uvicorn.

The process is a dispatcher replica: one `HookDispatcher` (strict events) on its own NATS
connection calls the remote hook workers, and `hookbus.integrations.gateway.gateway_app`
answers HTTP with it. It keeps no state of its own (suspensions and grants live in
JetStream KV), so N replicas behind a load balancer share the work.

A lost NATS server is retried ``--max-reconnects`` times (meanwhile every door answers
its fail-closed fallback and ``/readyz`` says not ready); then the gateway stops serving
and exits 1 with one error line (`_nats_lost`), for its supervisor to restart it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import click
import nats.errors
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookbusError, HookResult, NotConnectedError

from ._claude_code_cmd import door_options
from ._command_support import (
    ConnectionSettings,
    FiniteFloatRange,
    bucket_replicas_option,
    connect,
    connection_options,
    connection_or_embedded,
    drain_or_close,
    grace_period_option,
    max_reconnects_option,
    strict_buckets_option,
    wait_for_server_option,
)
from ._connect import LOCAL_URL
from ._decisions_cmd import ByteSize, audit_options
from ._extras import MissingExtraError
from ._lifecycle import listen, run_loop, running_loop, serve_announced
from ._nats_lost import nats_lost
from ._otel import otel_session, otlp_option

__all__ = ["gateway"]

log = logging.getLogger("hookbus.cli")

TOKEN_ENV = "HOOKBUS_GATEWAY_TOKEN"
DEFAULT_TIMEOUT_S = 25.0
"""Seconds a decision may take by default: the Claude Code door's default (below the
shortest default timeout Claude Code gives an HTTP hook)."""
DOOR_NAMES = ("claude-code", "aos")

F = TypeVar("F", bound=Callable[..., Any])


class Replica:
    """The gateway's dispatcher replica: its NATS connection and `HookDispatcher`.

    `emit` refuses with `NotConnectedError` while NATS is not connected (the doors answer
    that with their fail-closed reply), rather than deciding without the workers.
    """

    def __init__(self, nc: NATS, dispatcher: HookDispatcher) -> None:
        self.nc = nc
        self.dispatcher = dispatcher
        self.closed = False

    def ready(self) -> bool:
        return self.nc.is_connected and not self.closed

    async def emit(self, event: str, data: dict[str, Any], **options: Any) -> HookResult:
        if not self.ready():
            raise NotConnectedError("the gateway is not connected to NATS")
        return await self.dispatcher.emit(event, data, **options)

    async def close(self) -> None:
        """Stop the dispatcher, drain the connection (idempotent)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await self.dispatcher.close()
        if not self.nc.is_closed:
            try:
                await drain_or_close(self.nc)
            except (OSError, nats.errors.Error) as exc:  # nats-py closing a lost connection
                log.warning("NATS connection closed uncleanly: %s", exc or type(exc).__name__)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """The Starlette lifespan: on shutdown (SIGTERM, after uvicorn's own graceful
        stop), close the dispatcher and drain NATS."""
        try:
            yield
        finally:
            await self.close()


def _doors(value: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(d.strip() for d in value.split(",") if d.strip()))
    bad = [d for d in names if d not in DOOR_NAMES]
    if bad or not names:
        raise click.BadParameter(
            f"{value!r}: doors are a comma-separated list of {', '.join(DOOR_NAMES)}",
            param_hint="--doors",
        )
    return names


def _serve(
    *,
    doors: tuple[str, ...],
    host: str,
    port: int,
    token: str | None,
    https_cert: str | None,
    https_key: str | None,
    client_ca: str | None,
    max_body: int,
    on_continue: str,
    on_ask_user: str,
    fallbacks: tuple[str, ...],
    timeout_s: float,
    conn: ConnectionSettings,
    otlp_endpoint: str | None,
    grace_s: float,
    bucket_replicas: int,
    strict_buckets: bool,
    max_reconnects: int,
    wait_for_server_s: float,
    audit: bool,
    audit_max_age_s: float,
    audit_max_bytes: int,
) -> None:
    try:
        import uvicorn

        from hookbus.integrations.gateway import gateway_app
    except ImportError as exc:  # starlette, uvicorn
        raise MissingExtraError("hookbus gateway", "gateway") from exc
    if https_key and not https_cert:
        raise click.UsageError("--gateway-tls-key needs --gateway-tls-cert")
    if client_ca and not https_cert:
        raise click.UsageError("--gateway-client-ca needs --gateway-tls-cert (mTLS is HTTPS)")
    if token is not None and not token.strip():
        raise click.UsageError(f"--gateway-token (or {TOKEN_ENV}) is empty")
    if not token and not client_ca and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "the gateway on %s has neither a token (--gateway-token) nor client certificates"
            " (--gateway-client-ca): any client that reaches it may ask for decisions",
            host,
        )
    scheme = "https" if https_cert else "http"
    try:
        options = door_options(on_continue, on_ask_user, fallbacks, timeout_s)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    async def run(server: ConnectionSettings) -> None:
        nc = await connect(
            server,
            name=f"hookbus-gateway {','.join(doors)}",
            service=True,
            max_reconnects=max_reconnects,
            wait_for_server_s=wait_for_server_s,
        )
        dispatcher = HookDispatcher(
            nc,
            strict_events=True,
            approvals=on_ask_user == "approval",
            bucket_replicas=bucket_replicas,
            strict_buckets=strict_buckets,
            audit=audit,
            audit_max_age_s=audit_max_age_s,
            audit_max_bytes=audit_max_bytes,
        )
        replica = Replica(nc, dispatcher)
        try:
            try:
                await dispatcher.start()
            except HookbusError as exc:  # a bucket that differs (strict), JetStream down
                raise click.ClickException(str(exc)) from exc
            app = gateway_app(
                replica.emit,
                doors=set(doors),
                token=token,
                max_body_bytes=max_body,
                claude_code_options=options,
                aos_timeout_s=timeout_s,
                ready=replica.ready,
                lifespan=replica.lifespan,
            )
            config = uvicorn.Config(
                app,
                log_config=None,
                access_log=log.isEnabledFor(logging.INFO),
                lifespan="on",
                timeout_graceful_shutdown=max(1, round(grace_s)),
                ssl_certfile=https_cert,
                ssl_keyfile=https_key,
                ssl_ca_certs=client_ca,
                ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
            )
            try:
                config.load()
            except (OSError, ssl.SSLError) as exc:
                raise click.ClickException(f"cannot load the TLS files: {exc}") from exc
            sock = listen(host, port)
            methods = [("bearer token", token), ("client certificates", client_ca)]
            auth = ", ".join(name for name, on in methods if on) or "none"
            banner = (
                f"(doors: {', '.join(doors)}; auth: {auth}; loop {running_loop()}); Ctrl-C stops it"
            )
            http = uvicorn.Server(config)
            async with nats_lost(nc, server.url or LOCAL_URL, max_reconnects, http) as lost:
                await serve_announced(http, sock, what="gateway", scheme=scheme, banner=banner)
            lost.check()  # NATS given up on: one line, exit 1
        finally:
            await replica.close()

    with connection_or_embedded(conn) as server, otel_session("hookbus-gateway", otlp_endpoint):
        run_loop(run, server, serving=True)


def _gateway_options(default_port: int, default_doors: str, default_ask: str) -> Callable[[F], F]:
    options = [
        click.option(
            "--host",
            default="127.0.0.1",
            show_default=True,
            help="Address to listen on (0.0.0.0: every interface).",
        ),
        click.option(
            "--port",
            type=click.IntRange(0, 65535),
            default=default_port,
            show_default=True,
            help="Port (0: any free port; the URL is printed on stderr).",
        ),
        click.option(
            "--doors",
            default=default_doors,
            show_default=True,
            callback=lambda ctx, param, value: _doors(value),
            help="Doors to serve, comma-separated: claude-code (POST /claude-code, "
            "/claude-code/<event>), aos (POST /aos).",
        ),
        click.option(
            "--gateway-token",
            "gateway_token",
            envvar=TOKEN_ENV,
            default=None,
            metavar="TOKEN",
            help=f"Require Authorization: Bearer TOKEN on every door (env {TOKEN_ENV}, which"
            " keeps it out of the process list). --token is the NATS token.",
        ),
        click.option(
            "--gateway-tls-cert",
            "https_cert",
            envvar="HOOKBUS_GATEWAY_TLS_CERT",
            default=None,
            metavar="FILE",
            help="Serve HTTPS with this certificate chain (PEM; env HOOKBUS_GATEWAY_TLS_CERT)."
            " --tls-cert is the NATS client certificate.",
        ),
        click.option(
            "--gateway-tls-key",
            "https_key",
            envvar="HOOKBUS_GATEWAY_TLS_KEY",
            default=None,
            metavar="FILE",
            help="Private key (PEM) of --gateway-tls-cert (default: in that file; env"
            " HOOKBUS_GATEWAY_TLS_KEY).",
        ),
        click.option(
            "--gateway-client-ca",
            "client_ca",
            envvar="HOOKBUS_GATEWAY_CLIENT_CA",
            default=None,
            metavar="FILE",
            help="mTLS: refuse clients without a certificate signed by these CAs (PEM; env"
            " HOOKBUS_GATEWAY_CLIENT_CA).",
        ),
        click.option(
            "--max-body",
            type=ByteSize(),
            default="1MiB",
            show_default=True,
            help="Largest request body (e.g. 65536, 256KiB); larger ones get 413.",
        ),
        click.option(
            "--on-ask-user",
            type=click.Choice(["ask", "approval"]),
            default=default_ask,
            show_default=True,
            help="A handler's ask_user: left to the caller (Claude Code asks the user; the "
            "AOS door denies with hookbus:approval_required), or answered by hookbus's "
            "approval flow (`hookbus approvals`) within --timeout.",
        ),
        click.option(
            "--on-continue",
            type=click.Choice(["none", "allow"]),
            default="none",
            show_default=True,
            help="Claude Code door, when every handler lets a tool call go on: no opinion "
            "(Claude Code's permission rules decide) or allow (no permission prompt).",
        ),
        click.option(
            "--fallback",
            "fallbacks",
            multiple=True,
            metavar="[EVENT=]deny|allow|none",
            help="Claude Code door: what answers when hookbus cannot (repeatable). Default: "
            "PreToolUse and PermissionRequest deny, every other event none. The AOS door "
            "always denies.",
        ),
        click.option(
            "--timeout",
            "timeout_s",
            type=FiniteFloatRange(min=0, min_open=True, max=3600),
            default=DEFAULT_TIMEOUT_S,
            show_default=True,
            help="Seconds a decision may take (an approval's wait included); then the "
            "door's fallback answers. Keep it below the caller's HTTP timeout.",
        ),
        connection_options,
        otlp_option,
        grace_period_option,
        bucket_replicas_option,
        strict_buckets_option,
        max_reconnects_option,
        wait_for_server_option,
        audit_options,
    ]

    def decorate(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


@click.group()
def gateway() -> None:
    """Serve hookbus's doors over HTTP: each process is a stateless dispatcher replica
    (N replicas behind a load balancer share the work). GET /healthz and /readyz are
    always served. Once NATS is lost for good (--max-reconnects attempts failed), it
    stops and exits 1."""


@gateway.command("http")
@_gateway_options(8080, "claude-code", "ask")
def http_cmd(**options: Any) -> None:
    """Claude Code HTTP hooks: POST /claude-code (any event, named by the body's
    hook_event_name) and POST /claude-code/<hook_event_name>. SIGTERM stops it gracefully."""
    _main(options)


@gateway.command("aos")
@_gateway_options(8081, "aos", "approval")
def aos_cmd(**options: Any) -> None:
    """OWASP AOS guardian endpoint: JSON-RPC 2.0 on POST /aos. SIGTERM stops it gracefully."""
    _main(options)


def _main(options: dict[str, Any]) -> None:
    token = options.pop("gateway_token")
    if token is None and os.environ.get(TOKEN_ENV) == "":  # click ignores an empty variable
        token = ""
    _serve(token=token, **options)
