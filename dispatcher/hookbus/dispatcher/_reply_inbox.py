"""Where a call's replies wait: `Inbox` (one call's replies, in arrival order) and
`Deadlines` (the millisecond timers its waits end by)."""

from __future__ import annotations

import asyncio
import collections
import math

from nats.aio.msg import Msg

__all__ = ["Deadlines", "Inbox"]


class Deadlines:
    """When the requester's waits time out, at millisecond granularity: one event-loop
    timer per millisecond that has waits ending in it, not one per wait. A loop timer per
    call costs a heap push (of handles compared in Python) and a cancel; here a call costs
    a set add and a discard. A wait ends at its `until` or at most 1 ms later, never
    earlier."""

    __slots__ = ("_buckets",)

    def __init__(self) -> None:
        self._buckets: dict[int, set[asyncio.Future[None]]] = {}

    def add(
        self, loop: asyncio.AbstractEventLoop, until: float, waiter: asyncio.Future[None]
    ) -> int:
        """Fail `waiter` with `TimeoutError` at `until` (loop time) unless it is done by
        then; returns the key `discard` takes."""
        key = math.ceil(until * 1000.0)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = set()
            loop.call_at(key / 1000.0, self._expire, key)
        bucket.add(waiter)
        return key

    def discard(self, key: int, waiter: asyncio.Future[None]) -> None:
        """`waiter` no longer needs its deadline (it is done)."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.discard(waiter)

    def _expire(self, key: int) -> None:
        for waiter in self._buckets.pop(key, ()):
            if not waiter.done():
                waiter.set_exception(TimeoutError())


class Inbox:
    """The replies of one call, in arrival order: a deque and at most one waiter (cheaper
    than an `asyncio.Queue` under `asyncio.timeout` on this path)."""

    __slots__ = ("deadlines", "items", "waiter")

    def __init__(self, deadlines: Deadlines) -> None:
        self.items: collections.deque[tuple[str, Msg]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.deadlines = deadlines

    def put(self, token: str, msg: Msg) -> None:
        self.items.append((token, msg))
        self.wake()

    def wake(self) -> None:
        """Wake the waiter (`get` then raises `TimeoutError` if nothing came)."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, loop: asyncio.AbstractEventLoop, until: float) -> tuple[str, Msg]:
        """The next reply; `TimeoutError` if none came by `until` (loop time; at most 1 ms
        later, see `Deadlines`)."""
        if not self.items:
            if until <= loop.time():
                raise TimeoutError
            waiter = self.waiter = loop.create_future()
            key = self.deadlines.add(loop, until, waiter)
            try:
                await waiter
            finally:
                self.deadlines.discard(key, waiter)
                self.waiter = None
            if not self.items:  # woken for something else
                raise TimeoutError
        return self.items.popleft()
