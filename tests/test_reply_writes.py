"""A worker's reply is written to the socket at once, in the order it was sent.

`reply_now` writes a reply without nats-py's queue when nothing is queued before it, and
declines (doing nothing) whenever nats-py's own ``publish`` must decide: then the caller
publishes and `send_now` writes the queue in order.
"""

from __future__ import annotations

import asyncio
import uuid

import nats.errors
import pytest
from conftest import Connect
from nats.aio.client import Client as NATS

from hookbus._core.nats_guard import reply_now, send_now

pytestmark = pytest.mark.anyio


async def _listen(nc: NATS, subject: str) -> asyncio.Queue[bytes]:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_message(msg: object) -> None:
        got.put_nowait(msg.data)  # type: ignore[attr-defined]

    await nc.subscribe(subject, cb=on_message)
    await nc.flush()
    return got


async def test_a_reply_goes_out_at_once_and_after_what_was_queued_before_it(
    connect: Connect,
) -> None:
    subject = f"reply-writes.{uuid.uuid4().hex}"
    got = await _listen(await connect(), subject)
    nc = await connect()
    published = nc.stats["out_msgs"]
    assert reply_now(nc, subject, b"first")  # nothing queued: written now
    assert nc._pending == []
    await nc.publish(subject, b"queued")  # waits for nats-py's flusher
    assert not reply_now(nc, subject, b"behind it")  # would overtake it: declined
    send_now(nc)  # what the worker does then, after its own publish
    assert reply_now(nc, subject, b"last")
    assert nc.stats["out_msgs"] == published + 3
    received = [await asyncio.wait_for(got.get(), 5) for _ in range(3)]
    assert received == [b"first", b"queued", b"last"]


async def test_what_publish_refuses_is_left_to_publish(connect: Connect) -> None:
    nc = await connect()
    assert not reply_now(nc, "a bad subject", b"x")
    with pytest.raises(nats.errors.BadSubjectError):
        await nc.publish("a bad subject", b"x")
    assert not reply_now(nc, "", b"x")
    assert not reply_now(nc, "too.large", b"x" * (nc.max_payload + 1))
    with pytest.raises(nats.errors.MaxPayloadError):
        await nc.publish("too.large", b"x" * (nc.max_payload + 1))
    await nc.close()
    assert not reply_now(nc, "closed", b"x")
    with pytest.raises(nats.errors.ConnectionClosedError):
        await nc.publish("closed", b"x")
