"""The decision audit trail's wire type and stream configuration (data only, no I/O).

A dispatcher with the audit trail on appends one `DecisionRecord` per decided emit to the
JetStream stream `DECISIONS_STREAM`, on ``hookbus.v1.decisions.<agent>``
(`decisions_subject`). The stream keeps records by age and size (limits retention, the
oldest discarded first); `decisions_stream_config` is the configuration it is created with.
"""

from __future__ import annotations

import msgspec
from nats.js.api import DiscardPolicy, Placement, RetentionPolicy, StorageType, StreamConfig

from ._subjects import DECISIONS_STREAM, DECISIONS_WILDCARD
from ._types import Action, HandlerFailure, _Wire

__all__ = [
    "DECISIONS_DEFAULT_MAX_AGE_S",
    "DECISIONS_DEFAULT_MAX_BYTES",
    "DecisionRecord",
    "decisions_stream_config",
]

DECISIONS_DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0
"""Records older than this (30 days) are removed by the server."""
DECISIONS_DEFAULT_MAX_BYTES = 1 << 30
"""Past this size (1 GiB) the oldest records are removed first."""


class DecisionRecord(_Wire, omit_defaults=False):
    """One decided emit, as the audit trail stores it (every field encoded, defaults too,
    so a reader in any language sees ``null`` rather than a missing key).

    Written once per emit that returned a result (an emit that raised decided nothing and
    leaves no record); never updated. A retry of a call (same `idempotency_key`) that is
    decided again is a second record with the same `idempotency_key` and a new `emit_id`.
    """

    id: str
    """Unique id of this record (hex); also its JetStream ``Nats-Msg-Id``, so a publish
    retried after a lost acknowledgement is stored once."""
    event: str
    """The emitted event."""
    action: Action
    """The decision: the folded action `emit` returned."""
    time: float
    """When the decision was taken: seconds since the Unix epoch (the recorder's clock)."""
    time_iso: str
    """`time` as an RFC 3339 (ISO 8601) UTC timestamp, e.g.
    ``2026-01-02T03:04:05.123456+00:00``."""
    emit_id: str
    """The emit's id, as every handler of the call received it (`EventEnvelope.id`):
    fresh for every emit (the caller's key is `idempotency_key`)."""
    idempotency_key: str | None = None
    """The key the caller gave, None when it gave none."""
    agent_id: str | None = None
    """The agent the call was made for (the dispatcher's pinned agent, else the data's)."""
    session_id: str | None = None
    """The call's session (``data["session_id"]``), None when it had none."""
    tool_name: str | None = None
    """``data["tool_name"]`` of the call, None when it named no tool."""
    handlers: list[str] = msgspec.field(default_factory=list)
    """The handlers called, in the order they were called (a handler skipped by its tool
    filter or after a deny is not in it)."""
    decided_by: str | None = None
    """The handler whose result decided (`HookResult.decided_by`)."""
    reason: str | None = None
    """The decision's reason (`HookResult.reason`)."""
    failures: list[HandlerFailure] = msgspec.field(default_factory=list)
    """Every handler failure with the policy applied (`HookResult.failures`)."""
    approver: str | None = None
    """Who answered the approval that decided the call (`HookResult.approved_by`); None
    when no human answered."""
    trace_id: str | None = None
    """The OpenTelemetry trace of the emit (32 hex digits); None when tracing is off."""
    duration_ms: float | None = None
    """How long the emit took to decide, in milliseconds (a float, >= 0): from the start of
    the emit's handler chain to its final decision, on the recorder's monotonic clock (so a
    wall-clock step does not change it). It includes every handler call, retry and hedge,
    and the wait for a human's answer when an approval decided. None in records written
    before hookbus recorded it. Named in the spirit of OpenTelemetry's ``*.duration``
    measurements, in milliseconds for people reading the trail; the
    ``hookbus.emit.duration`` metric (seconds) times the whole `emit` call, which also
    counts checking the data before the chain starts."""


def decisions_stream_config(
    *,
    max_age_s: float = DECISIONS_DEFAULT_MAX_AGE_S,
    max_bytes: int = DECISIONS_DEFAULT_MAX_BYTES,
    replicas: int = 1,
    placement: Placement | None = None,
) -> StreamConfig:
    """The `DECISIONS_STREAM` config: every ``hookbus.v1.decisions.*`` subject, file
    storage, limits retention (records are kept until they are older than `max_age_s`
    seconds or the stream exceeds `max_bytes`; then the oldest go first), no deletion of
    single records (`deny_delete`: an audit record is never removed on its own), a 2-minute
    duplicate window for retried publishes. `replicas`: 3 on a cluster. `placement`: where
    JetStream puts its replicas (cluster, server tags; None: JetStream chooses)."""
    return StreamConfig(
        name=DECISIONS_STREAM,
        description="hookbus decision audit trail: one record per decided emit",
        subjects=[DECISIONS_WILDCARD],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=120.0,
        deny_delete=True,
        placement=placement,
    )
