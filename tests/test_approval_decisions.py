"""Approval decisions seen from outside: who is asked, which answers allow, what ends a wait.

- Every handler that answers ``ask_user`` has its own question shown, one after the other
  in priority order; the call is allowed only when every question was allowed, denied at
  the first refusal, and an "Allow always" covers only the handler whose question it
  answered.
- A handler names the options that allow (`HookResult.approval_allow_options`); options of
  which none allows are refused without asking anybody, with a reason that says so.
- The caller's deadline (``emit(..., timeout_s=...)``) ending the wait is not the human's
  silence: the call is denied, the approval stays pending, and a retry with the same
  idempotency key gets the answer. Only the approval's own ``approval_timeout`` applies
  ``approval_default``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from conftest import Connect
from test_approvals import Agent, Approver, asker, spawn_emit

from hookbus.dispatcher import AnswerNotAppliedError, HookDispatcher
from hookbus.schemas import HookPart, HookResult

pytestmark = pytest.mark.anyio

ASK_S = 5.0
"""Seconds a test waits for a question to be shown before it fails."""


@pytest.fixture
async def agent(connect: Connect) -> AsyncIterator[Agent]:
    """The agent's dispatcher (approvals on), its connection and a session id of its own."""
    nc = await connect()
    async with HookDispatcher(nc) as d:
        yield Agent(d, nc, f"session-{uuid.uuid4().hex[:10]}")


async def question(approver: Approver, session: str, handler: str) -> HookPart:
    """The next pending approval of `session` asked by `handler`."""
    return await approver.next(
        lambda h: (
            h.status == "pending"
            and h.metadata.get("session_id") == session
            and h.metadata.get("handler") == handler
        ),
        timeout_s=ASK_S,
    )


async def answer(approver: Approver, part: HookPart, choice: str, who: str = "tester") -> None:
    await approver.client.answer_approval(part.label, choice, approver=who, agent_id=part.agent_id)


def lint_and_security(d: HookDispatcher, event: str) -> None:
    """``lint`` (priority 1) asks about every bash call; ``security`` (priority 10) asks
    about ``rm -rf`` only. Both offer "Allow always"."""
    options = ["Allow once", "Allow always", "Deny"]

    async def lint(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user", approval_prompt="lint: run this bash command?",
            approval_options=options, approval_timeout=30,
        )  # fmt: skip

    async def security(event: str, data: dict[str, Any]) -> HookResult:
        if "rm -rf" not in data.get("tool_input", {}).get("command", ""):
            return HookResult(action="continue")
        return HookResult(
            action="ask_user", approval_prompt="security: delete recursively?",
            approval_options=options, approval_timeout=30,
        )  # fmt: skip

    d.register(event, lint, priority=1)
    d.register(event, security, priority=10)


def bash(command: str) -> dict[str, Any]:
    return {"tool_name": "bash", "tool_input": {"command": command}}


# -- every asker is asked ---------------------------------------------------------------------
async def test_allow_always_for_one_asker_does_not_answer_another_askers_question(
    agent: Agent, approver: Approver, event: str
) -> None:
    """ "Allow always" on lint's question allows lint's later questions only: the later
    ``rm -rf /data`` still shows security's question, and security's refusal denies."""
    lint_and_security(agent.d, event)
    session = agent.session
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, bash("ls"))
        await answer(approver, await question(approver, session, "lint"), "Allow always")
        assert (await out.wait()).action == "continue"

    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, bash("rm -rf /data"))
        part = await question(approver, session, "security")
        assert part.metadata["prompt"] == "security: delete recursively?"
        await answer(approver, part, "Deny", who="alice")
        r = await out.wait()
    assert (r.action, r.decided_by, r.approved_by) == ("deny", "security", "alice")
    assert r.reason == "alice chose 'Deny'"
    seen = await approver.settle(agent.nc, approver.nc)
    asked = [h.metadata["handler"] for h in seen if h.status == "pending"
             and h.metadata.get("session_id") == session]  # fmt: skip
    assert asked == ["lint", "security"]  # lint's grant answered lint's second question


async def test_every_askers_question_is_shown_in_priority_order(
    agent: Agent, approver: Approver, event: str
) -> None:
    """Both handlers ask about one call: lint's question first, then security's; the call
    goes on only when both were allowed, amplifier-core-shaped (lint's fields), with both
    approvers on the result."""
    lint_and_security(agent.d, event)
    session = agent.session
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, bash("rm -rf /tmp/build"))
        first = await question(approver, session, "lint")
        await anyio.sleep(0.2)
        assert approver.pending_of(session) == [first]  # one question at a time
        await answer(approver, first, "Allow once", who="alice")
        await answer(
            approver, await question(approver, session, "security"), "Allow once", who="bob"
        )
        r = await out.wait()
    assert (r.action, r.decided_by) == ("continue", "lint")
    assert r.approval_prompt == "lint: run this bash command?"
    assert r.approved_by == "alice, bob"
    assert r.reason == "lint: alice chose 'Allow once'; security: bob chose 'Allow once'"
    assert r.data is not None and r.data["tool_input"] == {"command": "rm -rf /tmp/build"}


# -- which options allow ----------------------------------------------------------------------
async def test_options_that_offer_no_allowing_answer_are_refused_without_asking(
    agent: Agent, approver: Approver, event: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``["Approve", "Reject"]`` with no `approval_allow_options`: no answer could allow,
    so nobody is asked; the deny says why (never as if a human refused) and a warning is
    logged."""
    agent.d.register(event, asker(approval_options=["Approve", "Reject"], approval_timeout=2))
    with caplog.at_level(logging.WARNING, logger="hookbus.dispatcher"):
        r = await agent.d.emit(event, {"tool_name": "deploy"})
    assert (r.action, r.decided_by, r.approved_by) == ("deny", "guard", None)
    assert r.reason is not None and "offer no allowing answer" in r.reason, r.reason
    assert "chose" not in r.reason and "timed out" not in r.reason
    assert any("offer no allowing answer" in m for m in caplog.messages), caplog.messages
    seen = await approver.settle(agent.nc, approver.nc)
    assert [h for h in seen if h.metadata.get("session_id") == agent.session] == []


@pytest.mark.parametrize(("choice", "action"), [("Approve", "continue"), ("Reject", "deny")])
async def test_a_handler_names_the_options_that_allow(
    agent: Agent, approver: Approver, event: str, choice: str, action: str
) -> None:
    agent.d.register(
        event,
        asker(approval_options=["Approve", "Reject"], approval_allow_options=["Approve"]),
    )
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, {"tool_name": "deploy"})
        part = await question(approver, agent.session, "guard")
        await answer(approver, part, choice)
        r = await out.wait()
    assert (r.action, r.approved_by, r.reason) == (action, "tester", f"tester chose {choice!r}")
    assert part.metadata["allow_options"] == ["Approve"]  # the approver sees which allow


async def test_allow_always_that_the_handler_does_not_list_denies_and_grants_nothing(
    agent: Agent, approver: Approver, event: str
) -> None:
    """With `approval_allow_options` given, only those options allow: an offered "Allow
    always" outside the list denies and stores no grant."""
    agent.d.register(
        event,
        asker(approval_options=["Yes", "Allow always", "No"], approval_allow_options=["Yes"]),
    )
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, {"tool_name": "deploy"})
        await answer(approver, await question(approver, agent.session, "guard"), "Allow always")
        r = await out.wait()
    assert r.action == "deny"
    assert await approver.client.approval_grants(session_id=agent.session) == []


# -- what ends the wait -----------------------------------------------------------------------
async def test_a_callers_approval_cut_ends_with_deny_never_an_early_allow(
    agent: Agent, approver: Approver, event: str
) -> None:
    """``approval_timeout=300, approval_default="allow"``, the emit's
    ``approval_timeout_s=1``: nobody answering, the approval ends at the caller's 1 s, with
    deny, not the handler's allow (only its full 300 s of silence allows), and the record is
    closed with the default it applied."""
    agent.d.register(event, asker(approval_timeout=300, approval_default="allow"))
    with anyio.fail_after(20):
        result = await agent.d.emit(
            event, {"tool_name": "bash"}, timeout_s=15, approval_timeout_s=1.0
        )
    assert (result.action, result.reason) == ("deny", "timed out after 1.0s; default deny")
    part = await question(approver, agent.session, "guard")
    assert (part.metadata["timeout_s"], part.metadata["default"]) == (1.0, "deny")
    got = await approver.client.get_approval(part.label)
    assert got is not None
    assert (got[0].status, got[0].reason) == (
        "cancelled",
        "timed out after 1.0s; default deny applied",
    )


async def test_the_callers_deadline_denies_and_a_retry_gets_the_answer(
    agent: Agent, approver: Approver, event: str
) -> None:
    """``approval_timeout=300, approval_default="allow"``, nobody answers within the
    emit's 1 s: denied (the caller's deadline, not the human's silence), the approval stays
    pending, and the same call retried after the answer gets that answer."""
    agent.d.register(event, asker(approval_timeout=300, approval_default="allow"))
    key = f"call-{uuid.uuid4().hex}"
    with anyio.fail_after(10):
        first = await agent.d.emit(event, {"tool_name": "bash"}, idempotency_key=key, timeout_s=1.0)
    assert (first.action, first.approved_by) == ("deny", None)
    assert first.reason is not None and "caller's deadline" in first.reason, first.reason
    part = await question(approver, agent.session, "guard")
    got = await approver.client.get_approval(part.label)
    assert got is not None and got[0].status == "pending"
    assert part.metadata["timeout_s"] == 300  # the record keeps the approval's own timeout

    with pytest.raises(AnswerNotAppliedError, match="is recorded"):  # nobody waits on it now
        await approver.client.answer_approval(
            part.label, "Allow", approver="alice", agent_id=part.agent_id, wait_s=0.3
        )
    with anyio.fail_after(10):
        again = await agent.d.emit(event, {"tool_name": "bash"}, idempotency_key=key, timeout_s=5)
    assert (again.action, again.approved_by, again.reason) == (
        "continue", "alice", "alice chose 'Allow'"
    )  # fmt: skip
    await approver.settle(agent.nc, approver.nc)
    assert len(approver.pending_of(agent.session)) == 1  # the retry asked nobody anew


async def test_only_the_approvals_own_timeout_applies_its_default(agent: Agent, event: str) -> None:
    """The approval's timeout (0.5 s) ends the wait before the caller's (5 s): its default
    applies."""
    agent.d.register(event, asker(approval_timeout=0.5, approval_default="allow"))
    r = await agent.d.emit(event, {"tool_name": "bash"}, timeout_s=5.0)
    assert r.action == "continue"
    assert r.reason is not None and r.reason.startswith("timed out after 0.5s; default allow")
