"""`hookbus decisions`: read the decision audit trail (the ``hookbus_decisions`` stream).

The stream is read with an ephemeral ordered consumer, released as soon as the command is
done. ``--agent`` narrows the consumer to that agent's subject
(``hookbus.v1.decisions.<agent>``); the other filters are applied here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar, cast, get_args

import anyio
import click
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from rich.console import Console
from rich.table import Table

from hookbus._core.consumers import open_consumer
from hookbus._core.kv import release_consumer
from hookbus.schemas import (
    DECISIONS_DEFAULT_MAX_AGE_S,
    DECISIONS_DEFAULT_MAX_BYTES,
    DECISIONS_STREAM,
    DECISIONS_WILDCARD,
    Action,
    DecisionRecord,
    HookbusError,
    decisions_subject,
    decode,
    to_builtins,
)

from ._command_support import (
    DURATION,
    ConnectionSettings,
    connect,
    connection_options,
    connection_or_embedded,
)
from ._lifecycle import on_signals

__all__ = ["audit_options", "decisions", "filter_options", "latency", "read_trail"]

F = TypeVar("F", bound=Callable[..., Any])

_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


class ByteSize(click.ParamType):  # type: ignore[type-arg]
    """Bytes, as a number or with a unit: ``1073741824``, ``512MiB``, ``1GiB``, ``10GB``."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            size = value
        else:
            text = str(value).strip().lower().replace(" ", "")
            number = text.rstrip("kmgtib")
            unit = text[len(number) :]
            try:
                size = int(float(number) * _SIZE_UNITS[unit])
            except (KeyError, ValueError):
                self.fail(f"{value!r} is not a size (e.g. 1073741824, 512MiB, 1GiB)", param, ctx)
        if size <= 0:
            self.fail(f"{value!r} must be above 0 bytes", param, ctx)
        return size


def audit_options(f: F) -> F:
    """The decision audit trail options of `hookbus dispatcher`: ``--audit``,
    ``--audit-max-age``, ``--audit-max-bytes`` (keyword arguments `audit`,
    `audit_max_age_s`, `audit_max_bytes`)."""
    options = [
        click.option(
            "--audit",
            envvar="HOOKBUS_AUDIT",
            is_flag=True,
            help="Record every decision in the hookbus_decisions stream (env HOOKBUS_AUDIT=1); "
            "read it with `hookbus decisions`.",
        ),
        click.option(
            "--audit-max-age",
            "audit_max_age_s",
            envvar="HOOKBUS_AUDIT_MAX_AGE",
            type=DURATION,
            default=f"{DECISIONS_DEFAULT_MAX_AGE_S / 86400:g}d",
            show_default=True,
            help="How long the stream keeps a decision, if this dispatcher creates it "
            "(env HOOKBUS_AUDIT_MAX_AGE).",
        ),
        click.option(
            "--audit-max-bytes",
            envvar="HOOKBUS_AUDIT_MAX_BYTES",
            type=ByteSize(),
            default=f"{DECISIONS_DEFAULT_MAX_BYTES >> 30}GiB",
            show_default=True,
            help="Size past which the stream drops its oldest decisions, if this dispatcher "
            "creates it (env HOOKBUS_AUDIT_MAX_BYTES).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


class _Filters:
    """The filters of a read: the agent (the consumer's subject filter), and the session,
    action and handler, applied here (`any`, calling it)."""

    def __init__(
        self, agent: str | None, session: str | None, action: str | None, handler: str | None
    ) -> None:
        self.agent = agent
        self.session, self.action, self.handler = session, action, handler

    @property
    def any(self) -> bool:
        """Whether a filter applied here is set (the agent is not one)."""
        return any(v is not None for v in (self.session, self.action, self.handler))

    def __call__(self, r: DecisionRecord) -> bool:
        return (
            (self.session is None or r.session_id == self.session)
            and (self.action is None or r.action == self.action)
            and (
                self.handler is None
                or self.handler in r.handlers
                or self.handler == r.decided_by
                or any(f.handler == self.handler for f in r.failures)
            )
        )


def filter_options(f: F) -> F:
    """The filters of `hookbus decisions` and `hookbus tail`: ``--agent``, ``--session``,
    ``--action``, ``--handler`` (None when not given), given to the command as one `_Filters`
    keyword argument, ``filters``."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = (kwargs.pop(name) for name in ("agent", "session", "action", "handler"))
        return f(*args, filters=_Filters(*given), **kwargs)

    options = [
        click.option(
            "--agent", default=None, help="Only this agent's decisions (read by subject)."
        ),
        click.option("--session", default=None, help="Only this session's decisions."),
        click.option(
            "--action",
            type=click.Choice(get_args(Action)),
            default=None,
            help="Only this decision.",
        ),
        click.option(
            "--handler", default=None, help="Only decisions this handler took part in (called it)."
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return cast(F, wrapper)


@click.command("decisions")
@connection_options
@filter_options
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="The most recent N matching decisions (with --follow: before the new ones).",
)
@click.option(
    "--since", type=DURATION, default=None, help="Only decisions of the last 90s, 15m, 1h, 7d."
)
@click.option("--follow", is_flag=True, help="Keep printing new decisions until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def decisions(
    conn: ConnectionSettings,
    filters: _Filters,
    limit: int,
    since: float | None,
    follow: bool,
    as_json: bool,
) -> None:
    """The decision audit trail, oldest first: who decided what, for which agent, session
    and tool, with the handlers called, failures, approver and trace id. Needs a NATS user
    that may read the hookbus_decisions stream (admin, auditor)."""
    out = _Printer(as_json=as_json, follow=follow)
    read_trail(conn, "hookbus-decisions", filters, limit=limit, since=since, follow=follow, out=out)


def read_trail(
    conn: ConnectionSettings,
    name: str,
    filters: _Filters,
    *,
    limit: int,
    since: float | None,
    follow: bool,
    out: _Printer,
) -> None:
    """Print the trail's records that pass `filters` with `out` (see `_read`; `limit` 0 with
    `follow`: new records only) as the NATS client `name`. A missing stream or a hookbus error is a
    `click.ClickException` (one line, exit 1); Ctrl-C/SIGTERM end it with exit 0."""

    async def run(server: ConnectionSettings) -> int:
        nc = await connect(server, name=name)
        try:
            return await _read(
                nc, filters=filters, limit=limit, since=since, follow=follow, out=out
            )
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    with connection_or_embedded(conn) as server:
        try:
            skipped = anyio.run(run, server, backend="asyncio")
        except HookbusError as exc:
            raise click.ClickException(str(exc)) from exc
        except KeyboardInterrupt:  # a second Ctrl-C while stopping
            skipped = 0
    if skipped:
        click.echo(f"skipped {skipped} malformed record(s)", err=True)


async def _read(
    nc: NATS,
    *,
    filters: _Filters,
    limit: int,
    since: float | None,
    follow: bool,
    out: _Printer,
) -> int:
    """Print the last `limit` matching records; with `follow`, then every new one until
    SIGINT/SIGTERM (`limit` 0 with `follow`: only the new ones). Returns how many malformed
    records were skipped."""
    js = nc.jetstream(timeout=5.0)
    try:
        info = await js.stream_info(DECISIONS_STREAM)
    except nats.js.errors.NotFoundError as exc:
        raise HookbusError(
            f"no decision audit trail here: the {DECISIONS_STREAM} stream does not exist"
            " (start `hookbus dispatcher --audit`)"
        ) from exc
    except (TimeoutError, nats.errors.Error) as exc:
        raise HookbusError(
            f"cannot read the {DECISIONS_STREAM} stream ({type(exc).__name__}: this NATS user"
            " may not read it? admin and auditor users may)"
        ) from exc
    last_seq = info.state.last_seq
    if not follow and info.state.messages == 0:
        out.backlog([])
        return 0

    config = ConsumerConfig()
    if since is not None:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = datetime.fromtimestamp(time.time() - since, UTC)
    elif limit == 0:  # only what is stored from now on
        config.deliver_policy = DeliverPolicy.NEW
    elif filters.agent is None and not filters.any:  # the last `limit` records are the answer
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = max(info.state.first_seq, last_seq - limit + 1, 1)

    inbox: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        inbox.put_nowait(msg)

    stop = asyncio.Event()
    with on_signals(lambda _sig: stop.set(), loop=asyncio.get_running_loop()):
        agent = filters.agent
        subject = decisions_subject(agent) if agent is not None else DECISIONS_WILDCARD
        sub = await open_consumer(
            js, DECISIONS_STREAM, subject, cb=on_msg, config=config, ordered=True,
            check_s=10.0 if follow else None,
        )  # fmt: skip
        skipped = 0
        recent: deque[DecisionRecord] = deque(maxlen=limit)
        try:
            start = await sub.consumer_info()
            delivered = start.delivered.consumer_seq if start.delivered else 0
            caught_up = limit == 0 or (not start.num_pending and not delivered)
            while not caught_up:
                msg = await _next(inbox, stop, timeout_s=None if follow else 10.0)
                if msg is None:
                    if stop.is_set():
                        return skipped
                    break  # nothing for 10 s while records were pending: print what came
                record = _decode(msg)
                if record is None:
                    skipped += 1
                elif filters(record):
                    recent.append(record)
                meta = msg.metadata
                caught_up = meta.num_pending == 0 or meta.sequence.stream >= last_seq
            out.backlog(list(recent))
            if follow:
                out.following()
            while follow:
                msg = await _next(inbox, stop, timeout_s=None)
                if msg is None:
                    break
                record = _decode(msg)
                if record is None:
                    skipped += 1
                elif filters(record):
                    out.one(record)
            return skipped
        finally:
            await release_consumer(sub)


async def _next(
    inbox: asyncio.Queue[Msg], stop: asyncio.Event, *, timeout_s: float | None
) -> Msg | None:
    """The next message, or None when `stop` is set or `timeout_s` passed first."""
    if not inbox.empty():
        return inbox.get_nowait()
    getting = asyncio.ensure_future(inbox.get())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait(
            {getting, stopping}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        stopping.cancel()
        if not getting.done():
            getting.cancel()
    return getting.result() if getting in done else None


def _decode(msg: Msg) -> DecisionRecord | None:
    try:
        return decode(msg.data, DecisionRecord)
    except HookbusError:
        return None


_COLUMNS = (
    "time", "agent", "session", "event", "tool", "action", "latency", "decided by",
    "handlers", "failures", "approver", "reason", "emit id", "trace id",
)  # fmt: skip


def latency(ms: float | None) -> str:
    """A decision's duration (`DecisionRecord.duration_ms`) for people: ``12.3ms`` under a
    second, ``4.56s`` under a minute, ``3m07s`` above; ``-`` when the record has none."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.1f}ms"
    if ms < 60_000:
        return f"{ms / 1000:.2f}s"
    minutes, seconds = divmod(round(ms / 1000), 60)
    return f"{minutes}m{seconds:02d}s"


class _Printer:
    """A rich table (the backlog) or lines (--follow), or JSON lines (--json). Nothing is
    ever cut: long cells fold, and off a terminal the table is as wide as it needs."""

    def __init__(self, *, as_json: bool, follow: bool) -> None:
        self.as_json, self.follow = as_json, follow
        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console = Console(width=100_000)
        self.console = console

    def backlog(self, records: list[DecisionRecord]) -> None:
        if self.as_json or self.follow:
            for r in records:
                self.one(r)
            return
        table = Table(title="decisions (oldest first)")
        for name in _COLUMNS:
            table.add_column(name, overflow="fold")
        for r in records:
            table.add_row(
                _time(r), r.agent_id or "", r.session_id or "", r.event, r.tool_name or "",
                r.action, latency(r.duration_ms), r.decided_by or "", " ".join(r.handlers),
                _failures(r), r.approver or "", r.reason or "", r.emit_id, r.trace_id or "",
            )  # fmt: skip
        self.console.print(table)

    def following(self) -> None:
        """Called once the backlog is printed and new records are being waited for."""

    def one(self, r: DecisionRecord) -> None:
        if self.as_json:
            click.echo(json.dumps(to_builtins(r), separators=(",", ":")))
            return
        parts = [
            _time(r), r.action, f"agent={r.agent_id or '-'}", f"session={r.session_id or '-'}",
            f"event={r.event}", f"tool={r.tool_name or '-'}",
            f"latency={latency(r.duration_ms)}", f"by={r.decided_by or '-'}",
            f"handlers={','.join(r.handlers) or '-'}",
        ]  # fmt: skip
        if r.failures:
            parts.append(f"failures={_failures(r)}")
        if r.approver:
            parts.append(f"approver={r.approver}")
        if r.reason:
            parts.append(f"reason={json.dumps(r.reason)}")
        parts += [f"emit={r.emit_id}", f"trace={r.trace_id or '-'}"]
        click.echo(" ".join(parts))


def _time(r: DecisionRecord) -> str:
    return datetime.fromtimestamp(r.time, UTC).isoformat(timespec="milliseconds")


def _failures(r: DecisionRecord) -> str:
    return " ".join(f"{f.handler}:{f.kind}:{f.policy}" for f in r.failures)
