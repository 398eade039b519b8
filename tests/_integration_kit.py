"""What the framework integrations' tests share: connections to the test's private server
(`private_connect`, a fixture: name it `connect` in the test module), a `HookWorker` serving some
handlers on a connection of its own (`worker`), and handlers that return a fixed result
(`returning`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from conftest import connections
from nats.aio.client import Client as NATS

from hookbus.cli import EmbeddedNatsServer
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

__all__ = ["Connect", "Handler", "named", "private_connect", "returning", "worker"]

Connect = Callable[..., Awaitable[NATS]]
Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]


@pytest.fixture
async def private_connect(embedded_server: EmbeddedNatsServer) -> AsyncIterator[Connect]:
    """Connections to this test's private server (one per simulated process)."""
    async with connections(
        embedded_server.url, max_reconnect_attempts=1, reconnect_time_wait=0.1
    ) as make:
        yield make


@contextlib.asynccontextmanager
async def worker(
    connect: Connect, *handlers: tuple[str, Handler, dict[str, Any]]
) -> AsyncIterator[HookWorker]:
    """A `HookWorker` on a connection of its own, serving `(event, fn, options)`."""
    w = HookWorker(await connect())
    for event, fn, options in handlers:
        w.add_handler(event, fn, **options)
    async with w:
        yield w


def named(name: str, fn: Handler) -> Handler:
    fn.__name__ = name
    return fn


def returning(name: str, result: HookResult | None, seen: list[Any] | None = None) -> Handler:
    """A handler named `name` that returns `result` (appending ``(event, data)`` to `seen`)."""

    async def handler(event: str, data: dict[str, Any]) -> HookResult | None:
        if seen is not None:
            seen.append((event, data))
        return result

    return named(name, handler)
