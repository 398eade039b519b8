"""An `Emit` that asks the dispatcher service: one NATS request per emit.

``hookbus dispatcher`` (`DispatcherService`) answers ``hookbus.v1.emit.<agent>.<event>``
with an `EmitReply`; this is the client side, for a door that runs no dispatcher of its own
(the Claude Code command hook). It imports nats-py's errors only when a request fails. Each
request carries the current trace context (W3C ``traceparent`` header, OpenTelemetry's
propagator; e.g. the caller's ``TRACEPARENT``, `hookbus.cli._trace_context`), so the
service's emit span continues the caller's trace.
"""

from __future__ import annotations

import asyncio
from typing import Any, Unpack

from nats.aio.client import Client as NATS
from opentelemetry import propagate

from hookbus._core.deadlines import Deadline
from hookbus.integrations import Emit
from hookbus.schemas import (
    BadRequestError,
    EmitOptions,
    EmitReply,
    EmitRequest,
    HookbusError,
    HookbusTimeoutError,
    HookResult,
    NotConnectedError,
    PayloadTooLargeError,
    UnknownEventError,
    WireError,
    decode,
    emit_service_subject,
    encode,
)

__all__ = ["REPLY_GRACE_S", "service_emit", "wire_error_to_exception"]

REPLY_GRACE_S = 1.5
"""Seconds past an emit's ``timeout_s`` the request waits for the reply: the service
settles an approval for up to 1 s past the deadline, then the reply travels."""

_DEFAULT_WAIT_S = 60.0
"""Seconds to wait for a reply when the emit has no ``timeout_s``."""


def wire_error_to_exception(error: WireError) -> HookbusError:
    """The hookbus error a service's `WireError` stands for (``unknown_event`` ->
    `UnknownEventError`, bad input -> `BadRequestError`, anything else -> `HookbusError`
    with the code and message)."""
    if error.code == "unknown_event":
        return UnknownEventError(error.message)
    if error.code == "payload_too_large":
        return PayloadTooLargeError(error.message)
    if error.code == "bad_request":
        return BadRequestError(error.message)
    return HookbusError(f"the dispatcher service answered {error.code}: {error.message}")


def service_emit(nc: NATS, *, agent_id: str | None = None, retries: int = 2) -> Emit:
    """An `Emit` that sends an `EmitRequest` to the dispatcher service on `nc`.

    Args:
        nc: a connected client.
        agent_id: the agent the emits act as (the ``<agent>`` subject token; on a secured
            server, the one this connection's user may act as). None: no agent.
        retries: times a retryable error reply (``busy``, ``unavailable``) is sent again,
            within the emit's deadline, with the same idempotency key.

    The returned function raises `NotConnectedError` (no service answers, NATS failed),
    `HookbusTimeoutError` (no reply within ``timeout_s`` + `REPLY_GRACE_S`),
    `WireFormatError` (a reply that is not an `EmitReply`) or the error the service
    answered (`wire_error_to_exception`). Never a nats-py error.
    """

    async def emit(event: str, data: dict[str, Any], **options: Unpack[EmitOptions]) -> HookResult:
        session = data.get("session_id")
        request = EmitRequest(
            data=data,
            agent_id=agent_id,
            session_id=session if isinstance(session, str) else None,
            **options,
        )
        subject = emit_service_subject(event, agent_id)
        payload = encode(request)
        timeout_s = request.timeout_s
        wait = (timeout_s if timeout_s is not None else _DEFAULT_WAIT_S) + REPLY_GRACE_S
        deadline = Deadline.after(wait)  # on the loop's clock
        attempt = 0
        while True:
            msg = await _request(nc, subject, payload, max(0.01, deadline.left()), wait)
            reply = decode(msg, EmitReply)
            if reply.error is None and reply.result is not None:
                return reply.result
            error = reply.error or WireError(code="internal", message="a reply with no result")
            if error.retryable and attempt < retries and deadline.left() > 0.1:
                attempt += 1
                await asyncio.sleep(0.05 * attempt)
                continue
            raise wire_error_to_exception(error)

    return emit


async def _request(nc: NATS, subject: str, payload: bytes, timeout: float, wait: float) -> bytes:
    headers: dict[str, str] = {}
    propagate.inject(headers)  # the caller's trace (nothing when there is none)
    try:
        msg = await nc.request(subject, payload, timeout=timeout, headers=headers or None)
    except Exception as exc:
        import nats.errors

        if isinstance(exc, nats.errors.NoRespondersError):
            raise NotConnectedError(
                f"no hookbus dispatcher service answers on {subject} (run `hookbus dispatcher`)"
            ) from exc
        if isinstance(exc, nats.errors.TimeoutError | TimeoutError):
            raise HookbusTimeoutError(
                f"the dispatcher service did not answer within {wait:g}s"
            ) from exc
        if isinstance(exc, nats.errors.Error | OSError):
            raise NotConnectedError(f"NATS request failed: {exc or type(exc).__name__}") from exc
        raise
    return msg.data
