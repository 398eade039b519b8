"""What the in-process tracing tests share: global providers installed and removed as an
application would (the SDK's in-memory exporter and metric reader), a wire spy, and an emit
request sent to the dispatcher service with the caller's trace headers.

Each test installs fresh global providers and removes them afterwards, so other tests run
with the API's defaults (tracing off).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import metrics, trace
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.util._once import Once

from hookbus.schemas import EmitReply, EmitRequest, decode, encode

__all__ = [
    "Otel",
    "RecordingSampler",
    "children",
    "emit_requested",
    "only",
    "reset_globals",
    "wire_headers",
]


def reset_globals() -> None:
    """Forget the global providers (what opentelemetry-test-utils' reset_*_globals do)."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    metrics_internal._METER_PROVIDER_SET_ONCE = Once()
    metrics_internal._METER_PROVIDER = None


class Otel:
    """The providers a test installed, and what they recorded."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(sampler=sampler)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def install(self) -> None:
        trace.set_tracer_provider(self.tracer_provider)
        metrics.set_meter_provider(self.meter_provider)

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()

    def spans(self, trace_id: int | None = None) -> list[ReadableSpan]:
        spans = list(self.exporter.get_finished_spans())
        if trace_id is not None:
            spans = [s for s in spans if s.context.trace_id == trace_id]
        return sorted(spans, key=lambda s: s.start_time or 0)

    def emit_span(self, event: str) -> ReadableSpan:
        found = [s for s in self.spans() if s.name == f"emit {event}"]
        assert len(found) == 1, [s.name for s in self.spans()]
        return found[0]

    def points(self, name: str) -> list[tuple[dict[str, Any], float]]:
        """(attributes, value) of each data point of instrument `name` (histogram: count)."""
        data = self.reader.get_metrics_data()
        out = []
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        for p in m.data.data_points:
                            value = p.value if hasattr(p, "value") else p.count
                            out.append((dict(p.attributes), value))
        return out


class RecordingSampler(Sampler):
    """The SDK's `inner` sampler, remembering every span it was asked about: (name, the
    attributes it was given, whether it sampled)."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.asked: list[tuple[str, dict[str, Any], bool]] = []

    def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                      attributes: Any = None, links: Sequence[Any] | None = None,
                      trace_state: Any = None) -> SamplingResult:  # fmt: skip
        result = self.inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )
        sampled = result.decision is Decision.RECORD_AND_SAMPLE
        self.asked.append((name, dict(attributes or {}), sampled))
        return result

    def get_description(self) -> str:
        return f"Recording({self.inner.get_description()})"


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def only(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


async def wire_headers(nc: Any, subject: str) -> list[dict[str, str] | None]:
    """Record the headers of every message on `subject` as NATS delivers them (a plain
    subscriber beside the worker's queue group: it sees each request and never answers)."""
    seen: list[dict[str, str] | None] = []

    async def cb(msg: Msg) -> None:
        seen.append(msg.headers)

    await nc.subscribe(subject, cb=cb)
    await nc.flush()
    return seen


async def emit_requested(
    nc: Any, subject: str, data: dict[str, Any], headers: dict[str, str], agent_id: str = "a1"
) -> EmitReply:
    """The dispatcher service's reply (within 5 s) to an `EmitRequest` of `data`, as agent
    `agent_id`, sent on `nc` to `subject` with `headers` (a caller's ``traceparent``)."""
    body = encode(EmitRequest(data=data, agent_id=agent_id))
    msg = await nc.request(subject, body, timeout=5, headers=headers)
    return decode(msg.data, EmitReply)
