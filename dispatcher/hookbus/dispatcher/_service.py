"""Service mode: the dispatcher answers emit / emit_and_collect requests on NATS.

An agent in any language emits with one plain NATS request and a JSON body:
``nats req 'hookbus.v1.emit.tool=3Apre' '{"data": {"tool_name": "bash"}}'`` answers
an `EmitReply`. Replicas share the load in the `DISPATCHER_QUEUE_GROUP` queue group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hookbus.schemas import (
    COLLECT_SERVICE_WILDCARD,
    DISPATCHER_QUEUE_GROUP,
    EMIT_SERVICE_WILDCARD,
    BadRequestError,
    CollectReply,
    CollectRequest,
    EmitReply,
    EmitRequest,
    HookbusError,
    PayloadTooLargeError,
    UnknownEventError,
    WireError,
    WireFormatError,
    decode,
    encode,
    event_from_service_subject,
)

from ._dispatcher import HookDispatcher
from ._telemetry import traced_dispatch

__all__ = ["DispatcherService"]

log = logging.getLogger("hookbus.dispatcher")


def _error_code(exc: Exception) -> str:
    if isinstance(exc, UnknownEventError):
        return "unknown_event"
    if isinstance(exc, PayloadTooLargeError):
        return "payload_too_large"
    if isinstance(exc, BadRequestError | WireFormatError):
        return "bad_request"
    return "internal"


class DispatcherService:
    """Serve a `HookDispatcher` on ``hookbus.v1.emit.*`` and ``hookbus.v1.emit_and_collect.*``.

    One task per request, at most `max_concurrency` at once; `stop` drains (idempotent).
    Bad input (malformed JSON, wrong types, an unknown event, an oversize result) gets a
    structured `WireError` reply and a log line; the service keeps serving.
    """

    def __init__(self, dispatcher: HookDispatcher, nc: NATS, *, max_concurrency: int = 512) -> None:
        self._dispatcher = dispatcher
        self._nc = nc
        self._limiter = asyncio.Semaphore(max_concurrency)
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self._running = False
        self._draining = False

    async def start(self) -> None:
        """Start the dispatcher, subscribe, flush; returns when requests can be served."""
        if self._running:
            return
        await self._dispatcher.start()
        for subject, handle in (
            (EMIT_SERVICE_WILDCARD, self._emit),
            (COLLECT_SERVICE_WILDCARD, self._collect),
        ):
            sub = await self._nc.subscribe(
                subject, queue=DISPATCHER_QUEUE_GROUP, cb=self._spawner(handle)
            )
            self._subs.append(sub)
        await self._nc.flush()
        self._running = True

    async def run(self) -> None:
        """`start`, then serve until `stop` is called."""
        await self.start()
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain: stop taking requests, answer every one received (idempotent)."""
        if self._draining:  # a concurrent stop(): wait for the drain in progress
            await self._stopped.wait()
            return
        if not self._running:
            self._stopped.set()
            return
        self._running = False
        self._draining = True
        for sub in self._subs:
            with contextlib.suppress(
                nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError
            ):
                await sub.drain()
        self._subs.clear()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._dispatcher.close()
        self._stopped.set()

    def _spawner(
        self, handle: Callable[[Msg], Awaitable[bytes]]
    ) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            await self._limiter.acquire()
            task = asyncio.create_task(self._serve(handle, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return on_message

    async def _serve(self, handle: Callable[[Msg], Awaitable[bytes]], msg: Msg) -> None:
        try:
            payload = await handle(msg)
            if not msg.reply:
                log.warning("request on %s has no reply subject; answer dropped", msg.subject)
                return
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
            await self._nc.publish(msg.reply, payload)
        except Exception:
            log.exception("unexpected error serving %s", msg.subject)
        finally:
            self._limiter.release()

    @traced_dispatch
    async def _emit(self, msg: Msg) -> bytes:
        try:
            event = event_from_service_subject(msg.subject)
            req = decode(msg.data, EmitRequest)
            ids = {
                k: v for k, v in (("agent_id", req.agent_id), ("session_id", req.session_id)) if v
            }
            result = await self._dispatcher.emit(event, {**ids, **req.data})
            return encode(EmitReply(result=result))
        except HookbusError as exc:
            log.warning("emit on %s refused: %s", msg.subject, exc)
            return encode(EmitReply(error=WireError(code=_error_code(exc), message=str(exc))))
        except Exception as exc:  # a bug of ours: still answer, never leave the agent waiting
            log.exception("emit on %s failed", msg.subject)
            return encode(EmitReply(error=WireError(code="internal", message=repr(exc))))

    @traced_dispatch
    async def _collect(self, msg: Msg) -> bytes:
        try:
            event = event_from_service_subject(msg.subject)
            req = decode(msg.data, CollectRequest)
            responses = await self._dispatcher.emit_and_collect(event, req.data, req.timeout_s)
            return encode(CollectReply(responses=responses))
        except HookbusError as exc:
            log.warning("emit_and_collect on %s refused: %s", msg.subject, exc)
            return encode(CollectReply(error=WireError(code=_error_code(exc), message=str(exc))))
        except Exception as exc:
            log.exception("emit_and_collect on %s failed", msg.subject)
            return encode(CollectReply(error=WireError(code="internal", message=repr(exc))))
