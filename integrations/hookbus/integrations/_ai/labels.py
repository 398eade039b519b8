"""How a hook of the ``ai`` integration is named and marked, and what its parts read of the
`HookbusHooks` they serve."""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol, TypeVar

import pydantic
from ai.types import messages as ai_messages
from ai.types import tools as ai_tools

from hookbus.dispatcher import Suspensions
from hookbus.schemas import HookPart

__all__ = [
    "AI_METADATA_KEY",
    "AI_TRACE_KEY",
    "APPROVAL_LABEL_PREFIX",
    "HookTarget",
    "HooksSettings",
    "M",
    "as_json",
    "is_tool_approval",
    "label_of",
    "log",
    "resolution_value",
]

M = TypeVar("M", bound=pydantic.BaseModel)

log = logging.getLogger("hookbus.integrations.ai")

APPROVAL_LABEL_PREFIX = "approve_"
"""``ai``'s tool approval labels start with this (``approve_<tool call id>``)."""

AI_METADATA_KEY = "_ai"
"""The key of a record's metadata that holds what ``ai``'s ``HookPart`` needs besides the
caller's metadata: ``{"hook_type": str, "tool_call_id": str | None}``; a used tool approval
adds ``"used_in"`` (the run id) and ``"ran"`` (the tool's results, ``ToolResultPart`` JSON)."""

AI_TRACE_KEY = "trace"
"""In the ``"_ai"`` metadata, with tracing on: the W3C ``traceparent`` of the run (or emit)
that created the suspension; the ``await suspension`` span of a later wait on it (a resumed
run, in any process) links to it."""

HookTarget = str | ai_messages.HookPart[Any] | HookPart
"""A hook as the functions here take it: its label, ``ai``'s ``HookPart`` (whose
``hook_id`` is the label) or hookbus's `HookPart` (its ``label``)."""


class HooksSettings(Protocol):
    """What the parts read of the `HookbusHooks` they serve, at each use (its attributes
    may be changed after it was made)."""

    suspensions: Suspensions
    timeout_s: float | None
    approval_default: Literal["deny", "allow"]
    session_id: str | None
    emit_timeout_s: float | None


def label_of(target: HookTarget) -> str:
    """The label of `target`.

    Raises:
        TypeError: `target` is neither a label nor a `HookPart`.
    """
    if isinstance(target, str):
        return target
    if isinstance(target, ai_messages.HookPart):
        return target.hook_id
    if isinstance(target, HookPart):
        return target.label
    raise TypeError(f"expected a label or a HookPart, got {type(target).__name__}")


def as_json(value: Any) -> Any:
    """A resolution as JSON data (what the record stores)."""
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    return value


def resolution_value(data: Any, payload: type[pydantic.BaseModel] | None) -> Any:
    """A resolution given as a pydantic model or a dict (validated as `payload` first
    when given) as the JSON data the record stores.

    Raises:
        pydantic.ValidationError: the dict does not validate as `payload`.
        TypeError: `data` is neither.
    """
    if isinstance(data, pydantic.BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, dict):
        return payload(**data).model_dump(mode="json") if payload is not None else data
    raise TypeError(f"expected a dict or a pydantic model, got {type(data).__name__}")


def is_tool_approval(label: str, payload: type[Any] | None) -> bool:
    """Whether the hook `label` with `payload` is a tool approval, decided only by an
    approver's proof: its payload is ``ai``'s ``ToolApproval`` (or a subclass), or its label
    starts with ``approve_``."""
    if isinstance(payload, type) and issubclass(payload, ai_tools.ToolApproval):
        return True
    return label.startswith(APPROVAL_LABEL_PREFIX)
