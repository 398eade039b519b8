"""Reading suspension records back (pure, no I/O): which keys of the suspensions bucket
are records (`is_record_key`), and `parse_record`, which validates a value read there,
for the dispatcher's record store and the console's feed alike (a value that fails is
skipped by both, never raised)."""

from __future__ import annotations

import math

from hookbus.schemas import (
    SUSPENSION_MAX_BYTES,
    BadRequestError,
    HookbusError,
    SuspensionRecord,
    decode,
    suspension_key,
)

__all__ = ["is_record_key", "parse_record"]


def is_record_key(key: str) -> bool:
    """Whether a bucket key is a record's (``<agent>.<label>``, two tokens), not an
    approver's answer proof (``<agent>.<label>.<approver>``) or an "Allow always" grant
    (five tokens, in the approvals bucket), which the record store ignores."""
    return key.count(".") == 1


def parse_record(key: str, value: bytes | None) -> SuspensionRecord | str:
    """Validate a stored value: the record, or the reason it is unusable.

    Checks the size (`SUSPENSION_MAX_BYTES`), JSON and UTF-8, every field's type, a finite
    ``created_at``, and that the record's agent and label are the ones its key encodes.
    """
    if not value:
        return "empty value"
    if len(value) > SUSPENSION_MAX_BYTES:
        return f"{len(value)} bytes, more than {SUSPENSION_MAX_BYTES}"
    try:
        record = decode(value, SuspensionRecord)
    except HookbusError as exc:
        return str(exc)
    if not math.isfinite(record.created_at):
        return "created_at is not a finite number"
    try:
        if suspension_key(record.label, record.agent_id) != key:
            return f"its agent and label {record.label[:80]!r} do not match its key"
    except BadRequestError as exc:
        return str(exc)
    return record
