"""When tracing is on, off, or decided against: providers, sampling and W3C propagation.

A real nats-server; each handler lives in a worker of its own (one request per handler
call). What is checked:

- the global providers are followed as they change (set after first use, removed, set
  again), by the dispatcher and by the worker, and no emit or request reads the
  environment for them;
- a sampler's "drop" is honoured before any work: no span is recorded, no attribute is
  handed to the sampler, the calls of an unrecorded emit make no span objects at all, and
  every request still carries the W3C ``traceparent`` with the sampled flag ``00`` (W3C
  Trace Context: the decision travels with the context, so parent-based samplers
  downstream drop it too);
- a caller's unsampled context is passed on the same way, embedded and through the
  dispatcher service;
- every span of an emit has ended when the emit returns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from _otel_harness import Otel, RecordingSampler, emit_requested, reset_globals, wire_headers
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.schemas import (
    HookResult,
    emit_service_subject,
    handler_subject,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


@pytest.fixture
def installed() -> Iterator[list[Otel]]:
    """Providers a test installs (``installed.append(Otel(...)); o.install()``): shut down
    and removed at the end."""
    reset_globals()
    made: list[Otel] = []
    yield made
    for o in made:
        o.shutdown()
    reset_globals()


def install(installed: list[Otel], **kwargs: Any) -> Otel:
    o = Otel(**kwargs)
    installed.append(o)
    o.install()
    return o


async def two_workers(nc: Any, connect: Any, event: str) -> tuple[HookWorker, HookWorker]:
    """`first` (priority 1) and `second` (priority 2), each in a worker of its own: one
    request per handler call."""
    w1, w2 = HookWorker(nc), HookWorker(await connect())

    @w1.handler(event, priority=1)
    async def first(ev: str, data: dict[str, Any]) -> None:
        return None

    @w2.handler(event, priority=2)
    async def second(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="no")

    return w1, w2


def traceparent(headers: dict[str, str] | None) -> tuple[str, str, bool]:
    """(trace id, parent id, sampled) of a W3C ``traceparent`` header (sampled: bit 0 of
    the flags; the SDK may set bit 1, "random trace id", of Trace Context Level 2)."""
    assert headers is not None and "traceparent" in headers, headers
    version, trace_id, parent_id, flags = headers["traceparent"].split("-")
    assert version == "00" and len(trace_id) == 32 and len(parent_id) == 16
    return trace_id, parent_id, bool(int(flags, 16) & 1)


class CountingEnviron(MutableMapping[str, str]):
    """The process environment, counting every read of an ``OTEL_`` variable."""

    def __init__(self, real: MutableMapping[str, str]) -> None:
        self.real = real
        self.reads: list[str] = []

    def _count(self, key: object) -> None:
        if isinstance(key, str) and key.startswith("OTEL_"):
            self.reads.append(key)

    def __getitem__(self, key: str) -> str:
        self._count(key)
        return self.real[key]

    def __contains__(self, key: object) -> bool:
        self._count(key)
        return key in self.real

    def __setitem__(self, key: str, value: str) -> None:
        self.real[key] = value

    def __delitem__(self, key: str) -> None:
        del self.real[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.real)

    def __len__(self) -> int:
        return len(self.real)

    def copy(self) -> dict[str, str]:
        return dict(self.real)


async def test_no_emit_and_no_request_reads_the_environment(
    installed: list[Otel], nc, connect, event, monkeypatch: pytest.MonkeyPatch
) -> None:
    w1, w2 = await two_workers(nc, connect, event)
    async with w1, w2, HookDispatcher(await connect()) as d:
        await d.emit(event, {})  # first use: decided once
        counting = CountingEnviron(os.environ)
        monkeypatch.setattr(os, "environ", counting)
        monkeypatch.setattr(metrics_internal, "environ", counting)
        for _ in range(20):
            assert (await d.emit(event, {})).action == "deny"
        off_reads = list(counting.reads)
        o = install(installed)  # (the SDK reads its OTEL_* settings as it is made)
        await d.emit(event, {})  # a provider set now is still honoured
        counting.reads.clear()
        for _ in range(4):
            await d.emit(event, {})
    assert off_reads == []
    assert counting.reads == []
    assert len([s for s in o.spans() if s.name == f"emit {event}"]) == 5
    assert len([s for s in o.spans() if s.name.startswith("process ")]) == 10


async def test_providers_are_followed_as_the_application_changes_them(
    installed: list[Otel], nc, connect, event
) -> None:
    w1, w2 = await two_workers(nc, connect, event)
    spy = await connect()
    seen = await wire_headers(spy, handler_subject(event, "first"))
    async with w1, w2, HookDispatcher(await connect()) as d:
        await d.emit(event, {})  # off
        first = install(installed)
        await d.emit(event, {})  # on: the dispatcher and the worker use it
        reset_globals()
        await d.emit(event, {})  # off again
        second = install(installed)
        await d.emit(event, {})  # on: the new one
        await spy.flush()
    assert [h is not None and "traceparent" in h for h in seen] == [False, True, False, True]
    for o in (first, second):
        names = sorted(s.name for s in o.spans())
        assert names == sorted(
            [f"emit {event}"]
            + [f"{op} {event} {h}" for op in ("send", "process") for h in ("first", "second")]
        ), names


async def test_an_unsampled_emit_records_nothing_and_sends_flags_00(
    installed: list[Otel], nc, connect, event
) -> None:
    sampler = RecordingSampler(ParentBased(ALWAYS_OFF))
    o = install(installed, sampler=sampler)
    w1, w2 = await two_workers(nc, connect, event)
    spy = await connect()
    first = await wire_headers(spy, handler_subject(event, "first"))
    second = await wire_headers(spy, handler_subject(event, "second"))
    async with w1, w2, HookDispatcher(await connect()) as d:
        result = await d.emit(event, {"tool_name": "bash"})
        await spy.flush()
    assert result.action == "deny" and result.reason == "no"
    assert o.spans() == []

    # one W3C context for the whole emit, flags 00: its calls made no spans of their own
    (h1,), (h2,) = first, second
    assert h1 == h2
    trace_id, _, sampled = traceparent(h1)
    assert not sampled and int(trace_id, 16) != 0
    mine = [asked for asked in sampler.asked if event in asked[0]]
    assert [name for name, _, _ in mine] == [
        f"emit {event}",
        f"process {event} first",
        f"process {event} second",
    ]
    assert all(attrs == {} and not sampled for _, attrs, sampled in mine)


async def test_an_unsampled_caller_is_honoured_and_passed_on(
    installed: list[Otel], nc, connect, event
) -> None:
    o = install(installed)  # the default sampler: parent-based, always on
    w1, w2 = await two_workers(nc, connect, event)
    spy = await connect()
    seen = await wire_headers(spy, handler_subject(event, "first"))
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller = {"traceparent": f"00-{caller_trace}-00f067aa0ba902b7-00"}

    service_nc = await connect()
    service = DispatcherService(HookDispatcher(service_nc), service_nc)
    async with w1, w2, HookDispatcher(await connect()) as d:
        # embedded: the emit runs in the caller's unsampled context
        token = otel_context.attach(propagate.extract(caller))
        try:
            embedded = await d.emit(event, {})
        finally:
            otel_context.detach(token)
        # service mode: the caller's traceparent comes with the request
        await service.start()
        try:
            reply = await emit_requested(spy, emit_service_subject(event), {}, caller)
        finally:
            await service.stop()
        await spy.flush()
    assert embedded.action == "deny"
    assert reply.result is not None and reply.result.action == "deny"
    assert [s.name for s in o.spans()] == []
    assert len(seen) == 2
    for headers in seen:  # the caller's trace and decision, passed on
        trace_id, _, sampled = traceparent(headers)
        assert (trace_id, sampled) == (caller_trace, False)


async def test_every_span_of_an_emit_has_ended_when_it_returns(
    installed: list[Otel], nc, connect, event
) -> None:
    o = install(installed)
    w1, w2 = await two_workers(nc, connect, event)
    async with w1, w2, HookDispatcher(await connect()) as d:
        started = time.time_ns()
        await d.emit(event, {"tool_name": "bash"})
        names = sorted(s.name for s in o.spans())  # no await since the emit returned
        returned = time.time_ns()
    assert names == sorted(
        [f"emit {event}"]
        + [f"{op} {event} {h}" for op in ("send", "process") for h in ("first", "second")]
    ), names
    emit = o.emit_span(event)
    assert started <= emit.start_time and emit.end_time is not None
    assert emit.end_time <= returned
    for span in o.spans():
        assert emit.start_time <= span.start_time <= span.end_time <= emit.end_time, span.name
