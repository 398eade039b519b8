"""OpenTelemetry for the dispatcher: a span and metrics for every decision.

The library only uses the OpenTelemetry API and whatever tracer and meter providers the
application set globally (``trace.set_tracer_provider`` / ``metrics.set_meter_provider``).
Which providers are set is decided once, at first use, and looked at again only when the
API's global provider slot changes: a provider set after import is used from the next
emit on, and no emit reads the environment (see `_telemetry_core`).

Costs:

- off (no provider set, or the API's no-op ones): an emit costs two identity tests, a
  handler call one flag test: no span objects, no ``traceparent`` headers, no attributes;
- a sampler that drops the emit: the SDK's non-recording span for the emit and no
  attributes; its handler calls make no spans at all, and every request of the emit
  carries the same W3C ``traceparent`` (the emit's context, flags ``00``, made once), so
  parent-based samplers downstream drop it too (W3C Trace Context: the sampled flag
  travels with the context);
- recorded: each span is started without attributes (the sampler decides first: it sees
  the name, kind, parent and links) and gets them in one call when it ends; a call's
  attributes that never change are built once per route. The SDK's own cost per span
  (start, attributes, end: tens of microseconds in place) is the floor: a traced chain
  of 3 makes three spans (the emit, its one send, the worker's one handling), see
  ``benchmarks/tracing.py`` (``bench_span_floor``).

Spans (names and attributes in `hookbus.schemas.telemetry`, and here): one
``send`` span per message that went over the wire, named as OpenTelemetry messaging
recommends, ``{operation} {destination}``, with a short, low-cardinality destination (the
event and handler the subject encodes, readable: ``send tool:pre guard``); the whole
subject is the span's ``messaging.destination.name``.

- ``emit <event>`` (INTERNAL): `HookDispatcher.emit`; the folded action, reason, deciding
  handler, and one ``hookbus.handler.failure`` event per failed handler.
- ``send <event> <handler>`` (PRODUCER): one remote handler call (its own request); its
  context goes to the worker in the W3C ``traceparent`` NATS header. ``handler <name>``
  (INTERNAL) for an in-process one. Both carry the handler's failure policy
  (`tn.FAILURE_POLICY`), failed or not. `start_call_span` / `record_call_span` make the same
  span for a call whose request is made elsewhere.
- ``send <event> <h1>,<h2>,<h3>`` (PRODUCER): ONE chain request, the adjacent handlers of
  one worker process in one message to the chain subject (`start_chain_span`), named by
  its handlers (`tn.chain_destination`: at most `tn.CHAIN_NAMES_SHOWN`, then ``+N more``):
  the handlers it asked (`tn.CHAIN_HANDLERS`), their failure policies
  (`tn.CHAIN_FAILURE_POLICIES`) and the outcomes read from its answer
  (`tn.CHAIN_OUTCOMES`); the worker's ``process <event> <h1>,<h2>,<h3>`` span is its child.
  A step the chain did not run is called alone afterwards, with a ``send`` span of its own.
- ``send <event> collect`` (PRODUCER): emit_and_collect's one message to every handler
  (`start_collect_span`): requests sent (`tn.COLLECT_ASKED`) and answers received
  (`tn.COLLECT_ANSWERED`); the workers' handlings are its children.
- ``process emit <event>`` / ``process emit_and_collect <event>`` (CONSUMER): the
  dispatcher service serving one request, parented to and linked with the agent's
  ``traceparent``; low-cardinality (no agent in the name): the subject is its
  ``messaging.destination.name``, the subject's agent its ``gen_ai.agent.id``.
- ``await <kind>`` (INTERNAL): a suspension wait (`suspension_span`); linked to the run or
  emit that created the suspension when that is not its parent (`created_by`).
- ``invoke_agent <agent>`` (INTERNAL): an agent run of the ``ai`` integration with no span
  current (`run_span`), with the run id (`tn.RUN_ID`) and session (`tn.GEN_AI_CONVERSATION_ID`)
  that a resumed run shares.

Metrics: see the ``METRIC_*`` names (durations in seconds).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from hookbus._core.otel_providers import w3c_headers
from hookbus.schemas import (
    DISPATCHER_QUEUE_GROUP,
    SUBJECT_PREFIX,
    EmitReply,
    HookbusError,
    HookResult,
    agent_from_service_subject,
    decode,
    event_from_service_subject,
)
from hookbus.schemas import telemetry as tn

from ._outcomes import Failed, Outcome
from ._route_table import Route
from ._telemetry_core import error, make, otel, reserve

__all__ = [
    "CallSpan",
    "ChainSpan",
    "SuspensionSpan",
    "created_by",
    "creating_traceparent",
    "end_collect_span",
    "observed_collect",
    "observed_emit",
    "record_call_span",
    "run_span",
    "send_name",
    "service_span_name",
    "start_call_span",
    "start_chain_span",
    "start_collect_span",
    "suspension_span",
    "trace_headers",
    "traced_call",
    "traced_dispatch",
]


def _ids(attrs: dict[str, Any], *sources: dict[str, Any] | None) -> dict[str, Any]:
    """Add the GenAI attributes of an event's data (agent, session, tool) to `attrs`; a
    later source wins."""
    for source in sources:
        if not source:
            continue
        for key, name in (
            ("agent_id", tn.GEN_AI_AGENT_ID),
            ("session_id", tn.GEN_AI_CONVERSATION_ID),
            ("tool_name", tn.GEN_AI_TOOL_NAME),
        ):
            value = source.get(key)
            if isinstance(value, str) and value:
                attrs[name] = value
    return attrs


def _result_attrs(attrs: dict[str, Any], result: HookResult) -> dict[str, Any]:
    attrs[tn.ACTION] = result.action
    if result.reason:
        attrs[tn.REASON] = result.reason
    if result.decided_by:
        attrs[tn.DECIDED_BY] = result.decided_by
    if result.approved_by:
        attrs[tn.APPROVED_BY] = result.approved_by
    return attrs


# -- emit ------------------------------------------------------------------------------------
async def observed_emit(
    emit: Callable[..., Awaitable[HookResult]],
    dispatcher: Any,
    event: str,
    data: dict[str, Any],
    kwargs: dict[str, Any],
) -> HookResult:
    """``await emit(event, data, **kwargs)`` inside the ``emit <event>`` span, with the emit
    metrics: what `HookDispatcher.emit` does while telemetry is on (`otel.sync`); with it
    off, it awaits the emitter directly (one coroutine frame less per emit).

    `dispatcher` gives the default fields for the span's attributes (``_defaults``)."""
    o = otel
    span: trace.Span | None = None
    token = None
    if o.tracing:  # the sampler decides first; attributes only for a recorded span
        span = o.tracer.start_span(f"{tn.SPAN_EMIT} {event}")
        token = otel_context.attach(trace.set_span_in_context(span))
        if not span.is_recording():
            span = None
    start = time.perf_counter()
    metric_attrs: dict[str, Any] = {tn.EVENT: event}
    try:
        result = await emit(event, data, **kwargs)
    except BaseException as exc:
        metric_attrs[tn.ERROR_TYPE] = type(exc).__qualname__
        if span is not None:
            span.set_attributes(_emit_attrs(dispatcher, event, data))
            error(span, exc)
        raise
    else:
        metric_attrs[tn.ACTION] = result.action
        if span is not None:
            _end_emit_span(span, _emit_attrs(dispatcher, event, data), result)
        if o.metrics:
            _count_emit(event, result)
        return result
    finally:
        if o.metrics:
            o.emit_duration.record(time.perf_counter() - start, metric_attrs)
        if token is not None:
            otel_context.detach(token)
        if span is not None:
            span.end()


def _emit_attrs(dispatcher: Any, event: str, data: dict[str, Any]) -> dict[str, Any]:
    return _ids({tn.EVENT: event}, getattr(dispatcher, "_defaults", None), data)


def _end_emit_span(span: trace.Span, attrs: dict[str, Any], result: HookResult) -> None:
    _result_attrs(attrs, result)
    failed_open = [f.handler for f in result.failures if f.policy == "ignore"]
    attrs[tn.FAILED_OPEN] = bool(failed_open)
    if result.failures:
        attrs[tn.FAILURE_COUNT] = len(result.failures)
    if failed_open:
        attrs[tn.FAILED_OPEN_HANDLERS] = failed_open
    span.set_attributes(attrs)
    for f in result.failures:
        span.add_event(
            tn.EVENT_HANDLER_FAILURE,
            {
                tn.HANDLER: f.handler,
                tn.FAILURE_KIND: f.kind,
                tn.FAILURE_POLICY: f.policy,
                tn.FAILED_OPEN: f.policy == "ignore",
                "exception.message": f.message,
            },
        )


def _count_emit(event: str, result: HookResult) -> None:
    o = otel
    o.decisions.add(1, {tn.EVENT: event, tn.ACTION: result.action})
    for f in result.failures:
        attrs = {tn.EVENT: event, tn.HANDLER: f.handler, tn.FAILURE_KIND: f.kind}
        o.failures.add(1, {**attrs, tn.FAILURE_POLICY: f.policy})
        if f.policy == "ignore":
            o.fail_opens.add(1, attrs)


# -- one handler call --------------------------------------------------------------------------
def traced_call(
    fn: Callable[[Any, Route, Any, dict[str, Any]], Awaitable[Outcome]],
) -> Callable[[Any, Route, Any, dict[str, Any]], Awaitable[Outcome]]:
    """Decorate `HookDispatcher._call(route, ctx, data)`: one span per handler call, a
    child of the emit span (none when the emit span is not recorded), and the
    ``hookbus.handler.duration`` histogram.

    `ctx` is the emit's context (``event``). Inside, `trace_headers` gives the
    ``traceparent`` of this call's span for the NATS request; an in-process handler runs
    inside its ``handler <name>`` span.
    """

    # A plain function handing back the call's awaitable, not a coroutine awaiting it:
    # with telemetry off this wrapper then costs no coroutine frame of its own (a few
    # tenths of a microsecond per in-process handler). Callers await the result at once.
    @functools.wraps(fn)
    def call(self: Any, route: Route, ctx: Any, data: dict[str, Any]) -> Awaitable[Outcome]:
        if not otel.on:  # as of this emit's sync
            return fn(self, route, ctx, data)
        return _observed_call(fn, self, route, ctx, data)

    return call


async def _observed_call(
    fn: Callable[[Any, Route, Any, dict[str, Any]], Awaitable[Outcome]],
    dispatcher: Any,
    route: Route,
    ctx: Any,
    data: dict[str, Any],
) -> Outcome:
    o = otel
    span: trace.Span | None = None
    token = None
    if o.tracing and trace.get_current_span().is_recording():
        name, kind, _ = _route_span(route)
        span = o.tracer.start_span(name, kind=kind)
        token = otel_context.attach(trace.set_span_in_context(span))
    start = time.perf_counter()
    outcome: Outcome | None = None
    try:
        outcome = await fn(dispatcher, route, ctx, data)
        return outcome
    except BaseException as exc:
        if span is not None and span.is_recording():
            span.set_attributes(_route_span(route)[2])
            error(span, exc)
        raise
    finally:
        if token is not None:
            otel_context.detach(token)
        if span is not None:
            if outcome is not None and span.is_recording():
                _set_outcome(span, route, outcome)
            span.end()
        if o.metrics:
            _record_duration(route, outcome, time.perf_counter() - start)


def _record_duration(route: Route, outcome: Outcome | None, seconds: float) -> None:
    m: dict[str, Any] = {tn.EVENT: route.event, tn.HANDLER: route.name}
    if isinstance(outcome, HookResult):
        m[tn.ACTION] = outcome.action
    elif isinstance(outcome, Failed):
        m[tn.ERROR_TYPE] = outcome.kind
    otel.handler_duration.record(seconds, m)


_route_spans: dict[Route, tuple[str, SpanKind, dict[str, Any]]] = {}
"""Per route: span name, kind and the attributes that never change (routes are immutable
and replaced on every registry change; the cache is dropped when it grows large)."""


def _route_span(route: Route) -> tuple[str, SpanKind, dict[str, Any]]:
    got = _route_spans.get(route)
    if got is not None:
        return got
    if len(_route_spans) >= 4096:
        _route_spans.clear()
    # few attributes: each costs the SDK one to two microseconds per span; the event is in
    # the subject and on the parent emit span, the queue group is on the worker's CONSUMER
    # span (a consumer attribute in the messaging semantic conventions); the failure policy
    # on every call, so a reader sees what a failure would do
    attrs: dict[str, Any] = {
        tn.HANDLER: route.name,
        tn.PRIORITY: route.priority,
        tn.FAILURE_POLICY: route.failure_policy,
    }
    if route.parallel:
        attrs[tn.PARALLEL] = True
    if route.remote:
        attrs.update({
            tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
            tn.MESSAGING_DESTINATION_NAME: route.subject,
            tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_SEND,
        })  # fmt: skip
        got = (send_name(route.event, route.name), SpanKind.PRODUCER, attrs)
    else:
        attrs[tn.EVENT] = route.event
        got = (f"{tn.SPAN_HANDLER} {route.name}", SpanKind.INTERNAL, attrs)
    _route_spans[route] = got
    return got


def _set_outcome(span: trace.Span, route: Route, outcome: Outcome) -> None:
    """Set the route's attributes and the outcome's on a recording call span, at once."""
    attrs = dict(_route_span(route)[2])
    if isinstance(outcome, Failed):
        attrs[tn.FAILURE_KIND] = outcome.kind
        attrs[tn.ERROR_TYPE] = outcome.kind
        attrs[tn.FAILED_OPEN] = route.failure_policy == "ignore"
        span.set_attributes(attrs)
        span.set_status(Status(StatusCode.ERROR, outcome.message))
        return
    attrs[tn.ACTION] = outcome.action
    if outcome.reason:
        attrs[tn.REASON] = outcome.reason
    if route.parallel and outcome.action == "modify":  # the fold refuses it: a bad reply
        attrs[tn.FAILURE_KIND] = "bad_reply"
        attrs[tn.ERROR_TYPE] = "bad_reply"
        attrs[tn.FAILED_OPEN] = route.failure_policy == "ignore"
    else:
        attrs[tn.FAILED_OPEN] = False
    span.set_attributes(attrs)


def send_name(event: str, destination: str) -> str:
    """The span name of a message sent to handler `destination` of `event` (a chain
    request: `tn.chain_destination` of its handlers; ``collect``: an emit_and_collect):
    OpenTelemetry messaging's
    ``{operation} {destination}`` with the destination the low-cardinality pair the
    subject encodes, readable (``send tool:pre guard``); the whole subject is the span's
    ``messaging.destination.name``."""
    return f"{tn.SPAN_SEND} {event} {destination}"


def _send_attrs(subject: str) -> dict[str, Any]:
    return {
        tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
        tn.MESSAGING_DESTINATION_NAME: subject,
        tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_SEND,
    }


def _start_send(name: str) -> tuple[trace.Span | None, dict[str, str] | None]:
    """A PRODUCER span `name`, a child of the current span, and the headers carrying its
    context; no span (and the current context's headers, see `trace_headers`) when
    tracing is off or the current span is not recorded."""
    if otel.tracing:
        parent = otel_context.get_current()
        if trace.get_current_span(parent).is_recording():
            span = otel.tracer.start_span(name, parent, kind=SpanKind.PRODUCER)
            carrier = w3c_headers(span.get_span_context(), parent)
            if carrier is None:
                carrier = {}
                propagate.inject(carrier, context=trace.set_span_in_context(span, parent))
            return span, carrier or None
    return None, trace_headers()


# -- a chain: one message, several handlers ------------------------------------------------------
class ChainSpan:
    """The ``send <event> <h1>,<h2>,...`` span (PRODUCER, `tn.chain_destination`) of one
    chain request: ONE message to the chain subject runs several handlers in one worker
    process. `headers` carry its context
    (W3C ``traceparent``) for that message, so the worker's handling of each step is this
    span's child. `step` records each step's outcome as the fold reads it (and its
    ``hookbus.handler.duration`` point, from the chain's start), `end` ends the span with
    the handlers it asked, their failure policies and the outcomes read (`tn.CHAIN_HANDLERS`,
    `tn.CHAIN_FAILURE_POLICIES`, `tn.CHAIN_OUTCOMES`; status
    ERROR naming the failed steps if any failed); `drop` (nothing was sent) leaves no span.
    Made by `start_chain_span`."""

    __slots__ = (
        "_failed",
        "_instance",
        "_outcomes",
        "_requests",
        "_seg",
        "_span",
        "_start_ns",
        "headers",
    )

    def __init__(
        self,
        seg: tuple[Route, ...],
        span: trace.Span | None,
        headers: dict[str, str] | None,
        start_ns: int,
    ) -> None:
        self._seg = seg
        self._span = span
        self._start_ns = start_ns
        self._outcomes: list[str] = []
        self._failed: list[str] = []
        self._requests = 0
        self._instance = ""
        self.headers = headers

    def step(self, route: Route, outcome: Outcome) -> None:
        """Record one step's outcome (the handler's `HookResult` or a `Failed`)."""
        if self._span is not None:
            if isinstance(outcome, Failed):
                self._outcomes.append(outcome.kind)
                self._failed.append(f"{route.name}: {outcome.message}")
            else:
                self._outcomes.append(outcome.action)
        if otel.metrics:
            _record_duration(route, outcome, max(0, time.time_ns() - self._start_ns) / 1e9)

    def drop(self) -> None:
        """Nothing was sent: no span (an SDK span never ended is never exported)."""
        self._span = None

    def delivered(self, requests: int, instance: str) -> None:
        """The requests the chain sent and the worker instance whose replies it used
        (`tn.REQUESTS`, `tn.WORKER_INSTANCE`), recorded when the span ends."""
        self._requests, self._instance = requests, instance

    def end(self, exc: BaseException | None = None) -> None:
        span = self._span
        if span is None:
            return
        self._span = None
        seg = self._seg
        attrs = _send_attrs(seg[0].chain or "")
        attrs[tn.CHAIN_HANDLERS] = [r.name for r in seg]
        attrs[tn.CHAIN_FAILURE_POLICIES] = [r.failure_policy for r in seg]
        attrs[tn.CHAIN_OUTCOMES] = self._outcomes
        attrs[tn.REQUESTS] = self._requests
        if self._instance:
            attrs[tn.WORKER_INSTANCE] = self._instance
        span.set_attributes(attrs)
        if exc is not None:
            error(span, exc)
        elif self._failed:  # the policy applied is on the emit span's failure events
            span.set_status(Status(StatusCode.ERROR, "; ".join(self._failed)))
        span.end()


_NO_CHAIN = ChainSpan((), None, None, 0)


def start_chain_span(seg: tuple[Route, ...]) -> ChainSpan:
    """Start the span of one chain request for the adjacent remote handlers `seg` (one
    worker process's): a child of the current span (the emit's). Send `ChainSpan.headers`
    with the chain's message; with tracing off and no context attached they are None, and
    with tracing and metrics off the object is one shared instance that does nothing."""
    if not otel.sync():
        return _NO_CHAIN
    destination = tn.chain_destination([r.name for r in seg])
    span, headers = _start_send(send_name(seg[0].event, destination))
    return ChainSpan(seg, span, headers, time.time_ns())


# -- emit_and_collect's one message ----------------------------------------------------------------
def start_collect_span(event: str) -> tuple[trace.Span | None, dict[str, str] | None]:
    """The ``send <event> collect`` span (PRODUCER) of an emit_and_collect's one message
    to every handler of `event`, and the headers carrying its context (the workers'
    handlings are its children); end it with `end_collect_span`. No span when tracing is
    off or the current span is not recorded."""
    if not otel.sync():
        return None, trace_headers()
    return _start_send(send_name(event, tn.COLLECT_DESTINATION))


def end_collect_span(span: trace.Span, subject: str, asked: int, answered: int) -> None:
    """End a `start_collect_span` span: requests sent (`tn.COLLECT_ASKED`, the handlers its
    one message asked) and answers received (`tn.COLLECT_ANSWERED`)."""
    attrs = _send_attrs(subject)
    attrs[tn.COLLECT_ASKED] = asked
    attrs[tn.COLLECT_ANSWERED] = answered
    span.set_attributes(attrs)
    span.end()


_headers_cache: tuple[object, dict[str, str] | None] = (None, None)


def trace_headers() -> dict[str, str] | None:
    """NATS headers carrying the current trace context (W3C ``traceparent``, through the
    application's global propagator), or None when there is none to carry: tracing off and
    no context attached (no header bytes sent).

    With tracing off, a context the caller attached (a process started inside a trace:
    ``TRACEPARENT``) is still carried, so the workers' spans join the caller's trace
    instead of each starting one of its own; without one, this costs an emptiness test.

    The dict may be shared by the requests made in one context (the calls of an emit whose
    span is not recorded all carry its context): do not modify it.
    """
    global _headers_cache
    current = otel_context.get_current()
    if not otel.tracing and not current:  # an empty context: nothing attached
        return None
    cached_for, headers = _headers_cache
    if cached_for is current:
        return headers
    carrier = w3c_headers(trace.get_current_span(current).get_span_context(), current)
    if carrier is None:
        carrier = {}
        propagate.inject(carrier, context=current)
    headers = carrier or None
    _headers_cache = (current, headers)
    return headers


# -- a handler call whose request is made elsewhere ------------------------------------------------
class CallSpan:
    """The span of one handler call, from `start_call_span`; `end` finishes it.

    `headers` are the NATS headers carrying this call's context (W3C ``traceparent``), for
    the request that runs the handler, so the worker's handling span is its child; None
    with tracing off. With the SDK's tracer the span is made when the call ends, with that
    context: a call that is never ended leaves no span (a handler of a several-handler
    request that did not run). With tracing and metrics off, `start_call_span` returns one
    shared instance whose `end` does nothing.
    """

    __slots__ = ("_context", "_parent", "_route", "_span", "_start_ns", "headers")

    def __init__(self, route: Route | None, start_ns: int) -> None:
        self._route = route
        self._start_ns = start_ns
        self._span: trace.Span | None = None
        self._parent: otel_context.Context | None = None
        self._context: SpanContext | None = None
        self.headers: dict[str, str] | None = None

    def end(
        self,
        outcome: Outcome | None,
        end_ns: int | None = None,
        *,
        error: BaseException | None = None,
    ) -> None:
        """End the call with its outcome (the handler's `HookResult` or a `Failed`), or
        with the exception that ended it (`error`, outcome None): the span `traced_call`
        makes (same name, kind, attributes, status) and one ``hookbus.handler.duration``
        point. Ends once; later calls do nothing.

        Args:
            end_ns: when the call ended, nanoseconds since the Unix epoch
                (`time.time_ns`, the clock of OpenTelemetry span times); None: now.
        """
        route = self._route
        if route is None:
            return
        self._route = None
        end = time.time_ns() if end_ns is None else end_ns
        span = self._span
        if span is None and self._context is not None and self._parent is not None:
            name, kind, _ = _route_span(route)
            span = make(name, self._parent, kind, self._start_ns, self._context)
        if span is not None:
            if span.is_recording():
                if outcome is not None:
                    _set_outcome(span, route, outcome)
                elif error is not None:
                    span.set_attributes(_route_span(route)[2])
                    _error_on(span, error)
            span.end(end_time=end)
        if otel.metrics:
            _record_duration(route, outcome, max(0, end - self._start_ns) / 1e9)


_error_on = error  # `CallSpan.end` has an argument named `error`
_NO_CALL = CallSpan(None, 0)


def start_call_span(route: Route, start_ns: int | None = None) -> CallSpan:
    """Start the span of one call of `route` whose request is made outside `traced_call`
    (e.g. each handler of a request that runs several), as `traced_call` would: ``send
    <subject>`` (PRODUCER) or ``handler <name>`` (INTERNAL), a child of the current span
    (the emit's). Send each call's `CallSpan.headers` with its handler's part of the
    request, and `CallSpan.end` the calls that ran: with the SDK's tracer those that did
    not leave no span, and the trace is the one per-handler requests make.

    No span when tracing is off or the current span is not recorded (the `headers` then
    carry the current context, as `trace_headers` does).

    Args:
        route: the handler's route.
        start_ns: when the call started, nanoseconds since the Unix epoch (`time.time_ns`);
            None: now.
    """
    o = otel
    if not o.sync():
        return _NO_CALL
    call = CallSpan(route, time.time_ns() if start_ns is None else start_ns)
    if not o.tracing:
        return call
    parent = otel_context.get_current()
    if not trace.get_current_span(parent).is_recording():
        call.headers = trace_headers()
        return call
    name, kind, _ = _route_span(route)
    reserved = reserve(name, parent, kind)
    if reserved is None:  # not the SDK's tracer: a span now
        span = o.tracer.start_span(name, parent, kind=kind, start_time=call._start_ns)
        call._span = span
    else:
        context, recording = reserved
        span = trace.NonRecordingSpan(context)
        if recording:
            call._parent, call._context = parent, context
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span, parent))
    call.headers = carrier or None
    return call


def record_call_span(route: Route, outcome: Outcome, start_ns: int, end_ns: int) -> None:
    """Record one finished call of `route` whose request was made elsewhere: the span
    `traced_call` would have made, a child of the current span (the emit's), same name,
    kind, attributes and status, at these times, and the same ``hookbus.handler.duration``
    point. The worker's handling is then not this span's child (its request carried
    another context): `start_call_span` keeps that too. Nothing when tracing and metrics
    are off; no span when the current span is not recorded.

    Args:
        route: the handler's route.
        outcome: its `HookResult`, or the `Failed` its failure policy judges.
        start_ns: when the call started, nanoseconds since the Unix epoch (`time.time_ns`).
        end_ns: when it ended, same clock.
    """
    o = otel
    if not o.sync():
        return
    call = CallSpan(route, start_ns)
    if o.tracing and trace.get_current_span().is_recording():
        name, kind, _ = _route_span(route)
        call._span = o.tracer.start_span(name, kind=kind, start_time=start_ns)
    call.end(outcome, end_ns)


# -- emit_and_collect -----------------------------------------------------------------------------
async def observed_collect(
    collect: Callable[..., Awaitable[list[Any]]],
    event: str,
    data: dict[str, Any],
    timeout: float,
) -> list[Any]:
    """``await collect(event, data, timeout)`` inside an ``emit_and_collect <event>`` span:
    what `HookDispatcher.emit_and_collect` does while tracing is on (`otel.sync` and
    `otel.tracing`); with it off, it awaits the emitter directly."""
    span = otel.tracer.start_span(f"{tn.SPAN_EMIT_AND_COLLECT} {event}")
    token = otel_context.attach(trace.set_span_in_context(span))
    recording = span.is_recording()
    try:
        responses = await collect(event, data, timeout)
    except BaseException as exc:
        if recording:
            span.set_attributes(_ids({tn.EVENT: event}, data))
            error(span, exc)
        raise
    else:
        if recording:
            span.set_attributes(_ids({tn.EVENT: event, tn.RESPONSE_COUNT: len(responses)}, data))
        return responses
    finally:
        otel_context.detach(token)
        span.end()


# -- service mode ------------------------------------------------------------------------------
def traced_dispatch(
    fn: Callable[[Any, Msg], Awaitable[bytes]],
) -> Callable[[Any, Msg], Awaitable[bytes]]:
    """Decorate a `DispatcherService` request handler ``(self, msg) -> reply bytes``: a
    CONSUMER ``process <verb> <event>`` span (`service_span_name`) parented to and linked
    with the agent's context (``traceparent`` in ``msg.headers``; a request without one
    starts a new trace)."""

    @functools.wraps(fn)
    async def serve(self: Any, msg: Msg) -> bytes:
        if not otel.sync() or not otel.tracing:
            return await fn(self, msg)
        parent = propagate.extract(msg.headers) if msg.headers else None
        remote = trace.get_current_span(parent).get_span_context()
        span = otel.tracer.start_span(
            service_span_name(msg.subject),
            context=parent,
            kind=SpanKind.CONSUMER,
            links=[Link(remote)] if remote.is_valid else None,
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        recording = span.is_recording()
        try:
            payload = await fn(self, msg)
        except BaseException as exc:
            if recording:
                span.set_attributes(_service_attrs(msg.subject))
                error(span, exc)
            raise
        else:
            if recording:
                _end_service_span(span, _service_attrs(msg.subject), payload)
            return payload
        finally:
            otel_context.detach(token)
            span.end()

    return serve


def service_span_name(subject: str) -> str:
    """The span name of the dispatcher service serving a request on `subject`
    (``hookbus.v1.emit.<agent>.<event>`` or ``hookbus.v1.emit_and_collect.<agent>.<event>``):
    ``process <emit or emit_and_collect> <event>``, e.g. ``process emit tool:pre``.
    Low-cardinality, as the messaging conventions ask of a span name: the agent token (one
    per agent) is left out (the whole subject is the span's ``messaging.destination.name``,
    the agent its ``gen_ai.agent.id``); ``?`` for a part that is not there or does not
    decode."""
    verb = event = "?"
    tokens = subject.split(".")
    if len(tokens) == 5 and subject.startswith(f"{SUBJECT_PREFIX}."):
        verb = tokens[2]
        with contextlib.suppress(HookbusError):
            event = event_from_service_subject(subject)
    return f"{tn.SPAN_PROCESS} {verb} {event}"


def _service_attrs(subject: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
        tn.MESSAGING_DESTINATION_NAME: subject,
        tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_PROCESS,
        tn.MESSAGING_CONSUMER_GROUP_NAME: DISPATCHER_QUEUE_GROUP,
    }
    with contextlib.suppress(HookbusError):
        attrs[tn.EVENT] = event_from_service_subject(subject)
    with contextlib.suppress(HookbusError):
        agent = agent_from_service_subject(subject)
        if agent:
            attrs[tn.GEN_AI_AGENT_ID] = agent
    return attrs


def _end_service_span(span: trace.Span, attrs: dict[str, Any], payload: bytes) -> None:
    """Set the outcome of a service reply on its span (an EmitReply or a CollectReply)."""
    with contextlib.suppress(HookbusError):
        reply = decode(payload, EmitReply)
        if reply.error is not None:
            attrs[tn.ERROR_TYPE] = reply.error.code
            span.set_status(Status(StatusCode.ERROR, reply.error.message))
        elif reply.result is not None:
            _result_attrs(attrs, reply.result)
    span.set_attributes(attrs)


# -- suspensions ---------------------------------------------------------------------------------
class SuspensionSpan:
    """The span of one suspension wait; `event` records its steps.

    Events: ``pending`` (a pending record was created or re-attached: counts in the
    ``hookbus.suspensions.pending`` gauge), ``resolved``, ``cancelled``, ``timed_out``,
    ``aborted`` (each ends the pending count). The last of those is the span's
    ``hookbus.suspension.outcome``.
    """

    __slots__ = ("_attrs", "_counted", "_span", "outcome")

    def __init__(self, span: trace.Span | None, attrs: dict[str, Any]) -> None:
        self._span = span
        self._attrs = attrs
        self._counted = False
        self.outcome: str | None = None

    def event(self, name: str, **attributes: Any) -> None:
        """Record step `name` (one of `SUSPENSION_EVENTS`); keyword attributes are added to
        the span event as ``hookbus.suspension.<key>`` (keys with a dot are kept as is).

        Raises:
            ValueError: `name` is not a suspension event.
        """
        if name not in tn.SUSPENSION_EVENTS:
            known = ", ".join(sorted(tn.SUSPENSION_EVENTS))
            raise ValueError(f"not a suspension event: {name!r} (one of {known})")
        if self._span is not None:
            attrs = {
                (k if "." in k else f"hookbus.suspension.{k}"): v
                for k, v in attributes.items()
                if v is not None
            }
            self._span.add_event(name, attrs)
        if name == tn.SUSPENSION_PENDING:
            if not self._counted and otel.metrics:
                otel.pending.add(1, self._attrs)
                self._counted = True
            return
        self.outcome = name
        if self._span is not None:
            self._span.set_attribute(tn.SUSPENSION_OUTCOME, name)
        self._uncount()

    def _uncount(self) -> None:
        if self._counted:
            otel.pending.add(-1, self._attrs)
            self._counted = False


@contextlib.contextmanager
def suspension_span(
    label: str, *, kind: str = "suspension", attributes: dict[str, Any] | None = None
) -> Iterator[SuspensionSpan]:
    """An ``await <kind>`` span (INTERNAL) around one suspension wait, a child of the
    current span (the emit, for an approval).

    Usage::

        with suspension_span(label, kind="approval", attributes={...}) as s:
            s.event("pending")
            ...                      # wait
            s.event("resolved", choice="Allow")

    An exception leaving the block ends the pending count; it is recorded on the span as an
    error unless an outcome (``timed_out``, ``cancelled``, ...) was recorded first, so
    ``s.event("timed_out"); raise SuspensionTimeoutError(...)`` is an outcome, not a failure.
    `attributes` may use any names (GenAI ids, ``hookbus.handler``, ...); None values are
    dropped. With tracing and metrics off, the object does nothing; a span the sampler
    drops gets no attributes or events.
    """
    otel.sync()
    base = {tn.SUSPENSION_KIND: kind}
    if not otel.tracing:
        holder = SuspensionSpan(None, base)
        try:
            yield holder
        finally:
            holder._uncount()
        return
    span = otel.tracer.start_span(f"{tn.SPAN_AWAIT} {kind}", links=_wait_links.get() or None)
    recording = span.is_recording()
    if recording:
        extra = {k: v for k, v in (attributes or {}).items() if v is not None}
        span.set_attributes({tn.SUSPENSION_LABEL: label, **base, **extra})
    holder = SuspensionSpan(span if recording else None, base)
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield holder
    except BaseException as exc:
        if holder.outcome is None and recording:
            error(span, exc)
        raise
    finally:
        otel_context.detach(token)
        holder._uncount()
        span.end()


# -- who created a suspension: links across runs and processes -------------------------------------
LINK_CREATED_BY = "hookbus.suspension.created_by"
"""On the link of an ``await`` span to the context that created its suspension (True)."""

_wait_links: contextvars.ContextVar[tuple[Link, ...]] = contextvars.ContextVar(
    "hookbus_wait_links", default=()
)


def creating_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span (the run or emit creating a
    suspension now), to keep with the suspension's record so that a later wait on it, in
    any process, links to its creator (`created_by`); None when tracing is off or no span
    is current."""
    if not otel.sync() or not otel.tracing:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


@contextlib.contextmanager
def created_by(traceparent: str | None) -> Iterator[None]:
    """The ``await`` spans of the suspension waits started inside (tasks created inside
    included: they copy the context) link to the span of `traceparent` (the run or emit
    that created the suspension, from `creating_traceparent`; attribute
    `LINK_CREATED_BY`), unless it is their parent already. None, or tracing off: nothing.

    A wait that was aborted and resumed later (another run, another process) is then
    tied to the trace that asked the question, not a root of its own.
    """
    link = None
    if traceparent and otel.sync() and otel.tracing:
        parent = trace.get_current_span().get_span_context()
        remote = _remote_context(traceparent)
        if remote is not None and (remote.trace_id, remote.span_id) != (
            parent.trace_id,
            parent.span_id,
        ):
            link = Link(remote, {LINK_CREATED_BY: True})
    if link is None:
        yield
        return
    token = _wait_links.set((*_wait_links.get(), link))
    try:
        yield
    finally:
        _wait_links.reset(token)


def _remote_context(traceparent: str) -> SpanContext | None:
    parts = traceparent.split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    context = SpanContext(trace_id, span_id, True, trace.TraceFlags(flags))
    return context if context.is_valid else None


@contextlib.contextmanager
def run_span(
    agent_id: str | None, run_id: str | None, conversation_id: str | None = None
) -> Iterator[None]:
    """An ``invoke_agent <agent>`` span (INTERNAL, OpenTelemetry GenAI) around an agent
    run whose hooks hookbus keeps, when no span is current: the run's waits are its
    children (not roots each) and the suspensions it creates keep its context
    (`creating_traceparent`). Inside a current span (the application's, or the agent
    library's own), nothing: that span is the run's.

    The span has the run id (`tn.RUN_ID`) and `conversation_id` (the run's session,
    `tn.GEN_AI_CONVERSATION_ID`): a run resuming another has the same, so a backend finds
    the two together by attribute (the link of a resumed wait to its creator is not
    shown everywhere)."""
    if not otel.sync() or not otel.tracing or trace.get_current_span().get_span_context().is_valid:
        yield
        return
    span = otel.tracer.start_span(f"invoke_agent {agent_id}" if agent_id else "invoke_agent")
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    except BaseException as exc:
        if span.is_recording():
            error(span, exc)
        raise
    finally:
        if span.is_recording():
            attrs: dict[str, Any] = {"gen_ai.operation.name": "invoke_agent"}
            if agent_id:
                attrs[tn.GEN_AI_AGENT_ID] = agent_id
            if run_id:
                attrs[tn.RUN_ID] = run_id
            if conversation_id:
                attrs[tn.GEN_AI_CONVERSATION_ID] = conversation_id
            span.set_attributes(attrs)
        with contextlib.suppress(Exception):  # a run block left from another context
            otel_context.detach(token)
        span.end()
