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

    @classmethod
    async def open(cls, nc: NATS, *, ttl_s: float = 7 * 24 * 3600, replicas: int = 1) -> Suspensions:
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
    ) -> T:
        """Suspend until `label` is resolved; return the resolution as `payload`.

        Args:
            label: any text; one live hook per label.
            payload: msgspec Struct or pydantic model type of the resolution (None: any JSON).
            metadata: JSON data shown to whoever resolves it (prompt, tool, ...).
            timeout_s: seconds to wait; None waits until resolved, cancelled or aborted.
            schema: JSON Schema to check resolutions against (default: `payload`'s).
        Raises:
            DuplicateHookError: another waiter is attached to a pending hook of this label.
            HookCancelledError: it was cancelled (now or before).
            HookAbortedError: `abort_pending_hook` stopped the wait.
            HookTimeoutError: no resolution within `timeout_s`.
        """
        run = _current_run.get()
        if run is not None:
            run.labels.add(label)
        key = suspension_key(label)
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
                break
            record, revision = got
            if record.status == "resolved" and not record.consumed:
                value = await self._consume(key, record, revision)
                if value is not _LOST_RACE:
                    return from_json_value(value, payload)
                continue
            if record.status == "cancelled":
                raise HookCancelledError(label, record.reason)
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
                break
            # pending: re-attach if nobody waits on it or it is this run's own (resume)
            same_run = run is not None and record.run_id == run.run_id
            if record.attached and not same_run:
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
            break
        return from_json_value(
            await self._wait(key, label, hook_id, revision, timeout_s, run), payload
        )

    async def _wait(
        self,
        key: str,
        label: str,
        hook_id: str,
        revision: int,
        timeout_s: float | None,
        run: RunScope | None,
    ) -> Any:
        scope = anyio.CancelScope()
        self._waiters[hook_id] = scope
        try:
            with scope:
                with anyio.fail_after(timeout_s):
                    return await self._watch_until_settled(key, label, revision)
        except TimeoutError:
            await self._detach(key, label)
            raise HookTimeoutError(f"hook {label!r} got no resolution within {timeout_s}s") from None
        finally:
            self._waiters.pop(hook_id, None)
            if scope.cancelled_caught:
                if run is not None:
                    run.aborted.add(label)
                with anyio.CancelScope(shield=True):
                    await self._detach(key, label)
                raise HookAbortedError(f"waiting on hook {label!r} was aborted; it stays pending")

    async def _watch_until_settled(self, key: str, label: str, revision: int) -> Any:
        watcher = await self._kv.watch(key)
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=self._poll_s)
                except nats.errors.TimeoutError:
                    entry = None  # quiet: read it ourselves (the watch may have stalled)
                if entry is None:
                    got = await self.get(label)
                    if got is None:
                        raise HookCancelledError(label, "the record was removed")
                    record, rev = got
                elif entry.value and entry.revision is not None:
                    record, rev = decode(entry.value, SuspensionRecord), entry.revision
                elif entry.operation in ("DEL", "PURGE"):
                    raise HookCancelledError(label, "the record was removed")
                else:
                    continue
                if record.status == "cancelled":
                    raise HookCancelledError(label, record.reason)
                if record.status == "resolved" and not record.consumed:
                    value = await self._consume(key, record, rev)
                    if value is not _LOST_RACE:
                        return value
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
                _check(record, data)
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

    # -- plumbing --------------------------------------------------------------------------
    async def _write(self, key: str, record: SuspensionRecord, *, last: int) -> int:
        payload = encode(record)
        async for attempt in _retrying():
            with attempt:
                if last == 0:
                    return await self._kv.create(key, payload)
                return await self._kv.update(key, payload, last=last)
        raise AssertionError("unreachable")

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


def _settled(record: SuspensionRecord) -> str:
    if record.status == "resolved":
        return "resolved (consumed)" if record.consumed else "resolved"
    return f"cancelled ({record.reason})" if record.reason else "cancelled"


def _check(record: SuspensionRecord, data: Any) -> None:
    assert record.payload_schema is not None
    validator = jsonschema.Draft202012Validator(record.payload_schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        path = "$" + "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ResolutionRejectedError(
            f"resolution for {record.label!r} does not fit {record.payload_type or 'its schema'}:"
            f" {error.message} at {path}"
        )
