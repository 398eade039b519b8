"""Calling one handler, in-process (`call_local`) or over NATS (`call_remote`), and
turning what happens into an outcome (`Outcome`: the handler's `HookResult` or a `Failed`
for the failure policy to judge).

Only caller errors (an oversize payload, a closed connection) raise; everything a
handler, a replica or the network does is an outcome. A remote call goes through the
connection's `Requester` (budget, retries, hedging: see `_requester`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import types
from collections.abc import Awaitable
from typing import Any

import anyio
from nats.aio.client import Client as NATS

from hookbus._core import clock
from hookbus._core.handler_options import DEFAULT_TIMEOUT_S, is_async_handler
from hookbus.schemas import EventEnvelope, NotConnectedError

from ._neighbours import Neighbours
from ._outcomes import Failed, Outcome, coerce_result, ready_outcome
from ._requester import Requester
from ._route_table import Route

__all__ = ["SyncHandler", "call_local", "call_remote"]

_COROUTINE = types.CoroutineType
"""An async handler's result: awaited without the general `inspect.isawaitable` check."""


def _cut(timeout_s: float | None, budget_s: float | None) -> float | None:
    if timeout_s is None:
        return budget_s
    if budget_s is None:
        return timeout_s
    return min(timeout_s, budget_s)


class SyncHandler(functools.partial[Any]):
    """An in-process handler that is a plain function (not a coroutine function), as
    registered (`LocalHandlers`): `call_local` runs it in a worker thread when its call
    has a time limit. Calling it calls the function (``func``), at the cost of a C-level
    `functools.partial` call."""

    @staticmethod
    def wrap(handler: Any) -> Any:
        """`handler` as `call_local` takes it: an async handler (`is_async_handler`: a
        coroutine function, or an object whose ``__call__`` is one) as it is, anything
        else in a `SyncHandler`, as a `HookWorker` decides which handlers run in a
        thread."""
        if is_async_handler(handler):
            return handler
        return SyncHandler(handler)


async def call_local(
    route: Route, event: str, data: dict[str, Any], budget_s: float | None = None
) -> Outcome:
    """Call an in-process handler (async or sync) within its timeout cut to `budget_s`
    (seconds the emit has left; None: no overall deadline). Past it the call is a
    ``timeout`` failure.

    A call without any time limit runs a sync handler (`SyncHandler`) on the event loop,
    as amplifier-core would. With one, it runs it as a `HookWorker` does: in a worker
    thread (anyio's, at most 40 at once: a call waiting for one waits within its limit),
    the wait for it cut at the limit. A thread cannot be stopped: one cut keeps running
    until the function returns, its result is discarded. An async handler is cancelled
    at the limit, and one that returns after it without having let the loop cut it (it
    computed without awaiting) fails as ``timeout`` too, as on a worker.
    """
    assert route.local is not None
    timeout_s = _cut(route.timeout_s, budget_s)
    if clock.no_time_left(timeout_s):
        return Failed("timeout", "not called: the emit's deadline had passed")
    try:
        if timeout_s is None:  # no cancel scope at all: most of an in-process call's cost
            raw = route.local(event, data)
            if type(raw) is _COROUTINE or inspect.isawaitable(raw):
                raw = await raw
        else:
            local = route.local
            started = clock.now()
            async with asyncio.timeout(timeout_s):
                if type(local) is SyncHandler:  # off the loop, or nothing could cut it
                    raw = await anyio.to_thread.run_sync(
                        local.func, event, data, abandon_on_cancel=True
                    )
                else:
                    raw = local(event, data)
                if inspect.isawaitable(raw):
                    raw = await raw
            if clock.now() - started > timeout_s:  # it held the loop past its limit
                return Failed("timeout", f"returned after its {timeout_s:.3g}s")
    except TimeoutError as exc:
        if timeout_s is None:  # the handler's own TimeoutError, not ours
            return Failed("error", f"TimeoutError: {exc}")
        return Failed("timeout", f"no result within {timeout_s:.3g}s")
    except Exception as exc:
        return Failed("error", f"{type(exc).__name__}: {exc}")
    return coerce_result(raw)


def call_remote(
    nc: NATS | None,
    requester: Requester,
    route: Route,
    envelope: EventEnvelope,
    headers: dict[str, str] | None,
    budget_s: float | None = None,
    neighbours: Neighbours | None = None,
) -> Awaitable[Outcome]:
    """Request one remote handler on its subject and judge its `HookReply`; returns the
    call's awaitable (await it at once: a plain function, not a coroutine frame around
    the requester's).

    Gives the handler the route's timeout (`DEFAULT_TIMEOUT_S` if it has none) cut to
    `budget_s` (seconds the emit has left; None: no deadline), and waits past it, while a
    live worker may still answer, at most until `budget_s` (`Requester.call`: the grace,
    and the overlap of the emit's other calls in flight, `neighbours`); hedges only a
    ``retry_safe`` route (see `_requester`).

    Raises:
        NotConnectedError: no connection, or it is closed.
        PayloadTooLargeError: the envelope exceeds the server's max_payload (when awaited).
    """
    if nc is None or nc.is_closed or not requester.started:
        raise NotConnectedError(f"remote handler {route.name!r} needs a NATS connection")
    if not nc.is_connected:  # reconnecting: fail now, not after the handler's timeout
        return ready_outcome(
            Failed("error", "not connected to NATS (reconnecting); the request was not sent")
        )
    timeout_s = _cut(route.timeout_s or DEFAULT_TIMEOUT_S, budget_s)
    assert timeout_s is not None
    if clock.no_time_left(timeout_s):
        return ready_outcome(Failed("timeout", "not called: the emit's deadline had passed"))
    return requester.call(
        nc, route, envelope, headers, timeout_s, hedge=route.retry_safe,
        within_s=math.inf if budget_s is None else budget_s, neighbours=neighbours,
    )  # fmt: skip
