"""OpenTelemetry SDK set-up for the CLI (the library itself only uses the API).

`configure_otel` installs a `TracerProvider` and a `MeterProvider` exporting OTLP over HTTP
when ``--otlp-endpoint`` or the standard variables ask for it:

- ``--otlp-endpoint URL`` (a base URL like ``OTEL_EXPORTER_OTLP_ENDPOINT``:
  ``/v1/traces`` and ``/v1/metrics`` are appended), else ``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``;
- ``OTEL_SDK_DISABLED=true`` turns everything off; ``OTEL_SERVICE_NAME`` and
  ``OTEL_RESOURCE_ATTRIBUTES`` name the service; ``OTEL_TRACES_EXPORTER=none`` /
  ``OTEL_METRICS_EXPORTER=none`` turn one signal's export off; the SDK reads the rest
  (``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_METRIC_EXPORT_INTERVAL``, headers, ...).

`render_trace_tree` draws the spans of one trace as a `rich` tree (the demo prints the
trace of a denied call with it).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console
from rich.text import Text
from rich.tree import Tree

from hookbus.schemas import telemetry as tn

from ._extras import MissingExtraError
from ._trace_context import otlp_option

__all__ = [
    "OtelSetup",
    "configure_otel",
    "otel_session",
    "otlp_option",
    "print_denied_trace",
    "render_trace_tree",
]

log = logging.getLogger("hookbus.cli")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _exporter_on(name: str) -> bool:
    """``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: only ``none`` turns it off."""
    return os.environ.get(name, "").strip().lower() != "none"


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _signal_endpoint(base: str | None, signal: str) -> str | None:
    """The URL one signal is exported to, as the OTLP exporter resolves it."""
    if base:
        return f"{base}/v1/{signal}"
    specific = _env(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return specific
    general = _env("OTEL_EXPORTER_OTLP_ENDPOINT")
    return f"{general.rstrip('/')}/v1/{signal}" if general else None


class _Switch(SpanProcessor):
    """The one span processor the CLI installs per process; each `configure_otel` call
    plugs its own processors in and `OtelSetup.shutdown` takes them out again (the global
    tracer provider can be set only once per process)."""

    def __init__(self) -> None:
        self.processors: tuple[SpanProcessor, ...] = ()

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        for p in self.processors:
            p.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        for p in self.processors:
            p.on_end(span)

    def shutdown(self) -> None:
        for p in self.processors:
            p.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self.processors)


_switch: _Switch | None = None

_NO_SELF_METRICS = NoOpMeterProvider()
"""The SDK's own metrics (``otel.sdk.span.*``, exporter counters) cost a few microseconds
per span on the emit path; the CLI leaves them off and exports only hookbus's metrics."""


@dataclass
class OtelSetup:
    """What `configure_otel` installed. `shutdown` flushes and detaches it (idempotent)."""

    processors: list[SpanProcessor] = field(default_factory=list)
    meter_provider: MeterProvider | None = None
    memory: InMemorySpanExporter | None = None
    """Keeps every finished span of this process when ``keep_spans=True``."""
    traces_endpoint: str | None = None
    """Where spans are exported; None when only kept in memory or off."""
    metrics_endpoint: str | None = None

    @property
    def tracing(self) -> bool:
        return bool(self.processors)

    def finished_spans(self) -> list[ReadableSpan]:
        """Spans finished so far (only with ``keep_spans=True``; else empty)."""
        for p in self.processors:
            p.force_flush()
        return list(self.memory.get_finished_spans()) if self.memory is not None else []

    def shutdown(self) -> None:
        """Flush every exporter (spans and metrics) and detach them."""
        if _switch is not None and self.processors:
            _switch.processors = tuple(p for p in _switch.processors if p not in self.processors)
        for p in self.processors:
            with contextlib.suppress(Exception):
                p.shutdown()
        self.processors = []
        if self.meter_provider is not None:
            with contextlib.suppress(Exception):
                self.meter_provider.shutdown()
            self.meter_provider = None


def configure_otel(
    service_name: str,
    otlp_endpoint: str | None = None,
    *,
    keep_spans: bool = False,
    resource_attributes: dict[str, Any] | None = None,
) -> OtelSetup:
    """Install the OpenTelemetry SDK for a CLI command; see the module docstring.

    Args:
        service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` sets one.
        otlp_endpoint: OTLP/HTTP base URL (``http://host:4318``), overriding the variables.
        keep_spans: also keep finished spans in memory (`OtelSetup.finished_spans`), even
            with nothing to export.
        resource_attributes: extra resource attributes (over ``OTEL_RESOURCE_ATTRIBUTES``).
    Returns:
        The `OtelSetup` to `shutdown` at exit (a do-nothing one when OTel is off).
    Raises:
        MissingExtraError: export asked for and the OTLP exporter (the ``otel`` extra) is
            not installed.
    """
    global _switch
    setup = OtelSetup()
    if _truthy("OTEL_SDK_DISABLED"):
        return setup
    base = otlp_endpoint.rstrip("/") if otlp_endpoint else None
    export_traces = _exporter_on("OTEL_TRACES_EXPORTER") and bool(
        base or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    export_metrics = _exporter_on("OTEL_METRICS_EXPORTER") and bool(
        base or _env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not (export_traces or export_metrics or keep_spans):
        return setup
    attrs: dict[str, Any] = {"process.pid": os.getpid(), **(resource_attributes or {})}
    named = _env("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    if not named:
        attrs[SERVICE_NAME] = service_name
    resource = Resource.create(attrs)

    if export_traces:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise _needs_otel_extra(otlp_endpoint) from exc

        span_exporter = OTLPSpanExporter(
            endpoint=f"{base}/v1/traces" if base else None, meter_provider=_NO_SELF_METRICS
        )
        setup.traces_endpoint = _signal_endpoint(base, "traces")
        setup.processors.append(BatchSpanProcessor(span_exporter, meter_provider=_NO_SELF_METRICS))
    if keep_spans:
        setup.memory = InMemorySpanExporter()
        setup.processors.append(SimpleSpanProcessor(setup.memory))
    if setup.processors:
        if _switch is None:
            _switch = _Switch()
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider):  # the application set an SDK one already
                current.add_span_processor(_switch)
            else:
                provider = TracerProvider(resource=resource, meter_provider=_NO_SELF_METRICS)
                provider.add_span_processor(_switch)
                trace.set_tracer_provider(provider)
        _switch.processors = (*_switch.processors, *setup.processors)

    if export_metrics:
        if isinstance(metrics.get_meter_provider(), MeterProvider):
            log.info("a meter provider is already set in this process; metrics go there")
        else:
            try:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                    OTLPMetricExporter,
                )
            except ImportError as exc:
                raise _needs_otel_extra(otlp_endpoint) from exc

            metric_exporter = OTLPMetricExporter(
                endpoint=f"{base}/v1/metrics" if base else None, meter_provider=_NO_SELF_METRICS
            )
            setup.metrics_endpoint = _signal_endpoint(base, "metrics")
            setup.meter_provider = MeterProvider(
                resource=resource,
                metric_readers=[PeriodicExportingMetricReader(metric_exporter)],
            )
            metrics.set_meter_provider(setup.meter_provider)
    if setup.traces_endpoint or setup.metrics_endpoint:
        log.info(
            "OpenTelemetry: traces to %s, metrics to %s",
            setup.traces_endpoint or "-",
            setup.metrics_endpoint or "-",
        )
    return setup


def _needs_otel_extra(otlp_endpoint: str | None) -> MissingExtraError:
    what = "--otlp-endpoint" if otlp_endpoint else "OTLP export (OTEL_EXPORTER_OTLP_*)"
    return MissingExtraError(what, "otel", " (or OTEL_SDK_DISABLED=true)")


@contextlib.contextmanager
def otel_session(
    service_name: str,
    otlp_endpoint: str | None = None,
    *,
    keep_spans: bool = False,
    resource_attributes: dict[str, Any] | None = None,
) -> Iterator[OtelSetup]:
    """`configure_otel`, then `OtelSetup.shutdown` (flush) on the way out."""
    setup = configure_otel(
        service_name, otlp_endpoint, keep_spans=keep_spans, resource_attributes=resource_attributes
    )
    try:
        yield setup
    finally:
        setup.shutdown()


# -- the trace as a tree ----------------------------------------------------------------------
_ACTION_STYLE = {
    "deny": "bold red",
    "ask_user": "bold magenta",
    "inject_context": "cyan",
    "modify": "yellow",
    "continue": "green",
}


def _label(span: ReadableSpan) -> Text:
    attrs = span.attributes or {}
    text = Text(span.name, style="bold")
    text.append(f"  {span.kind.name.lower()}", style="dim")
    handler = attrs.get(tn.HANDLER)
    if handler and not span.name.endswith(f" {handler}"):
        text.append(f"  handler={handler}")
    action = attrs.get(tn.ACTION)
    if isinstance(action, str):
        text.append("  ")
        text.append(action, style=_ACTION_STYLE.get(action, ""))
    kind = attrs.get(tn.FAILURE_KIND) or attrs.get(tn.ERROR_TYPE)
    if kind:
        text.append(f"  failed: {kind}", style="red")
        if attrs.get(tn.FAILED_OPEN):
            text.append(" (failed open)", style="bold yellow")
    outcome = attrs.get(tn.SUSPENSION_OUTCOME)
    if outcome:
        text.append(f"  {outcome}", style="magenta")
    if span.end_time is not None and span.start_time is not None:
        text.append(f"  {(span.end_time - span.start_time) / 1e6:.2f} ms", style="dim")
    reason = attrs.get(tn.REASON)
    if isinstance(reason, str) and reason:
        short = reason if len(reason) <= 60 else reason[:59] + "…"
        text.append(f"  — {short}", style="italic")
    return text


def render_trace_tree(spans: Sequence[ReadableSpan]) -> Tree:
    """Draw the spans of one trace as a tree: name, kind, handler, action, failure, duration.

    Children are ordered by start time; spans whose parent is not among `spans` (the root,
    or children of spans another process has not exported) hang from the top.

    Raises:
        ValueError: `spans` is empty.
    """
    if not spans:
        raise ValueError("no spans to draw")
    by_id = {s.context.span_id: s for s in spans if s.context is not None}
    children: dict[int | None, list[ReadableSpan]] = {}
    for s in spans:
        parent = s.parent.span_id if s.parent is not None else None
        children.setdefault(parent if parent in by_id else None, []).append(s)
    for group in children.values():
        group.sort(key=lambda s: s.start_time or 0)
    roots = children.get(None, [])
    trace_id = spans[0].context.trace_id if spans[0].context is not None else 0
    if len(roots) == 1:
        tree = Tree(_label(roots[0]))
        todo = [(tree, roots[0])]
    else:
        tree = Tree(Text(f"trace {trace_id:032x}", style="bold"))
        todo = [(tree.add(_label(r)), r) for r in roots]
    while todo:
        node, span = todo.pop()
        for child in children.get(span.context.span_id if span.context else None, []):
            todo.append((node.add(_label(child)), child))
    return tree


def denied_trace(spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    """The spans of the trace of the first emit whose decision was deny ([] if none)."""
    denied = sorted(
        (s for s in spans if s.name.startswith(f"{tn.SPAN_EMIT} ")
         and (s.attributes or {}).get(tn.ACTION) == "deny"),
        key=lambda s: s.start_time or 0,
    )  # fmt: skip
    if not denied or denied[0].context is None:
        return []
    trace_id = denied[0].context.trace_id
    return [s for s in spans if s.context is not None and s.context.trace_id == trace_id]


def print_denied_trace(setup: OtelSetup, console: Console | None = None) -> bool:
    """Print the trace of the first denied emit kept by `setup` as a tree; False if none."""
    spans = denied_trace(setup.finished_spans())
    if not spans:
        return False
    console = console or Console()
    trace_id = spans[0].context.trace_id if spans[0].context is not None else 0
    console.print(f"\n[bold]trace of a denied call[/bold] [dim](trace id {trace_id:032x})[/dim]")
    console.print(render_trace_tree(spans))
    return True
