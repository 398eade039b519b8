"""Wire types of durable suspensions (hooks) and approvals.

The API and event semantics follow the Vercel AI SDK's hooks (a run suspends on a label,
emits `pending`, is resolved or cancelled from anywhere; a resolution that arrives first is
pre-registered and consumed by the next matching hook); the storage is a JetStream KV
record per label (`SUSPENSIONS_BUCKET`), changed only by compare-and-set.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ._types import _Wire

__all__ = [
    "APPROVAL_DEFAULT_OPTIONS",
    "ApprovalAnswer",
    "HookEvent",
    "HookPart",
    "HookStatus",
    "SuspensionRecord",
]

HookStatus = Literal["pending", "resolved", "cancelled"]
"""A suspension's state, as its events report it."""

APPROVAL_DEFAULT_OPTIONS: tuple[str, ...] = ("Allow", "Deny")
"""amplifier-core: ``approval_options=None`` means ``["Allow", "Deny"]``."""


class SuspensionRecord(_Wire):
    """The KV record of one label. Transitions (each a compare-and-set on the revision):

    absent -> pending (a waiter created it) -> resolved | cancelled;
    absent -> resolved with ``preregistered=True`` (resolve_hook came first);
    resolved -> resolved with ``consumed=True`` (a waiter took the value, exactly once).
    """

    label: str
    status: HookStatus
    hook_id: str = ""
    """Id of the waiting hook (empty for a pre-registered resolution)."""
    run_id: str | None = None
    """The run that created the pending hook; the same run may re-attach (resume)."""
    attached: bool = False
    """A waiter is currently waiting on it (False after abort, timeout or a crash resume)."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    payload_type: str | None = None
    """Name of the payload type the waiter expects."""
    payload_schema: dict[str, Any] | None = None
    """JSON Schema of the payload: a resolution that does not fit is refused at resolve time."""
    resolution: Any = None
    """The resolved value (JSON), once resolved."""
    reason: str | None = None
    """Why it was cancelled."""
    preregistered: bool = False
    consumed: bool = False
    created_at: float = 0.0
    """Seconds since the Unix epoch."""
    settled_at: float | None = None


class HookPart(_Wire):
    """What a hook event tells about one hook (the Vercel AI SDK's ``HookPart``)."""

    hook_id: str
    label: str
    status: HookStatus
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    resolution: Any = None
    reason: str | None = None


class HookEvent(_Wire):
    """Published on ``hookbus.v1.hooks.<label>.<status>`` at each transition."""

    hook: HookPart
    at: float = 0.0
    """Seconds since the Unix epoch."""


class ApprovalAnswer(_Wire):
    """The payload that resolves an approval suspension: one of the offered options."""

    choice: str
