"""A worker's handler as it holds it: its function and its declaration (`HandlerSpec`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hookbus.schemas import HandlerDeclaration, ToolFilter

__all__ = ["Handler", "HandlerSpec"]

Handler = Callable[[str, dict[str, Any]], Any]
"""``(event, data) -> HookResult | dict | None``, sync or async (amplifier-core signature)."""


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """One handler of a worker: its function and its declaration."""

    fn: Handler
    declaration: HandlerDeclaration
    is_async: bool = False
    """Whether `fn` is a coroutine function (sync ones run in a worker thread)."""
    tool_filter: ToolFilter = ToolFilter.EVERY
    """The declaration's tool filter, compiled (`ToolFilter.EVERY`: every call matches)."""
    key: tuple[str, str] = field(init=False, repr=False, compare=False)
    """(event, handler name): the handler's identity in this worker (made once: a chain
    reads it at every step)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.declaration.event, self.declaration.name))

    def matches(self, data: dict[str, Any]) -> bool:
        """Whether the tool filter admits ``data["tool_name"]``: `ToolFilter.matches`, the
        same judgement dispatchers make (`Route.matches`)."""
        return self.tool_filter.matches(data)
