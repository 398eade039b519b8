"""What the framework integrations' tests do alike: an agent's dispatcher whose ``bash``
calls a worker denies (`denying_bash`) and the call it was asked about (`denied_bash_call`),
a handler's result asking for an approval (`asking`), the next approval a hook event stream
shows pending (`pending_approval`), and a call made while alice answers the approval it asks
for (`answered`); the agent's tools as plain functions that record their calls
(`RecordedTools`). The plumbing beneath (connections, workers, handlers) is
`_integration_kit`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from _integration_kit import Connect, returning, worker

from hookbus.dispatcher import (
    APPROVAL_LABEL_PREFIX,
    ApprovalsClient,
    HookDispatcher,
    HookEventStream,
    PendingHook,
)
from hookbus.schemas import TOOL_PRE, HookResult

__all__ = [
    "RecordedTools",
    "answered",
    "asking",
    "denied_bash_call",
    "denying_bash",
    "pending_approval",
]

T = TypeVar("T")


@contextlib.asynccontextmanager
async def denying_bash(
    connect: Connect, reason: str, seen: list[Any]
) -> AsyncIterator[HookDispatcher]:
    """The dispatcher of agent ``agent-1``, on a connection of its own, while a worker's
    ``security`` handler denies every ``bash`` call with `reason` (its tool filter spares
    the other tools); the handler appends the ``(event, data)`` it is asked with to `seen`."""
    deny = HookResult(action="deny", reason=reason)
    async with (
        worker(connect, (TOOL_PRE, returning("security", deny, seen), {"tool_filter": ["bash"]})),
        HookDispatcher(await connect(), agent_id="agent-1") as d,
    ):
        yield d


def denied_bash_call(seen: list[Any]) -> dict[str, Any]:
    """The data of the one call `denying_bash`'s handler was asked about (`seen`): the
    ``tool:pre`` of ``bash rm -rf /`` (its tool filter spared the other tools)."""
    [(event, data)] = seen
    assert event == TOOL_PRE and data["tool_name"] == "bash"
    assert data["tool_input"] == {"command": "rm -rf /"}
    return dict(data)


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


async def answered(
    call: Callable[[], Awaitable[T]],
    approver: ApprovalsClient | HookDispatcher,
    stream: HookEventStream,
    choice: str,
) -> tuple[T, PendingHook]:
    """What `call` returns while alice answers `choice` to the next approval `stream` shows
    pending (within 20 s), and that approval."""
    out: list[T] = []

    async def run() -> None:
        out.append(await call())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        hook = await pending_approval(stream)
        await approver.answer_approval(hook.label, choice, approver="alice", agent_id=hook.agent_id)
    return out[0], hook


@dataclass
class RecordedTools:
    """An agent's tools as plain functions, for a framework to wrap: ``bash`` ("ran
    COMMAND"), ``send_email`` ("sent to TO") and ``transfer`` ("sent AMOUNT to PAYEE");
    each records its call as ``(tool, arguments)`` in `ran` before it answers."""

    ran: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def functions(self) -> dict[str, Callable[..., Any]]:
        """Tool name -> its function (named, annotated and documented for the framework)."""

        def bash(command: str) -> str:
            """Run a shell command."""
            self.ran.append(("bash", {"command": command}))
            return f"ran {command}"

        def send_email(to: str, body: str) -> str:
            """Send an e-mail."""
            self.ran.append(("send_email", {"to": to, "body": body}))
            return f"sent to {to}"

        def transfer(amount: int, payee: str) -> str:
            """Transfer money."""
            self.ran.append(("transfer", {"amount": amount, "payee": payee}))
            return f"sent {amount} to {payee}"

        return {"bash": bash, "send_email": send_email, "transfer": transfer}
