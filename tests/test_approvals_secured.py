"""Approvals on a secured server (`hookbus auth init`, static nkeys and JWTs alike): an
approver ends a pending approval by hand with a proven cancel, the waiting call is denied
at once naming the approver, and a client that is no approver can neither cancel nor
answer (the approval still stands)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from test_permissions import (  # noqa: F401  (fixtures)
    Client,
    Connect,
    Secure,
    _service_emit,
    _system,
    _until_served,
    as_,
    event,
    refused,
    secure,
)

from hookbus.dispatcher import ApprovalsClient, DispatcherService, HookDispatcher
from hookbus.schemas import (
    APPROVALS_BUCKET,
    ApprovalAnswer,
    SuspensionRecord,
    approval_answer_key,
    emit_service_subject,
    encode,
)

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def _asked(
    as_: Connect, event: str, command: str
) -> AsyncIterator[tuple[SuspensionRecord, ApprovalsClient, list[dict[str, Any]], Client]]:
    """A worker asking about `command`, the dispatcher service deciding for agent a2, a2's
    emit waiting on the approval: yields the pending record, approver alice's client, the
    list the emit's reply lands in (once it ends), and a2's client."""
    worker, _ = await _system(as_, event)
    service_client = await as_("dispatcher-dispatcher")
    service = DispatcherService(HookDispatcher(service_client.nc), service_client.nc)
    await service.start()
    client = await as_("agent-a2")
    alice = await as_("approver-alice")
    replies: list[dict[str, Any]] = []
    try:
        async with worker, ApprovalsClient(alice.nc, agent_id="a2") as approvals:
            await _until_served(client, emit_service_subject(event, "a2"))
            async with anyio.create_task_group() as tg:

                async def ask() -> None:
                    replies.append((await _service_emit(client, command))["result"])

                tg.start_soon(ask)
                with anyio.fail_after(20):
                    while True:
                        mine = [r for r in await approvals.pending_approvals()
                                if r.metadata.get("data", {}).get("tool_input", {}).get(
                                    "command") == command]  # fmt: skip
                        if mine:
                            break
                        await anyio.sleep(0.1)
                yield mine[0], approvals, replies, client
                tg.cancel_scope.cancel()
    finally:
        await service.stop()


async def _still_pending(approvals: ApprovalsClient, label: str) -> bool:
    return label in {r.label for r in await approvals.pending_approvals()}


async def test_an_approver_cancels_and_the_waiting_call_is_denied_at_once(
    as_: Connect, event: str
) -> None:
    async with _asked(as_, event, "ask cancel") as (record, approvals, replies, _):
        with anyio.fail_after(10):  # the approval's own timeout is 20 s
            await approvals.cancel_approval(
                record.label, approver="alice", reason="wrong tool", agent_id="a2"
            )
            while not replies:
                await anyio.sleep(0.05)
        assert not await _still_pending(approvals, record.label)
    result = replies[0]
    assert result["action"] == "deny", result
    assert result["reason"] == "approval cancelled: by alice: wrong tool", result


async def test_an_agent_can_neither_cancel_nor_answer(
    secure: Secure, as_: Connect, event: str
) -> None:
    async with _asked(as_, event, "ask agent") as (record, approvals, replies, agent):
        js = agent.nc.jetstream(timeout=2)
        for kind, choice in (("cancel", ""), ("answer", "Allow once")):
            proof = ApprovalAnswer(choice=choice, answered_by="alice", kind=kind)
            key = approval_answer_key(record.label, "a2", "alice")
            await refused(
                secure, agent, f"agent writes approver alice's {kind} proof",
                lambda: js.publish(f"$KV.{APPROVALS_BUCKET}.{key}", encode(proof)),
            )  # fmt: skip
        assert await _still_pending(approvals, record.label)
        assert not replies
        await approvals.cancel_approval(record.label, approver="alice", agent_id="a2")
