"""Event names: amplifier-core's list, with the same constant names and strings.

Source: amplifier-core 2.0.2, `amplifier_core.events` (the constants and ``ALL_EVENTS``)
and `amplifier_core.hooks.HookRegistry` (the eight it carries as class attributes).
hookbus adds no event names of its own; any other name is a custom event. Every name here
is also exported by `hookbus.schemas` (and `hookbus.amplifier`, as amplifier-core's
`HookRegistry` module exports them).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ALL_EVENTS",
    "APPROVAL_DENIED",
    "APPROVAL_GRANTED",
    "APPROVAL_REQUIRED",
    "ARTIFACT_READ",
    "ARTIFACT_WRITE",
    "CANCEL_COMPLETED",
    "CANCEL_REQUESTED",
    "CONTENT_BLOCK_DELTA",
    "CONTENT_BLOCK_END",
    "CONTENT_BLOCK_START",
    "CONTEXT_COMPACTION",
    "CONTEXT_INCLUDE",
    "CONTEXT_POST_COMPACT",
    "CONTEXT_PRE_COMPACT",
    "EXECUTION_END",
    "EXECUTION_START",
    "LLM_REQUEST",
    "LLM_RESPONSE",
    "MODULE_LOAD_FAILED",
    "MODULE_ON_SESSION_READY_FAILED",
    "ORCHESTRATOR_COMPLETE",
    "PLAN_END",
    "PLAN_START",
    "POLICY_VIOLATION",
    "PROMPT_COMPLETE",
    "PROMPT_SUBMIT",
    "PROVIDER_ERROR",
    "PROVIDER_REQUEST",
    "PROVIDER_RESOLVE",
    "PROVIDER_RESPONSE",
    "PROVIDER_RETRY",
    "PROVIDER_THROTTLE",
    "PROVIDER_TOOL_SEQUENCE_REPAIRED",
    "SESSION_END",
    "SESSION_FORK",
    "SESSION_RESUME",
    "SESSION_START",
    "STANDARD_EVENTS",
    "THINKING_DELTA",
    "THINKING_FINAL",
    "TOOL_ERROR",
    "TOOL_POST",
    "TOOL_PRE",
    "USER_NOTIFICATION",
    "StandardEvents",
]

# Session lifecycle
SESSION_START: Final = "session:start"
SESSION_END: Final = "session:end"
SESSION_FORK: Final = "session:fork"
SESSION_RESUME: Final = "session:resume"
# Prompt lifecycle
PROMPT_SUBMIT: Final = "prompt:submit"
PROMPT_COMPLETE: Final = "prompt:complete"
# Planning
PLAN_START: Final = "plan:start"
PLAN_END: Final = "plan:end"
# Provider calls
PROVIDER_REQUEST: Final = "provider:request"
PROVIDER_RESPONSE: Final = "provider:response"
PROVIDER_RETRY: Final = "provider:retry"
PROVIDER_ERROR: Final = "provider:error"
PROVIDER_THROTTLE: Final = "provider:throttle"
PROVIDER_TOOL_SEQUENCE_REPAIRED: Final = "provider:tool_sequence_repaired"
PROVIDER_RESOLVE: Final = "provider:resolve"
# LLM events
LLM_REQUEST: Final = "llm:request"
LLM_RESPONSE: Final = "llm:response"
# Content blocks
CONTENT_BLOCK_START: Final = "content_block:start"
CONTENT_BLOCK_DELTA: Final = "content_block:delta"
CONTENT_BLOCK_END: Final = "content_block:end"
# Thinking
THINKING_DELTA: Final = "thinking:delta"
THINKING_FINAL: Final = "thinking:final"
# Tool invocations
TOOL_PRE: Final = "tool:pre"
TOOL_POST: Final = "tool:post"
TOOL_ERROR: Final = "tool:error"
# Context management
CONTEXT_PRE_COMPACT: Final = "context:pre_compact"
CONTEXT_POST_COMPACT: Final = "context:post_compact"
CONTEXT_COMPACTION: Final = "context:compaction"
CONTEXT_INCLUDE: Final = "context:include"
# Orchestrator lifecycle
ORCHESTRATOR_COMPLETE: Final = "orchestrator:complete"
EXECUTION_START: Final = "execution:start"
EXECUTION_END: Final = "execution:end"
# User notifications
USER_NOTIFICATION: Final = "user:notification"
# Artifacts
ARTIFACT_WRITE: Final = "artifact:write"
ARTIFACT_READ: Final = "artifact:read"
# Policy and approvals
POLICY_VIOLATION: Final = "policy:violation"
APPROVAL_REQUIRED: Final = "approval:required"
APPROVAL_GRANTED: Final = "approval:granted"
APPROVAL_DENIED: Final = "approval:denied"
# Cancellation
CANCEL_REQUESTED: Final = "cancel:requested"
CANCEL_COMPLETED: Final = "cancel:completed"
# Module lifecycle
MODULE_ON_SESSION_READY_FAILED: Final = "module:on_session_ready_failed"
MODULE_LOAD_FAILED: Final = "module:load_failed"

ALL_EVENTS: Final[list[str]] = [
    SESSION_START, SESSION_END, SESSION_FORK, SESSION_RESUME,
    PROMPT_SUBMIT, PROMPT_COMPLETE, PLAN_START, PLAN_END,
    PROVIDER_REQUEST, PROVIDER_RESPONSE, PROVIDER_RETRY, PROVIDER_ERROR,
    PROVIDER_THROTTLE, PROVIDER_TOOL_SEQUENCE_REPAIRED, PROVIDER_RESOLVE,
    LLM_REQUEST, LLM_RESPONSE,
    CONTENT_BLOCK_START, CONTENT_BLOCK_DELTA, CONTENT_BLOCK_END,
    THINKING_DELTA, THINKING_FINAL,
    TOOL_PRE, TOOL_POST, TOOL_ERROR,
    CONTEXT_PRE_COMPACT, CONTEXT_POST_COMPACT, CONTEXT_COMPACTION, CONTEXT_INCLUDE,
    ORCHESTRATOR_COMPLETE, EXECUTION_START, EXECUTION_END,
    USER_NOTIFICATION,
    ARTIFACT_WRITE, ARTIFACT_READ,
    POLICY_VIOLATION, APPROVAL_REQUIRED, APPROVAL_GRANTED, APPROVAL_DENIED,
    CANCEL_REQUESTED, CANCEL_COMPLETED,
    MODULE_ON_SESSION_READY_FAILED, MODULE_LOAD_FAILED,
]  # fmt: skip
"""Every standard event, in amplifier-core's order (its ``ALL_EVENTS`` is a list too)."""

STANDARD_EVENTS: Final[frozenset[str]] = frozenset(ALL_EVENTS)
"""The same names as a set: what ``strict_events`` accepts without a handler."""


class StandardEvents:
    """The eight event constants amplifier-core's `HookRegistry` carries as class attributes.

    `HookDispatcher` inherits from this, so ``HookDispatcher.TOOL_PRE`` works as
    ``HookRegistry.TOOL_PRE`` does; every other constant is a module-level name here.
    """

    SESSION_START = SESSION_START
    SESSION_END = SESSION_END
    PROMPT_SUBMIT = PROMPT_SUBMIT
    TOOL_PRE = TOOL_PRE
    TOOL_POST = TOOL_POST
    CONTEXT_PRE_COMPACT = CONTEXT_PRE_COMPACT
    ORCHESTRATOR_COMPLETE = ORCHESTRATOR_COMPLETE
    USER_NOTIFICATION = USER_NOTIFICATION
