"""The one call every door makes: emit an event and get the folded `HookResult`.

A door (the Claude Code command hook, the HTTP gateway, the AOS guardian endpoint) maps its
protocol's message to a hookbus event and data, calls an `Emit`, and maps the result back.
`HookDispatcher.emit` is an `Emit` (an in-process dispatcher); so is a function that sends an
`EmitRequest` to the dispatcher service. This module imports nothing but the wire types, so a
door that uses it stays cheap to import.

The rules the agent-framework integrations (pydantic-ai, the Vercel ``ai`` SDK) share are
here too, written once: how an emit that cannot decide is turned into a decision
(`emit_decision`), which results stop an action (`denied`, `as_deny`), the text a model
reads for a denied call (`denied_text`) or a withheld result (`withheld_text`), the final
chained data (`final_data`), the injections of a result (`injections`) and how they are
framed when appended to the text of a tool result (`framed_injections`); and what the
hooks of a framework hold and how they emit (`FrameworkHooks`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, Unpack

from hookbus.schemas import (
    EmitOptions,
    HookbusError,
    HookResult,
    NotConnectedError,
    UnknownEventError,
)

if TYPE_CHECKING:
    from hookbus.dispatcher import HookDispatcher

__all__ = [
    "DATA_ACTIONS",
    "NO_APPROVALS",
    "Emit",
    "FrameworkHooks",
    "HookDeniedError",
    "Injection",
    "as_deny",
    "check_options",
    "check_timeout",
    "denied",
    "denied_text",
    "emit_decision",
    "final_data",
    "framed_injections",
    "injections",
    "jsonable",
    "reason",
    "withheld_text",
]


class Emit(Protocol):
    """``await emit(event, data, idempotency_key=..., timeout_s=..., approval_timeout_s=...)
    -> HookResult`` (the options: `EmitOptions`).

    The shape of `HookDispatcher.emit` (``approval_timeout_s``, seconds: the longest wait of
    an approval the emit asks). Raises what it raises (`hookbus.schemas.HookbusError`
    subclasses); a door answers those with its protocol's fallback, never a traceback.
    """

    async def __call__(
        self, event: str, data: dict[str, Any], **options: Unpack[EmitOptions]
    ) -> HookResult: ...


DATA_ACTIONS = frozenset({"continue", "modify", "inject_context"})
"""The actions that let the action go on (with the result's data)."""

InjectionRole = Literal["system", "user", "assistant"]
Injection = tuple[str, InjectionRole, bool, "str | None"]
"""One injection: (content, role, ephemeral, handler)."""


async def emit_decision(
    emit: Emit, event: str, data: dict[str, Any], *, key: str, timeout_s: float | None
) -> HookResult:
    """``await emit(event, data, idempotency_key=key, timeout_s=timeout_s)`` for an
    integration that must get a decision: a strict dispatcher with no handler declared for
    `event` (`UnknownEventError`) is ``continue`` with `data` (nothing decides); an
    `OSError` becomes `NotConnectedError` (never let it pass as "allow").

    Raises:
        HookbusError: what the emit raised (`NotConnectedError`, `PayloadTooLargeError`,
            `SuspensionAbortedError`, ...).
    """
    try:
        return await emit(event, data, idempotency_key=key, timeout_s=timeout_s)
    except UnknownEventError:
        return HookResult(action="continue", data=data)
    except HookbusError:
        raise
    except OSError as exc:
        raise NotConnectedError(f"{event} could not be emitted: {exc!r}") from exc


def final_data(result: HookResult) -> dict[str, Any]:
    """The final chained data of an emit (`HookResult.chained_data`), or {} (then every
    field counts as unchanged)."""
    return result.chained_data if result.chained_data is not None else {}


def denied(result: HookResult) -> bool:
    """Whether `result` stops the action: a deny, an ``ask_user`` nobody here can answer,
    or anything that is not a known action (fail closed)."""
    return result.action not in DATA_ACTIONS


def reason(result: HookResult) -> str:
    """A deny's reason: its own, else who denied."""
    if result.reason:
        return result.reason
    return f"denied by {result.decided_by}" if result.decided_by else "denied"


def denied_text(result: HookResult) -> str:
    """The tool result the model sees for a denied call (amplifier-core's wording)."""
    return f"Denied by hook: {reason(result)}"


def withheld_text(result: HookResult) -> str:
    """The tool result the model sees when ``tool:post`` denies it (the tool has run)."""
    return f"Tool result withheld by hook: {reason(result)}"


def as_deny(
    result: HookResult, event: str, why_unanswered: str, *, log: logging.Logger
) -> HookResult:
    """`result` as a deny with its reason: a deny as is; an ``ask_user`` that came back
    unanswered says so and `why_unanswered` (a warning is logged on `log`); any other
    action is an unknown one."""
    if result.action == "deny":
        return result
    if result.action == "ask_user":
        log.warning(
            "%s asked for an approval that cannot be answered here: %s", event, why_unanswered
        )
        text = f"approval required ({reason(result)}), but it cannot be answered: {why_unanswered}"
    else:
        text = f"unknown action {result.action!r}"
    return HookResult(action="deny", reason=text, decided_by=result.decided_by)


def injections(result: HookResult) -> list[Injection]:
    """(content, role, ephemeral, handler) of each injection, in the order the handlers ran:
    ``result.context_injections`` (the handler named ``hook_name``, as amplifier-core
    names it, or ``handler``), else the merged ``context_injection``."""
    found: list[Injection] = []
    for injection in result.context_injections:
        handler: str | None = getattr(injection, "hook_name", None) or getattr(
            injection, "handler", None
        )
        if injection.content:
            found.append((injection.content, injection.role, injection.ephemeral, handler))
    if not found and result.context_injection:
        found.append(
            (
                result.context_injection,
                result.context_injection_role,
                result.ephemeral,
                result.decided_by,
            )
        )
    return found


def framed_injections(text: str, added: list[Injection]) -> str:
    """`text` (what the model reads for a tool's result) with each injection of `added`
    appended after a blank line, framed ``<hook_injection handler="..." role="...">...
    </hook_injection>`` (amplifier-core's ``append_to_last_tool_result``: the role is named,
    not applied)."""
    for content, role, _ephemeral, handler in added:
        frame = f'<hook_injection handler="{handler or "hook"}" role="{role}">'
        text += f"\n\n{frame}{content}</hook_injection>"
    return text


def check_timeout(name: str, value: float | None) -> None:
    """Raise `ValueError` unless `value` is None or a finite number of seconds above 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds or None, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds above 0, got {value!r}")


def check_options(
    owner: str,
    dispatcher: object,
    *,
    events: Collection[str],
    session_id: str | None,
    timeout_s: float | None,
    timeouts: Mapping[str, float | None] | None,
) -> dict[str, float | None]:
    """Check the options every framework integration takes (`owner`: its class name, for
    the messages); the per-event timeouts (seconds) as a new dict.

    Raises:
        TypeError: `dispatcher` is not a `HookDispatcher`.
        ValueError: `session_id` is not a non-empty string or None; `timeouts` names an
            event not in `events`; a timeout is not None or a finite number above 0.
    """
    from hookbus.dispatcher import HookDispatcher  # the doors import this module: lazily

    if not isinstance(dispatcher, HookDispatcher):
        raise TypeError(f"{owner} needs a hookbus HookDispatcher, got {type(dispatcher).__name__}")
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise ValueError("session_id must be a non-empty string or None")
    per_event = dict(timeouts or {})
    unknown = sorted(set(per_event) - set(events))
    if unknown:
        raise ValueError(f"timeouts for events {owner} never emits: {unknown}")
    for name, value in [("timeout_s", timeout_s), *per_event.items()]:
        check_timeout(name, value)
    return per_event


NO_APPROVALS = (
    "the dispatcher does not run hookbus approvals (a connected, started HookDispatcher with"
    " approvals on does)"
)
"""Why an ``ask_user`` came back unanswered from a dispatcher (`as_deny`'s `why_unanswered`)."""


class FrameworkHooks:
    """What the hooks of an agent framework hold (the dispatcher, the session id, the
    deadlines) and how they emit (`_emit`). A subclass names the events it emits in
    `_events` and describes its arguments (``dispatcher``, ``session_id``, ``timeout_s``,
    ``timeouts``); they are checked by `check_options`, whose errors name the subclass."""

    _events: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        dispatcher: HookDispatcher,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
        timeouts: Mapping[str, float | None] | None = None,
    ) -> None:
        per_event = check_options(
            type(self).__name__, dispatcher, events=self._events, session_id=session_id,
            timeout_s=timeout_s, timeouts=timeouts,
        )  # fmt: skip
        self.dispatcher = dispatcher
        self.session_id = session_id
        self.timeout_s = timeout_s
        self.timeouts = per_event

    async def _emit(self, event: str, data: dict[str, Any], key: str) -> HookResult:
        """`emit_decision` through the dispatcher with idempotency key `key`, within the
        deadline of `event` (its `timeouts` entry, else `timeout_s`)."""
        timeout = self.timeouts.get(event, self.timeout_s)
        return await emit_decision(self.dispatcher.emit, event, data, key=key, timeout_s=timeout)


class HookDeniedError(HookbusError):
    """A handler denied an event that a run cannot go on without (``session:start``,
    ``prompt:submit``, ...): the run does not go on.

    Attributes:
        event: the denied event.
        result: the dispatcher's `HookResult` (``reason``, ``decided_by``, ``failures``).
    """

    def __init__(self, event: str, result: HookResult) -> None:
        self.event = event
        self.result = result
        by = f" by {result.decided_by}" if result.decided_by else ""
        super().__init__(f"{event} denied{by}: {result.reason or 'no reason given'}")


def jsonable(value: Any) -> Any:
    """`value` as JSON data (what crosses the bus); anything JSON cannot hold becomes text.
    Needs pydantic (both agent frameworks bring it; imported here only when called)."""
    import pydantic_core

    return pydantic_core.to_jsonable_python(value, serialize_unknown=True)
