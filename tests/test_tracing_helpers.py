"""The tracing helpers for handlers answered outside the per-call wrappers (several
handlers run by one request): they make the spans and points the wrappers make.

- `record_call_span` (dispatcher): a finished call's span, the same name, kind, attributes
  and status as `traced_call`'s for the same route and outcome, at the given times, a
  child of the current span; the same ``hookbus.handler.duration`` point;
- `start_call_span` (dispatcher): the same span started before the request, whose
  ``headers`` make the worker's handling its child;
- `handling_span` (worker): the same ``process`` span as `traced_handling`'s for the same
  handler, envelope and caller context (from an `EventEnvelope` or its bytes);
- with tracing and metrics off, each is one shared object that does nothing.

A real nats-server; each test installs fresh global providers and removes them after.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _otel_harness import Otel, children, only
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from hookbus.dispatcher import HookDispatcher
from hookbus.dispatcher._outcomes import Failed
from hookbus.dispatcher._telemetry import record_call_span, start_call_span, trace_headers
from hookbus.schemas import EventEnvelope, HookReply, HookResult, decode, encode
from hookbus.schemas import telemetry as tn
from hookbus.workers import HookWorker
from hookbus.workers._telemetry import handling_span

pytestmark = pytest.mark.anyio


def shape(
    span: ReadableSpan, *without: str
) -> tuple[str, SpanKind, dict[str, Any], StatusCode, str | None]:
    """Name, kind, attributes (but `without`), status code and description."""
    return (
        span.name,
        span.kind,
        {k: v for k, v in (span.attributes or {}).items() if k not in without},
        span.status.status_code,
        span.status.description,
    )


async def test_record_call_span_is_the_span_traced_call_makes(otel: Otel, nc, connect, event):
    w = HookWorker(nc)

    @w.handler(event, priority=3, failure_policy="deny")
    async def security(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="no bash")

    async with w, HookDispatcher(await connect()) as d:
        await d.emit(event, {"tool_name": "bash"})
        (route,) = d.routes(event)
    traced = only(otel.spans(), f"send {event} security")

    tracer = trace.get_tracer("test")
    t0 = time.time_ns()
    with tracer.start_as_current_span(f"emit {event} again") as parent:
        record_call_span(route, HookResult(action="deny", reason="no bash"), t0, t0 + 2_000_000)
        record_call_span(route, Failed("timeout", "ran past 1s"), t0, t0 + 1_000_000_000)
    recorded = children(otel.spans(), otel.spans()[-1])  # the parent started last
    assert otel.spans()[-1].context.span_id == parent.get_span_context().span_id
    deny, timeout = sorted(recorded, key=lambda s: s.end_time or 0)
    # what went over the wire (requests sent, the instance that answered) only the call knows
    assert shape(deny) == shape(traced, tn.REQUESTS, tn.WORKER_INSTANCE)
    assert (deny.start_time, deny.end_time) == (t0, t0 + 2_000_000)
    assert timeout.name == traced.name and timeout.kind is SpanKind.PRODUCER
    assert timeout.status.status_code is StatusCode.ERROR
    assert timeout.status.description == "ran past 1s"
    assert {k: timeout.attributes[k] for k in (tn.FAILURE_KIND, tn.FAILURE_POLICY,
            tn.ERROR_TYPE, tn.FAILED_OPEN, tn.HANDLER, tn.PRIORITY)} == {
        tn.FAILURE_KIND: "timeout", tn.FAILURE_POLICY: "deny", tn.ERROR_TYPE: "timeout",
        tn.FAILED_OPEN: False, tn.HANDLER: "security", tn.PRIORITY: 3,
    }  # fmt: skip

    durations = {
        tuple(sorted(a.items())): n
        for a, n in otel.points(tn.METRIC_HANDLER_DURATION)
        if a.get(tn.EVENT) == event
    }
    key = {tn.EVENT: event, tn.HANDLER: "security"}
    assert durations == {
        tuple(sorted({**key, tn.ACTION: "deny"}.items())): 2,  # traced + recorded
        tuple(sorted({**key, tn.ERROR_TYPE: "timeout"}.items())): 1,
    }


async def test_start_call_span_makes_the_workers_handling_its_child(otel: Otel, nc, connect, event):
    w = HookWorker(nc)

    @w.handler(event)
    async def audit(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="continue")

    agent = await connect()
    tracer = trace.get_tracer("test")
    async with w, HookDispatcher(agent) as d:
        (route,) = d.routes(event)
        with tracer.start_as_current_span(f"emit {event}"):
            call = start_call_span(route)
            assert call.headers is not None and call.headers != trace_headers()
            envelope = EventEnvelope(
                id="e" * 32, event=event, data={"tool_name": "ls"}, agent_id="a-1"
            )
            msg = await agent.request(route.subject, encode(envelope), 5, headers=call.headers)
            reply = decode(msg.data, HookReply)
            call.end(reply.result)
            call.end(reply.result)  # ends once
            never_ran = start_call_span(route)  # a call never ended: no span at all
            assert never_ran.headers is not None and never_ran.headers != call.headers
    spans = otel.spans()
    emit = only(spans, f"emit {event}")
    (send,) = children(spans, emit)
    (process,) = children(spans, send)
    assert send.name == f"send {event} audit" and send.kind is SpanKind.PRODUCER
    assert send.attributes[tn.MESSAGING_DESTINATION_NAME] == route.subject
    assert send.attributes[tn.ACTION] == "continue" and send.attributes[tn.FAILED_OPEN] is False
    assert process.name == f"process {event} audit" and process.kind is SpanKind.CONSUMER
    assert process.attributes[tn.MESSAGING_DESTINATION_NAME] == route.subject
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert process.attributes[tn.MESSAGING_MESSAGE_ID] == "e" * 32
    assert process.attributes[tn.GEN_AI_AGENT_ID] == "a-1"
    assert process.attributes[tn.GEN_AI_TOOL_NAME] == "ls"
    assert len([s for s in spans if s.name == send.name]) == 1


async def test_handling_span_is_the_span_traced_handling_makes(otel: Otel, nc, connect, event):
    w = HookWorker(nc)

    async def guard(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="no bash")

    spec = w.add_handler(event, guard, name="guard")
    decl = spec.declaration
    envelope = EventEnvelope(
        id="f" * 32, event=event, data={"tool_name": "bash"}, agent_id="a-1", session_id="s-1"
    )
    tracer = trace.get_tracer("test")
    agent = await connect()
    async with w:
        with tracer.start_as_current_span("send (a request of its own)") as real_parent:
            headers: dict[str, str] = {}
            propagate.inject(headers)
            await agent.request(decl.subject, encode(envelope), 5, headers=headers)
        with tracer.start_as_current_span("send (one of several handlers)") as parent:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
        answer = HookReply(handler="guard", result=HookResult(action="deny", reason="no bash"))
        for given in (envelope, encode(envelope)):  # decoded or as it came
            with handling_span(decl, given, carrier) as handling:
                current = trace.get_current_span()  # the handler's own spans are its children
                assert current.get_span_context().trace_id == parent.get_span_context().trace_id
                current.set_attribute("policy.rule", "no-bash")  # what a handler may add
                handling.reply(answer)
        with pytest.raises(RuntimeError), handling_span(decl, envelope, carrier):
            raise RuntimeError("crashed")
    spans = otel.spans()
    real = only(spans, "send (a request of its own)")
    (handled,) = children(spans, real)
    helper = only(spans, "send (one of several handlers)")
    made = children(spans, helper)
    assert len(made) == 3
    assert [s.attributes["policy.rule"] for s in made[:2]] == ["no-bash"] * 2
    assert shape(made[0], "policy.rule") == shape(made[1], "policy.rule") == shape(handled)
    assert handled.attributes[tn.MESSAGING_MESSAGE_ID] == "f" * 32
    assert handled.attributes[tn.GEN_AI_CONVERSATION_ID] == "s-1"
    assert [link.context.span_id for link in made[0].links] == [helper.context.span_id]
    crashed = made[2]
    assert crashed.status.status_code is StatusCode.ERROR
    assert crashed.attributes[tn.ERROR_TYPE] == "RuntimeError"
    assert real_parent.get_span_context().span_id == real.context.span_id

    durations = [
        (a.get(tn.ACTION), a.get(tn.ERROR_TYPE), n)
        for a, n in otel.points(tn.METRIC_PROCESS_DURATION)
        if a.get(tn.HANDLER) == "guard"
    ]
    assert sorted(durations, key=str) == sorted(
        [("deny", None, 3), (None, "RuntimeError", 1)], key=str
    )


async def test_the_helpers_do_nothing_with_tracing_off(no_otel: None, event) -> None:
    d = HookDispatcher()

    async def h(ev: str, data: dict[str, Any]) -> None:
        return None

    d.register(event, h, name="h")
    (route,) = d.routes(event)
    decl = HookWorker().add_handler(event, h, name="h").declaration
    await d.emit(event, {})  # the providers as of now: none

    call = start_call_span(route)
    assert call is start_call_span(route) and call.headers is None  # one shared no-op
    call.end(HookResult(action="continue"))
    assert record_call_span(route, HookResult(action="continue"), 0, 1) is None
    handling = handling_span(
        decl, b"{}", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    )
    assert handling is handling_span(decl, b"{}", None)
    with handling as h_:
        h_.reply(None)
        assert not trace.get_current_span().get_span_context().is_valid
    assert trace_headers() is None
