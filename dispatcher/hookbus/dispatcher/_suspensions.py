"""Durable suspensions: the Vercel AI SDK's hooks, kept in a JetStream KV bucket.

A run that needs an answer calls ``await hook(label, payload=T)``. One KV record per label
(`SuspensionRecord`) holds the state; every change is a compare-and-set on its revision, so
concurrent resolvers, cancellers and waiters in any process end in exactly one outcome.

- A pre-registered resolution (``resolve_hook`` before any ``hook``) is consumed by the next
  matching ``hook`` exactly once, which returns at once.
- Otherwise ``hook`` creates a pending record (create-if-absent: a second live hook on the
  label is `DuplicateHookError`), publishes a ``pending`` `HookEvent`, and waits on a KV
  watch backed by a periodic read (FIELD-NOTES: a watch can stall after a server loss).
- ``resolve_hook`` checks the value against the payload's JSON Schema kept in the record
  (`ResolutionRejectedError`, record unchanged), then compare-and-sets it to resolved.
- ``cancel_hook`` compare-and-sets it to cancelled; the waiter raises `HookCancelledError`.
- ``abort_pending_hook`` stops a local waiter and leaves the record pending, detached: a
  later run calling ``hook(label)`` again gets the stored resolution (serverless resume), or
  re-attaches and waits if there is none yet.
- A run scope (``async with run(run_id)``) records the labels it used; on exit it removes
  its live hooks and unused pre-registered resolutions (and consumed / cancelled records).
- Records expire with the bucket's TTL (its max age, counted from the last write).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import jsonschema
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from hookbus.schemas import (
    HOOK_EVENTS_WILDCARD,
    AlreadySettledError,
    DuplicateHookError,
    HookAbortedError,
    HookbusError,
    HookCancelledError,
    HookEvent,
    HookNotFoundError,
    HookPart,
    HookTimeoutError,
    ResolutionRejectedError,
    SuspensionRecord,
    decode,
    encode,
    hook_event_subject,
    label_from_key,
    suspension_key,
    suspensions_bucket_config,
)

from ._telemetry import SuspensionSpan, suspension_span

__all__ = ["HookEventStream", "PendingHook", "RunScope", "Suspensions"]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

_TRANSIENT = (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError)
"""KV write failures worth retrying (a stream leader moving, FIELD-NOTES: ~6-7 s)."""


def _retrying() -> AsyncRetrying:
    return AsyncRetrying(
        retry=retry_if_exception_type(_TRANSIENT),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        stop=stop_after_delay(15),
        reraise=True,
    )


def payload_schema(payload: type[Any] | None) -> dict[str, Any] | None:
    """JSON Schema of a payload type: a msgspec Struct (or any msgspec type), or a
    pydantic model when pydantic is installed; None for any JSON value."""
    if payload is None:
        return None
    if hasattr(payload, "model_json_schema"):
        return payload.model_json_schema()  # type: ignore[no-any-return]
    return msgspec.json.schema(payload)


def to_json_value(value: Any) -> Any:
    """A resolution as plain JSON data (Structs, pydantic models, dataclasses, dicts)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return msgspec.to_builtins(value)


def from_json_value(value: Any, payload: type[T] | None) -> T:
    """Convert a stored resolution into the payload type (identity without one)."""
    if payload is None:
        return value  # type: ignore[no-any-return]
    if hasattr(payload, "model_validate"):
        return payload.model_validate(value)  # type: ignore[no-any-return,attr-defined]
    return msgspec.convert(value, payload)


@dataclass(frozen=True, slots=True)
class PendingHook:
    """A hook this process is waiting on (what `abort_pending_hook` takes)."""

    hook_id: str
    label: str


@dataclass
class RunScope:
    """The labels one run used; see `Suspensions.run`."""

    run_id: str
    labels: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)


_current_run: contextvars.ContextVar[RunScope | None] = contextvars.ContextVar(
    "hookbus_run", default=None
)


class HookEventStream:
    """Hook events as an async iterator (`async for event in stream`); close with
    `aclose` or use ``async with``. Subscribed before it is returned: nothing after the
    call is missed."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    def __aiter__(self) -> HookEventStream:
        return self

    async def __anext__(self) -> HookEvent:
        while True:
            try:
                msg = await self._sub.next_msg(timeout=None)
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                raise StopAsyncIteration from None
            try:
                return decode(msg.data, HookEvent)
            except HookbusError as exc:
                log.warning("ignoring bad hook event on %s: %s", msg.subject, exc)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def __aenter__(self) -> HookEventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Suspensions:
    """The suspension store of one process. Made by `HookDispatcher.start`; every method
    is also reachable on the dispatcher (``dispatcher.hook(...)``).

    Args:
        nc: a connected client.
        kv: the suspensions bucket.
        poll_s: seconds between the periodic reads that back the KV watch.
    """

    def __init__(self, nc: NATS, kv: KeyValue, *, poll_s: float = 1.0) -> None:
        self._nc = nc
        self._kv = kv
        self._poll_s = poll_s
        self._waiters: dict[str, anyio.CancelScope] = {}
        self._live_labels: set[str] = set()
        self._validators: dict[bytes, jsonschema.protocols.Validator] = {}

    @classmethod
    async def open(
        cls, nc: NATS, *, ttl_s: float = 7 * 24 * 3600, replicas: int = 1
    ) -> Suspensions:
        js = nc.jetstream()
        config = suspensions_bucket_config(ttl_s=ttl_s, replicas=replicas)
        try:
            kv = await js.create_key_value(config=config)
        except nats.js.errors.BadRequestError:  # exists with another TTL: use it as it is
            kv = await js.key_value(config.bucket)
        return cls(nc, kv)

    # -- reading ---------------------------------------------------------------------------
    async def get(self, label: str) -> tuple[SuspensionRecord, int] | None:
        """The record of `label` and its revision, or None."""
        try:
            entry = await self._kv.get(suspension_key(label))
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value or entry.revision is None:
            return None  # an expiry marker (FIELD-NOTES) or a delete
        return decode(entry.value, SuspensionRecord), entry.revision

    async def list(self) -> list[SuspensionRecord]:
        """Every record in the bucket (pending, resolved, cancelled), by creation time."""
        try:
            keys = await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        records = []
        for key in keys:
            with contextlib.suppress(HookbusError):
                got = await self.get(label_from_key(key))
                if got is not None:
                    records.append(got[0])
        return sorted(records, key=lambda r: r.created_at)

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
            timeout_s: seconds to wait; None waits until resolved, cancelled or aborted.
            schema: JSON Schema to check resolutions against (default: `payload`'s).
            shared: the label names one call that may be retried from another process (an
                approval): attach to its pending record even if a waiter is recorded, and
                take its resolution even if another waiter consumed it.
            kind: what the wait is for (``suspension``, ``approval``): the span is
                ``await <kind>``, with events pending / resolved / cancelled / timed_out /
                aborted; `span_attributes` are added to it.
        Raises:
            DuplicateHookError: another waiter is attached to a pending hook of this label.
            HookCancelledError: it was cancelled (now or before).
            HookAbortedError: `abort_pending_hook` stopped the wait.
            HookTimeoutError: no resolution within `timeout_s`.
        """
        with suspension_span(label, kind=kind, attributes=span_attributes) as span:
            try:
                value = await self._hook(
                    span, label, payload=payload, metadata=metadata, timeout_s=timeout_s,
                    schema=schema, shared=shared,
                )  # fmt: skip
            except HookCancelledError as exc:
                span.event("cancelled", reason=exc.reason or "")
                raise
            except HookTimeoutError:
                span.event("timed_out")
                raise
            except HookAbortedError:
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
        key = suspension_key(label)  # BadRequestError for a label too long to be a key
        if label in self._live_labels and not shared:
            raise DuplicateHookError(f"this process already waits on a hook labelled {label!r}")
        run = _current_run.get()
        if run is not None:
            run.labels.add(label)
        hook_id = uuid.uuid4().hex
        while True:
            got = await self.get(label)
            if got is None:
                record = SuspensionRecord(
                    label=label,
                    status="pending",
                    hook_id=hook_id,
                    run_id=run.run_id if run else None,
                    attached=True,
                    metadata=metadata or {},
                    payload_type=getattr(payload, "__name__", None),
                    payload_schema=schema if schema is not None else payload_schema(payload),
                    created_at=time.time(),
                )
                try:
                    revision = await self._write(key, record, last=0)
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue  # someone created it first: look again
                await self._publish(record)
                span.event("pending")
                break
            record, revision = got
            if record.status == "resolved" and not record.consumed:
                result = _convert(label, record.resolution, payload)  # refuse before consuming
                value = await self._consume(key, record, revision)
                if value is not _LOST_RACE:
                    return result
                continue
            if record.status == "cancelled":
                raise HookCancelledError(label, record.reason)
            if record.status == "resolved" and shared:  # one call, retried: its answer
                return _convert(label, record.resolution, payload)
            if record.status == "resolved":  # consumed earlier: this is a new hook
                fresh = SuspensionRecord(
                    label=label, status="pending", hook_id=hook_id,
                    run_id=run.run_id if run else None, attached=True,
                    metadata=metadata or {}, payload_type=getattr(payload, "__name__", None),
                    payload_schema=schema if schema is not None else payload_schema(payload),
                    created_at=time.time(),
                )  # fmt: skip
                try:
                    revision = await self._write(key, fresh, last=revision)
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue
                record = fresh
                await self._publish(record)
                span.event("pending")
                break
            # pending: re-attach if nobody waits on it or it is this run's own (resume)
            same_run = run is not None and record.run_id == run.run_id
            if record.attached and not same_run and not shared:
                raise DuplicateHookError(
                    f"a live hook with label {label!r} exists (hook {record.hook_id})"
                )
            hook_id = record.hook_id
            attached = msgspec.structs.replace(record, attached=True)
            try:
                revision = await self._write(key, attached, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            record = attached
            span.event("pending")
            break
        return _convert(
            label, await self._wait(key, label, hook_id, timeout_s, run, shared=shared), payload
        )

    async def _wait(
        self,
        key: str,
        label: str,
        hook_id: str,
        timeout_s: float | None,
        run: RunScope | None,
        *,
        shared: bool,
    ) -> Any:
        scope = anyio.CancelScope()
        self._waiters[hook_id] = scope
        self._live_labels.add(label)
        try:
            with scope, anyio.move_on_after(timeout_s) as deadline:
                return await self._watch_until_settled(key, label, shared=shared)
            if deadline.cancelled_caught:
                with anyio.CancelScope(shield=True):
                    await self._detach(key, label)
                raise HookTimeoutError(f"hook {label!r} got no resolution within {timeout_s}s")
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            self._waiters.pop(hook_id, None)
            self._live_labels.discard(label)
            if scope.cancelled_caught:
                if run is not None:
                    run.aborted.add(label)
                with anyio.CancelScope(shield=True):
                    await self._detach(key, label)
                raise HookAbortedError(f"waiting on hook {label!r} was aborted; it stays pending")

    async def _watch_until_settled(self, key: str, label: str, *, shared: bool) -> Any:
        """Wait on a KV watch, read the record every `poll_s` seconds anyway, and survive a
        lost server: the watch is re-created and reads are retried until settled."""
        while True:
            try:
                watcher = await self._kv.watch(key)
            except Exception as exc:  # server restarting: try again after a poll period
                log.info("watch on %r failed (%s); retrying", label, exc)
                await anyio.sleep(self._poll_s)
                continue
            try:
                while True:
                    try:
                        entry = await watcher.updates(timeout=self._poll_s)
                    except nats.errors.TimeoutError:
                        entry = None  # quiet: read it ourselves (the watch may have stalled)
                    if entry is None or not entry.value or entry.revision is None:
                        if entry is not None and entry.operation not in ("DEL", "PURGE"):
                            continue
                        got = await self.get(label)
                        if got is None:
                            raise HookCancelledError(label, "the record was removed")
                        record, rev = got
                    else:
                        record, rev = decode(entry.value, SuspensionRecord), entry.revision
                    if record.status == "cancelled":
                        raise HookCancelledError(label, record.reason)
                    if record.status == "resolved":
                        if record.consumed:
                            if shared:
                                return record.resolution
                            raise AlreadySettledError(
                                f"hook {label!r} was resolved and consumed by another waiter"
                            )
                        value = await self._consume(key, record, rev)
                        if value is not _LOST_RACE:
                            return value
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                log.info("waiting on %r: %s; re-creating the watch", label, exc)
                await anyio.sleep(self._poll_s)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()

    async def _consume(self, key: str, record: SuspensionRecord, revision: int) -> Any:
        """Mark a resolution consumed (compare-and-set): exactly one consumer wins."""
        try:
            await self._write(
                key, msgspec.structs.replace(record, consumed=True, attached=False), last=revision
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return _LOST_RACE
        return record.resolution

    async def _detach(self, key: str, label: str) -> None:
        """Leave a pending record pending with no waiter attached (abort, timeout)."""
        with contextlib.suppress(Exception):
            for _ in range(5):
                got = await self.get(label)
                if got is None or got[0].status != "pending" or not got[0].attached:
                    return
                try:
                    await self._write(
                        key, msgspec.structs.replace(got[0], attached=False), last=got[1]
                    )
                    return
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue

    # -- settling --------------------------------------------------------------------------
    async def resolve_hook(self, label: str, value: Any) -> SuspensionRecord:
        """Resolve `label` with `value` (a Struct, pydantic model or JSON data).

        With no record, stores a pre-registered resolution for the next ``hook(label)``.
        Returns the record as written.

        Raises:
            ResolutionRejectedError: the value does not fit the hook's payload schema
                (the message gives the reason and JSON path; the record is unchanged).
            AlreadySettledError: it is already resolved or cancelled.
        """
        run = _current_run.get()
        if run is not None:
            run.labels.add(label)
        data = to_json_value(value)
        key = suspension_key(label)
        while True:
            got = await self.get(label)
            now = time.time()
            if got is None:
                record = SuspensionRecord(
                    label=label, status="resolved", resolution=data, preregistered=True,
                    created_at=now, settled_at=now,
                )  # fmt: skip
                try:
                    await self._write(key, record, last=0)
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue
                return record
            record, revision = got
            if record.status != "pending":
                raise AlreadySettledError(f"hook {label!r} is already {_settled(record)}")
            if record.payload_schema is not None:
                _check(record, data, self._validator(record.payload_schema))
            resolved = msgspec.structs.replace(
                record, status="resolved", resolution=data, settled_at=now
            )
            try:
                await self._write(key, resolved, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # changed under us: judge again on the new state
            await self._publish(resolved)
            return resolved

    async def cancel_hook(self, label: str, *, reason: str | None = None) -> SuspensionRecord:
        """Cancel the pending hook `label`; its waiter raises `HookCancelledError`.

        Raises:
            HookNotFoundError: no record for the label.
            AlreadySettledError: it is already resolved or cancelled.
        """
        key = suspension_key(label)
        while True:
            got = await self.get(label)
            if got is None:
                raise HookNotFoundError(f"no hook with label {label!r}")
            record, revision = got
            if record.status != "pending":
                raise AlreadySettledError(f"hook {label!r} is already {_settled(record)}")
            cancelled = msgspec.structs.replace(
                record, status="cancelled", reason=reason, settled_at=time.time()
            )
            try:
                await self._write(key, cancelled, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            await self._publish(cancelled)
            return cancelled

    def abort_pending_hook(self, hook: PendingHook | HookPart | str) -> bool:
        """Stop this process's wait on a hook (by `PendingHook`, `HookPart` or hook id);
        the record stays pending. Returns False if nothing here waits on it."""
        hook_id = hook if isinstance(hook, str) else hook.hook_id
        scope = self._waiters.get(hook_id)
        if scope is None:
            return False
        scope.cancel()
        return True

    # -- runs and events -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def run(self, run_id: str | None = None) -> AsyncIterator[RunScope]:
        """Scope a run: labels used inside are cleaned up on exit (see module docstring).

        Re-entering with the same `run_id` (in any process) resumes that run's hooks.
        """
        scope = RunScope(run_id or uuid.uuid4().hex)
        token = _current_run.set(scope)
        try:
            yield scope
        finally:
            _current_run.reset(token)
            with anyio.CancelScope(shield=True):
                await self._cleanup(scope)

    async def _cleanup(self, scope: RunScope) -> None:
        for label in scope.labels - scope.aborted:
            got = await self.get(label)
            if got is None:
                continue
            record, revision = got
            live = record.status == "pending" and record.attached and record.run_id == scope.run_id
            finished = record.consumed or record.status == "cancelled"
            unused_prereg = record.preregistered and not record.consumed
            if live or finished or unused_prereg:
                with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                    await self._kv.delete(suspension_key(label), last=revision)

    async def events(self) -> HookEventStream:
        """Subscribe to every hook event (pending / resolved / cancelled)."""
        sub = await self._nc.subscribe(HOOK_EVENTS_WILDCARD)
        await self._nc.flush()
        return HookEventStream(sub)

    # -- plumbing ---
    def _validator(self, schema: dict[str, Any]) -> jsonschema.protocols.Validator:
        """A JSON Schema validator per distinct schema, built once (35 us each)."""
        cache_key = encode(schema)
        validator = self._validators.get(cache_key)
        if validator is None:
            if len(self._validators) > 256:
                self._validators.clear()
            validator = self._validators[cache_key] = jsonschema.Draft202012Validator(schema)
        return validator

    async def _write(self, key: str, record: SuspensionRecord, *, last: int) -> int:
        payload = encode(record)
        try:  # the first attempt goes straight out: tenacity only once something failed
            return await self._put(key, payload, last)
        except _TRANSIENT:
            pass
        async for attempt in _retrying():
            with attempt:
                return await self._put(key, payload, last)
        raise AssertionError("unreachable")

    async def _put(self, key: str, payload: bytes, last: int) -> int:
        if last == 0:
            return await self._kv.create(key, payload)
        return await self._kv.update(key, payload, last=last)

    async def _publish(self, record: SuspensionRecord) -> None:
        event = HookEvent(
            hook=HookPart(
                hook_id=record.hook_id,
                label=record.label,
                status=record.status,
                metadata=record.metadata,
                resolution=record.resolution,
                reason=record.reason,
            ),
            at=time.time(),
        )
        with contextlib.suppress(nats.errors.ConnectionClosedError):
            await self._nc.publish(hook_event_subject(record.label, record.status), encode(event))


_LOST_RACE = object()


def _convert(label: str, value: Any, payload: type[T] | None) -> T:
    """The resolution as `payload`, or `ResolutionRejectedError` with the reason."""
    try:
        return from_json_value(value, payload)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        name = getattr(payload, "__name__", "the payload type")
        raise ResolutionRejectedError(
            f"the resolution of {label!r} does not fit {name}: {exc}"
        ) from exc


def _settled(record: SuspensionRecord) -> str:
    if record.status == "resolved":
        return "resolved (consumed)" if record.consumed else "resolved"
    return f"cancelled ({record.reason})" if record.reason else "cancelled"


def _check(record: SuspensionRecord, data: Any, validator: jsonschema.protocols.Validator) -> None:
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        path = "$" + "".join(
            f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path
        )
        raise ResolutionRejectedError(
            f"resolution for {record.label!r} does not fit {record.payload_type or 'its schema'}:"
            f" {error.message} at {path}"
        )
