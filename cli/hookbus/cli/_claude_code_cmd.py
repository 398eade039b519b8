"""``hookbus claude-code``: the Claude Code command hook, and ``settings`` to install it.

As a hook, it reads the hook's JSON input on stdin, emits it through the dispatcher service
(or, with ``--embedded``, an in-process `HookDispatcher` on the same connection) and writes
Claude Code's answer: JSON on stdout and exit code 0, or exit code 1 and one line on stderr
for bad input. NATS unreachable, no dispatcher service, a timeout, even a misconfigured
command: the event's fallback answers (``PreToolUse`` and ``PermissionRequest`` are denied
by default), within ``--timeout`` plus a few seconds, never a traceback.

This module is imported on its own by `hookbus.cli._console_script` for the hook path, so it keeps
its imports to click, the connection options and the Claude Code door; the dispatcher is
imported only with ``--embedded``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shlex
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
from nats.aio.client import Client as NATS
from opentelemetry import trace

from hookbus._core.nats_guard import harden_connection
from hookbus.integrations import Emit
from hookbus.integrations.claude_code import (
    DEFAULT_TIMEOUT_S,
    EVENTS,
    ClaudeCodeAnswer,
    ClaudeCodeOptions,
    FallbackAction,
    answer,
    fallback_answer,
)
from hookbus.schemas import HookResult, NotConnectedError, NotPermittedError

from ._connect import (
    ConnectionSettings,
    _quiet_asyncio_tls_eof,
    auth_identity,
    connection_options,
    describe_refusal,
)
from ._service_emit import service_emit
from ._trace_context import callers_trace, exports, otlp_option

__all__ = ["claude_code", "run_hook"]

_tracer = trace.get_tracer("hookbus.cli")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
"""Where the hook connects without ``--url``, ``NATS_URL`` or a context (NATS's default)."""

_TOOL_EVENTS = frozenset({"PreToolUse", "PostToolUse", "PostToolUseFailure", "PermissionRequest"})
_NO_HTTP = frozenset({"SessionStart"})
"""Events Claude Code runs command hooks for, never HTTP hooks (hooks reference,
"Prompt-based hooks": SessionStart supports command and mcp_tool hooks only)."""

_stdin: list[bytes] = []


def _read_stdin() -> bytes:
    """The hook input, read once (a misconfigured command still answers the same input)."""
    if not _stdin:
        try:
            _stdin.append(sys.stdin.buffer.read())
        except (OSError, ValueError):
            _stdin.append(b"")
    return _stdin[0]


def _parse_fallbacks(values: Sequence[str]) -> dict[str, FallbackAction]:
    """``--fallback`` values: ``ACTION`` (every event) or ``EVENT=ACTION``.

    Raises:
        click.BadParameter: an unknown event or action.
    """
    out: dict[str, Any] = {}
    for value in values:
        name, sep, action = value.rpartition("=")
        name = name.strip() if sep else "*"
        action = action.strip()
        if action not in ("deny", "allow", "none"):
            raise click.BadParameter(
                f"{value!r}: the action must be deny, allow or none", param_hint="--fallback"
            )
        if name != "*" and name not in EVENTS:
            raise click.BadParameter(
                f"{value!r}: unknown event {name!r} (one of {', '.join(EVENTS)})",
                param_hint="--fallback",
            )
        out[name] = action
    return out


def door_options(
    on_continue: str, on_ask_user: str, fallbacks: Sequence[str], timeout_s: float
) -> ClaudeCodeOptions:
    """The Claude Code door's options from the command line's: ``--on-continue``,
    ``--on-ask-user``, ``--fallback`` (`_parse_fallbacks`) and ``--timeout`` (seconds).

    Raises:
        click.BadParameter: a bad ``--fallback``.
        ValueError: another option out of its bounds (`ClaudeCodeOptions`).
    """
    return ClaudeCodeOptions(
        on_continue=on_continue,  # type: ignore[arg-type]
        on_ask_user=on_ask_user,  # type: ignore[arg-type]
        fallback=_parse_fallbacks(fallbacks),
        timeout_s=timeout_s,
    )


class _LazyEmit:
    """Connects on the first emit, so bad input is answered without NATS and a connection
    failure becomes the fallback's reason (`answer` catches what this raises)."""

    def __init__(
        self,
        conn: ConnectionSettings,
        *,
        agent_id: str | None,
        embedded: bool,
        approvals: bool,
        connect_timeout_s: float,
    ) -> None:
        self._conn = conn
        self._agent_id = agent_id
        self._embedded = embedded
        self._approvals = approvals
        self._connect_timeout_s = connect_timeout_s
        self._nc: NATS | None = None
        self._dispatcher: Any = None

    async def __call__(self, event: str, data: dict[str, Any], **options: Any) -> HookResult:
        with _tracer.start_as_current_span(
            f"claude-code {event}", kind=trace.SpanKind.CLIENT, attributes={"hookbus.event": event}
        ):
            return await self._emit(event, data, **options)

    async def _emit(self, event: str, data: dict[str, Any], **options: Any) -> HookResult:
        nc = await self._connect()
        emit: Emit
        if self._embedded:
            from hookbus.dispatcher import HookDispatcher

            self._dispatcher = HookDispatcher(
                nc, approvals=self._approvals, agent_id=self._agent_id
            )
            await self._dispatcher.start()
            emit = self._dispatcher.emit
        else:
            emit = service_emit(nc, agent_id=self._agent_id)
        try:
            # approval_timeout_s: an approval ends within the door's wait, via either path
            return await emit(event, data, **options)
        except NotPermittedError as exc:
            if self._agent_id is not None:
                raise
            known = auth_identity(self._conn)
            name = known.name if known is not None and known.role == "agent" else "NAME"
            raise NotPermittedError(
                f"{exc}: no --agent given, and the emit subject carries the agent's name"
                f" (give --agent {name}, or env HOOKBUS_AGENT_ID)",
                operation=exc.operation,
                subject=exc.subject,
                identity=exc.identity,
                role=exc.role,
            ) from exc

    async def _connect(self) -> NATS:
        import nats

        url = self._conn.url or DEFAULT_NATS_URL
        servers = [s.strip() for s in url.split(",") if s.strip()]
        try:
            options = self._conn.nats_options()
        except click.ClickException as exc:  # an unreadable credentials or TLS file
            raise NotConnectedError(exc.format_message()) from exc
        errors: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        _quiet_asyncio_tls_eof()  # a TLS server closing says nothing the answer does not
        # each server at most twice (nats-py reads 0 as "forever"), and a TLS handshake
        # that never ends (nats-py waits on it) is cut by the overall bound
        bound = 2 * self._connect_timeout_s + 0.5
        try:
            async with asyncio.timeout(bound):
                self._nc = await nats.connect(
                    servers,
                    name="hookbus-claude-code",
                    connect_timeout=self._connect_timeout_s,
                    allow_reconnect=True,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0.05,
                    error_cb=on_error,
                    **options,
                )
        except TimeoutError as exc:
            raise NotConnectedError(
                f"cannot connect to NATS at {url}: no connection within {bound:g}s"
            ) from exc
        except Exception as exc:
            from ._connect import _most_telling

            cause = _most_telling([*errors, exc])
            raise NotConnectedError(describe_refusal(url, self._conn, cause)) from exc
        known = auth_identity(self._conn)  # a refused emit fails at once, naming who
        harden_connection(self._nc, identity=known.label if known is not None else None)
        return self._nc

    async def aclose(self) -> None:
        if self._dispatcher is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._dispatcher.close(), 2.0)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), 1.0)


async def _hook(body: bytes, emit: _LazyEmit, options: ClaudeCodeOptions) -> ClaudeCodeAnswer:
    try:
        return await answer(body, emit, options)
    finally:
        await emit.aclose()


def _write(reply: ClaudeCodeAnswer) -> int:
    if reply.stdout:
        sys.stdout.write(reply.stdout + "\n")
        sys.stdout.flush()
    if reply.stderr:
        sys.stderr.write(reply.stderr + "\n")
        sys.stderr.flush()
    return reply.exit_code


@click.group("claude-code", invoke_without_command=True)
@connection_options(embedded=False)
@click.option(
    "--agent",
    "agent_id",
    envvar="HOOKBUS_AGENT_ID",
    default=None,
    help="Emit as this agent (hookbus.v1.emit.<agent>.<event>; env HOOKBUS_AGENT_ID).",
)
@click.option(
    "--embedded",
    is_flag=True,
    help="Emit through an in-process dispatcher on this connection instead of the "
    "dispatcher service (workers and the handler registry are still on NATS).",
)
@click.option(
    "--on-continue",
    type=click.Choice(["none", "allow"]),
    envvar="HOOKBUS_CLAUDE_CODE_ON_CONTINUE",
    default="none",
    show_default=True,
    help="When every handler lets a tool call go on: no opinion (Claude Code's permission "
    "rules decide) or allow it (the permission prompt is skipped).",
)
@click.option(
    "--on-ask-user",
    type=click.Choice(["ask", "approval"]),
    envvar="HOOKBUS_CLAUDE_CODE_ON_ASK_USER",
    default="ask",
    show_default=True,
    help="A handler's ask_user: Claude Code asks the user, or hookbus's approval flow "
    "answers (`hookbus approvals`). With --embedded it sets the dispatcher's approvals; "
    "the dispatcher service always runs them.",
)
@click.option(
    "--fallback",
    "fallbacks",
    multiple=True,
    metavar="[EVENT=]deny|allow|none",
    help="What answers when hookbus cannot (repeatable). Default: PreToolUse and "
    "PermissionRequest deny, every other event none.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    help="Seconds an emit may take (an approval's wait included) before the fallback "
    "answers; an approval waits at most this less a margin (5 s, at most a fifth), then "
    "its default applies. Keep it below the hook's timeout in Claude Code's settings.",
)
@click.option(
    "--connect-timeout",
    "connect_timeout_s",
    type=float,
    default=2.0,
    show_default=True,
    help="Seconds to wait for NATS to accept the connection.",
)
@otlp_option
@click.pass_context
def claude_code(
    ctx: click.Context,
    conn: ConnectionSettings,
    agent_id: str | None,
    embedded: bool,
    on_continue: str,
    on_ask_user: str,
    fallbacks: tuple[str, ...],
    timeout_s: float,
    connect_timeout_s: float,
    otlp_endpoint: str | None,
) -> None:
    """Run as a Claude Code command hook: the hook's JSON on stdin, Claude Code's answer on
    stdout (exit 0), or one line on stderr and exit 1 for bad input.

    NATS is --url (env NATS_URL), else nats://127.0.0.1:4222. `hookbus claude-code
    settings` prints the settings.json "hooks" block that runs it."""
    if ctx.invoked_subcommand is not None:
        return
    body = _read_stdin()
    try:
        options = door_options(on_continue, on_ask_user, fallbacks, timeout_s)
        if not (math.isfinite(connect_timeout_s) and connect_timeout_s > 0):
            raise click.BadParameter(
                "must be a number of seconds above 0", param_hint="--connect-timeout"
            )
    except (ValueError, click.ClickException) as exc:
        text = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        ctx.exit(_write(_misconfigured(body, text)))
    emit = _LazyEmit(
        conn,
        agent_id=agent_id,
        embedded=embedded,
        approvals=options.on_ask_user == "approval",
        connect_timeout_s=connect_timeout_s,
    )
    try:
        with callers_trace(), _exporting(otlp_endpoint):
            reply = asyncio.run(_hook(body, emit, options))
    except Exception as exc:  # a bug of ours: still answer, by the fallback
        reply = fallback_answer(body, f"internal error: {exc!r}", options)
    ctx.exit(_write(reply))


@contextlib.contextmanager
def _exporting(otlp_endpoint: str | None) -> Iterator[None]:
    """Within: spans exported by OTLP when an endpoint is set (the SDK is loaded only then:
    the hook's start-up stays lean otherwise)."""
    if not exports(otlp_endpoint):
        yield
        return
    from ._otel import otel_session

    with otel_session("hookbus-claude-code", otlp_endpoint):
        yield


def _misconfigured(body: bytes, problem: str) -> ClaudeCodeAnswer:
    """The default fallback's answer for a hook command that cannot run as configured."""
    return fallback_answer(body, f"the hook command is misconfigured: {problem}")


def run_hook(args: Sequence[str]) -> int:
    """Run ``hookbus claude-code ARGS`` as a command hook; returns the exit code.

    A usage error (an unknown option, a bad value) is answered by the default fallback
    with the problem on stderr, not by click's exit code 2 (which Claude Code would read
    as a blocking error on every event)."""
    try:
        code = claude_code.main(list(args), prog_name="hookbus claude-code", standalone_mode=False)
    except click.ClickException as exc:
        return _write(_misconfigured(_read_stdin(), exc.format_message()))
    except click.exceptions.Abort:
        return 1
    return code if isinstance(code, int) else 0


# -- settings --------------------------------------------------------------------------------
def _hookbus_command() -> str:
    """This installation's ``hookbus`` executable, as an absolute path when there is one."""
    beside = Path(sys.executable).with_name("hookbus")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.absolute())
    found = shutil.which("hookbus")
    if found:
        return str(Path(found).absolute())
    return shlex.join([sys.executable, "-m", "hookbus.cli"])


def _hook_params(hook_args: Sequence[str]) -> dict[str, Any]:
    """The ``hookbus claude-code`` options `hook_args` give, parsed as the hook will.

    Raises:
        click.BadParameter: `hook_args` are not valid ``hookbus claude-code`` options.
    """
    try:
        ctx = claude_code.make_context("hookbus claude-code", list(hook_args))
    except click.ClickException as exc:
        raise click.BadParameter(exc.format_message(), param_hint="HOOK_ARGS") from exc
    extra = " ".join([*getattr(ctx, "_protected_args", []), *ctx.args])  # a subcommand, extras
    if extra:
        raise click.BadParameter(f"unexpected {extra!r}", param_hint="HOOK_ARGS")
    return dict(ctx.params)


_PATH_OPTIONS = ("--nkey", "--creds", "--tls-ca", "--tls-cert", "--tls-key")
"""The hook's options that name a file: Claude Code runs the hook in the session's folder,
so a relative path would name another file there."""


def absolute_hook_args(hook_args: Sequence[str]) -> list[str]:
    """`hook_args` with the file of each `_PATH_OPTIONS` option (``--nkey F`` or
    ``--nkey=F``) and a ``--context`` given as a ``.json`` path made absolute (from the
    current folder)."""
    out: list[str] = []
    args = list(hook_args)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        is_path = name in _PATH_OPTIONS or (name == "--context" and value.endswith(".json"))
        if eq and is_path:
            out.append(f"{name}={os.path.abspath(value)}")
        elif arg in _PATH_OPTIONS or arg == "--context":
            out.append(arg)
            if i + 1 < len(args):
                value = args[i + 1]
                keep = arg == "--context" and not value.endswith(".json")
                out.append(value if keep else os.path.abspath(value))
                i += 1
        else:
            out.append(arg)
        i += 1
    return out


def _names_agent(hook_args: Sequence[str]) -> bool:
    """Whether `hook_args` give ``--agent`` (the hook's environment may lack
    ``HOOKBUS_AGENT_ID``)."""
    return any(a == "--agent" or a.startswith("--agent=") for a in hook_args)


def _hook_timeout(hook_args: Sequence[str]) -> int:
    """Claude Code's ``timeout`` for the hook: the hook's ``--timeout`` plus 5 s (its
    connect and fallback), in whole seconds.

    Raises:
        click.BadParameter: `hook_args` are not valid ``hookbus claude-code`` options.
    """
    return math.ceil(float(_hook_params(hook_args)["timeout_s"])) + 5


def fail_closed_events(hook_args: Sequence[str] = ()) -> frozenset[str]:
    """The events whose hook denies when hookbus cannot answer (`DEFAULT_FALLBACK` and the
    hook's own ``--fallback``): Claude Code must block them too when the hook itself cannot
    run (the executable missing or broken, the gateway down, a timeout), which it does for
    a hook with ``"onFailure": "block"`` (Claude Code 2.1.295 and later). Every other event
    keeps Claude Code's default: a failed hook lets it go on, so a broken install never
    blocks a session's Stop or prompts.

    Raises:
        click.BadParameter: `hook_args` are not valid ``hookbus claude-code`` options.
    """
    options = ClaudeCodeOptions(fallback=_parse_fallbacks(_hook_params(hook_args)["fallbacks"]))
    return frozenset(e for e in EVENTS if options.fallback_for(e) == "deny")


def settings_hooks(
    *,
    events: Sequence[str],
    handler: Mapping[str, Any],
    matcher: str = "*",
    fail_closed: frozenset[str] = frozenset(),
) -> dict[str, list[dict[str, Any]]]:
    """The settings.json ``hooks`` block: one matcher group per event running `handler`
    (tool events with `matcher`, the others without: they match every occurrence); the
    events of `fail_closed` get ``"onFailure": "block"`` (see `fail_closed_events`)."""
    hooks: dict[str, list[dict[str, Any]]] = {}
    for name in events:
        group: dict[str, Any] = {"matcher": matcher} if name in _TOOL_EVENTS else {}
        hook = _for_event(handler, name)
        if name in fail_closed:
            hook["onFailure"] = "block"
        group["hooks"] = [hook]
        hooks[name] = [group]
    return hooks


def _for_event(handler: Mapping[str, Any], name: str) -> dict[str, Any]:
    """`handler` for event `name`: an HTTP hook gets the gateway's URL of that event
    (``<url>/<Event>``), so the gateway knows the event even of a request it refuses
    unread (a bad token, an oversize body) and answers it with that event's fallback."""
    out = dict(handler)
    if out.get("type") == "http":
        out["url"] = f"{str(out['url']).rstrip('/')}/{name}"
    return out


def _is_ours(handler: Any, new: Mapping[str, Any]) -> bool:
    """Whether an existing handler is a hookbus Claude Code hook (replaced on merge)."""
    if not isinstance(handler, dict):
        return False
    if handler.get("type") == "command":
        command = str(handler.get("command", ""))
        return "hookbus" in command and "claude-code" in command.split()
    if handler.get("type") == "http":
        url, ours = str(handler.get("url") or ""), str(new.get("url") or "")
        return bool(url) and url in (ours, ours.rpartition("/")[0])  # per event, or one URL
    return False


def merge_settings(
    settings: dict[str, Any], hooks: Mapping[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """`settings` with `hooks` added: every other key and hook kept, hookbus's previous
    Claude Code hooks (`_is_ours`) replaced, so merging twice changes nothing.

    Raises:
        click.ClickException: ``hooks`` (or one event's list) is not of the documented shape.
    """
    merged = dict(settings)
    existing = merged.get("hooks", {})
    if not isinstance(existing, dict):
        raise click.ClickException('the settings\' "hooks" is not an object')
    out: dict[str, Any] = dict(existing)
    for name, groups in hooks.items():
        new_handler = groups[0]["hooks"][0]
        current = out.get(name, [])
        if not isinstance(current, list):
            raise click.ClickException(f"the settings' hooks.{name} is not a list")
        kept = []
        for group in current:
            if isinstance(group, dict) and isinstance(group.get("hooks"), list):
                left = [h for h in group["hooks"] if not _is_ours(h, new_handler)]
                if not left and group["hooks"]:
                    continue  # a group that held only our hook
                group = {**group, "hooks": left}
            kept.append(group)
        out[name] = [*kept, *groups]
    merged["hooks"] = out
    return merged


_MANAGED_NOTE = """\
managed settings (organisation-wide, not overridable by users): write this object into
  Linux/WSL: /etc/claude-code/managed-settings.json
  macOS:     /Library/Application Support/ClaudeCode/managed-settings.json
  (Windows: see Claude Code's settings documentation)
merged with whatever the file already holds (--merge FILE). The command must exist on every
machine at that path: install hookbus system-wide, or pass --command. Add
"allowManagedHooksOnly": true to run only managed hooks (user, project and plugin hooks are
then ignored); "disableAllHooks" in user or project settings cannot turn managed hooks off."""


@claude_code.command("settings")
@click.option(
    "--door",
    type=click.Choice(["command", "http"]),
    default="command",
    show_default=True,
    help="A command hook (this CLI) or an HTTP hook (`hookbus gateway http`).",
)
@click.option(
    "--url",
    "http_url",
    default=None,
    metavar="URL",
    help="With --door http: the gateway's Claude Code URL, e.g. http://127.0.0.1:8080/claude-code"
    " (each event gets URL/<Event>).",
)
@click.option(
    "--token-env",
    default=None,
    metavar="VAR",
    help="With --door http: send 'Authorization: Bearer $VAR' (VAR read from Claude Code's "
    "environment, listed in allowedEnvVars).",
)
@click.option(
    "--events",
    default=None,
    metavar="LIST",
    help="Comma-separated Claude Code events (default: every event the door answers; "
    "--door http leaves out SessionStart, which Claude Code runs as command hooks only).",
)
@click.option(
    "--matcher",
    default="*",
    show_default=True,
    help="Matcher of the tool events (PreToolUse, PostToolUse, PostToolUseFailure, "
    "PermissionRequest), e.g. 'Bash|Write'.",
)
@click.option(
    "--command",
    "hook_command",
    default=None,
    help="With --door command: the hookbus executable Claude Code runs (default: this "
    "installation's, as an absolute path).",
)
@click.option(
    "--hook-timeout",
    type=click.IntRange(1, 3600),
    default=None,
    help="Claude Code's timeout for the hook, seconds (default: the hook's --timeout + 5).",
)
@click.option(
    "--merge",
    "merge_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Print this settings.json with the hooks merged in (other keys and hooks kept; "
    "hookbus's earlier hooks replaced). A missing file counts as {}.",
)
@click.option("--write", is_flag=True, help="With --merge: write the result back to the file.")
@click.option(
    "--managed",
    is_flag=True,
    help="For an organisation: notes on stderr on where managed settings live.",
)
@click.argument("hook_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- HOOK_ARGS...]")
def settings_cmd(
    door: str,
    http_url: str | None,
    token_env: str | None,
    events: str | None,
    matcher: str,
    hook_command: str | None,
    hook_timeout: int | None,
    merge_file: str | None,
    write: bool,
    managed: bool,
    hook_args: tuple[str, ...],
) -> None:
    """Print the settings.json "hooks" block that runs hookbus as Claude Code's hook.

    HOOK_ARGS (after --) are appended to the hook command, e.g. `-- --url nats://host:4222
    --on-continue allow`; they are checked here."""
    if door == "http":
        if not http_url:
            raise click.UsageError("--door http needs --url (the gateway's Claude Code URL)")
        if not http_url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{http_url!r} is not an http(s) URL", param_hint="--url")
        if hook_args or hook_command:
            raise click.UsageError("HOOK_ARGS and --command are for --door command")
    elif http_url or token_env:
        raise click.UsageError("--url and --token-env are for --door http")
    if write and not merge_file:
        raise click.UsageError("--write needs --merge FILE")
    names = _event_list(events, door)
    hook_args = tuple(absolute_hook_args(hook_args))
    timeout = hook_timeout or _hook_timeout(hook_args)
    if door == "command" and not _names_agent(hook_args):
        click.echo(
            "warning: no --agent in HOOK_ARGS: on a secured server the hook's emits are"
            " refused and every PreToolUse is denied by its fallback (add `-- --agent NAME`)",
            err=True,
        )
    handler: dict[str, Any]
    if door == "http":
        handler = {"type": "http", "url": http_url, "timeout": timeout}
        if token_env:
            handler["headers"] = {"Authorization": f"Bearer ${token_env}"}
            handler["allowedEnvVars"] = [token_env]
    else:
        base = hook_command or _hookbus_command()
        handler = {
            "type": "command",
            "command": " ".join([base, "claude-code", *map(shlex.quote, hook_args)]),
            "timeout": timeout,
        }
    hooks = settings_hooks(
        events=names, handler=handler, matcher=matcher, fail_closed=fail_closed_events(hook_args)
    )
    result: dict[str, Any] = {"hooks": hooks}
    if merge_file:
        result = merge_settings(_load_settings(Path(merge_file)), hooks)
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if write and merge_file:
        _write_atomically(Path(merge_file), text + "\n")
        click.echo(f"wrote {merge_file}", err=True)
    else:
        click.echo(text)
    if managed:
        click.echo(_MANAGED_NOTE, err=True)


def _event_list(events: str | None, door: str) -> list[str]:
    if events is None:
        return [e for e in EVENTS if not (door == "http" and e in _NO_HTTP)]
    names = [e.strip() for e in events.split(",") if e.strip()]
    if not names:
        raise click.BadParameter("no event given", param_hint="--events")
    for name in names:
        if name not in EVENTS:
            raise click.BadParameter(
                f"unknown event {name!r} (one of {', '.join(EVENTS)})", param_hint="--events"
            )
        if door == "http" and name in _NO_HTTP:
            raise click.BadParameter(
                f"Claude Code runs {name} hooks as commands only, not HTTP hooks: use "
                "--door command for it",
                param_hint="--events",
            )
    return list(dict.fromkeys(names))


def _load_settings(path: Path) -> dict[str, Any]:
    """The settings file as an object ({} when it does not exist).

    Raises:
        click.ClickException: unreadable, not JSON, or not an object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from exc
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.ClickException(f"{path} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise click.ClickException(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.hookbus-tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise click.ClickException(f"cannot write {path}: {exc}") from exc
