"""Traces tell what went over the wire: one ``send`` span per message actually sent.

A real nats-server; the worker and the dispatcher each have their own connection. The
SDK's in-memory exporter (`_otel_harness`). Checks, against the messages a spy sees:

- a chain of 3 is ONE message to the chain subject: one ``send <event> <h1>,<h2>,<h3>``
  span naming the chain subject, the handlers it asked, their failure policies and the
  outcomes it gave, and the worker's one ``process <event> <h1>,<h2>,<h3>`` span (its steps
  in array attributes) is its child (not three ``send`` spans naming handler subjects that
  carried nothing); a longer chain's names list the first handlers and how many more;
- the parallel group's sends each carry their worker's handling as a child;
- ``emit_and_collect``'s one message has a ``send`` span, the workers' handlings are its
  children, and it counts requests sent and answers received apart;
- span names are short (``{operation} {event} {handler}``), the whole subject stays in
  ``messaging.destination.name``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _otel_harness import Otel, children, only, reset_globals, wire_headers
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult, collect_subject, handler_subject
from hookbus.schemas import telemetry as tn
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

CHAIN_HANDLERS = "hookbus.chain.handlers"
CHAIN_OUTCOMES = "hookbus.chain.outcomes"
W_HANDLERS = "hookbus.chain.handlers"
W_OUTCOMES = "hookbus.chain.outcomes"
W_REASONS = "hookbus.chain.reasons"
W_DURATIONS = "hookbus.chain.durations_s"
COLLECT_ASKED = "hookbus.collect.asked"
COLLECT_ANSWERED = "hookbus.collect.answered"


def _context_of(headers: dict[str, str] | None) -> tuple[int, int]:
    assert headers is not None
    ctx = trace.get_current_span(propagate.extract(headers)).get_span_context()
    return ctx.trace_id, ctx.span_id


def _chain_worker(nc: Any, event: str) -> HookWorker:
    w = HookWorker(nc)

    @w.handler(event, priority=1)
    async def first(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "trail": ["first"]})

    @w.handler(event, priority=2, failure_policy="deny")
    async def second(ev: str, data: dict[str, Any]) -> None:
        return None

    @w.handler(event, priority=3)
    async def third(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="third says no")

    return w


async def test_a_chain_is_one_send_span_and_its_steps_are_its_children(
    otel: Otel, nc, connect, event
) -> None:
    w = _chain_worker(nc, event)
    spy = await connect()
    event_token = collect_subject(event).rsplit(".", 1)[1]
    on_wire = await wire_headers(spy, f"hookbus.v1.chain.{event_token}.*")
    per_handler = [await wire_headers(spy, handler_subject(event, h)) for h in ("first", "second")]
    async with w, HookDispatcher(await connect()) as d:
        result = await d.emit(event, {"tool_name": "bash"})
        await spy.flush()
    assert result.action == "deny" and result.decided_by == "third"
    assert len(on_wire) == 1 and per_handler == [[], []]  # one message, on the chain subject

    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    (send,) = children(spans, emit)
    # the handlers that ran are in the name, as a single call's is
    assert send.name == f"send {event} first,second,third" and send.kind is SpanKind.PRODUCER
    chain_subject = send.attributes[tn.MESSAGING_DESTINATION_NAME]
    assert chain_subject.startswith("hookbus.v1.chain.")
    assert send.attributes[tn.MESSAGING_OPERATION_TYPE] == "send"
    assert list(send.attributes[CHAIN_HANDLERS]) == ["first", "second", "third"]
    assert list(send.attributes[CHAIN_OUTCOMES]) == ["modify", "continue", "deny"]
    policies = send.attributes[tn.CHAIN_FAILURE_POLICIES]
    assert list(policies) == ["ignore", "deny", "ignore"]  # what a failure of each would do
    assert _context_of(on_wire[0]) == (emit.context.trace_id, send.context.span_id)

    # the worker: one CONSUMER span for the one message, its steps in array attributes
    (process,) = children(spans, send)
    assert process.name == f"process {event} first,second,third"
    assert process.kind is SpanKind.CONSUMER
    assert process.attributes[tn.MESSAGING_DESTINATION_NAME] == chain_subject  # what came
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert list(process.attributes[W_HANDLERS]) == ["first", "second", "third"]
    assert list(process.attributes[W_OUTCOMES]) == ["modify", "continue", "deny"]
    assert list(process.attributes[W_REASONS]) == ["", "", "third says no"]
    assert len(process.attributes[W_DURATIONS]) == 3
    assert process.attributes[tn.GEN_AI_TOOL_NAME] == "bash"
    assert len(spans) == 3  # emit, one send, one handling
    assert not [s for s in spans if handler_subject(event, "first") in s.name]
    assert not [s for s in spans if "=3A" in s.name]

    durations = [a for a, _ in otel.points(tn.METRIC_HANDLER_DURATION) if a[tn.EVENT] == event]
    assert sorted(a[tn.HANDLER] for a in durations) == ["first", "second", "third"]


async def test_a_long_chains_span_names_are_bounded(otel: Otel, nc, connect, event) -> None:
    names = [f"step{i}" for i in range(6)]
    w = HookWorker(nc)
    for priority, name in enumerate(names):

        async def step(ev: str, data: dict[str, Any]) -> None:
            return None

        w.handler(event, priority=priority, name=name)(step)
    async with w, HookDispatcher(await connect()) as d:
        await d.emit(event, {})
    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    (send,) = children(spans, emit)
    assert send.name == f"send {event} step0,step1,step2 +3 more"
    assert list(send.attributes[CHAIN_HANDLERS]) == names  # every one, in the attribute
    (process,) = children(spans, send)
    assert process.name == f"process {event} step0,step1,step2 +3 more"


def test_chain_destination_lists_the_first_handlers_then_counts() -> None:
    assert tn.chain_destination(["guard"]) == "guard"
    assert tn.chain_destination(["a", "b", "c"]) == "a,b,c"
    assert tn.chain_destination(["a", "b", "c", "d"]) == "a,b,c +1 more"
    assert tn.chain_destination([]) == "?"


async def test_span_names_are_short_and_the_subject_is_an_attribute(
    otel: Otel, nc, connect, event
) -> None:
    w = HookWorker(nc)

    @w.handler(event, priority=1)
    async def guard(ev: str, data: dict[str, Any]) -> None:
        return None

    async with w, HookDispatcher(await connect(), chains=False) as d:
        await d.emit(event, {})
    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    send = only(spans, f"send {event} guard")
    process = only(spans, f"process {event} guard")
    subject = handler_subject(event, "guard")
    assert send.attributes[tn.MESSAGING_DESTINATION_NAME] == subject
    assert process.attributes[tn.MESSAGING_DESTINATION_NAME] == subject
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert all("=3A" not in s.name for s in spans)


async def test_each_send_of_a_parallel_group_carries_its_handling(
    otel: Otel, nc, connect, event
) -> None:
    """Two processes: the group's sends go out at once, one per handler, each with the
    worker's handling as its child (none under the emit)."""
    left_w, right_w = HookWorker(nc), HookWorker(await connect())

    @left_w.handler(event, priority=1, parallel=True)
    async def left(ev: str, data: dict[str, Any]) -> None:
        return None

    @right_w.handler(event, priority=2, parallel=True)
    async def right(ev: str, data: dict[str, Any]) -> None:
        return None

    async with left_w, right_w, HookDispatcher(await connect()) as d:
        await d.emit(event, {})
    emit = otel.emit_span(event)
    spans = otel.spans(emit.context.trace_id)
    sends = children(spans, emit)
    assert sorted(s.name for s in sends) == [f"send {event} left", f"send {event} right"]
    for send in sends:
        assert send.kind is SpanKind.PRODUCER
        (kid,) = children(spans, send)
        assert kid.kind is SpanKind.CONSUMER
        assert kid.attributes[tn.HANDLER] == send.attributes[tn.HANDLER]
    assert len(spans) == 5


async def test_emit_and_collect_sends_one_message_and_counts_requests_and_answers_apart(
    otel: Otel, nc, connect, event
) -> None:
    w = HookWorker(nc)

    @w.handler(event, priority=1)
    async def one(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"data": {"from": "one"}}

    @w.handler(event, priority=2)
    async def two(ev: str, data: dict[str, Any]) -> None:
        return None  # an answer without data: no response, still an answer

    spy = await connect()
    on_wire = await wire_headers(spy, collect_subject(event))
    async with w, HookDispatcher(await connect()) as d:
        responses = await d.emit_and_collect(event, {"q": 1}, timeout=5)
        await spy.flush()
    assert responses == [{"from": "one"}]
    assert len(on_wire) == 1

    collect = only(otel.spans(), f"emit_and_collect {event}")
    spans = otel.spans(collect.context.trace_id)
    (send,) = children(spans, collect)
    assert send.name == f"send {event} collect" and send.kind is SpanKind.PRODUCER
    assert send.attributes[tn.MESSAGING_DESTINATION_NAME] == collect_subject(event)
    assert send.attributes[COLLECT_ASKED] == 2  # requests: the handlers the message asked
    assert send.attributes[COLLECT_ANSWERED] == 2  # answers: both came back
    assert collect.attributes[tn.RESPONSE_COUNT] == 1  # responses returned (with data)
    assert _context_of(on_wire[0]) == (collect.context.trace_id, send.context.span_id)
    handlings = children(spans, send)
    assert sorted(s.attributes[tn.HANDLER] for s in handlings) == ["one", "two"]
    assert all(s.kind is SpanKind.CONSUMER for s in handlings)


async def test_an_unsampled_chain_records_nothing_and_carries_flags_00(nc, connect, event) -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    reset_globals()
    o = Otel(sampler=ParentBased(ALWAYS_OFF))
    o.install()
    try:
        w = _chain_worker(nc, event)
        spy = await connect()
        event_token = collect_subject(event).rsplit(".", 1)[1]
        on_wire = await wire_headers(spy, f"hookbus.v1.chain.{event_token}.*")
        async with w, HookDispatcher(await connect()) as d:
            result = await d.emit(event, {"tool_name": "bash"})
            await spy.flush()
        assert result.action == "deny"
        assert o.spans() == []
        (headers,) = on_wire
        assert headers is not None
        ctx = trace.get_current_span(propagate.extract(headers)).get_span_context()
        assert ctx.is_valid and not ctx.trace_flags.sampled
    finally:
        o.shutdown()
        reset_globals()


async def test_a_hedged_call_records_its_requests_and_the_instance_that_answered(
    otel: Otel, connect, event
) -> None:
    """Two replicas of a retry_safe handler, one hung: a call the hung one took is hedged
    to the other; its ``send`` span says 2 requests were sent and names the instance whose
    reply decided it. A call answered at once says 1 request, and who answered."""
    hung = asyncio.Event()  # set only at the end
    workers = {"hung": HookWorker(await connect()), "live": HookWorker(await connect())}
    for who, w in workers.items():

        async def gate(ev: str, data: dict[str, Any], who: str = who) -> None:
            if who == "hung":
                await hung.wait()

        # a budget wide enough that a busy machine still hedges (at a quarter of it) and
        # hears the live replica within it
        w.add_handler(event, gate, name="gate", timeout_s=2.0, retry_safe=True)
    try:
        async with workers["hung"], workers["live"], HookDispatcher(await connect()) as d:
            for n in range(20):
                assert (await d.emit(event, {"n": n})).action == "continue"
            live = workers["live"].instance
    finally:
        hung.set()
    sends = [s for s in otel.spans() if s.name == f"send {event} gate"]
    assert len(sends) == 20, [s.name for s in otel.spans()]
    assert {s.attributes[tn.WORKER_INSTANCE] for s in sends} == {live}
    requests = sorted(s.attributes[tn.REQUESTS] for s in sends)
    assert requests[0] == 1 and requests[-1] >= 2, requests  # some answered at once, some hedged
