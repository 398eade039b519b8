"""Standard event names, as amplifier-core's `HookRegistry` defines them.

Source: amplifier-core `amplifier_core/hooks.py` (`HookRegistry.SESSION_START`, ...).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "AGENT_COMPLETE",
    "AGENT_SPAWN",
    "CONTEXT_PRE_COMPACT",
    "DECISION_AGENT_RESOLUTION",
    "DECISION_CONTEXT_RESOLUTION",
    "DECISION_TOOL_RESOLUTION",
    "ERROR_ORCHESTRATION",
    "ERROR_PROVIDER",
    "ERROR_TOOL",
    "ORCHESTRATOR_COMPLETE",
    "PROMPT_SUBMIT",
    "SESSION_END",
    "SESSION_START",
    "STANDARD_EVENTS",
    "TOOL_POST",
    "TOOL_PRE",
    "USER_NOTIFICATION",
    "StandardEvents",
]

# Lifecycle events
SESSION_START: Final = "session:start"
SESSION_END: Final = "session:end"
PROMPT_SUBMIT: Final = "prompt:submit"
TOOL_PRE: Final = "tool:pre"
TOOL_POST: Final = "tool:post"
CONTEXT_PRE_COMPACT: Final = "context:pre-compact"
AGENT_SPAWN: Final = "agent:spawn"
AGENT_COMPLETE: Final = "agent:complete"
ORCHESTRATOR_COMPLETE: Final = "orchestrator:complete"
USER_NOTIFICATION: Final = "user:notification"
# Decision events
DECISION_TOOL_RESOLUTION: Final = "decision:tool_resolution"
DECISION_AGENT_RESOLUTION: Final = "decision:agent_resolution"
DECISION_CONTEXT_RESOLUTION: Final = "decision:context_resolution"
# Error events
ERROR_TOOL: Final = "error:tool"
ERROR_PROVIDER: Final = "error:provider"
ERROR_ORCHESTRATION: Final = "error:orchestration"

STANDARD_EVENTS: Final[frozenset[str]] = frozenset(
    {
        SESSION_START,
        SESSION_END,
        PROMPT_SUBMIT,
        TOOL_PRE,
        TOOL_POST,
        CONTEXT_PRE_COMPACT,
        AGENT_SPAWN,
        AGENT_COMPLETE,
        ORCHESTRATOR_COMPLETE,
        USER_NOTIFICATION,
        DECISION_TOOL_RESOLUTION,
        DECISION_AGENT_RESOLUTION,
        DECISION_CONTEXT_RESOLUTION,
        ERROR_TOOL,
        ERROR_PROVIDER,
        ERROR_ORCHESTRATION,
    }
)


class StandardEvents:
    """The event constants as class attributes, the way `HookRegistry` carries them.

    `HookDispatcher` inherits from this, so ``HookDispatcher.TOOL_PRE`` works as
    ``HookRegistry.TOOL_PRE`` does in amplifier-core.
    """

    SESSION_START = SESSION_START
    SESSION_END = SESSION_END
    PROMPT_SUBMIT = PROMPT_SUBMIT
    TOOL_PRE = TOOL_PRE
    TOOL_POST = TOOL_POST
    CONTEXT_PRE_COMPACT = CONTEXT_PRE_COMPACT
    AGENT_SPAWN = AGENT_SPAWN
    AGENT_COMPLETE = AGENT_COMPLETE
    ORCHESTRATOR_COMPLETE = ORCHESTRATOR_COMPLETE
    USER_NOTIFICATION = USER_NOTIFICATION
    DECISION_TOOL_RESOLUTION = DECISION_TOOL_RESOLUTION
    DECISION_AGENT_RESOLUTION = DECISION_AGENT_RESOLUTION
    DECISION_CONTEXT_RESOLUTION = DECISION_CONTEXT_RESOLUTION
    ERROR_TOOL = ERROR_TOOL
    ERROR_PROVIDER = ERROR_PROVIDER
    ERROR_ORCHESTRATION = ERROR_ORCHESTRATION
