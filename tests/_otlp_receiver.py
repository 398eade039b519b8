"""An OTLP/HTTP receiver for tests: what a Collector's ``otlp`` receiver does, kept in memory.

A standard-library HTTP server on 127.0.0.1 (port 0) decodes the protobuf
``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest`` bodies (`opentelemetry-proto`)
posted to ``/v1/traces`` and ``/v1/metrics`` and keeps every span (with its events and links)
and every metric data point, so a test can check what several processes exported.

    with OtlpReceiver() as rx:
        ... run processes with --otlp-endpoint rx.url ...
        spans = rx.wait_for(lambda spans: len(spans) >= 5, timeout_s=20)
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

__all__ = ["OtlpReceiver", "ReceivedMetric", "ReceivedSpan"]


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span; ids are lower-case hex (trace 32, span 16 characters)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    """``INTERNAL`` | ``SERVER`` | ``CLIENT`` | ``PRODUCER`` | ``CONSUMER``."""
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]
    """(trace id, span id) of each link."""
    status: str
    """``UNSET`` | ``OK`` | ``ERROR``."""
    start_ns: int
    end_ns: int
    resource: dict[str, Any]

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True)
class ReceivedMetric:
    """One exported data point: a sum's value or a histogram's count."""

    name: str
    attributes: dict[str, Any]
    value: float
    resource: dict[str, Any]


@dataclass
class _Store:
    spans: list[ReceivedSpan] = field(default_factory=list)
    metrics: list[ReceivedMetric] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)


def _span_kind(kind: int) -> str:
    return trace_pb2.Span.SpanKind.Name(kind).removeprefix("SPAN_KIND_")


def _decode_traces(body: bytes) -> list[ReceivedSpan]:
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None,
                        name=s.name,
                        kind=_span_kind(s.kind),
                        attributes=_attrs(s.attributes),
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        status=trace_pb2.Status.StatusCode.Name(s.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        resource=resource,
                    )
                )
    return out


def _decode_metrics(body: bytes) -> list[ReceivedMetric]:
    req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
    out = []
    for rm in req.resource_metrics:
        resource = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                which = m.WhichOneof("data")
                if which is None:
                    continue
                for p in getattr(m, which).data_points:
                    if which in ("sum", "gauge"):
                        value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                    else:  # histogram, exponential_histogram
                        value = p.count
                    out.append(ReceivedMetric(m.name, _attrs(p.attributes), float(value), resource))
    return out


class _Handler(BaseHTTPRequestHandler):
    store: _Store  # set on the subclass made per receiver

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        encoding = (self.headers.get("Content-Encoding") or "").lower()
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        if self.path == "/v1/traces":
            spans = _decode_traces(body)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            with self.store.changed:
                self.store.spans.extend(spans)
                self.store.changed.notify_all()
        elif self.path == "/v1/metrics":
            points = _decode_metrics(body)
            reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
            with self.store.changed:
                self.store.metrics.extend(points)
                self.store.changed.notify_all()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


class OtlpReceiver:
    """An OTLP/HTTP endpoint on 127.0.0.1 for the duration of a ``with`` block."""

    def __init__(self) -> None:
        self._store = _Store()
        handler = type("Handler", (_Handler,), {"store": self._store})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The base URL (give it as ``--otlp-endpoint`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._store.changed:
            return list(self._store.spans)

    @property
    def metrics(self) -> list[ReceivedMetric]:
        with self._store.changed:
            return list(self._store.metrics)

    def wait_for(
        self, ready: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """Block until `ready(spans)` holds (checked at each export); return the spans.

        Raises:
            TimeoutError: not within `timeout_s` seconds (the message lists what came).
        """
        with self._store.changed:
            ok = self._store.changed.wait_for(lambda: ready(list(self._store.spans)), timeout_s)
            spans = list(self._store.spans)
        if not ok:
            got = sorted({f"{s.service}: {s.name}" for s in spans})
            raise TimeoutError(f"the expected spans did not arrive within {timeout_s}s; got {got}")
        return spans

    def wait_for_metrics(
        self, ready: Callable[[list[ReceivedMetric]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedMetric]:
        """Block until `ready(metrics)` holds (checked at each export); return the points.

        Raises:
            TimeoutError: not within `timeout_s` seconds.
        """
        with self._store.changed:
            ok = self._store.changed.wait_for(lambda: ready(list(self._store.metrics)), timeout_s)
            points = list(self._store.metrics)
        if not ok:
            got = sorted({f"{p.resource.get('service.name')}: {p.name}" for p in points})
            raise TimeoutError(
                f"the expected metrics did not arrive within {timeout_s}s; got {got}"
            )
        return points
