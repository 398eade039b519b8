"""`hookbus suspensions ...`: suspensions from the terminal (approvals: `_approvals_cmd`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import SuspensionRecord, to_builtins

from ._command_support import ConnectionSettings, connection_options, with_dispatcher
from ._output import print_rows

T = TypeVar("T")


def _with_dispatcher(conn: ConnectionSettings, fn: Callable[[HookDispatcher], Awaitable[T]]) -> T:
    return with_dispatcher(conn, fn, name="hookbus-suspensions")


agent_option = click.option(
    "--agent",
    envvar="HOOKBUS_AGENT_ID",
    default=None,
    help="The agent whose suspension it is (records are per agent; env HOOKBUS_AGENT_ID; "
    "default: the suspensions of calls without an agent id).",
)


async def _require(d: HookDispatcher, label: str, agent: str | None) -> SuspensionRecord:
    entry = await d.suspensions.for_agent(agent).records.read(label)
    if entry is None:
        raise click.ClickException(
            f"no suspension with label {label!r} (see `hookbus suspensions list`)"
        )
    if entry.record is None:
        raise click.ClickException(
            f"the record of {label!r} is malformed ({entry.problem}); replace it with"
            f" `hookbus suspensions resolve --preregister` or remove it with"
            f" `hookbus suspensions clear`"
        )
    return entry.record


def _state(r: SuspensionRecord) -> str:
    if r.status == "resolved":
        return (
            "resolved, consumed"
            if r.consumed
            else ("pre-registered" if r.preregistered else "resolved")
        )
    if r.status == "pending":
        return "pending" if r.attached else "pending (no waiter)"
    return "cancelled"


@click.group(invoke_without_command=True)
@click.pass_context
@connection_options
def suspensions(ctx: click.Context, conn: ConnectionSettings) -> None:
    """Durable suspensions (runs paused on a label): list, show, resolve, cancel and clear
    them by label. Without a command: list. The connection options go here or after the
    command."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(suspensions_list, conn=conn)


_HEADERS = ("agent", "label", "state", "hook id", "run", "metadata")


@suspensions.command("list")
@connection_options
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--status",
    type=click.Choice(["pending", "resolved", "cancelled"]),
    default=None,
    help="Only records in this state.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many.")
@click.option("--after", default=None, help="The cursor a previous page printed.")
def suspensions_list(
    conn: ConnectionSettings,
    as_json: bool,
    status: str | None,
    limit: int | None,
    after: str | None,
) -> None:
    """Suspension records, oldest first: agent, label, state, hook id, run, metadata.
    Malformed records are skipped and counted."""
    page = _with_dispatcher(
        conn,
        lambda d: d.suspensions.page(status=status, limit=limit, after=after),  # type: ignore[arg-type]
    )
    records = page.records
    if page.skipped:
        click.echo(
            f"skipped {page.skipped} malformed record(s): "
            + ", ".join(repr(k) for k in page.skipped_keys[:10]),
            err=True,
        )
    if as_json:
        click.echo(json.dumps([to_builtins(r) for r in records], indent=2))
        if page.next is not None:
            click.echo(f"more: --after '{page.next}'", err=True)
        return
    caption = f"more: --after '{page.next}'" if page.next is not None else None
    rows = [
        (r.agent_id or "", r.label, _state(r), r.hook_id[:12], r.run_id or "",
         json.dumps(r.metadata)[:80])
        for r in records
    ]  # fmt: skip
    print_rows("suspensions", _HEADERS, rows, ids=2, caption=caption)


@suspensions.command("show")
@click.argument("label")
@connection_options
@agent_option
def suspensions_show(label: str, conn: ConnectionSettings, agent: str | None) -> None:
    """One suspension record, whole, as JSON."""
    record = _with_dispatcher(conn, lambda d: _require(d, label, agent))
    click.echo(json.dumps(to_builtins(record), indent=2))


@suspensions.command("resolve")
@click.argument("label")
@click.argument("value", metavar="JSON")
@connection_options
@click.option(
    "--preregister",
    is_flag=True,
    help="Store the resolution even if no suspension with this label exists yet.",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Replace a resolution no waiter consumed yet (e.g. one its waiter refused).",
)
@agent_option
def suspensions_resolve(
    label: str,
    value: str,
    conn: ConnectionSettings,
    preregister: bool,
    replace: bool,
    agent: str | None,
) -> None:
    """Resolve LABEL with a JSON value (checked against the suspension's payload schema)."""
    try:
        data: Any = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(
            f"value is not valid JSON: {exc.msg} at column {exc.colno}"
        ) from exc

    async def resolve(d: HookDispatcher) -> None:
        if not preregister:
            await _require(d, label, agent)
        await d.suspensions.for_agent(agent).resolve_hook(label, data, replace=replace)

    _with_dispatcher(conn, resolve)
    click.echo(f"resolved {label}")


@suspensions.command("cancel")
@click.argument("label")
@connection_options
@click.option("--reason", default=None, help="Why (the waiter's error says it).")
@agent_option
def suspensions_cancel(
    label: str, conn: ConnectionSettings, reason: str | None, agent: str | None
) -> None:
    """Cancel the pending suspension LABEL: its waiter raises SuspensionCancelledError."""
    _with_dispatcher(
        conn, lambda d: d.suspensions.for_agent(agent).cancel_hook(label, reason=reason)
    )
    click.echo(f"cancelled {label}")


@suspensions.command("clear")
@click.argument("label")
@connection_options
@agent_option
def suspensions_clear(label: str, conn: ConnectionSettings, agent: str | None) -> None:
    """Remove a resolution of LABEL that no waiter consumed (a pre-registered value is
    deleted; a resolved pending suspension waits again) or a malformed record."""
    cleared = _with_dispatcher(conn, lambda d: d.suspensions.for_agent(agent).clear_hook(label))
    if not cleared:
        raise click.ClickException(f"{label!r} holds no unconsumed resolution to clear")
    click.echo(f"cleared {label}")
