"""Calling one handler, in-process or over NATS, and turning what happens into an outcome.

An outcome is either the handler's `HookResult` or a `Failed` (kind + message) for the
failure policy to judge. Only caller errors (an oversize payload, a closed connection)
raise; everything a handler, a replica or the network does is an outcome — a reply of any
bytes at all included.

Remote calls go through a `Requester`: one reply inbox per connection, a future per call.
A call has a budget (seconds: the handler's timeout, cut to what the emit has left), sent in
the envelope as ``budget_s`` so the worker never runs past it. Within it:

- an error reply marked ``retryable`` (``busy``, ``unavailable``: the handler did not run)
  is sent again at once, to whichever replica the queue group picks;
- a handler declared ``retry_safe`` that is unanswered after a fraction of the budget
  (`HEDGE_FRACTION`, at least `HEDGE_MIN_S`) is sent again (hedged), then once per half
  such window while the budget lasts (at most `MAX_RESENDS` extra requests: the queue group
  picks a replica at random, so each further request halves the odds of landing on the
  stalled one again), and the first answer wins. A handler not declared retry_safe is
  never sent twice unless a replica said it did not run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

import anyio
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hookbus.schemas import (
    EventEnvelope,
    FailureKind,
    HookReply,
    HookResult,
    NotConnectedError,
    PayloadTooLargeError,
    WireFormatError,
    collect_reply_subject,
    decode,
    encode,
    to_hook_result,
)

from ._routes import Route

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEDGE_FRACTION",
    "HEDGE_MIN_S",
    "Failed",
    "Outcome",
    "Requester",
    "call_local",
    "call_remote",
    "coerce_result",
    "nats_failure",
]

log = logging.getLogger("hookbus.dispatcher")

DEFAULT_TIMEOUT_S = 5.0
"""Seconds a remote call waits when its route gives no timeout."""
HEDGE_FRACTION = 0.25
"""A retry_safe call unanswered after this fraction of its budget is sent again."""
HEDGE_MIN_S = 0.05
"""Seconds: the shortest hedging window."""
MAX_RESENDS = 8
"""At most this many extra requests per call (hedges and retries of refused requests)."""
MAX_REFUSALS = 8
"""A call refused (``busy``/``unavailable``) this many times fails (kind ``error``): the
queue group picks a replica at random, so with one of two replicas refusing a call fails
1 time in 256; with every replica overloaded, more requests would only add load."""

_STATUS = "Status"
_NO_RESPONDERS = "503"


@dataclass(frozen=True, slots=True)
class Failed:
    """A handler call that gave no usable result."""

    kind: FailureKind
    message: str


Outcome = HookResult | Failed

_ERROR_KINDS: dict[str, FailureKind] = {
    "handler_timeout": "timeout",
    "deadline_exceeded": "timeout",
    "bad_result": "bad_reply",
}
"""Worker error codes that map to a failure kind other than ``error``."""

_CONNECTION_ERRORS = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
)


def coerce_result(raw: Any) -> Outcome:
    """A handler's return value as an outcome: see `hookbus.schemas.to_hook_result`."""
    try:
        return to_hook_result(raw)
    except WireFormatError as exc:
        return Failed("bad_reply", str(exc))


def nats_failure(exc: BaseException) -> Failed:
    """A nats-py error met while sending, as a failure for the policy (never raised)."""
    return Failed("error", f"NATS: {type(exc).__name__}: {exc}".rstrip(": "))


def _cut(timeout_s: float | None, budget_s: float | None) -> float | None:
    if timeout_s is None:
        return budget_s
    if budget_s is None:
        return timeout_s
    return min(timeout_s, budget_s)


async def call_local(
    route: Route, event: str, data: dict[str, Any], budget_s: float | None = None
) -> Outcome:
    """Call an in-process handler (async or sync) within its timeout cut to `budget_s`
    (seconds the emit has left; None: no overall deadline)."""
    assert route.local is not None
    timeout_s = _cut(route.timeout_s, budget_s)
    if timeout_s is not None and timeout_s <= 0:
        return Failed("timeout", "not called: the emit's deadline had passed")
    try:
        with anyio.fail_after(timeout_s):
            raw = route.local(event, data)
            if inspect.isawaitable(raw):
                raw = await raw
    except TimeoutError:
        return Failed("timeout", f"no result within {timeout_s:.3g}s")
    except Exception as exc:
        return Failed("error", f"{type(exc).__name__}: {exc}")
    return coerce_result(raw)


def judge_reply(msg: Msg) -> Outcome | None:
    """One reply message as an outcome; None for a status with no body (no responders).

    Every byte string ends as an outcome: status messages with a body, invalid UTF-8,
    nesting too deep, wrong types and empty bodies are all ``bad_reply``.
    """
    headers = msg.headers or {}
    status = headers.get(_STATUS)
    if status is not None:
        if not msg.data and status == _NO_RESPONDERS:
            return None
        return Failed("bad_reply", f"a status {status!r} message, not a HookReply")
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


def _retryable(msg: Msg) -> str | None:
    """The error code of a reply that says "not run, send it again", else None."""
    if msg.headers and _STATUS in msg.headers:
        return None
    try:
        reply = decode(msg.data, HookReply)
    except WireFormatError:
        return None
    err = reply.error
    if err is not None and err.retryable and err.code in ("busy", "unavailable"):
        return err.code
    return None


class Requester:
    """Requests with a reply inbox of our own (one subscription per connection).

    nats-py's ``request`` reads any reply with a 503 status as "no responders", whatever
    its body, and cannot take several answers to one call; this can.
    """

    def __init__(self) -> None:
        self._prefix = ""
        self._sub: Subscription | None = None
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Queue[tuple[str, Msg]]] = {}

    @property
    def started(self) -> bool:
        return self._sub is not None

    async def start(self, nc: NATS) -> None:
        if self._sub is None:
            self._prefix = nc.new_inbox()
            self._sub = await nc.subscribe(
                collect_reply_subject(self._prefix, "*"), cb=self._on_reply
            )

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        queue = self._waiting.get(token)
        if queue is not None:
            queue.put_nowait((token, msg))

    async def call(
        self, nc: NATS, route: Route, envelope: EventEnvelope, headers: dict[str, str] | None,
        budget_s: float, *, hedge: bool,
    ) -> Outcome:  # fmt: skip
        """Send `envelope` to `route` and wait at most `budget_s` seconds for an answer.

        Raises:
            NotConnectedError: the connection is closed.
            PayloadTooLargeError: the envelope exceeds the server's max_payload.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        window = max(HEDGE_MIN_S, budget_s * HEDGE_FRACTION) if hedge else math.inf
        queue: asyncio.Queue[tuple[str, Msg]] = asyncio.Queue()
        live: set[str] = set()
        refused: str | None = None
        refusals = 0
        try:
            for attempt in itertools.count(1):
                remaining = deadline - loop.time()
                if remaining <= 0 or attempt > MAX_RESENDS + 1:
                    break
                envelope.attempt = attempt
                envelope.budget_s = remaining
                token = f"{next(self._tokens):x}"
                self._waiting[token] = queue
                failed = await self._send(nc, route, envelope, headers, token)
                if failed is not None:
                    if not live:
                        return failed
                else:
                    live.add(token)
                next_send = loop.time() + (window if attempt == 1 else max(HEDGE_MIN_S, window / 2))
                while True:
                    wait = min(next_send, deadline) - loop.time()
                    try:
                        async with asyncio.timeout(max(wait, 0)):
                            token, msg = await queue.get()
                    except TimeoutError:
                        break  # hedge (retry_safe) or the budget is spent
                    live.discard(token)
                    self._waiting.pop(token, None)
                    code = _retryable(msg)
                    if code is not None:  # not run: send again, to any replica
                        refused, refusals = code, refusals + 1
                        if live:
                            continue
                        if refusals >= MAX_REFUSALS:
                            return Failed("error", f"{code}: refused {refusals} times")
                        await asyncio.sleep(min(0.005 * refusals, max(wait, 0)))
                        break
                    outcome = judge_reply(msg)
                    if outcome is not None:
                        return outcome
                    if not live:  # no replica subscribed: answered at once
                        return Failed(
                            "no_responders", f"no replica of {route.name!r} is subscribed"
                        )
                if loop.time() >= deadline:
                    break
        finally:
            for token in [t for t, q in self._waiting.items() if q is queue]:
                del self._waiting[token]
        if refused is not None and not live:
            return Failed("error", f"{refused}: every replica refused within {budget_s:.3g}s")
        return Failed("timeout", f"no reply within {budget_s:.3g}s")

    async def _send(
        self, nc: NATS, route: Route, envelope: EventEnvelope, headers: dict[str, str] | None,
        token: str,
    ) -> Failed | None:  # fmt: skip
        try:
            payload = encode(envelope)
        except (WireFormatError, OverflowError, TypeError, ValueError) as exc:
            return Failed("bad_reply", f"the data cannot be encoded: {exc}")
        if len(payload) > nc.max_payload:
            raise PayloadTooLargeError(
                f"event {envelope.event!r} is {len(payload)} bytes encoded; the server's"
                f" max_payload is {nc.max_payload} bytes"
            )
        try:
            await nc.publish(
                route.subject,
                payload,
                reply=collect_reply_subject(self._prefix, token),
                headers=headers,
            )
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLargeError(str(exc)) from exc
        except _CONNECTION_ERRORS as exc:
            raise NotConnectedError("the NATS connection is closed") from exc
        except nats.errors.Error as exc:
            return nats_failure(exc)
        return None


async def call_remote(
    nc: NATS | None,
    requester: Requester,
    route: Route,
    envelope: EventEnvelope,
    headers: dict[str, str] | None,
    budget_s: float | None = None,
) -> Outcome:
    """Request one remote handler on its subject and judge its `HookReply`.

    Waits the route's timeout (`DEFAULT_TIMEOUT_S` if it has none) cut to `budget_s`;
    hedges only a ``retry_safe`` route (see the module docstring).

    Raises:
        NotConnectedError: no connection, or it is closed.
        PayloadTooLargeError: the envelope exceeds the server's max_payload.
    """
    if nc is None or nc.is_closed or not requester.started:
        raise NotConnectedError(f"remote handler {route.name!r} needs a NATS connection")
    if not nc.is_connected:  # reconnecting: fail now, not after the handler's timeout
        return Failed("error", "not connected to NATS (reconnecting); the request was not sent")
    timeout_s = _cut(route.timeout_s or DEFAULT_TIMEOUT_S, budget_s)
    assert timeout_s is not None
    if timeout_s <= 0:
        return Failed("timeout", "not called: the emit's deadline had passed")
    retry_safe = bool(getattr(route, "retry_safe", False))
    return await requester.call(nc, route, envelope, headers, timeout_s, hedge=retry_safe)
