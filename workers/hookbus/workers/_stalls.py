"""When a request read now may really have come: the worker's event loop's stalls.

A worker dates a chain request from when it reads it. That is when it came, unless the
event loop could not read then: the process was paused (SIGSTOP), or a handler held the
loop (it computed without awaiting, or called a blocking library). The request may then
have waited in the socket since the stall began, while the dispatcher's clock ran on.
`LoopStalls` ticks on the loop; a tick that comes much later than asked marks a stall, and
a request read during one, or shortly after it, is dated from the stall's start: the
worker then finds the dispatcher may have given up on it and runs none of its steps,
instead of running a chain whose steps the dispatcher is already calling on their own.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["LoopStalls"]

TICK_S = 0.1
"""Seconds between ticks."""
STALL_S = 0.2
"""A tick this much later than asked marks a stall (a busy machine's scheduling delays stay
well below it)."""
AFTER_S = 1.0
"""Seconds after a stall during which a request read is dated from the stall's start (a
backlog that came during it is read within this)."""


class LoopStalls:
    """The stalls of the running event loop, measured by a tick (`start`, `stop`)."""

    __slots__ = ("_handle", "_last", "_stall")

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._stall: tuple[float, float] | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Tick on the running loop (again: nothing)."""
        if self._handle is None:
            self._last = time.monotonic()
            self._handle = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def dated(self, now: float) -> float:
        """The `time.monotonic()` from which a request read at `now` is dated: `now`, or
        the start of a stall it was read during or just after."""
        last = self._last
        if self._handle is not None and now - last > TICK_S + STALL_S:
            return last  # the loop is only now running again: its tick has not come yet
        stall = self._stall
        if stall is not None and now - stall[1] < AFTER_S:
            return stall[0]
        return now

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last > TICK_S + STALL_S:
            self._stall = (self._last, now)
        self._last = now
        self._handle = asyncio.get_running_loop().call_later(TICK_S, self._tick)
