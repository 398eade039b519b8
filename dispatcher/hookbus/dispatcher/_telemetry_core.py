"""The machinery under `_telemetry`: which providers are set, and call spans whose context
is made before the span.

- `otel.sync()`: which global providers the application set is decided at first use (a
  provider named by ``OTEL_PYTHON_TRACER_PROVIDER`` / ``OTEL_PYTHON_METER_PROVIDER`` is
  loaded then) and looked at again only when the API's global provider slot changes: two
  identity tests per emit, no environment read (`ProviderSlots`, shared with the workers).
- `reserve(...)` / `make(...)`: for a handler call whose request carries its context
  before anyone knows whether it will run (one request that runs several handlers),
  `reserve` asks the tracer's sampler at once and makes the span's context (the parent's
  trace, a span id of its own, the sampled flag, the sampler's trace state) without a
  span; `make` makes the SDK span with that very context when the call has ended (the
  span id goes through the SDK tracer's id generator, ``Tracer.id_generator``). A context
  never made into a span leaves nothing. A tracer without ``id_generator`` and
  ``sampler`` (not the SDK's) gets no reservation: the caller starts a real span.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from hookbus._core.otel_providers import ProviderSlots
from hookbus.schemas import telemetry as tn

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, UpDownCounter

__all__ = ["error", "make", "otel", "reserve"]

log = logging.getLogger("hookbus.dispatcher.telemetry")


class _Otel(ProviderSlots):
    """The tracer, meter and instruments of the dispatcher's scope, bound to the current
    global providers."""

    __slots__ = (
        "decisions",
        "emit_duration",
        "exact_ids",
        "fail_opens",
        "failures",
        "handler_duration",
        "pending",
    )

    def __init__(self) -> None:
        self.exact_ids = False
        """Whether `make` can give a span the context `reserve` made."""
        super().__init__(tn.SCOPE_DISPATCHER, log)
        self.emit_duration: Histogram
        self.handler_duration: Histogram
        self.decisions: Counter
        self.failures: Counter
        self.fail_opens: Counter
        self.pending: UpDownCounter

    def _bind_tracer(self, tracer: trace.Tracer) -> None:
        self.exact_ids = _take_over_ids(tracer)

    def _bind_meter(self, meter: metrics.Meter) -> None:
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


otel = _Otel()


# -- call spans whose context is made before the span ---------------------------------------------
class _Reserved(threading.local):
    span_id = 0


_reserved = _Reserved()


class _ReservedIds:
    """An SDK tracer's id generator that hands out the span id `reserve` made for the span
    `make` is making, and otherwise asks the generator it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate_span_id(self) -> int:
        span_id = _reserved.span_id
        if span_id:
            _reserved.span_id = 0
            return span_id
        return int(self.inner.generate_span_id())

    def generate_trace_id(self) -> int:
        return int(self.inner.generate_trace_id())

    def __getattr__(self, name: str) -> Any:  # is_trace_id_random, and whatever comes next
        return getattr(self.inner, name)


def _take_over_ids(tracer: trace.Tracer) -> bool:
    """Wrap the id generator of `tracer` (an SDK tracer, this scope's own) in
    `_ReservedIds`; False if it has none, or no sampler to ask first."""
    inner = getattr(tracer, "id_generator", None)
    if inner is None or not callable(getattr(inner, "generate_span_id", None)):
        return False
    if not callable(getattr(getattr(tracer, "sampler", None), "should_sample", None)):
        return False
    if not isinstance(inner, _ReservedIds):
        tracer.id_generator = _ReservedIds(inner)  # type: ignore[attr-defined]
    return True


def _new_id(bits: int) -> int:
    value = random.getrandbits(bits)  # as the SDK's RandomIdGenerator
    while not value:
        value = random.getrandbits(bits)
    return value


def reserve(
    name: str, parent: otel_context.Context, kind: SpanKind
) -> tuple[SpanContext, bool] | None:
    """The context a span `name` (a child of the span in `parent`) will have, and whether
    it is recorded, as the tracer's sampler decides it now (asked without attributes); no
    span is made (`make` makes it). None: the tracer cannot make a span with a context
    made in advance (not the SDK's), or the parent has no valid context."""
    tracer = otel.tracer
    parent_ctx = trace.get_current_span(parent).get_span_context()
    if not otel.exact_ids or not parent_ctx.is_valid:
        return None
    enabled = getattr(tracer, "_is_enabled", None)  # the SDK's per-scope switch
    if enabled is not None and not enabled():
        return None
    result = tracer.sampler.should_sample(  # type: ignore[attr-defined]
        parent, parent_ctx.trace_id, name, kind, None, None
    )
    sampled = result.decision.is_sampled()
    flags = (parent_ctx.trace_flags & ~_SAMPLED) | (_SAMPLED if sampled else 0)
    context = SpanContext(
        parent_ctx.trace_id, _new_id(64), False, TraceFlags(flags), result.trace_state
    )
    return context, result.decision.is_recording()


_SAMPLED = 0x01


def make(
    name: str, parent: otel_context.Context, kind: SpanKind, start_ns: int, context: SpanContext
) -> trace.Span:
    """The SDK span `name` with the `context` `reserve` made (its span id), a child of the
    span in `parent`, started at `start_ns` (the sampler decides again, as it did)."""
    _reserved.span_id = context.span_id
    try:
        return otel.tracer.start_span(name, parent, kind=kind, start_time=start_ns)
    finally:
        _reserved.span_id = 0


def error(span: trace.Span, exc: BaseException) -> None:
    """Record `exc` on `span`: an exception event, status ERROR, ``error.type``."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.set_attribute(tn.ERROR_TYPE, type(exc).__qualname__)


def note_delivery(requests: int, instance: str) -> None:
    """On the current span (a handler call's ``send`` span, when recorded): the requests
    the call sent (`tn.REQUESTS`; more than 1: hedged, or refused and sent again) and the
    worker instance whose reply was used (`tn.WORKER_INSTANCE`; "" for none: not set)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(tn.REQUESTS, requests)
        if instance:
            span.set_attribute(tn.WORKER_INSTANCE, instance)
