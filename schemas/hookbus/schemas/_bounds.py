"""The bounds of a handler registry record (a `HandlerDeclaration` or `RequiredHandler`
value): every implementation that writes or reads one keeps to them, and the JSON Schema
(`json_schemas`) states them."""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_HANDLER_TIMEOUT_S", "MAX_PRIORITY", "MAX_RECORD_BYTES", "MAX_TOOL_PATTERNS"]

MAX_HANDLER_TIMEOUT_S: Final = 60.0
"""Longest per-call timeout a handler may have, in seconds (larger ones are clamped)."""
MAX_PRIORITY: Final = 1_000_000
"""Priorities of remote handlers are ints within ``[-MAX_PRIORITY, MAX_PRIORITY]``."""
MAX_TOOL_PATTERNS: Final = 64
"""Most globs in one ``tool_filter``."""
MAX_RECORD_BYTES: Final = 4096
"""Largest registry value accepted, in bytes."""
