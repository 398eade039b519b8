"""Keep one hostile message from silencing a nats-py connection for good.

nats-py (2.16) decodes a message's subject, reply subject and status-line description with
strict UTF-8 inside its read loop; a `UnicodeDecodeError` there ends the loop, logged once,
and the connection stays "connected" while reading nothing more: every later request of
that process times out (a fail-closed handler then denies everything). Any client can send
such bytes, as a reply to a dispatcher's request or as a request to a worker.

`harden_connection` wraps the message entry point of one client so such bytes are replaced
(by "?"; nats-py already replaces bad bytes in header values) instead. No I/O here: it only wraps a
method of the object it is given.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["harden_connection"]

log = logging.getLogger("hookbus")

_MARK = "_hookbus_hardened"


def _safe(raw: Any) -> Any:
    if not raw:
        return raw
    return bytes(raw).decode("utf-8", "replace").encode("ascii", "replace")


def harden_connection(nc: Any) -> None:
    """Make `nc` (a nats-py client) survive invalid UTF-8 in subjects and status lines
    (idempotent; a client without the expected entry point is left as it is)."""
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
