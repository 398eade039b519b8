"""Approvals on a secured server (`hookbus auth init`, static nkeys and JWTs alike): an
approver ends a pending approval by hand with a proven cancel, the waiting call is denied
at once naming the approver, and a client that is no approver can neither cancel nor
answer (the approval still stands)."""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import msgspec
import pytest
import test_permissions as _permissions
from _integration_kit import private_connect  # noqa: F401  (a fixture)
from test_permissions import (
    Client,
    Connect,
    Secure,
    _service_emit,
    _system,
    _until_served,
    refused,
)

from hookbus.cli._output import short_id
from hookbus.dispatcher import (
    ApprovalsClient,
    DispatcherService,
    HookDispatcher,
    _approval_answers,
)
from hookbus.dispatcher._approvals import CALLERS_DEADLINE
from hookbus.schemas import (
    APPROVALS_BUCKET,
    ApprovalAnswer,
    HookResult,
    SuspensionRecord,
    approval_answer_key,
    emit_service_subject,
    encode,
    suspension_key,
)

pytestmark = pytest.mark.anyio

# the secured server of either mode (nkey, JWT), its connections and event: shared fixtures
secure = _permissions.secure
as_ = _permissions.as_
event = _permissions.event


@dataclass
class Asked:
    """A pending approval of agent a2 whose emit (through the dispatcher service) waits."""

    record: SuspensionRecord
    approvals: ApprovalsClient  # approver alice's
    agent: Client  # a2's
    replies: list[dict[str, Any]] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)

    async def result(self) -> dict[str, Any]:
        """The emit's result, once it ended."""
        await self.done.wait()
        return self.replies[0]


@contextlib.asynccontextmanager
async def _asked(as_: Connect, event: str, command: str) -> AsyncIterator[Asked]:
    """A worker asking about `command`, the dispatcher service deciding for agent a2, and
    a2's emit waiting on the approval (with alice's client it is found pending)."""
    worker, _ = await _system(as_, event)
    service_client = await as_("dispatcher-dispatcher")
    service = DispatcherService(HookDispatcher(service_client.nc), service_client.nc)
    await service.start()
    client = await as_("agent-a2")
    alice = await as_("approver-alice")
    replies: list[dict[str, Any]] = []
    done = anyio.Event()
    try:
        async with worker, ApprovalsClient(alice.nc, agent_id="a2") as approvals:
            await _until_served(client, emit_service_subject(event, "a2"))
            async with anyio.create_task_group() as tg:

                async def ask() -> None:
                    replies.append((await _service_emit(client, command))["result"])
                    done.set()

                tg.start_soon(ask)
                with anyio.fail_after(20):
                    while True:
                        mine = [r for r in await approvals.pending_approvals()
                                if r.metadata.get("data", {}).get("tool_input", {}).get(
                                    "command") == command]  # fmt: skip
                        if mine:
                            break
                        await anyio.sleep(0.1)
                yield Asked(mine[0], approvals, client, replies, done)
                tg.cancel_scope.cancel()
    finally:
        await service.stop()


async def _still_pending(approvals: ApprovalsClient, label: str) -> bool:
    return label in {r.label for r in await approvals.pending_approvals()}


async def _cancel_by_cli(secure: Secure, label: str, reason: str) -> str:
    """`hookbus approvals cancel` with approver alice's context (no --approver: the
    credentials name her); its one line of output."""
    context = secure.out / "T1" / "approver-alice.json"
    with anyio.fail_after(30):
        done = await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", "approvals", "cancel", short_id(label),
             "--reason", reason, "--context", str(context), "--url", secure.url],
            check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


@pytest.mark.parametrize("via", ["client", "cli"])
async def test_an_approver_cancels_and_the_waiting_call_is_denied_at_once(
    secure: Secure, as_: Connect, event: str, via: str
) -> None:
    async with _asked(as_, event, f"ask cancel {via}") as asked:
        record, approvals = asked.record, asked.approvals
        with anyio.fail_after(15):  # the approval's own timeout is 20 s
            if via == "client":
                await approvals.cancel_approval(
                    record.label, approver="alice", reason="wrong tool", agent_id="a2"
                )
            else:
                said = await _cancel_by_cli(secure, record.label, "wrong tool")
                assert said == f"cancelled {record.label}: by alice: wrong tool"
            result = await asked.result()
        assert not await _still_pending(approvals, record.label)
    assert result["action"] == "deny", result
    assert result["reason"] == "approval cancelled: by alice: wrong tool", result


async def test_an_agent_can_neither_cancel_nor_answer(
    secure: Secure, as_: Connect, event: str
) -> None:
    async with _asked(as_, event, "ask agent") as asked:
        record, approvals, agent = asked.record, asked.approvals, asked.agent
        js = agent.nc.jetstream(timeout=2)
        key = approval_answer_key(record.label, "a2", "alice")
        for kind, choice in (("cancel", ""), ("answer", "Allow once")):
            proof = encode(ApprovalAnswer(choice=choice, answered_by="alice", kind=kind))
            await refused(
                secure, agent, f"agent writes approver alice's {kind} proof",
                partial(js.publish, f"$KV.{APPROVALS_BUCKET}.{key}", proof),
            )  # fmt: skip
        closed = msgspec.structs.replace(record, status="cancelled", reason="by alice")
        await refused(
            secure, agent, "agent closes the approval record itself",
            partial(js.publish, f"$KV.{APPROVALS_BUCKET}.{suspension_key(record.label, 'a2')}",
                    encode(closed)),
        )  # fmt: skip
        assert await _still_pending(approvals, record.label)
        assert not asked.done.is_set()
        await approvals.cancel_approval(record.label, approver="alice", agent_id="a2")


async def test_the_dispatcher_service_ends_an_approval_nobody_waits_for(
    private_connect: Any,  # noqa: F811  (the fixture imported above)
    event: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's deadline leaves an approval pending (its asker gone); with nobody
    listing or reading it, the dispatcher service's sweep ends it past its timeout plus the
    margin: closed with its default, as expired. (A server of its own: on the shared one,
    other files' required handlers decide the event first.)"""
    connect = private_connect
    monkeypatch.setattr(_approval_answers, "EXPIRY_MARGIN_S", 0.5)
    agent = HookDispatcher(await connect())

    async def ask(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_timeout=3.0, approval_default="deny")

    agent.register(event, ask)  # an event of its own: the server is shared
    service_nc = await connect()
    service = DispatcherService(HookDispatcher(service_nc), service_nc, expiry_sweep_s=0.3)
    async with agent, ApprovalsClient(await connect()) as reader:
        session = f"s-{uuid.uuid4().hex}"  # the server is shared: this test's approval
        call = {"tool_name": "bash", "session_id": session}
        gone = await agent.emit(event, call, timeout_s=2.0)
        assert gone.action == "deny" and CALLERS_DEADLINE in (gone.reason or ""), gone
        every = (await reader.approval_page(status=None)).records  # a listing that ends nothing
        [pending] = [r for r in every if r.metadata.get("session_id") == session]
        assert pending.status == "pending"
        await service.start()
        try:
            with anyio.fail_after(30):  # expired after 3.5 s, swept every 0.3 s
                while True:  # only get_approval: a plain read that ends nothing
                    got = await reader.get_approval(pending.label, agent_id=pending.agent_id)
                    assert got is not None
                    if got[0].status != "pending":
                        break
                    await anyio.sleep(0.2)
        finally:
            await service.stop()
    assert got[0].status == "cancelled"
    assert got[0].reason == "timed out after 3.0s; default deny applied"
