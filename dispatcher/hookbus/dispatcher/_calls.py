"""Calling one handler, in-process or over NATS, and turning what happens into an outcome.

An outcome is either the handler's `HookResult` or a `Failed` (kind + message) for the
failure policy to judge. Only caller errors (an oversize payload, a closed connection)
raise; everything a handler or the network does is an outcome.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import anyio
import nats.errors
from nats.aio.client import Client as NATS

from hookbus.schemas import (
    EventEnvelope,
    FailureKind,
    HookReply,
    HookResult,
    NotConnectedError,
    PayloadTooLargeError,
    WireFormatError,
    decode,
    encode,
    to_hook_result,
)

from ._routes import Route

__all__ = ["Failed", "Outcome", "call_local", "call_remote", "coerce_result"]

log = logging.getLogger("hookbus.dispatcher")


@dataclass(frozen=True, slots=True)
class Failed:
    """A handler call that gave no usable result."""

    kind: FailureKind
    message: str


Outcome = HookResult | Failed

_ERROR_KINDS: dict[str, FailureKind] = {"handler_timeout": "timeout", "bad_result": "bad_reply"}
"""Worker error codes that map to a failure kind other than ``error``."""


def coerce_result(raw: Any) -> Outcome:
    """A handler's return value as an outcome: see `hookbus.schemas.to_hook_result`."""
    try:
        return to_hook_result(raw)
    except WireFormatError as exc:
        return Failed("bad_reply", str(exc))


async def call_local(route: Route, event: str, data: dict[str, Any]) -> Outcome:
    """Call an in-process handler (async or sync) within its timeout, if it has one."""
    assert route.local is not None
    try:
        with anyio.fail_after(route.timeout_s):
            raw = route.local(event, data)
            if inspect.isawaitable(raw):
                raw = await raw
    except TimeoutError:
        return Failed("timeout", f"no result within {route.timeout_s}s")
    except Exception as exc:
        return Failed("error", f"{type(exc).__name__}: {exc}")
    return coerce_result(raw)


async def call_remote(
    nc: NATS | None, route: Route, envelope: EventEnvelope, headers: dict[str, str] | None
) -> Outcome:
    """Request one remote handler on its subject and decode its `HookReply`.

    Raises:
        NotConnectedError: no connection, or it is closed.
        PayloadTooLargeError: the envelope exceeds the server's max_payload.
    """
    if nc is None or nc.is_closed:
        raise NotConnectedError(f"remote handler {route.name!r} needs a NATS connection")
    if not nc.is_connected:  # reconnecting: fail now, not after the handler's timeout
        return Failed("error", "not connected to NATS (reconnecting); the request was not sent")
    timeout_s = route.timeout_s or 5.0
    envelope.budget_s = timeout_s
    payload = encode(envelope)
    if len(payload) > nc.max_payload:
        raise PayloadTooLargeError(
            f"event {envelope.event!r} is {len(payload)} bytes encoded; the server's"
            f" max_payload is {nc.max_payload} bytes"
        )
    try:
        msg = await nc.request(route.subject, payload, timeout=timeout_s, headers=headers)
    except nats.errors.NoRespondersError:
        return Failed("no_responders", f"no replica of {route.name!r} is subscribed")
    except nats.errors.TimeoutError:
        return Failed("timeout", f"no reply within {timeout_s}s")
    except nats.errors.MaxPayloadError as exc:
        raise PayloadTooLargeError(str(exc)) from exc
    except nats.errors.ConnectionClosedError as exc:
        raise NotConnectedError("the NATS connection is closed") from exc
    try:
        reply = decode(msg.data, HookReply)
    except WireFormatError as exc:
        return Failed("bad_reply", str(exc))
    if reply.error is not None:
        kind = _ERROR_KINDS.get(reply.error.code, "error")
        return Failed(kind, f"{reply.error.code}: {reply.error.message}")
    if reply.result is None:
        return Failed("bad_reply", "reply carries neither result nor error")
    return reply.result
