"""`HookbusToolHooks`: the tool calls of a LangGraph agent decided by remote hook workers.

Every test runs a LangGraph agent (a ``StateGraph``: a model node, a ``ToolNode`` with the
hooks, LangGraph's ``tools_condition``) on langchain-core's `GenericFakeChatModel` (scripted
answers, no network); the hooks emit through a `HookDispatcher` on its own connection; the
handlers are `HookWorker`s on other connections (one per simulated process) of a real
nats-server, private to each test (the `embedded_server` fixture): the hooks emit the
standard events, so handler declarations must not leak between tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from _integration_cases import (
    RecordedTools,
    asking,
    denied_bash_call,
    denying_bash,
    pending_approval,
)
from _integration_kit import Connect, named, private_connect, returning, worker
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

from hookbus.dispatcher import AnswerNotAppliedError, ApprovalsClient, HookDispatcher
from hookbus.integrations.langgraph import HookbusToolHooks
from hookbus.schemas import TOOL_ERROR, TOOL_POST, TOOL_PRE, HookbusError, HookResult

pytestmark = pytest.mark.anyio

connect = private_connect
"""Connections to this test's private server (a fixture)."""


# -- fixtures and helpers --------------------------------------------------------------------
def calls(*calls: tuple[str, dict[str, Any]], first_id: int = 1) -> AIMessage:
    """A model turn asking for tool calls ``call-1``, ``call-2``, ... (ids models reuse)."""
    return AIMessage(
        "",
        tool_calls=[
            {"name": name, "args": args, "id": f"call-{first_id + i}"}
            for i, (name, args) in enumerate(calls)
        ],
    )


class Tools(RecordedTools):
    """The agent's tools (``bash``, ``transfer``, and ``explode``, which fails), recording
    what they ran with."""

    def all(self) -> list[Any]:
        @tool
        def explode() -> str:
            """Fail."""
            raise RuntimeError("boom")

        plain = self.functions()
        return [tool(plain["bash"]), tool(plain["transfer"]), explode]


@dataclass
class Agent:
    """A LangGraph agent: the model node records what the model read in each request."""

    hooks: HookbusToolHooks
    turns: list[AIMessage]
    tools: Tools = field(default_factory=Tools)
    checkpointer: Any = None
    requests: list[list[BaseMessage]] = field(default_factory=list)

    def __post_init__(self) -> None:
        model = GenericFakeChatModel(messages=iter([*self.turns, *[AIMessage("done")] * 10]))

        async def call_model(state: MessagesState) -> dict[str, Any]:
            self.requests.append(list(state["messages"]))
            return {"messages": [await model.ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", call_model)
        graph.add_node("tools", self.hooks.tool_node(self.tools.all()))
        graph.add_edge(START, "agent")
        graph.add_conditional_edges("agent", tools_condition)
        graph.add_edge("tools", "agent")
        self.graph = graph.compile(checkpointer=self.checkpointer)

    async def run(self, prompt: str | None, thread: str | None = None) -> dict[str, Any]:
        config = {"configurable": {"thread_id": thread}} if thread else {}
        state = None if prompt is None else {"messages": [HumanMessage(prompt)]}
        return await self.graph.ainvoke(state, config)

    def tool_messages(self, i: int) -> dict[str, ToolMessage]:
        """Tool name -> the ToolMessage the model read in request `i`."""
        return {
            m.name or "": m for m in self.requests[i] if isinstance(m, ToolMessage)
        }  # fmt: skip


async def next_approval(approver: ApprovalsClient, stream: Any) -> tuple[str, dict[str, Any]]:
    """The label and metadata of the next pending approval on `stream`."""
    hook = await pending_approval(stream)
    return hook.label, hook.metadata


ASK = asking("Transfer 100 to acme?", 60.0)


# -- tool:pre ---------------------------------------------------------------------------------
async def test_a_denied_rm_rf_never_runs_and_the_model_reads_the_reason(
    connect: Connect,
) -> None:
    seen: list[Any] = []
    async with denying_bash(connect, "destructive command", seen) as d:
        agent = Agent(
            HookbusToolHooks(d),
            [calls(("bash", {"command": "rm -rf /"}), ("transfer", {"amount": 5, "payee": "a"}))],
        )
        result = await agent.run("clean up", thread="thread-1")
    assert result["messages"][-1].content == "done"
    assert agent.tools.ran == [("transfer", {"amount": 5, "payee": "a"})]  # the filter spared it
    read = agent.tool_messages(1)
    assert read["bash"].content == "Denied by hook: destructive command"
    assert read["bash"].status == "error" and read["bash"].tool_call_id == "call-1"
    assert read["transfer"].content == "sent 5 to a"
    data = denied_bash_call(seen)  # the worker saw bash only (its tool_filter)
    assert data["tool_call_id"] == "call-1"
    assert data["agent_id"] == "agent-1" and data["session_id"] == "thread-1"
    assert data["run_id"].startswith("tools:")


async def test_modified_args_reach_the_tool(connect: Connect) -> None:
    async def halve(event: str, data: dict[str, Any]) -> HookResult:
        tool_input = {**data["tool_input"], "amount": data["tool_input"]["amount"] // 2}
        return HookResult(action="modify", data={**data, "tool_input": tool_input})

    async def breaks(event: str, data: dict[str, Any]) -> HookResult | None:
        if data["tool_input"].get("payee") != "mallory":
            return None
        return HookResult(action="modify", data={**data, "tool_input": {"amount": "lots"}})

    async with (
        worker(
            connect,
            (TOOL_PRE, named("halve", halve), {"tool_filter": ["transfer"], "priority": 1}),
            (TOOL_PRE, named("breaks", breaks), {"tool_filter": ["transfer"], "priority": 2}),
        ),
        HookDispatcher(await connect()) as d,
    ):
        agent = Agent(
            HookbusToolHooks(d),
            [
                calls(("transfer", {"amount": 100, "payee": "acme"})),
                calls(("transfer", {"amount": 10, "payee": "mallory"}), first_id=2),
            ],
        )
        await agent.run("pay", thread="thread-1")
    assert agent.tools.ran == [("transfer", {"amount": 50, "payee": "acme"})]
    assert agent.tool_messages(1)["transfer"].content == "sent 50 to acme"
    broken = agent.tool_messages(2)["transfer"]  # arguments the tool refuses: it never ran
    assert broken.status == "error" and "payee" in broken.content


async def test_tool_post_modify_deny_and_injections_reach_the_model(connect: Connect) -> None:
    async def dlp(event: str, data: dict[str, Any]) -> HookResult:
        if data["tool_name"] == "bash":
            return HookResult(action="deny", reason="the output holds secrets")
        text = data["tool_result"].replace("acme", "[payee]")
        return HookResult(action="modify", data={**data, "tool_result": text})

    note = HookResult(action="inject_context", context_injection="Payments over 50 need a ticket.")
    errors: list[Any] = []
    async with (
        worker(
            connect,
            (TOOL_PRE, returning("payments_guidance", note), {"tool_filter": ["transfer"]}),
            (TOOL_POST, named("dlp", dlp), {}),
            (TOOL_ERROR, returning("audit", None, errors), {}),
        ),
        HookDispatcher(await connect()) as d,
    ):
        agent = Agent(
            HookbusToolHooks(d),
            [calls(("transfer", {"amount": 5, "payee": "acme"}), ("bash", {"command": "env"}))],
        )
        await agent.run("pay", thread="thread-1")
    assert len(agent.tools.ran) == 2  # tool:post decides after the tool ran
    read = agent.tool_messages(1)
    assert read["transfer"].content == (
        "sent 5 to [payee]\n\n"
        '<hook_injection handler="payments_guidance" role="system">'
        "Payments over 50 need a ticket.</hook_injection>"
    )
    assert read["bash"].content == "Tool result withheld by hook: the output holds secrets"
    assert errors == []


async def test_a_failing_tool_emits_tool_error(connect: Connect) -> None:
    seen: list[Any] = []
    async with (
        worker(connect, (TOOL_ERROR, returning("audit", None, seen), {})),
        HookDispatcher(await connect()) as d,
    ):
        agent = Agent(HookbusToolHooks(d), [calls(("explode", {}))])
        with pytest.raises(RuntimeError, match="boom"):  # ToolNode's default: raised
            await agent.run("go", thread="thread-1")
    [(event, data)] = seen
    assert event == TOOL_ERROR and data["tool_name"] == "explode"
    assert data["error"] == {"type": "RuntimeError", "msg": "boom"}


# -- approvals ------------------------------------------------------------------------------
@pytest.mark.parametrize(("choice", "runs"), [("Allow once", True), ("Deny", False)])
async def test_an_approval_answered_by_another_process_decides_the_tool(
    connect: Connect, choice: str, runs: bool
) -> None:
    async with (
        worker(connect, (TOOL_PRE, returning("transfer_approval", ASK), {})),
        ApprovalsClient(await connect()) as approver,
        HookDispatcher(await connect(), agent_id="payments") as d,
    ):
        agent = Agent(HookbusToolHooks(d), [calls(("transfer", {"amount": 100, "payee": "acme"}))])
        stream = await approver.events()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(agent.run, "pay acme", "thread-1")
                label, metadata = await next_approval(approver, stream)
                assert agent.tools.ran == []  # the tool waits for the answer
                await approver.answer_approval(label, choice, approver="alice", agent_id="payments")
        finally:
            await stream.aclose()
    assert metadata["prompt"] == "Transfer 100 to acme?" and metadata["tool_name"] == "transfer"
    if runs:
        assert agent.tools.ran == [("transfer", {"amount": 100, "payee": "acme"})]
        assert agent.tool_messages(1)["transfer"].content == "sent 100 to acme"
    else:
        assert agent.tools.ran == []
        assert agent.tool_messages(1)["transfer"].content == "Denied by hook: alice chose 'Deny'"


async def dies_waiting(
    connect: Connect, turn: list[Any], checkpointer: Any, approver: HookDispatcher, stream: Any
) -> tuple[Agent, str]:
    """An agent of ``payments`` that runs `turn` on ``thread-1`` and dies (is cancelled)
    while it waits on the approval `approver` sees on `stream`: (the agent, the label)."""
    async with HookDispatcher(await connect(), agent_id="payments") as d:
        dead = Agent(HookbusToolHooks(d), turn, checkpointer=checkpointer)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dead.run, "pay acme", "thread-1")
            label, _ = await next_approval(approver, stream)
            tg.cancel_scope.cancel()
    return dead, label


@asynccontextmanager
async def transfer_approvals(connect: Connect) -> AsyncIterator[tuple[ApprovalsClient, Any]]:
    """A worker that asks to approve each ``transfer``, an approvals client and its
    approval event stream (closed on exit): (the client, the stream)."""
    async with (
        worker(connect, (TOOL_PRE, returning("transfer_approval", ASK), {})),
        ApprovalsClient(await connect()) as approver,
    ):
        stream = await approver.events()
        try:
            yield approver, stream
        finally:
            await stream.aclose()


async def dies_allowed_once(
    connect: Connect, checkpointer: Any, approver: ApprovalsClient, stream: Any
) -> tuple[Agent, str]:
    """`dies_waiting` on a transfer of 100 to acme, then "Allow once" is answered while
    the agent is dead (not applied: nobody waits on it): (the dead agent, the label)."""
    turn = [calls(("transfer", {"amount": 100, "payee": "acme"}))]
    dead, label = await dies_waiting(connect, turn, checkpointer, approver, stream)
    with pytest.raises(AnswerNotAppliedError):
        await approver.answer_approval(
            label, "Allow once", approver="alice", agent_id="payments", wait_s=0.2
        )
    return dead, label


async def test_an_approval_survives_the_agent_process(connect: Connect) -> None:
    """The agent dies while it waits on the transfer's approval; "Allow once" is answered
    while it is dead; a new agent (new dispatcher, new graph, the same checkpointer) resumes
    the thread: the transfer runs once, without asking again."""
    checkpointer = InMemorySaver()  # a durable checkpointer, as far as this test goes
    async with transfer_approvals(connect) as (approver, stream):
        dead, _ = await dies_allowed_once(connect, checkpointer, approver, stream)
        assert dead.tools.ran == []
        async with HookDispatcher(await connect(), agent_id="payments") as d:
            alive = Agent(HookbusToolHooks(d), [], checkpointer=checkpointer)
            with anyio.fail_after(30):
                result = await alive.run(None, "thread-1")  # resume the thread
    assert alive.tools.ran == [("transfer", {"amount": 100, "payee": "acme"})]
    assert result["messages"][-1].content == "done"
    [read] = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    assert read.content == "sent 100 to acme"


async def test_an_allow_once_runs_the_tool_once_however_often_the_thread_resumes(
    connect: Connect,
) -> None:
    """As above, then the thread is resumed a second time from the same checkpoint (the
    one before the tool node, replayed: what a process that died after the transfer but
    before the next checkpoint would do): the call is asked again in a fresh approval (a
    replay is a fork with a task of its own, so its key is another), never allowed by the
    answer already used, and the refusal given then stops it: the transfer ran once."""
    checkpointer = InMemorySaver()
    async with transfer_approvals(connect) as (approver, stream):
        _, label = await dies_allowed_once(connect, checkpointer, approver, stream)
        async with HookDispatcher(await connect(), agent_id="payments") as d:
            first = Agent(HookbusToolHooks(d), [], checkpointer=checkpointer)
            with anyio.fail_after(30):
                await first.run(None, "thread-1")
            thread = {"configurable": {"thread_id": "thread-1"}}
            history = [s async for s in first.graph.aget_state_history(thread)]
            before_tools = next(s for s in history if s.next == ("tools",))
        async with HookDispatcher(await connect(), agent_id="payments") as d:
            second = Agent(HookbusToolHooks(d), [], checkpointer=checkpointer)
            async with anyio.create_task_group() as tg:
                tg.start_soon(second.graph.ainvoke, None, before_tools.config)
                again, _ = await next_approval(approver, stream)
                await approver.answer_approval(again, "Deny", approver="alice", agent_id="payments")
    assert first.tools.ran == [("transfer", {"amount": 100, "payee": "acme"})]
    assert again != label  # asked again, in a fresh approval
    assert second.tools.ran == []


async def test_two_runs_never_share_an_approval(connect: Connect) -> None:
    """A fixed session, the same tool call id (``call-1``) and the same arguments: thread 1
    is denied; thread 2, and a later turn of thread 1, are each asked anew."""
    turn = calls(("transfer", {"amount": 100, "payee": "acme"}))
    async with (
        worker(connect, (TOOL_PRE, returning("transfer_approval", ASK), {})),
        ApprovalsClient(await connect()) as approver,
        HookDispatcher(await connect(), agent_id="payments") as d,
    ):
        hooks = HookbusToolHooks(d, session_id="session-1")
        stream = await approver.events()
        labels = []
        try:
            for thread, turns, choice in [
                ("thread-1", [turn], "Deny"),
                ("thread-2", [turn], "Allow once"),
            ]:
                agent = Agent(hooks, turns, checkpointer=InMemorySaver())
                async with anyio.create_task_group() as tg:
                    tg.start_soon(agent.run, "pay acme", thread)
                    label, _ = await next_approval(approver, stream)
                    labels.append(label)
                    await approver.answer_approval(
                        label, choice, approver="alice", agent_id="payments"
                    )
            first = agent.tools.ran
            assert first == [("transfer", {"amount": 100, "payee": "acme"})]
            # a second turn of thread 2: the same call id again, asked again
            again = Agent(hooks, [turn], checkpointer=InMemorySaver())
            async with anyio.create_task_group() as tg:
                tg.start_soon(again.run, "pay acme again", "thread-2")
                label, _ = await next_approval(approver, stream)
                labels.append(label)
                await approver.answer_approval(label, "Deny", approver="alice", agent_id="payments")
        finally:
            await stream.aclose()
    assert len(set(labels)) == 3
    assert again.tools.ran == []


async def test_an_approval_nobody_here_can_answer_is_a_deny(connect: Connect) -> None:
    async with (
        worker(connect, (TOOL_PRE, returning("gate", ASK), {})),
        HookDispatcher(await connect(), approvals=False) as d,  # runs no approvals
    ):
        agent = Agent(HookbusToolHooks(d), [calls(("bash", {"command": "ls"}))])
        await agent.run("list", thread="thread-1")
    assert agent.tools.ran == []
    text = agent.tool_messages(1)["bash"].content
    assert text.startswith("Denied by hook: approval required (denied by gate)")
    assert "does not run hookbus approvals" in text


# -- faults, options ------------------------------------------------------------------------
async def test_no_responders_with_a_deny_policy_the_tool_does_not_run(connect: Connect) -> None:
    guard = returning("guard", None)
    async with worker(connect, (TOOL_PRE, guard, {"failure_policy": "deny", "timeout_s": 1.0})):
        pass  # stopped: its declaration stays, and nobody answers it any more
    async with HookDispatcher(await connect()) as d:
        agent = Agent(HookbusToolHooks(d), [calls(("bash", {"command": "ls"}))])
        await agent.run("list", thread="thread-1")
    assert agent.tools.ran == []
    text = agent.tool_messages(1)["bash"].content
    assert text.startswith("Denied by hook: handler 'guard' failed (no_responders)")


async def test_a_synchronous_run_never_runs_a_tool_unchecked(connect: Connect) -> None:
    async with HookDispatcher(await connect()) as d:
        tools = Tools()
        graph = StateGraph(MessagesState)
        graph.add_node("tools", HookbusToolHooks(d).tool_node(tools.all()))
        graph.add_edge(START, "tools")
        compiled = graph.compile()
        with pytest.raises(HookbusError, match="ainvoke or astream"):
            await anyio.to_thread.run_sync(
                compiled.invoke, {"messages": [calls(("bash", {"command": "ls"}))]}
            )
    assert tools.ran == []


def test_bad_options_are_clear_errors() -> None:
    d = HookDispatcher()
    with pytest.raises(TypeError, match="HookDispatcher"):
        HookbusToolHooks(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        HookbusToolHooks(d, timeout_s=-1)
    with pytest.raises(ValueError, match="never emit"):
        HookbusToolHooks(d, timeouts={"tool:pree": 1.0})
    with pytest.raises(ValueError, match="session_id"):
        HookbusToolHooks(d, session_id="")
    with pytest.raises(TypeError, match="awrap_tool_call"):
        HookbusToolHooks(d).tool_node([], awrap_tool_call=None)
