"""Durable suspensions: the Vercel AI SDK's hooks, kept in a JetStream KV bucket.

A run that needs an answer calls ``await hook(label, payload=T)``. One KV record per label
(`SuspensionRecord`) holds the state; every change is a compare-and-set on its revision
that stays exactly-once when a write's outcome is unknown (`RecordStore`), so concurrent
resolvers, cancellers and waiters in any process end in exactly one outcome.

- A pre-registered resolution (``resolve_hook`` before any ``hook``) is consumed by the next
  matching ``hook`` exactly once, which returns at once. One that does not fit the payload
  is refused (`ResolutionRejectedError`) and left unconsumed; an operator replaces it
  (``resolve_hook(label, value, replace=True)``) or clears it (``clear_hook``).
- Otherwise ``hook`` creates a pending record owned by this process (its waiter id, kept
  alive by one lease per process, see `Leases`), publishes a ``pending`` `HookEvent`, and
  waits on the process's one shared watch (`SharedWatch`). A second ``hook`` on a label
  whose owner is alive is `DuplicateSuspensionError`; an owner whose lease expired (a crashed
  process) is taken over.
- ``resolve_hook`` checks the value against the payload's JSON Schema kept in the record
  (`ResolutionRejectedError`, record unchanged), then compare-and-sets it to resolved, on
  the revision the process's watch last delivered when it has one (no read first; a stale
  one loses the compare-and-set and the key is read). That write is the whole wake path:
  the waiter returns on the watch's delivery and marks the record consumed afterwards
  (`_deliveries` says why a resolution is still consumed exactly once).
- ``cancel_hook`` compare-and-sets it to cancelled; the waiter raises `SuspensionCancelledError`.
- ``abort_pending_hook`` (or ``abort_all``) stops local waits and leaves the record pending,
  detached: a later ``hook(label)`` gets the stored resolution (serverless resume), or
  re-attaches and waits if there is none yet.
- A run scope (``async with run(run_id)``, `RunScope`) records the labels it used; on exit it
  removes its live hooks, unused pre-registered resolutions and consumed / cancelled records.
- Records expire with the bucket's TTL (its max age, counted from the last write). A
  malformed record is skipped and logged, never raised (listings count it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus._core.buckets import suspensions_bucket_config
from hookbus._core.jetstream import caller_deadline, time_left
from hookbus._core.kv import kv_retry, open_bucket
from hookbus._core.nats_guard import harden_connection
from hookbus._core.tasks import stop_task
from hookbus.schemas import (
    AlreadySettledError,
    DuplicateSuspensionError,
    HookbusTimeoutError,
    HookPart,
    HookStatus,
    ResolutionRejectedError,
    SuspensionAbortedError,
    SuspensionCancelledError,
    SuspensionNotFoundError,
    SuspensionRecord,
    SuspensionTimeoutError,
    suspension_events_subject,
)

from ._deliveries import Deliveries
from ._records import Entry, RecordStore, SuspensionPage
from ._run_scopes import RunScope, cleanup, current_run_scope, note_label
from ._suspension_events import (
    HookEventStream,
    Validators,
    check,
    convert,
    payload_schema,
    publish,
    settled,
    to_json_value,
)
from ._telemetry import SuspensionSpan, suspension_span
from ._waiter import Leases, SharedWatch, Slot

__all__ = ["HookEventStream", "PendingHook", "RunScope", "SuspensionPage", "Suspensions"]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

MIN_STORE_S = 0.5
"""Seconds a hook's store reads and writes may take at least, however short its timeout
(a timeout of 0 still creates its record, or takes a stored resolution)."""

CLOSING_S = 1.0
"""Seconds past a hook's timeout its closing write (detaching its record, so that a later
``hook(label)`` may take it) may take; one cut there leaves the record attached until
this process's lease lapses."""


@dataclass(frozen=True, slots=True)
class PendingHook:
    """A hook this process is waiting on (what `abort_pending_hook` takes)."""

    hook_id: str
    label: str


class Suspensions:
    """The suspension store of one process. Made by `HookDispatcher.start`; every method
    is also reachable on the dispatcher (``dispatcher.hook(...)``).

    Args:
        nc: a connected client.
        kv: the suspensions bucket.
        poll_s: seconds between the periodic reads that back the shared watch.
        leases: this process's waiter lease (None: opened with the first waiter).
        write_deadline_s: seconds one read or write may keep retrying through an outage.
        poll_batch: records read per poll period (see `SharedWatch`).
    """

    def __init__(
        self,
        nc: NATS,
        kv: KeyValue,
        *,
        poll_s: float = 1.0,
        leases: Leases | None = None,
        write_deadline_s: float = 15.0,
        poll_batch: int = 256,
        agent_id: str | None = None,
        scoped: bool = False,
    ) -> None:
        self._nc = nc
        harden_connection(nc)  # `events` subscribes, flushes and must then hear every event
        self.records = RecordStore(
            kv, deadline_s=write_deadline_s, agent_id=agent_id, scoped=scoped
        )
        """The record store (create / compare-and-set / reconcile, validated reads)."""
        self.watch = SharedWatch(self.records, poll_s=poll_s, poll_batch=poll_batch)
        """The process's one watch on the bucket (``watch.consumers`` is 0 or 1)."""
        self._leases = leases
        self._waiters: dict[str, set[anyio.CancelScope]] = {}
        self._live: dict[str, int] = {}
        self._validators = Validators()
        self._deliveries = Deliveries()
        self._settles = 0
        self._watching: asyncio.Task[None] | None = None

    def for_agent(self, agent_id: str | None) -> Suspensions:
        """This store addressing `agent_id`'s records (``<agent>.<label>`` keys): the same
        watch, lease and waits, so a dispatcher service serves every agent with one watch."""
        if agent_id == self.records.agent_id:
            return self
        view = copy.copy(self)
        view.records = self.records.for_agent(agent_id)
        return view

    @property
    def agent_id(self) -> str | None:
        """The agent whose records this store addresses by label."""
        return self.records.agent_id

    @classmethod
    async def open(
        cls,
        nc: NATS,
        *,
        ttl_s: float = 7 * 24 * 3600,
        replicas: int = 1,
        lease_s: float = 15.0,
        poll_s: float = 1.0,
        agent_id: str | None = None,
        scoped: bool = False,
        js_domain: str | None = None,
    ) -> Suspensions:
        """Open (or create) the suspensions and leases buckets.

        Args:
            agent_id: the agent whose records are addressed by label (see `for_agent`).
            scoped: watch and list `agent_id`'s records only (an agent's NATS user may
                read nothing else); False: every agent's.
            ttl_s: seconds a record lives after its last write (a new bucket's max age).
            replicas: JetStream replicas of buckets created here (3 on a cluster).
            lease_s: seconds a crashed waiter keeps its label (a new leases bucket's max
                age; an existing bucket's own max age wins).
            js_domain: the JetStream domain holding the buckets (None: the one bound to
                `nc`, else the connection's own JetStream).
        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
            JetStreamDomainError: see `open_bucket`.
        """
        config = suspensions_bucket_config(ttl_s=ttl_s, replicas=replicas)
        kv = await open_bucket(nc, config, js_domain=js_domain)
        leases = await Leases.open(nc, lease_s=lease_s, replicas=replicas, js_domain=js_domain)
        return cls(nc, kv, leases=leases, poll_s=poll_s, agent_id=agent_id, scoped=scoped)

    @property
    def waiter_id(self) -> str | None:
        """This process's waiter id (the ``owner`` of the records it waits on)."""
        return None if self._leases is None else self._leases.waiter_id

    @property
    def leases(self) -> Leases | None:
        """This process's waiter lease (another store of the process may share it)."""
        return self._leases

    async def close(self, *, leases: bool = True) -> None:
        """Store the "consumed" marks still in flight (at most 5 s), stop the shared watch
        and, with `leases`, the lease heartbeat (waits in progress keep their records; their
        lease expires). Idempotent."""
        await self._deliveries.flush(timeout_s=5.0)
        watching, self._watching = self._watching, None
        await stop_task(watching, "the suspension watch's start")  # else it starts after
        await self.watch.close()
        if leases and self._leases is not None:
            await self._leases.close()

    # -- reading ---------------------------------------------------------------------------
    async def get(self, label: str) -> tuple[SuspensionRecord, int] | None:
        """The record of `label` and its revision, or None (absent, or malformed: skipped
        and logged).

        Raises:
            BadRequestError: the label cannot be a key (empty or too long).
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        entry = await self.records.read(label)
        if entry is None or entry.record is None:
            return None
        return entry.record, entry.revision

    async def list(self, *, status: HookStatus | None = None) -> list[SuspensionRecord]:
        """Every valid record (optionally of one `status`), by creation time; malformed
        ones are skipped and logged (see `page` for their count).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        return (await self.page(status=status)).records

    async def page(
        self,
        *,
        status: HookStatus | None = None,
        limit: int | None = None,
        after: str | None = None,
        prefix: str | None = None,
    ) -> SuspensionPage:
        """One page of records, oldest first, read in one pass over the bucket (no round
        trip per record); see `RecordStore.page` for the arguments and errors."""
        return await self.records.page(status=status, limit=limit, after=after, prefix=prefix)

    # -- the hook --------------------------------------------------------------------------
    async def hook(
        self,
        label: str,
        *,
        payload: type[T] | None = None,
        metadata: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        schema: dict[str, Any] | None = None,
        shared: bool = False,
        kind: str = "suspension",
        span_attributes: dict[str, Any] | None = None,
    ) -> T:
        """Suspend until `label` is resolved; return the resolution as `payload`.

        Args:
            label: any text; one live hook per label.
            payload: msgspec Struct or pydantic model type of the resolution (None: any JSON).
            metadata: JSON data shown to whoever resolves it (prompt, tool, ...).
            timeout_s: seconds the whole call may take: every store read and write it
                makes (creating the record, the waiter lease, ...) ends by then too (but
                gets at least `MIN_STORE_S`), and detaching the record at the end takes at
                most `CLOSING_S` more. None waits until resolved, cancelled or aborted.
            schema: JSON Schema to check resolutions against (default: `payload`'s).
            shared: the label names one call that may be retried from another process (an
                approval): attach to its pending record even if a waiter is recorded, and
                take its resolution even if another waiter consumed it.
            kind: what the wait is for (``suspension``, ``approval``): the span is
                ``await <kind>``, with events pending / resolved / cancelled / timed_out /
                aborted; `span_attributes` are added to it.
        Raises:
            DuplicateSuspensionError: a live waiter (its process's lease alive) holds a pending
                hook of this label.
            ResolutionRejectedError: the stored resolution does not fit `payload`; it is
                not consumed (replace or clear it).
            SuspensionCancelledError: it was cancelled (now or before), or its record removed.
            SuspensionAbortedError: `abort_pending_hook` / `abort_all` stopped the wait.
            SuspensionTimeoutError: no resolution within `timeout_s`.
            HookbusTimeoutError: JetStream stayed unavailable while writing the record, for
                the store's deadline or until `timeout_s`, whichever came first (a write
                cut there may still be stored: a pending record, which this call never
                resolves).
        """
        with suspension_span(label, kind=kind, attributes=span_attributes) as span:
            try:
                bound = None if timeout_s is None else max(timeout_s, MIN_STORE_S)
                with caller_deadline(bound):
                    value = await self._hook(
                        span, label, payload=payload, metadata=metadata, timeout_s=timeout_s,
                        schema=schema, shared=shared,
                    )  # fmt: skip
            except SuspensionCancelledError as exc:
                span.event("cancelled", reason=exc.reason or "")
                raise
            except SuspensionTimeoutError:
                span.event("timed_out")
                raise
            except SuspensionAbortedError:
                span.event("aborted")
                raise
            span.event("resolved")
            return value

    async def _hook(
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
        key = self.records.key(label)  # BadRequestError for a label too long to be a key
        until = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        if self._live.get(key) and not shared:
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

            def fresh() -> SuspensionRecord:
                return SuspensionRecord(
                    label=label, status="pending", hook_id=hook_id, agent_id=self.agent_id,
                    run_id=run.run_id if run else None, attached=True, owner=leases.waiter_id,
                    metadata=metadata or {}, payload_type=getattr(payload, "__name__", None),
                    payload_schema=schema if schema is not None else payload_schema(payload),
                    created_at=time.time(),
                )  # fmt: skip

            while True:
                entry = await self.records.latest(label)
                if entry is None or entry.record is None:  # absent, deleted or malformed
                    record = fresh()
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
                    record = fresh()
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

    async def _lease(self) -> Leases:
        if self._leases is None:
            self._leases = await Leases.open(self._nc)
        await self._leases.ensure()
        return self._leases

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
        until: float | None = None,
    ) -> T:
        """Wait for the record's resolution until the loop time `until` (None: no end);
        `timeout_s` (seconds) is what the error names."""
        scope = anyio.CancelScope()
        self._waiters.setdefault(hook_id, set()).add(scope)
        key = self.records.key(label)
        self._live[key] = self._live.get(key, 0) + 1
        keep = False  # a run cancelled from outside: its exit removes the record
        took = False  # the resolution was handed to this wait: nothing to detach
        try:
            left = None if until is None else max(0.0, until - asyncio.get_running_loop().time())
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
            scopes = self._waiters.get(hook_id, set())
            scopes.discard(scope)
            if not scopes:
                self._waiters.pop(hook_id, None)
            self._live[key] -= 1
            if not self._live[key]:
                del self._live[key]
            if key not in self._live and not keep and not took:
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
            if record.owner == self.waiter_id and record.hook_id == hook_id:
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
        me = self.waiter_id
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

    # -- settling --------------------------------------------------------------------------
    async def resolve_hook(
        self, label: str, value: Any, *, replace: bool = False, timeout_s: float | None = None
    ) -> SuspensionRecord:
        """Resolve `label` with `value` (a Struct, pydantic model or JSON data).

        With no record (or a malformed one), stores a pre-registered resolution for the
        next ``hook(label)``. With `replace`, a resolution not consumed yet (e.g. a
        pre-registered value its waiter refused) is replaced by `value`. Returns the record
        as written. A write whose ack was lost is never stored twice: if the record was
        removed meanwhile (consumed, then cleaned up), it counts as written.

        Raises:
            ResolutionRejectedError: the value does not fit the hook's payload schema
                (the message gives the reason and JSON path; the record is unchanged).
            AlreadySettledError: it is already resolved (without `replace`), consumed or
                cancelled.
            HookbusTimeoutError: JetStream stayed unavailable, for the store's deadline
                or `timeout_s` seconds (None: the store's deadline), whichever is first.
                A write cut there may still be stored: read the record to know.
        """
        with caller_deadline(timeout_s):
            return await self._resolve_hook(label, value, replace=replace)

    async def _resolve_hook(self, label: str, value: Any, *, replace: bool) -> SuspensionRecord:
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
                    agent_id=self.agent_id,
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

    async def clear_hook(self, label: str) -> bool:
        """Remove a resolution of `label` that no waiter consumed (e.g. a pre-registered
        value that does not fit): a pre-registered one is deleted, one that resolved a
        pending hook turns it back to pending. A malformed record is deleted.

        Returns True if something was cleared, False if there was nothing to clear
        (no record, pending, consumed or cancelled).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
        """
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

    async def cancel_hook(
        self, label: str, *, reason: str | None = None, timeout_s: float | None = None
    ) -> SuspensionRecord:
        """Cancel the pending hook `label`; its waiter raises `SuspensionCancelledError`.

        Raises:
            SuspensionNotFoundError: no (valid) record for the label.
            AlreadySettledError: it is already resolved or cancelled.
            HookbusTimeoutError: JetStream stayed unavailable, for the store's deadline
                or `timeout_s` seconds (None: the store's deadline), whichever is first.
        """
        with caller_deadline(timeout_s):
            return await self._cancel_hook(label, reason)

    async def _cancel_hook(self, label: str, reason: str | None) -> SuspensionRecord:
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

    def _hint(self, label: str) -> Entry | None:
        """The shared watch's last value of `label` (a valid record), to compare-and-set on
        without reading first; None when it has none. A process that settles more than
        once, or listens to the events, keeps the watch running for that (started in the
        background: this call never waits for it)."""
        key = self.records.key(label)  # BadRequestError for a label that cannot be a key
        self._settles += 1
        if self._settles > 1:
            self._watch_soon()
        entry = self.watch.recent(key)
        return entry if entry is not None and entry.record is not None else None

    def _watch_soon(self) -> None:
        if self.watch.started or self._watching is not None:
            return

        async def start() -> None:
            try:
                await self.watch.start()
            except Exception as exc:  # reads still work; the next settle may try again
                log.info("suspension watch not started for settling (%r)", exc)
            finally:
                self._watching = None

        self._watching = asyncio.get_running_loop().create_task(start())

    def abort_pending_hook(self, hook: PendingHook | HookPart | str) -> bool:
        """Stop this process's wait on a hook (by `PendingHook`, `HookPart` or hook id);
        the record stays pending. Returns False if nothing here waits on it."""
        hook_id = hook if isinstance(hook, str) else hook.hook_id
        scopes = self._waiters.get(hook_id)
        if not scopes:
            return False
        for scope in scopes:
            scope.cancel()
        return True

    def abort_all(self) -> int:
        """Stop every wait of this process (each raises `SuspensionAbortedError`); the records
        stay pending, detached, for a later ``hook(label)`` to resume. Returns how many
        waits were stopped."""
        scopes = [scope for group in self._waiters.values() for scope in group]
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    # -- runs and events -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def run(self, run_id: str | None = None) -> AsyncIterator[RunScope]:
        """Scope a run: labels used inside are cleaned up on exit (see `_run_scopes`).

        Re-entering with the same `run_id` (in any process) resumes that run's hooks.
        """
        scope = RunScope(run_id or uuid.uuid4().hex)
        token = current_run_scope.set(scope)
        try:
            yield scope
        finally:
            current_run_scope.reset(token)
            with anyio.CancelScope(shield=True):
                await self._deliveries.flush(timeout_s=self.records.deadline_s)
                await cleanup(self.records, scope)

    async def events(self) -> HookEventStream:
        """Subscribe to the suspension events (`HookEvent`: pending / resolved / cancelled):
        this agent's (``hookbus.v1.suspension.<agent>.>``) for a scoped store, every agent's
        otherwise."""
        subject = suspension_events_subject(self.agent_id, every_agent=not self.records.scoped)
        self._watch_soon()  # a listener settles what it hears: see `_hint`
        sub = await self._nc.subscribe(subject)
        await self._nc.flush()
        return HookEventStream(sub)
