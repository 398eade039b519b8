"""Helpers the test modules share: a started `HookWorker` with given handlers (`serving`),
a dispatcher waited on until it routes them (`until_routed`, `audited`), a handler that
tells when it is cancelled (`sleeper`), and an emit that a worker's shutdown cuts short
(`emit_during_shutdown`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
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


def sleeper(name: str, seconds: float) -> tuple[Callable[..., Awaitable[None]], asyncio.Event]:
    """A handler named `name` that sleeps `seconds`, and the event it sets once cancelled
    (when what runs it stops waiting for it)."""
    cancelled = asyncio.Event()

    async def sleep(event: str, data: dict[str, Any]) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    sleep.__name__ = name
    return sleep, cancelled


async def until_routed(d: HookDispatcher, event: str, names: list[str]) -> None:
    """Wait (10 s at most) until `d` routes `event` to the handlers `names`, in that order."""
    with anyio.fail_after(10):
        while d.list_handlers(event)[event] != names:  # noqa: ASYNC110
            await anyio.sleep(0.01)


@contextlib.asynccontextmanager
async def audited(
    connect: Callable[[], Awaitable[NATS]],
    agent: str,
    worker_nc: NATS,
    *handlers: tuple[str, Callable[..., Any], dict[str, Any]],
) -> AsyncIterator[HookDispatcher]:
    """`handlers` ``(event, fn, options)`` served on `worker_nc` (one event; each options
    names its handler, in priority order), and agent `agent`'s dispatcher (audit on) on a
    connection of its own, yielded once it routes to all of them in that order."""
    (event,) = {ev for ev, _, _ in handlers}
    async with (
        serving(worker_nc, *handlers),
        HookDispatcher(await connect(), agent_id=agent, audit=True) as d,
    ):
        await until_routed(d, event, [options["name"] for _, _, options in handlers])
        yield d


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
