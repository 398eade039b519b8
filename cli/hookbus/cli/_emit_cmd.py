"""``hookbus emit``: emit one event through a dispatcher in this process and print the
result (or, with ``--collect``, every handler's answer).

The data is a JSON object: inline, ``-`` for stdin, or ``@FILE``. With ``--exit-code`` the
exit status says the decision (see `EXIT_CODES`), for scripts. The first SIGINT (Ctrl-C)
or SIGTERM stops it at once, even while it waits for an approval (which stays pending):
exit 130 or 143, no traceback. Traced like the other commands (``--otlp-endpoint``, the
``OTEL_*`` variables); a ``TRACEPARENT`` variable (W3C trace context, as ``otel-cli`` and
CI systems set it) makes the emit's span a child of the caller's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    STANDARD_EVENTS,
    HookbusError,
    NotPermittedError,
    UnknownEventError,
    to_builtins,
)

from ._command_support import (
    AGENT_ID,
    ConnectionSettings,
    FiniteFloatRange,
    connect,
    connection_options,
    connection_or_embedded,
    parse_json_object,
)
from ._connect import LOCAL_URL
from ._lifecycle import Supervisor, run_async, stop_on_signals
from ._otel import otel_session
from ._service_emit import service_emit
from ._trace_context import callers_trace, otlp_option

__all__ = ["EXIT_CODES", "emit", "exit_code_of", "read_json_argument"]

EXIT_CODES = {"deny": 3, "ask_user": 4, "failures": 5}
"""``hookbus emit --exit-code``: 3 when the decision is deny, 4 when it is an ask_user
nobody answered (``--no-wait``), 5 when it let the call go on but handler failures were
recorded (a handler failed open); 0 otherwise. Errors stay 1, usage errors 2, and a
signal 128 + its number (Ctrl-C: 130)."""


def exit_code_of(result: dict[str, Any]) -> int:
    """The ``--exit-code`` status of an emit's result (as JSON builtins): see `EXIT_CODES`."""
    action = result.get("action")
    if action in ("deny", "ask_user"):
        return EXIT_CODES[str(action)]
    return EXIT_CODES["failures"] if result.get("failures") else 0


def read_json_argument(value: str, *, what: str = "JSON data") -> dict[str, Any]:
    """A JSON object from an argument: the text itself, ``-`` (stdin) or ``@FILE``.

    Raises:
        click.BadParameter: the file cannot be read, or the text is not a JSON object.
    """
    if value == "-":
        text, source = sys.stdin.read(), f"{what} on stdin"
    elif value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise click.BadParameter(f"cannot read {path}: {reason}", param_hint="JSON") from exc
        source = f"{what} in {path}"
    else:
        text, source = value, what
    return parse_json_object(text, what=source)


class _EventData(click.ParamType):  # type: ignore[type-arg]
    """The data argument, as given: required (a forgotten argument is not an empty call)."""

    name = "text"

    def get_missing_message(self, param: click.Parameter, ctx: click.Context | None) -> str:
        return "The event's data: a JSON object ('{}' for none), - to read it from stdin, or @FILE."


_SERVICE_HINT = (
    "; a plain agent identity of a secured server emits through the dispatcher service:"
    " add --service (and --agent-id)"
)
"""Added to a refusal of the dispatcher this command runs in its own process."""


@click.command()
@click.argument("event")
@click.argument("data", type=_EventData(), metavar="JSON|-|@FILE")
@connection_options
@otlp_option
@click.option(
    "--agent-id", type=AGENT_ID, default=None, help="Emit as this agent (the data's agent_id)."
)
@click.option("--session-id", default=None, help="The data's session_id (unless it has one).")
@click.option("--collect", is_flag=True, help="emit_and_collect instead of emit.")
@click.option(
    "--timeout",
    type=FiniteFloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="emit_and_collect timeout, s.",
)
@click.option(
    "--no-wait",
    is_flag=True,
    help="Do not wait for an approval: print an ask_user result as the handlers gave it.",
)
@click.option(
    "--allow-unknown",
    is_flag=True,
    help="Emit even if the event is neither standard nor has a declared handler.",
)
@click.option(
    "--exit-code",
    "use_exit_code",
    is_flag=True,
    help="Exit 3 on deny, 4 on an unanswered ask_user (--no-wait), 5 when handler failures "
    "were recorded; 0 otherwise.",
)
@click.option("--compact", is_flag=True, help="Print the JSON on one line.")
@click.option(
    "--service",
    "via_service",
    is_flag=True,
    help="Ask the dispatcher service (`hookbus dispatcher`) instead of a dispatcher in this "
    "process: what a plain agent identity of a secured server may do (it asks approvals, "
    "records the decision and bounds each agent). Needs --agent-id on a secured server.",
)
@click.option(
    "--audit",
    is_flag=True,
    help="Record the decision in the hookbus_decisions stream (created if absent), as "
    "`hookbus dispatcher --audit` does; `hookbus tail` and `hookbus decisions` show it.",
)
def emit(
    event: str,
    data: str,
    conn: ConnectionSettings,
    otlp_endpoint: str | None,
    agent_id: str | None,
    session_id: str | None,
    collect: bool,
    timeout: float,
    no_wait: bool,
    allow_unknown: bool,
    use_exit_code: bool,
    compact: bool,
    via_service: bool,
    audit: bool,
) -> None:
    """Emit EVENT with a JSON object (inline, - for stdin, @FILE) through a dispatcher in
    this process, waiting for an approval if a handler asks for one; print the result as
    JSON. Ctrl-C stops it at once (exit 130)."""
    payload = read_json_argument(data)
    if session_id is not None:
        payload.setdefault("session_id", session_id)
    out: list[Any] = []

    async def body(sup: Supervisor, server: ConnectionSettings) -> None:
        nc = await connect(server, name="hookbus-emit")
        sup.watch(nc, server.url or LOCAL_URL)
        with callers_trace():
            await emit_once(nc)

    async def emit_once(nc: Any) -> None:
        if via_service:
            if collect or no_wait or audit:
                raise click.UsageError("--service emits only: no --collect, --no-wait or --audit")
            try:
                result = await service_emit(nc, agent_id=agent_id)(event, payload)
            except HookbusError as exc:
                raise click.ClickException(str(exc)) from exc
            out.append(to_builtins(result))
            return
        try:
            async with HookDispatcher(
                nc,
                strict_events=not allow_unknown,
                approvals=not no_wait,
                agent_id=agent_id,
                audit=audit,
            ) as d:
                if collect:
                    out.append(await d.emit_and_collect(event, payload, timeout))
                else:
                    out.append(to_builtins(await d.emit(event, payload)))
        except UnknownEventError as exc:
            known = ", ".join(sorted(STANDARD_EVENTS))
            raise click.ClickException(f"{exc} (standard events: {known})") from exc
        except NotPermittedError as exc:  # a plain agent may not run a dispatcher itself
            raise click.ClickException(f"{exc}{_SERVICE_HINT}") from exc
        except HookbusError as exc:
            raise click.ClickException(str(exc)) from exc

    what = "hookbus emit"
    with (
        stop_on_signals(what),
        connection_or_embedded(conn) as server,
        otel_session("hookbus-emit", otlp_endpoint),
    ):
        code = run_async(Supervisor(what, grace_s=0).run(lambda s: body(s, server)))
    if code:
        raise click.exceptions.Exit(code)
    (result,) = out
    if compact:
        click.echo(json.dumps(result, separators=(",", ":")))
    else:
        click.echo(json.dumps(result, indent=2))
    if use_exit_code and not collect:
        status = exit_code_of(result)
        if status:
            raise click.exceptions.Exit(status)
