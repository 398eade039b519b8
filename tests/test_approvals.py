"""Approvals: a handler's ``ask_user`` becomes a durable approval suspension.

The agent's dispatcher emits; an "approver" (another connection, as another process would
be) answers from the hook events. Each test has its own event and session id, so its
approval labels and "Allow always" grants are its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import nats.errors
import pytest
from _cli_subprocess import hookbus_cli
from _emitted import Emitted, in_background
from _sentinel import send_sentinel
from anyio.abc import TaskGroup
from conftest import Connect
from nats.aio.client import Client as NATS

from hookbus.dispatcher import (
    APPROVAL_LABEL_PREFIX,
    AnswerNotAppliedError,
    ApprovalsClient,
    HookDispatcher,
    approval_label,
    next_approval_label,
)
from hookbus.dispatcher._approvals import CALLERS_DEADLINE
from hookbus.schemas import (
    APPROVALS_BUCKET,
    AlreadySettledError,
    ApprovalAnswer,
    ApprovalGrant,
    HookEvent,
    HookPart,
    HookResult,
    ResolutionRejectedError,
    SuspensionNotFoundError,
    approval_answer_key,
    encode,
    grant_key,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


class Approver:
    """Another process that watches hook events and answers approvals (`client`)."""

    def __init__(self, client: ApprovalsClient, nc: NATS) -> None:
        self.client, self.nc = client, nc
        self.seen: list[HookEvent] = []
        self._taken: set[int] = set()
        self._stream: Any = None

    async def open(self) -> Approver:
        self._stream = await self.client.events()
        return self

    async def close(self) -> None:
        await self._stream.aclose()

    async def next(self, pred: Callable[[HookPart], bool], timeout_s: float = 10) -> HookPart:
        with anyio.fail_after(timeout_s):
            i = 0
            while True:
                while i < len(self.seen):
                    if i not in self._taken and pred(self.seen[i].hook):
                        self._taken.add(i)
                        return self.seen[i].hook
                    i += 1
                self.seen.append(await self._stream.__anext__())

    async def answer(self, part: HookPart, choice: str, **options: Any) -> ApprovalAnswer:
        """`part` answered `choice` by the approver "tester" (`answer_approval`'s `options`)."""
        return await self.client.answer_approval(
            part.label, choice, approver="tester", agent_id=part.agent_id, **options
        )

    async def pending(self, session: str) -> HookPart:
        """The next pending approval of `session`."""
        return await self.next(
            lambda h: h.status == "pending" and h.metadata.get("session_id") == session
        )

    async def settle(self, *conns: NATS) -> list[HookPart]:
        """Every event received once all `conns` sent so far has arrived (sentinel)."""
        sentinel = await send_sentinel(self.nc, *conns)
        await self.next(lambda h: h.label == sentinel)
        return [e.hook for e in self.seen if e.hook.label != sentinel]

    def pending_of(self, session: str) -> list[HookPart]:
        return [
            e.hook
            for e in self.seen
            if e.hook.status == "pending" and e.hook.metadata.get("session_id") == session
        ]


class Agent:
    """The agent's dispatcher (approvals on), its connection and its session id."""

    def __init__(self, d: HookDispatcher, nc: NATS, session: str) -> None:
        self.d, self.nc, self.session = d, nc, session
        d.set_default_fields(session_id=session)


@pytest.fixture
async def agent(connect: Connect) -> AsyncIterator[Agent]:
    nc = await connect()
    d = HookDispatcher(nc)
    async with d:
        yield Agent(d, nc, f"session-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def asking(agent: Agent, event: str) -> Agent:
    """`agent`, its dispatcher asking the user on every `event` (`asker()`)."""
    agent.d.register(event, asker())
    return agent


def spawn_emit(tg: TaskGroup, d: HookDispatcher, event: str, data: dict[str, Any]) -> Emitted:
    """``d.emit(event, data)`` in the background of `tg` (its `wait`: 10 s by default)."""
    return in_background(tg, lambda: d.emit(event, data))


async def asked_a1(
    tg: TaskGroup, agent: Agent, approver: Approver, event: str
) -> tuple[Emitted, HookPart]:
    """A bash call of agent ``a1`` emitted by `agent` in the background of `tg`: that emit,
    and the approval it asks (the next pending one of the agent's session)."""
    out = spawn_emit(tg, agent.d, event, {"tool_name": "bash", "agent_id": "a1"})
    return out, await approver.pending(agent.session)


async def answered(
    agent: Agent,
    approver: Approver,
    event: str,
    data: dict[str, Any],
    choice: str,
    session: str | None = None,
) -> tuple[HookPart, HookResult]:
    """Emits `event` with `data` from `agent`'s dispatcher, answers the approval it asks
    (the first pending one in `session`, the agent's by default) with `choice`, and
    returns that approval and the emit's result."""
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, data)
        part = await approver.pending(agent.session if session is None else session)
        await approver.answer(part, choice)
        return part, await out.wait()


async def asked(approver: Approver, nc: NATS, session: str) -> list[HookPart]:
    """The approvals asked in `session` so far (after `nc`'s messages settled)."""
    return [h for h in await approver.settle(nc) if h.metadata.get("session_id") == session]


def asker(name: str = "guard", **fields: Any) -> Callable[..., Awaitable[HookResult]]:
    """A handler that asks the user (`fields` are the HookResult's approval_* fields).

    The approval times out after 10 s by default (denying), so a test whose answer never
    comes fails with a wrong action instead of hanging until the per-test timeout.
    """
    fields.setdefault("approval_timeout", 10.0)

    async def handler(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", **fields)

    handler.__name__ = name
    return handler


def returning(name: str, result: HookResult) -> Callable[..., Awaitable[HookResult]]:
    async def handler(event: str, data: dict[str, Any]) -> HookResult:
        return result

    handler.__name__ = name
    return handler


# -- the approval suspension -------------------------------------------------------------------
async def test_ask_user_from_a_remote_handler_waits_for_the_answer_and_allows(
    agent: Agent, approver: Approver, connect: Connect, event: str
) -> None:
    worker = HookWorker(await connect())
    worker.add_handler(
        event,
        asker(
            "remote_guard",
            approval_prompt="Run rm -rf?",
            approval_options=["Allow once", "Allow always", "Deny"],
            approval_timeout=30,
            approval_default="deny",
        ),
    )
    async with worker:
        await agent.d.refresh()
        assert agent.d.list_handlers(event) == {event: ["remote_guard"]}
        async with anyio.create_task_group() as tg:
            out, part = await asked_a1(tg, agent, approver, event)
            assert part.label.startswith(APPROVAL_LABEL_PREFIX)
            m = part.metadata
            assert m["prompt"] == "Run rm -rf?"
            assert m["options"] == ["Allow once", "Allow always", "Deny"]
            assert m["timeout_s"] == 30 and m["default"] == "deny"
            assert m["handler"] == "remote_guard" and m["event"] == event
            assert m["tool_name"] == "bash" and m["agent_id"] == "a1"
            assert not out.done.is_set()
            await approver.answer(part, "Allow once")
            r = await out.wait()
    assert r.action == "continue"
    assert r.decided_by == "remote_guard"
    assert r.reason is not None and "Allow once" in r.reason
    assert r.data is not None and r.data["tool_name"] == "bash"


async def test_a_local_handler_deny_choice_denies(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(event, asker(approval_options=["Yes", "No"], approval_allow_options=["Yes"]))
    _, r = await answered(agent, approver, event, {"tool_name": "write_file"}, "No")
    assert r.action == "deny" and r.decided_by == "guard"
    assert r.reason is not None and "No" in r.reason


async def test_default_options_are_allow_and_deny_and_other_choices_are_refused(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(event, asker())
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, {"tool_name": "bash"})
        part = await approver.pending(agent.session)
        assert part.metadata["options"] == ["Allow", "Deny"]
        assert part.metadata["prompt"]  # a prompt is always shown, even when none was given
        before = await approver.client.get_approval(part.label)
        with pytest.raises(ResolutionRejectedError, match="choice"):
            await approver.answer(part, "Maybe")
        assert await approver.client.get_approval(part.label) == before
        await approver.answer(part, "Deny")
        r = await out.wait()
    assert r.action == "deny"


@pytest.mark.parametrize(("default", "action"), [("allow", "continue"), ("deny", "deny")])
async def test_a_timeout_applies_the_default(
    agent: Agent, approver: Approver, event: str, default: str, action: str
) -> None:
    agent.d.register(event, asker(approval_timeout=0.3, approval_default=default))
    r = await agent.d.emit(event, {"tool_name": "bash"})
    assert r.action == action
    assert r.decided_by == "guard"
    assert r.reason is not None and "timed out" in r.reason
    part = await approver.pending(agent.session)
    closed = await approver.next(lambda h: h.label == part.label and h.status == "cancelled")
    assert closed.reason is not None and default in closed.reason
    with pytest.raises(AlreadySettledError):  # a late answer is refused, not silently lost
        await approver.answer(part, "Allow")


async def test_a_cancelled_approval_denies(agent: Agent, approver: Approver, event: str) -> None:
    agent.d.register(event, asker(approval_default="allow"))
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, {"tool_name": "bash"})
        part = await approver.pending(agent.session)
        await approver.client.cancel_approval(part.label, reason="operator left")
        r = await out.wait()
    assert r.action == "deny"
    assert r.reason is not None and "operator left" in r.reason


# -- "Allow always" ------------------------------------------------------------------------------
async def test_allow_always_is_remembered_for_the_session_handler_and_tool(
    agent: Agent, approver: Approver, connect: Connect, event: str
) -> None:
    agent.d.register(event, asker(approval_options=["Allow once", "Allow always", "Deny"]))
    part, r = await answered(
        agent, approver, event, {"tool_name": "bash", "command": "ls"}, "Allow always"
    )
    assert r.action == "continue"

    # the next call of the same tool in the same session does not ask again
    again = await agent.d.emit(event, {"tool_name": "bash", "command": "pwd"})
    assert again.action == "continue" and again.decided_by == "guard"
    assert again.reason is not None and "always" in again.reason
    seen = await approver.settle(agent.nc, approver.nc)
    assert (
        len(
            [
                h
                for h in seen
                if h.status == "pending" and h.metadata.get("session_id") == agent.session
            ]
        )
        == 1
    )

    # ... even from another dispatcher process (the grant is in KV, not in memory)
    other = HookDispatcher(await connect())
    other.register(event, asker(approval_options=["Allow once", "Allow always", "Deny"]))
    other.set_default_fields(session_id=agent.session)
    async with other:
        assert (
            await other.emit(event, {"tool_name": "bash", "command": "id"})
        ).action == "continue"
    assert len(approver.pending_of(agent.session)) == 1

    # another tool in the same session asks again
    part, r = await answered(agent, approver, event, {"tool_name": "write_file"}, "Deny")
    assert part.metadata["tool_name"] == "write_file"
    assert r.action == "deny"

    # the same tool in another session asks again
    agent.d.set_default_fields(session_id=f"{agent.session}-other")
    part, r = await answered(
        agent,
        approver,
        event,
        {"tool_name": "bash", "command": "ls"},
        "Deny",
        session=f"{agent.session}-other",
    )
    assert r.action == "deny"


async def test_allow_always_is_per_handler(agent: Agent, approver: Approver, event: str) -> None:
    agent.d.register(event, asker("first", approval_options=["Allow always", "Deny"]), priority=1)
    part, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Allow always")
    assert r.action == "continue"
    unregister_second = agent.d.register(event, asker("second"), priority=0)  # now asks first
    part, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Deny")
    assert part.metadata["handler"] == "second"
    assert r.action == "deny" and r.decided_by == "second"
    unregister_second()


async def test_allow_once_is_not_remembered(agent: Agent, approver: Approver, event: str) -> None:
    agent.d.register(event, asker(approval_options=["Allow once", "Allow always", "Deny"]))
    for _ in range(2):  # the identical call asks again each time
        _, r = await answered(
            agent, approver, event, {"tool_name": "bash", "command": "ls"}, "Allow once"
        )
        assert r.action == "continue"


# -- precedence (amplifier-core) ------------------------------------------------------------------
async def test_deny_by_an_earlier_handler_wins_without_asking(
    agent: Agent, approver: Approver, event: str
) -> None:
    calls: list[str] = []

    async def ask(ev: str, data: dict[str, Any]) -> HookResult:
        calls.append("ask")
        return HookResult(action="ask_user")

    agent.d.register(
        event, returning("blocker", HookResult(action="deny", reason="no")), priority=1
    )
    agent.d.register(event, ask, priority=2)
    r = await agent.d.emit(event, {"tool_name": "bash"})
    assert r.action == "deny" and r.decided_by == "blocker" and r.reason == "no"
    assert calls == []
    assert await asked(approver, agent.nc, agent.session) == []


async def test_deny_by_a_later_handler_wins_without_asking(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(event, asker("ask"), priority=1)
    agent.d.register(
        event, returning("blocker", HookResult(action="deny", reason="no")), priority=2
    )
    r = await agent.d.emit(event, {"tool_name": "bash"})
    assert r.action == "deny" and r.decided_by == "blocker"
    assert await asked(approver, agent.nc, agent.session) == []


async def test_ask_user_beats_inject_context_and_the_asking_handler_decides(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(
        event,
        returning("context", HookResult(action="inject_context", context_injection="be careful")),
        priority=1,
    )
    agent.d.register(event, asker("ask", approval_prompt="ok?"), priority=2)
    part, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Allow")
    assert part.metadata["prompt"] == "ok?" and part.metadata["handler"] == "ask"
    assert r.action == "continue" and r.decided_by == "ask"


async def test_the_first_ask_user_is_kept(agent: Agent, approver: Approver, event: str) -> None:
    agent.d.register(event, asker("first", approval_prompt="first?"), priority=1)
    agent.d.register(event, asker("second", approval_prompt="second?"), priority=2)
    part, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Deny")
    assert part.metadata["prompt"] == "first?"
    assert r.action == "deny" and r.decided_by == "first"
    assert len(approver.pending_of(agent.session)) == 1


async def test_approvals_off_passes_ask_user_through(
    connect: Connect, approver: Approver, event: str
) -> None:
    nc = await connect()
    d = HookDispatcher(nc, approvals=False)
    d.register(event, asker(approval_prompt="ok?"))
    session = f"session-{uuid.uuid4().hex[:10]}"
    d.set_default_fields(session_id=session)
    async with d:
        r = await d.emit(event, {"tool_name": "bash"})
    assert r.action == "ask_user" and r.approval_prompt == "ok?" and r.decided_by == "guard"
    assert await asked(approver, nc, session) == []


# -- the label: one approval per call -------------------------------------------------------------
def test_approval_label_is_per_call_not_per_content() -> None:
    """The label binds the call's id: a retry (same id, any timestamp) finds the same
    approval; another id (a new identical call) or other data, agent, session, handler or
    event is another approval. (The former label hashed the content only, so an identical
    new call found the previous call's decided approval.)"""
    data = {"session_id": "s1", "agent_id": "a1", "tool_name": "bash", "timestamp": "t1"}
    label = approval_label("tool:pre", data, "guard", call_id="k1")
    assert label.startswith(APPROVAL_LABEL_PREFIX)
    assert label == approval_label("tool:pre", {**data, "timestamp": "t2"}, "guard", call_id="k1")
    others = [
        approval_label("tool:pre", data, "guard", call_id="k2"),
        approval_label("tool:pre", {**data, "x": 1}, "guard", call_id="k1"),
        approval_label("tool:pre", {**data, "agent_id": "a2"}, "guard", call_id="k1"),
        approval_label("tool:pre", {**data, "session_id": "s2"}, "guard", call_id="k1"),
        approval_label("tool:pre", data, "other", call_id="k1"),
        approval_label("tool:post", data, "guard", call_id="k1"),
    ]
    assert len({label, *others}) == 1 + len(others)


async def pending_label(approver: Approver, session: str | None, agent: str | None = None) -> str:
    part = await approver.next(
        lambda h: (
            h.status == "pending"
            and h.metadata.get("session_id") == session
            and h.metadata.get("agent_id") == agent
        )
    )
    return part.label


# -- a decided approval never decides another call -------------------------------------------------
async def test_a_timed_out_approval_does_not_decide_the_next_identical_call(
    agent: Agent, approver: Approver, event: str
) -> None:
    """A timed-out approval (default allow) is closed; the next identical call is asked
    anew, and its own answer decides it (formerly: denied at once as "cancelled")."""
    agent.d.register(event, asker(approval_timeout=0.3, approval_default="allow"))
    call = {"tool_name": "bash", "command": "ls"}
    first = await agent.d.emit(event, dict(call))
    assert first.action == "continue"
    assert first.reason is not None and "timed out" in first.reason
    first_label = (await approver.pending(agent.session)).label
    part, second = await answered(agent, approver, event, dict(call), "Deny")
    assert part.label != first_label
    assert second.action == "deny" and second.decided_by == "guard"
    assert second.reason == "tester chose 'Deny'"


async def test_a_cancelled_approval_does_not_decide_the_next_identical_call(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(event, asker(approval_default="allow"))
    call = {"tool_name": "bash", "command": "ls"}
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, dict(call))
        part = await approver.pending(agent.session)
        await approver.client.cancel_approval(part.label, reason="operator left")
        assert (await out.wait()).action == "deny"
    again, r = await answered(agent, approver, event, dict(call), "Allow")
    assert again.label != part.label
    assert r.action == "continue" and r.reason == "tester chose 'Allow'"


# -- a retry of the same call (idempotency key) ----------------------------------------------------
async def test_two_dispatchers_waiting_on_one_call_get_its_allow_once_once(
    agent: Agent, approver: Approver, connect: Connect, event: str
) -> None:
    """The same call (same key) waits in two dispatchers at once (the reply was lost, the
    agent retried through another); one "Allow once" allows one of them: the other is
    asked again, in a fresh approval, and so is a retry after both."""
    agent.d.register(event, asker(approval_options=["Allow once", "Deny"]))
    call = {"tool_name": "bash", "command": "make deploy"}
    key = f"call-{uuid.uuid4().hex}"
    async with anyio.create_task_group() as tg:
        first = spawn_emit_keyed(tg, agent.d, event, dict(call), key)
        part = await approver.pending(agent.session)
        other = HookDispatcher(await connect())
        other.register(event, asker(approval_options=["Allow once", "Deny"]))
        other.set_default_fields(session_id=agent.session)
        async with other:
            retried = spawn_emit_keyed(tg, other, event, dict(call), key)
            with anyio.fail_after(10):  # the retry attached to the same approval
                while True:
                    got = await approver.client.get_approval(part.label, agent_id=part.agent_id)
                    if got is not None and got[0].owner == other.suspensions.waiter_id:
                        break
                    await anyio.sleep(0.05)
            await approver.answer(part, "Allow once")
            again = await approver.pending(agent.session)  # the loser asks afresh
            assert again.label == next_approval_label(part.label)
            await approver.answer(again, "Deny")
            results = [await first.wait(), await retried.wait()]
            assert sorted((r.action, r.reason) for r in results) == [
                ("continue", "tester chose 'Allow once'"),
                ("deny", "tester chose 'Deny'"),
            ]
            # a retry after both is asked again too (the refusal decided that approval)
            late = spawn_emit_keyed(tg, other, event, dict(call), key)
            assert (await late.wait()).action == "deny"
    assert len(approver.pending_of(agent.session)) == 2
    got = await approver.client.get_approval(part.label, agent_id=part.agent_id)
    assert got is not None and got[0].used_by


async def test_an_allow_once_answered_while_the_agent_was_dead_allows_one_resume(
    agent: Agent, approver: Approver, event: str
) -> None:
    """The agent's emit ended (its deadline: a process killed mid-wait) with the approval
    pending; "Allow once" was answered meanwhile. The call resumed (same key) is allowed
    once; resumed again, it is asked again, and a refusal then denies it."""
    agent.d.register(event, asker(approval_options=["Allow once", "Deny"], approval_timeout=60))
    call = {"tool_name": "transfer", "amount": 100}
    key = f"run-1:tool:pre:{uuid.uuid4().hex[:8]}"
    dead = await agent.d.emit(event, dict(call), idempotency_key=key, timeout_s=2.0)
    assert dead.action == "deny" and CALLERS_DEADLINE in (dead.reason or "")
    part = await approver.pending(agent.session)
    with pytest.raises(AnswerNotAppliedError):  # nobody waits on it
        await approver.answer(part, "Allow once", wait_s=0.2)
    resumed = await agent.d.emit(event, dict(call), idempotency_key=key, timeout_s=20)
    assert (resumed.action, resumed.approved_by) == ("continue", "tester")
    async with anyio.create_task_group() as tg:
        twice = spawn_emit_keyed(tg, agent.d, event, dict(call), key)
        fresh = await approver.next(
            lambda h: h.status == "pending" and h.label == next_approval_label(part.label)
        )
        assert not twice.done.is_set(), twice.result  # not allowed again without asking
        assert fresh.metadata["tool_name"] == "transfer"
        await approver.answer(fresh, "Deny")
        assert (await twice.wait()).action == "deny"


async def test_a_lost_ack_of_the_use_mark_still_allows_once(
    agent: Agent, approver: Approver, event: str
) -> None:
    """The write that uses up an "Allow once" is stored but its ack is lost: the decider
    reads its own mark back (the records' reconcile) and allows; the next resume of the
    call is asked again."""
    agent.d.register(event, asker(approval_options=["Allow once", "Deny"], approval_timeout=60))
    call = {"tool_name": "transfer", "amount": 7}
    key = f"call-{uuid.uuid4().hex}"
    assert (await agent.d.emit(event, dict(call), idempotency_key=key, timeout_s=2.0)).action == (
        "deny"
    )
    part = await approver.pending(agent.session)
    with pytest.raises(AnswerNotAppliedError):
        await approver.answer(part, "Allow once", wait_s=0.2)
    lossy = LoseUseMarkAck(agent.d.approvals.records.records.kv)
    agent.d.approvals.records.records.kv = lossy  # type: ignore[assignment]
    resumed = await agent.d.emit(event, dict(call), idempotency_key=key, timeout_s=20)
    assert lossy.lost == 1
    assert (resumed.action, resumed.approved_by) == ("continue", "tester")
    async with anyio.create_task_group() as tg:
        twice = spawn_emit_keyed(tg, agent.d, event, dict(call), key)
        fresh = await approver.next(
            lambda h: h.status == "pending" and h.label == next_approval_label(part.label)
        )
        assert not twice.done.is_set()
        await approver.answer(fresh, "Deny")
        assert (await twice.wait()).action == "deny"


async def test_the_amplifier_drop_in_allows_a_resumed_tool_call_once(
    connect: Connect, approver: Approver, event: str
) -> None:
    """amplifier-core's `HookRegistry` (hookbus's, on NATS): a tool call's approval
    answered "Allow once" while the agent was dead allows the resumed call once; the call
    resumed again asks again. (The test's own event stands for ``tool:pre``: the server is
    shared with other tests' workers.)"""
    from hookbus.amplifier import HookRegistry, HookResult

    TOOL_PRE = event

    session = f"session-{uuid.uuid4().hex[:10]}"
    hooks = HookRegistry(await connect(), agent_id="amp")
    hooks.set_default_fields(session_id=session)

    async def approval_hook(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user", approval_prompt="Transfer?",
            approval_options=["Allow once", "Deny"], approval_timeout=60,
        )  # fmt: skip

    hooks.register(TOOL_PRE, approval_hook, 10, "approval_hook")
    call = {"tool_name": "transfer", "tool_input": {"amount": 5}, "tool_call_id": "t1"}
    key = f"amp:{uuid.uuid4().hex[:8]}:t1"
    ran = 0
    async with hooks:
        killed = await hooks.emit(TOOL_PRE, dict(call), idempotency_key=key, timeout_s=2.0)
        assert killed.action == "deny"
        part = await approver.pending(session)
        with pytest.raises(AnswerNotAppliedError):
            await approver.client.answer_approval(
                part.label, "Allow once", approver="tester", agent_id="amp", wait_s=0.2
            )
        ran += (await hooks.emit(TOOL_PRE, dict(call), idempotency_key=key)).action == "continue"
        assert ran == 1
        async with anyio.create_task_group() as tg:
            again = spawn_emit_keyed(tg, hooks, TOOL_PRE, dict(call), key)
            fresh = await approver.pending(session)
            assert not again.done.is_set(), again.result
            await approver.client.answer_approval(
                fresh.label, "Deny", approver="tester", agent_id="amp"
            )
            ran += (await again.wait()).action == "continue"
    assert fresh.label != part.label
    assert ran == 1


class LoseUseMarkAck:
    """The approvals bucket's KV client, except that the first write marking an approval
    used (``used_by``) is stored and then answered with ``TimeoutError`` (a lost ack)."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        revision = await self._kv.update(key, value, last=last)
        if not self.lost and b'"used_by"' in value:
            self.lost += 1
            raise nats.errors.TimeoutError
        return revision


async def test_a_retry_after_the_timeout_gets_the_same_decision(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(event, asker(approval_timeout=0.3, approval_default="allow"))
    key = f"call-{uuid.uuid4().hex}"
    first = await agent.d.emit(event, {"tool_name": "bash"}, idempotency_key=key)
    again = await agent.d.emit(event, {"tool_name": "bash"}, idempotency_key=key)
    assert first.action == again.action == "continue"
    assert again.reason is not None and "timed out" in again.reason
    await approver.settle(agent.nc, approver.nc)
    assert len(approver.pending_of(agent.session)) == 1


async def test_a_key_reused_for_another_call_does_not_reuse_the_answer(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(event, asker())
    key = f"call-{uuid.uuid4().hex}"
    async with anyio.create_task_group() as tg:
        out = spawn_emit_keyed(tg, agent.d, event, {"tool_name": "bash", "command": "ls"}, key)
        part = await approver.pending(agent.session)
        await approver.answer(part, "Allow")
        assert (await out.wait()).action == "continue"
    async with anyio.create_task_group() as tg:
        out = spawn_emit_keyed(tg, agent.d, event, {"tool_name": "bash", "command": "rm"}, key)
        again = await approver.pending(agent.session)
        assert again.label != part.label
        await approver.answer(again, "Deny")
        assert (await out.wait()).action == "deny"


def spawn_emit_keyed(
    tg: TaskGroup, d: HookDispatcher, event: str, data: dict[str, Any], key: str
) -> Emitted:
    return in_background(tg, lambda: d.emit(event, data, idempotency_key=key))


# -- "Allow always": scoped, never without a session, listed and revoked ---------------------------
async def test_allow_always_without_a_session_allows_that_call_only(
    connect: Connect, approver: Approver, event: str
) -> None:
    """Agents that send no session id: agent A's "Allow always" for ``ls`` allows that
    call only (the reason says so); neither agent B's ``rm -rf /data`` nor A's next call is
    allowed without asking (formerly both shared session ``-`` and the grant)."""
    d = HookDispatcher(await connect())
    d.register(event, asker(approval_options=["Allow once", "Allow always", "Deny"]))
    agent_a, agent_b = f"agent-a-{uuid.uuid4().hex[:8]}", f"agent-b-{uuid.uuid4().hex[:8]}"
    async with d:
        async with anyio.create_task_group() as tg:
            out = spawn_emit(tg, d, event, {"tool_name": "bash", "agent_id": agent_a,
                                            "tool_input": {"command": "ls"}})  # fmt: skip
            label = await pending_label(approver, None, agent_a)
            await approver.client.answer_approval(
                label, "Allow always", approver="tester", agent_id=agent_a
            )
            r = await out.wait()
        assert r.action == "continue"
        assert r.reason is not None and "this call only" in r.reason and "session" in r.reason
        for who, command in ((agent_b, "rm -rf /data"), (agent_a, "ls")):
            async with anyio.create_task_group() as tg:
                out = spawn_emit(tg, d, event, {"tool_name": "bash", "agent_id": who,
                                                "tool_input": {"command": command}})  # fmt: skip
                label = await pending_label(approver, None, who)
                await approver.client.answer_approval(
                    label, "Deny", approver="tester", agent_id=who
                )
                r = await out.wait()
            assert r.action == "deny" and r.reason == "tester chose 'Deny'", who
        assert await approver.client.approval_grants(agent_id=agent_a) == []


async def test_allow_always_is_per_agent_within_a_session(
    agent: Agent, approver: Approver, event: str
) -> None:
    agent.d.register(event, asker(approval_options=["Allow always", "Deny"]))
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, {"tool_name": "bash", "agent_id": "a1"})
        label = await pending_label(approver, agent.session, "a1")
        await approver.client.answer_approval(
            label, "Allow always", approver="tester", agent_id="a1"
        )
        assert (await out.wait()).action == "continue"
    ok = await agent.d.emit(event, {"tool_name": "bash", "agent_id": "a1", "command": "x"})
    assert ok.action == "continue" and ok.reason is not None and "always" in ok.reason
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, {"tool_name": "bash", "agent_id": "a2"})
        label = await pending_label(approver, agent.session, "a2")
        await approver.client.answer_approval(label, "Deny", approver="tester", agent_id="a2")
        assert (await out.wait()).action == "deny"


async def test_grants_are_listed_and_revoked(agent: Agent, approver: Approver, event: str) -> None:
    agent.d.register(event, asker(approval_options=["Allow always", "Deny"]))
    agent.d.set_default_fields(session_id=agent.session, agent_id="a1")
    part, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Allow always")
    assert r.action == "continue"
    (grant,) = await approver.client.approval_grants(session_id=agent.session)
    assert (grant.agent_id, grant.session_id, grant.event, grant.handler, grant.tool) == (
        "a1", agent.session, event, "guard", "bash"
    )  # fmt: skip
    assert grant.label == part.label and grant.choice == "Allow always" and grant.granted_at > 0
    assert (await agent.d.emit(event, {"tool_name": "bash"})).action == "continue"

    await approver.client.revoke_grant(grant)
    assert await approver.client.approval_grants(session_id=agent.session) == []
    part, r = await answered(
        agent, approver, event, {"tool_name": "bash"}, "Deny"
    )  # asked again once revoked
    assert r.action == "deny"


async def test_a_grant_that_does_not_match_its_key_is_ignored_and_the_human_asked(
    agent: Agent, approver: Approver, nc: NATS, event: str
) -> None:
    """A grant value that does not decode, or names another scope than its key, never
    allows: the human is asked."""
    agent.d.register(event, asker())
    kv = await nc.jetstream().key_value(APPROVALS_BUCKET)
    key = grant_key(None, agent.session, event, "guard", "bash")
    other = ApprovalGrant(session_id="another", event=event, handler="guard", tool="bash")
    for value in (b"\xff not json", encode(other), b"{}"):
        await kv.put(key, value)
        _, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Deny")
        assert r.action == "deny"
    assert await approver.client.approval_grants(session_id=agent.session) == []


# -- the CLI: hookbus approvals grants | revoke ------------------------------------------------
async def test_grants_are_listed_and_revoked_from_the_cli(
    agent: Agent, approver: Approver, nats_url: str, event: str
) -> None:
    agent.d.register(event, asker(approval_options=["Allow always", "Deny"]))
    agent.d.set_default_fields(session_id=agent.session, agent_id="cli-agent")
    part, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Allow always")
    assert r.action == "continue"
    key = grant_key("cli-agent", agent.session, event, "guard", "bash")

    p = await hookbus_cli(nats_url, "approvals", "grants", "--json", "--session", agent.session)
    assert p.returncode == 0, p.stderr.decode()
    (listed,) = json.loads(p.stdout)
    assert listed["key"] == key and listed["agent_id"] == "cli-agent"
    assert (listed["tool"], listed["handler"], listed["label"]) == ("bash", "guard", part.label)
    p = await hookbus_cli(nats_url, "approvals", "grants")
    assert p.returncode == 0 and key in p.stdout.decode(), p.stderr.decode()

    p = await hookbus_cli(nats_url, "approvals", "revoke")
    assert p.returncode == 2 and "--all" in p.stderr.decode()  # nothing named: refused
    p = await hookbus_cli(nats_url, "approvals", "revoke", "--session", agent.session)
    assert p.returncode == 0 and p.stdout.decode().split() == ["revoked", key], p.stderr.decode()
    p = await hookbus_cli(nats_url, "approvals", "grants", "--json", "--session", agent.session)
    assert p.returncode == 0 and json.loads(p.stdout) == []
    part, r = await answered(agent, approver, event, {"tool_name": "bash"}, "Deny")  # asked again
    assert r.action == "deny"


@pytest.mark.parametrize("timeout_s", [-5.0, float("nan")])
async def test_an_approval_timeout_out_of_range_is_clamped(
    agent: Agent, approver: Approver, event: str, timeout_s: float
) -> None:
    """A handler's negative or NaN `approval_timeout` is no wait at all: the default."""
    agent.d.register(event, asker(approval_timeout=timeout_s, approval_default="allow"))
    r = await agent.d.emit(event, {"tool_name": "bash"})
    assert r.action == "continue" and r.approval_timeout == 0
    assert r.reason is not None and r.reason.startswith("timed out after 0.0s; default allow")


# -- who answered: only an approver's proof decides ---------------------------------------------
async def forge(d: HookDispatcher, label: str, value: dict[str, Any], agent_id: str) -> None:
    """Resolve the approval record itself, as any client may on an open server (on a secured
    one only the dispatcher service may write it): no approver's proof is written."""
    await d.approvals.records.for_agent(agent_id).resolve_hook(label, value)


@pytest.mark.parametrize(
    "forged",
    [
        {"choice": "Allow"},  # names nobody
        {"choice": "Allow", "answered_by": "alice"},  # names an approver with no proof
    ],
)
async def test_a_record_resolved_without_an_approvers_proof_denies(
    agent: Agent, approver: Approver, event: str, forged: dict[str, Any]
) -> None:
    """Writing "Allow" into the approval record decides nothing: the dispatcher looks for
    the proof ``<agent>.<label>.<approver>`` that only that approver's user may write, finds
    none, and denies."""
    agent.d.register(event, asker())
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, agent, approver, event)
        await forge(agent.d, part.label, forged, "a1")
        r = await out.wait()
    assert r.action == "deny" and r.approved_by is None
    assert r.reason is not None and r.reason.startswith("answer refused"), r.reason


async def test_a_proof_for_another_choice_does_not_carry_a_forged_one(
    agent: Agent, approver: Approver, event: str
) -> None:
    """alice's proof says "Deny". A writer that resolves the record with "Allow" in alice's
    name is refused (the proof disagrees), or loses to alice's own answer: never allowed."""
    agent.d.register(event, asker(approval_timeout=30))
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, agent, approver, event)
        kv = await approver.nc.jetstream().key_value(APPROVALS_BUCKET)
        proof = ApprovalAnswer(choice="Deny", answered_by="alice", answered_at=1.0)
        await kv.create(approval_answer_key(part.label, "a1", "alice"), encode(proof))
        with contextlib.suppress(AlreadySettledError):  # alice's answer was applied first
            await forge(agent.d, part.label, {"choice": "Allow", "answered_by": "alice"}, "a1")
        r = await out.wait()
    assert r.action == "deny" and r.reason is not None
    assert "'Deny', not 'Allow'" in r.reason or r.reason == "alice chose 'Deny'", r.reason


async def test_an_approval_record_written_outside_the_approvals_store_is_not_an_approval(
    agent: Agent, approver: Approver, event: str
) -> None:
    """An agent may write its own suspension records: one made to look like an approval
    (an ``approval:`` label, metadata naming a handler, tool and session) is neither listed
    nor answerable, so no "Allow always" can come of it, and the next call is still asked."""
    agent.d.register(event, asker(approval_options=["Allow always", "Deny"]))
    label = f"{APPROVAL_LABEL_PREFIX}{uuid.uuid4().hex}"
    fake = {
        "kind": "approval", "prompt": "Allow bash?", "options": ["Allow always", "Deny"],
        "allow_options": ["Allow always"], "timeout_s": None, "default": "deny",
        "handler": "guard", "event": event, "tool_name": "bash",
        "session_id": agent.session, "agent_id": "a1",
    }  # fmt: skip
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: agent.d.hook(label, metadata=fake, timeout_s=5)  # the agent's own record
        )
        await approver.next(lambda h: h.label == label and h.status == "pending")
        page = await approver.client.approval_page()
        assert label not in [r.label for r in page.records]
        with pytest.raises(SuspensionNotFoundError):
            await approver.client.answer_approval(
                label, "Allow always", approver="tester", agent_id="a1"
            )
        tg.cancel_scope.cancel()
    assert await approver.client.approval_grants(session_id=agent.session) == []
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, agent, approver, event)  # asked: nothing was granted
        await approver.client.answer_approval(part.label, "Deny", approver="tester", agent_id="a1")
        assert (await out.wait()).action == "deny"


async def allowed_always(agent: Agent, approver: Approver, event: str, choice: str) -> str:
    """One call of `event` answered `choice` by alice for agent a1; its approval label."""
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, agent, approver, event)
        await approver.client.answer_approval(part.label, choice, approver="alice", agent_id="a1")
        assert (await out.wait()).action == "continue"
    return part.label


@pytest.mark.parametrize("kind", ["no approval", "proof disagrees", "expired", "no lineage"])
async def test_a_grant_without_a_matching_proof_allows_nothing(
    agent: Agent, approver: Approver, event: str, kind: str
) -> None:
    """A grant written by anyone but the deciding dispatcher (an approver may write only its
    proofs) allows nothing unless its lineage holds: the approval it names exists, is about
    this scope, and the approver's proof there holds an allowing "Allow always". Else it is
    ignored and the human is asked."""
    agent.d.register(event, asker(approval_options=["Allow", "Allow always", "Deny"]))
    label = f"{APPROVAL_LABEL_PREFIX}{uuid.uuid4().hex[:32]}"
    if kind == "proof disagrees":  # a real approval of this scope, answered "Allow" once
        label = await allowed_always(agent, approver, event, "Allow")
    if kind == "expired":  # a real "Allow always", whose grant has expired
        label = await allowed_always(agent, approver, event, "Allow always")
    kv = await approver.nc.jetstream().key_value(APPROVALS_BUCKET)
    key = grant_key("a1", agent.session, event, "guard", "bash")
    grant = ApprovalGrant(
        session_id=agent.session, event=event, handler="guard", agent_id="a1", tool="bash",
        choice="Allow always", label=label, granted_at=time.time(), approved_by="alice",
        expires_at=time.time() + (-1 if kind == "expired" else 3600),
    )  # fmt: skip
    if kind == "no lineage":
        grant = ApprovalGrant(
            session_id=agent.session, event=event, handler="guard", agent_id="a1", tool="bash",
            choice="Allow always", granted_at=time.time(),
        )  # fmt: skip
    await kv.put(key, encode(grant))
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, agent, approver, event)  # the grant did not allow: asked
        await approver.client.answer_approval(part.label, "Deny", approver="tester", agent_id="a1")
        r = await out.wait()
    assert (r.action, r.approved_by) == ("deny", "tester")


async def test_a_grant_names_its_approver_and_allows_while_its_proof_holds(
    agent: Agent, approver: Approver, event: str
) -> None:
    """The deciding dispatcher writes the grant with its lineage; a call it allows names
    the approver; once the approver's proof is gone, the grant allows nothing."""
    agent.d.register(event, asker(approval_options=["Allow", "Allow always", "Deny"]))
    label = await allowed_always(agent, approver, event, "Allow always")
    (grant,) = await approver.client.approval_grants(session_id=agent.session)
    assert (grant.label, grant.approved_by) == (label, "alice")
    assert grant.expires_at is not None and grant.expires_at > time.time() + 3000
    again = await agent.d.emit(event, {"tool_name": "bash", "agent_id": "a1"})
    assert (again.action, again.approved_by) == ("continue", "alice")
    kv = await approver.nc.jetstream().key_value(APPROVALS_BUCKET)
    await kv.delete(approval_answer_key(label, "a1", "alice"))
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, agent, approver, event)
        await approver.client.answer_approval(part.label, "Deny", approver="tester", agent_id="a1")
        assert (await out.wait()).action == "deny"


async def test_a_retry_does_not_bring_back_a_revoked_grant(
    agent: Agent, approver: Approver, event: str
) -> None:
    """The retry of an answered call gets its answer again, but the grant revoked since is
    not stored again: only the dispatcher that applied the answer stores it."""
    agent.d.register(event, asker(approval_options=["Allow always", "Deny"]))
    key = f"call-{uuid.uuid4().hex}"
    data = {"tool_name": "bash", "agent_id": "a1"}
    async with anyio.create_task_group() as tg:
        out = spawn_emit_keyed(tg, agent.d, event, dict(data), key)
        part = await approver.pending(agent.session)
        await approver.client.answer_approval(
            part.label, "Allow always", approver="alice", agent_id="a1"
        )
        assert (await out.wait()).action == "continue"
    (grant,) = await approver.client.approval_grants(session_id=agent.session)
    await approver.client.revoke_grant(grant)
    again = await agent.d.emit(event, dict(data), idempotency_key=key)
    assert (again.action, again.approved_by) == ("continue", "alice")
    assert await approver.client.approval_grants(session_id=agent.session) == []


async def test_the_first_proof_written_decides_when_nobody_waited(
    agent: Agent, approver: Approver, event: str
) -> None:
    """Two approvers answer while no dispatcher waits (the caller's deadline passed): both
    answers are recorded; the retried call applies the first one written, whatever the
    order of the approvers' names."""
    agent.d.register(event, asker(approval_timeout=300))
    key = f"call-{uuid.uuid4().hex}"
    first = await agent.d.emit(
        event, {"tool_name": "bash", "agent_id": "a1"}, idempotency_key=key, timeout_s=0.5
    )
    assert first.action == "deny"
    part = await approver.pending(agent.session)
    for who, choice in (("zed", "Deny"), ("alice", "Allow")):
        with pytest.raises(AnswerNotAppliedError):
            await approver.client.answer_approval(
                part.label, choice, approver=who, agent_id="a1", wait_s=0.2
            )
    with pytest.raises(AlreadySettledError, match="already answered"):  # its own, otherwise
        await approver.client.answer_approval(part.label, "Allow", approver="zed", agent_id="a1")
    again = await agent.d.emit(
        event, {"tool_name": "bash", "agent_id": "a1"}, idempotency_key=key, timeout_s=5
    )
    assert (again.action, again.approved_by, again.reason) == ("deny", "zed", "zed chose 'Deny'")
    got = await approver.client.get_approval(part.label, agent_id="a1")
    assert got is not None and got[0].resolution["answered_by"] == "zed"
    with pytest.raises(AlreadySettledError, match="zed"):
        await approver.client.answer_approval(part.label, "Allow", approver="bob", agent_id="a1")


async def test_two_deciders_of_one_approval_apply_the_same_first_answer(
    connect: Connect, approver: Approver, event: str
) -> None:
    """Two dispatchers wait on the same approval (the same call, retried on another while
    the first still waits); two approvers answer at once. Both dispatchers decide by the
    answer written first, and the approver whose answer lost is told. A refusal denies
    both; an "Allow" (allows once) allows one of them, and the other is asked again."""
    session = f"session-{uuid.uuid4().hex[:8]}"
    call = {"tool_name": "bash", "agent_id": "a1", "session_id": session}
    key = f"call-{uuid.uuid4().hex}"
    d1, d2 = HookDispatcher(await connect()), HookDispatcher(await connect())
    for d in (d1, d2):
        d.register(event, asker(approval_timeout=30))
    results: list[HookResult] = []
    async with d1, d2, anyio.create_task_group() as tg:

        async def emit(d: HookDispatcher) -> None:
            results.append(await d.emit(event, dict(call), idempotency_key=key, timeout_s=20))

        tg.start_soon(emit, d1)
        part = await approver.pending(session)
        first = await approver.client.get_approval(part.label, agent_id="a1")
        assert first is not None
        tg.start_soon(emit, d2)
        with anyio.fail_after(10):  # the second decider attached to the same approval
            while True:
                got = await approver.client.get_approval(part.label, agent_id="a1")
                if got is not None and got[1] != first[1]:
                    break
                await anyio.sleep(0.05)
        assert got[0].owner == d2.suspensions.waiter_id
        outcomes: dict[str, Any] = {}

        async def answer(who: str, choice: str) -> None:
            try:
                outcomes[who] = await approver.client.answer_approval(
                    part.label, choice, approver=who, agent_id="a1"
                )
            except AlreadySettledError as exc:
                outcomes[who] = exc

        async with anyio.create_task_group() as answering:
            answering.start_soon(answer, "alice", "Allow")
            answering.start_soon(answer, "bob", "Deny")
        if "alice" in [w for w, o in outcomes.items() if isinstance(o, ApprovalAnswer)]:
            again = await approver.pending(session)  # the allow went to one decider
            assert again.label == next_approval_label(part.label)
            await approver.client.answer_approval(
                again.label, "Deny", approver="carol", agent_id="a1"
            )
    won = [w for w, o in outcomes.items() if isinstance(o, ApprovalAnswer)]
    assert len(won) == 1, outcomes
    (lost,) = set(outcomes) - set(won)
    assert won[0] in str(outcomes[lost])  # told who decided
    if won == ["bob"]:
        assert [r.approved_by for r in results] == ["bob", "bob"]
        assert len({(r.action, r.reason) for r in results}) == 1, results
    else:
        assert sorted((r.action, r.approved_by) for r in results) == [
            ("continue", "alice"), ("deny", "carol"),
        ]  # fmt: skip


async def test_grants_and_proofs_are_not_records(
    agent: Agent, approver: Approver, event: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The approvals bucket also holds proofs and grants: listings and watches skip them
    without a warning."""
    agent.d.register(event, asker(approval_options=["Allow always", "Deny"]))
    with caplog.at_level(logging.WARNING, logger="hookbus.dispatcher"):
        await allowed_always(agent, approver, event, "Allow always")
        page = await approver.client.approval_page(status=None, prefix=None)
        assert page.skipped == 0
        assert await agent.d.emit(event, {"tool_name": "bash", "agent_id": "a1"})
    assert [r.getMessage() for r in caplog.records] == []


async def quota_asking(connect: Connect, event: str, max_pending: int) -> HookDispatcher:
    """A dispatcher (not started) allowing `max_pending` pending approvals per agent, whose
    handler asks on every `event` (30 s to answer)."""
    d = HookDispatcher(await connect(), max_pending_approvals=max_pending)
    d.register(event, asker(approval_timeout=30))
    return d


async def cancelled_then_denied(approver: Approver, agent: str, outs: list[Emitted]) -> None:
    """Cancel every approval of `agent` still listed; each of `outs` then ends denied."""
    for record in (await approver.client.approval_page()).records:
        if record.agent_id == agent:
            await approver.client.cancel_approval(record.label, agent_id=agent)
    for out in outs:
        assert (await out.wait()).action == "deny"


async def test_pending_approvals_per_agent_are_limited(
    connect: Connect, approver: Approver, event: str
) -> None:
    """Past `max_pending_approvals` pending approvals of one agent, a question is denied
    at once with a ``quota:`` reason; another agent is still asked."""
    d = await quota_asking(connect, event, 2)
    agent = f"quota-{uuid.uuid4().hex[:8]}"
    session = f"session-{uuid.uuid4().hex[:8]}"
    async with d, anyio.create_task_group() as tg:
        outs = []
        for i in range(2):
            outs.append(
                spawn_emit(tg, d, event, {"agent_id": agent, "session_id": session, "n": i})
            )
            await approver.pending(session)
        with anyio.fail_after(5):
            r = await d.emit(event, {"agent_id": agent, "session_id": session, "n": 2})
        assert r.action == "deny" and r.reason is not None and r.reason.startswith("quota:")
        other = spawn_emit(tg, d, event, {"agent_id": f"{agent}-b", "session_id": session})
        part = await approver.pending(session)
        assert part.agent_id == f"{agent}-b"
        await approver.client.answer_approval(
            part.label, "Allow", approver="t", agent_id=part.agent_id
        )
        assert (await other.wait()).action == "continue"
        await cancelled_then_denied(approver, agent, outs)


async def test_questions_asked_at_once_cannot_race_past_the_pending_quota(
    connect: Connect, approver: Approver, event: str
) -> None:
    """Ten questions of one agent at once, at most 3 pending: 3 are asked, 7 denied
    ``quota:`` at once (each question sees the others before any record is written, and
    the agent's keys are counted once for all of them)."""
    d = await quota_asking(connect, event, 3)
    agent = f"race-{uuid.uuid4().hex[:8]}"
    session = f"session-{uuid.uuid4().hex[:8]}"
    async with d, anyio.create_task_group() as tg:
        outs = [
            spawn_emit(tg, d, event, {"agent_id": agent, "session_id": session, "n": i})
            for i in range(10)
        ]
        with anyio.fail_after(30):
            while sum(1 for o in outs if o.done.is_set()) < 7:  # noqa: ASYNC110 (any 7 of 10)
                await anyio.sleep(0.02)
        denied = [await o.wait() for o in outs if o.done.is_set()]
        assert len(denied) == 7 and all((r.reason or "").startswith("quota:") for r in denied)
        # the 3 admitted are written after the 7 refusals: their records are awaited, not
        # assumed already there (a busy machine writes them later)
        with anyio.fail_after(30):
            asked = {(await approver.pending(session)).label for _ in range(3)}
        pending = [
            r for r in (await approver.client.approval_page()).records if r.agent_id == agent
        ]
        assert {r.label for r in pending} == asked
        await cancelled_then_denied(approver, agent, outs)


async def test_the_approver_is_on_the_result_the_record_and_the_hook_event(
    asking: Agent, approver: Approver, event: str
) -> None:
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, asking, approver, event)
        assert part.agent_id == "a1"
        answer = await approver.client.answer_approval(
            part.label, "Allow", approver="alice", agent_id="a1"
        )
        r = await out.wait()
    assert answer.answered_by == "alice"
    assert (r.action, r.approved_by, r.reason) == ("continue", "alice", "alice chose 'Allow'")
    resolved = await approver.next(lambda h: h.label == part.label and h.status == "resolved")
    assert resolved.resolution["answered_by"] == "alice" and resolved.agent_id == "a1"
    got = await approver.client.get_approval(part.label, agent_id="a1")
    assert got is not None and got[0].resolution["answered_by"] == "alice"


async def test_a_second_approver_loses_and_is_told(
    asking: Agent, approver: Approver, event: str
) -> None:
    async with anyio.create_task_group() as tg:
        out, part = await asked_a1(tg, asking, approver, event)
        await approver.client.answer_approval(part.label, "Deny", approver="alice", agent_id="a1")
        with pytest.raises(AlreadySettledError):
            await approver.client.answer_approval(
                part.label, "Allow", approver="bob", agent_id="a1"
            )
        r = await out.wait()
    assert (r.action, r.approved_by) == ("deny", "alice")


async def test_a_retry_through_a_host_whose_clock_is_ahead_applies_no_default(
    agent: Agent, approver: Approver, connect: Connect, event: str, monkeypatch: Any
) -> None:
    """An approval left pending by the caller's deadline, retried (same key) through a
    dispatcher whose wall clock is an hour ahead: still pending, so the retry is denied at
    its own caller's deadline; the clock of the host that wrote the record is never
    compared with the retrying host's, and the ``allow`` default is not applied."""
    ask = asker(approval_timeout=300.0, approval_default="allow")
    agent.d.register(event, ask)
    key = f"call-{uuid.uuid4().hex}"
    first = await agent.d.emit(event, {"tool_name": "bash"}, idempotency_key=key, timeout_s=1.0)
    assert first.action == "deny" and "stays pending" in (first.reason or "")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # this host's clock is off
    other = HookDispatcher(await connect())
    other.register(event, ask)
    other.set_default_fields(session_id=agent.session)
    async with other:
        started = time.monotonic()
        again = await other.emit(event, {"tool_name": "bash"}, idempotency_key=key, timeout_s=1.0)
        took = time.monotonic() - started
    assert again.action == "deny" and "stays pending" in (again.reason or ""), again.reason
    assert took >= 0.9
    [record] = [r for r in (await approver.client.approval_page()).records if r.status == "pending"
                and r.metadata.get("session_id") == agent.session]  # fmt: skip
    assert record.status == "pending"


# -- an approval nobody waits for ends ---------------------------------------------------------
async def test_an_approval_whose_asker_is_gone_expires_at_its_timeout_with_its_default(
    agent: Agent, approver: Approver, event: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's deadline ends the wait and leaves the approval pending; past its own
    timeout (plus the margin, by the server's clock) the next listing ends it with its
    default: it is no longer pending, an answer is refused as settled, a retry of the call
    gets the default, and the CLI shows it as expired."""
    from hookbus.dispatcher import _approval_answers

    monkeypatch.setattr(_approval_answers, "EXPIRY_MARGIN_S", 0.5)
    agent.d.register(event, asker(approval_timeout=3.0, approval_default="allow"))
    call = {"tool_name": "bash", "command": "ls"}
    key = f"key-{uuid.uuid4().hex}"
    gone = await agent.d.emit(event, dict(call), idempotency_key=key, timeout_s=2.0)
    assert gone.action == "deny" and CALLERS_DEADLINE in (gone.reason or "")
    label = (await approver.pending(agent.session)).label
    async with ApprovalsClient(approver.nc) as client:
        assert label in [r.label for r in await client.pending_approvals()]  # not yet overdue
        with anyio.fail_after(15):
            while True:  # each listing reads the server's clock: no event to wait on
                if label not in [r.label for r in await client.pending_approvals()]:
                    break
                await anyio.sleep(0.2)
        got = await client.get_approval(label)
        assert got is not None
        assert got[0].status == "cancelled"
        assert got[0].reason == "timed out after 3.0s; default allow applied"
        with pytest.raises(AlreadySettledError, match=r"timed out after 3\.0s"):
            await client.answer_approval(label, "Allow", approver="late")
    again = await agent.d.emit(event, dict(call), idempotency_key=key, timeout_s=5)
    assert again.action == "continue" and again.reason == "timed out after 3.0s; default allow"


async def test_an_overdue_approval_is_refused_an_answer_and_listed_as_expired_by_the_cli(
    agent: Agent, approver: Approver, event: str, nats_url: str
) -> None:
    """`hookbus approvals list --json` ends an approval nobody waited for past its timeout
    (its own margin) and shows it once as expired; `answer` then finds nothing pending.
    The caller leaves before the approval's timeout, with seconds to spare for the approval
    to be written first (a busy machine's JetStream write can take a tenth of a second)."""
    agent.d.register(event, asker(approval_timeout=2.5, approval_default="deny"))
    gone = await agent.d.emit(event, {"tool_name": "bash"}, timeout_s=2.0)
    assert gone.action == "deny"
    label = (await approver.pending(agent.session)).label
    await anyio.sleep(2.5 + _approvals_margin() + 0.5)
    listed = await hookbus_cli(nats_url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [r for r in json.loads(listed.stdout) if r["label"] == label]
    assert [(r["state"], r["reason"]) for r in rows] == [
        ("expired", "timed out after 2.5s; default deny applied")
    ]
    answered = await hookbus_cli(
        nats_url, "approvals", "answer", label, "Allow", "--approver", "late"
    )
    assert answered.returncode == 1 and b"no pending approval" in answered.stderr
    assert b"Traceback" not in answered.stderr


def _approvals_margin() -> float:
    from hookbus.dispatcher._approvals import EXPIRY_MARGIN_S

    return EXPIRY_MARGIN_S


async def test_an_approval_is_cancelled_from_the_cli_and_its_asker_denies(
    agent: Agent, approver: Approver, event: str, nats_url: str
) -> None:
    """`hookbus approvals cancel ID --reason ...` ends a pending approval: the waiting call
    is denied with the reason; a second cancel, or a bad id, is one line, never a
    traceback; no argument is a usage error (exit 2)."""
    agent.d.register(event, asker(approval_timeout=20.0))
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, agent.d, event, {"tool_name": "bash"})
        part = await approver.pending(agent.session)
        from hookbus.cli._output import short_id

        done = await hookbus_cli(
            nats_url, "approvals", "cancel", short_id(part.label), "--reason", "not today"
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode().strip() == f"cancelled {part.label}: not today"
        result = await out.wait()
    assert result.action == "deny" and result.reason == "approval cancelled: not today"
    again = await hookbus_cli(nats_url, "approvals", "cancel", part.label)
    assert again.returncode == 1 and b"no pending approval" in again.stderr
    assert b"Traceback" not in again.stderr
    usage = await hookbus_cli(nats_url, "approvals", "cancel")
    assert usage.returncode == 2 and b"Traceback" not in usage.stderr
