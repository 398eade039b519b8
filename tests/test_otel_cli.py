"""The CLI's OpenTelemetry set-up: ``--otlp-endpoint`` and the OTEL_* variables, exporting
OTLP/HTTP to a receiver this test runs; and the trace tree the demo prints."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _otlp_receiver import OtlpReceiver
from opentelemetry import trace
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.util._once import Once
from rich.console import Console

from hookbus.cli import _otel
from hookbus.cli._otel import configure_otel, otel_session, print_denied_trace, render_trace_tree
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult
from hookbus.schemas import telemetry as tn

pytestmark = pytest.mark.anyio


def _reset_globals() -> None:
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    metrics_internal._METER_PROVIDER_SET_ONCE = Once()
    metrics_internal._METER_PROVIDER = None
    _otel._switch = None


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (
        "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
    ):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    _reset_globals()
    yield
    _reset_globals()


def dispatcher_with_deny() -> HookDispatcher:
    d = HookDispatcher()

    @d.register("tool:pre", priority=1, name="redact")
    async def redact(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "x": 1})

    @d.register("tool:pre", priority=2, name="security")
    async def security(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="no bash")

    return d


def test_nothing_is_installed_without_an_endpoint() -> None:
    setup = configure_otel("hookbus-test")
    assert not setup.tracing and setup.meter_provider is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    setup.shutdown()


def test_otel_sdk_disabled_wins_over_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    setup = configure_otel("hookbus-test", "http://127.0.0.1:9", keep_spans=True)
    assert not setup.tracing and setup.meter_provider is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_exports_spans_and_metrics_over_otlp_http(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with OtlpReceiver() as rx:
        if how == "env":
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url)
            monkeypatch.setenv("OTEL_SERVICE_NAME", "agent-from-env")
        with otel_session("hookbus-test", rx.url if how == "flag" else None) as setup:
            assert setup.traces_endpoint == f"{rx.url}/v1/traces"
            assert setup.metrics_endpoint == f"{rx.url}/v1/metrics"
            result = await dispatcher_with_deny().emit("tool:pre", {"tool_name": "bash"})
        assert result.action == "deny"
        # shutdown flushed both signals: no waiting needed beyond it
        spans = rx.spans
        points = rx.metrics
    service = "hookbus-test" if how == "flag" else "agent-from-env"
    assert sorted(s.name for s in spans) == ["emit tool:pre", "handler redact", "handler security"]
    assert {s.service for s in spans} == {service}
    (emit,) = [s for s in spans if s.name == "emit tool:pre"]
    assert emit.attributes[tn.ACTION] == "deny"
    assert {s.parent_span_id for s in spans if s is not emit} == {emit.span_id}
    decisions = [p for p in points if p.name == tn.METRIC_DECISIONS]
    assert [(p.attributes, p.value) for p in decisions] == [
        ({tn.EVENT: "tool:pre", tn.ACTION: "deny"}, 1.0)
    ]
    assert {p.resource.get("service.name") for p in points} == {service}


async def test_traces_exporter_none_keeps_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    with OtlpReceiver() as rx:
        with otel_session("hookbus-test", rx.url) as setup:
            assert not setup.tracing and setup.meter_provider is not None
            await dispatcher_with_deny().emit("tool:pre", {"tool_name": "bash"})
        assert rx.spans == []
        assert any(p.name == tn.METRIC_EMIT_DURATION for p in rx.metrics)


async def test_the_denied_call_is_drawn_as_a_tree() -> None:
    with otel_session("hookbus-demo", keep_spans=True) as setup:
        d = dispatcher_with_deny()
        await d.emit("tool:pre", {"tool_name": "ls"})  # denied too, but first: it is this one
        await d.emit("session:start", {})
        console = Console(record=True, width=200, color_system=None)
        assert print_denied_trace(setup, console)
        spans = setup.finished_spans()
    text = console.export_text()
    lines = text.splitlines()
    assert "trace of a denied call" in lines[1]
    assert lines[2].startswith("emit tool:pre  internal  deny")
    assert "handler redact  internal  modify" in lines[3]
    assert "handler security  internal  deny" in lines[4] and "no bash" in lines[4]
    assert lines[3].lstrip().startswith("├──") and lines[4].lstrip().startswith("└──")
    assert all(" ms" in line for line in lines[2:5])
    with pytest.raises(ValueError, match="no spans"):
        render_trace_tree([])
    # spans of another process missing: the orphans hang from the trace's root node
    tree = render_trace_tree([s for s in spans if not s.name.startswith("emit ")][:2])
    assert "trace " in str(tree.label)


async def test_no_denied_call_prints_nothing() -> None:
    with otel_session("hookbus-demo", keep_spans=True) as setup:
        await HookDispatcher().emit("tool:pre", {})
        console = Console(record=True)
        assert not print_denied_trace(setup, console)
    assert console.export_text() == ""
