"""`hookbus approvals ...`: pending approvals, and "Allow always" grants, from the terminal."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
import click
from rich.table import Table

from hookbus.dispatcher import ApprovalsClient
from hookbus.schemas import (
    ApprovalGrant,
    HookbusError,
    NotPermittedError,
    SuspensionRecord,
    grant_key,
    to_builtins,
)

from ._command_support import (
    ConnectionSettings,
    close_quietly,
    connect,
    connection_options,
    connection_or_embedded,
)
from ._connect import auth_identity
from ._output import id_column, is_short_id, short_id, table_console

T = TypeVar("T")


def _with_approvals(conn: ConnectionSettings, fn: Callable[[ApprovalsClient], Awaitable[T]]) -> T:
    """Run ``fn(approvals)`` on an `ApprovalsClient` (the approvals bucket only: no registry
    watch, no request inboxes) connected as client ``hookbus-approvals`` with `conn` (no URL:
    `LOCAL_URL` if a server answers there; ``--embedded``: a private server for this call).

    Raises:
        click.ClickException: a hookbus error, as one line (a refusal says which
            credentials answer).
    """

    async def run(server: ConnectionSettings) -> T:
        nc = await connect(server, name="hookbus-approvals")
        try:
            async with ApprovalsClient(nc) as approvals:
                return await fn(approvals)
        finally:
            await close_quietly(nc)

    try:
        with connection_or_embedded(conn) as server:
            try:
                return anyio.run(run, server, backend="asyncio")
            except HookbusError as exc:
                raise click.ClickException(str(exc)) from exc
    except click.ClickException as exc:
        refusal = exc.__cause__
        if not isinstance(refusal, NotPermittedError) or ".STREAM.CREATE." in refusal.subject:
            raise  # not a refusal, or a bucket for the admin to make: said as it is
        me = auth_identity(conn)
        if me is not None and me.role in ("approver", "admin"):
            raise
        raise click.ClickException(
            f"{exc.message} (approvals are listed and answered with an approver's NATS"
            " credentials: `hookbus auth add approver NAME`, then --nkey its seed)"
        ) from exc.__cause__


_json_option = click.option(
    "--json", "as_json", is_flag=True, help="One JSON array instead of a table."
)


@click.group(invoke_without_command=True)
@click.pass_context
@connection_options
@_json_option
def approvals(ctx: click.Context, conn: ConnectionSettings, as_json: bool) -> None:
    """Pending approvals (ask_user results): list them, `answer LABEL CHOICE`, `cancel
    LABEL`; "Allow always" grants: `grants`, `revoke`."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(approvals_list, conn=conn, as_json=as_json)


async def _pending_approvals(approvals: ApprovalsClient) -> list[SuspensionRecord]:
    return await approvals.pending_approvals()


def _status(r: SuspensionRecord) -> str:
    """``pending``, ``expired`` (closed by its own timeout, its default applied),
    ``cancelled`` or ``resolved``."""
    if r.status == "cancelled" and (r.reason or "").startswith("timed out after "):
        return "expired"
    return r.status


async def _listed(approvals: ApprovalsClient) -> list[SuspensionRecord]:
    """The approvals ended now (nobody waited past their timeout), then the pending ones."""
    ended = await approvals.end_overdue()
    return ended + await approvals.pending_approvals()


@approvals.command("list")
@connection_options
@_json_option
def approvals_list(conn: ConnectionSettings, as_json: bool) -> None:
    """Pending approvals with prompt, options, handler and tool. `answer` and `cancel`
    take the label or the id beside it (8 characters, the same on every run). An approval
    nobody waited for past its timeout is ended as it is listed (its default applied) and
    shown once more with status "expired"."""
    records = _with_approvals(conn, _listed)
    if as_json:
        rows = [{"id": short_id(r.label), **to_builtins(r), "state": _status(r)}
                for r in records]  # fmt: skip
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="pending approvals")
    table.add_column("id", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for header in ("label", "prompt", "options", "handler", "tool", "agent", "session", "default"):
        id_column(table, header)  # what you copy, and what you decide on: never cut
    for r in records:
        m = r.metadata
        table.add_row(
            short_id(r.label),
            _status(r),
            r.label,
            str(m.get("prompt", "")),
            " / ".join(str(o) for o in m.get("options", []) or []),
            str(m.get("handler", "")),
            str(m.get("tool_name") or ""),
            str(m.get("agent_id") or ""),
            str(m.get("session_id") or ""),
            str(m.get("default", "")),
        )
    table_console().print(table)


def _check_approver(conn: ConnectionSettings, approver: str | None) -> str | None:
    """The approver name to act as: `approver`, else (None) the name of these credentials
    when they are an approver's, else None.

    Raises:
        click.ClickException: the credentials are another approver's.
    """
    me = auth_identity(conn)
    if me is None or me.role != "approver":
        return approver
    if approver is not None and me.name != approver:
        raise click.ClickException(
            f"these NATS credentials are approver {me.name} ({me.public_key}): they answer"
            f" as {me.name} only, not as {approver} (give --approver {me.name})"
        )
    return me.name


_APPROVER_HELP = (
    "Your approver name (env HOOKBUS_APPROVER): on a secured server, the name your NATS user"
    " may answer as (`hookbus auth add approver NAME`); it is recorded as who answered."
)


@approvals.command("answer")
@click.argument("label", metavar="LABEL|ID")
@click.argument("choice")
@click.option(
    "--approver",
    envvar="HOOKBUS_APPROVER",
    required=True,
    help=_APPROVER_HELP,
)
@click.option("--agent", default=None, help="The agent whose approval it is (default: found).")
@connection_options
def approvals_answer(
    label: str, choice: str, approver: str, agent: str | None, conn: ConnectionSettings
) -> None:
    """Answer the approval LABEL (or the ID `hookbus approvals` prints beside it) with one
    of its options (e.g. "Allow always": it then allows every input of that tool for that
    agent and session until revoked)."""
    _check_approver(conn, approver)

    async def answer(d: ApprovalsClient) -> str:
        record = await _one_pending(d, label, agent)
        await d.answer_approval(record.label, choice, approver=approver, agent_id=record.agent_id)
        return record.label

    answered = _with_approvals(conn, answer)
    click.echo(f"answered {answered}: {choice} (as {approver})")


async def _one_pending(d: ApprovalsClient, label: str, agent: str | None) -> SuspensionRecord:
    """The pending approval `label` (or id) names, of `agent` if given.

    Raises:
        click.ClickException: none, or several agents have one.
    """
    by_id = is_short_id(label)
    found = [r for r in await _pending_approvals(d)
             if r.label == label or (by_id and short_id(r.label) == label)]  # fmt: skip
    if agent is not None:
        found = [r for r in found if r.agent_id == agent]
    if not found:
        raise click.ClickException(f"no pending approval {label!r} (see `hookbus approvals`)")
    if len({(r.label, r.agent_id) for r in found}) > 1:
        raise click.ClickException(
            f"approval {label!r} is pending for several agents; pick one with --agent"
        )
    return found[0]


@approvals.command("cancel")
@click.argument("label", metavar="LABEL|ID")
@click.option(
    "--reason", default=None, help='Why (default "cancelled by hand"); the asker denies with it.'
)
@click.option(
    "--approver",
    envvar="HOOKBUS_APPROVER",
    default=None,
    help=_APPROVER_HELP.replace("answer as", "cancel as").replace("answered", "cancelled")
    + " Default: the name of an approver's credentials; none: the record is written"
    " directly (the admin's or the dispatcher service's credentials).",
)
@click.option("--agent", default=None, help="The agent whose approval it is (default: found).")
@connection_options
def approvals_cancel(
    label: str, reason: str | None, approver: str | None, agent: str | None,
    conn: ConnectionSettings,
) -> None:  # fmt: skip
    """End the pending approval LABEL (or the ID `hookbus approvals` prints beside it)
    without an answer: the call waiting on it, or a retry of it, is denied ("approval
    cancelled: REASON"). As an approver (--approver, or an approver's credentials) the
    cancel is that approver's proof, which the deciding dispatcher applies: the reason is
    then "by APPROVER: REASON". Without one it writes the approval record: on a secured
    server, the admin's credentials (or the dispatcher service's)."""
    who = _check_approver(conn, approver)
    why = reason if who is not None else reason or "cancelled by hand"

    async def cancel(d: ApprovalsClient) -> str:
        record = await _one_pending(d, label, agent)
        await d.cancel_approval(record.label, reason=why, agent_id=record.agent_id, approver=who)
        return record.label

    cancelled = _with_approvals(conn, cancel)
    shown = why if who is None else f"by {who}" + (f": {why}" if why else "")
    click.echo(f"cancelled {cancelled}: {shown}")


_GRANT_FILTERS = {"agent": "agent_id", "session": "session_id", "event": "event",
                  "handler": "handler", "tool": "tool"}  # fmt: skip
"""Each grant filter option: the keyword of `ApprovalsClient.approval_grants` it is."""


def _filters(f: Callable[..., None]) -> Callable[..., None]:
    """The grant filters ``--agent``, ``--session``, ``--event``, ``--handler``, ``--tool``,
    given to the command as one keyword argument, ``filters``: those given, as
    `ApprovalsClient.approval_grants` takes them."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        given = {_GRANT_FILTERS[name]: kwargs.pop(name) for name in _GRANT_FILTERS}
        f(*args, filters={k: v for k, v in given.items() if v is not None}, **kwargs)

    for name, help_ in reversed(
        [
            ("--agent", "Only this agent's grants."),
            ("--session", "Only this session's grants."),
            ("--event", "Only grants asked for on this event."),
            ("--handler", "Only grants of this handler."),
            ("--tool", "Only grants of this tool."),
        ]
    ):
        wrapper = click.option(name, default=None, help=help_)(wrapper)
    return wrapper


def _key(g: ApprovalGrant) -> str:
    return grant_key(g.agent_id, g.session_id, g.event, g.handler, g.tool)


@approvals.command("grants")
@connection_options
@_filters
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON array, each grant with its key and id."
)
def approvals_grants(conn: ConnectionSettings, filters: dict[str, str], as_json: bool) -> None:
    """Live "Allow always" grants. Each allows every input of its tool, for its agent and
    session, when its handler asks on its event, until revoked or expired, while the answer
    of its approver ("approved by") to its approval still holds."""

    async def grants(d: ApprovalsClient) -> list[ApprovalGrant]:
        return await d.approval_grants(**filters)

    found = _with_approvals(conn, grants)
    if as_json:
        rows = [{"key": _key(g), "id": short_id(_key(g)), **to_builtins(g)} for g in found]
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title='"Allow always" grants')
    table.add_column("id", no_wrap=True)
    for header in ("key", "agent", "session", "event", "handler", "tool", "granted"):
        id_column(table, header)
    for header in ("expires", "by approval", "approved by"):
        id_column(table, header)
    for g in found:
        at = datetime.fromtimestamp(g.granted_at, UTC).isoformat(timespec="seconds")
        ends = (
            datetime.fromtimestamp(g.expires_at, UTC).isoformat(timespec="seconds")
            if g.expires_at is not None
            else "never: allows nothing"
        )
        table.add_row(short_id(_key(g)), _key(g), g.agent_id or "", g.session_id, g.event,
                      g.handler, g.tool or "", at, ends, g.label, g.approved_by)  # fmt: skip
    table_console().print(table)


@approvals.command("revoke")
@click.argument("keys", nargs=-1, metavar="[KEY|ID]...")
@connection_options
@_filters
@click.option("--all", "revoke_all", is_flag=True, help="Every grant the filters match.")
def approvals_revoke(
    keys: tuple[str, ...], conn: ConnectionSettings, filters: dict[str, str], revoke_all: bool
) -> None:
    """Revoke grants: by KEY or ID (as `grants` prints them), or every grant the filters
    match (at least one filter, or --all for every grant)."""
    filtered = bool(filters)
    if not keys and not filtered and not revoke_all:
        raise click.UsageError("name grant KEYs, or filters (--agent, --session, ...), or --all")
    if keys and (filtered or revoke_all):
        raise click.UsageError("give either KEYs or filters, not both")

    async def revoke(d: ApprovalsClient) -> list[str]:
        if keys:
            targets = await _keys_of(d, keys)
        else:
            targets = [_key(g) for g in await d.approval_grants(**filters)]
        for key in targets:
            await d.revoke_grant(key)
        return targets

    for key in _with_approvals(conn, revoke):
        click.echo(f"revoked {key}")


async def _keys_of(d: ApprovalsClient, given: tuple[str, ...]) -> list[str]:
    """The grant keys `given` name: a key as is, an id (`short_id`) as the key it stands for.

    Raises:
        click.ClickException: an id no live grant has.
    """
    if not any(is_short_id(k) for k in given):
        return list(given)
    by_id = {short_id(_key(g)): _key(g) for g in await d.approval_grants()}
    keys = []
    for k in given:
        if is_short_id(k):
            if k not in by_id:
                raise click.ClickException(f"no grant with id {k} (see `hookbus approvals grants`)")
            keys.append(by_id[k])
        else:
            keys.append(k)
    return keys
