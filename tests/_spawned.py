"""A ``hook`` call running in the test's task group, and what it ended with (`spawn_hook`),
for the suspension tests that resolve, cancel or time out a waiter while it waits."""

from __future__ import annotations

from typing import Any

import anyio
from anyio.abc import TaskGroup

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookbusError

__all__ = ["Outcome", "spawn_hook"]


class Outcome:
    """What one `hook` call ended with: its `value`, or the hookbus `error` it raised; `done`
    is set either way."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: HookbusError | None = None
        self.done = anyio.Event()

    async def wait(self, timeout_s: float = 10) -> Outcome:
        """This outcome once the call has ended (at most `timeout_s` seconds)."""
        with anyio.fail_after(timeout_s):
            await self.done.wait()
        return self


def spawn_hook(
    tg: TaskGroup, d: HookDispatcher, label: str, payload: Any = None, **kw: Any
) -> Outcome:
    """Start ``d.hook(label, payload, **kw)`` in `tg`; a non-hookbus error fails the test."""
    out = Outcome()

    async def run() -> None:
        try:
            out.value = await d.hook(label, payload, **kw)
        except HookbusError as exc:
            out.error = exc
        finally:
            out.done.set()

    tg.start_soon(run)
    return out
