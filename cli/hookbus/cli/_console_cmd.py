"""``hookbus console``: the approvals console in a browser, served by uvicorn.

The process connects to NATS as one client (on a secured server: an approver's
credentials), opens an `ApprovalsClient` (the approvals bucket only) that lists and
answers approvals and grants, and serves `hookbus.integrations.console.console_app`
until SIGTERM / SIGINT. A lost NATS server is retried ``--max-reconnects`` times; then
the console stops serving and exits 1 with one error line (`_nats_lost`).
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

import click
import nats.errors
import nats.js.errors

from hookbus._core.approvers import valid_approver
from hookbus.dispatcher import ApprovalsClient
from hookbus.schemas import HookbusError

from ._command_support import (
    DURATION,
    ConnectionSettings,
    FiniteFloatRange,
    connect,
    connection_options,
    connection_or_embedded,
    drain_or_close,
    max_reconnects_option,
    wait_for_server_option,
)
from ._connect import LOCAL_URL, auth_identity
from ._extras import MissingExtraError
from ._lifecycle import listen, run_loop, running_loop, serve_announced
from ._nats_lost import nats_lost

__all__ = ["console"]

log = logging.getLogger("hookbus.cli")

TOKEN_ENV = "HOOKBUS_CONSOLE_TOKEN"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


@click.command("console")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0: every interface; then serve HTTPS).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8090,
    show_default=True,
    help="Port (0: any free port; the URL is printed on stderr).",
)
@click.option(
    "--console-token",
    "console_token",
    envvar=TOKEN_ENV,
    default=None,
    metavar="TOKEN",
    help=f"What signing in to the page takes (env {TOKEN_ENV}, which keeps it out of the "
    "process list); required. --token is the NATS token.",
)
@click.option(
    "--approver",
    envvar="HOOKBUS_CONSOLE_APPROVER",
    default=None,
    metavar="NAME",
    help="Bind the token to this approver name: every answer is recorded as NAME (env "
    "HOOKBUS_CONSOLE_APPROVER). Without it, each person names themselves at sign-in. On a "
    "secured server, the NATS user must be allowed to answer as that name.",
)
@click.option(
    "--session-ttl",
    "session_ttl_s",
    type=DURATION,
    default="12h",
    show_default=True,
    help="How long a sign-in lasts (e.g. 30m, 12h).",
)
@click.option(
    "--console-tls-cert",
    "https_cert",
    envvar="HOOKBUS_CONSOLE_TLS_CERT",
    default=None,
    metavar="FILE",
    help="Serve HTTPS with this certificate chain (PEM; env HOOKBUS_CONSOLE_TLS_CERT); the "
    "session cookie is then Secure. --tls-cert is the NATS client certificate.",
)
@click.option(
    "--console-tls-key",
    "https_key",
    envvar="HOOKBUS_CONSOLE_TLS_KEY",
    default=None,
    metavar="FILE",
    help="Private key (PEM) of --console-tls-cert (default: in that file).",
)
@click.option(
    "--ping-timeout",
    default=0.5,
    show_default=True,
    type=FiniteFloatRange(min=0.05, max=10),
    help="Seconds the handlers view gathers the live workers' answers.",
)
@connection_options
@max_reconnects_option
@wait_for_server_option
def console(
    host: str,
    port: int,
    console_token: str | None,
    approver: str | None,
    session_ttl_s: float,
    https_cert: str | None,
    https_key: str | None,
    ping_timeout: float,
    conn: ConnectionSettings,
    max_reconnects: int,
    wait_for_server_s: float,
) -> None:
    """Serve the approvals console: pending approvals (answered as the signed-in
    approver), "Allow always" grants (revoke), recent decisions and live handlers, updated
    live. Sign in with the console token. SIGTERM / SIGINT stop it; once NATS is lost for
    good (--max-reconnects attempts failed), it stops and exits 1."""
    try:
        import uvicorn

        from hookbus.integrations.console import Feed, console_app
    except ImportError as exc:  # starlette, uvicorn
        raise MissingExtraError("hookbus console", "console") from exc
    if console_token is None and os.environ.get(TOKEN_ENV) == "":
        console_token = ""  # click ignores an empty variable
    if console_token is None:
        raise click.UsageError(f"the console needs a token: --console-token or {TOKEN_ENV}")
    if not console_token.strip():
        raise click.UsageError(f"--console-token (or {TOKEN_ENV}) is empty")
    if approver is not None and (problem := valid_approver(approver)):
        raise click.BadParameter(problem, param_hint="--approver")
    if https_key and not https_cert:
        raise click.UsageError("--console-tls-key needs --console-tls-cert")
    if not https_cert and host not in LOOPBACK:
        log.warning(
            "the console on %s serves plain HTTP: the token and the session cookie cross the"
            " network in clear (--console-tls-cert, or a TLS proxy in front)",
            host,
        )
    scheme = "https" if https_cert else "http"
    me = auth_identity(conn)  # the seed's identity, if a `hookbus auth` folder names it
    nats_approver = me.name if me is not None and me.role == "approver" else None
    if me is not None and me.role in ("agent", "worker", "auditor"):
        raise click.UsageError(
            f"the console's NATS credentials are {me.label} ({me.public_key}), which may not"
            " answer approvals: run it with an approver's seed (`hookbus auth add approver"
            " NAME`)"
        )
    if nats_approver is not None and approver is not None and approver != nats_approver:
        raise click.BadParameter(
            f"the NATS credentials are approver {nats_approver}: answers can only be"
            f" recorded as {nats_approver}, not as {approver}",
            param_hint="--approver",
        )
    who = f"approver {approver}" if approver else "approver named at sign-in"
    if nats_approver is not None and approver is None:
        who = f"approver named at sign-in: {nats_approver}, as its NATS credentials"

    async def run(server: ConnectionSettings) -> None:
        nc = await connect(
            server,
            name="hookbus-console",
            service=True,
            max_reconnects=max_reconnects,
            wait_for_server_s=wait_for_server_s,
        )
        client = ApprovalsClient(nc)  # the approvals bucket only
        feed = Feed(nc)
        try:
            try:
                await client.start()
                await feed.start()
            except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
                raise click.ClickException(
                    f"cannot open the approval buckets: {exc or type(exc).__name__}"
                ) from exc
            servers: list[Any] = []  # uvicorn's, once made: open event streams end with it
            app = console_app(
                client, nc, token=console_token, approver=approver,
                session_ttl_s=session_ttl_s, ping_timeout_s=ping_timeout, feed=feed,
                stopping=lambda: bool(servers) and servers[0].should_exit,
                nats_approver=nats_approver,
            )  # fmt: skip
            config = uvicorn.Config(
                app,
                log_config=None,
                access_log=log.isEnabledFor(logging.INFO),
                lifespan="on",
                timeout_graceful_shutdown=2,
                ssl_certfile=https_cert,
                ssl_keyfile=https_key,
            )
            servers.append(uvicorn.Server(config))
            try:
                config.load()
            except (OSError, ssl.SSLError) as exc:
                raise click.ClickException(f"cannot load the TLS files: {exc}") from exc
            sock = listen(host, port)
            banner = f"({who}; loop {running_loop()}); Ctrl-C stops it"
            http = servers[0]
            async with nats_lost(nc, server.url or LOCAL_URL, max_reconnects, http) as lost:
                await serve_announced(
                    servers[0], sock, what="console", scheme=scheme, banner=banner, path="/"
                )
            lost.check()  # NATS given up on: one line, exit 1
        finally:
            await feed.close()
            await client.close()
            if not nc.is_closed:
                await drain_or_close(nc)

    with connection_or_embedded(conn) as server:
        run_loop(run, server)
