"""The dispatcher service's two requests: emit and emit_and_collect (`RequestHandlers`),
each decoded, checked and answered with one reply, the result or a `WireError`
(`wire_error`).

The agent a request acts as is the one its subject names (`agent_of`); a body naming
another is refused. Timeouts in requests are clamped to the service's bounds and must be
finite numbers above 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from hookbus._core.log_limits import RateLimitedWarning, clip
from hookbus.schemas import (
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
    UnknownEventError,
    WireError,
    WireFormatError,
    agent_from_service_subject,
    decode,
    encode,
    event_from_service_subject,
)

from ._dispatcher import HookDispatcher
from ._telemetry import traced_dispatch

__all__ = ["RequestHandlers", "agent_of", "unavailable", "wire_error"]

log = logging.getLogger("hookbus.dispatcher")


def wire_error(exc: BaseException) -> WireError:
    """The structured error a failed request is answered with."""
    if isinstance(exc, UnknownEventError):
        return WireError(code="unknown_event", message=str(exc))
    if isinstance(exc, PayloadTooLargeError):
        return WireError(code="payload_too_large", message=str(exc))
    if isinstance(exc, BadRequestError | WireFormatError):
        return WireError(code="bad_request", message=str(exc))
    if isinstance(exc, SuspensionAbortedError | asyncio.CancelledError):
        return unavailable("the dispatcher is shutting down; send the request again")
    if isinstance(exc, NotConnectedError | HookbusTimeoutError | nats.errors.Error):
        return unavailable(f"NATS or JetStream is unreachable: {exc}")
    if isinstance(exc, HookbusError):
        return WireError(code="internal", message=str(exc))
    return WireError(code="internal", message=repr(exc))


def unavailable(message: str) -> WireError:
    """A retryable ``unavailable`` error: send the same request again, here or elsewhere."""
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


class RequestHandlers:
    """Answer the service's requests with `dispatcher`.

    Args:
        dispatcher: the dispatcher that decides.
        max_emit_timeout_s: upper bound of ``EmitRequest.timeout_s``, seconds.
        max_collect_timeout_s: upper bound of ``CollectRequest.timeout_s``, seconds.
    """

    def __init__(
        self,
        dispatcher: HookDispatcher,
        *,
        max_emit_timeout_s: float,
        max_collect_timeout_s: float,
    ) -> None:
        self._dispatcher = dispatcher
        self.max_emit_timeout_s = max_emit_timeout_s
        self.max_collect_timeout_s = max_collect_timeout_s
        self._refused = RateLimitedWarning(log, what="refused request(s)")
        """A refused request's WARNING: a few per interval one by one, the rest counted."""

    @traced_dispatch
    async def emit(self, msg: Msg) -> bytes:
        """Answer an emit request (an `EmitReply`, encoded): the decision, or the error."""
        try:
            event = event_from_service_subject(msg.subject)
            req = decode(msg.data, EmitRequest)
            agent = agent_of(msg.subject, req.agent_id, req.data.get("agent_id"))
            ids = {k: v for k, v in (("agent_id", agent), ("session_id", req.session_id)) if v}
            options: dict[str, Any] = {}
            if req.idempotency_key:
                options["idempotency_key"] = req.idempotency_key
            timeout_s = _timeout(req.timeout_s, maximum=self.max_emit_timeout_s, field="timeout_s")
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
    async def collect(self, msg: Msg) -> bytes:
        """Answer an emit_and_collect request (a `CollectReply`, encoded)."""
        try:
            event = event_from_service_subject(msg.subject)
            req = decode(msg.data, CollectRequest)
            agent_of(msg.subject, req.data.get("agent_id"))
            timeout_s = _timeout(
                req.timeout_s, maximum=self.max_collect_timeout_s, field="timeout_s"
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
        """The error reply of a failed request, logged (a bug of ours with its traceback)."""
        error = wire_error(exc)
        if error.code == "internal" and not isinstance(exc, HookbusError | msgspec.MsgspecError):
            log.exception("%s on %s failed", what, clip(msg.subject))  # a bug of ours: answer
        else:  # what a client sent: a flood of them is a few lines, each of bounded size
            self._refused.warn(
                "%s on %s refused (%s): %s", what, clip(msg.subject), error.code, clip(exc)
            )
        return error


def agent_of(subject: str, *claimed: object) -> str | None:
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
