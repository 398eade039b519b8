"""A sentinel hook event: how a test watching the hook events knows it has seen every event
sent before it (NATS keeps one publisher's order, and a flush puts what a connection sent on
the server)."""

from __future__ import annotations

import uuid

from nats.aio.client import Client as NATS

from hookbus.schemas import HookEvent, HookPart, encode, suspension_event_subject

__all__ = ["send_sentinel"]


async def send_sentinel(nc: NATS, *conns: NATS) -> str:
    """Flush each of `conns`, then publish on `nc` a pending hook event of a fresh label;
    once a watcher sees it, it has seen what `conns` sent before. The label."""
    for conn in conns:
        await conn.flush()
    sentinel = f"sentinel {uuid.uuid4().hex}"
    await nc.publish(
        suspension_event_subject(sentinel, "pending"),
        encode(HookEvent(hook=HookPart(hook_id="-", label=sentinel, status="pending"))),
    )
    return sentinel
