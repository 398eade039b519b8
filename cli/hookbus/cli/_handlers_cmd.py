"""`hookbus handlers ...`: the handler registry, live replicas and required handlers;
`hookbus services`: every live hookbus service on the NATS services API (workers and
dispatcher services), as ``nats micro ls`` would list them, with the dispatchers' request
counts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict as data_asdict
from typing import Any, TypeVar

import anyio
import click
import nats.errors
import nats.js.errors
from msgspec.structs import asdict
from nats.aio.client import Client as NATS
from rich.table import Table

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.jetstream import existing_key_value
from hookbus.dispatcher import (
    DispatcherReplica,
    HandlerStatus,
    LiveReplica,
    RegistryView,
    describe_handlers,
    live_dispatchers,
    live_handlers,
    require_handler,
    unrequire_handler,
)
from hookbus.schemas import (
    DISPATCHER_SERVICE_NAME,
    WORKER_SERVICE_NAME,
    HookbusError,
    handler_key,
    to_builtins,
)

from ._command_support import (
    ConnectionSettings,
    FiniteFloatRange,
    connect,
    connection_options,
    connection_or_embedded,
)
from ._output import id_column, table_console

__all__ = ["handlers", "services"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _with_connection(conn: ConnectionSettings, what: str, fn: Callable[[NATS], Awaitable[T]]) -> T:
    """Run `fn` on a fresh connection; any registry failure is one clear error line."""

    async def run(server: ConnectionSettings) -> T:
        nc = await connect(server, name="hookbus-handlers")
        try:
            return await fn(nc)
        finally:
            await nc.close()

    with connection_or_embedded(conn) as server:
        try:
            return anyio.run(run, server, backend="asyncio")
        except (HookbusError, nats.errors.Error) as exc:
            detail = str(exc) or type(exc).__name__
            raise click.ClickException(f"cannot {what}: {detail}") from exc


def _row_json(h: HandlerStatus) -> dict[str, Any]:
    out: dict[str, Any] = (
        to_builtins(asdict(h.declaration)) if h.declaration else {"event": h.event, "name": h.name}
    )
    out["declared"] = h.declaration is not None
    out["required"] = to_builtins(asdict(h.required)) if h.required else None
    out["replicas"] = [r.service_id for r in h.replicas]
    out["last_seen"] = h.last_seen
    return out


def _age(at: float | None) -> str:
    return "-" if at is None else f"{max(0.0, time.time() - at):.1f} s ago"


_json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON instead of a table."
)


def _ping_timeout_option(answers: str) -> Callable[[F], F]:
    """``--ping-timeout``: seconds (0.05 to 10, default 0.5) to gather `answers`."""
    return click.option(
        "--ping-timeout",
        default=0.5,
        show_default=True,
        type=FiniteFloatRange(min=0.05, max=10),
        help=f"Seconds to gather {answers}.",
    )


@click.group(invoke_without_command=True)
@connection_options
@click.option("--event", default=None, help="Only this event.")
@click.option(
    "--remove",
    "remove",
    nargs=2,
    default=None,
    metavar="EVENT NAME",
    help="Delete a handler's declaration from the registry.",
)
@_json_option
@_ping_timeout_option("the live workers' answers ($SRV.PING)")
@click.pass_context
def handlers(
    ctx: click.Context,
    conn: ConnectionSettings,
    event: str | None,
    remove: tuple[str, str] | None,
    as_json: bool,
    ping_timeout: float,
) -> None:
    """List the handlers declared or required in the registry bucket, in call order, with
    their live replicas (workers answering the NATS services API) and when last seen."""
    if ctx.invoked_subcommand is not None:
        return

    async def run(nc: NATS) -> tuple[RegistryView, list[DispatcherReplica]]:
        if remove:
            kv = await existing_key_value(nc, handlers_bucket_config().bucket)
            try:
                await kv.get(handler_key(*remove))
            except nats.js.errors.KeyNotFoundError:
                raise click.ClickException(f"no handler {remove[1]!r} for {remove[0]!r}") from None
            await kv.delete(handler_key(*remove))
            click.echo(f"removed {remove[1]} from {remove[0]}")
        return await asyncio.gather(
            describe_handlers(nc, ping_timeout_s=ping_timeout),
            live_dispatchers(nc, timeout_s=ping_timeout),
        )

    view, dispatchers = _with_connection(conn, "read the handler registry", run)
    for key, reason in view.rejected.items():
        click.echo(f"skipped bad record at {key!r}: {reason}", err=True)
    rows = [h for h in view.handlers if event in (None, h.event)]
    if as_json:
        click.echo(json.dumps([_row_json(h) for h in rows], indent=2))
        return
    table = Table(title="handlers")
    id_column(table, "event")
    table.add_column("priority")
    id_column(table, "handler")
    for header in ("tool filter", "timeout s", "policy", "parallel", "required", "replicas"):
        table.add_column(header)
    table.add_column("last seen")
    for h in rows:
        d, req = h.declaration, h.required
        src = d or req
        assert src is not None
        table.add_row(
            h.event,
            str(src.priority),
            h.name,
            ",".join(src.tool_filter or ["*"]),
            f"{src.timeout_s:g}",
            src.failure_policy,
            "yes" if d is not None and d.parallel else "",
            ("yes" if d else "yes, NOT DECLARED") if req else "",
            str(len(h.replicas)),
            _age(h.last_seen),
        )
    table_console().print(table)
    for ev, name in view.live_only:
        if event in (None, ev):
            click.echo(f"served but not declared: {name} ({ev})", err=True)
    ids = " ".join(d.service_id for d in dispatchers)
    click.echo(
        f"dispatcher services: {len(dispatchers)} live{f' ({ids})' if ids else ''};"
        " `hookbus services` shows their endpoints and requests",
        err=True,
    )


def _workers_by_instance(
    live: dict[tuple[str, str], list[LiveReplica]],
) -> list[dict[str, Any]]:
    """The live workers, one per instance, with the handlers each serves."""
    out: dict[str, dict[str, Any]] = {}
    for (ev, name), replicas in sorted(live.items()):
        for r in replicas:
            entry = out.setdefault(
                r.service_id,
                {"service_id": r.service_id, "handlers": [], "metadata": r.metadata},
            )
            entry["handlers"].append({"event": ev, "name": name})
    return [out[k] for k in sorted(out)]


def _dispatcher_json(d: DispatcherReplica) -> dict[str, Any]:
    out = data_asdict(d)
    out["name"] = DISPATCHER_SERVICE_NAME
    return out


@click.command("services")
@connection_options
@_json_option
@_ping_timeout_option("the services' answers ($SRV.PING / $SRV.STATS)")
def services(conn: ConnectionSettings, as_json: bool, ping_timeout: float) -> None:
    """List the live hookbus services of the NATS services API, as `nats micro ls` does:
    each dispatcher service replica (hookbus-dispatcher) with its endpoints (emit,
    emit_and_collect) and, per endpoint, the requests received, the error replies, the
    mean processing time in ms and the requests in flight; each worker process
    (hookbus-worker) with the handlers it serves."""

    async def run(nc: NATS) -> tuple[list[DispatcherReplica], list[dict[str, Any]]]:
        dispatchers, live = await asyncio.gather(
            live_dispatchers(nc, timeout_s=ping_timeout),
            live_handlers(nc, timeout_s=ping_timeout),
        )
        return dispatchers, _workers_by_instance(live)

    dispatchers, workers = _with_connection(conn, "ask the services API", run)
    if as_json:
        body = {
            "dispatchers": [_dispatcher_json(d) for d in dispatchers],
            "workers": [{"name": WORKER_SERVICE_NAME, **w} for w in workers],
        }
        click.echo(json.dumps(body, indent=2))
        return
    table = Table(title="hookbus services")
    table.add_column("service")
    id_column(table, "id")
    table.add_column("version")
    id_column(table, "endpoint / handlers")
    for header in ("requests", "errors", "avg ms", "in flight"):
        table.add_column(header, justify="right")
    for d in dispatchers:
        for e in d.endpoints:
            in_flight = e.data.get("in_flight")
            table.add_row(
                DISPATCHER_SERVICE_NAME, d.service_id, d.version, f"{e.name} {e.subject}",
                str(e.requests), str(e.errors), f"{e.average_ms:.1f}",
                "-" if in_flight is None else str(in_flight),
            )  # fmt: skip
    for w in workers:
        served = " ".join(f"{h['name']} ({h['event']})" for h in w["handlers"])
        table.add_row(WORKER_SERVICE_NAME, w["service_id"], "", served, "", "", "", "")
    table_console().print(table)
    click.echo(f"{len(dispatchers)} dispatcher service(s), {len(workers)} worker(s)", err=True)


@handlers.command("require")
@click.argument("event")
@click.argument("name")
@connection_options
@click.option(
    "--failure-policy",
    type=click.Choice(["deny", "ignore"]),
    default="deny",
    show_default=True,
    help="What an emit does while the handler has no declaration or no live replica.",
)
@click.option("--priority", default=0, show_default=True, help="Its place in the call order.")
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteFloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds per call.",
)
@click.option(
    "--tool-filter", multiple=True, help="Glob over tool_name (repeatable); default: every call."
)
def require(
    event: str,
    name: str,
    conn: ConnectionSettings,
    failure_policy: str,
    priority: int,
    timeout_s: float,
    tool_filter: tuple[str, ...],
) -> None:
    """Mark handler NAME as required for EVENT: while it is absent, emits of EVENT are
    decided by its failure policy (deny by default), never a silent continue."""

    async def run(nc: NATS) -> None:
        await require_handler(
            nc,
            event,
            name,
            failure_policy="deny" if failure_policy == "deny" else "ignore",
            priority=priority,
            timeout_s=timeout_s,
            tool_filter=list(tool_filter) or None,
        )

    _with_connection(conn, "store the requirement", run)
    click.echo(f"{event} now requires {name} (failure policy {failure_policy})")


@handlers.command("unrequire")
@click.argument("event")
@click.argument("name")
@connection_options
def unrequire(event: str, name: str, conn: ConnectionSettings) -> None:
    """Remove the requirement of handler NAME for EVENT."""

    async def run(nc: NATS) -> bool:
        return await unrequire_handler(nc, event, name)

    if not _with_connection(conn, "remove the requirement", run):
        raise click.ClickException(f"{event} does not require {name}")
    click.echo(f"{event} no longer requires {name}")
