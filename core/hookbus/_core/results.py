"""Turning what a handler returned into a `HookResult` (pure; shared by both sides)."""

from __future__ import annotations

from typing import Any, get_args

import msgspec

from hookbus.schemas import Action, ContextInjection, HookResult, WireFormatError

__all__ = ["to_hook_result"]

_ACTIONS = frozenset(get_args(Action))
_CONTINUE = HookResult()
"""What a handler returning None means (shared: results are never changed in place)."""


def to_hook_result(raw: Any) -> HookResult:
    """A handler's return value as a valid `HookResult`.

    Accepts a `HookResult`; ``None`` (continue); a dict of `HookResult` fields (unknown
    keys ignored, a missing ``action`` is continue); or any object with ``model_dump()``
    such as amplifier-core's pydantic `HookResult`. A `HookResult` is checked as a dict
    would be (msgspec does not validate on construction): an unknown ``action``, data
    that is not a dict or a field of the wrong type is refused, never read as continue.

    Raises:
        WireFormatError: anything else, or fields that do not fit (message has the path).
            The dispatcher denies such a result, as amplifier-core denies a handler result
            it cannot parse.
    """
    if isinstance(raw, HookResult):
        if _plainly_valid(raw):
            return raw
        raw = msgspec.to_builtins(raw)
    elif raw is None:
        return _CONTINUE
    elif hasattr(raw, "model_dump"):
        raw = raw.model_dump(exclude_none=True)
    if isinstance(raw, dict):
        try:
            return msgspec.convert(raw, HookResult)
        except msgspec.ValidationError as exc:
            raise WireFormatError(f"result does not fit HookResult: {exc}") from exc
    raise WireFormatError(f"handler returned {type(raw).__name__}, not a HookResult")


def _plainly_valid(r: HookResult) -> bool:
    """The fast check of the fields a decision reads; anything else goes through a full
    conversion (which also turns dict items of `context_injections` into the type)."""
    return (
        r.action in _ACTIONS
        and (r.data is None or type(r.data) is dict)
        and (r.reason is None or type(r.reason) is str)
        # most results inject nothing: no generator for an empty list
        and (
            not r.context_injections
            or all(type(i) is ContextInjection for i in r.context_injections)
        )
        and (r.context_injection is None or type(r.context_injection) is str)
    )
