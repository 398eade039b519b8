"""A helper the test modules share: a started `HookWorker` with given handlers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from nats.aio.client import Client as NATS

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
