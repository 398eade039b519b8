"""hookbus's hook events as ``ai``'s ``HookEvent``."""

from __future__ import annotations

from typing import Any

from ai.types import events as ai_events
from ai.types import messages as ai_messages

from hookbus.dispatcher import HookEventStream
from hookbus.schemas import HookEvent, HookPart

from .labels import AI_METADATA_KEY

__all__ = ["AIHookEvents", "ai_hook_part"]


def ai_hook_part(part: HookPart) -> ai_messages.HookPart[Any]:
    """hookbus's `HookPart` as ``ai``'s (``hook_id`` = the label; ``hook_type`` and
    ``tool_call_id`` from the ``"_ai"`` metadata key, which is removed)."""
    metadata = dict(part.metadata)
    extra = metadata.pop(AI_METADATA_KEY, None)
    extra = extra if isinstance(extra, dict) else {}
    return ai_messages.HookPart(
        hook_id=part.label,
        hook_type=str(extra.get("hook_type") or ""),
        status=part.status,
        metadata=metadata,
        resolution=part.resolution,
        tool_call_id=extra.get("tool_call_id"),
    )


class AIHookEvents:
    """hookbus hook events as ``ai``'s ``HookEvent`` (see `HookbusHooks.events`)."""

    def __init__(self, stream: HookEventStream) -> None:
        self._stream = stream

    def __aiter__(self) -> AIHookEvents:
        return self

    async def __anext__(self) -> ai_events.HookEvent:
        event: HookEvent = await self._stream.__anext__()
        part = ai_hook_part(event.hook)
        message = ai_messages.Message(role="internal", parts=[part])
        return ai_events.HookEvent(message=message, hook=part)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> AIHookEvents:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
