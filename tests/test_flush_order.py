"""A flush means "the server has everything sent before it", on every connection hookbus uses.

nats-py (2.16) writes a flush's PING straight to the socket while the commands queued
before it (``SUB``, ``PUB``) wait for its flusher task, so the PING can reach the server
first: the flush returns before the server has the subscription, and a request from another
connection in that moment is answered "no responders" (or a published event is lost). A
proxy holds the ``SUB`` back, as a server slow to read one connection does, to show it
every time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from _proxy import NatsProxy
from conftest import Connect, connections
from nats.aio.client import Client as NATS

from hookbus._core.nats_guard import harden_connection
from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.integrations.console import Feed
from hookbus.schemas import (
    DecisionRecord,
    EmitReply,
    HookEvent,
    HookPart,
    decisions_subject,
    decode,
    emit_service_subject,
    encode,
    suspension_event_subject,
)

pytestmark = pytest.mark.anyio

LATE_S = 0.5
"""Seconds the proxy holds a subscription back."""


@pytest.fixture
async def proxy(nats_url: str) -> AsyncIterator[NatsProxy]:
    async with NatsProxy(nats_url.split(",")[0]) as p:
        yield p


@pytest.fixture
async def proxied(proxy: NatsProxy) -> AsyncIterator[Connect]:
    """Connections through the proxy as nats-py makes them (flushes not ordered), closed
    at the end: what hookbus does with them is under test."""
    async with connections(proxy.url, ordered=False) as make:
        yield make


async def test_a_hardened_connections_flush_follows_its_subscriptions_on_the_wire(
    proxy: NatsProxy, proxied: Connect
) -> None:
    nc = await proxied()
    harden_connection(nc)
    subject = f"order.{uuid.uuid4().hex}"
    await nc.subscribe(subject)
    await nc.flush()
    ops = [op.split()[:2] for op in proxy.client_ops]  # [op, first argument]
    sub_at = ops.index([b"SUB", subject.encode()])
    assert [b"PING"] in ops[sub_at:], f"the flush's PING went before the SUB: {ops}"


async def test_a_dispatcher_service_serves_the_first_request_after_start(
    proxy: NatsProxy, proxied: Connect, nc: NATS, event: str
) -> None:
    service_nc = await proxied()
    d = HookDispatcher(service_nc)
    service = DispatcherService(d, service_nc)
    proxy.hold_next_client_op(b"SUB hookbus.v1.emit.", LATE_S)
    await service.start()
    try:
        msg = await nc.request(emit_service_subject(event, "agent-1"), b"{}", timeout=5)
        reply = decode(msg.data, EmitReply)
        assert reply.error is None and reply.result is not None
        assert reply.result.action == "continue"
    except nats.errors.NoRespondersError:
        pytest.fail("start returned before the server had the service's subscriptions")
    finally:
        await service.stop(grace_s=1)


async def test_a_suspension_event_stream_hears_an_event_sent_right_after_it_opens(
    proxy: NatsProxy, proxied: Connect, nc: NATS
) -> None:
    approver = HookDispatcher(await proxied(), approvals=False)
    await approver.start()
    try:
        proxy.hold_next_client_op(b"SUB hookbus.v1.suspension.", LATE_S)
        stream = await approver.hook_events()
        label = f"first {uuid.uuid4().hex}"
        await nc.publish(
            suspension_event_subject(label, "pending"),
            encode(HookEvent(hook=HookPart(hook_id="-", label=label, status="pending"))),
        )
        try:
            got = await asyncio.wait_for(stream.__anext__(), LATE_S * 6)
        except TimeoutError:
            pytest.fail("the event sent right after hook_events() returned was lost")
        assert got.hook.label == label
        await stream.aclose()
    finally:
        await approver.close()


async def test_the_consoles_feed_hears_a_decision_recorded_right_after_it_starts(
    proxy: NatsProxy, proxied: Connect, nc: NATS
) -> None:
    async with HookDispatcher(nc, audit=True):  # creates the buckets the feed watches
        feed = Feed(await proxied())
        listener = feed.listen()
        proxy.hold_next_client_op(b"SUB hookbus.v1.decisions.", LATE_S)
        await feed.start()
        try:
            emit_id = uuid.uuid4().hex
            record = DecisionRecord(
                id=uuid.uuid4().hex, event="tool:pre", action="deny", time=0.0,
                time_iso="1970-01-01T00:00:00+00:00", emit_id=emit_id, handlers=["guard"],
            )  # fmt: skip
            await nc.publish(decisions_subject("agent-1"), encode(record))
            while (got := await listener.get(LATE_S * 6)) is not None:
                if got[0] == "decision" and emit_id in str(got[1]):
                    break
            else:
                pytest.fail("the decision recorded right after the feed started was lost")
        finally:
            await feed.close()
