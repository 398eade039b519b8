"""Serving a worker's requests: each handler's call, collect and instance subjects, every
request answered (a result or a `WireError`), and the refusals of requests not run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus._core.log_limits import RateLimitedWarning
from hookbus._core.nats_guard import harden_connection, reply_now, send_now
from hookbus._core.serving import Endpoint, Refusal
from hookbus.schemas import (
    EventEnvelope,
    HookReply,
    WireError,
    WireFormatError,
    decode,
    encode,
    handler_instance_subject,
)

from ._handler_call import HandlerCaller
from ._replies import UNENCODABLE, log_reply, ready, sendable
from ._spec import HandlerSpec
from ._telemetry import traced_handling
from ._telemetry_core import otel

__all__ = ["RequestServer"]

log = logging.getLogger("hookbus.workers")


class RequestServer:
    """The request path of one worker process: a request to one of its handlers is read,
    run within the handler's timeout and the caller's budget (`HandlerCaller`), and
    answered on its reply subject; a request the serving loop does not run is refused
    with a retryable error. `HookWorker` gives it the connection, the concurrency bound
    and its instance id when it starts.

    Args:
        caller: runs a handler within its timeout.
    """

    __slots__ = (
        "_bad_requests",
        "caller",
        "handled",
        "instance",
        "max_concurrency",
        "nc",
        "refused",
    )

    def __init__(self, caller: HandlerCaller) -> None:
        self.caller = caller
        """Runs a handler within its timeout (chain requests run their steps with it too:
        one record of which handlers wait)."""
        self.nc: NATS | None = None
        """The connection replies go out on (set when the worker starts)."""
        self.max_concurrency = 1
        """Requests handled at once by the process (named in a ``busy`` refusal)."""
        self.instance = ""
        """The process's instance id, carried by every reply ("" until it is known)."""
        self.handled = 0
        """Requests answered so far, a chain request counting each handler it ran."""
        self.refused = 0
        """Requests refused with ``busy`` or ``unavailable`` without running."""
        self._bad_requests = RateLimitedWarning(log)

    # -- endpoints ---------------------------------------------------------------------
    def endpoints(self, specs: Iterable[HandlerSpec]) -> list[Endpoint]:
        """Each handler's call and collect endpoints, in its queue group."""
        found = []
        for spec in specs:
            decl = spec.declaration
            found.append(self.endpoint(spec, decl.subject, decl.queue_group))
            found.append(self.endpoint(spec, decl.collect_subject, decl.queue_group))
        return found

    def instance_endpoints(self, specs: Iterable[HandlerSpec], instance: str) -> list[Endpoint]:
        """Each handler's endpoint on its subject of this process `instance` (hedges)."""
        found = []
        for spec in specs:
            decl = spec.declaration
            subject = handler_instance_subject(decl.event, decl.name, instance)
            found.append(self.endpoint(spec, subject))
        return found

    def endpoint(self, spec: HandlerSpec, subject: str, queue_group: str = "") -> Endpoint:
        """A handler's endpoint on `subject` (its call, collect or instance subject)."""
        harden_connection(self.nc)  # requests come from anyone: none may silence us
        # a partial, not a closure awaiting `_serve`: one coroutine frame less per request
        serve = functools.partial(self._serve, spec)
        return Endpoint(
            subject, serve, self.refusal(spec.declaration.name), queue_group=queue_group
        )

    def refusal(self, name: str) -> Callable[[Msg, Refusal, int], Awaitable[None]]:
        """The serving loop's refusals of `name`'s requests, answered as `name`."""

        async def refuse(msg: Msg, why: Refusal, received: int) -> None:
            if why == "draining":
                await self._refuse_as(name, msg, "unavailable", "the worker is shutting down")
            else:
                busy = f"over max_concurrency={self.max_concurrency}"
                await self._refuse_as(name, msg, "busy", busy)

        return refuse

    async def _refuse_as(self, name: str, msg: Msg, code: str, message: str) -> None:
        """Answer at once that the request was not run and may be sent again."""
        self.refused += 1
        if msg.reply and self.nc is not None:
            error = WireError(code=code, message=message, retryable=True)
            reply = HookReply(handler=name, error=error, instance=self.instance)
            payload = encode(reply)
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(msg.reply, payload)
                send_now(self.nc)

    # -- one request -------------------------------------------------------------------
    async def _serve(self, spec: HandlerSpec, msg: Msg, context: object, received: int) -> None:
        """Serve one request to `spec` (the serving loop's handler; `context` and
        `received` are not used: the budget is counted from here, as `handle` does)."""
        decl = spec.declaration
        try:
            started = time.monotonic()
            if otel.sync():
                reply = await self.handle(spec, msg)
            else:  # `handle` without its span's wrapper: one coroutine frame less
                reply = await self.handle_untraced(spec, msg)
            if reply is not None:
                await self.respond(msg, reply)
                if log.isEnabledFor(logging.DEBUG):
                    kind = "collect" if msg.subject == decl.collect_subject else "call"
                    log_reply(decl, reply, kind, time.monotonic() - started)
        except asyncio.CancelledError:  # shutdown's grace ran out
            error = WireError(
                code="unavailable",
                message="the worker shut down while the handler ran",
                retryable=decl.retry_safe,
            )
            with contextlib.suppress(Exception):
                await self.respond(msg, HookReply(handler=decl.name, error=error))
            raise
        except Exception as exc:  # never let one request take the worker down
            log.exception("unexpected error serving %s", msg.subject)
            if msg.reply and self.nc is not None:  # answer anyway: no wait for a timeout
                error = WireError(code="internal", message=repr(exc))
                with contextlib.suppress(Exception):
                    reply = HookReply(handler=decl.name, error=error, instance=self.instance)
                    await self.nc.publish(msg.reply, encode(reply))
        finally:
            self.handled += 1

    def handle_untraced(self, spec: HandlerSpec, msg: Msg) -> Awaitable[HookReply | None]:
        """Decode the request and run its handler within its timeout and the caller's
        budget; the reply (None: nothing to send). A plain function returning the
        handler's `HandlerCaller.invoke` (one coroutine frame less per request)."""
        received = time.monotonic()
        envelope, refusal = self.read_request(spec.declaration.name, msg)
        if envelope is None:
            return ready(refusal)
        timeout_s = spec.declaration.timeout_s
        if envelope.budget_s is not None:
            timeout_s = min(timeout_s, envelope.budget_s)  # never more than the caller has left
        timeout_s -= time.monotonic() - received
        return self.caller.invoke(spec, envelope.event, envelope.data, timeout_s, envelope.id)

    handle = traced_handling(handle_untraced)
    """`handle_untraced` in its span and duration point (telemetry on)."""

    def read_request(
        self, name: str, msg: Msg, decoded: EventEnvelope | None = None
    ) -> tuple[EventEnvelope, None] | tuple[None, HookReply]:
        """The request's envelope, or the error reply that refuses it (`name` answers).
        `decoded`: its envelope if already decoded from ``msg.data`` (None: decode it)."""
        try:
            envelope = decoded if decoded is not None else decode(msg.data, EventEnvelope)
        except WireFormatError as exc:
            self._bad_requests.warn("bad request on %s: %.200s", msg.subject, exc)
            return None, HookReply(
                handler=name, error=WireError(code="bad_request", message=str(exc)[:500])
            )
        budget = envelope.budget_s
        if budget is not None:
            if math.isnan(budget):
                self._bad_requests.warn("bad request on %s: budget_s is NaN", msg.subject)
                return None, HookReply(
                    handler=name,
                    error=WireError(code="bad_request", message="budget_s is not a number"),
                )
            if budget <= 0:  # the caller has given up already: say so, run nothing
                return None, HookReply(
                    handler=name,
                    error=WireError(
                        code="deadline_exceeded",
                        message=f"the caller's budget ({budget}s) was spent on arrival",
                        retryable=True,
                    ),
                )
        return envelope, None

    async def respond(self, msg: Msg, reply: HookReply) -> None:
        """Publish `reply` on the request's reply subject, naming this instance, and send
        it now; a reply JSON cannot carry, or over the server's ``max_payload``, goes as
        the error that says so (``bad_result``, ``payload_too_large``)."""
        if not msg.reply:
            log.warning("request on %s has no reply subject; answer dropped", msg.subject)
            return
        assert self.nc is not None
        reply.instance = self.instance
        try:
            payload = encode(reply)
        except UNENCODABLE:  # a result JSON cannot carry: that reply fails, not the others
            if reply.chain is not None:
                reply.chain = [sendable(r, every_field=True) for r in reply.chain]
            else:
                reply = sendable(reply, every_field=True)
                reply.instance = self.instance
            payload = encode(reply)
        if len(payload) > self.nc.max_payload:
            log.warning("reply of %s is %d bytes, over max_payload", reply.handler, len(payload))
            payload = encode(
                HookReply(
                    handler=reply.handler,
                    error=WireError(
                        code="payload_too_large",
                        message=f"reply is {len(payload)} bytes; max_payload is"
                        f" {self.nc.max_payload}",
                    ),
                    instance=self.instance,
                )
            )
        # written now, not after whatever the loop runs next (it may compute)
        if not reply_now(self.nc, msg.reply, payload):
            await self.nc.publish(msg.reply, payload)
            send_now(self.nc)
