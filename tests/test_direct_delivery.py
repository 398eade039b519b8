"""A direct subscription's messages are handed over in the connection's read loop, in the
order they were read, with nothing lost around a delivery that fails or bytes that do not
decode; a connection not hardened delivers them through the subscription's callback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import urlparse

import pytest
from conftest import connections
from nats.aio.msg import Msg

from hookbus._core.direct_delivery import direct_table, subscribe_direct, unsubscribe_direct
from hookbus._core.nats_guard import harden_connection
from hookbus._core.serving import Endpoint, Refusal, ServingLoop

pytestmark = pytest.mark.anyio

N = 300


class Seen:
    """What a direct subscription's `deliver` was given, and in which task."""

    def __init__(self, nc: Any, *, fail_on: bytes | None = None) -> None:
        self.nc = nc
        self.fail_on = fail_on
        self.msgs: list[Msg] = []
        self.tasks: set[asyncio.Task[Any] | None] = set()
        self.done = asyncio.Event()
        self.expected = N

    def __call__(self, msg: Msg) -> None:
        self.tasks.add(asyncio.current_task())
        if msg.data == self.fail_on:
            raise RuntimeError("a delivery that fails")
        self.msgs.append(msg)
        if len(self.msgs) >= self.expected:
            self.done.set()


async def _publish_all(pub: Any, subject: str) -> None:
    for i in range(N):
        headers = {"n": str(i)} if i % 3 == 0 else None
        await pub.publish(f"{subject}.{i}", str(i).encode(), headers=headers)
    await pub.flush()


async def test_messages_are_handed_over_in_the_read_loop_in_order(nats_url: str) -> None:
    async with connections(nats_url) as connect:
        nc, pub = await connect(), await connect()
        harden_connection(nc)
        seen = Seen(nc)
        sub = await subscribe_direct(nc, "direct.order.*", seen)
        await nc.flush()
        before = nc.stats["in_msgs"]
        await _publish_all(pub, "direct.order")
        await asyncio.wait_for(seen.done.wait(), 10)
        # no task of the subscription's: the client's read loop called `deliver` itself
        assert seen.tasks == {nc._reading_task}
        assert [m.data for m in seen.msgs] == [str(i).encode() for i in range(N)]
        assert [m.subject for m in seen.msgs] == [f"direct.order.{i}" for i in range(N)]
        assert all(
            (m.headers or {}).get("n") == (str(i) if i % 3 == 0 else None)
            for i, m in enumerate(seen.msgs)
        )
        assert nc.stats["in_msgs"] - before == N  # nats-py's counters kept
        assert sub.pending_msgs == 0  # nothing went through the subscription's queue
        await unsubscribe_direct(nc, sub)
        await nc.flush()
        await pub.publish("direct.order.late", b"late")
        await pub.flush()
        await nc.flush()
        assert len(seen.msgs) == N  # unsubscribed: nothing more


async def test_a_delivery_that_raises_drops_its_message_and_nothing_else(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with connections(nats_url) as connect:
        nc, pub = await connect(), await connect()
        harden_connection(nc)
        seen = Seen(nc, fail_on=b"7")
        seen.expected = N - 1
        await subscribe_direct(nc, "direct.fail.*", seen)
        await nc.flush()
        await _publish_all(pub, "direct.fail")
        await asyncio.wait_for(seen.done.wait(), 10)
        assert [m.data for m in seen.msgs] == [str(i).encode() for i in range(N) if i != 7]
        assert "its delivery failed" in caplog.text
        # the read loop goes on: the connection still answers
        await nc.flush(timeout=5)
        assert nc.is_connected


async def test_an_undecodable_status_line_reaches_a_direct_subscription_replaced(
    nats_url: str,
) -> None:
    """A message whose status line is not UTF-8 (anyone may send one) is delivered with the
    bad bytes replaced, in its place among the others, and the connection reads on."""
    async with connections(nats_url) as connect:
        nc = await connect()
        harden_connection(nc)
        seen = Seen(nc)
        seen.expected = 3
        await subscribe_direct(nc, "direct.bytes.*", seen)
        await nc.flush()
        u = urlparse(nats_url)
        reader, writer = await asyncio.open_connection(u.hostname or "127.0.0.1", u.port or 4222)
        try:
            await reader.readline()  # INFO
            head = b"NATS/1.0 503 \xff\xfe\r\n\r\n"
            writer.write(
                b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'
                b"PUB direct.bytes.0 1\r\na\r\n"
                + b"HPUB direct.bytes.1 %d %d\r\n%sb\r\n" % (len(head), len(head) + 1, head)
                + b"PUB direct.bytes.2 1\r\nc\r\nPING\r\n"
            )
            await writer.drain()
            while (await reader.readline()).strip() != b"PONG":
                pass
            await asyncio.wait_for(seen.done.wait(), 10)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        assert [m.data for m in seen.msgs] == [b"a", b"b", b"c"]
        assert seen.msgs[1].headers is not None
        assert seen.msgs[1].headers.get("Status") == "503"
        assert seen.tasks == {nc._reading_task}


async def test_a_connection_not_hardened_delivers_through_the_callback(nats_url: str) -> None:
    async with connections(nats_url) as connect:
        nc, pub = await connect(), await connect()
        seen = Seen(nc)
        await subscribe_direct(nc, "direct.plain.*", seen)
        await nc.flush()
        await _publish_all(pub, "direct.plain")
        await asyncio.wait_for(seen.done.wait(), 10)
        assert [m.data for m in seen.msgs] == [str(i).encode() for i in range(N)]
        assert nc._reading_task not in seen.tasks  # the subscription's own task


async def test_a_request_taken_as_a_handler_ends_gets_its_slot(nats_url: str) -> None:
    """The read loop takes a request in the same turn of the event loop as a handler
    ending: the slot that handler gives back is the new request's, not a ``busy``."""
    async with connections(nats_url) as connect:
        nc, caller = await connect(), await connect()
        harden_connection(nc)
        loop = ServingLoop(nc, max_concurrency=1, log=logging.getLogger("test"))
        release, started = asyncio.Event(), asyncio.Event()
        served: list[bytes] = []
        refused: list[str] = []

        async def handler(msg: Msg, context: Any, received: int) -> None:
            if msg.data == b"first":
                started.set()
                await release.wait()
            served.append(msg.data)
            await nc.publish(msg.reply, b"served")

        async def refuse(msg: Msg, why: Refusal, received: int) -> None:
            refused.append(why)
            await nc.publish(msg.reply, why.encode())

        await loop.add(Endpoint("slots.test", handler, refuse))
        await nc.flush()
        first = asyncio.ensure_future(caller.request("slots.test", b"first", timeout=10))
        await asyncio.wait_for(started.wait(), 10)
        assert loop.in_flight == 1
        # what the read loop does when the next request is parsed in the turn the first
        # one's handler ends in: its `deliver`, called right after that handler is woken
        sub = loop._subs[0]
        deliver = direct_table(nc)[sub._id]
        inbox = caller.new_inbox()
        replies = await caller.subscribe(inbox, max_msgs=1)
        await caller.flush()
        release.set()
        deliver(Msg(nc, subject="slots.test", reply=inbox, data=b"second"))
        assert (await first).data == b"served"
        assert (await replies.next_msg(timeout=10)).data == b"served"
        assert served == [b"first", b"second"] and refused == []
        await loop.stop_intake(5)
