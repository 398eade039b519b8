"""Load at a steady rate: calls from concurrent lanes, paced, until told to stop."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio


async def paced_lanes(
    one: Callable[[int], Awaitable[None]], stop: anyio.Event, *, lanes: int, rate_per_s: float
) -> None:
    """Call ``one(i)`` for i = 0, 1, 2, ... from `lanes` concurrent lanes (lane k takes
    k, k + lanes, ...) at `rate_per_s` calls a second in all, until `stop` is set. A steady
    rate, not a tight loop: a call that fails fast (a connection reconnecting) must not spin
    the event loop the reconnect needs."""

    async def lane(k: int) -> None:
        i, next_at = k, time.monotonic()
        while not stop.is_set():
            await one(i)
            i += lanes
            next_at = max(next_at + lanes / rate_per_s, time.monotonic())
            await anyio.sleep(max(0.0, next_at - time.monotonic()))

    async with anyio.create_task_group() as tg:
        for k in range(lanes):
            tg.start_soon(lane, k)
