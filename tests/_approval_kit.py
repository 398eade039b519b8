"""What the framework integrations' tests share about approvals: a handler's result asking
for one (`asking`), and the next approval a hook event stream shows pending
(`pending_approval`)."""

from __future__ import annotations

import anyio

from hookbus.dispatcher import APPROVAL_LABEL_PREFIX, HookEventStream, PendingHook
from hookbus.schemas import HookResult

__all__ = ["asking", "pending_approval"]


def asking(prompt: str, timeout_s: float) -> HookResult:
    """A handler's result asking a human `prompt`, with the options "Allow once" and "Deny";
    the approval waits at most `timeout_s` seconds."""
    return HookResult(
        action="ask_user",
        approval_prompt=prompt,
        approval_options=["Allow once", "Deny"],
        approval_timeout=timeout_s,
    )


async def pending_approval(stream: HookEventStream, within_s: float = 20.0) -> PendingHook:
    """The next approval the hook event `stream` shows pending (within `within_s` seconds)."""
    with anyio.fail_after(within_s):
        async for event in stream:
            hook = event.hook
            if hook.status == "pending" and hook.label.startswith(APPROVAL_LABEL_PREFIX):
                return hook
    raise AssertionError("the hook event stream ended")
