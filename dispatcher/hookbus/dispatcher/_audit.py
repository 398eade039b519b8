"""The decision audit trail: one `DecisionRecord` per decided emit, in a JetStream stream.

`DecisionLog.append` is called once per emit, where `HookDispatcher.emit` knows its final
result. It never raises and never waits on NATS: the record is put on a bounded queue,
and a background task publishes it (``js.publish`` on ``hookbus.v1.decisions.<agent>``;
the JetStream acknowledgement confirms it is stored).

Why a background task with a bounded queue rather than an inline publish with a timeout:

- the decision is the caller's, not the audit trail's. An inline publish adds a JetStream
  round trip (a replicated write on a cluster) to every emit, and while JetStream is
  unavailable (a leader election: seconds) every emit would wait out the timeout and then
  return the same decision anyway. In the background, an emit costs one ``put_nowait``.
- the queue is bounded (`queue_size`), so an unreachable stream costs bounded memory; a
  record that does not fit is dropped at once.
- a publish whose outcome is unknown (no ack in `publish_timeout_s`) is sent again, for
  up to `retry_for_s` seconds, with the record's id as ``Nats-Msg-Id``: JetStream stores it
  once (duplicate window 2 min).

The price: a record is stored shortly *after* the emit returns, and records still queued
when the process dies are lost. No record is lost silently: every record not stored (queue
full, retries exhausted, the log closed) is counted (`dropped`, the
``hookbus.audit.dropped`` metric by reason) and named by its emit id in a WARNING, at most
one line per `warn_interval_s` seconds, each listing every emit id dropped since the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from opentelemetry import metrics, trace

from hookbus._core.deadlines import Deadline
from hookbus._core.decisions_stream import ensure_decisions_stream
from hookbus._core.jetstream import jetstream_context
from hookbus._core.kv import is_transient
from hookbus.schemas import (
    DECISIONS_DEFAULT_MAX_AGE_S,
    DECISIONS_DEFAULT_MAX_BYTES,
    DECISIONS_STREAM,
    DecisionRecord,
    HookResult,
    decisions_subject,
    encode,
)
from hookbus.schemas import telemetry as tn

__all__ = ["DecisionLog", "current_trace_id"]

log = logging.getLogger("hookbus.dispatcher.audit")


def current_trace_id() -> str | None:
    """The trace id of the current OpenTelemetry span (32 hex digits), None without one."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


@dataclass(slots=True)
class _Pending:
    record: DecisionRecord
    subject: str
    payload: bytes
    queued_at: float  # monotonic
    error: str = ""  # why the last publish of it failed

    def closed(self) -> str:
        """The reason it was dropped when the log closed before it was stored."""
        tried = f"; last try: {self.error}" if self.error else ""
        return f"the log closed before it was stored{tried}"


class _DropCounter:
    """The ``hookbus.audit.dropped`` counter, rebound when the global meter provider
    changes (as the dispatcher's other instruments are)."""

    __slots__ = ("_counter", "_provider")

    def __init__(self) -> None:
        self._provider: object = None
        self._counter: Any = None

    def add(self, reason: str) -> None:
        provider = metrics.get_meter_provider()
        if provider is not self._provider:
            self._provider = provider
            meter = provider.get_meter(tn.SCOPE_DISPATCHER)
            self._counter = meter.create_counter(
                tn.METRIC_AUDIT_DROPPED,
                unit="{record}",
                description="Decision audit records not stored, by reason.",
            )
        self._counter.add(1, {tn.AUDIT_DROP_REASON: reason})


_drops = _DropCounter()


class DecisionLog:
    """Append `DecisionRecord`s to the decisions stream from a background task.

    Usage: ``log = DecisionLog(nc)``, ``await log.start()`` (opens or creates the stream),
    ``log.append(...)`` once per decided emit, ``await log.close()`` (bounded flush).

    Args:
        nc: the connection to publish on.
        max_age_s, max_bytes, replicas: the stream's retention, if this log creates it.
        strict: refuse a stream that exists with another config (`BucketConfigError`).
        queue_size: records waiting to be published; more are dropped (and logged).
        concurrency: publishes in flight at once.
        publish_timeout_s: seconds to wait for one publish's acknowledgement.
        retry_for_s: seconds after which a record not yet stored is dropped.
        warn_interval_s: at most one WARNING about dropped records per this many seconds.
        create_timeout_s: bound of each stream info / create request at `start`.
        open_stream: check (and create) the stream at `start`; False: only publish (a
            NATS user that may append records but not read or create the stream).
    """

    def __init__(
        self,
        nc: NATS,
        *,
        max_age_s: float = DECISIONS_DEFAULT_MAX_AGE_S,
        max_bytes: int = DECISIONS_DEFAULT_MAX_BYTES,
        replicas: int = 1,
        strict: bool = False,
        queue_size: int = 10_000,
        concurrency: int = 16,
        publish_timeout_s: float = 2.0,
        retry_for_s: float = 10.0,
        warn_interval_s: float = 10.0,
        create_timeout_s: float = 5.0,
        open_stream: bool = True,
    ) -> None:
        self._nc = nc
        self._retention = (max_age_s, max_bytes, replicas)
        self._strict = strict
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue(maxsize=queue_size)
        self._slots = asyncio.Semaphore(concurrency)
        self._publish_timeout_s = publish_timeout_s
        self._retry_for_s = retry_for_s
        self._warn_interval_s = warn_interval_s
        self._create_timeout_s = create_timeout_s
        self._open_stream = open_stream
        self._js = jetstream_context(nc)
        self._runner: asyncio.Task[None] | None = None
        self._inflight: dict[asyncio.Task[None], _Pending] = {}
        self._closed = False
        self._unreported: list[str] = []
        self._reasons: Counter[str] = Counter()
        self._last_error = ""
        self._last_warning = -float("inf")
        self._warn_handle: asyncio.TimerHandle | None = None
        self.written = 0
        """Records stored (acknowledged by JetStream)."""
        self.dropped = 0
        """Records not stored: each was counted, and named in a WARNING by its emit id."""

    async def start(self) -> None:
        """Open (or create) the stream and start publishing. See `ensure_decisions_stream`
        for what is raised."""
        if self._runner is not None:
            return
        max_age_s, max_bytes, replicas = self._retention
        if self._open_stream:
            await ensure_decisions_stream(
                self._nc,
                max_age_s=max_age_s,
                max_bytes=max_bytes,
                replicas=replicas,
                strict=self._strict,
                timeout_s=self._create_timeout_s,
            )
        self._closed = False
        self._runner = asyncio.create_task(self._run(), name="hookbus-decision-log")

    @property
    def pending(self) -> int:
        """Records queued or being published."""
        return self._queue.qsize() + len(self._inflight)

    def append(
        self,
        event: str,
        result: HookResult,
        *,
        emit_id: str,
        idempotency_key: str | None = None,
        agent_id: str | None = None,
        session_id: str | None = None,
        tool_name: str | None = None,
        handlers: list[str] | None = None,
        trace_id: str | None = None,
        duration_ms: float | None = None,
    ) -> None:
        """Queue the record of one decided emit. Never raises, never waits: a record that
        cannot be queued is dropped, counted and logged with its emit id.

        `duration_ms`: milliseconds from the start of the emit's chain to its decision
        (`DecisionRecord.duration_ms`); None when unknown. A negative or non-finite value
        is stored as None."""
        try:
            now = time.time()
            record = DecisionRecord(
                id=os.urandom(16).hex(),
                event=event,
                action=result.action,
                time=now,
                time_iso=datetime.fromtimestamp(now, UTC).isoformat(),
                emit_id=emit_id,
                idempotency_key=idempotency_key,
                agent_id=agent_id,
                session_id=session_id,
                tool_name=tool_name,
                handlers=list(handlers or ()),
                decided_by=result.decided_by,
                reason=result.reason,
                failures=list(result.failures),
                approver=result.approved_by,
                trace_id=trace_id,
                duration_ms=_duration(duration_ms),
            )
            subject, payload = decisions_subject(agent_id), encode(record)
            pending = _Pending(record, subject, payload, time.monotonic())
        except Exception as exc:  # a bug or an unencodable value: never the caller's problem
            self._drop(emit_id, "error", repr(exc))
            return
        if self._closed or self._runner is None:
            self._drop(emit_id, "closed", "the decision log is not running")
            return
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            self._drop(emit_id, "queue_full", f"{self._queue.maxsize} records already queued")

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting records, publish the queued ones for up to `timeout_s` seconds,
        then drop (and log) whatever is left. Idempotent."""
        if self._runner is None:
            self._closed = True
            return
        self._closed = True
        runner, self._runner = self._runner, None
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)  # a full queue: the wait below ends by timeout
        done, _ = await asyncio.wait([runner], timeout=timeout_s)
        if not done:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        for task in list(self._inflight):
            task.cancel()
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=1.0)
        for p in self._inflight.values():  # tasks that would not end
            self._drop(p.record.emit_id, "closed", p.closed())
        self._inflight.clear()
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                self._drop(item.record.emit_id, "closed", item.closed())
        self._warn_now()

    # -- internals ------------------------------------------------------------------------
    async def _run(self) -> None:
        """Take records in order and publish each in a task (at most `concurrency` at once)."""
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    break
                await self._slots.acquire()
                task = asyncio.create_task(self._publish(item))
                self._inflight[task] = item
                task.add_done_callback(self._finished)
            if self._inflight:
                await asyncio.wait(list(self._inflight))
        except asyncio.CancelledError:
            pass

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._slots.release()
        item = self._inflight.pop(task, None)
        if item is not None and task.cancelled():
            self._drop(item.record.emit_id, "closed", item.closed())

    async def _publish(self, item: _Pending) -> None:
        headers = {"Nats-Msg-Id": item.record.id}
        deadline = Deadline.after(self._retry_for_s, item.queued_at)  # on time.monotonic()
        wait = 0.05
        while True:
            try:
                await self._js.publish(
                    item.subject, item.payload, timeout=self._publish_timeout_s, headers=headers
                )
                self.written += 1
                return
            except Exception as exc:
                error = _describe(exc)
                if isinstance(exc, nats.js.errors.NoStreamResponseError):
                    error += (
                        f" (no stream stores {item.subject}: `hookbus dispatcher --audit` or an"
                        f" admin creates {DECISIONS_STREAM})"
                    )
                item.error = error
                if not is_transient(exc):
                    self._drop(item.record.emit_id, "refused", error)
                    return
                now = time.monotonic()
                if deadline.passed(now):
                    self._drop(item.record.emit_id, "unavailable", error)
                    return
                await asyncio.sleep(deadline.cut(wait, now))
                wait = min(wait * 2, 1.0)

    def _drop(self, emit_id: str, reason: str, error: str) -> None:
        """Count a record not stored and have it named in the next WARNING."""
        self.dropped += 1
        self._unreported.append(emit_id)
        self._reasons[reason] += 1
        self._last_error = error
        with contextlib.suppress(Exception):  # metrics must never fail the caller
            _drops.add(reason)
        if self._warn_handle is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: report at once
            self._warn_now()
            return
        # the next WARNING: once this burst is over (a later turn of the loop), and no
        # sooner than `warn_interval_s` after the last one
        wait = self._last_warning + self._warn_interval_s - time.monotonic()
        self._warn_handle = loop.call_later(max(0.0, wait), self._warn_now)

    def _warn_now(self) -> None:
        """One WARNING naming every emit id dropped since the last one."""
        if self._warn_handle is not None:
            self._warn_handle.cancel()
            self._warn_handle = None
        if not self._unreported:
            return
        ids, self._unreported = self._unreported, []
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self._reasons.items()))
        self._reasons.clear()
        self._last_warning = time.monotonic()
        log.warning(
            "decision audit: %d record(s) NOT stored (%s; last error: %s); emit ids: %s",
            len(ids),
            reasons,
            self._last_error,
            " ".join(ids),
        )


def _duration(ms: float | None) -> float | None:
    """`ms` rounded to the microsecond; None for None, a negative or non-finite value."""
    if ms is None or not math.isfinite(ms) or ms < 0:
        return None
    return round(ms, 3)


def _describe(exc: BaseException) -> str:
    description = getattr(exc, "description", None)
    return f"{type(exc).__name__}: {description or exc}"
