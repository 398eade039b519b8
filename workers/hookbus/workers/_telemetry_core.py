"""Which OpenTelemetry providers the application set, for the worker (the dispatcher
subclasses the same `ProviderSlots`: the two never import each other).

`otel.sync()`: the global providers are decided at first use (a provider named by
``OTEL_PYTHON_TRACER_PROVIDER`` / ``OTEL_PYTHON_METER_PROVIDER`` is loaded then) and looked
at again only when the API's global provider slot changes: two identity tests per request,
no environment read.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hookbus._core.otel_providers import ProviderSlots
from hookbus.schemas import telemetry as tn

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram, Meter

__all__ = ["otel"]

log = logging.getLogger("hookbus.workers.telemetry")


class _Otel(ProviderSlots):
    """The tracer and histogram of the workers' scope, bound to the current global
    providers."""

    __slots__ = ("process_duration",)

    def __init__(self) -> None:
        super().__init__(tn.SCOPE_WORKERS, log)
        self.process_duration: Histogram

    def _bind_meter(self, meter: Meter) -> None:
        self.process_duration = meter.create_histogram(
            tn.METRIC_PROCESS_DURATION,
            unit="s",
            description="Duration of one handling in a worker.",
            explicit_bucket_boundaries_advisory=tn.DURATION_BUCKETS_S,
        )


otel = _Otel()
