"""Calling one handler within its timeout, timed by this process (`HandlerCaller`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from types import CoroutineType
from typing import Any, Final

import anyio

from hookbus._core.results import to_hook_result
from hookbus.schemas import ChainStep, HookbusError, HookReply, WireError

from ._coroutines import Resumed
from ._spec import HandlerSpec

__all__ = ["HandlerCaller"]

log = logging.getLogger("hookbus.workers")

_CONTINUE: Final = to_hook_result(None)
"""What a handler returning None answers (the one shared result `to_hook_result` gives)."""


class HandlerCaller:
    """Runs a worker's handlers, one call at a time each, within a timeout it enforces
    itself; and remembers which handlers were seen to wait (suspend) when called, which
    a chain request reads to tell its progress ahead of a step (`may_wait`)."""

    __slots__ = ("_returns_at_once", "_waits")

    def __init__(self) -> None:
        self._waits: set[tuple[str, str]] = set()
        """Handlers seen to wait on something (suspend) when called: see `may_wait`."""
        self._returns_at_once: set[tuple[str, str]] = set()
        """Handlers called in a chain that returned without waiting, never seen to wait."""

    def returned(self, spec: HandlerSpec) -> None:
        """A chain's step of `spec` returned: it is taken to return at once from now on,
        unless a call showed (or shows) it waits."""
        self._returns_at_once.add(spec.key)

    def may_wait(self, run: list[tuple[ChainStep, HandlerSpec]]) -> bool:
        """Whether a step of `run` is likely to wait on something (suspend): then the
        replies so far are reported before it starts, ahead of anything it sends itself
        (a process killed just after would otherwise take them along). A handler is taken
        to wait until a call showed it returns at once, and for good once one showed it
        waits; sync handlers run in a thread: they always wait. A step that waits against
        that guess reports the moment it does (`ChainProgress.suspended`)."""
        for _, spec in run:
            key = spec.key
            if not spec.is_async or key in self._waits or key not in self._returns_at_once:
                return True
        return False

    async def invoke(
        self,
        spec: HandlerSpec,
        event: str,
        data: dict[str, Any],
        timeout_s: float,
        emit_id: str,
        suspended: Callable[[], None] | None = None,
    ) -> HookReply:
        """Run one handler within `timeout_s` seconds; its result or the error, as a reply.

        The process that runs a handler times it: a handler still running at `timeout_s`
        is cut (``handler_timeout``), and so is one that returns after it without having
        given the loop a chance to cut it (it computed without awaiting): its late result
        is not used, as a dispatcher timing the call would not have used it. A handler
        that raises answers ``handler_error``, one whose result cannot be read
        ``bad_result``; nothing is raised.
        `suspended()`: called the moment the handler really waits (its coroutine suspends,
        or it runs in a thread), before the loop runs anything else."""
        decl = spec.declaration
        started = time.monotonic()
        try:
            if spec.is_async:
                coro = spec.fn(event, data)
                if type(coro) is not CoroutineType:  # another awaitable: no first step here
                    if suspended is not None:
                        suspended()
                    async with asyncio.timeout(timeout_s):
                        raw = await coro
                else:
                    # The handler's first step runs before any timer is armed: asyncio's
                    # timeout acts only through its timer's callback, which the loop runs
                    # only once the task suspends, so a handler that returns (or raises)
                    # without suspending is never cut by it, and needs no timer at all.
                    # One that suspends gets its timer at the deadline counted from
                    # before its first step, and the rest of it is awaited under it.
                    try:
                        suspended_on = coro.send(None)
                    except StopIteration as done:
                        raw = done.value
                    else:
                        self._waits.add(spec.key)  # it waits: see `may_wait`
                        if suspended is not None:
                            suspended()
                        loop = asyncio.get_running_loop()
                        deadline = loop.time() + timeout_s - (time.monotonic() - started)
                        async with asyncio.timeout_at(deadline):
                            raw = await Resumed(coro, suspended_on)
            else:
                if suspended is not None:
                    suspended()
                async with asyncio.timeout(timeout_s):  # cheaper than anyio's on this path
                    raw = await anyio.to_thread.run_sync(
                        spec.fn, event, data, abandon_on_cancel=True
                    )
                    if inspect.isawaitable(raw):
                        raw = await raw
            if time.monotonic() - started > timeout_s:
                raise TimeoutError  # it held the loop past its time: nothing could cut it
        except TimeoutError:
            return HookReply(
                handler=decl.name,
                error=WireError(code="handler_timeout", message=f"ran past {timeout_s:.3g}s"),
            )
        except Exception as exc:
            log.warning("handler %s raised on %s: %r", decl.name, emit_id, exc)
            return HookReply(
                handler=decl.name,
                error=WireError(code="handler_error", message=f"{type(exc).__name__}: {exc}"),
            )
        try:
            result = _CONTINUE if raw is None else to_hook_result(raw)
        except HookbusError as exc:
            return HookReply(
                handler=decl.name, error=WireError(code="bad_result", message=str(exc))
            )
        return HookReply(handler=decl.name, result=result)
