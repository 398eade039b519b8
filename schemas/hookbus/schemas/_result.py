"""Turning what a handler returned into a `HookResult` (pure; shared by both sides)."""

from __future__ import annotations

from typing import Any

import msgspec

from ._errors import WireFormatError
from ._types import HookResult

__all__ = ["to_hook_result"]


def to_hook_result(raw: Any) -> HookResult:
    """A handler's return value as a `HookResult`.

    Accepts a `HookResult`; ``None`` (continue); a dict of `HookResult` fields; or any
    object with ``model_dump()`` such as amplifier-core's pydantic `HookResult`.

    Raises:
        WireFormatError: anything else, or fields that do not fit (message has the path).
    """
    if isinstance(raw, HookResult):
        return raw
    if raw is None:
        return HookResult()
    if hasattr(raw, "model_dump"):
        raw = raw.model_dump(exclude_none=True)
    if isinstance(raw, dict):
        try:
            return msgspec.convert(raw, HookResult)
        except msgspec.ValidationError as exc:
            raise WireFormatError(f"result does not fit HookResult: {exc}") from exc
    raise WireFormatError(f"handler returned {type(raw).__name__}, not a HookResult")
