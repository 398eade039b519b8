"""hookbus as the hook layer of a Claude Agent SDK for Python host: `HookbusClaudeHooks`.

``ClaudeAgentOptions(hooks=HookbusClaudeHooks(dispatcher).hooks(), ...)`` (or
``HookbusClaudeHooks(dispatcher).options(...)``) gives the Claude Code CLI the SDK drives a
Python hook callback per event, which emits the event through a `HookDispatcher` the
application started and answers with what hookbus handlers anywhere on NATS decided:

========================  ==================  ==============================================
Claude Code event         hookbus event       data
========================  ==================  ==============================================
``PreToolUse``            ``tool:pre``        the hook input, field for field
                                              (``session_id``, ``cwd``, ``tool_name``,
                                              ``tool_input``, ``tool_use_id``, ...)
``PostToolUse``           ``tool:post``       the same and ``tool_response``
``UserPromptSubmit``      ``prompt:submit``   ``session_id``, ``prompt``, ...
========================  ==================  ==============================================

The callback is the Claude Code door's (`hookbus.integrations.claude_code.answer`): the same
event mapping, input checks, fallback and JSON decision as ``hookbus claude-code``, handed
to the CLI over the SDK's control channel instead of a process's stdout. Other events of
`hookbus.integrations.claude_code.EVENT_MAP` the SDK can hook (``PostToolUseFailure``,
``Stop``, ``SubagentStop``, ``PreCompact``, ``Notification``, ``PermissionRequest``) are
emitted too when named in ``events``.

What each action does (the dispatcher's fold decides; nothing is re-decided here):

- ``deny`` on ``tool:pre``: ``permissionDecision: "deny"``: the CLI does not run the tool
  and the model reads the reason as the tool's (error) result. On ``tool:post`` (the tool
  has run) and ``prompt:submit``: ``decision: "block"`` with the reason.
- ``modify`` on ``tool:pre``: the final chained data's ``tool_input`` is ``updatedInput``:
  the tool runs with it. The SDK's own permission rules (``allowed_tools``,
  ``permission_mode``, ``can_use_tool``) still decide on the rewritten input, as they would
  have on the model's (`ClaudeCodeOptions.on_modify` ``"rules"``; ``on_continue="allow"``
  makes every call hookbus lets through allowed outright). On ``tool:post``:
  ``updatedToolOutput``.
- ``inject_context``: ``additionalContext``, which the model reads with the tool's result
  (or the prompt).
- ``ask_user``: the dispatcher turns it into a durable hookbus approval (JetStream KV,
  answered from any process with `HookDispatcher.answer_approval` or ``hookbus approvals
  answer``) and returns the answer as continue or deny; the CLI waits for the callback. An
  approval waits at most `ClaudeCodeOptions.approval_timeout_s` (`ClaudeCodeOptions.timeout_s`
  less a margin; raise `timeout_s` for approvals a person answers), whatever the handler's
  ``approval_timeout``: one nobody answers ends with its ``approval_default`` before the
  callback gives up, never left pending. A dispatcher without approvals cannot answer it:
  a deny, with a reason saying why.
- ``continue``: no opinion: the SDK's own permission rules decide.

Faults: an emit that fails (NATS unreachable, a timeout past
`ClaudeCodeOptions.timeout_s`, a `HookbusError`) is answered by the event's fallback
(`ClaudeCodeOptions.fallback`: ``PreToolUse`` denies, other events have no opinion), with
a ``systemMessage`` saying why. The ``PreToolUse`` matcher is ``on_failure="block"``: a
callback that fails anyway (an input the door refuses, the matcher's own timeout) blocks the
tool rather than let it run undecided.

Idempotency: every tool event's key is ``claude-code:<session id>:<Claude Code
event>:<tool_use_id>``, from the hook input (the door's): each CLI session has its own id, so
two runs never share a key (nor an approval), even when a tool_use_id repeats, and a retried
callback of the same call finds its approval again. ``UserPromptSubmit`` has no tool_use_id:
it is emitted without a key (each prompt is a new call).

``import hookbus`` never imports ``claude_agent_sdk``; this module does (the
``claude-agent-sdk`` extra).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from claude_agent_sdk import ClaudeAgentOptions, HookContext, HookMatcher

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult

from ._emit import NO_APPROVALS, as_deny
from .claude_code import _SETTLE_S, ClaudeCodeOptions, answer

__all__ = ["DEFAULT_EVENTS", "SDK_EVENTS", "HookbusClaudeHooks"]

log = logging.getLogger("hookbus.integrations.claude_agent_sdk")

DEFAULT_EVENTS = ("PreToolUse", "PostToolUse", "UserPromptSubmit")
"""The Claude Code events hooked unless ``events`` says otherwise."""

SDK_EVENTS = (
    "PreToolUse",
    "PostToolUse",
    "PostToolUseFailure",
    "UserPromptSubmit",
    "Stop",
    "SubagentStop",
    "PreCompact",
    "Notification",
    "PermissionRequest",
)
"""The events both the SDK's ``hooks`` and the Claude Code door know."""

_TOOL_EVENTS = frozenset({"PreToolUse", "PostToolUse", "PostToolUseFailure", "PermissionRequest"})
"""Events whose matcher is a tool-name pattern."""

_FAIL_CLOSED = frozenset({"PreToolUse", "PermissionRequest"})
"""Events whose matcher blocks when the callback itself fails (``on_failure="block"``)."""

_MATCHER_SLACK_S = 5.0
"""Seconds past the door's own bound (`ClaudeCodeOptions.timeout_s` and its settle time)
before the SDK's matcher timeout cuts the callback: the fallback answers first."""


class HookbusClaudeHooks:
    """The Claude Agent SDK ``hooks`` of a `HookDispatcher` (see the module docstring).

    Args:
        dispatcher: a started `HookDispatcher` (connected, so remote handlers are called and
            ``ask_user`` is a durable approval). It stays the caller's.
        options: how decisions are answered, the fallback and the emit's deadline; None:
            ``ClaudeCodeOptions(on_ask_user="approval", on_modify="rules")``. Options of
            your own keep their ``on_modify`` (the door's default, ``"ask"``, makes a
            rewritten call wait for the SDK's ``can_use_tool``; without one the CLI refuses
            it), so pass ``on_modify="rules"`` with them.
        events: the Claude Code events to hook (of `SDK_EVENTS`); default `DEFAULT_EVENTS`.
        matcher: the tool-name matcher of the tool events' `HookMatcher` (``"Bash"``,
            ``"Write|Edit"``); None: every tool.

    Raises:
        TypeError: `dispatcher` is not a `HookDispatcher`.
        ValueError: an event outside `SDK_EVENTS`, or no event.
    """

    def __init__(
        self,
        dispatcher: HookDispatcher,
        *,
        options: ClaudeCodeOptions | None = None,
        events: Iterable[str] = DEFAULT_EVENTS,
        matcher: str | None = None,
    ) -> None:
        if not isinstance(dispatcher, HookDispatcher):
            raise TypeError(
                "HookbusClaudeHooks needs a hookbus HookDispatcher, got"
                f" {type(dispatcher).__name__}"
            )
        chosen = tuple(dict.fromkeys(events))
        unknown = sorted(set(chosen) - set(SDK_EVENTS))
        if unknown or not chosen:
            raise ValueError(
                f"events must be some of {', '.join(SDK_EVENTS)}; got {unknown or 'none'}"
            )
        self.dispatcher = dispatcher
        self.door = options or ClaudeCodeOptions(on_ask_user="approval", on_modify="rules")
        self.events = chosen
        self.matcher = matcher

    def hooks(self) -> dict[Any, list[HookMatcher]]:
        """``ClaudeAgentOptions.hooks``: one `HookMatcher` per event, calling `callback`."""
        timeout = self.door.timeout_s + _SETTLE_S + _MATCHER_SLACK_S
        return {
            name: [
                HookMatcher(
                    matcher=self.matcher if name in _TOOL_EVENTS else None,
                    hooks=[self.callback],
                    timeout=timeout,
                    on_failure="block" if name in _FAIL_CLOSED else None,
                )
            ]
            for name in self.events
        }

    def options(self, **kwargs: Any) -> ClaudeAgentOptions:
        """``ClaudeAgentOptions(**kwargs)`` with these hooks; a ``hooks`` in `kwargs` keeps
        its matchers, after hookbus's (hookbus decides first)."""
        mine: dict[Any, list[HookMatcher]] = self.hooks()
        for name, matchers in (kwargs.pop("hooks", None) or {}).items():
            mine[name] = [*mine.get(name, []), *matchers]
        return ClaudeAgentOptions(hooks=mine, **kwargs)

    async def callback(
        self, input_data: Any, tool_use_id: str | None, context: HookContext
    ) -> dict[str, Any]:
        """The SDK hook callback: the hook input emitted, the decision as hook output JSON.

        Raises:
            ValueError: an input the door refuses (not an event it knows, a field missing);
                the ``PreToolUse`` matcher blocks the tool then.
        """
        body = json.dumps(dict(input_data), ensure_ascii=False, default=str)
        reply = await answer(body, self._emit, self.door)
        if reply.exit_code != 0:
            raise ValueError(reply.stderr)
        if reply.fallback is not None:
            log.warning("%s", reply.stderr)
        out: dict[str, Any] = json.loads(reply.stdout) if reply.stdout else {}
        return out

    async def _emit(self, event: str, data: dict[str, Any], **options: Any) -> HookResult:
        """The dispatcher's emit; an ``ask_user`` it could not turn into an approval is a
        deny (nobody can answer it here)."""
        result = await self.dispatcher.emit(event, data, **options)
        if result.action == "ask_user":
            return as_deny(result, event, NO_APPROVALS, log=log)
        return result
