"""What a handler call came to: its `HookResult`, or a `Failed` for the failure policy.

Everything a handler, a replica or the network does is an outcome, a reply of any bytes
at all included (`judge_reply`, `read_reply`): nothing here raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.msg import Msg

from hookbus._core.copies import json_copy
from hookbus._core.results import to_hook_result
from hookbus.schemas import (
    BadRequestError,
    FailureKind,
    HookReply,
    HookResult,
    WireFormatError,
    decode,
)

__all__ = [
    "NOT_RUN_CODES",
    "Failed",
    "Outcome",
    "coerce_result",
    "judge_reply",
    "nats_failure",
    "read_reply",
    "ready_outcome",
    "reply_outcome",
]

_STATUS = "Status"
_NO_RESPONDERS = "503"


@dataclass(frozen=True, slots=True)
class Failed:
    """A handler call that gave no usable result."""

    kind: FailureKind
    message: str


Outcome = HookResult | Failed


NOT_RUN_CODES = frozenset(
    {"bad_request", "busy", "unavailable", "deadline_exceeded", "not_ready", "stale_declaration"}
)
"""Worker error codes of a request that ran nothing (sent before any handler started)."""

_ERROR_KINDS: dict[str, FailureKind] = {
    "handler_timeout": "timeout",
    "deadline_exceeded": "timeout",
    "bad_result": "bad_reply",
}
"""Worker error codes that map to a failure kind other than ``error``."""


def coerce_result(raw: Any) -> Outcome:
    """A handler's return value as an outcome: see `hookbus.schemas.to_hook_result`.

    Its data becomes a JSON copy (as amplifier-core turns a handler's result into JSON), so
    later in-place edits by the handler or by the next one change nothing here. A value
    that cannot be read is a ``bad_reply`` (the fold denies it).
    """
    try:
        result = to_hook_result(raw)
        if result.data is not None:
            result = msgspec.structs.replace(result, data=json_copy(result.data))
    except (WireFormatError, BadRequestError) as exc:
        return Failed("bad_reply", str(exc))
    return result


def nats_failure(exc: BaseException) -> Failed:
    """A nats-py error met while sending, as a failure for the policy (never raised)."""
    return Failed("error", f"NATS: {type(exc).__name__}: {exc}".rstrip(": "))


def judge_reply(msg: Msg) -> Outcome | None:
    """One reply message as an outcome; None for a status with no body (no responders).

    Every byte string ends as an outcome: status messages with a body, invalid UTF-8,
    nesting too deep, wrong types and empty bodies are all ``bad_reply``.
    """
    return read_reply(msg)[0]


def reply_outcome(reply: HookReply) -> Outcome:
    """One handler's `HookReply` (alone or within a chain's) as an outcome."""
    err = reply.error
    if err is not None:
        return Failed(_ERROR_KINDS.get(err.code, "error"), f"{err.code}: {err.message}")
    if reply.result is None:
        return Failed("bad_reply", "reply carries neither result nor error")
    return reply.result


def read_reply(msg: Msg) -> tuple[Outcome | None, str | None, str]:
    """`judge_reply`, plus the error code of a reply that says "not run, send it again"
    (``busy`` or ``unavailable``, marked retryable; else None) and the id of the worker
    instance that answered ("" if unknown)."""
    headers = msg.headers or {}
    status = headers.get(_STATUS)
    if status is not None:
        if not msg.data and status == _NO_RESPONDERS:
            return None, None, ""
        return Failed("bad_reply", f"a status {status!r} message, not a HookReply"), None, ""
    try:
        reply = decode(msg.data, HookReply)
    except WireFormatError as exc:
        return Failed("bad_reply", str(exc)), None, ""
    err = reply.error
    if err is not None:
        failed = Failed(_ERROR_KINDS.get(err.code, "error"), f"{err.code}: {err.message}")
        again = err.code if err.retryable and err.code in ("busy", "unavailable") else None
        return failed, again, reply.instance
    if reply.result is None:
        return Failed("bad_reply", "reply carries neither result nor error"), None, reply.instance
    return reply.result, None, reply.instance


async def ready_outcome(outcome: Outcome) -> Outcome:
    """`outcome` as an awaitable (a call decided before anything was sent)."""
    return outcome


class _HandlerName(msgspec.Struct):
    handler: str


_handler_name = msgspec.json.Decoder(_HandlerName)


def _reply_handler(msg: Msg) -> str | None:
    """The handler a reply names, or None if it cannot be read."""
    try:
        return _handler_name.decode(msg.data).handler
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
