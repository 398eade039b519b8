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
agent's request waits behind it. Its refusal is answered after a pause
(`AGENT_REFUSAL_HOLD_S`: about 1 s for ``quota``, 0.25 s for the agent's ``busy``, each
spread over half to one and a half times that, so refusals do not come back as one burst;
at most half the request's own ``timeout_s``, so the caller still hears it): a client that
sends again as soon as it is refused, with many requests in flight, then slows to its
bounds instead of keeping the replica, the server and the machine busy with refusals
(measured by ``benchmarks/abuse.py``). At most `MAX_HELD_REFUSALS` refusals wait at once;
past them, refusals are answered at once.

Each replica is a service of the NATS services API (``nats.micro``) named
``hookbus-dispatcher`` with two endpoints, ``emit`` and ``emit_and_collect``: ``$SRV.INFO``
names them, ``$SRV.STATS`` counts their requests, errors and processing time (see
`_services_api`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus._core.jetstream import bind_js_domain
from hookbus._core.log_limits import RateLimitedWarning, clip
from hookbus._core.serving import (
    Admission,
    Endpoint,
    EndpointCounters,
    Refusal,
    ServingLoop,
    Ticket,
)
from hookbus.schemas import (
    COLLECT_SERVICE_WILDCARD,
    DISPATCHER_QUEUE_GROUP,
    EMIT_SERVICE_WILDCARD,
    SUBJECT_PREFIX,
    BadRequestError,
    CollectReply,
    CollectRequest,
    EmitReply,
    EmitRequest,
    HookbusError,
    HookbusTimeoutError,
    NotConnectedError,
    PayloadTooLargeError,
    SuspensionAbortedError,
    SuspensionRecord,
    UnknownEventError,
    WireError,
    WireFormatError,
    agent_from_service_subject,
    decode,
    decode_token,
    encode,
    event_from_service_subject,
)

from ._dispatcher import HookDispatcher
from ._expiry_sweep import EXPIRY_SWEEP_S, ExpirySweep
from ._services_api import ServicesAPI
from ._telemetry import traced_dispatch

__all__ = ["DispatcherService"]

log = logging.getLogger("hookbus.dispatcher")

Reply = type[EmitReply] | type[CollectReply]
Handle = Callable[[Msg], Awaitable[bytes]]


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


def _wire_error(exc: BaseException) -> WireError:
    """The structured error a failed request is answered with."""
    if isinstance(exc, UnknownEventError):
        return WireError(code="unknown_event", message=str(exc))
    if isinstance(exc, PayloadTooLargeError):
        return WireError(code="payload_too_large", message=str(exc))
    if isinstance(exc, BadRequestError | WireFormatError):
        return WireError(code="bad_request", message=str(exc))
    if isinstance(exc, SuspensionAbortedError | asyncio.CancelledError):
        return _unavailable("the dispatcher is shutting down; send the request again")
    if isinstance(exc, NotConnectedError | HookbusTimeoutError | nats.errors.Error):
        return _unavailable(f"NATS or JetStream is unreachable: {exc}")
    if isinstance(exc, HookbusError):
        return WireError(code="internal", message=str(exc))
    return WireError(code="internal", message=repr(exc))


AGENT_REFUSAL_HOLD_S: Final = {"quota": 1.0, "busy": 0.25}
"""Seconds an agent's refusal waits before it is sent (see the module docstring)."""

_ADMITTED: Final = Admission()

MAX_HELD_REFUSALS: Final = 10_000
"""Refusals of a replica waiting to be sent at most; past it they are sent at once."""


class _Timeout(msgspec.Struct):
    """The one field of a request a held refusal reads (the rest is never decoded)."""

    timeout_s: float | None = None


class _AgentQuota(Ticket):
    """One agent's bounds on this replica: requests in flight, and a token bucket; an
    admitted request holds one of its requests in flight while it runs."""

    __slots__ = ("in_flight", "stamp", "tokens")

    def __init__(self, tokens: float, now: float) -> None:
        self.in_flight = 0
        self.tokens = tokens
        self.stamp = now

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


def _agent_label(token: str) -> str:
    """The agent a quota key names, for a refusal's message."""
    with contextlib.suppress(Exception):
        return repr(decode_token(token))
    return repr(token[:80])


def _unavailable(message: str) -> WireError:
    return WireError(code="unavailable", message=message, retryable=True)


def _timeout(value: float | None, *, maximum: float, field: str) -> float | None:
    """`value` clamped to `maximum`; None stays None.

    Raises:
        BadRequestError: not a finite number above 0 (NaN, inf, 0, negative).
    """
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        raise BadRequestError(f"$.{field}: must be a finite number of seconds above 0")
    return min(value, maximum)


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
        if agent_max_in_flight is not None and agent_max_in_flight < 1:
            raise ValueError("agent_max_in_flight must be at least 1 (None: no bound)")
        if agent_rate_per_s is not None and not (
            math.isfinite(agent_rate_per_s) and agent_rate_per_s > 0
        ):
            raise ValueError("agent_rate_per_s must be a finite number above 0 (None: no limit)")
        if agent_burst is not None and agent_burst < 1:
            raise ValueError("agent_burst must be at least 1")
        if audit:
            dispatcher.audit = True  # opened by the dispatcher's start
        self._dispatcher = dispatcher
        self._nc = nc
        self._js_domain = js_domain
        self._max = max_concurrency
        self._max_collect = max(1, max_concurrency // 2)
        self._grace_s = grace_s
        self._max_emit_timeout_s = max_emit_timeout_s
        self._max_collect_timeout_s = max_collect_timeout_s
        self._agent_max = agent_max_in_flight
        self._agent_rate = agent_rate_per_s
        self._agent_burst = float(
            agent_burst if agent_burst is not None else max(1, math.ceil(agent_rate_per_s or 1))
        )
        self._quotas: dict[str, _AgentQuota] = {}
        self._refused = RateLimitedWarning(log, what="refused request(s)")
        """A refused request's WARNING: a few per interval one by one, the rest counted."""
        self._held: dict[int, tuple[asyncio.TimerHandle, tuple[Msg, Reply, WireError, int]]] = {}
        """Refusals waiting for their hold, by number (see `_refuse_later`)."""
        self._held_seq = 0
        self._tasks: set[asyncio.Future[None]] = set()
        """Per agent token: its requests in flight and its token bucket (idle ones pruned)."""
        self._next_prune = 0.0
        self._stopped = asyncio.Event()
        self._running = False
        self._counters = _endpoints()
        self._serving = ServingLoop(nc, max_concurrency=max_concurrency, log=log)
        self._endpoints = {
            EmitReply: self._endpoint(self._emit, EmitReply, EMIT_SERVICE_WILDCARD),
            CollectReply: self._endpoint(
                self._collect, CollectReply, COLLECT_SERVICE_WILDCARD, self._max_collect
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
        api = ServicesAPI(
            self._nc,
            list(self._counters.values()),
            metadata={
                "max_concurrency": str(self._max),
                "agent_max_in_flight": str(self._agent_max or "none"),
                "agent_rate_per_s": f"{self._agent_rate:g}" if self._agent_rate else "none",
                "agent_burst": f"{self._agent_burst:g}" if self._agent_rate else "none",
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
        deadline = asyncio.get_running_loop().time() + grace
        if self._api is not None:  # no longer listed as live while it drains
            await self._api.close()
            self._api = None
        # unsubscribe, passing the messages already delivered through the callback (which
        # answers them ``unavailable`` now that the service is draining)
        await serving.stop_intake(timeout_s=max(grace, 1.0))
        await self._release_all()

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
            error = _wire_error(asyncio.CancelledError())
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
                error = _unavailable("the dispatcher is draining")
            else:
                error = WireError(
                    code="busy",
                    message=f"over this replica's concurrency bound ({self._max})",
                    retryable=True,
                )
            await self._refuse(msg, reply_type, error, received)

        async def admit(msg: Msg, received: int) -> Admission | None:
            quota = self._admit_agent(msg.subject)
            if isinstance(quota, WireError):
                await self._refuse_later(msg, reply_type, quota, received)
                return None
            return _ADMITTED if quota is None else Admission(ticket=quota)

        async def serve(msg: Msg, context: object, received: int) -> None:
            try:
                payload = await handle(msg)
            except asyncio.CancelledError:  # the drain ran out of grace
                payload = encode(reply_type(error=_wire_error(asyncio.CancelledError())))
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

    def _admit_agent(self, subject: str) -> _AgentQuota | WireError | None:
        """The agent's quota with room for one more request (its token taken), the
        refusal when it has none, or None when no per-agent bound is set."""
        if self._agent_max is None and self._agent_rate is None:
            return None
        parts = subject.split(".", 4)
        token = parts[3] if len(parts) == 5 else "="
        if token == "=":
            return None  # the no-agent subject: no identity to bound (see the class doc)
        now = time.monotonic()
        quota = self._quotas.get(token)
        if quota is None:
            if now >= self._next_prune and len(self._quotas) >= 1024:
                self._prune(now)
            quota = self._quotas[token] = _AgentQuota(self._agent_burst, now)
        if self._agent_max is not None and quota.in_flight >= self._agent_max:
            return WireError(
                code="busy",
                message=f"agent {_agent_label(token)} has {quota.in_flight} requests in flight"
                f" on this replica, its limit (agent_max_in_flight={self._agent_max}); send it"
                " again once one is answered",
                retryable=True,
            )
        rate = self._agent_rate
        if rate is not None:
            quota.tokens = min(self._agent_burst, quota.tokens + (now - quota.stamp) * rate)
            quota.stamp = now
            if quota.tokens < 1.0:
                return WireError(
                    code="quota",
                    message=f"agent {_agent_label(token)} is over its request rate on this"
                    f" replica (agent_rate_per_s={rate:g}, agent_burst={self._agent_burst:g});"
                    f" send it again in {(1.0 - quota.tokens) / rate:.3f} s or later",
                    retryable=True,
                )
            quota.tokens -= 1.0
        return quota

    def _prune(self, now: float) -> None:
        """Forget the agents with nothing in flight and a full bucket (they are as new)."""
        self._next_prune = now + 1.0
        rate = self._agent_rate or 0.0
        full = self._agent_burst
        for token, quota in list(self._quotas.items()):
            if quota.in_flight == 0 and (
                not rate or quota.tokens + (now - quota.stamp) * rate >= full
            ):
                del self._quotas[token]

    async def _refuse_later(
        self, msg: Msg, reply_type: Reply, error: WireError, received: int
    ) -> None:
        """Answer an agent's refusal `error` after its hold (`AGENT_REFUSAL_HOLD_S`, at
        most half the request's ``timeout_s``), or at once when too many wait already."""
        # spread over half to one and a half times the hold: refusals released together
        # would come back together, a burst every other agent's requests queue behind
        hold = AGENT_REFUSAL_HOLD_S.get(error.code, 0.0) * (0.5 + random.random())
        if hold and len(self._held) < MAX_HELD_REFUSALS:
            # whatever the body (nested past the decoder's depth: RecursionError), the
            # refusal is sent: only its hold depends on the body
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                asked = msgspec.json.decode(msg.data, type=_Timeout).timeout_s
                if asked is not None and asked > 0:
                    hold = min(hold, asked / 2)
            if hold > 0.001:
                self._held_seq += 1
                key = self._held_seq
                handle = asyncio.get_running_loop().call_later(hold, self._release, key)
                self._held[key] = (handle, (msg, reply_type, error, received))
                return
        await self._refuse(msg, reply_type, error, received)

    def _release(self, key: int) -> None:
        """A held refusal's time came: send it."""
        held = self._held.pop(key, None)
        if held is not None:
            task = asyncio.ensure_future(self._refuse(*held[1]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _release_all(self) -> None:
        """Send every held refusal now (the replica stops)."""
        held, self._held = list(self._held.values()), {}
        for handle, entry in held:
            handle.cancel()
            await self._refuse(*entry)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)

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

    @traced_dispatch
    async def _emit(self, msg: Msg) -> bytes:
        try:
            event = event_from_service_subject(msg.subject)
            req = decode(msg.data, EmitRequest)
            agent = _agent_of(msg.subject, req.agent_id, req.data.get("agent_id"))
            ids = {k: v for k, v in (("agent_id", agent), ("session_id", req.session_id)) if v}
            options: dict[str, Any] = {}
            if req.idempotency_key:
                options["idempotency_key"] = req.idempotency_key
            timeout_s = _timeout(req.timeout_s, maximum=self._max_emit_timeout_s, field="timeout_s")
            if timeout_s is not None:
                options["timeout_s"] = timeout_s
            approval_s = _timeout(
                req.approval_timeout_s, maximum=math.inf, field="approval_timeout_s"
            )
            if approval_s is not None:
                options["approval_timeout_s"] = approval_s
            started = time.monotonic()
            result = await self._dispatcher.emit(event, {**ids, **req.data}, **options)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "emit %s agent=%s session=%s: %s%s in %.1f ms",
                    event, agent or "-", req.session_id or "-", result.action,
                    f" by {result.decided_by}" if result.decided_by else "",
                    (time.monotonic() - started) * 1000,
                )  # fmt: skip
            return encode(EmitReply(result=result))
        except Exception as exc:
            return encode(EmitReply(error=self._log_error("emit", msg, exc)))

    @traced_dispatch
    async def _collect(self, msg: Msg) -> bytes:
        try:
            event = event_from_service_subject(msg.subject)
            req = decode(msg.data, CollectRequest)
            _agent_of(msg.subject, req.data.get("agent_id"))
            timeout_s = _timeout(
                req.timeout_s, maximum=self._max_collect_timeout_s, field="timeout_s"
            )
            assert timeout_s is not None
            started = time.monotonic()
            responses = await self._dispatcher.emit_and_collect(event, req.data, timeout_s)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "emit_and_collect %s: %d response(s) in %.1f ms",
                    event, len(responses), (time.monotonic() - started) * 1000,
                )  # fmt: skip
            return encode(CollectReply(responses=responses))
        except Exception as exc:
            return encode(CollectReply(error=self._log_error("emit_and_collect", msg, exc)))

    def _log_error(self, what: str, msg: Msg, exc: Exception) -> WireError:
        error = _wire_error(exc)
        if error.code == "internal" and not isinstance(exc, HookbusError | msgspec.MsgspecError):
            log.exception("%s on %s failed", what, clip(msg.subject))  # a bug of ours: answer
        else:  # what a client sent: a flood of them is a few lines, each of bounded size
            self._refused.warn(
                "%s on %s refused (%s): %s", what, clip(msg.subject), error.code, clip(exc)
            )
        return error


def _reply_error(payload: bytes, reply_type: Reply) -> WireError | None:
    """The error an encoded reply carries, None for a result. Replies are encoded without
    their defaults, so an error reply (and only one) starts with its ``error`` field."""
    if not payload.startswith(b'{"error":'):
        return None
    try:
        return decode(payload, reply_type).error
    except HookbusError:
        return WireError(code="internal", message="an error reply that does not decode")


def _agent_of(subject: str, *claimed: object) -> str | None:
    """The agent a service request acts as: the one its subject names
    (``hookbus.v1.emit.<agent>.<event>``, which only that agent's NATS user may publish
    on). A request whose body names another agent is refused, never believed. On the
    no-agent subject (``hookbus.v1.emit.=.<event>``, which the generated permissions give
    no agent) the body's agent id is taken as it is, as on an open development server.

    Raises:
        BadRequestError: the subject has no valid agent token, or the body names another
            agent (or two different ones).
    """
    agent = agent_from_service_subject(subject)
    names = {n for n in claimed if n not in (None, "")}
    if agent is None and len(names) <= 1:
        name = next(iter(names), None)
        return name if isinstance(name, str) else None
    for name in names:
        if name != agent:
            raise BadRequestError(
                f"the request names agent {name!r} but was sent as agent {agent!r}"
                " (the agent is the one in the subject: hookbus.v1.emit.<agent>.<event>)"
            )
    return agent
