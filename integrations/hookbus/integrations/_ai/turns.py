"""The assistant turn a model is giving in each run, for the messages a killed process's
run resumes from (``ai`` adds that turn to ``stream.messages`` only once all its tool calls
have finished)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from ai.types import events as ai_events
from ai.types import messages as ai_messages

__all__ = ["ModelTurns"]


class ModelTurns:
    """The model's turn of each run in progress, by the run's context."""

    def __init__(self) -> None:
        self._turns: dict[int, ai_messages.Message] = {}  # run context id -> model's turn

    async def follow(self, call: Any, next: Any) -> AsyncIterator[Any]:
        """``ai``'s ``wrap_agent_run``: the run's events, each model event's message (the
        assistant turn so far) noted until the run ends."""
        key = id(call)
        try:
            async with contextlib.aclosing(next(call)) as events:
                async for event in events:
                    message = getattr(event, "message", None)
                    if isinstance(event, ai_events.ModelEvent) and isinstance(
                        message, ai_messages.Message
                    ):
                        self._turns[key] = message
                    yield event
        finally:
            self._turns.pop(key, None)

    def resumable(self, stream: Any) -> list[ai_messages.Message]:
        """``stream.messages`` plus the assistant turn whose tool calls are running, if
        it is not in them yet (see `HookbusHooks.resumable_messages`)."""
        messages = list(stream.messages)
        turn = self._turns.get(id(stream.context))
        if turn is None or not turn.tool_calls:
            return messages
        if any(m is turn or m.id == turn.id for m in messages):
            return messages
        return [*messages, turn]
