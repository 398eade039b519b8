"""Helpers the test modules share: a started `HookWorker` with given handlers (`serving`),
an emit that a worker's shutdown cuts short (`emit_during_shutdown`), and two concurrent
stops that wait for the work in flight (`stopped_twice_at_once`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker


@contextlib.asynccontextmanager
async def serving(
    conn: NATS, *handlers: tuple[str, Callable[..., Any], dict[str, Any]]
) -> AsyncIterator[HookWorker]:
    """A started `HookWorker` on `conn` with `(event, fn, options)` handlers."""
    w = HookWorker(conn)
    for event, fn, options in handlers:
        w.add_handler(event, fn, **options)
    async with w:
        yield w


async def emit_during_shutdown(
    connect: Callable[[], Awaitable[NATS]], w: HookWorker, event: str, running: asyncio.Event
) -> HookResult:
    """Emit `event` (empty data) through a dispatcher on a connection of its own; once a
    handler of the started worker `w` runs (`running` is set), shut `w` down with a grace of
    0.2 s. The emit's result (within 10 s)."""
    async with HookDispatcher(await connect()) as d:
        emit = asyncio.create_task(d.emit(event, {}))
        await running.wait()
        await w.shutdown(grace_s=0.2)
        return await asyncio.wait_for(emit, 10)


async def stopped_twice_at_once(
    stop: Callable[[], Awaitable[Any]], release: asyncio.Event, still_running: str
) -> None:
    """Call `stop` twice at once while work is in flight: neither call may return within
    0.3 s (failing with "a stop returned while `still_running`"); then set `release` (the
    work ends) and wait for both."""
    first = asyncio.create_task(stop())
    second = asyncio.create_task(stop())
    done, _ = await asyncio.wait({first, second}, timeout=0.3)
    assert done == set(), f"a stop returned while {still_running}"
    release.set()
    await asyncio.gather(first, second)
