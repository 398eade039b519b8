"""Two nats-py (2.16) client defects, repaired on each connection hookbus is given.

**A hostile message must not silence a connection for good.** nats-py decodes a message's
subject, reply subject and status-line description with strict UTF-8 inside its read loop;
a `UnicodeDecodeError` there ends the loop, logged once, and the connection stays
"connected" while reading nothing more: every later request of that process times out (a
fail-closed handler then denies everything). Any client can send such bytes, as a reply to
a dispatcher's request or as a request to a worker.

**A flush must follow what was sent before it.** nats-py queues ``SUB``/``PUB`` for its
flusher task but writes a flush's ``PING`` straight to the socket, so the ``PING`` can
reach the server first, and the ``PONG`` that ends `flush()` then says nothing about the
subscriptions made just before: a request from another connection in that moment is
answered "no responders", and a message published to the new subscription is lost
(``docs/decisions-under-faults.md``).

`harden_connection` repairs both on one client: it wraps the message entry point so such
bytes are replaced (by "?"; nats-py already replaces bad bytes in header values) instead,
and makes a ``PING`` (of `flush`, `rtt` and the keep-alive) write the queued commands out
before itself. No I/O here: it only wraps methods of the object it is given.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["harden_connection", "order_flushes"]

log = logging.getLogger("hookbus")

_MARK = "_hookbus_hardened"


def _safe(raw: Any) -> Any:
    if not raw:
        return raw
    return bytes(raw).decode("utf-8", "replace").encode("ascii", "replace")


def harden_connection(nc: Any) -> None:
    """Make `nc` (a nats-py client) survive invalid UTF-8 in subjects and status lines, and
    make its flushes ordered after the commands sent before them (idempotent; a client
    without the expected private entry points is left as it is)."""
    order_flushes(nc)
    _safe_decoding(nc)


def order_flushes(nc: Any) -> None:
    """Make `nc` (a nats-py client) write the commands queued for its flusher task before
    each ``PING``, so a flush returns only once the server has everything sent before it
    (idempotent; a client without the expected private entry points is left as it is).

    The flusher takes and clears the whole queue in one step, so writing the rest here keeps
    the byte order the commands were queued in; nats-py does the same when its flusher is
    gone. Not connected (reconnecting): left to nats-py, which writes the queue out once
    reconnected.
    """
    original = getattr(nc, "_send_ping", None)
    if original is None or getattr(original, _MARK, False) or not hasattr(nc, "_pending"):
        return

    async def send_ping(future: Any = None) -> None:
        transport = nc._transport
        if nc._pending and transport is not None and nc.is_connected:
            transport.writelines(nc._pending[:])
            nc._pending = []
            nc._pending_data_size = 0
        await original(future)

    setattr(send_ping, _MARK, True)
    nc._send_ping = send_ping


def _safe_decoding(nc: Any) -> None:
    original = getattr(nc, "_process_msg", None)
    if original is None or getattr(original, _MARK, False):
        return

    seen = 0

    async def process_msg(sid: int, subject: Any, reply: Any, data: Any, headers: Any) -> Any:
        nonlocal seen
        try:
            return await original(sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            seen += 1
            if seen <= 5 or seen % 1000 == 0:  # a flood must not flood the log
                log.warning("%d message(s) with invalid UTF-8 in a subject or status line", seen)
        try:
            return await original(sid, _safe(subject), _safe(reply), data, _safe(headers))
        except UnicodeDecodeError:  # pragma: no cover - nothing left to decode strictly
            log.warning("a message that nats-py cannot parse was dropped")
            return None

    setattr(process_msg, _MARK, True)
    nc._process_msg = process_msg
