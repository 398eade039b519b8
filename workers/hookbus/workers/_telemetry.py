"""OpenTelemetry for workers: one CONSUMER span per handling, linked to the dispatcher's call.

The library only uses the OpenTelemetry API and the global providers the application set,
decided at first use and looked at again only when the API's global provider slot changes
(see `_telemetry_core`): a provider set after import is used from the next request on, and
no request reads the environment. With none set, a request costs two identity tests: no
span, no attributes, no header parsing.

The span (``process <event> <handler>``, OpenTelemetry messaging's ``{operation}
{destination}`` with the destination the event and handler the subject encodes; the subject
itself is ``messaging.destination.name``; a chain message: one ``process <event>
<h1>,<h2>,...`` span naming the handlers it asks for, see `ChainHandling`) is parented to,
and linked with, the context in the request's W3C ``traceparent`` NATS header, so the
dispatcher's ``send`` span and this one share a trace; a request without headers starts a
new trace. The span is started without attributes, so the sampler decides before any is
built: a handling it drops (e.g. a parent sent with flags ``00``) gets none and the
request's envelope is not read for them; its context is still current while the handler
runs, so the handler's own spans and requests carry the same decision. A recorded span gets
its attributes in one call when it ends. With the API's default propagator (W3C trace
context and baggage), a ``traceparent`` without baggage is read here directly, and the
handlers of one request share one reading. A span is finished (attributes, ``end``) once the
reply is written (`_after_reply`): the dispatcher does not wait for the SDK's work. Names in
`hookbus.schemas.telemetry`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from hookbus._core.otel_providers import default_textmap
from hookbus.schemas import EventEnvelope, HandlerDeclaration, HookReply, handler_subject
from hookbus.schemas import telemetry as tn

from ._telemetry_core import otel

if TYPE_CHECKING:
    from ._spec import HandlerSpec

__all__ = ["ChainHandling", "HandlingSpan", "chain_handling", "handling_span", "traced_handling"]


class _Ids(msgspec.Struct):
    tool_name: Any = None


class _Envelope(msgspec.Struct):
    """The fields of an `EventEnvelope` the span wants; the rest is skipped unparsed."""

    id: Any = None
    agent_id: Any = None
    session_id: Any = None
    data: _Ids | None = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)

Handle = Callable[[Any, "HandlerSpec", Msg], Awaitable["HookReply | None"]]


def traced_handling(fn: Handle) -> Handle:
    """Decorate `RequestServer.handle(spec, msg) -> HookReply | None`: the CONSUMER span and
    the ``messaging.process.duration`` histogram (seconds), see `handling_span`."""

    @functools.wraps(fn)
    async def handle(self: Any, spec: HandlerSpec, msg: Msg) -> HookReply | None:
        if not otel.sync():
            return await fn(self, spec, msg)
        with HandlingSpan(spec.declaration, msg.data, msg.headers, msg.subject) as handling:
            reply = await fn(self, spec, msg)
            handling.reply(reply)
            return reply

    return handle


_last_extract: tuple[object, otel_context.Context] | None = None


def _start_process_span(name: str, headers: Mapping[str, str] | None) -> tuple[trace.Span, object]:
    """A CONSUMER span `name` parented to, and linked with, the context in `headers` (a
    new trace without one), attached as the current context; the span and the token to
    detach it with."""
    parent = _extract(headers) if headers else None
    remote = trace.get_current_span(parent).get_span_context()
    span = otel.tracer.start_span(
        name, parent, kind=SpanKind.CONSUMER, links=[Link(remote)] if remote.is_valid else None
    )
    return span, otel_context.attach(trace.set_span_in_context(span, parent))


def _extract(headers: Mapping[str, str]) -> otel_context.Context:
    """The context in `headers`, as the application's global propagator reads it; the same
    headers twice in a row (the handlers of one request) are read once."""
    global _last_extract
    # the usual headers are a lone traceparent: keyed by its text (no copy of the dict)
    key: object = headers.get("traceparent") if len(headers) == 1 else None
    if key is None:
        key = tuple(headers.items())
    last = _last_extract
    if last is not None and last[0] == key:
        return last[1]
    context = _w3c(headers) if default_textmap() else None
    if context is None:
        context = propagate.extract(headers)
    _last_extract = (key, context)
    return context


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
"""W3C Trace Context, ``traceparent``: version, trace-id, parent-id, trace-flags (lower-case
hex); a later version may append fields after a ``-``."""


def _w3c(headers: Mapping[str, str]) -> otel_context.Context | None:
    """What the default propagator reads from `headers` (W3C Trace Context: a valid
    ``traceparent`` and its ``tracestate``), read here at a fraction of its cost; None:
    leave it to the propagator (baggage, or a header it judges itself)."""
    value = headers.get("traceparent")
    if value is None or "baggage" in headers:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or not int(trace_id, 16):
        return None
    if not int(span_id, 16):
        return None
    tracestate = headers.get("tracestate")
    state = TraceState.from_header([tracestate]) if tracestate else None
    context = SpanContext(
        int(trace_id, 16), int(span_id, 16), True, TraceFlags(int(flags, 16)), state
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(context), otel_context.Context())


class HandlingSpan:
    """One handling's ``process <subject>`` span (CONSUMER) and its
    ``messaging.process.duration`` point (seconds), as a context manager: the span's
    context is current inside (the handler's own spans and requests are its children),
    and it ends on exit. Record the answer with `reply`; an exception leaving the block is
    recorded as the error instead. Made by `handling_span`.
    """

    __slots__ = (
        "_decl",
        "_envelope",
        "_headers",
        "_replied",
        "_reply",
        "_span",
        "_start",
        "_subject",
        "_token",
    )

    def __init__(
        self,
        decl: HandlerDeclaration | None,
        envelope: EventEnvelope | bytes | None,
        headers: Mapping[str, str] | None,
        subject: str,
    ) -> None:
        self._decl = decl
        self._envelope: EventEnvelope | tuple[Any, ...] | bytes | None = envelope
        self._headers = headers
        self._subject = subject
        self._span: trace.Span | None = None
        self._token: object = None
        self._start = 0.0
        self._reply: HookReply | None = None
        self._replied = False

    def __enter__(self) -> HandlingSpan:
        if self._decl is None:
            return self
        if otel.tracing:  # the sampler decides first; attributes only for a recorded span
            decl = self._decl
            span, self._token = _start_process_span(
                f"{tn.SPAN_PROCESS} {decl.event} {decl.name}", self._headers
            )
            if span.is_recording():
                self._span = span
                envelope = self._envelope
                if isinstance(envelope, EventEnvelope):  # as it came: the handler may edit it
                    self._envelope = _envelope_fields(envelope)
        self._start = time.perf_counter()
        return self

    def reply(self, reply: HookReply | None) -> None:
        """Record the handling's answer: its action (and reason), or its error code (span
        status ERROR); None: the request was dropped unanswered (``hookbus.dropped``)."""
        if self._decl is not None:
            self._reply = reply
            self._replied = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        decl = self._decl
        if decl is None:
            return
        elapsed = time.perf_counter() - self._start
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
        span = self._span
        if span is not None:
            _after_reply(self._end, span, decl, exc, time.time_ns())
        if otel.metrics:
            _after_reply(self._record, decl, exc, elapsed)

    def _end(
        self, span: trace.Span, decl: HandlerDeclaration, exc: BaseException | None, end_ns: int
    ) -> None:
        attrs, status = self._attributes(decl)
        span.set_attributes(attrs)
        if status is not None:
            span.set_status(status)
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attribute(tn.ERROR_TYPE, type(exc).__qualname__)
        span.end(end_time=end_ns)

    def _attributes(self, decl: HandlerDeclaration) -> tuple[dict[str, Any], Status | None]:
        # few attributes (each costs the SDK one to two microseconds): the event is in the
        # subject, priority and policy on the dispatcher's span of the same call
        attrs: dict[str, Any] = {
            tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
            tn.MESSAGING_DESTINATION_NAME: self._subject,
            tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_PROCESS,
            tn.MESSAGING_CONSUMER_GROUP_NAME: decl.queue_group,
            tn.HANDLER: decl.name,
        }
        envelope = self._envelope
        _envelope_attrs(attrs, None if isinstance(envelope, EventEnvelope) else envelope)
        reply = self._reply
        if not self._replied:
            return attrs, None
        if reply is None:
            attrs[tn.DROPPED] = True
        elif reply.error is not None:
            attrs[tn.ERROR_TYPE] = reply.error.code
            return attrs, Status(StatusCode.ERROR, reply.error.message)
        elif reply.result is not None:
            attrs[tn.ACTION] = reply.result.action
            if reply.result.reason:
                attrs[tn.REASON] = reply.result.reason
        return attrs, None

    def _record(self, decl: HandlerDeclaration, exc: BaseException | None, elapsed: float) -> None:
        _record_process(self._subject, decl, self._reply, exc, elapsed)


def _record_process(
    subject: str,
    decl: HandlerDeclaration,
    reply: HookReply | None,
    exc: BaseException | None,
    elapsed: float,
) -> None:
    """One ``messaging.process.duration`` point of a handling of `decl` on `subject`."""
    m: dict[str, Any] = {
        tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
        tn.MESSAGING_DESTINATION_NAME: subject,
        tn.MESSAGING_CONSUMER_GROUP_NAME: decl.queue_group,
        tn.HANDLER: decl.name,
    }
    if exc is not None:
        m[tn.ERROR_TYPE] = type(exc).__qualname__
    elif reply is not None and reply.error is not None:
        m[tn.ERROR_TYPE] = str(reply.error.code)
    elif reply is not None and reply.result is not None:
        m[tn.ACTION] = reply.result.action
    otel.process_duration.record(elapsed, m)


_NO_HANDLING = HandlingSpan(None, None, None, "")


def _after_reply(fn: Callable[..., None], *args: Any) -> None:
    """Call `fn(*args)` once the reply the caller is about to publish has been written:
    two event loop turns from now (nats-py writes a publish in its flusher task, woken by
    the publish: the first turn runs that task's step, the second this). Finishing a span
    (its attributes, ``end`` with the time taken at the handling's end, the processor's
    ``on_end``) costs the SDK tens of microseconds that the dispatcher would otherwise wait
    for. Now, when no loop is running."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        fn(*args)
        return
    loop.call_soon(loop.call_soon, fn, *args)


def handling_span(
    decl: HandlerDeclaration,
    envelope: EventEnvelope | bytes | None,
    headers: Mapping[str, str] | None,
    *,
    subject: str | None = None,
) -> HandlingSpan | _ChainStep:
    """The span and duration point of one handling, as `traced_handling` makes them, for
    a handler run outside it (e.g. each handler of a request that runs several)::

        with handling_span(decl, envelope, headers) as handling:
            reply = ...                 # run the handler
            handling.reply(reply)

    Args:
        decl: the handler's declaration (name, queue group, subject).
        envelope: the request's `EventEnvelope`, or its JSON bytes (read only if the span
            is recorded): the emit id, agent, session and tool attributes.
        headers: NATS headers carrying the caller's W3C ``traceparent``: this handler's
            own call context when the caller sent one per handler (then the handling is
            that call span's child, as with a request of its own), else the request's;
            None starts a new trace.
        subject: the span's destination (``process <subject>``); None: the handler's own
            subject, as a request of its own would have.
    Returns:
        A `HandlingSpan`; with tracing and metrics off, one shared instance that does
        nothing. Inside `chain_handling` (a step of a chain message), an object with the
        same use that records the step as an event of the chain's span.
    """
    if not otel.sync():
        return _NO_HANDLING
    chain = _chain.get()
    if chain is not None:  # a step of the chain message being handled: its span's event
        return _ChainStep(decl, chain)
    if subject is None:
        subject = decl.subject or handler_subject(decl.event, decl.name)
    return HandlingSpan(decl, envelope, headers, subject)


def _envelope_fields(envelope: EventEnvelope) -> tuple[Any, ...]:
    data = envelope.data
    tool = data.get("tool_name") if isinstance(data, dict) else None
    return (envelope.id, envelope.agent_id, envelope.session_id, tool)


def _envelope_attrs(attrs: dict[str, Any], envelope: tuple[Any, ...] | bytes | None) -> None:
    """The emit id, agent, session and tool of the envelope (its JSON, or its fields)."""
    if envelope is None:
        return
    if isinstance(envelope, tuple):
        fields = envelope
    else:
        try:
            env = _envelope_decoder.decode(envelope)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        tool = env.data.tool_name if env.data is not None else None
        fields = (env.id, env.agent_id, env.session_id, tool)
    for value, name in zip(fields, _ENVELOPE_NAMES, strict=True):
        if isinstance(value, str) and value:
            attrs[name] = value


_ENVELOPE_NAMES = (
    tn.MESSAGING_MESSAGE_ID,
    tn.GEN_AI_AGENT_ID,
    tn.GEN_AI_CONVERSATION_ID,
    tn.GEN_AI_TOOL_NAME,
)


# -- a chain: one message, several handlers --------------------------------------------------

_chain: contextvars.ContextVar[ChainHandling | None] = contextvars.ContextVar(
    "hookbus_chain_handling", default=None
)


class ChainHandling:
    """The ``process <event> <h1>,<h2>,...`` span (CONSUMER) of one chain message, named by
    the handlers it asks for as the dispatcher's span is (`tn.chain_destination`): ONE
    message ran several handlers, so one span, parented to and linked with the message's
    ``traceparent`` (the dispatcher's ``send <event> <h1>,<h2>,...`` span), its steps in array
    attributes, one entry per step run (`tn.CHAIN_HANDLERS`, `tn.CHAIN_OUTCOMES`,
    `tn.CHAIN_DURATIONS`, `tn.CHAIN_REASONS`: attributes, not span events or spans, as each of
    those costs the SDK several microseconds more). `handling_span` inside it records a
    step instead of making a span; each step's ``messaging.process.duration`` point is
    kept. Made by `chain_handling`; a context manager."""

    __slots__ = (
        "_durations",
        "_envelope",
        "_errors",
        "_fields",
        "_handlers",
        "_msg",
        "_outcomes",
        "_reasons",
        "_span",
        "_token",
        "_var_token",
    )

    def __init__(self, msg: Msg | None, envelope: EventEnvelope | None) -> None:
        self._msg = msg
        self._envelope = envelope
        self._span: trace.Span | None = None
        self._token: object = None
        self._var_token: contextvars.Token[ChainHandling | None] | None = None
        self._handlers: list[str] = []
        self._outcomes: list[str] = []
        self._durations: list[float] = []
        self._reasons: list[str] | None = None
        self._errors = 0
        self._fields: tuple[Any, ...] | None = None

    def __enter__(self) -> ChainHandling:
        msg = self._msg
        if msg is None:
            return self
        if otel.tracing:
            envelope = self._envelope
            event, steps = (envelope.event, envelope.chain or ()) if envelope else ("?", ())
            destination = tn.chain_destination([step.handler for step in steps])
            span, self._token = _start_process_span(
                f"{tn.SPAN_PROCESS} {event} {destination}", msg.headers
            )
            if span.is_recording():
                self._span = span
                envelope = self._envelope
                if envelope is not None:  # as it came: the chain's last handler may edit it
                    self._fields = _envelope_fields(envelope)
        self._var_token = _chain.set(self)
        return self

    def step(self, decl: HandlerDeclaration, reply: HookReply | None, seconds: float) -> None:
        if self._span is None:
            return
        reason = ""
        if reply is None:
            outcome = "dropped"
        elif reply.error is not None:
            outcome = str(reply.error.code)
            self._errors += 1
        elif reply.result is not None:
            outcome = reply.result.action
            reason = reply.result.reason or ""
        else:
            outcome = ""
        n = len(self._handlers)
        self._handlers.append(decl.name)
        self._outcomes.append(outcome)
        self._durations.append(seconds)
        if reason and self._reasons is None:
            self._reasons = [""] * n
        if self._reasons is not None:
            self._reasons.append(reason)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._msg is None:
            return
        if self._var_token is not None:
            _chain.reset(self._var_token)
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
        span = self._span
        if span is None:
            return
        _after_reply(self._end, span, self._fields, exc, time.time_ns())

    def _end(
        self,
        span: trace.Span,
        fields: tuple[Any, ...] | None,
        exc: BaseException | None,
        end_ns: int,
    ) -> None:
        assert self._msg is not None
        attrs: dict[str, Any] = {
            tn.MESSAGING_SYSTEM: tn.MESSAGING_SYSTEM_NATS,
            tn.MESSAGING_DESTINATION_NAME: self._msg.subject,
            tn.MESSAGING_OPERATION_TYPE: tn.OPERATION_PROCESS,
        }
        _envelope_attrs(attrs, fields)
        attrs[tn.CHAIN_HANDLERS] = self._handlers
        attrs[tn.CHAIN_OUTCOMES] = self._outcomes
        attrs[tn.CHAIN_DURATIONS] = self._durations
        if self._reasons is not None:
            attrs[tn.CHAIN_REASONS] = self._reasons
        span.set_attributes(attrs)
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attribute(tn.ERROR_TYPE, type(exc).__qualname__)
        elif self._errors:
            span.set_status(Status(StatusCode.ERROR, f"{self._errors} step(s) answered an error"))
        span.end(end_time=end_ns)


_NO_CHAIN = ChainHandling(None, None)


def chain_handling(msg: Msg, envelope: EventEnvelope | None) -> ChainHandling:
    """The span of one chain message, around running its steps (see `ChainHandling`);
    with tracing and metrics off, one shared instance that does nothing."""
    if not otel.sync():
        return _NO_CHAIN
    return ChainHandling(msg, envelope)


class _ChainStep:
    """`handling_span` for a step of the chain message being handled: an event on the
    chain's span (no span of its own) and the handler's ``messaging.process.duration``."""

    __slots__ = ("_chain", "_decl", "_reply", "_start")

    def __init__(self, decl: HandlerDeclaration, chain: ChainHandling) -> None:
        self._decl = decl
        self._chain = chain
        self._reply: HookReply | None = None
        self._start = 0.0

    def __enter__(self) -> _ChainStep:
        self._start = time.perf_counter()
        return self

    def reply(self, reply: HookReply | None) -> None:
        self._reply = reply

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        elapsed = time.perf_counter() - self._start
        decl, reply = self._decl, self._reply
        self._chain.step(decl, reply, elapsed)
        if otel.metrics:  # once the chain's reply is written, as the span
            _after_reply(self._record, decl, reply, exc, elapsed)

    def _record(
        self,
        decl: HandlerDeclaration,
        reply: HookReply | None,
        exc: BaseException | None,
        elapsed: float,
    ) -> None:
        subject = self._chain._msg.subject if self._chain._msg is not None else ""
        _record_process(subject, decl, reply, exc, elapsed)
