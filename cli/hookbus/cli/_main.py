"""The `hookbus` command (click)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig

from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.dispatcher._kv import open_bucket
from hookbus.schemas import (
    STANDARD_EVENTS,
    HookbusError,
    handlers_bucket_config,
    to_builtins,
)
from hookbus.workers import HookWorker

from ._approvals_cmd import approvals
from ._auth import auth
from ._claude_code_cmd import claude_code
from ._console_cmd import console
from ._common import (
    DURATION,
    ConnectionSettings,
    bucket_replicas_option,
    connect,
    connection_options,
    connection_or_embedded,
    drain_or_close,
    grace_period_option,
    load_object,
    parse_json_object,
    setup_logging,
    strict_buckets_option,
)
from ._contract_cmd import asyncapi, schema
from ._decisions_cmd import audit_options, decisions
from ._gateway_cmd import gateway
from ._handlers_cmd import handlers
from ._hooks_cmd import hooks
from ._otel import otel_session, otlp_option, print_denied_trace
from ._server import EmbeddedNatsServer

__all__ = ["cli", "main"]

T = TypeVar("T")


@click.group()
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Logging level.",
)
@click.version_option(package_name="hookbus")
def cli(log_level: str) -> None:
    """hookbus: a distributed hook dispatcher for AI agent fleets, on NATS."""
    setup_logging(log_level)


@cli.command()
@click.option(
    "--port",
    type=int,
    default=None,
    help="Client port (default 4222; -1: any free port; with --config: the config's).",
)
@click.option(
    "--data-dir",
    default=".hookbus/nats",
    show_default=True,
    type=click.Path(file_okay=False),
    help="JetStream store (kept across runs); with --config: the log and ports file only.",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="A nats-server config (e.g. `hookbus auth init`'s server.conf): auth, TLS, listen.",
)
def server(port: int | None, data_dir: str, config: str | None) -> None:
    """Run nats-server (JetStream on) in the foreground: with --config, as configured;
    without, the development server: open (no auth) and on loopback only."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # before the server starts: a SIGTERM at any point stops it (never orphaned)
    signal.signal(signal.SIGTERM, interrupt)
    if config:
        srv = EmbeddedNatsServer(data_dir, port=port, config=config)
    else:
        click.echo(
            "development server: open (no auth: any local process may connect) and on"
            " loopback (127.0.0.1) only; for auth: `hookbus auth init`, then"
            " `hookbus server --config`",
            err=True,
        )
        srv = EmbeddedNatsServer(data_dir, port=4222 if port is None else port)
    try:
        url = srv.start()
        where = f"log in {srv.log_file}" if config else f"data in {data_dir}"
        label = f"with {config}" if config else "with JetStream"
        click.echo(f"nats-server {label} at {url}; {where}; Ctrl-C stops it")
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()


@cli.command()
@click.argument("target", metavar="MODULE:ATTR")
@connection_options
@otlp_option
@click.option(
    "--max-concurrency",
    default=256,
    show_default=True,
    help="Requests handled at once by this process; more are refused 'busy' at once.",
)
@grace_period_option
@bucket_replicas_option
@strict_buckets_option
@click.option(
    "--replace",
    is_flag=True,
    help="Take over handler names already declared with other settings (else refused).",
)
def worker(
    target: str,
    conn: ConnectionSettings,
    otlp_endpoint: str | None,
    max_concurrency: int,
    grace_s: float,
    bucket_replicas: int,
    strict_buckets: bool,
    replace: bool,
) -> None:
    """Serve the HookWorker at MODULE:ATTR (or path/to/file.py:ATTR) until SIGTERM/SIGINT,
    then drain within the grace period: every request received is answered (a result, or
    a retryable 'unavailable' for what could not finish)."""
    obj = load_object(target)
    if not isinstance(obj, HookWorker):
        raise click.BadParameter(f"{target} is a {type(obj).__name__}, not a HookWorker")
    obj.max_concurrency = max_concurrency
    obj.replace = obj.replace or replace

    async def run(server: ConnectionSettings) -> None:
        nc = await connect(server, name=f"hookbus-worker {target}", service=True)
        try:
            await _ensure_bucket(
                nc, handlers_bucket_config(replicas=bucket_replicas), strict=strict_buckets
            )
            _on_signals(lambda: obj.shutdown(grace_s=grace_s))
            try:
                await obj.run(nc)
            except HookbusError as exc:  # a conflicting declaration, the registry unavailable
                raise click.ClickException(str(exc)) from exc
        finally:
            await drain_or_close(nc)

    with (
        connection_or_embedded(conn) as server,
        otel_session(
            "hookbus-worker", otlp_endpoint, resource_attributes={"hookbus.worker.target": target}
        ),
    ):
        _run(run(server))


@cli.command("dispatcher")
@connection_options
@otlp_option
@click.option(
    "--max-concurrency",
    default=512,
    show_default=True,
    help="Emit requests served at once by this replica; more are refused 'busy' at once.",
)
@grace_period_option
@bucket_replicas_option
@click.option(
    "--suspension-ttl",
    "suspension_ttl_s",
    envvar="HOOKBUS_SUSPENSION_TTL",
    type=DURATION,
    default="7d",
    show_default=True,
    help="How long a suspension record lives after its last write (env HOOKBUS_SUSPENSION_TTL).",
)
@click.option(
    "--approval-ttl",
    "approval_ttl_s",
    envvar="HOOKBUS_APPROVAL_TTL",
    type=DURATION,
    default="24h",
    show_default=True,
    help='How long an "Allow always" grant lives (env HOOKBUS_APPROVAL_TTL).',
)
@strict_buckets_option
@audit_options
def dispatcher_cmd(
    conn: ConnectionSettings,
    otlp_endpoint: str | None,
    max_concurrency: int,
    grace_s: float,
    bucket_replicas: int,
    suspension_ttl_s: float,
    approval_ttl_s: float,
    strict_buckets: bool,
    audit: bool,
    audit_max_age_s: float,
    audit_max_bytes: int,
) -> None:
    """Serve emit / emit_and_collect on hookbus.v1.emit.<event> and
    hookbus.v1.emit_and_collect.<event> (queue group hookbus-dispatcher). SIGTERM/SIGINT
    drain within the grace period: intake stops at once, requests in flight finish, then
    approval waits are aborted (left pending: the agent's retry with the same idempotency
    key resumes them) and whatever is left is answered with a retryable 'unavailable'."""

    async def run(server: ConnectionSettings) -> None:
        nc = await connect(server, name="hookbus-dispatcher", service=True)
        dispatcher = HookDispatcher(
            nc,
            strict_events=True,
            bucket_replicas=bucket_replicas,
            suspension_ttl_s=suspension_ttl_s,
            approval_ttl_s=approval_ttl_s,
            strict_buckets=strict_buckets,
            audit=audit,
            audit_max_age_s=audit_max_age_s,
            audit_max_bytes=audit_max_bytes,
        )
        service = DispatcherService(
            dispatcher, nc, max_concurrency=max_concurrency, grace_s=grace_s
        )
        _on_signals(service.stop)
        try:
            try:
                await service.start()
            except HookbusError as exc:  # a bucket that differs (strict), JetStream down
                raise click.ClickException(str(exc)) from exc
            click.echo("dispatcher serving hookbus.v1.emit.* (Ctrl-C drains and stops)", err=True)
            await service.run()
        finally:
            await drain_or_close(nc)

    with connection_or_embedded(conn) as server, otel_session("hookbus-dispatcher", otlp_endpoint):
        _run(run(server))


@cli.command()
@click.argument("event")
@click.argument("data", default="{}", metavar="JSON")
@connection_options
@click.option("--collect", is_flag=True, help="emit_and_collect instead of emit.")
@click.option("--timeout", default=1.0, show_default=True, help="emit_and_collect timeout, s.")
@click.option(
    "--allow-unknown",
    is_flag=True,
    help="Emit even if the event is neither standard nor has a declared handler.",
)
def emit(
    event: str,
    data: str,
    conn: ConnectionSettings,
    collect: bool,
    timeout: float,
    allow_unknown: bool,
) -> None:
    """Emit EVENT with JSON data through a dispatcher in this process; print the result."""
    payload = parse_json_object(data, what="JSON data")

    async def run(server: ConnectionSettings) -> None:
        nc = await connect(server, name="hookbus-emit")
        try:
            async with HookDispatcher(nc, strict_events=not allow_unknown) as d:
                if collect:
                    out = await d.emit_and_collect(event, payload, timeout)
                else:
                    result = await d.emit(event, payload)
                    out = to_builtins(result)
            click.echo(json.dumps(out, indent=2))
        finally:
            await nc.close()

    with connection_or_embedded(conn) as server:
        try:
            _run(run(server))
        except HookbusError as exc:
            known = sorted(STANDARD_EVENTS)
            raise click.ClickException(f"{exc} (standard events: {', '.join(known)})") from exc


def _demo_agents_option(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    """``hookbus demo --agents``: see `parse_agents` (imported only when used)."""
    from ._demo_agents import parse_agents

    return parse_agents(ctx, param, value)


@cli.command()
@connection_options
@click.option(
    "--examples-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="Folder with the example workers and transcript (default: ./examples, "
    "else the one beside this installation's sources).",
)
@click.option("--interactive", is_flag=True, help="Answer approvals in the terminal.")
@click.option(
    "--secure",
    is_flag=True,
    help="Run every process as its own identity from the --auth folder (made with "
    "`hookbus auth init --demo`): workers, approver and agents with their roles' "
    "credentials; the server is --url, else the folder's.",
)
@click.option(
    "--auth",
    "auth_dir",
    envvar="HOOKBUS_AUTH_DIR",
    default="auth",
    show_default=True,
    type=click.Path(file_okay=False),
    help="With --secure: the folder `hookbus auth init` wrote (env HOOKBUS_AUTH_DIR).",
)
@click.option(
    "--agents",
    "agents",
    metavar="NAMES",
    default="",
    callback=_demo_agents_option,
    help="Then also run these framework agents (comma-separated) against the same workers "
    "and approver, with scripted models: pydantic-ai (examples/pydantic_ai_agent.py; needs "
    "hookbus[pydantic-ai]), ai (examples/ai_agent.py on a Python >= 3.12, see --ai-python).",
)
@click.option(
    "--ai-python",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --agents ai: a Python >= 3.12 with hookbus and its ai extra (default: "
    "the venv the ai test builds, ~/.cache/hookbus/venv-py312-*, else $HOOKBUS_PY312, if it"
    " has them).",
)
@click.option(
    "--via",
    type=click.Choice(["direct", "aos"]),
    default="direct",
    show_default=True,
    help="direct: each agent emits its steps; aos: each step is sent as an OWASP AOS "
    "JSON-RPC request through the AOS guardian door (in process, the agent's dispatcher), "
    "and a second table shows each AOS decision.",
)
@otlp_option
def demo(
    conn: ConnectionSettings,
    examples_dir: str | None,
    interactive: bool,
    secure: bool,
    auth_dir: str,
    agents: tuple[str, ...],
    ai_python: str | None,
    via: str,
    otlp_endpoint: str | None,
) -> None:
    """Run a fleet of agents whose tool calls are decided by remote hook workers; print the
    decision table; exit 1 if any decision differs from the transcript's expectation."""
    from ._demo import demo_main, find_examples_dir, secure_credentials

    folder = Path(examples_dir) if examples_dir else find_examples_dir()
    if otlp_endpoint:  # worker processes the demo starts export there too
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    with otel_session("hookbus-demo", otlp_endpoint, keep_spans=True) as otel:
        if secure:
            credentials = secure_credentials(Path(auth_dir), conn.url)
            target = credentials("admin", "admin")
            click.echo(f"secure demo: every process as its own identity from {auth_dir}/"
                       f" at {target.url}", err=True)  # fmt: skip
            code = _run(demo_main(target, folder, interactive=interactive, credentials=credentials,
                                  agents=agents, ai_python=ai_python, via=via))  # fmt: skip
        else:
            with connection_or_embedded(conn) as server:
                code = _run(demo_main(server, folder, interactive=interactive, agents=agents,
                                      ai_python=ai_python, via=via))  # fmt: skip
        print_denied_trace(otel)
    sys.exit(code)


cli.add_command(handlers)
cli.add_command(hooks)
cli.add_command(approvals)
cli.add_command(decisions)
cli.add_command(auth)
cli.add_command(gateway)
cli.add_command(claude_code)
cli.add_command(console)
cli.add_command(schema)
cli.add_command(asyncapi)


def _on_signals(stop: Callable[[], Awaitable[None]]) -> None:
    """Run `stop()` once on the first SIGTERM or SIGINT (later ones change nothing)."""
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Future[None]] = []

    def on_signal() -> None:
        if not stopping:
            stopping.append(asyncio.ensure_future(stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)


async def _ensure_bucket(nc: NATS, config: KeyValueConfig, *, strict: bool) -> None:
    """Create `config`'s bucket as asked, or report it if it exists with another config.

    Raises:
        click.ClickException: `strict` and the bucket differs, or JetStream is unavailable.
    """
    try:
        await open_bucket(nc, config, strict=strict)
    except HookbusError as exc:
        raise click.ClickException(str(exc)) from exc


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on asyncio (nats-py's backend) through anyio."""

    async def runner() -> T:
        return await coro

    return anyio.run(runner, backend="asyncio")


def main() -> None:
    cli(prog_name="hookbus")


if __name__ == "__main__":
    main()
