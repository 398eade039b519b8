"""What a worker sends back: a reply made sendable as JSON, and its debug line."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import msgspec

from hookbus._core.copies import json_copy
from hookbus.schemas import BadRequestError, HandlerDeclaration, HookReply, WireError, encode

__all__ = ["UNENCODABLE", "log_reply", "ready", "sendable", "sendable_step"]

log = logging.getLogger("hookbus.workers")

R = TypeVar("R")

UNENCODABLE = (TypeError, ValueError, OverflowError, msgspec.EncodeError)
"""What msgspec raises for a value JSON cannot carry."""


def sendable(reply: HookReply, *, every_field: bool = False) -> HookReply:
    """`reply` as it can be sent: data JSON does not carry natively converted as
    amplifier-core converts a handler's result (`json_copy`: a `Decimal` to a string, any
    other object to its ``str()``, as an in-process handler's is), or, when even that
    fails (data that refers to itself, a result field of the wrong type), a ``bad_result``
    error in its place: that handler fails (the fold denies a result it cannot read), the
    other handlers' replies stand. A chain checks a step's data at once, before the next
    step runs on it; `every_field`: the whole result (after the reply failed to encode).
    """
    result = reply.result
    if result is None or (result.data is None and not every_field):
        return reply
    try:
        encode(result if every_field else result.data)
        return reply
    except UNENCODABLE:
        pass
    try:
        if result.data is not None:
            result = msgspec.structs.replace(result, data=json_copy(result.data))
        encode(result)
    except (BadRequestError, *UNENCODABLE) as exc:
        message = f"the result cannot be sent as JSON: {type(exc).__name__}: {exc}"
        return HookReply(
            handler=reply.handler, error=WireError(code="bad_result", message=message[:500])
        )
    return HookReply(handler=reply.handler, result=result)


def sendable_step(reply: HookReply) -> tuple[HookReply, dict[str, Any] | None, int | None]:
    """`sendable(reply)` for a step of a chain, its result's data encoded once: the reply
    as it is sent (the data as that JSON, a `msgspec.Raw`, which the chain's replies copy
    as they are), the data the next step runs on if this one modifies (None: the result
    has none) and the length of its JSON in bytes (for that step's copy; None: not known,
    the data was converted). A reply `sendable` converts or refuses is that one."""
    result = reply.result
    if result is None or result.data is None:
        return reply, None, None
    try:
        encoded = encode(result.data)
    except UNENCODABLE:
        out = sendable(reply)  # converted as amplifier-core converts it, or bad_result
        data = out.result.data if out.result is not None else None
        return out, data, None
    sent = msgspec.structs.replace(result, data=msgspec.Raw(encoded))
    return msgspec.structs.replace(reply, result=sent), result.data, len(encoded)


async def ready(reply: R) -> R:
    """A reply known at once, as an awaitable (a request or a step that runs nothing)."""
    return reply


def log_reply(decl: HandlerDeclaration, reply: HookReply, kind: str, took_s: float) -> None:
    """One debug line per handler call answered (a chain's steps included): kind
    (``call`` or ``collect``), handler, outcome, time (`took_s`: seconds)."""
    if reply.error is not None:
        outcome = f"error {reply.error.code}"
    else:
        outcome = reply.result.action if reply.result is not None else "no result"
    log.debug("%s %s/%s: %s in %.1f ms", kind, decl.event, decl.name, outcome, took_s * 1000)
