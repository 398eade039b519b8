"""Settling a hook: resolving, clearing and cancelling its record (`Settling`, the
settling side of `Suspensions`).

Each is a compare-and-set on the record's revision, judged again on the new state when
another writer changed it first. The revision comes from the shared watch when it has
the record (no read first: `Suspensions` gives that hint); a stale hint loses its
compare-and-set, and a refusal (already settled, a value that does not fit) is only
made on a fresh read. A resolution is checked against the payload's JSON Schema kept in
the record before it is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from hookbus.schemas import (
    AlreadySettledError,
    ResolutionRejectedError,
    SuspensionNotFoundError,
    SuspensionRecord,
)

from ._records import Entry, RecordStore
from ._run_scopes import note_label
from ._suspension_events import Validators, check, publish, settled, to_json_value

__all__ = ["Settling"]


class Settling:
    """The settling side of one store (`Suspensions`) addressing one agent's records.

    Args:
        nc: the connection the settled events are published on.
        records: the record store (this agent's key space).
        validators: the compiled payload schemas resolutions are checked against.
        hint: the shared watch's last valid entry of a label (None: read it).
    """

    def __init__(
        self,
        nc: NATS,
        records: RecordStore,
        validators: Validators,
        hint: Callable[[str], Entry | None],
    ) -> None:
        self._nc = nc
        self.records = records
        self._validators = validators
        self._hint = hint

    async def resolve(self, label: str, value: Any, *, replace: bool) -> SuspensionRecord:
        """`Suspensions.resolve_hook`, within the caller's deadline."""
        note_label(label)
        data = to_json_value(value)
        hint = self._hint(label)
        while True:
            hinted = hint is not None
            entry = hint if hint is not None else await self.records.latest(label)
            hint = None
            now = time.time()
            if entry is None or entry.record is None:
                record = SuspensionRecord(
                    label=label, status="resolved", resolution=data, preregistered=True,
                    agent_id=self.records.agent_id,
                    created_at=now, settled_at=now,
                )  # fmt: skip
                if await self.records.create(record, over=entry) is None:
                    continue
                return record
            record = entry.record
            settled_unconsumed = record.status == "resolved" and not record.consumed
            if record.status != "pending" and not (replace and settled_unconsumed):
                if hinted:
                    continue  # the watch's value may be stale: refuse on a read only
                raise AlreadySettledError(f"hook {label!r} is already {settled(record)}")
            if record.payload_schema is not None:
                try:
                    check(record, data, self._validators.get(record.payload_schema))
                except ResolutionRejectedError:
                    if hinted:
                        continue
                    raise
            resolved = msgspec.structs.replace(
                record, status="resolved", resolution=data, settled_at=now
            )
            if await self.records.swap(resolved, last=entry.revision) is None:
                continue  # changed under us: judge again on the new state
            if not resolved.preregistered:
                await publish(self._nc, resolved)
            return resolved

    async def clear(self, label: str) -> bool:
        """`Suspensions.clear_hook`."""
        while True:
            entry = await self.records.read(label)
            if entry is None:
                return False
            record = entry.record
            if record is None or (record.preregistered and not record.consumed):
                if await self.records.delete(label, last=entry.revision):
                    return True
                continue
            if record.status != "resolved" or record.consumed:
                return False
            back = msgspec.structs.replace(
                record, status="pending", resolution=None, settled_at=None
            )
            if await self.records.swap(back, last=entry.revision) is not None:
                await publish(self._nc, back)
                return True

    async def cancel(self, label: str, reason: str | None) -> SuspensionRecord:
        """`Suspensions.cancel_hook`, within the caller's deadline."""
        hint = self._hint(label)
        while True:
            hinted = hint is not None
            entry = hint if hint is not None else await self.records.read(label)
            hint = None
            if entry is None or entry.record is None:
                raise SuspensionNotFoundError(f"no suspension with label {label!r}")
            record = entry.record
            if record.status != "pending":
                if hinted:
                    continue  # the watch's value may be stale: refuse on a read only
                raise AlreadySettledError(f"hook {label!r} is already {settled(record)}")
            cancelled = msgspec.structs.replace(
                record, status="cancelled", reason=reason, settled_at=time.time()
            )
            if await self.records.swap(cancelled, last=entry.revision) is None:
                continue
            await publish(self._nc, cancelled)
            return cancelled
