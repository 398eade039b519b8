"""Subscriptions whose messages are handed over in the connection's read loop, not by a task.

nats-py gives a subscription with a callback a queue and a task of its own: a message read
from the socket is put on the queue, the task wakes on a later turn of the event loop and
only then calls the callback. For a reply inbox whose callback only files the reply where
its caller waits (the dispatcher's `Requester`), or a request whose callback only starts
the request's own task (`hookbus._core.serving`), that is a queue put, a task step and a
coroutine per message, and a turn of the loop before the caller is woken or the request
started.

A direct subscription (`subscribe_direct`) has its ``deliver(msg)`` called by the read loop
as the message is parsed, on connections `harden_connection` was given
(`hookbus._core.nats_guard`, whose entry point looks the subscription up here): the
messages of the connection reach it in the order they were read, none is queued, and
nats-py's pending limits (slow consumer) do not apply to it. ``deliver`` must therefore be
quick and must not wait: it runs before the connection's next message is read. An exception
it raises is logged and its message dropped; the read loop goes on. On a connection not
hardened (a client without nats-py's private entry point), the subscription's own callback
calls ``deliver`` as any subscription would.

Measured: ``docs/performance.md``, "A message handed over in the read loop".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

__all__ = [
    "Deliver",
    "deliver_now",
    "direct_table",
    "forget_direct",
    "subscribe_direct",
    "unsubscribe_direct",
]

log = logging.getLogger("hookbus")

Deliver = Callable[[Msg], None]
"""``deliver(msg)``: take one message; quick, never waiting (see the module docstring)."""

_TABLE = "_hookbus_direct"


def direct_table(nc: Any) -> dict[int, Deliver]:
    """The direct subscriptions of `nc` (a nats-py client), by subscription id: the table
    the hardened entry point reads (made empty on first use)."""
    table: dict[int, Deliver] | None = getattr(nc, _TABLE, None)
    if table is None:
        table = {}
        setattr(nc, _TABLE, table)
    return table


async def subscribe_direct(
    nc: Any, subject: str, deliver: Deliver, *, queue: str = ""
) -> Subscription:
    """Subscribe `subject` on `nc` (in queue group `queue`; "" for none) with `deliver`
    called in the read loop (see the module docstring); not flushed.

    Raises:
        nats.errors.Error: nats-py's subscribe failed (closed, draining, a bad subject).
    """

    async def callback(msg: Msg) -> None:  # a connection whose entry point is not ours
        deliver(msg)

    sub: Subscription = await nc.subscribe(subject, queue=queue, cb=callback)
    sid = getattr(sub, "_id", None)
    if sid is not None:  # not nats-py's subscription (a test kit's): its callback delivers
        direct_table(nc)[sid] = deliver
    return sub


async def unsubscribe_direct(nc: Any, sub: Subscription) -> None:
    """Unsubscribe `sub` (made by `subscribe_direct` on `nc`).

    Raises:
        nats.errors.Error: nats-py's unsubscribe failed (e.g. the connection is closed).
    """
    forget_direct(nc, sub)
    await sub.unsubscribe()


def forget_direct(nc: Any, sub: Subscription) -> None:
    """Drop `sub` from `nc`'s direct subscriptions (it was unsubscribed or drained)."""
    direct_table(nc).pop(getattr(sub, "_id", None), None)


async def deliver_now(
    nc: Any, deliver: Deliver, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
) -> None:
    """Hand one message of direct subscription `sid` to `deliver`: what nats-py's
    ``_process_msg`` does for a subscription, its queue and task left out (the client's
    counters kept). `subject`, `reply` and `headers` as the parser gives them, already
    safe to decode."""
    sub = nc._subs.get(sid)
    if sub is None:  # unsubscribed meanwhile: nats-py drops it too
        return
    stats = nc.stats
    stats["in_msgs"] += 1
    stats["in_bytes"] += len(data)
    sub._received += 1
    hdr = await nc._process_headers(headers) if headers else None
    try:
        deliver(nc._build_message(sid, subject, reply, data, hdr))
    except Exception:  # never let one message end the read loop
        log.exception("a message to %s was dropped: its delivery failed", sub.subject)
