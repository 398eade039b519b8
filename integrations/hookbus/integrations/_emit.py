"""The one call every door makes: emit an event and get the folded `HookResult`.

A door (the Claude Code command hook, the HTTP gateway, the AOS guardian endpoint) maps its
protocol's message to a hookbus event and data, calls an `Emit`, and maps the result back.
`HookDispatcher.emit` is an `Emit` (an in-process dispatcher); so is a function that sends an
`EmitRequest` to the dispatcher service. This module imports nothing but the wire types, so a
door that uses it stays cheap to import.
"""

from __future__ import annotations

from typing import Any, Protocol

from hookbus.schemas import HookResult

__all__ = ["Emit"]


class Emit(Protocol):
    """``await emit(event, data, idempotency_key=..., timeout_s=...) -> HookResult``.

    The shape of `HookDispatcher.emit`. Raises what it raises (`hookbus.schemas.HookbusError`
    subclasses); a door answers those with its protocol's fallback, never a traceback.
    """

    async def __call__(
        self,
        event: str,
        data: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        timeout_s: float | None = None,
    ) -> HookResult: ...
