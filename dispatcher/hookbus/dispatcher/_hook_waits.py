"""Waiting on a hook: attaching to its record, waiting on the shared watch, and handing
its resolution out exactly once (`HookWaits`, the waiting side of `Suspensions.hook`).

``hook(label)`` first looks at the record: none (or a malformed one) is created pending
and owned by this process; a stored resolution nobody consumed is taken at once (marked
consumed by compare-and-set: one taker wins); a pending record whose owner's lease lapsed
is taken over, and one of this run re-attached. Then the wait: the process's one shared
watch (`SharedWatch`) delivers each new state of the record; a resolution of the record
this process holds is returned at once and marked consumed in the background
(`Deliveries`). A wait that ends without one (abort, timeout, an error) detaches the
record, so that a later ``hook(label)`` anywhere may take it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
from nats.aio.client import Client as NATS

from hookbus._core.deadlines import NEVER, Deadline, caller_deadline, time_left
from hookbus._core.kv import kv_retry
from hookbus.schemas import (
    AlreadySettledError,
    DuplicateSuspensionError,
    HookbusTimeoutError,
    SuspensionAbortedError,
    SuspensionCancelledError,
    SuspensionRecord,
    SuspensionTimeoutError,
)

from ._deliveries import Deliveries
from ._records import Entry, RecordStore
from ._run_scopes import RunScope, note_label
from ._suspension_events import convert, payload_schema, publish
from ._telemetry import SuspensionSpan
from ._waiter import Leases, SharedWatch, Slot

__all__ = ["CLOSING_S", "MIN_STORE_S", "HookWaits", "LocalWaits"]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

MIN_STORE_S = 0.5
"""Seconds a hook's store reads and writes may take at least, however short its timeout
(a timeout of 0 still creates its record, or takes a stored resolution)."""

CLOSING_S = 1.0
"""Seconds past a hook's timeout its closing write (detaching its record, so that a later
``hook(label)`` may take it) may take; one cut there leaves the record attached until
this process's lease lapses."""


class LocalWaits:
    """This process's waits on hooks, shared by every agent's view of its store: each
    hook id's cancel scopes (what an abort stops) and how many waits each key has."""

    __slots__ = ("_live", "_scopes")

    def __init__(self) -> None:
        self._scopes: dict[str, set[anyio.CancelScope]] = {}
        self._live: dict[str, int] = {}

    def waiting(self, key: str) -> bool:
        """Whether a wait of this process is on the record `key`."""
        return bool(self._live.get(key))

    def enter(self, hook_id: str, key: str, scope: anyio.CancelScope) -> None:
        """A wait on hook `hook_id` (record `key`) starts; `scope` stops it."""
        self._scopes.setdefault(hook_id, set()).add(scope)
        self._live[key] = self._live.get(key, 0) + 1

    def leave(self, hook_id: str, key: str, scope: anyio.CancelScope) -> bool:
        """The wait `enter` started ends. Whether it was the last wait on `key`."""
        scopes = self._scopes.get(hook_id, set())
        scopes.discard(scope)
        if not scopes:
            self._scopes.pop(hook_id, None)
        self._live[key] -= 1
        if not self._live[key]:
            del self._live[key]
        return key not in self._live

    def abort(self, hook_id: str) -> bool:
        """Stop every wait on hook `hook_id`; False if there is none."""
        scopes = self._scopes.get(hook_id)
        if not scopes:
            return False
        for scope in scopes:
            scope.cancel()
        return True

    def abort_all(self) -> int:
        """Stop every wait; how many there were."""
        scopes = [scope for group in self._scopes.values() for scope in group]
        for scope in scopes:
            scope.cancel()
        return len(scopes)


class HookWaits:
    """The waiting side of one store (`Suspensions`) addressing one agent's records.

    Args:
        nc: the connection the pending events are published on.
        records: the record store (this agent's key space).
        watch: the process's shared watch on the bucket.
        deliveries: the resolutions handed out here whose "consumed" mark is in flight.
        local: the process's waits (shared by every agent's view).
        lease: this process's waiter lease, opened (and kept alive) on first use.
        waiter_id: this process's waiter id, None before its lease is opened.
    """

    def __init__(
        self,
        nc: NATS,
        records: RecordStore,
        watch: SharedWatch,
        deliveries: Deliveries,
        local: LocalWaits,
        *,
        lease: Callable[[], Awaitable[Leases]],
        waiter_id: Callable[[], str | None],
    ) -> None:
        self._nc = nc
        self.records = records
        self.watch = watch
        self._deliveries = deliveries
        self.local = local
        self._lease = lease
        self._waiter_id = waiter_id

    async def suspend(
        self,
        span: SuspensionSpan,
        label: str,
        *,
        payload: type[T] | None,
        metadata: dict[str, Any] | None,
        timeout_s: float | None,
        schema: dict[str, Any] | None,
        shared: bool,
    ) -> T:
        """`Suspensions.hook` inside its span and deadline: attach to `label`'s record
        (create it, take it over, or take its resolution at once), then wait."""
        key = self.records.key(label)  # BadRequestError for a label too long to be a key
        until = Deadline.after(timeout_s, asyncio.get_running_loop().time())
        if self.local.waiting(key) and not shared:
            raise DuplicateSuspensionError(
                f"this process already waits on a hook labelled {label!r}"
            )
        run = note_label(label)
        try:  # a resolution handed out here is marked first
            bound = None if timeout_s is None else time_left(max(timeout_s, MIN_STORE_S))
            async with asyncio.timeout(bound):
                await self._deliveries.settle(key)
        except TimeoutError as exc:
            raise HookbusTimeoutError(
                f"hook {label!r}: the mark of its last resolution was not stored in {timeout_s}s"
            ) from exc
        leases = await self._lease()
        slot = self.watch.register(key)
        try:
            await kv_retry(self.watch.start, deadline_s=self.records.deadline_s, what="watch")
            hook_id = uuid.uuid4().hex

            def fresh(over: int) -> SuspensionRecord:
                return SuspensionRecord(
                    label=label, status="pending", hook_id=hook_id, agent_id=self.records.agent_id,
                    run_id=run.run_id if run else None, attached=True, owner=leases.waiter_id,
                    metadata=metadata or {}, payload_type=getattr(payload, "__name__", None),
                    payload_schema=schema if schema is not None else payload_schema(payload),
                    created_at=time.time(), created_over=over,
                )  # fmt: skip

            while True:
                entry = await self.records.latest(label)
                if entry is None or entry.record is None:  # absent, deleted or malformed
                    record = fresh(0 if entry is None else entry.revision)
                    revision = await self.records.create(record, over=entry, if_deleted="lost")
                    if revision is None:
                        continue  # someone created it first: look again
                    await publish(self._nc, record)
                    break
                record, revision = entry.record, entry.revision
                consumed = record.consumed or self._deliveries.delivered(key, revision)
                if record.status == "resolved" and not consumed:
                    mine = record.owner == leases.waiter_id
                    resume = run is not None and record.run_id == run.run_id
                    if record.attached and record.owner and not (mine or shared or resume):
                        if await leases.alive(record.owner):  # being handed to its waiter
                            raise DuplicateSuspensionError(
                                f"a live hook with label {label!r} exists (hook"
                                f" {record.hook_id}); its resolution is being handed to it"
                            )
                    result = convert(label, record.resolution, payload)  # refuse, unconsumed
                    if await self._consume(record, revision):
                        return result
                    continue
                if record.status == "cancelled":
                    raise SuspensionCancelledError(label, record.reason)
                if record.status == "resolved" and shared:  # one call, retried: its answer
                    return convert(label, record.resolution, payload)
                if record.status == "resolved":  # consumed earlier: this is a new hook
                    record = fresh(entry.revision)
                    revision = await self.records.swap(
                        record, last=entry.revision, prior=entry.record, if_deleted="lost"
                    )
                    if revision is None:
                        continue
                    await publish(self._nc, record)
                    break
                # pending: attach if nobody live waits on it, or it is this run's (resume)
                same_run = run is not None and record.run_id == run.run_id
                if record.attached and not same_run and not shared:
                    if not record.owner or await leases.alive(record.owner):
                        raise DuplicateSuspensionError(
                            f"a live hook with label {label!r} exists (hook {record.hook_id})"
                        )
                    log.info("taking over hook %r from %s (its lease expired)",
                             label, record.owner)  # fmt: skip
                hook_id = record.hook_id
                record = msgspec.structs.replace(record, attached=True, owner=leases.waiter_id)
                revision = await self.records.swap(record, last=entry.revision, if_deleted="lost")
                if revision is None:
                    continue
                break
            span.event("pending")
            slot.arm(Entry(revision, record))
            return await self._wait(
                slot, label, hook_id, payload, timeout_s, run, shared=shared, until=until
            )
        finally:
            self.watch.unregister(slot)

    async def _wait(
        self,
        slot: Slot,
        label: str,
        hook_id: str,
        payload: type[T] | None,
        timeout_s: float | None,
        run: RunScope | None,
        *,
        shared: bool,
        until: Deadline = NEVER,
    ) -> T:
        """Wait for the record's resolution until `until` (`NEVER`: no end);
        `timeout_s` (seconds) is what the error names."""
        scope = anyio.CancelScope()
        key = self.records.key(label)
        self.local.enter(hook_id, key, scope)
        keep = False  # a run cancelled from outside: its exit removes the record
        took = False  # the resolution was handed to this wait: nothing to detach
        try:
            left = None if until.unbounded else until.left(asyncio.get_running_loop().time())
            with scope, anyio.move_on_after(left) as deadline:
                value = await self._untilsettled(slot, label, hook_id, payload, shared=shared)
                took = True
                return value
            if deadline.cancelled_caught:
                raise SuspensionTimeoutError(
                    f"hook {label!r} got no resolution within {timeout_s}s"
                )
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException as exc:
            keep = run is not None and isinstance(exc, anyio.get_cancelled_exc_class())
            raise
        finally:
            if self.local.leave(hook_id, key, scope) and not keep and not took:
                closing = None if timeout_s is None else CLOSING_S
                with anyio.CancelScope(shield=True), caller_deadline(closing, extend=True):
                    await self._detach(label)
            if scope.cancelled_caught:
                if run is not None:
                    run.aborted.add(label)
                raise SuspensionAbortedError(
                    f"waiting on hook {label!r} was aborted; it stays pending"
                )

    async def _untilsettled(
        self, slot: Slot, label: str, hook_id: str, payload: type[T] | None, *, shared: bool
    ) -> T:
        """Act on each state the shared watch (or its backing read) delivers. A resolution
        of the record this process holds is returned at once, with no read or write; its
        "consumed" mark follows in the background (see `_deliveries`)."""
        while True:
            await slot.changed(None)
            if slot.removed:
                raise SuspensionCancelledError(label, "the record was removed")
            entry = slot.latest
            if entry is None or entry.record is None:
                continue  # malformed (logged): wait for a good version
            record = entry.record
            if record.status == "cancelled":
                raise SuspensionCancelledError(label, record.reason)
            if record.status != "resolved":
                continue
            if record.consumed:
                if shared:
                    return convert(label, record.resolution, payload)
                raise AlreadySettledError(
                    f"hook {label!r} was resolved and consumed by another waiter"
                )
            result = convert(label, record.resolution, payload)  # refused: not consumed
            if record.owner == self._waiter_id() and record.hook_id == hook_id:
                self._hand_out(slot.key, record, entry.revision)
                return result
            if record.owner and not shared:  # taken over (this process's lease lapsed)
                raise AlreadySettledError(
                    f"hook {label!r} was taken over by another waiter, which gets its resolution"
                )
            if await self._consume(record, entry.revision):  # no owner: whoever sets it first
                return result

    def _hand_out(self, key: str, record: SuspensionRecord, revision: int) -> None:
        """`record`'s resolution at `revision` (key `key`) goes to a waiter of this process:
        mark it consumed in the background; a record changed first is left detached."""

        async def mark() -> bool:
            if await self._consume(record, revision):
                return True
            await self._detach(record.label, hook_id=record.hook_id)
            return False

        self._deliveries.hand_out(key, revision, mark)

    async def _consume(self, record: SuspensionRecord, revision: int) -> bool:
        """Mark a resolution consumed (compare-and-set): exactly one consumer wins. A mark
        whose outcome stayed unknown while the record was removed counts as not stored:
        another waiter may have consumed it, and a resolution is never handed out twice."""
        done = msgspec.structs.replace(record, consumed=True, attached=False, owner="")
        return await self.records.swap(done, last=revision, if_deleted="lost") is not None

    async def _detach(self, label: str, *, hook_id: str | None = None) -> None:
        """Leave a record this process holds (pending, or resolved and not consumed) with
        no waiter (abort, timeout, a refused resolution, an error), so that a later
        ``hook(label)`` anywhere may take it. Best effort: a lease that lapses detaches it
        anyway. `hook_id`: only that hook's record."""
        me = self._waiter_id()
        with contextlib.suppress(Exception):
            for _ in range(5):
                entry = await self.records.read(label)
                record = None if entry is None else entry.record
                if entry is None or record is None or record.consumed:
                    return
                if self._deliveries.delivered(self.records.key(label), entry.revision):
                    return  # handed out here, its mark not stored: consumed, not free
                if record.status not in ("pending", "resolved"):
                    return
                if not record.attached or (record.owner and record.owner != me):
                    return
                if hook_id is not None and record.hook_id != hook_id:
                    return
                detached = msgspec.structs.replace(record, attached=False, owner="")
                if await self.records.swap(detached, last=entry.revision) is not None:
                    return
