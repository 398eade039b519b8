"""Durable suspensions: the Vercel AI SDK's hooks, kept in a JetStream KV bucket.

A run that needs an answer calls ``await hook(label, payload=T)``. One KV record per label
(`SuspensionRecord`) holds the state; every change is a compare-and-set on its revision
that stays exactly-once when a write's outcome is unknown (`RecordStore`), so concurrent
resolvers, cancellers and waiters in any process end in exactly one outcome. `Suspensions`
composes the parts: the waiting side (`HookWaits`), the settling side (`Settling`), the
process's shared watch and lease, and its run scopes.

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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus._core.buckets import suspensions_bucket_config
from hookbus._core.deadlines import caller_deadline
from hookbus._core.kv import open_bucket
from hookbus._core.leader_reads import own_keys_only, read_from_replicas
from hookbus._core.nats_guard import harden_connection
from hookbus._core.tasks import stop_task
from hookbus.schemas import (
    HookPart,
    HookStatus,
    SuspensionAbortedError,
    SuspensionCancelledError,
    SuspensionRecord,
    SuspensionTimeoutError,
    suspension_events_subject,
)

from ._deliveries import Deliveries
from ._hook_waits import MIN_STORE_S, HookWaits, LocalWaits
from ._records import Entry, RecordStore, SuspensionPage
from ._run_scopes import RunScope, cleanup, current_run_scope
from ._settling import Settling
from ._suspension_events import HookEventStream, Validators
from ._telemetry import suspension_span
from ._waiter import Leases, SharedWatch

__all__ = ["HookEventStream", "PendingHook", "RunScope", "SuspensionPage", "Suspensions"]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")


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
        self._local = LocalWaits()
        self._validators = Validators()
        self._deliveries = Deliveries()
        self._settles = 0
        self._watching: asyncio.Task[None] | None = None
        self._bind()

    def _bind(self) -> None:
        """The waiting and settling sides, on this store's records."""
        self._waits = HookWaits(
            self._nc, self.records, self.watch, self._deliveries, self._local,
            lease=self.ensure_leases, waiter_id=lambda: self.waiter_id,
        )  # fmt: skip
        self._settling = Settling(self._nc, self.records, self._validators, self._hint)

    def for_agent(self, agent_id: str | None) -> Suspensions:
        """This store addressing `agent_id`'s records (``<agent>.<label>`` keys): the same
        watch, lease and waits, so a dispatcher service serves every agent with one watch."""
        if agent_id == self.records.agent_id:
            return self
        view = copy.copy(self)
        view.records = self.records.for_agent(agent_id)
        view._bind()
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
        own_keys = own_keys_only(nc, scoped=scoped)
        if own_keys:  # it may get its own keys only, by direct get
            read_from_replicas(kv)
        leases = await Leases.open(
            nc, lease_s=lease_s, replicas=replicas, js_domain=js_domain, own_keys=own_keys
        )
        return cls(nc, kv, leases=leases, poll_s=poll_s, agent_id=agent_id, scoped=scoped)

    @property
    def waiter_id(self) -> str | None:
        """This process's waiter id (the ``owner`` of the records it waits on)."""
        return None if self._leases is None else self._leases.waiter_id

    @property
    def leases(self) -> Leases | None:
        """This process's waiter lease (another store of the process may share it); None
        until the first waiter opens it (see `ensure_leases`)."""
        return self._leases

    @property
    def connection(self) -> NATS:
        """The connection the store reads, writes and publishes on (the caller's: `close`
        leaves it open)."""
        return self._nc

    async def ensure_leases(self) -> Leases:
        """This process's waiter lease, alive: opened with the leases bucket's defaults if
        the store has none yet (as the first waiter does), its heartbeat running.

        Raises:
            HookbusTimeoutError: the leases bucket stayed unavailable for one lease.
        """
        if self._leases is None:
            own_keys = own_keys_only(self._nc, scoped=self.records.scoped)
            self._leases = await Leases.open(self._nc, own_keys=own_keys)
        await self._leases.ensure()
        return self._leases

    async def flush_deliveries(self, timeout_s: float | None = None) -> None:
        """Wait until the "consumed" marks of the resolutions this process handed to its
        waiters are stored (see `_deliveries`), at most `timeout_s` seconds (None: no
        limit). A mark that could not be stored is logged, never raised."""
        await self._deliveries.flush(timeout_s=timeout_s)

    async def close(self, *, leases: bool = True) -> None:
        """Store the "consumed" marks still in flight (at most 5 s), stop the shared watch
        and, with `leases`, the lease heartbeat (waits in progress keep their records; their
        lease expires). Idempotent."""
        await self.flush_deliveries(timeout_s=5.0)
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
                    value = await self._waits.suspend(
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
            return await self._settling.resolve(label, value, replace=replace)

    async def clear_hook(self, label: str) -> bool:
        """Remove a resolution of `label` that no waiter consumed (e.g. a pre-registered
        value that does not fit): a pre-registered one is deleted, one that resolved a
        pending hook turns it back to pending. A malformed record is deleted.

        Returns True if something was cleared, False if there was nothing to clear
        (no record, pending, consumed or cancelled).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        return await self._settling.clear(label)

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
            return await self._settling.cancel(label, reason)

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
        return self._local.abort(hook if isinstance(hook, str) else hook.hook_id)

    def abort_all(self) -> int:
        """Stop every wait of this process (each raises `SuspensionAbortedError`); the records
        stay pending, detached, for a later ``hook(label)`` to resume. Returns how many
        waits were stopped."""
        return self._local.abort_all()

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
                await self.flush_deliveries(timeout_s=self.records.deadline_s)
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
