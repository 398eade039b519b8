"""An emit running in the background of a task group, for the tests that answer what it
waits on (an approval) while it waits."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from hookbus.schemas import HookResult

__all__ = ["Emitted", "in_background"]


class Emitted:
    """An emit running in the background: its `result` once `done` is set, and when it
    `started` (`time.monotonic`, seconds)."""

    def __init__(self, wait_s: float = 10) -> None:
        self.result: HookResult | None = None
        self.started = 0.0
        self.done = anyio.Event()
        self._wait_s = wait_s

    async def wait(self, timeout_s: float | None = None) -> HookResult:
        """The emit's result, within `timeout_s` seconds (None: the `wait_s` it was made
        with).

        Raises:
            TimeoutError: no result by then.
        """
        with anyio.fail_after(self._wait_s if timeout_s is None else timeout_s):
            await self.done.wait()
        assert self.result is not None
        return self.result


def in_background(
    tg: Any, emit: Callable[[], Awaitable[HookResult]], wait_s: float = 10
) -> Emitted:
    """Start ``emit()`` in `tg`; its `Emitted` (`wait_s`: how long its `wait` waits by
    default, seconds). An error of the emit fails the task group, as it would the caller."""
    out = Emitted(wait_s)

    async def run() -> None:
        try:
            out.started = time.monotonic()
            out.result = await emit()
        finally:
            out.done.set()

    tg.start_soon(run)
    return out
