"""The dispatcher service on the NATS services API (``nats.micro``, ADR-32).

Every `DispatcherService` runs a service named `DISPATCHER_SERVICE_NAME`: it answers
``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` (all services, every
``hookbus-dispatcher``, or one instance by id), so ``nats micro ls`` / ``nats micro info
hookbus-dispatcher`` / ``nats micro stats hookbus-dispatcher`` list its replicas, their
two endpoints (``emit`` on ``hookbus.v1.emit.*.*`` and ``emit_and_collect`` on
``hookbus.v1.emit_and_collect.*.*``: the agent and the event are the last two tokens, in
queue group ``hookbus-dispatcher``) and per endpoint the requests received, the error
replies and the processing time. Source of the message shapes: the NATS services API
(ADR-32), ``io.nats.micro.v1.{ping,info,stats}_response``.

Why the endpoints are the service's own subscriptions rather than ``nats.micro``
endpoints: a ``nats.micro`` endpoint runs its handler inside the subscription's callback
(one request at a time, unless the handler only spawns a task, and then its processing
time is the spawn's) and stops with an unsubscribe that drops requests already delivered.
The service needs a task per request, a concurrency bound that answers ``busy`` at once
and a drain that answers every request received; so it keeps its subscriptions and
`EndpointCounters` count what each one did, and this module's `nats.micro` service reports
them (its `info` and `stats` list them as endpoints).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.micro.service import Service, ServiceConfig, ServiceInfo, ServiceStats

from hookbus._core.serving import EndpointCounters
from hookbus.schemas import DISPATCHER_SERVICE_NAME, NotConnectedError

from ._liveness import srv_scatter

__all__ = [
    "DispatcherEndpoint",
    "DispatcherReplica",
    "EndpointCounters",
    "ServicesAPI",
    "live_dispatchers",
]

log = logging.getLogger("hookbus.dispatcher")


class ServicesAPI(Service):
    """The ``nats.micro`` service of one `DispatcherService`: `nats.micro` answers the
    ``$SRV`` verbs; its endpoints are the `EndpointCounters` given.

    Args:
        nc: the service's connection.
        endpoints: the endpoints to report, in order.
        metadata: the service's metadata (``$SRV.PING`` / ``INFO`` / ``STATS``).
        endpoint_data: called for each endpoint's ``data`` in ``$SRV.STATS`` (e.g. the
            requests in flight); None for none.
    """

    def __init__(
        self,
        nc: NATS,
        endpoints: list[EndpointCounters],
        *,
        metadata: dict[str, str] | None = None,
        endpoint_data: Callable[[EndpointCounters], dict[str, Any]] | None = None,
    ) -> None:
        config = ServiceConfig(
            name=DISPATCHER_SERVICE_NAME,
            version=_version(),
            description="hookbus dispatcher service: emit and emit_and_collect for any agent",
            metadata=dict(metadata or {}),
            queue_group=DISPATCHER_SERVICE_NAME,
        )
        super().__init__(nc, config)
        self.counters = endpoints
        self._endpoint_data = endpoint_data

    def info(self) -> ServiceInfo:
        info = super().info()
        info.endpoints = [c.info() for c in self.counters]
        return info

    def stats(self) -> ServiceStats:
        stats = super().stats()
        data = self._endpoint_data
        stats.endpoints = [c.stats(data(c) if data else None) for c in self.counters]
        return stats

    async def close(self) -> None:
        """Stop answering the ``$SRV`` verbs (idempotent; a lost connection is ignored)."""
        with contextlib.suppress(Exception):
            await self.stop()


def _version() -> str:
    """hookbus's version (a semantic version, as the services API requires)."""
    try:
        return importlib.metadata.version("hookbus")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


# -- reading it -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DispatcherEndpoint:
    """One endpoint of a live dispatcher service, as its ``$SRV.STATS`` answer says."""

    name: str
    subject: str
    queue_group: str
    requests: int
    """Requests received since the replica started."""
    errors: int
    """Requests answered with an error (``busy``, ``unavailable``, ``bad_request``...)."""
    average_ms: float
    """Mean milliseconds from receipt to reply over the requests answered."""
    last_error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    """The endpoint's extra figures (``in_flight``: requests being served now)."""


@dataclass(frozen=True)
class DispatcherReplica:
    """One live `DispatcherService` process, as the NATS services API reports it."""

    service_id: str
    """Its ``nats.micro`` instance id (``$SRV.INFO.hookbus-dispatcher.<id>`` reaches it)."""
    version: str
    started: str
    """When it started, as it says (RFC 3339 UTC)."""
    seen_at: float
    """When it answered, seconds since the Unix epoch."""
    endpoints: list[DispatcherEndpoint] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)


async def live_dispatchers(nc: NATS, *, timeout_s: float = 0.5) -> list[DispatcherReplica]:
    """The live dispatcher services: one ``$SRV.STATS.hookbus-dispatcher`` scatter,
    answers gathered for `timeout_s` seconds (the NATS services API, ADR-32). An answer
    that does not parse is skipped.

    Returns:
        One `DispatcherReplica` per instance that answered, by service id.
    Raises:
        NotConnectedError: the connection is closed.
    """
    if nc.is_closed:
        raise NotConnectedError("live_dispatchers needs an open NATS connection")
    found: dict[str, DispatcherReplica] = {}
    for data in await srv_scatter(nc, f"$SRV.STATS.{DISPATCHER_SERVICE_NAME}", timeout_s):
        replica = _parse_stats(data)
        if replica is not None:
            found.setdefault(replica.service_id, replica)
    return [found[k] for k in sorted(found)]


def _parse_stats(data: bytes) -> DispatcherReplica | None:
    """A ``$SRV.STATS`` answer of a dispatcher service; None if it is not one."""
    try:
        body = json.loads(data)
        if body.get("name") != DISPATCHER_SERVICE_NAME:
            return None
        endpoints = [
            DispatcherEndpoint(
                name=str(e["name"]),
                subject=str(e["subject"]),
                queue_group=str(e.get("queue_group") or ""),
                requests=int(e.get("num_requests") or 0),
                errors=int(e.get("num_errors") or 0),
                average_ms=int(e.get("average_processing_time") or 0) / 1e6,
                last_error=str(e["last_error"]) if e.get("last_error") else None,
                data=dict(e.get("data") or {}),
            )
            for e in body.get("endpoints") or []
        ]
        metadata = body.get("metadata") or {}
        return DispatcherReplica(
            service_id=str(body["id"]),
            version=str(body.get("version") or ""),
            started=str(body.get("started") or ""),
            seen_at=time.time(),
            endpoints=endpoints,
            metadata={str(k): str(v)[:200] for k, v in metadata.items()},
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
