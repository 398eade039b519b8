"""Service mode: the dispatcher answers emit / emit_and_collect requests on NATS.

An agent in any language emits with one plain NATS request and a JSON body:
``nats req 'hookbus.v1.emit.payments.tool=3Apre' '{"data": {"tool_name": "bash"}}'``
(agent ``payments``; ``=`` for none) answers an `EmitReply`. Replicas share the load in
the `DISPATCHER_QUEUE_GROUP` queue group.

Every request gets exactly one reply, never silence: the result, or a `WireError`. The
retryable ones (``busy``: over the replica's concurrency bound, answered at once, or over
the agent's in-flight limit; ``quota``: the agent is over its request rate;
``unavailable``: shutting down, or the bus is unreachable) mean the agent may send the same
request again, to this or another replica; with the same ``idempotency_key`` a retried emit
finds its approval instead of asking twice.

Each agent (the subject's agent token, which only that agent's NATS user may publish on
with the generated permissions) has its own bounds on a replica: requests in flight
(`agent_max_in_flight`) and a token bucket of requests per second (`agent_rate_per_s`,
`agent_burst`). Requests on the no-agent subject ``=`` (an open development server; no
generated identity may publish there) name no one to bound: only `max_concurrency`
applies to them. A request past them never reaches a handler, so one agent flooding a
replica holds at most its in-flight limit of the replica's `max_concurrency` and no other
agent's request waits behind it (`_agent_quotas`). Its refusal is answered after a pause
(`_held_refusals`: about 1 s for ``quota``, 0.25 s for the agent's ``busy``, each
spread over half to one and a half times that, so refusals do not come back as one burst;
at most half the request's own ``timeout_s``, so the caller still hears it): a client that
sends again as soon as it is refused, with many requests in flight, then slows to its
bounds instead of keeping the replica, the server and the machine busy with refusals
(measured by ``benchmarks/abuse.py``). At most 10,000 refusals wait at once; past them,
refusals are answered at once.

Each replica is a service of the NATS services API (``nats.micro``) named
``hookbus-dispatcher`` with two endpoints, ``emit`` and ``emit_and_collect``: ``$SRV.INFO``
names them, ``$SRV.STATS`` counts their requests, errors and processing time (see
`_services_api`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus._core.deadlines import Deadline
from hookbus._core.jetstream import bind_js_domain
from hookbus._core.serving import (
    Admission,
    Endpoint,
    EndpointCounters,
    Refusal,
    ServingLoop,
)
from hookbus.schemas import (
    COLLECT_SERVICE_WILDCARD,
    DISPATCHER_QUEUE_GROUP,
    EMIT_SERVICE_WILDCARD,
    SUBJECT_PREFIX,
    CollectReply,
    EmitReply,
    HookbusError,
    SuspensionRecord,
    WireError,
    decode,
    encode,
)

from ._agent_quotas import AgentQuotas
from ._dispatcher import HookDispatcher
from ._expiry_sweep import EXPIRY_SWEEP_S, ExpirySweep
from ._held_refusals import HeldRefusals, Reply
from ._service_requests import RequestHandlers, unavailable, wire_error
from ._services_api import ServicesAPI

__all__ = ["DispatcherService"]

log = logging.getLogger("hookbus.dispatcher")

Handle = Callable[[Msg], Awaitable[bytes]]

_ADMITTED: Final = Admission()


def _endpoints() -> dict[Reply, EndpointCounters]:
    """The service's two endpoints, by the reply type they answer with."""
    q = DISPATCHER_QUEUE_GROUP

    def meta(verb: str, request: str, reply: str) -> dict[str, str]:
        return {
            "subject_pattern": f"{SUBJECT_PREFIX}.{verb}.<agent>.<event>",
            "request": request,
            "reply": reply,
        }

    return {
        EmitReply: EndpointCounters(
            "emit", EMIT_SERVICE_WILDCARD, q, meta("emit", "EmitRequest", "EmitReply")
        ),
        CollectReply: EndpointCounters(
            "emit_and_collect",
            COLLECT_SERVICE_WILDCARD,
            q,
            meta("emit_and_collect", "CollectRequest", "CollectReply"),
        ),
    }


class DispatcherService:
    """Serve a `HookDispatcher` on ``hookbus.v1.emit.*.*`` and ``hookbus.v1.emit_and_collect.*.*``.

    One task per request. Over `max_concurrency` requests in flight (emit_and_collect may
    hold at most half of them, so decisions always have room), a request is refused at
    once with a retryable ``busy`` error instead of queueing into timeouts. Each agent
    also has its own bounds (see the module docstring): over `agent_max_in_flight`
    requests in flight it is answered ``busy``, over `agent_rate_per_s` (with a burst of
    `agent_burst`) ``quota``; both at once, naming the agent and the limit, before any
    handler runs. Bad input
    (malformed JSON, wrong types, an unknown event, an oversize result, a timeout that is
    not a finite number above 0) gets a structured `WireError` reply and a log line; the
    service keeps serving. Timeouts in requests are clamped: ``EmitRequest.timeout_s`` to
    `max_emit_timeout_s`, ``CollectRequest.timeout_s`` to `max_collect_timeout_s`;
    ``EmitRequest.approval_timeout_s`` (a finite number above 0, else ``bad_request``) cuts
    the timeout of each approval the emit asks (`HookDispatcher.emit`).

    Args:
        dispatcher: the dispatcher that serves the requests (started by `start`).
        nc: the connection to serve on.
        max_concurrency: requests served at once; more are answered ``busy``.
        grace_s: default bounded-drain grace period of `stop`, seconds (below the 30 s
            Kubernetes gives between SIGTERM and SIGKILL).
        max_emit_timeout_s: upper bound of ``EmitRequest.timeout_s``, seconds.
        max_collect_timeout_s: upper bound of ``CollectRequest.timeout_s``, seconds.
        agent_max_in_flight: requests of one agent served at once (emit and
            emit_and_collect together); more are answered ``busy``. None: no per-agent
            bound (only `max_concurrency`).
        agent_rate_per_s: requests per second one agent may send (a token bucket refilled
            at this rate); past it, and its `agent_burst`, requests are answered ``quota``.
            None: no rate limit.
        agent_burst: the bucket's size: requests one agent may send at once after a pause.
        audit: turn the dispatcher's decision audit trail on (``HookDispatcher(audit=True)``):
            one record per decided emit in the ``hookbus_decisions`` stream.
        js_domain: the JetStream domain holding the fleet's buckets (a service at a leaf
            site: the hub's); bound to `nc`, so `dispatcher` reads and writes there too.
            None: the connection's own JetStream (or the dispatcher's `js_domain`).
        expiry_sweep_s: mean seconds between two sweeps that end approvals nobody waits
            for (past their timeout plus the margin, by the server's clock: their default
            applied; see `hookbus.dispatcher._expiry_sweep`), each pause jittered by 20 %.
            None: no sweep.

    While it serves, it answers the NATS services API as ``hookbus-dispatcher``
    (`service_id`); `stop` withdraws it first, so a draining replica is no longer listed.
    """

    DEFAULT_GRACE_S = 20.0
    AGENT_MAX_IN_FLIGHT = 64
    AGENT_RATE_PER_S = 200.0
    AGENT_BURST = 400
    MAX_EMIT_TIMEOUT_S = 900.0
    MAX_COLLECT_TIMEOUT_S = 60.0

    def __init__(
        self,
        dispatcher: HookDispatcher,
        nc: NATS,
        *,
        max_concurrency: int = 512,
        grace_s: float = DEFAULT_GRACE_S,
        max_emit_timeout_s: float = MAX_EMIT_TIMEOUT_S,
        max_collect_timeout_s: float = MAX_COLLECT_TIMEOUT_S,
        audit: bool = False,
        agent_max_in_flight: int | None = AGENT_MAX_IN_FLIGHT,
        agent_rate_per_s: float | None = AGENT_RATE_PER_S,
        agent_burst: int | None = AGENT_BURST,
        js_domain: str | None = None,
        expiry_sweep_s: float | None = EXPIRY_SWEEP_S,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self._quotas = AgentQuotas(
            max_in_flight=agent_max_in_flight, rate_per_s=agent_rate_per_s, burst=agent_burst
        )
        if audit:
            dispatcher.audit = True  # opened by the dispatcher's start
        self._dispatcher = dispatcher
        self._nc = nc
        self._js_domain = js_domain
        self._max = max_concurrency
        self._max_collect = max(1, max_concurrency // 2)
        self._grace_s = grace_s
        self._requests = RequestHandlers(
            dispatcher,
            max_emit_timeout_s=max_emit_timeout_s,
            max_collect_timeout_s=max_collect_timeout_s,
        )
        self._held = HeldRefusals(self._refuse)
        """Agents' refusals waiting for their hold."""
        self._stopped = asyncio.Event()
        self._running = False
        self._counters = _endpoints()
        self._serving = ServingLoop(nc, max_concurrency=max_concurrency, log=log)
        self._endpoints = {
            EmitReply: self._endpoint(self._requests.emit, EmitReply, EMIT_SERVICE_WILDCARD),
            CollectReply: self._endpoint(
                self._requests.collect, CollectReply, COLLECT_SERVICE_WILDCARD, self._max_collect
            ),
        }
        self._api: ServicesAPI | None = None
        self._sweep = (
            None
            if expiry_sweep_s is None
            else ExpirySweep(self._end_overdue_approvals, interval_s=expiry_sweep_s)
        )

    async def _end_overdue_approvals(self) -> list[SuspensionRecord]:
        """One expiry sweep: every agent's overdue approvals ended, through the
        dispatcher's approvals client (`ApprovalsClient.end_overdue`)."""
        client = await self._dispatcher._approvals_client()
        return await client.end_overdue()

    @property
    def in_flight(self) -> int:
        """Requests being served now."""
        return self._serving.in_flight

    @property
    def service_id(self) -> str | None:
        """This replica's NATS services API instance id while it serves
        (``$SRV.INFO.hookbus-dispatcher.<id>`` reaches it alone); None otherwise."""
        return self._api.id if self._api is not None else None

    async def start(self) -> None:
        """Start the dispatcher, subscribe, flush; returns when requests can be served.

        Raises:
            JetStreamDomainError: see `HookDispatcher.start`.
        """
        if self._running:
            return
        bind_js_domain(self._nc, self._js_domain)
        await self._dispatcher.start()
        for endpoint in self._endpoints.values():
            await self._serving.add(endpoint)
        quotas = self._quotas
        api = ServicesAPI(
            self._nc,
            list(self._counters.values()),
            metadata={
                "max_concurrency": str(self._max),
                "agent_max_in_flight": str(quotas.max_in_flight or "none"),
                "agent_rate_per_s": f"{quotas.rate_per_s:g}" if quotas.rate_per_s else "none",
                "agent_burst": f"{quotas.burst:g}" if quotas.rate_per_s else "none",
                "audit": "on" if self._dispatcher.audit else "off",
            },
            endpoint_data=self._endpoint_data,
        )
        await api.start()  # subscribes to the $SRV verbs, then flushes
        self._api = api
        self._running = True
        if self._sweep is not None:
            self._sweep.start()

    def _endpoint_data(self, endpoint: EndpointCounters) -> dict[str, Any]:
        """The extra ``$SRV.STATS`` figures of an endpoint."""
        collect = endpoint is self._counters[CollectReply]
        active, active_collect = self._serving.in_flight, self._endpoints[CollectReply].in_flight
        return {
            "in_flight": active_collect if collect else active - active_collect,
            "answered": endpoint.answered,
            "draining": self._serving.draining,
        }

    async def run(self) -> None:
        """`start`, then serve until `stop` is called."""
        await self.start()
        await self._stopped.wait()

    async def stop(self, grace_s: float | None = None) -> None:
        """Bounded drain (idempotent; a concurrent call waits for the drain in progress).

        1. Intake stops on every subscription at once; a request that still arrives is
           answered ``unavailable`` (retryable) at once.
        2. Requests in flight run to their end for up to `grace_s` seconds.
        3. Then this process's durable waits (approvals, hooks) are aborted: their records
           stay pending, so a retry with the same idempotency key resumes them. Whatever
           has not finished a moment later is cancelled. Every request not answered by
           then is answered ``unavailable`` (retryable).

        Args:
            grace_s: seconds for step 2; None: the `grace_s` given at construction.
        """
        grace = self._grace_s if grace_s is None else max(0.0, grace_s)
        serving = self._serving
        if serving.draining:
            await self._stopped.wait()
            return
        if not self._running:
            self._stopped.set()
            return
        self._running = False
        serving.draining = True
        if self._sweep is not None:
            await self._sweep.stop()
        deadline = Deadline.after(grace, asyncio.get_running_loop().time())
        if self._api is not None:  # no longer listed as live while it drains
            await self._api.close()
            self._api = None
        # unsubscribe, passing the messages already delivered through the callback (which
        # answers them ``unavailable`` now that the service is draining)
        await serving.stop_intake(timeout_s=max(grace, 1.0))
        await self._held.release_all()

        async def late(running: int) -> None:
            aborted = self._abort_waits()
            log.warning(
                "drain: %d request(s) still running after %ss; %d durable wait(s) aborted "
                "(left pending), the rest answered unavailable",
                running,
                grace,
                aborted,
            )
            if aborted:  # let the aborted emits answer for themselves
                await serving.wait(1.0)

        for request in await serving.finish(deadline, cancel_wait_s=1.0, late=late):
            # would not end
            collect = request.endpoint is self._endpoints[CollectReply]
            reply_type: Reply = CollectReply if collect else EmitReply
            error = wire_error(asyncio.CancelledError())
            payload = encode(reply_type(error=error))
            await self._answer(request.msg, payload, reply_type, request.received)
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self._nc.flush(timeout=2)
        await self._dispatcher.close()
        self._stopped.set()

    def _abort_waits(self) -> int:
        """Abort this process's durable waits, hooks and approvals
        (`HookDispatcher.abort_all`); records stay pending."""
        return self._dispatcher.abort_all()

    def _endpoint(
        self, handle: Handle, reply_type: Reply, subject: str, max_in_flight: int | None = None
    ) -> Endpoint:
        """The serving loop's endpoint answering `reply_type` on `subject`: draining and
        over the bound, refused at once; over the agent's bounds, after a hold."""

        async def refuse(msg: Msg, why: Refusal, received: int) -> None:
            if why == "draining":
                error = unavailable("the dispatcher is draining")
            else:
                error = WireError(
                    code="busy",
                    message=f"over this replica's concurrency bound ({self._max})",
                    retryable=True,
                )
            await self._refuse(msg, reply_type, error, received)

        def admit(msg: Msg, received: int) -> Admission | Awaitable[None]:
            # a plain function: only a refusal (held, then answered) needs a coroutine
            quota = self._quotas.admit(msg.subject)
            if isinstance(quota, WireError):
                return self._held.hold(msg, reply_type, quota, received)
            return _ADMITTED if quota is None else Admission(ticket=quota)

        async def serve(msg: Msg, context: object, received: int) -> None:
            try:
                payload = await handle(msg)
            except asyncio.CancelledError:  # the drain ran out of grace
                payload = encode(reply_type(error=wire_error(asyncio.CancelledError())))
            await self._answer(msg, payload, reply_type, received)

        return Endpoint(
            subject,
            serve,
            refuse,
            queue_group=DISPATCHER_QUEUE_GROUP,
            admit=admit,
            max_in_flight=max_in_flight,
            counters=self._counters[reply_type],
        )

    async def _refuse(self, msg: Msg, reply_type: Reply, error: WireError, received: int) -> None:
        """Answer `error` at once (a refusal: small, its error known, nothing to decode back;
        the cheap path a flooding agent's requests take)."""
        if not msg.reply:
            log.warning("request on %s has no reply subject; answer dropped", msg.subject)
        else:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(msg.reply, encode(reply_type(error=error)))
        self._counters[reply_type].answer(received, error)

    async def _answer(self, msg: Msg, payload: bytes, reply_type: Reply, received: int) -> None:
        """Send the reply and count it on its endpoint (`received`: when the request came,
        ``time.perf_counter_ns()``)."""
        if len(payload) > self._nc.max_payload:
            payload = encode(
                EmitReply(
                    error=WireError(
                        code="payload_too_large",
                        message=f"reply is {len(payload)} bytes; max_payload is "
                        f"{self._nc.max_payload}",
                    )
                )
            )
        error = _reply_error(payload, reply_type)
        if not msg.reply:
            log.warning("request on %s has no reply subject; answer dropped", msg.subject)
        else:
            await self._nc.publish(msg.reply, payload)
        self._counters[reply_type].answer(received, error)


def _reply_error(payload: bytes, reply_type: Reply) -> WireError | None:
    """The error an encoded reply carries, None for a result. Replies are encoded without
    their defaults, so an error reply (and only one) starts with its ``error`` field."""
    if not payload.startswith(b'{"error":'):
        return None
    try:
        return decode(payload, reply_type).error
    except HookbusError:
        return WireError(code="internal", message="an error reply that does not decode")
