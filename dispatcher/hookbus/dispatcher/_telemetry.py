"""OpenTelemetry for the dispatcher: a span and metrics for every decision.

The library only uses the OpenTelemetry API and whatever tracer and meter providers the
application set globally (``trace.set_tracer_provider`` / ``metrics.set_meter_provider``),
looked up on every emit, so a provider set after import is used from the next emit on.
With none set (the API's proxy or no-op providers) nothing is created: an emit costs one
provider look-up per signal and one flag test per handler call, no span objects, no
``traceparent`` headers.

Spans (names and attributes in `hookbus.schemas._telemetry_names`):

- ``emit <event>`` (INTERNAL): `HookDispatcher.emit`; the folded action, reason, deciding
  handler, and one ``hookbus.handler.failure`` event per failed handler.
- ``send <subject>`` (PRODUCER): one remote handler call; its context goes to the worker
  in the W3C ``traceparent`` NATS header. ``handler <name>`` (INTERNAL) for an in-process one.
- ``process hookbus.v1.emit.<event>`` (CONSUMER): the dispatcher service serving one
  request, parented to and linked with the agent's ``traceparent``.
- ``await <kind>`` (INTERNAL): a suspension wait (`suspension_span`).

Metrics: see the ``METRIC_*`` names (durations in seconds).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from hookbus.schemas import (
    DISPATCHER_QUEUE_GROUP,
    EmitReply,
    HookbusError,
    HookResult,
    decode,
    event_from_service_subject,
    handler_queue_group,
)
from hookbus.schemas import _telemetry_names as tn

from ._calls import Failed, Outcome
from ._routes import Route

try:  # the API's "no provider set yet" meter provider (private name, stable since 1.12)
    from opentelemetry.metrics._internal import _ProxyMeterProvider as _ProxyMP
except ImportError:  # pragma: no cover - a future API without it
    _ProxyMP = NoOpMeterProvider  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, UpDownCounter

__all__ = [
    "SuspensionSpan",
    "suspension_span",
    "trace_headers",
    "traced_call",
    "traced_collect",
    "traced_dispatch",
    "traced_emit",
]

try:
    _VERSION = _metadata.version("hookbus")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    _VERSION = "0"


class _Otel:
    """The tracer, meter and instruments, bound to the current global providers.

    `refresh` is called once per emit: it compares the global providers with the ones
    bound (identity, ~0.1 us each) and rebinds when the application set new ones.
    """

    __slots__ = (
        "decisions",
        "emit_duration",
        "fail_opens",
        "failures",
        "handler_duration",
        "meter_provider",
        "metrics",
        "pending",
        "tracer",
        "tracer_provider",
        "tracing",
    )

    def __init__(self) -> None:
        self.tracing = False
        self.metrics = False
        self.tracer_provider: object = None
        self.meter_provider: object = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        self.emit_duration: Histogram
        self.handler_duration: Histogram
        self.decisions: Counter
        self.failures: Counter
        self.fail_opens: Counter
        self.pending: UpDownCounter

    def refresh(self) -> bool:
        """Rebind to the global providers if they changed; whether any signal is on."""
        tp = trace.get_tracer_provider()
        if tp is not self.tracer_provider:
            self.tracer_provider = tp
            self.tracing = not isinstance(tp, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
            self.tracer = tp.get_tracer(tn.SCOPE_DISPATCHER, _VERSION)
        mp = metrics.get_meter_provider()
        if mp is not self.meter_provider:
            self.meter_provider = mp
            self.metrics = not isinstance(mp, _ProxyMP | NoOpMeterProvider)
            self._instruments(mp.get_meter(tn.SCOPE_DISPATCHER, _VERSION))
        return self.tracing or self.metrics

    def _instruments(self, meter: metrics.Meter) -> None:
        buckets = tn.DURATION_BUCKETS_S
        self.emit_duration = meter.create_histogram(
            tn.METRIC_EMIT_DURATION, unit="s", description="Duration of one emit.",
            explicit_bucket_boundaries_advisory=buckets,
        )  # fmt: skip
        self.handler_duration = meter.create_histogram(
            tn.METRIC_HANDLER_DURATION, unit="s",
            description="Duration of one handler call as the dispatcher saw it.",
            explicit_bucket_boundaries_advisory=buckets,
        )  # fmt: skip
        self.decisions = meter.create_counter(
            tn.METRIC_DECISIONS, unit="{emit}", description="Emits by folded action."
        )
        self.failures = meter.create_counter(
            tn.METRIC_FAILURES, unit="{failure}",
            description="Handler failures by kind and failure policy.",
        )  # fmt: skip
        self.fail_opens = meter.create_counter(
            tn.METRIC_FAIL_OPENS, unit="{failure}",
            description="Handler failures ignored by policy (the call went on).",
        )  # fmt: skip
        self.pending = meter.create_up_down_counter(
            tn.METRIC_SUSPENSIONS_PENDING, unit="{suspension}",
            description="Suspension waits in progress.",
        )  # fmt: skip


_otel = _Otel()


def _ids(data: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The GenAI attributes of an event's data: agent, session (conversation), tool."""
    attrs: dict[str, Any] = {}
    for source in (defaults, data):
        if not source:
            continue
        for key, name in (
            ("agent_id", tn.GEN_AI_AGENT_ID),
            ("session_id", tn.GEN_AI_CONVERSATION_ID),
            ("tool_name", tn.GEN_AI_TOOL_NAME),
        ):
            value = source.get(key)
            if isinstance(value, str) and value:
                attrs[name] = value
    return attrs


def _result_attrs(result: HookResult) -> dict[str, Any]:
    attrs: dict[str, Any] = {tn.ACTION: result.action}
    if result.reason:
        attrs[tn.REASON] = result.reason
    if result.decided_by:
        attrs[tn.DECIDED_BY] = result.decided_by
    if result.approved_by:
        attrs[tn.APPROVED_BY] = result.approved_by
    return attrs


# -- emit ------------------------------------------------------------------------------------
def traced_emit(
    fn: Callable[..., Awaitable[HookResult]],
) -> Callable[..., Awaitable[HookResult]]:
    """Decorate `HookDispatcher.emit`: the ``emit <event>`` span and the emit metrics."""

    @functools.wraps(fn)
    async def emit(self: Any, event: str, data: dict[str, Any], **kwargs: Any) -> HookResult:
        if not _otel.refresh():
            return await fn(self, event, data, **kwargs)
        return await _observed_emit(fn, self, event, data, kwargs)

    return emit


async def _observed_emit(
    fn: Callable[..., Awaitable[HookResult]],
    dispatcher: Any,
    event: str,
    data: dict[str, Any],
    kwargs: dict[str, Any],
) -> HookResult:
    tracing = _otel.tracing
    span: trace.Span | None = None
    token = None
    if tracing:
        attrs = {tn.EVENT: event, **_ids(data, getattr(dispatcher, "_defaults", None))}
        span = _otel.tracer.start_span(f"{tn.SPAN_EMIT} {event}", attributes=attrs)
        token = otel_context.attach(trace.set_span_in_context(span))
    start = time.perf_counter()
    metric_attrs: dict[str, Any] = {tn.EVENT: event}
    try:
        result = await fn(dispatcher, event, data, **kwargs)
    except BaseException as exc:
        metric_attrs[tn.ERROR_TYPE] = type(exc).__qualname__
        if span is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attribute(tn.ERROR_TYPE, type(exc).__qualname__)
        raise
    else:
        metric_attrs[tn.ACTION] = result.action
        failed_open = [f.handler for f in result.failures if f.policy == "ignore"]
        if span is not None:
            end = _result_attrs(result)
            end[tn.FAILED_OPEN] = bool(failed_open)
            if result.failures:
                end[tn.FAILURE_COUNT] = len(result.failures)
            if failed_open:
                end[tn.FAILED_OPEN_HANDLERS] = failed_open
            span.set_attributes(end)
            for f in result.failures:
                span.add_event(
                    tn.EVENT_HANDLER_FAILURE,
                    {
                        tn.HANDLER: f.handler,
                        tn.FAILURE_KIND: f.kind,
                        tn.FAILURE_POLICY: f.policy,
                        tn.FAILED_OPEN: f.policy == "ignore",
                        "exception.message": f.message,
                    },
                )
        if _otel.metrics:
            _otel.decisions.add(1, {tn.EVENT: event, tn.ACTION: result.action})
            for f in result.failures:
                attrs = {tn.EVENT: event, tn.HANDLER: f.handler, tn.FAILURE_KIND: f.kind}
                _otel.failures.add(1, {**attrs, tn.FAILURE_POLICY: f.policy})
                if f.policy == "ignore":
                    _otel.fail_opens.add(1, attrs)
        return result
    finally:
        if _otel.metrics:
            _otel.emit_duration.record(time.perf_counter() - start, metric_attrs)
        if span is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
            span.end()


# -- one handler call --------------------------------------------------------------------------
def traced_call(
    fn: Callable[[Any, Route, Any, dict[str, Any]], Awaitable[Outcome]],
) -> Callable[[Any, Route, Any, dict[str, Any]], Awaitable[Outcome]]:
    """Decorate `HookDispatcher._call(route, ctx, data)`: one span per handler call.

    `ctx` is the emit's context (``event``, ``id``). Inside, `trace_headers` gives the
    ``traceparent`` of this call's span for the NATS request.
    """

    @functools.wraps(fn)
    async def call(self: Any, route: Route, ctx: Any, data: dict[str, Any]) -> Outcome:
        if not (_otel.tracing or _otel.metrics):  # as of this emit's refresh
            return await fn(self, route, ctx, data)
        return await _observed_call(fn, self, route, ctx, data)

    return call


async def _observed_call(
    fn: Callable[[Any, Route, Any, dict[str, Any]], Awaitable[Outcome]],
    dispatcher: Any,
    route: Route,
    ctx: Any,
    data: dict[str, Any],
) -> Outcome:
    event: str = ctx.event
    span: trace.Span | None = None
    token = None
    if _otel.tracing:
        name, kind, static = _route_span(route)
        span = _otel.tracer.start_span(name, kind=kind, attributes=static)
        token = otel_context.attach(trace.set_span_in_context(span))
    start = time.perf_counter()
    outcome: Outcome | None = None
    try:
        outcome = await fn(dispatcher, route, ctx, data)
        return outcome
    except BaseException as exc:
        if span is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attribute(tn.ERROR_TYPE, type(exc).__qualname__)
        raise
    finally:
        elapsed = time.perf_counter() - start
        if span is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
            if outcome is not None:
                span.set_attributes(_outcome_attrs(route, outcome))
                if isinstance(outcome, Failed):
                    span.set_status(Status(StatusCode.ERROR, outcome.message))
            span.end()
        if _otel.metrics:
            m: dict[str, Any] = {tn.EVENT: event, tn.HANDLER: route.name}
            if isinstance(outcome, HookResult):
                m[tn.ACTION] = outcome.action
            elif isinstance(outcome, Failed):
                m[tn.ERROR_TYPE] = outcome.kind
            _otel.handler_duration.record(elapsed, m)


_route_spans: dict[Route, tuple[str, SpanKind, dict[str, Any]]] = {}
"""Per route: span name, kind and the attributes that never change (routes are immutable
and replaced on every registry change; the cache is dropped when it grows large)."""


def _route_span(route: Route) -> tuple[str, SpanKind, dict[str, Any]]:
    got = _route_spans.get(route)
    if got is not None:
        return got
    if len(_route_spans) >= 4096:
        _route_spans.clear()
    # few attributes: each costs the SDK about a microsecond per span; the event is in the
    # subject and on the parent emit span, the policy is set when a failure applies it
    attrs: dict[str, Any] = {tn.HANDLER: route.name, tn.PRIORITY: route.priority}
    if route.parallel:
        attrs[tn.PARALLEL] = True
    if route.remote:
        attrs.update({
            tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
            tn.MESSAGING_DESTINATION_NAME: route.subject,
            tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_SEND,
            tn.MESSAGING_CONSUMER_GROUP_NAME: handler_queue_group(route.name),
        })  # fmt: skip
        got = (f"{tn.SPAN_SEND} {route.subject}", SpanKind.PRODUCER, attrs)
    else:
        attrs[tn.EVENT] = route.event
        got = (f"{tn.SPAN_HANDLER} {route.name}", SpanKind.INTERNAL, attrs)
    _route_spans[route] = got
    return got


def _outcome_attrs(route: Route, outcome: Outcome) -> dict[str, Any]:
    if isinstance(outcome, Failed):
        return {
            tn.FAILURE_KIND: outcome.kind,
            tn.FAILURE_POLICY: route.failure_policy,
            tn.ERROR_TYPE: outcome.kind,
            tn.FAILED_OPEN: route.failure_policy == "ignore",
        }
    attrs: dict[str, Any] = {tn.ACTION: outcome.action}
    if outcome.reason:
        attrs[tn.REASON] = outcome.reason
    if route.parallel and outcome.action == "modify":  # the fold refuses it: a bad reply
        attrs.update({
            tn.FAILURE_KIND: "bad_reply",
            tn.FAILURE_POLICY: route.failure_policy,
            tn.ERROR_TYPE: "bad_reply",
            tn.FAILED_OPEN: route.failure_policy == "ignore",
        })  # fmt: skip
    else:
        attrs[tn.FAILED_OPEN] = False
    return attrs


def trace_headers() -> dict[str, str] | None:
    """NATS headers carrying the current trace context (W3C ``traceparent``), or None when
    tracing is off (so no header bytes are sent)."""
    if not _otel.tracing:
        return None
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers or None


# -- emit_and_collect -----------------------------------------------------------------------------
def traced_collect(
    fn: Callable[..., Awaitable[list[Any]]],
) -> Callable[..., Awaitable[list[Any]]]:
    """Decorate `HookDispatcher.emit_and_collect`: an ``emit_and_collect <event>`` span."""

    @functools.wraps(fn)
    async def emit_and_collect(
        self: Any, event: str, data: dict[str, Any], *args: Any, **kwargs: Any
    ) -> list[Any]:
        if not _otel.refresh() or not _otel.tracing:
            return await fn(self, event, data, *args, **kwargs)
        attrs = {tn.EVENT: event, **_ids(data)}
        with _otel.tracer.start_as_current_span(
            f"{tn.SPAN_EMIT_AND_COLLECT} {event}", attributes=attrs
        ) as span:
            responses = await fn(self, event, data, *args, **kwargs)
            span.set_attribute(tn.RESPONSE_COUNT, len(responses))
            return responses

    return emit_and_collect


# -- service mode ------------------------------------------------------------------------------
def traced_dispatch(
    fn: Callable[[Any, Msg], Awaitable[bytes]],
) -> Callable[[Any, Msg], Awaitable[bytes]]:
    """Decorate a `DispatcherService` request handler ``(self, msg) -> reply bytes``: a
    CONSUMER ``process <subject>`` span parented to and linked with the agent's context
    (``traceparent`` in ``msg.headers``; a request without one starts a new trace)."""

    @functools.wraps(fn)
    async def serve(self: Any, msg: Msg) -> bytes:
        if not _otel.refresh() or not _otel.tracing:
            return await fn(self, msg)
        parent = propagate.extract(msg.headers) if msg.headers else None
        remote = trace.get_current_span(parent).get_span_context()
        attrs: dict[str, Any] = {
            tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
            tn.MESSAGING_DESTINATION_NAME: msg.subject,
            tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_PROCESS,
            tn.MESSAGING_CONSUMER_GROUP_NAME: DISPATCHER_QUEUE_GROUP,
        }
        with contextlib.suppress(HookbusError):
            attrs[tn.EVENT] = event_from_service_subject(msg.subject)
        span = _otel.tracer.start_span(
            f"{tn.SPAN_PROCESS} {msg.subject}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attrs,
            links=[Link(remote)] if remote.is_valid else None,
        )
        with trace.use_span(span, end_on_exit=True):
            payload = await fn(self, msg)
            _reply_attrs(span, payload)
            return payload

    return serve


def _reply_attrs(span: trace.Span, payload: bytes) -> None:
    """Set the outcome of a service reply on its span (an EmitReply or a CollectReply)."""
    try:
        reply = decode(payload, EmitReply)
    except HookbusError:
        return
    if reply.error is not None:
        span.set_attribute(tn.ERROR_TYPE, reply.error.code)
        span.set_status(Status(StatusCode.ERROR, reply.error.message))
    elif reply.result is not None:
        span.set_attributes(_result_attrs(reply.result))


# -- suspensions ---------------------------------------------------------------------------------
class SuspensionSpan:
    """The span of one suspension wait; `event` records its steps.

    Events: ``pending`` (a pending record was created or re-attached: counts in the
    ``hookbus.suspensions.pending`` gauge), ``resolved``, ``cancelled``, ``timed_out``,
    ``aborted`` (each ends the pending count). The last of those is the span's
    ``hookbus.suspension.outcome``.
    """

    __slots__ = ("_attrs", "_counted", "_span", "outcome")

    def __init__(self, span: trace.Span | None, attrs: dict[str, Any]) -> None:
        self._span = span
        self._attrs = attrs
        self._counted = False
        self.outcome: str | None = None

    def event(self, name: str, **attributes: Any) -> None:
        """Record step `name` (one of `SUSPENSION_EVENTS`); keyword attributes are added to
        the span event as ``hookbus.suspension.<key>`` (keys with a dot are kept as is).

        Raises:
            ValueError: `name` is not a suspension event.
        """
        if name not in tn.SUSPENSION_EVENTS:
            known = ", ".join(sorted(tn.SUSPENSION_EVENTS))
            raise ValueError(f"not a suspension event: {name!r} (one of {known})")
        if self._span is not None:
            attrs = {
                (k if "." in k else f"hookbus.suspension.{k}"): v
                for k, v in attributes.items()
                if v is not None
            }
            self._span.add_event(name, attrs)
        if name == tn.SUSPENSION_PENDING:
            if not self._counted and _otel.metrics:
                _otel.pending.add(1, self._attrs)
                self._counted = True
            return
        self.outcome = name
        if self._span is not None:
            self._span.set_attribute(tn.SUSPENSION_OUTCOME, name)
        self._uncount()

    def _uncount(self) -> None:
        if self._counted:
            _otel.pending.add(-1, self._attrs)
            self._counted = False


@contextlib.contextmanager
def suspension_span(
    label: str, *, kind: str = "suspension", attributes: dict[str, Any] | None = None
) -> Iterator[SuspensionSpan]:
    """An ``await <kind>`` span (INTERNAL) around one suspension wait, a child of the
    current span (the emit, for an approval).

    Usage::

        with suspension_span(label, kind="approval", attributes={...}) as s:
            s.event("pending")
            ...                      # wait
            s.event("resolved", choice="Allow")

    An exception leaving the block ends the pending count; it is recorded on the span as an
    error unless an outcome (``timed_out``, ``cancelled``, ...) was recorded first, so
    ``s.event("timed_out"); raise SuspensionTimeoutError(...)`` is an outcome, not a failure.
    `attributes` may use any names (GenAI ids, ``hookbus.handler``, ...); None values are
    dropped. With tracing and metrics off, the object does nothing.
    """
    _otel.refresh()
    base = {tn.SUSPENSION_KIND: kind}
    if not _otel.tracing:
        holder = SuspensionSpan(None, base)
        try:
            yield holder
        finally:
            holder._uncount()
        return
    extra = {k: v for k, v in (attributes or {}).items() if v is not None}
    attrs = {tn.SUSPENSION_LABEL: label, **base, **extra}
    span = _otel.tracer.start_span(f"{tn.SPAN_AWAIT} {kind}", attributes=attrs)
    holder = SuspensionSpan(span, base)
    try:
        with trace.use_span(span, record_exception=False, set_status_on_exception=False):
            yield holder
    except BaseException as exc:
        if holder.outcome is None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attribute(tn.ERROR_TYPE, type(exc).__qualname__)
        raise
    finally:
        holder._uncount()
        span.end()
