"""A call that waits on an approval, answered by another process's `ApprovalsClient`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from hookbus.dispatcher import ApprovalsClient
from hookbus.schemas import HookPart

__all__ = ["answered"]

T = TypeVar("T")


async def answered(
    approver: ApprovalsClient,
    call: Callable[[], Awaitable[T]],
    asked: Callable[[HookPart], bool],
    choice: str,
    by: str = "alice",
) -> T:
    """Run ``call()`` while `approver` watches the hook events; answer the first pending
    approval that `asked` accepts with `choice` (as approver `by`); return what the call
    returned.

    Raises:
        TimeoutError: no such approval was asked within 10 s.
    """
    events = await approver.events()
    out: list[T] = []

    async def run() -> None:
        out.append(await call())

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                async for e in events:
                    if e.hook.status == "pending" and asked(e.hook):
                        break
            await approver.answer_approval(
                e.hook.label, choice, approver=by, agent_id=e.hook.agent_id
            )
    finally:
        await events.aclose()
    return out[0]
