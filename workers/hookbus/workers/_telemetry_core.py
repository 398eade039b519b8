"""Which OpenTelemetry providers the application set, for the worker (the dispatcher has
its twin: the two never import each other).

`otel.sync()`: the global providers are decided at first use (a provider named by
``OTEL_PYTHON_TRACER_PROVIDER`` / ``OTEL_PYTHON_METER_PROVIDER`` is loaded then) and looked
at again only when the API's global provider slot changes: two identity tests per request,
no environment read.
"""

from __future__ import annotations

import logging
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, cast

from opentelemetry import metrics, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.metrics import _internal as _metrics_api

from hookbus.schemas import _telemetry_names as tn

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram

__all__ = ["otel"]

log = logging.getLogger("hookbus.workers.telemetry")

try:
    _VERSION = _metadata.version("hookbus")
except _metadata.PackageNotFoundError:  # pragma: no cover
    _VERSION = "0"

_SLOTS = hasattr(trace, "_TRACER_PROVIDER") and hasattr(_metrics_api, "_METER_PROVIDER")
"""Whether the API keeps its global providers in the module slots read below (every
release since 1.12); without them each request asks ``get_*_provider()``."""
_UNSET = object()
_PROXY_MP: type = getattr(_metrics_api, "_ProxyMeterProvider", NoOpMeterProvider)
"""The API's "no provider set yet" meter provider (private name, stable since 1.12)."""


class _Otel:
    """The tracer and histogram, bound to the current global providers."""

    __slots__ = (
        "env_loaded",
        "meter_slot",
        "metrics",
        "on",
        "process_duration",
        "tracer",
        "tracer_slot",
        "tracing",
    )

    def __init__(self) -> None:
        self.tracing = False
        self.metrics = False
        self.on = False
        self.env_loaded = False
        self.tracer_slot: object = _UNSET
        self.meter_slot: object = _UNSET
        self.tracer: trace.Tracer = trace.NoOpTracer()
        self.process_duration: Histogram

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
            self.tracer = tp.get_tracer(tn.SCOPE_WORKERS, _VERSION)
            self.tracing = not isinstance(tp, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
            self.tracer_slot = tracer_slot  # last: a reader that sees it sees the tracer
        if meter_slot is not self.meter_slot:
            mp = cast(metrics.MeterProvider, meter_slot)
            if meter_slot is None:
                mp = NoOpMeterProvider()
            self.process_duration = mp.get_meter(tn.SCOPE_WORKERS, _VERSION).create_histogram(
                tn.METRIC_PROCESS_DURATION,
                unit="s",
                description="Duration of one handling in a worker.",
                explicit_bucket_boundaries_advisory=tn.DURATION_BUCKETS_S,
            )
            self.metrics = not isinstance(mp, _PROXY_MP | NoOpMeterProvider)
            self.meter_slot = meter_slot
        self.on = self.tracing or self.metrics


otel = _Otel()
