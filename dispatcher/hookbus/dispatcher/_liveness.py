"""Liveness of the handlers: which worker processes serve them now.

Every worker process runs a service of the NATS services API (``nats.micro``, ADR-32)
named `WORKER_SERVICE_NAME` whose ``handlers`` metadata lists the handler keys it serves.
One ``$SRV.PING.hookbus-worker`` scatter, answered by every live worker, gives the live
replicas of every handler. Emits never wait on this: it is for operators
(`hookbus handlers`) and tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus._core.jetstream import jetstream_context
from hookbus._core.kv import kv_retry
from hookbus.schemas import (
    HANDLERS_BUCKET,
    WORKER_SERVICE_NAME,
    HandlerDeclaration,
    NotConnectedError,
    RequiredHandler,
    parse_served_handlers,
)

from ._registry_watch import RegistryRead, read_registry

__all__ = ["HandlerStatus", "LiveReplica", "RegistryView", "describe_handlers", "live_handlers"]


@dataclass(frozen=True)
class LiveReplica:
    """One live worker process serving a handler, as the NATS services API reports it."""

    service_id: str
    """The `nats.micro` service instance id (one per worker process)."""
    seen_at: float
    """When it answered, seconds since the Unix epoch."""
    metadata: dict[str, str] = field(default_factory=dict)


async def srv_scatter(nc: NATS, subject: str, timeout_s: float) -> list[bytes]:
    """The bodies of every answer to one NATS services API request on `subject` (e.g.
    ``$SRV.PING.<name>``), gathered for `timeout_s` seconds: a scatter has no last answer,
    so the wait is the whole of it."""
    answers: list[bytes] = []
    inbox = nc.new_inbox()
    done = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        if not done.is_set():
            answers.append(msg.data)

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, b"", reply=inbox)
        await nc.flush()
        await asyncio.sleep(timeout_s)
    finally:
        done.set()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return answers


async def live_handlers(
    nc: NATS, *, timeout_s: float = 0.5
) -> dict[tuple[str, str], list[LiveReplica]]:
    """Which handlers have live replicas now: a ``$SRV.PING.hookbus-worker`` scatter,
    answers gathered for `timeout_s` seconds (the NATS services API, ADR-32).

    Returns:
        ``{(event, handler): [LiveReplica, ...]}``; a declared handler absent from it has
        no live replica (or its workers did not answer within `timeout_s`).
    Raises:
        NotConnectedError: the connection is closed.
    """
    if nc.is_closed:
        raise NotConnectedError("live_handlers needs an open NATS connection")

    found: dict[tuple[str, str], list[LiveReplica]] = {}
    seen: set[str] = set()
    for data in await srv_scatter(nc, f"$SRV.PING.{WORKER_SERVICE_NAME}", timeout_s):
        try:
            body = json.loads(data)
            service_id = str(body["id"])
            metadata = body.get("metadata") or {}
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
        if service_id in seen or not isinstance(metadata, dict):
            continue
        seen.add(service_id)
        meta = {str(k): str(v)[:200] for k, v in metadata.items() if k != "handlers"}
        replica = LiveReplica(service_id=service_id, seen_at=time.time(), metadata=meta)
        for pair in parse_served_handlers(metadata.get("handlers")):
            found.setdefault(pair, []).append(replica)
    return found


@dataclass(frozen=True)
class HandlerStatus:
    """One handler as the registry and the live workers show it."""

    event: str
    name: str
    declaration: HandlerDeclaration | None
    """Its validated declaration; None for a required handler never declared."""
    required: RequiredHandler | None
    """The operator's requirement for it, if any."""
    replicas: list[LiveReplica]
    """Live worker processes serving it (empty: calls get ``no_responders``)."""

    @property
    def last_seen(self) -> float | None:
        """When a replica last answered (seconds since the epoch); None: none answered."""
        return max((r.seen_at for r in self.replicas), default=None)


@dataclass
class RegistryView:
    """`describe_handlers`'s answer."""

    handlers: list[HandlerStatus]
    """By event, then call order (priority, name)."""
    rejected: dict[str, str]
    """Records refused by validation (key: reason): reported, never routed."""
    live_only: list[tuple[str, str]]
    """Handlers served by a live worker but with no declaration (yet)."""


async def describe_handlers(
    nc: NATS, *, ping_timeout_s: float = 0.5, deadline_s: float = 10.0
) -> RegistryView:
    """Every declared or required handler with its live replicas (a complete read of the
    registry, retried through a leader election within `deadline_s` seconds, and one
    liveness scatter of `ping_timeout_s` seconds).

    Raises:
        HookbusTimeoutError: the registry could not be read within `deadline_s` seconds.
        NotConnectedError: the connection is closed.
    """
    js = jetstream_context(nc)

    async def read() -> RegistryRead:
        try:
            kv = await js.key_value(HANDLERS_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            return RegistryRead(complete=True)
        got = await read_registry(kv)
        if not got.complete:
            raise TimeoutError("the registry read did not complete")
        return got

    got, live = await asyncio.gather(
        kv_retry(read, deadline_s=deadline_s, what="reading the handler registry"),
        live_handlers(nc, timeout_s=ping_timeout_s),
    )
    decls, required, rejected = got.declarations, got.required, got.rejected
    by_pair: dict[tuple[str, str], tuple[HandlerDeclaration | None, RequiredHandler | None]] = {}
    for decl in decls.values():
        by_pair[(decl.event, decl.name)] = (decl, None)
    for req in required.values():
        pair = (req.event, req.name)
        by_pair[pair] = (by_pair.get(pair, (None, None))[0], req)

    def order(pair: tuple[str, str]) -> tuple[str, int, str]:
        decl, req = by_pair[pair]
        priority = decl.priority if decl else req.priority if req else 0
        return (pair[0], priority, pair[1])

    handlers = [
        HandlerStatus(event, name, *by_pair[(event, name)], replicas=live.get((event, name), []))
        for event, name in sorted(by_pair, key=order)
    ]
    live_only = sorted(pair for pair in live if pair not in by_pair)
    return RegistryView(handlers=handlers, rejected=rejected, live_only=live_only)
