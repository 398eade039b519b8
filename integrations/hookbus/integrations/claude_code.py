"""The Claude Code door: a Claude Code hook's input in, hookbus's decision out.

Claude Code runs a hook (a command, or an HTTP endpoint) at points of its lifecycle and
reads the hook's answer (source: Claude Code hooks reference, https://code.claude.com/docs/
en/hooks). `answer` takes the hook's JSON input, emits it as a hookbus event through an
`Emit` (a `HookDispatcher.emit`, or a request to the dispatcher service), and maps the folded
`HookResult` back to what Claude Code reads: an exit code, JSON on stdout, a line on stderr.
`http_reply` gives the same answer as an HTTP response for Claude Code's HTTP hooks.

=======================  ====================================  ============================
Claude Code event        hookbus event                         JSON decision the door uses
=======================  ====================================  ============================
``PreToolUse``           ``tool:pre``                          ``permissionDecision``
``PermissionRequest``    ``claude_code:permission_request``    ``decision.behavior``
``PostToolUse``          ``tool:post``                         ``decision: "block"``
``PostToolUseFailure``   ``tool:error``                        none (context only)
``UserPromptSubmit``     ``prompt:submit``                     ``decision: "block"``
``Stop``                 ``claude_code:stop``                  ``decision: "block"``
``SubagentStop``         ``claude_code:subagent_stop``         ``decision: "block"``
``PreCompact``           ``context:pre_compact``               ``decision: "block"``
``SessionStart``         ``session:start``                     none (context only)
``SessionEnd``           ``session:end``                       none
``Notification``         ``user:notification``                 none
=======================  ====================================  ============================

The event data is the hook's input, field for field (``session_id``, ``transcript_path``,
``cwd``, ``permission_mode``, ``hook_event_name``, ``tool_name``, ``tool_input``,
``tool_use_id``, ``tool_response``, ``prompt``, ...): Claude Code's names are the names
hookbus's tool events use. Every decision is JSON on stdout with exit code 0 (never exit
code 2), which is how Claude Code's HTTP hooks must answer too. docs/claude-code.md has the
full mapping. This module imports the standard library and `hookbus.schemas` only.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from hookbus.schemas import (
    CONTEXT_PRE_COMPACT,
    PROMPT_SUBMIT,
    SESSION_END,
    SESSION_START,
    TOOL_ERROR,
    TOOL_POST,
    TOOL_PRE,
    USER_NOTIFICATION,
    HookbusError,
    HookResult,
    UnknownEventError,
)

from ._emit import Emit

__all__ = [
    "CLAUDE_CODE_PERMISSION_REQUEST",
    "CLAUDE_CODE_STOP",
    "CLAUDE_CODE_SUBAGENT_STOP",
    "DEFAULT_FALLBACK",
    "DEFAULT_TIMEOUT_S",
    "EVENTS",
    "EVENT_MAP",
    "ClaudeCodeAnswer",
    "ClaudeCodeOptions",
    "FallbackAction",
    "answer",
    "fallback_answer",
    "http_reply",
    "refusal_answer",
]

CLAUDE_CODE_STOP: Final = "claude_code:stop"
"""hookbus event of Claude Code's ``Stop`` (the main agent finished its turn): a deny keeps
Claude working, which no framework-neutral event means."""
CLAUDE_CODE_SUBAGENT_STOP: Final = "claude_code:subagent_stop"
"""hookbus event of Claude Code's ``SubagentStop`` (a subagent finished)."""
CLAUDE_CODE_PERMISSION_REQUEST: Final = "claude_code:permission_request"
"""hookbus event of Claude Code's ``PermissionRequest`` (a permission dialog is about to be
shown): answered on the user's behalf, which ``tool:pre`` (fired for every call) is not."""

EVENT_MAP: Final[Mapping[str, str]] = {
    "PreToolUse": TOOL_PRE,
    "PostToolUse": TOOL_POST,
    "PostToolUseFailure": TOOL_ERROR,
    "UserPromptSubmit": PROMPT_SUBMIT,
    "SessionStart": SESSION_START,
    "SessionEnd": SESSION_END,
    "PreCompact": CONTEXT_PRE_COMPACT,
    "Notification": USER_NOTIFICATION,
    "Stop": CLAUDE_CODE_STOP,
    "SubagentStop": CLAUDE_CODE_SUBAGENT_STOP,
    "PermissionRequest": CLAUDE_CODE_PERMISSION_REQUEST,
}
"""Claude Code hook event name -> hookbus event name."""

EVENTS: Final = tuple(EVENT_MAP)
"""The Claude Code hook events this door answers."""

FallbackAction = Literal["deny", "allow", "none"]
"""What answers when hookbus cannot: ``deny`` (fail closed: the event's blocking decision),
``allow`` (PreToolUse ``permissionDecision: "allow"``, PermissionRequest ``behavior:
"allow"``; elsewhere no decision), ``none`` (no decision: Claude Code goes on as if the hook
were not there)."""

DEFAULT_FALLBACK: Final[Mapping[str, FallbackAction]] = {
    "PreToolUse": "deny",
    "PermissionRequest": "deny",
}
"""Fail closed where a tool call is decided; every other event: ``none``."""

DEFAULT_TIMEOUT_S: Final = 25.0
"""Seconds an emit may take: below 30 s, the shortest default timeout Claude Code gives a
command or HTTP hook on the events this door answers (``UserPromptSubmit``; most events
get 600 s), so the door's own fallback answers before Claude Code cancels the hook."""

APPROVAL_MARGIN_S: Final = 5.0
"""Seconds of the door's wait kept for the handler chain before an approval and for the
answer to come back: an approval asked through the door waits at most
`ClaudeCodeOptions.approval_timeout_s`, the door's wait less this (at most a fifth of it)."""

_SETTLE_S = 2.0
"""Seconds past `ClaudeCodeOptions.timeout_s` an emit may take to bring its answer back
(the dispatcher settles an approval, the reply travels) before the fallback answers."""

# Fields each event must carry (name, JSON type) besides ``hook_event_name``.
_COMMON: Final = (("session_id", str),)
_TOOL: Final = (("tool_name", str), ("tool_input", dict))
_REQUIRED: Final[Mapping[str, tuple[tuple[str, type], ...]]] = {
    "PreToolUse": _TOOL,
    "PermissionRequest": _TOOL,
    "PostToolUse": _TOOL,
    "PostToolUseFailure": (*_TOOL, ("error", str)),
    "UserPromptSubmit": (("prompt", str),),
}
_TYPE_NAMES: Final[Mapping[type, str]] = {str: "a string", dict: "an object"}

# What each event can take (Claude Code hooks reference, "Decision control").
_BLOCK_DECISION: Final = frozenset(
    {"UserPromptSubmit", "PostToolUse", "Stop", "SubagentStop", "PreCompact"}
)
"""Events whose top-level ``decision: "block"`` + ``reason`` blocks."""
_ADDITIONAL_CONTEXT: Final = frozenset(
    {
        "PreToolUse",
        "PostToolUse",
        "PostToolUseFailure",
        "UserPromptSubmit",
        "SessionStart",
        "Stop",
        "SubagentStop",
    }
)
"""Events whose ``hookSpecificOutput.additionalContext`` reaches Claude."""


@dataclass(frozen=True)
class ClaudeCodeOptions:
    """How the door answers what hookbus decided, and what answers when it cannot.

    Attributes:
        on_continue: when every handler let the event go on: ``"none"`` (no opinion: exit
            0 and no output, so Claude Code's own permission rules and dialog decide) or
            ``"allow"`` (PreToolUse ``permissionDecision: "allow"``, PermissionRequest
            ``behavior: "allow"``: the permission prompt is skipped).
        on_ask_user: who answers a handler's ``ask_user``: ``"ask"`` (Claude Code asks the
            user: PreToolUse ``permissionDecision: "ask"``) or ``"approval"`` (hookbus's own
            approval flow: the dispatcher turns the ask into a durable approval and returns
            its answer, see README "Suspensions and approvals"). The door maps whatever the
            emit returns; the option tells the dispatcher the door builds whether to run
            approvals (a `hookbus dispatcher` service always runs them).
        fallback: Claude Code event name -> `FallbackAction`, over `DEFAULT_FALLBACK`; the
            key ``"*"`` sets every event not named.
        timeout_s: seconds the emit may take (the handler chain's deadline, an approval's
            wait included); then the fallback answers. Keep it below the hook's ``timeout``
            in Claude Code's settings (default 600 s; 30 s on UserPromptSubmit).
        on_modify: how a PreToolUse whose ``tool_input`` a handler modified is answered
            when nothing else allows it (`on_continue` ``"none"``, no approval): ``"ask"``
            (``permissionDecision: "ask"``: the user confirms the rewritten input) or
            ``"rules"`` (``updatedInput`` alone: Claude Code's own permission rules decide
            on the rewritten input, as they would have on the model's; what an Agent SDK
            host, which has nobody to ask, wants).

    Raises:
        ValueError: a value outside its choices, an unknown event in `fallback`, or a
            timeout that is not a finite number above 0.
    """

    on_continue: Literal["none", "allow"] = "none"
    on_ask_user: Literal["ask", "approval"] = "ask"
    fallback: Mapping[str, FallbackAction] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S
    on_modify: Literal["ask", "rules"] = "ask"

    def __post_init__(self) -> None:
        if self.on_modify not in ("ask", "rules"):
            raise ValueError(f"on_modify must be 'ask' or 'rules', not {self.on_modify!r}")
        if self.on_continue not in ("none", "allow"):
            raise ValueError(f"on_continue must be 'none' or 'allow', not {self.on_continue!r}")
        if self.on_ask_user not in ("ask", "approval"):
            raise ValueError(f"on_ask_user must be 'ask' or 'approval', not {self.on_ask_user!r}")
        for name, action in self.fallback.items():
            if name != "*" and name not in EVENT_MAP:
                raise ValueError(
                    f"fallback for unknown event {name!r}: choose from {', '.join(EVENTS)} or *"
                )
            if action not in ("deny", "allow", "none"):
                raise ValueError(
                    f"fallback for {name} must be 'deny', 'allow' or 'none', not {action!r}"
                )
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError(f"timeout_s must be a number of seconds, not {timeout!r}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout_s must be a finite number of seconds above 0: {timeout}")

    @property
    def approval_timeout_s(self) -> float:
        """Longest ``approval_timeout`` of an approval asked through the door, seconds:
        `timeout_s` less `APPROVAL_MARGIN_S` (at most a fifth of `timeout_s`), so an
        unanswered approval ends at its own timeout, with its ``approval_default``, before
        the door gives up, and none is left pending behind it. `answer` passes it with every
        emit (``approval_timeout_s``: an embedded dispatcher, the dispatcher service and
        the gateway's replica all cut a handler's ``approval_timeout`` to it)."""
        return self.timeout_s - min(APPROVAL_MARGIN_S, self.timeout_s / 5)

    def fallback_for(self, hook_event_name: str) -> FallbackAction:
        """The fallback of one Claude Code event: `fallback` (its name, else ``"*"``),
        else `DEFAULT_FALLBACK`, else ``"none"``."""
        if hook_event_name in self.fallback:
            return self.fallback[hook_event_name]
        if "*" in self.fallback:
            return self.fallback["*"]
        return DEFAULT_FALLBACK.get(hook_event_name, "none")


@dataclass(frozen=True)
class ClaudeCodeAnswer:
    """What a command hook hands back to Claude Code.

    Attributes:
        stdout: the JSON output (one line), or ``""`` for no opinion.
        exit_code: 0 (Claude Code reads `stdout`), or 1 for bad input (Claude Code's
            non-blocking error: the action goes on and the first line of `stderr` is shown
            in the transcript). The door never exits 2: every decision is JSON.
        stderr: one line for a person: the input error, or why the fallback answered.
        hook_event_name: the Claude Code event answered (None when the input had none).
        fallback: why the fallback answered (hookbus unreachable, a timeout, an error
            reply); None when hookbus decided.
    """

    stdout: str = ""
    exit_code: int = 0
    stderr: str = ""
    hook_event_name: str | None = None
    fallback: str | None = None


class _InputError(ValueError):
    """The hook input is not a Claude Code hook input this door answers."""


def _parse(body: bytes | str, hook_event_name: str | None) -> dict[str, Any]:
    """The hook input as a dict, checked.

    Raises:
        _InputError: not JSON, not an object, no or an unknown ``hook_event_name``, another
            event than `hook_event_name`, or a required field missing or of the wrong type.
    """
    try:
        text = body.decode("utf-8") if isinstance(body, bytes | bytearray) else body
    except UnicodeDecodeError as exc:
        raise _InputError(f"the hook input is not UTF-8 text ({exc.reason})") from exc
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _InputError(f"the hook input is not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise _InputError(f"the hook input is a JSON {_json_kind(value)}, not an object")
    name = value.get("hook_event_name")
    if not isinstance(name, str) or not name:
        raise _InputError("the hook input has no hook_event_name (a string)")
    if name not in EVENT_MAP:
        raise _InputError(
            f"unsupported Claude Code hook event {name[:80]!r} (supported: {', '.join(EVENTS)})"
        )
    if hook_event_name is not None and name != hook_event_name:
        raise _InputError(
            f"the hook input is a {name} event, but this hook answers {hook_event_name[:80]!r}"
        )
    for key, type_ in (*_COMMON, *_REQUIRED.get(name, ())):
        if not isinstance(value.get(key), type_):
            got = "missing" if key not in value else f"a JSON {_json_kind(value[key])}"
            raise _InputError(f"the {name} input has no {key!r} ({_TYPE_NAMES[type_]}; {got})")
    return value


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int | float):
        return "number"
    return "null"


def _idempotency_key(name: str, data: Mapping[str, Any]) -> str | None:
    """A key per tool call (``tool_use_id``): a retried hook finds its approval again."""
    tool_use_id = data.get("tool_use_id")
    if isinstance(tool_use_id, str) and tool_use_id:
        return f"claude-code:{data['session_id']}:{name}:{tool_use_id}"
    return None


async def answer(
    body: bytes | str,
    emit: Emit,
    options: ClaudeCodeOptions | None = None,
    *,
    hook_event_name: str | None = None,
) -> ClaudeCodeAnswer:
    """Answer one Claude Code hook: parse `body`, emit it, map the result.

    Args:
        body: the hook's input: stdin of a command hook, the POST body of an HTTP hook.
        emit: where the event goes (`HookDispatcher.emit`, or a dispatcher service request).
        options: how to answer; None: `ClaudeCodeOptions()`.
        hook_event_name: the event this hook is configured for (an HTTP hook's URL per
            event); an input of another event is refused. None: any event of `EVENTS`.

    Returns:
        The answer. Bad input (not JSON, not an object, an unknown event, a missing field)
        is Claude Code's non-blocking error: exit code 1, one line on stderr, no stdout.
        An emit that fails (a `HookbusError`, a timeout past ``options.timeout_s``, NATS
        unreachable, any other error) is answered by the event's fallback, exit code 0.
        An event no handler is declared for (`UnknownEventError` from a strict dispatcher)
        is no opinion. Never raises.

    Source: Claude Code hooks reference ("Exit code output", "JSON output", "Decision
    control" and each event's decision control).
    """
    opts = options or ClaudeCodeOptions()
    try:
        data = _parse(body, hook_event_name)
    except _InputError as exc:
        return ClaudeCodeAnswer(exit_code=1, stderr=f"hookbus claude-code: {exc}")
    name: str = data["hook_event_name"]
    event = EVENT_MAP[name]
    try:
        async with asyncio.timeout(opts.timeout_s + _SETTLE_S):
            result = await emit(
                event,
                dict(data),
                idempotency_key=_idempotency_key(name, data),
                timeout_s=opts.timeout_s,
                approval_timeout_s=opts.approval_timeout_s,
            )
    except UnknownEventError:  # nothing declared for this event: nobody has an opinion
        return ClaudeCodeAnswer(hook_event_name=name)
    except TimeoutError as exc:  # the door's own bound, or the emit's timeout error
        late = f"no answer within {opts.timeout_s + _SETTLE_S:g}s"
        return _fallback(name, data, _describe(exc) if str(exc) else late, opts)
    except Exception as exc:  # a door answers, it never raises: the fallback decides
        return _fallback(name, data, _describe(exc), opts)
    if not isinstance(result, HookResult):
        return _fallback(name, data, f"the emit returned a {type(result).__name__}", opts)
    out = _render(name, data, result, opts)
    return ClaudeCodeAnswer(stdout=_dump(out), hook_event_name=name)


def fallback_answer(
    body: bytes | str,
    why: str,
    options: ClaudeCodeOptions | None = None,
    *,
    hook_event_name: str | None = None,
) -> ClaudeCodeAnswer:
    """The fallback's answer to `body` without emitting (e.g. the door could not even
    connect, or was misconfigured): as `answer` when the emit fails for reason `why`.

    Bad input is answered as in `answer` (exit code 1). Never raises.
    """
    opts = options or ClaudeCodeOptions()
    try:
        data = _parse(body, hook_event_name)
    except _InputError as exc:
        return ClaudeCodeAnswer(exit_code=1, stderr=f"hookbus claude-code: {exc}")
    return _fallback(data["hook_event_name"], data, why, opts)


def refusal_answer(
    hook_event_name: str | None, why: str, options: ClaudeCodeOptions | None = None
) -> ClaudeCodeAnswer:
    """The answer to a request the HTTP door refused before reading it as input (a bad
    token, a body over the size limit): nothing is emitted, and the event's fallback decides,
    as if hookbus were unreachable (`PreToolUse` and `PermissionRequest` deny by default).

    Claude Code takes any non-2xx answer of an HTTP hook as a non-blocking error and runs the
    tool, so a refusal answered with a 401 or 413 status would let a misconfigured token or
    an oversize tool input skip every policy. `hook_event_name` is the event the URL or the
    body names; when neither does (an unknown or missing name), the answer is
    ``{"continue": false, "stopReason": ...}``: Claude stops rather than go on ungoverned.
    Never raises.

    Source: Claude Code hooks reference, "HTTP response handling" and "Common JSON fields".
    """
    opts = options or ClaudeCodeOptions()
    if hook_event_name not in EVENT_MAP:
        note = f"hookbus refused the hook request ({why}); Claude stops"
        out = {"continue": False, "stopReason": note}
        return ClaudeCodeAnswer(stdout=_dump(out), stderr=note, fallback=why)
    name = str(hook_event_name)
    return _fallback(name, {"hook_event_name": name}, why, opts)


def http_reply(reply: ClaudeCodeAnswer) -> tuple[int, bytes, str]:
    """`reply` as an HTTP hook response: ``(status, body, content type)``.

    A decision is ``200`` with the JSON body (an HTTP hook blocks only with a 2xx JSON body;
    status codes alone cannot block); no opinion is ``200`` with an empty body; bad input
    (exit code 1) is ``400`` with the error line as text, a non-blocking error.

    Source: Claude Code hooks reference, "HTTP response handling".
    """
    if reply.exit_code != 0:
        return 400, (reply.stderr + "\n").encode(), "text/plain; charset=utf-8"
    if not reply.stdout:
        return 200, b"", "text/plain; charset=utf-8"
    return 200, reply.stdout.encode(), "application/json"


# -- mapping ---------------------------------------------------------------------------------
def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, HookbusError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _fallback(
    name: str, data: Mapping[str, Any], why: str, opts: ClaudeCodeOptions
) -> ClaudeCodeAnswer:
    """The event's fallback answer, with a `systemMessage` telling the user why."""
    action = opts.fallback_for(name)
    note = f"hookbus unavailable ({why}); {name} answered by the fallback: {action}"
    if action == "deny":
        result = HookResult(action="deny", reason=f"hookbus unavailable ({why}): denied")
        out = _render(name, data, result, opts)
    elif action == "allow":
        allowing = ClaudeCodeOptions(on_continue="allow", timeout_s=opts.timeout_s)
        out = _render(name, data, HookResult(action="continue"), allowing)
    else:
        out = {}
    _add_message(out, note)
    return ClaudeCodeAnswer(stdout=_dump(out), stderr=note, hook_event_name=name, fallback=why)


def _render(
    name: str, sent: Mapping[str, Any], result: HookResult, opts: ClaudeCodeOptions
) -> dict[str, Any]:
    """The JSON output for `result` (empty: no opinion)."""
    out: dict[str, Any] = {}
    specific: dict[str, Any] = {}
    final = result.chained_data if result.chained_data is not None else result.data
    new_input = _changed(sent, final, "tool_input", result)

    if result.action == "deny":
        _deny(name, _deny_reason(result), out, specific)
    elif result.action == "ask_user":
        _ask(name, result, new_input, out, specific)
    elif name == "PreToolUse":
        allow = opts.on_continue == "allow" or result.approved_by is not None
        if result.approved_by is not None:
            specific["permissionDecision"] = "allow"
            why = result.reason or f"{result.approved_by} allowed it"
            specific["permissionDecisionReason"] = f"approved in hookbus: {why}"
        if new_input is not None:
            by = ", ".join(result.modified_by)
            if allow or opts.on_modify == "ask":
                specific["permissionDecision"] = "allow" if allow else "ask"
            specific.setdefault("permissionDecisionReason", f"tool input modified by {by}")
            specific["updatedInput"] = new_input
        elif allow:
            specific["permissionDecision"] = "allow"
    elif name == "PermissionRequest":
        if opts.on_continue == "allow" or result.approved_by is not None:
            decision: dict[str, Any] = {"behavior": "allow"}
            if new_input is not None:
                decision["updatedInput"] = new_input
            specific["decision"] = decision
    elif name == "PostToolUse":
        new_output = _changed(sent, final, "tool_response", result)
        if new_output is not None:
            specific["updatedToolOutput"] = new_output

    if result.context_injection and name in _ADDITIONAL_CONTEXT:
        specific["additionalContext"] = result.context_injection
    if result.user_message:
        _add_message(out, result.user_message)
    if result.suppress_output:
        out["suppressOutput"] = True
    if specific:
        out["hookSpecificOutput"] = {"hookEventName": name, **specific}
    return out


def _changed(
    sent: Mapping[str, Any], final: Mapping[str, Any] | None, key: str, result: HookResult
) -> Any:
    """The new value of `key` when a handler modified it, else None."""
    if not result.modified_by or final is None or key not in final:
        return None
    value = final[key]
    return None if value == sent.get(key) else value


def _deny_reason(result: HookResult) -> str:
    if result.reason:
        return result.reason
    if result.decided_by:
        return f"denied by hookbus handler {result.decided_by}"
    return "denied by a hookbus handler"


def _deny(name: str, reason: str, out: dict[str, Any], specific: dict[str, Any]) -> None:
    """A deny in the event's own terms; events that cannot block show it to the user."""
    if name == "PreToolUse":
        specific["permissionDecision"] = "deny"
        specific["permissionDecisionReason"] = reason
    elif name == "PermissionRequest":
        specific["decision"] = {"behavior": "deny", "message": reason}
    elif name in _BLOCK_DECISION:
        out["decision"] = "block"
        out["reason"] = reason
    else:  # SessionStart, SessionEnd, Notification, PostToolUseFailure: no decision control
        _add_message(out, f"hookbus denied {name}: {reason}")


def _ask(
    name: str,
    result: HookResult,
    new_input: Any,
    out: dict[str, Any],
    specific: dict[str, Any],
) -> None:
    """An ``ask_user`` that came back as such (no hookbus approval answered it)."""
    prompt = result.approval_prompt or result.reason or "a hookbus handler asks for confirmation"
    if name == "PreToolUse":
        specific["permissionDecision"] = "ask"
        specific["permissionDecisionReason"] = prompt
        if new_input is not None:
            specific["updatedInput"] = new_input
    elif name == "PermissionRequest":
        _add_message(out, prompt)  # no decision: Claude Code's dialog asks the user
    else:  # no way to ask the user here: an approval nobody can give is a deny
        _deny(name, f"approval required: {prompt}", out, specific)


def _add_message(out: dict[str, Any], text: str) -> None:
    previous = out.get("systemMessage")
    out["systemMessage"] = f"{previous}\n{text}" if previous else text


def _dump(out: Mapping[str, Any]) -> str:
    if not out:
        return ""
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"), default=str)
