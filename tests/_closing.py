"""Connections a test opens with a connect function of its own (one that also returns
something beside the connection: the async errors it received, say), all closed together."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ParamSpec, TypeVar

from nats.aio.client import Client as NATS

__all__ = ["closing"]

P = ParamSpec("P")
T = TypeVar("T")


@contextlib.asynccontextmanager
async def closing(
    connect: Callable[P, Awaitable[tuple[NATS, T]]],
) -> AsyncIterator[Callable[P, Awaitable[tuple[NATS, T]]]]:
    """`connect` as it is, except that every connection it opened is closed on exit (in
    the order opened; one that failed to open is `connect`'s to close)."""
    opened: list[NATS] = []

    async def connect_kept(*args: P.args, **kwargs: P.kwargs) -> tuple[NATS, T]:
        nc, extra = await connect(*args, **kwargs)
        opened.append(nc)
        return nc, extra

    try:
        yield connect_kept
    finally:
        for nc in opened:
            await nc.close()
