"""Which OpenTelemetry providers the application set, for one instrumentation scope.

The dispatcher and the workers each subclass `ProviderSlots` (they never import each
other) and bind their own tracer and instruments in `_bind_tracer` / `_bind_meter`.

`sync()`: the global providers are decided at first use (a provider named by
``OTEL_PYTHON_TRACER_PROVIDER`` / ``OTEL_PYTHON_METER_PROVIDER`` is loaded then) and looked
at again only when the API's global provider slot changes: two identity tests per call, no
environment read. Private module: not exported from `hookbus.schemas`.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata as _metadata
from typing import cast

from opentelemetry import baggage, metrics, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.metrics import _internal as _metrics_api
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["ProviderSlots", "default_textmap", "version", "w3c_headers"]


@functools.cache
def version() -> str:
    """hookbus's version for the instrumentation scope, read from the installed package's
    metadata at first use (not at import: schemas does no I/O when imported); "0" when
    running from a bare checkout."""
    try:
        return _metadata.version("hookbus")
    except _metadata.PackageNotFoundError:  # pragma: no cover
        return "0"


_SLOTS = hasattr(trace, "_TRACER_PROVIDER") and hasattr(_metrics_api, "_METER_PROVIDER")
"""Whether the API keeps its global providers in the module slots read below (every
release since 1.12); without them each call asks ``get_*_provider()``."""
_UNSET = object()
_PROXY_MP: type = getattr(_metrics_api, "_ProxyMeterProvider", NoOpMeterProvider)
"""The API's "no provider set yet" meter provider (private name, stable since 1.12)."""


class ProviderSlots:
    """The tracer (and, in subclasses, the instruments) of instrumentation scope `scope`,
    bound to the current global providers.

    ``tracing`` / ``metrics``: whether the application set a real tracer / meter provider
    (not the API's proxy or no-op one); ``on``: either. A provider named in the
    environment that fails to load is logged on `log` (a warning) and leaves its signal off.
    """

    __slots__ = (
        "env_loaded",
        "log",
        "meter_slot",
        "metrics",
        "on",
        "scope",
        "tracer",
        "tracer_slot",
        "tracing",
    )

    def __init__(self, scope: str, log: logging.Logger) -> None:
        self.scope = scope
        self.log = log
        self.tracing = False
        self.metrics = False
        self.on = False
        self.env_loaded = False
        self.tracer_slot: object = _UNSET
        self.meter_slot: object = _UNSET
        self.tracer: trace.Tracer = trace.NoOpTracer()

    def sync(self) -> bool:
        """Rebind if the application set other providers; whether any signal is on."""
        if (
            not _SLOTS
            or trace._TRACER_PROVIDER is not self.tracer_slot
            or _metrics_api._METER_PROVIDER is not self.meter_slot
        ):
            self._rebind()
        return self.on

    def _bind_tracer(self, tracer: trace.Tracer) -> None:
        """Called with this scope's new tracer (already in ``self.tracer``) before
        ``tracing`` is decided; nothing by default."""

    def _bind_meter(self, meter: metrics.Meter) -> None:
        """Make this scope's instruments on `meter`, the new provider's meter."""
        raise NotImplementedError

    def _rebind(self) -> None:
        if not self.env_loaded:  # once: a provider named in the environment loads now
            self.env_loaded = True
            try:
                trace.get_tracer_provider()
                metrics.get_meter_provider()
            except Exception as exc:  # a bad OTEL_PYTHON_*_PROVIDER: say so, stay off
                self.log.warning("OpenTelemetry provider from the environment not loaded: %r", exc)
        tracer_slot = trace._TRACER_PROVIDER if _SLOTS else trace.get_tracer_provider()
        meter_slot = _metrics_api._METER_PROVIDER if _SLOTS else metrics.get_meter_provider()
        if tracer_slot is not self.tracer_slot:
            tp = cast(trace.TracerProvider, tracer_slot)
            if tracer_slot is None:
                tp = trace.NoOpTracerProvider()
            self.tracer = tp.get_tracer(self.scope, version())
            self._bind_tracer(self.tracer)
            self.tracing = not isinstance(tp, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
            self.tracer_slot = tracer_slot  # last: a reader that sees it sees the tracer
        if meter_slot is not self.meter_slot:
            mp = cast(metrics.MeterProvider, meter_slot)
            if meter_slot is None:
                mp = NoOpMeterProvider()
            self._bind_meter(mp.get_meter(self.scope, version()))
            self.metrics = not isinstance(mp, _PROXY_MP | NoOpMeterProvider)
            self.meter_slot = meter_slot
        self.on = self.tracing or self.metrics


_textmap: tuple[object, bool] = (None, False)


def default_textmap() -> bool:
    """Whether the global propagator is the API's default, W3C trace context then W3C
    baggage (``OTEL_PROPAGATORS`` unset or ``tracecontext,baggage``); one identity test
    while it stays the same."""
    global _textmap
    textmap = propagate.get_global_textmap()
    seen, default = _textmap
    if seen is not textmap:
        parts = getattr(textmap, "_propagators", None)
        default = isinstance(textmap, CompositePropagator) and [type(p) for p in parts or ()] == [
            TraceContextTextMapPropagator,
            W3CBaggagePropagator,
        ]
        _textmap = (textmap, default)
    return default


def w3c_headers(
    span_context: trace.SpanContext, context: otel_context.Context | None
) -> dict[str, str] | None:
    """The headers the default propagator writes for a span with `span_context` in
    `context` (W3C ``traceparent`` and ``tracestate``), made here at a third of its cost;
    None: leave it to ``propagate.inject`` (another propagator, or baggage to carry)."""
    if not default_textmap() or baggage.get_all(context):
        return None
    if not span_context.is_valid:
        return {}
    headers = {
        "traceparent": (
            f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
            f"-{span_context.trace_flags:02x}"
        )
    }
    if span_context.trace_state:
        headers["tracestate"] = span_context.trace_state.to_header()
    return headers
