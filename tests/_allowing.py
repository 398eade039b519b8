"""An emit run while an approver answers "Allow" to the approval it asks for
(`emitted_allowed`), for the tests that look at what an approved emit leaves behind."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from hookbus.dispatcher import ApprovalsClient, HookEventStream

__all__ = ["emitted_allowed"]

T = TypeVar("T")


async def emitted_allowed(
    emit: Awaitable[T], event: str, stream: HookEventStream, approvals: ApprovalsClient
) -> T:
    """What `emit` returns while `approvals` answers "Allow" (as approver ``tester``) to the
    first pending approval of `event` on the suspension event `stream`; that answer must
    be given within 10 s of `emit`'s end. `stream` is closed afterwards."""

    async def approve() -> None:
        async for ev in stream:
            if ev.hook.status == "pending" and ev.hook.metadata.get("event") == event:
                await approvals.answer_approval(
                    ev.hook.label, "Allow", approver="tester", agent_id=ev.hook.agent_id
                )
                return

    approver = asyncio.create_task(approve())
    try:
        result = await emit
        await asyncio.wait_for(approver, 10)
    finally:
        approver.cancel()
        await stream.aclose()
    return result
