"""The machinery under `_telemetry`: which providers are set, and call spans whose context
is made before the span.

- `otel.sync()`: which global providers the application set is decided at first use (a
  provider named by ``OTEL_PYTHON_TRACER_PROVIDER`` / ``OTEL_PYTHON_METER_PROVIDER`` is
  loaded then) and looked at again only when the API's global provider slot changes: two
  identity tests per emit, no environment read.
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
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.metrics import _internal as _metrics_api
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from hookbus.schemas import _telemetry_names as tn

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, UpDownCounter

__all__ = ["error", "make", "otel", "reserve"]

log = logging.getLogger("hookbus.dispatcher.telemetry")

try:
    _VERSION = _metadata.version("hookbus")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    _VERSION = "0"

_SLOTS = hasattr(trace, "_TRACER_PROVIDER") and hasattr(_metrics_api, "_METER_PROVIDER")
"""Whether the API keeps its global providers in the module slots read below (every
release since 1.12); without them each emit asks ``get_*_provider()``."""
_UNSET = object()
_PROXY_MP: type = getattr(_metrics_api, "_ProxyMeterProvider", NoOpMeterProvider)
"""The API's "no provider set yet" meter provider (private name, stable since 1.12)."""


class _Otel:
    """The tracer, meter and instruments, bound to the current global providers."""

    __slots__ = (
        "decisions",
        "emit_duration",
        "env_loaded",
        "exact_ids",
        "fail_opens",
        "failures",
        "handler_duration",
        "meter_slot",
        "metrics",
        "on",
        "pending",
        "tracer",
        "tracer_slot",
        "tracing",
    )

    def __init__(self) -> None:
        self.tracing = False
        self.metrics = False
        self.on = False
        self.exact_ids = False
        """Whether `materialize` can give a span the context `reserve` made."""
        self.env_loaded = False
        self.tracer_slot: object = _UNSET
        self.meter_slot: object = _UNSET
        self.tracer: trace.Tracer = trace.NoOpTracer()
        self.emit_duration: Histogram
        self.handler_duration: Histogram
        self.decisions: Counter
        self.failures: Counter
        self.fail_opens: Counter
        self.pending: UpDownCounter

    def sync(self) -> bool:
        """Rebind if the application set other providers; whether any signal is on."""
        if (
            not _SLOTS
            or trace._TRACER_PROVIDER is not self.tracer_slot
            or _metrics_api._METER_PROVIDER is not self.meter_slot
        ):
            self._rebind()
        return self.on

    def _rebind(self) -> None:
        if not self.env_loaded:  # once: a provider named in the environment loads now
            self.env_loaded = True
            try:
                trace.get_tracer_provider()
                metrics.get_meter_provider()
            except Exception as exc:  # a bad OTEL_PYTHON_*_PROVIDER: say so, stay off
                log.warning("OpenTelemetry provider from the environment not loaded: %r", exc)
        tracer_slot = trace._TRACER_PROVIDER if _SLOTS else trace.get_tracer_provider()
        meter_slot = _metrics_api._METER_PROVIDER if _SLOTS else metrics.get_meter_provider()
        if tracer_slot is not self.tracer_slot:
            tp = cast(trace.TracerProvider, tracer_slot)
            if tracer_slot is None:
                tp = trace.NoOpTracerProvider()
            self.tracer = tp.get_tracer(tn.SCOPE_DISPATCHER, _VERSION)
            self.exact_ids = _take_over_ids(self.tracer)
            self.tracing = not isinstance(tp, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
            self.tracer_slot = tracer_slot  # last: a reader that sees it sees the tracer
        if meter_slot is not self.meter_slot:
            mp = cast(metrics.MeterProvider, meter_slot)
            if meter_slot is None:
                mp = NoOpMeterProvider()
            self._instruments(mp.get_meter(tn.SCOPE_DISPATCHER, _VERSION))
            self.metrics = not isinstance(mp, _PROXY_MP | NoOpMeterProvider)
            self.meter_slot = meter_slot
        self.on = self.tracing or self.metrics

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
