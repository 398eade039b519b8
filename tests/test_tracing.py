"""Tracing and metrics in one process: the SDK's in-memory exporter and metric reader.

A real nats-server; the worker and the dispatcher each have their own connection, so every
handler call crosses NATS with its ``traceparent`` header. Each test installs fresh global
providers (as an application would) and removes them afterwards (`_otel_harness`), so
other tests run with the API's defaults (tracing off).
"""

from __future__ import annotations

from typing import Any

import pytest
from _allowing import emitted_allowed
from _otel_harness import Otel, children, emit_requested, only, wire_headers
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, StatusCode

from hookbus.dispatcher import ApprovalsClient, DispatcherService, HookDispatcher
from hookbus.dispatcher._telemetry import suspension_span, trace_headers
from hookbus.schemas import (
    HookResult,
    emit_service_subject,
    handler_subject,
)
from hookbus.schemas import telemetry as tn
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


async def test_deny_is_one_trace_emit_calls_and_handlings(otel: Otel, nc, connect, event) -> None:
    w = HookWorker(nc)

    @w.handler(event, priority=1)
    async def redact(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "command": "ls ***"})

    @w.handler(event, priority=2, failure_policy="deny")
    async def security(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="no bash")

    @w.handler(event, priority=3)
    async def audit(ev: str, data: dict[str, Any]) -> None:
        raise AssertionError("never called after a deny")

    spy = await connect()
    headers = await wire_headers(spy, handler_subject(event, "security"))
    # one request per handler here (the wire check below reads the handler's own request);
    # the same handlers as one chain request: tests/test_chains.py
    async with w, HookDispatcher(await connect(), chains=False) as d:
        d.set_default_fields(agent_id="agent-7")
        result = await d.emit(event, {"tool_name": "bash", "session_id": "sess-1"})
        await spy.flush()
    assert result.action == "deny" and result.decided_by == "security"

    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    assert emit.parent is None and emit.kind is SpanKind.INTERNAL
    assert emit.attributes[tn.ACTION] == "deny"
    assert emit.attributes[tn.DECIDED_BY] == "security"
    assert emit.attributes[tn.REASON] == "no bash"
    assert emit.attributes[tn.FAILED_OPEN] is False
    assert emit.attributes[tn.GEN_AI_AGENT_ID] == "agent-7"
    assert emit.attributes[tn.GEN_AI_CONVERSATION_ID] == "sess-1"
    assert emit.attributes[tn.GEN_AI_TOOL_NAME] == "bash"

    sends = children(spans, emit)
    assert [s.attributes[tn.HANDLER] for s in sends] == ["redact", "security"]  # audit never ran
    for send, priority, action in zip(sends, (1, 2), ("modify", "deny"), strict=True):
        assert send.kind is SpanKind.PRODUCER
        assert send.name == f"send {event} {send.attributes[tn.HANDLER]}"  # short: semconv
        assert send.attributes[tn.MESSAGING_DESTINATION_NAME] == handler_subject(
            event, send.attributes[tn.HANDLER]
        )
        assert send.attributes[tn.MESSAGING_SYSTEM] == "nats"
        assert send.attributes[tn.MESSAGING_OPERATION_TYPE] == "send"
        assert send.attributes[tn.PRIORITY] == priority
        assert send.attributes[tn.ACTION] == action
        assert send.attributes[tn.FAILED_OPEN] is False
        (process,) = children(spans, send)
        assert process.kind is SpanKind.CONSUMER
        assert process.name == f"process {event} {send.attributes[tn.HANDLER]}"
        dest = tn.MESSAGING_DESTINATION_NAME
        assert process.attributes[dest] == send.attributes[dest]
        assert process.attributes[tn.MESSAGING_CONSUMER_GROUP_NAME] == send.attributes[tn.HANDLER]
        assert process.attributes[tn.ACTION] == action
        assert process.attributes[tn.GEN_AI_AGENT_ID] == "agent-7"
        assert [link.context.span_id for link in process.links] == [send.context.span_id]
        assert len(process.attributes[tn.MESSAGING_MESSAGE_ID]) == 32  # the emit's id
    assert sends[1].attributes[tn.REASON] == "no bash"
    # every call says what a failure of it would do, though none failed
    assert [s.attributes[tn.FAILURE_POLICY] for s in sends] == ["ignore", "deny"]
    assert all(tn.FAILURE_KIND not in s.attributes for s in sends)
    assert len(spans) == 5

    # the traceparent on the wire is the send span's context
    (sent,) = headers
    assert sent is not None
    ctx = trace.get_current_span(propagate.extract(sent)).get_span_context()
    assert (ctx.trace_id, ctx.span_id) == (emit.context.trace_id, sends[1].context.span_id)

    decisions = otel.points(tn.METRIC_DECISIONS)
    assert ({tn.EVENT: event, tn.ACTION: "deny"}, 1) in decisions
    durations = [a for a, _ in otel.points(tn.METRIC_HANDLER_DURATION) if a[tn.EVENT] == event]
    by_handler = {a[tn.HANDLER]: a[tn.ACTION] for a in durations}
    assert by_handler == {"redact": "modify", "security": "deny"}


async def test_modify_chain_spans_in_priority_order(otel: Otel, nc, connect, event) -> None:
    w = HookWorker(nc)

    @w.handler(event, priority=1)
    async def first(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"action": "modify", "data": {**data, "trail": [*data.get("trail", []), "first"]}}

    @w.handler(event, priority=3)
    def third(ev: str, data: dict[str, Any]) -> dict[str, Any]:  # a sync handler (a thread)
        return {"action": "modify", "data": {**data, "trail": [*data["trail"], "third"]}}

    async with w, HookDispatcher(await connect()) as d:

        @d.register(event, priority=2, name="local_second")
        async def second(ev: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="modify", data={**data, "trail": [*data["trail"], "second"]})

        result = await d.emit(event, {"tool_name": "edit"})
    assert result.action == "continue" and result.data["trail"] == ["first", "second", "third"]

    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    calls = children(spans, emit)
    assert [(s.name.split()[0], s.attributes[tn.HANDLER]) for s in calls] == [
        ("send", "first"),
        ("handler", "local_second"),
        ("send", "third"),
    ]
    assert [s.kind for s in calls] == [SpanKind.PRODUCER, SpanKind.INTERNAL, SpanKind.PRODUCER]
    assert all(s.attributes[tn.ACTION] == "modify" for s in calls)
    assert all(s.attributes[tn.FAILURE_POLICY] == "ignore" for s in calls)  # in process too
    assert calls[0].end_time <= calls[1].start_time and calls[1].end_time <= calls[2].start_time
    assert [len(children(spans, s)) for s in calls] == [1, 0, 1]  # a worker handling per remote
    assert (
        emit.attributes[tn.ACTION] == "continue"
    )  # the emit returns continue with the chained data
    assert emit.attributes.get(tn.DECIDED_BY) == result.decided_by


async def test_failure_under_ignore_fails_open_and_says_so(otel: Otel, nc, connect, event) -> None:
    w = HookWorker(nc)

    @w.handler(event, priority=1, failure_policy="ignore")
    async def flaky(ev: str, data: dict[str, Any]) -> None:
        raise RuntimeError("database down")

    @w.handler(event, priority=2)
    async def fine(ev: str, data: dict[str, Any]) -> None:
        return None

    # one request per handler: each call's own send span (a chain: tests/test_tracing_wire)
    async with w, HookDispatcher(await connect(), chains=False) as d:
        result = await d.emit(event, {"tool_name": "bash"})
    assert result.action == "continue" and [f.handler for f in result.failures] == ["flaky"]

    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    flaky_send = only(spans, f"send {event} flaky")
    assert flaky_send.status.status_code is StatusCode.ERROR
    assert "database down" in (flaky_send.status.description or "")
    assert flaky_send.attributes[tn.FAILURE_KIND] == "error"
    assert flaky_send.attributes[tn.FAILURE_POLICY] == "ignore"
    assert flaky_send.attributes[tn.FAILED_OPEN] is True
    (flaky_process,) = children(spans, flaky_send)
    assert flaky_process.status.status_code is StatusCode.ERROR
    assert flaky_process.attributes[tn.ERROR_TYPE] == "handler_error"
    fine_send = only(spans, f"send {event} fine")
    assert fine_send.attributes[tn.FAILED_OPEN] is False
    assert fine_send.attributes[tn.FAILURE_POLICY] == "ignore"  # what a failure would do
    assert fine_send.status.status_code is StatusCode.UNSET

    assert emit.attributes[tn.FAILED_OPEN] is True
    assert emit.attributes[tn.FAILED_OPEN_HANDLERS] == ("flaky",)
    (failure,) = [e for e in emit.events if e.name == tn.EVENT_HANDLER_FAILURE]
    assert failure.attributes[tn.HANDLER] == "flaky"
    assert failure.attributes[tn.FAILURE_KIND] == "error"
    assert failure.attributes[tn.FAILED_OPEN] is True

    key = {tn.EVENT: event, tn.HANDLER: "flaky", tn.FAILURE_KIND: "error"}
    assert ({**key, tn.FAILURE_POLICY: "ignore"}, 1) in otel.points(tn.METRIC_FAILURES)
    assert (key, 1) in otel.points(tn.METRIC_FAIL_OPENS)


async def test_failure_under_deny_fails_closed(otel: Otel, nc, connect, event) -> None:
    w = HookWorker(nc)

    @w.handler(event, priority=1, failure_policy="deny")
    async def guard(ev: str, data: dict[str, Any]) -> None:
        return None

    async with w:
        pass  # declared, then gone: its declaration outlives it (no responders)
    async with HookDispatcher(await connect()) as d:
        result = await d.emit(event, {"tool_name": "bash"})
    assert result.action == "deny" and result.decided_by == "guard"

    emit = otel.emit_span(event)
    (send,) = children(otel.spans(emit.context.trace_id), emit)
    assert send.attributes[tn.FAILURE_KIND] == "no_responders"
    assert send.attributes[tn.FAILURE_POLICY] == "deny"
    assert send.attributes[tn.FAILED_OPEN] is False
    assert send.status.status_code is StatusCode.ERROR
    assert emit.attributes[tn.ACTION] == "deny"
    assert emit.attributes[tn.FAILED_OPEN] is False
    (failure,) = [e for e in emit.events if e.name == tn.EVENT_HANDLER_FAILURE]
    assert failure.attributes[tn.FAILURE_POLICY] == "deny"
    assert failure.attributes[tn.FAILED_OPEN] is False

    key = {tn.EVENT: event, tn.HANDLER: "guard", tn.FAILURE_KIND: "no_responders"}
    assert ({**key, tn.FAILURE_POLICY: "deny"}, 1) in otel.points(tn.METRIC_FAILURES)
    assert not [p for p in otel.points(tn.METRIC_FAIL_OPENS) if p[0].get(tn.EVENT) == event]
    assert [v for a, v in otel.points(tn.METRIC_EMIT_DURATION) if a[tn.EVENT] == event] == [1]


async def test_service_mode_continues_the_agents_trace(otel: Otel, nc, connect, event) -> None:
    w = HookWorker(nc)

    @w.handler(event)
    async def security(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="not in prod")

    agent = await connect()
    service_nc = await connect()
    service = DispatcherService(HookDispatcher(service_nc), service_nc)
    async with w:
        await service.start()
        try:
            tracer = trace.get_tracer("test-agent")
            subject = emit_service_subject(event, "a1")
            with tracer.start_as_current_span(f"send emit {event}", kind=SpanKind.PRODUCER) as span:
                headers: dict[str, str] = {}
                propagate.inject(headers)
                reply = await emit_requested(agent, subject, {"tool_name": "kubectl"}, headers)
        finally:
            await service.stop()
    assert reply.result is not None and reply.result.action == "deny"

    trace_id = span.get_span_context().trace_id
    spans = otel.spans(trace_id)
    agent_span = only(spans, f"send emit {event}")
    (dispatch,) = children(spans, agent_span)
    # low-cardinality: one name per event, not per agent; the subject and agent attributes
    assert dispatch.name == f"process emit {event}" and dispatch.kind is SpanKind.CONSUMER
    assert dispatch.attributes[tn.MESSAGING_DESTINATION_NAME] == subject
    assert dispatch.attributes[tn.GEN_AI_AGENT_ID] == "a1"
    assert [ln.context.span_id for ln in dispatch.links] == [agent_span.context.span_id]
    assert dispatch.attributes[tn.MESSAGING_CONSUMER_GROUP_NAME] == "hookbus-dispatcher"
    assert dispatch.attributes[tn.EVENT] == event
    assert dispatch.attributes[tn.ACTION] == "deny"
    (emit,) = children(spans, dispatch)
    assert emit.name == f"emit {event}" and emit.attributes[tn.GEN_AI_AGENT_ID] == "a1"
    (send,) = children(spans, emit)
    (process,) = children(spans, send)
    assert process.attributes[tn.ACTION] == "deny" and process.kind is SpanKind.CONSUMER
    assert len(spans) == 5  # one trace: agent, dispatcher service, emit, call, handling


async def test_emit_and_collect_is_traced_to_the_workers(otel: Otel, nc, connect, event) -> None:
    w = HookWorker(nc)

    @w.handler(event, priority=1)
    async def one(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"data": {"from": "one"}}

    @w.handler(event, priority=2)
    async def two(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"data": {"from": "two"}}

    async with w, HookDispatcher(await connect()) as d:
        responses = await d.emit_and_collect(event, {"q": 1}, timeout=5)
    assert responses == [{"from": "one"}, {"from": "two"}]
    (collect,) = [s for s in otel.spans() if s.name == f"emit_and_collect {event}"]
    assert collect.attributes[tn.RESPONSE_COUNT] == 2
    spans = otel.spans(collect.context.trace_id)
    (send,) = children(spans, collect)  # the one message (tests/test_tracing_wire.py)
    handlings = children(spans, send)
    assert sorted(s.attributes[tn.HANDLER] for s in handlings) == ["one", "two"]
    assert all(s.kind is SpanKind.CONSUMER for s in handlings)


async def test_tracing_off_sends_no_headers_then_a_provider_set_later_is_used(
    no_otel: None, nc, connect, event
) -> None:
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    w = HookWorker(nc)

    @w.handler(event)
    async def h(ev: str, data: dict[str, Any]) -> None:
        return None

    spy = await connect()
    headers = await wire_headers(spy, handler_subject(event, "h"))
    async with w, HookDispatcher(await connect()) as d:
        await d.emit(event, {})
        assert trace_headers() is None
        # the application sets its providers after hookbus was imported and used
        later = Otel()
        later.install()
        try:
            await d.emit(event, {})
            await spy.flush()
        finally:
            later.tracer_provider.shutdown()
    assert headers[0] is None
    assert headers[1] is not None and "traceparent" in headers[1]
    assert [s.name for s in later.spans()].count(f"emit {event}") == 1
    assert ({tn.EVENT: event, tn.ACTION: "continue"}, 1) in later.points(tn.METRIC_DECISIONS)


async def test_suspension_span_events_and_pending_gauge(otel: Otel) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("emit test:approval") as parent:
        attrs = {tn.HANDLER: "h", tn.GEN_AI_TOOL_NAME: None}  # None: dropped
        with suspension_span("approval:s1:h:abc", kind="approval", attributes=attrs) as wait:
            wait.event("pending", prompt="Allow rm?")
            pending = otel.points(tn.METRIC_SUSPENSIONS_PENDING)
            wait.event("resolved", choice="Allow")
        with pytest.raises(ValueError, match="not a suspension event"):
            with suspension_span("x") as bad:
                bad.event("maybe")
        with suspension_span("approval:s1:h:def", kind="approval") as timed:
            timed.event("pending")
            timed.event("timed_out", default="deny")
    assert pending == [({tn.SUSPENSION_KIND: "approval"}, 1)]
    assert otel.points(tn.METRIC_SUSPENSIONS_PENDING) == [({tn.SUSPENSION_KIND: "approval"}, 0)]
    waits = [s for s in otel.spans() if s.name == "await approval"]
    assert [s.parent.span_id for s in waits] == [parent.get_span_context().span_id] * 2
    first, second = waits
    assert [e.name for e in first.events] == ["pending", "resolved"]
    assert first.events[0].attributes == {"hookbus.suspension.prompt": "Allow rm?"}
    assert first.events[1].attributes == {"hookbus.suspension.choice": "Allow"}
    assert first.attributes[tn.SUSPENSION_LABEL] == "approval:s1:h:abc"
    assert first.attributes[tn.SUSPENSION_OUTCOME] == "resolved"
    assert first.attributes[tn.HANDLER] == "h" and tn.GEN_AI_TOOL_NAME not in first.attributes
    assert second.attributes[tn.SUSPENSION_OUTCOME] == "timed_out"


async def test_approval_wait_is_a_span_under_the_emit(otel: Otel, nc, connect, event) -> None:
    """ask_user -> an approval suspension: its wait is an ``await approval`` span, child of
    the emit span, with ``pending`` then ``resolved`` events (needs the dispatcher's
    approvals to call `suspension_span`)."""
    w = HookWorker(nc)

    @w.handler(event)
    async def ask(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_prompt="Run rm?", approval_timeout=30)

    async with w, HookDispatcher(await connect()) as d:
        stream = await d.hook_events()
        emit = d.emit(event, {"tool_name": "rm", "session_id": f"s-{event}"})
        result = await emitted_allowed(emit, event, stream, ApprovalsClient.over(d.approvals))
    assert result.action == "continue"

    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    (wait,) = [s for s in children(spans, emit) if s.name == "await approval"]
    assert [e.name for e in wait.events] == ["pending", "resolved"]
    assert wait.attributes[tn.SUSPENSION_KIND] == "approval"
    assert wait.attributes[tn.SUSPENSION_OUTCOME] == "resolved"
    assert emit.attributes[tn.ACTION] == "continue"
    assert otel.points(tn.METRIC_SUSPENSIONS_PENDING) == [({tn.SUSPENSION_KIND: "approval"}, 0)]


def test_service_span_names_leave_the_agent_out() -> None:
    """Every agent's requests for one event share one span name (the messaging conventions'
    low-cardinality destination), emit and emit_and_collect apart."""
    from hookbus.dispatcher._telemetry import service_span_name
    from hookbus.schemas import collect_service_subject

    names = {service_span_name(emit_service_subject("tool:pre", a)) for a in ("a1", "b.2", None)}
    assert names == {"process emit tool:pre"}
    assert service_span_name(collect_service_subject("tool:pre", "a1")) == (
        "process emit_and_collect tool:pre"
    )
    assert service_span_name("hookbus.v1.emit.a1.=ZZ") == "process emit ?"  # not decodable
    assert service_span_name("elsewhere") == "process ? ?"
