"""The caller's trace, kept by every command that emits, without the OpenTelemetry SDK.

A program that runs ``hookbus emit`` or Claude Code's ``hookbus claude-code`` hook inside a
trace of its own passes it as the W3C ``TRACEPARENT`` (and ``TRACESTATE``) environment
variables, the convention of OpenTelemetry's environment carriers. `callers_trace` makes
that context current, so the emit's spans are its children and the request to the
dispatcher service carries it (``traceparent`` header, `hookbus.cli._service_emit`).
Only the OpenTelemetry API is imported here: the Claude Code hook's start-up stays lean,
and the SDK (`hookbus.cli._otel`) is loaded only when something is exported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import click
from opentelemetry import context as otel_context
from opentelemetry.propagate import extract

__all__ = ["callers_trace", "exports", "otlp_option"]

otlp_option = click.option(
    "--otlp-endpoint",
    default=None,
    metavar="URL",
    help="Export traces and metrics by OTLP/HTTP to this base URL (e.g. http://localhost:4318;"
    " /v1/traces and /v1/metrics are appended). Default: the OTEL_EXPORTER_OTLP_* variables;"
    " with neither, nothing is exported. OTEL_SDK_DISABLED=true turns it off.",
)

_ENDPOINT_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)


def exports(otlp_endpoint: str | None) -> bool:
    """Whether anything is to be exported: an ``--otlp-endpoint``, or an OTLP endpoint
    variable, and the SDK not disabled (``OTEL_SDK_DISABLED``)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    return bool(otlp_endpoint) or any(os.environ.get(v, "").strip() for v in _ENDPOINT_VARIABLES)


@contextlib.contextmanager
def callers_trace() -> Iterator[None]:
    """Within: the trace context of ``TRACEPARENT`` (and ``TRACESTATE``), if set."""
    carrier = {k: v for k, v in (("traceparent", os.environ.get("TRACEPARENT")),
                                 ("tracestate", os.environ.get("TRACESTATE"))) if v}  # fmt: skip
    if not carrier:
        yield
        return
    token = otel_context.attach(extract(carrier))
    try:
        yield
    finally:
        otel_context.detach(token)
