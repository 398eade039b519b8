"""OpenTelemetry for workers: one CONSUMER span per handling, linked to the dispatcher's call.

The library only uses the OpenTelemetry API and the global providers the application set
(looked up per request, so providers set after import are used from then on); with none
set, a request costs two provider look-ups and no span. The span (``process <subject>``)
is parented to, and linked with, the context in the request's W3C ``traceparent`` NATS
header, so the dispatcher's ``send`` span and this one share a trace; a request without
headers starts a new trace. Names in `hookbus.schemas._telemetry_names`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg
from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from hookbus.schemas import HookReply
from hookbus.schemas import _telemetry_names as tn

try:  # the API's "no provider set yet" meter provider (private name, stable since 1.12)
    from opentelemetry.metrics._internal import _ProxyMeterProvider as _ProxyMP
except ImportError:  # pragma: no cover - a future API without it
    _ProxyMP = NoOpMeterProvider  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram

    from ._worker import HandlerSpec

__all__ = ["traced_handling"]

try:
    _VERSION = _metadata.version("hookbus")
except _metadata.PackageNotFoundError:  # pragma: no cover
    _VERSION = "0"


class _Ids(msgspec.Struct):
    tool_name: Any = None


class _Envelope(msgspec.Struct):
    """The fields of an `EventEnvelope` the span wants; the rest is skipped unparsed."""

    id: Any = None
    agent_id: Any = None
    session_id: Any = None
    data: _Ids | None = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)


class _Otel:
    __slots__ = (
        "meter_provider",
        "metrics",
        "process_duration",
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
        self.process_duration: Histogram

    def refresh(self) -> bool:
        tp = trace.get_tracer_provider()
        if tp is not self.tracer_provider:
            self.tracer_provider = tp
            self.tracing = not isinstance(tp, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
            self.tracer = tp.get_tracer(tn.SCOPE_WORKERS, _VERSION)
        mp = metrics.get_meter_provider()
        if mp is not self.meter_provider:
            self.meter_provider = mp
            self.metrics = not isinstance(mp, _ProxyMP | NoOpMeterProvider)
            self.process_duration = mp.get_meter(tn.SCOPE_WORKERS, _VERSION).create_histogram(
                tn.METRIC_PROCESS_DURATION,
                unit="s",
                description="Duration of one handling in a worker.",
                explicit_bucket_boundaries_advisory=tn.DURATION_BUCKETS_S,
            )
        return self.tracing or self.metrics


_otel = _Otel()

Handle = Callable[[Any, "HandlerSpec", Msg], Awaitable["HookReply | None"]]


def traced_handling(fn: Handle) -> Handle:
    """Decorate `HookWorker._handle(spec, msg) -> HookReply | None`: the CONSUMER span and
    the ``messaging.process.duration`` histogram (seconds)."""

    @functools.wraps(fn)
    async def handle(self: Any, spec: HandlerSpec, msg: Msg) -> HookReply | None:
        if not _otel.refresh():
            return await fn(self, spec, msg)
        return await _observed(fn, self, spec, msg)

    return handle


async def _observed(fn: Handle, worker: Any, spec: HandlerSpec, msg: Msg) -> HookReply | None:
    decl = spec.declaration
    span: trace.Span | None = None
    if _otel.tracing:
        parent = propagate.extract(msg.headers) if msg.headers else None
        remote = trace.get_current_span(parent).get_span_context()
        # few attributes (each costs the SDK about a microsecond): the event is in the
        # subject, priority and policy on the dispatcher's span of the same call
        attrs: dict[str, Any] = {
            tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
            tn.MESSAGING_DESTINATION_NAME: msg.subject,
            tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_PROCESS,
            tn.MESSAGING_CONSUMER_GROUP_NAME: decl.queue_group,
            tn.HANDLER: decl.name,
            **_envelope_attrs(msg.data),
        }
        span = _otel.tracer.start_span(
            f"{tn.SPAN_PROCESS} {msg.subject}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attrs,
            links=[Link(remote)] if remote.is_valid else None,
        )
    start = time.perf_counter()
    reply: HookReply | None = None
    error_type: str | None = None
    try:
        if span is None:
            reply = await fn(worker, spec, msg)
        else:
            with trace.use_span(span, end_on_exit=False):
                reply = await fn(worker, spec, msg)
        error_type = _reply_attrs(span, reply)
        return reply
    except BaseException as exc:
        error_type = type(exc).__qualname__
        raise
    finally:
        if span is not None:
            span.end()
        if _otel.metrics:
            m: dict[str, Any] = {
                tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
                tn.MESSAGING_DESTINATION_NAME: msg.subject,
                tn.MESSAGING_CONSUMER_GROUP_NAME: decl.queue_group,
                tn.HANDLER: decl.name,
            }
            if error_type is not None:
                m[tn.ERROR_TYPE] = error_type
            elif reply is not None and reply.result is not None:
                m[tn.ACTION] = reply.result.action
            _otel.process_duration.record(time.perf_counter() - start, m)


def _envelope_attrs(payload: bytes) -> dict[str, Any]:
    try:
        env = _envelope_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return {}
    attrs: dict[str, Any] = {}
    tool = env.data.tool_name if env.data is not None else None
    for value, name in (
        (env.id, tn.MESSAGING_MESSAGE_ID),
        (env.agent_id, tn.GEN_AI_AGENT_ID),
        (env.session_id, tn.GEN_AI_CONVERSATION_ID),
        (tool, tn.GEN_AI_TOOL_NAME),
    ):
        if isinstance(value, str) and value:
            attrs[name] = value
    return attrs


def _reply_attrs(span: trace.Span | None, reply: HookReply | None) -> str | None:
    """Put the reply's outcome on the span; return its error code, if any."""
    if reply is None:
        if span is not None:
            span.set_attribute(tn.DROPPED, True)
        return None
    if reply.error is not None:
        if span is not None:
            span.set_attribute(tn.ERROR_TYPE, reply.error.code)
            span.set_status(Status(StatusCode.ERROR, reply.error.message))
        return str(reply.error.code)
    if reply.result is not None and span is not None:
        span.set_attribute(tn.ACTION, reply.result.action)
        if reply.result.reason:
            span.set_attribute(tn.REASON, reply.result.reason)
    return None
