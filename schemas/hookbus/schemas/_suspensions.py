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
    "SUSPENSION_MAX_BYTES",
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

SUSPENSION_MAX_BYTES = 256 * 1024
"""Largest encoded `SuspensionRecord` written or read (bytes); a bigger value in the bucket
is skipped as malformed."""


class SuspensionRecord(_Wire):
    """The KV record of one label. Transitions (each a compare-and-set on the revision):

    absent -> pending (a waiter created it) -> resolved | cancelled;
    absent -> resolved with ``preregistered=True`` (resolve_hook came first);
    resolved -> resolved with ``consumed=True`` (a waiter took the value, exactly once);
    an approval: resolved -> resolved with `used_by` (its one-time allow was used).

    Every write carries a fresh `write_id`, so a writer whose write had an unknown outcome
    (a lost ack) can tell its own write from another's by reading the key again.
    """

    label: str
    """The label the run suspended on (any text; encoded in the key)."""
    status: HookStatus
    """``pending`` (a waiter waits), ``resolved`` (a value was given) or ``cancelled``."""
    hook_id: str = ""
    """Id of the waiting hook (empty for a pre-registered resolution)."""
    agent_id: str | None = None
    """The agent the record belongs to: its key is ``<agent>.<label>`` (see
    `suspension_key`), so NATS permissions can keep agents out of each other's records."""
    run_id: str | None = None
    """The run that created the pending hook; the same run may re-attach (resume)."""
    attached: bool = False
    """A waiter is currently waiting on it (False after abort, timeout or a crash resume)."""
    owner: str = ""
    """Waiter id of the process whose waiter holds it (empty: none). That process keeps a
    lease key alive in the leases bucket; once the lease is gone the record may be taken
    over by a new ``hook(label)``."""
    write_id: str = ""
    """Unique id of the write that stored this version (reconciles lost acks)."""
    lineage: list[str] = msgspec.field(default_factory=list)
    """Write ids of the versions this one replaced, newest first (a few): a writer whose
    write was replaced before it could read it back still finds it here."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    """What the waiter attached for whoever resolves it (for an approval: an
    `ApprovalMetadata`)."""
    payload_type: str | None = None
    """Name of the payload type the waiter expects."""
    payload_schema: dict[str, Any] | None = None
    """JSON Schema of the payload: a resolution that does not fit is refused at resolve time."""
    resolution: Any = None
    """The resolved value (JSON), once resolved."""
    reason: str | None = None
    """Why it was cancelled."""
    preregistered: bool = False
    """True: the resolution came before any waiter (a later ``hook(label)`` consumes it)."""
    consumed: bool = False
    """True: a waiter took the resolution (exactly once). The waiter that held the record
    (`owner`, `attached`) when it was resolved returns at once and writes this just after;
    until then the resolution is its owner's, refused to other processes while the owner's
    lease lives."""
    used_by: str = ""
    """For an approval: the id of the decision that used up its one-time allow (an
    allowing answer other than "Allow always"), written by compare-and-set, so of two
    deciders one gets the allow; empty: not used. A call retried with the same idempotency
    key after that is asked again, in a fresh approval."""
    created_at: float = 0.0
    """When the record was created: seconds since the Unix epoch."""
    created_over: int = 0
    """The revision (stream sequence) of what this hook's pending record was written over:
    an earlier hook's record on the label, or its delete marker (0: a key never written).
    An answer proof stored at or below it answered an earlier hook, never this one."""
    settled_at: float | None = None
    """When it was resolved or cancelled: seconds since the Unix epoch; None while pending."""


class HookPart(_Wire):
    """What a suspension event tells about one suspension (the Vercel AI SDK's ``HookPart``)."""

    hook_id: str
    """Id of the waiting hook (empty for a pre-registered resolution)."""
    label: str
    """The hook's label."""
    status: HookStatus
    """The state this event reports: ``pending``, ``resolved`` or ``cancelled``."""
    agent_id: str | None = None
    """The agent whose hook it is (also the ``<agent>`` token of the event's subject)."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    """The record's metadata (for an approval: an `ApprovalMetadata`)."""
    resolution: Any = None
    """The resolved value (JSON) for ``resolved``; None otherwise."""
    reason: str | None = None
    """Why it was cancelled, for ``cancelled``."""


class HookEvent(_Wire):
    """A suspension event (the Vercel AI SDK's name): published on
    ``hookbus.v1.suspension.<agent>.<label>.<status>`` at each transition."""

    hook: HookPart
    """The hook and its new state."""
    at: float = 0.0
    """Seconds since the Unix epoch."""


class ApprovalAnswer(_Wire):
    """The payload that resolves an approval suspension: one of the offered options, and
    who chose it.

    An approver writes it twice: first as its answer proof under
    ``<agent>.<label>.<approver>`` (a key only that approver's NATS user may write), then
    as the record's resolution. A dispatcher accepts a resolution only when the proof of
    `answered_by` holds the same choice, so no other client (the agent included) can
    answer an approval by writing the record.
    """

    choice: str
    """One of the approval's options (`ApprovalMetadata.options`), e.g. ``"Allow once"``."""
    answered_by: str | None = None
    """The approver's name, as its NATS permissions establish it (the proof key's last
    segment)."""
    answered_at: float | None = None
    """Seconds since the Unix epoch."""
    kind: Literal["answer", "cancel"] = "answer"
    """``"answer"``: `choice` answers the approval. ``"cancel"`` (a proof only, `choice`
    empty): the approver ends the approval without an answer; the decider closes it as
    cancelled, reason ``"by <answered_by>"`` (``": <reason>"`` appended when given), and the
    waiting call is denied."""
    reason: str | None = None
    """Why a cancel was given (None for an answer)."""
