"""`HookbusGuard`: an OpenAI Agents SDK agent's tool calls decided by remote hook workers.

Every test runs an `agents.Agent` on a scripted model (`Scripted`, an implementation of the
SDK's own `agents.models.interface.Model`: no network) through `HookbusGuard.run`, whose
dispatcher emits on its own connection; the handlers are `HookWorker`s on other connections
(one per simulated process) of a real nats-server. Each test gets a private server (the
`embedded_server` fixture): the guard emits the standard events (``tool:pre``, ...), so
handler declarations must not leak between tests. The SDK's tracing export is off and its
API key a dummy, so nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable
from typing import Any

import anyio
import pytest

os.environ.setdefault("OPENAI_API_KEY", "sk-dummy-no-network")

import agents
from _integration_cases import (
    RecordedTools,
    answered,
    asking,
    denied_bash_call,
    denying_bash,
    pending_approval,
)
from _integration_kit import Connect, Handler, named, private_connect, returning, worker
from agents import Agent, FunctionTool, ModelResponse, Usage, function_tool
from agents.models.interface import Model
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.dispatcher._approvals import next_approval_label
from hookbus.integrations.openai_agents import HookbusGuard, HookDeniedError
from hookbus.schemas import (
    PROMPT_SUBMIT,
    TOOL_POST,
    TOOL_PRE,
    HookResult,
    NotConnectedError,
)

agents.set_tracing_disabled(True)

pytestmark = pytest.mark.anyio

connect = private_connect
"""Connections to this test's private server (a fixture)."""


# -- fixtures and helpers --------------------------------------------------------------------
def call(name: str, args: dict[str, Any], call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        id=f"fc-{call_id}",
        call_id=call_id,
        type="function_call",
        name=name,
        arguments=json.dumps(args),
    )


def text(content: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id="msg-1",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(text=content, type="output_text", annotations=[])],
    )


class Scripted(Model):
    """A model that answers each request with the next scripted turn (then "done"), and
    records the input of every request."""

    def __init__(self, *turns: list[Any]) -> None:
        self.turns = list(turns)
        self.inputs: list[Any] = []

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kw: Any):
        self.inputs.append(input)
        turn = self.turns.pop(0) if self.turns else [text("done")]
        return ModelResponse(output=turn, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the tests run without streaming")

    def outputs(self, i: int) -> dict[str, str]:
        """call id -> the output text the model read for it, in request `i`."""
        items = self.inputs[i] if isinstance(self.inputs[i], list) else []
        return {
            item["call_id"]: item["output"]
            for item in items
            if isinstance(item, dict) and item.get("type") == "function_call_output"
        }


class Tools(RecordedTools):
    """The agent's tools (``bash``, ``send_email``, ``transfer``), recording what they ran
    with."""

    def all(self) -> list[FunctionTool]:
        return [function_tool(f) for f in self.functions().values()]


def make_agent(model: Scripted, tools: Tools) -> Agent[Any]:
    return Agent(name="ops", instructions="Help.", model=model, tools=list(tools.all()))


# -- tool:pre ---------------------------------------------------------------------------------
async def test_a_denied_tool_never_runs_and_the_model_reads_the_reason(connect: Connect) -> None:
    seen: list[Any] = []
    async with denying_bash(connect, "destructive shell commands are not allowed", seen) as d:
        model = Scripted(
            [
                call("bash", {"command": "rm -rf /"}, "c1"),
                call("send_email", {"to": "a", "body": "b"}, "c2"),
            ]
        )
        tools = Tools()
        result = await HookbusGuard(d).run(make_agent(model, tools), "clean up", run_id="r1")
    assert result.final_output == "done"
    assert tools.ran == [("send_email", {"to": "a", "body": "b"})]  # the filter spared it
    outputs = model.outputs(1)
    assert outputs["c1"] == "Denied by hook: destructive shell commands are not allowed"
    assert outputs["c2"] == "sent to a"
    data = denied_bash_call(seen)  # the worker saw bash only (its tool_filter)
    assert data["tool_call_id"] == "c1"
    assert data["agent_id"] == "agent-1" and data["run_id"] == "r1"
    assert data["session_id"] == "r1"


async def test_modified_args_reach_the_tool_and_invalid_ones_deny(connect: Connect) -> None:
    async def redact(event: str, data: dict[str, Any]) -> HookResult:
        tool_input = dict(data["tool_input"])
        if "body" in tool_input:
            tool_input["body"] = tool_input["body"].replace("4111 1111 1111 1111", "[card]")
        if "amount" in tool_input:
            tool_input["amount"] = "lots"  # the tool's schema wants an integer
        return HookResult(action="modify", data={**data, "tool_input": tool_input})

    posts: list[Any] = []
    async with (
        worker(
            connect,
            (TOOL_PRE, named("redact", redact), {}),
            (TOOL_POST, returning("audit", None, posts), {}),
        ),
        HookDispatcher(await connect()) as d,
    ):
        model = Scripted(
            [
                call("send_email", {"to": "bob", "body": "card 4111 1111 1111 1111"}, "c1"),
                call("transfer", {"amount": 100, "payee": "acme"}, "c2"),
            ]
        )
        tools = Tools()
        await HookbusGuard(d).run(make_agent(model, tools), "pay")
    assert tools.ran == [("send_email", {"to": "bob", "body": "card [card]"})]
    outputs = model.outputs(1)
    assert outputs["c1"] == "sent to bob"
    assert outputs["c2"].startswith("Denied by hook: redact replaced the arguments with invalid")
    [(_, post)] = posts  # tool:post of the call that ran, with the arguments it ran with
    assert post["tool_input"] == {"to": "bob", "body": "card [card]"}
    assert post["tool_result"] == "sent to bob"


async def test_tool_post_and_injections_reach_the_model(connect: Connect) -> None:
    def note() -> Handler:
        async def handler(event: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="inject_context", context_injection="prod is frozen")

        return handler

    async def rewrite(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "tool_result": "[redacted]"})

    async with (
        worker(
            connect,
            (TOOL_PRE, named("notes", note()), {}),
            (TOOL_POST, named("redactor", rewrite), {}),
            (PROMPT_SUBMIT, named("prompt_notes", note()), {}),
        ),
        HookDispatcher(await connect()) as d,
    ):
        model = Scripted([call("bash", {"command": "ls"}, "c1")])
        tools = Tools()
        await HookbusGuard(d).run(make_agent(model, tools), "list files")
    assert tools.ran == [("bash", {"command": "ls"})]
    first = model.inputs[0]
    assert first[0] == {"role": "system", "content": "prod is frozen"}
    assert first[-1]["content"] == "list files"
    assert model.outputs(1)["c1"] == (
        '[redacted]\n\n<hook_injection handler="notes" role="system">prod is frozen'
        "</hook_injection>"
    )


async def test_a_denied_prompt_never_reaches_the_model(connect: Connect) -> None:
    deny = HookResult(action="deny", reason="no prompts today")
    async with (
        worker(connect, (PROMPT_SUBMIT, returning("gate", deny), {})),
        HookDispatcher(await connect()) as d,
    ):
        model = Scripted()
        with pytest.raises(HookDeniedError, match="no prompts today"):
            await HookbusGuard(d).run(make_agent(model, Tools()), "hello")
    assert model.inputs == []


# -- approvals ------------------------------------------------------------------------------
ASK = asking("Transfer 100 to acme?", 30.0)


@pytest.mark.parametrize(("choice", "runs"), [("Allow once", True), ("Deny", False)])
async def test_an_approval_answered_by_another_process_decides_the_tool(
    connect: Connect, choice: str, runs: bool
) -> None:
    async with (
        worker(
            connect, (TOOL_PRE, returning("transfer_approval", ASK), {"tool_filter": ["transfer"]})
        ),
        ApprovalsClient(await connect()) as approver,
        HookDispatcher(await connect(), agent_id="payments") as d,
    ):
        model = Scripted([call("transfer", {"amount": 100, "payee": "acme"}, "c1")])
        tools = Tools()
        stream = await approver.events()
        try:
            async with anyio.create_task_group() as tg:
                done: list[Any] = []

                async def run() -> None:
                    done.append(await HookbusGuard(d).run(make_agent(model, tools), "pay acme"))

                tg.start_soon(run)
                hook = await pending_approval(stream)
                assert tools.ran == []  # the tool waits for the answer
                await approver.answer_approval(
                    hook.label, choice, approver="alice", agent_id=hook.agent_id
                )
        finally:
            await stream.aclose()
    assert hook.metadata["prompt"] == "Transfer 100 to acme?"
    assert hook.metadata["tool_name"] == "transfer"
    assert done[0].final_output == "done"
    if runs:
        assert tools.ran == [("transfer", {"amount": 100, "payee": "acme"})]
    else:
        assert tools.ran == []
        assert model.outputs(1)["c1"] == "Denied by hook: alice chose 'Deny'"


async def test_two_runs_never_share_an_approval(connect: Connect) -> None:
    """The model reuses its call id and the session is fixed: the second run is asked
    again (a refusal of the first never silently decides it, nor its allow the next)."""
    async with (
        worker(
            connect, (TOOL_PRE, returning("transfer_approval", ASK), {"tool_filter": ["transfer"]})
        ),
        ApprovalsClient(await connect()) as approver,
        HookDispatcher(await connect(), agent_id="payments") as d,
    ):
        guard = HookbusGuard(d, session_id="session-1")
        tools = Tools()
        stream = await approver.events()
        labels: list[str] = []
        runs: list[Any] = []

        async def one_run(choice: str) -> None:
            model = Scripted([call("transfer", {"amount": 100, "payee": "acme"}, "call-1")])

            def run() -> Awaitable[Any]:
                return guard.run(make_agent(model, tools), "pay acme")

            result, approval = await answered(run, approver, stream, choice)
            runs.append(result)
            labels.append(approval.label)

        try:
            await one_run("Deny")
            assert tools.ran == []
            await one_run("Allow once")
            assert tools.ran == [("transfer", {"amount": 100, "payee": "acme"})]
            await one_run("Deny")
        finally:
            await stream.aclose()
    assert tools.ran == [("transfer", {"amount": 100, "payee": "acme"})]
    assert len(set(labels)) == 3
    assert labels[1] != next_approval_label(labels[0])
    assert labels[2] != next_approval_label(labels[1])
    assert [r.final_output for r in runs] == ["done", "done", "done"]


async def test_an_allow_once_runs_the_tool_once_however_often_the_run_resumes(
    connect: Connect,
) -> None:
    """The same run resumed twice (same ``run_id``, the model replaying call ``c1``): the
    "Allow once" the first run got runs the transfer once; the first resume reaching the
    call again is asked again (a fresh approval), answered "Deny"; the second resume gets
    that refusal without asking (a refusal decides every retry of the call)."""
    async with (
        worker(
            connect, (TOOL_PRE, returning("transfer_approval", ASK), {"tool_filter": ["transfer"]})
        ),
        ApprovalsClient(await connect()) as approver,
        HookDispatcher(await connect(), agent_id="payments") as d,
    ):
        guard = HookbusGuard(d)
        tools = Tools()
        stream = await approver.events()
        labels: list[str] = []

        def model() -> Scripted:
            return Scripted([call("transfer", {"amount": 100, "payee": "acme"}, "c1")])

        async def resume(choice: str) -> None:
            def run() -> Awaitable[Any]:
                return guard.run(make_agent(model(), tools), "pay acme", run_id="run-1")

            _, approval = await answered(run, approver, stream, choice)
            labels.append(approval.label)

        try:
            await resume("Allow once")
            await resume("Deny")
            last = model()
            with anyio.fail_after(20):  # nobody is asked: the refusal stands
                await guard.run(make_agent(last, tools), "pay acme", run_id="run-1")
        finally:
            await stream.aclose()
    assert tools.ran == [("transfer", {"amount": 100, "payee": "acme"})]
    assert labels[1] == next_approval_label(labels[0])  # the same call, asked again
    assert last.outputs(1)["c1"] == "Denied by hook: alice chose 'Deny'"


# -- faults -----------------------------------------------------------------------------------
async def test_a_bus_that_cannot_decide_stops_the_run(connect: Connect) -> None:
    async with worker(connect, (TOOL_PRE, returning("security", None), {})):
        nc = await connect()
        async with HookDispatcher(nc) as d:
            model = Scripted([call("bash", {"command": "rm -rf /"}, "c1")])
            tools = Tools()
            await nc.close()  # the agent's connection is gone
            items = [{"role": "user", "content": "clean up"}]  # not text: no prompt:submit
            with pytest.raises(agents.exceptions.UserError) as raised:
                await HookbusGuard(d).run(make_agent(model, tools), items)
    assert isinstance(raised.value.__cause__, NotConnectedError)
    assert tools.ran == []


def test_the_core_does_not_import_the_sdk() -> None:
    import subprocess
    import sys

    code = "import sys, hookbus.dispatcher, hookbus.workers; print('agents' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_only_function_tools_are_governed() -> None:
    from agents import WebSearchTool

    guard = HookbusGuard.__new__(HookbusGuard)
    with pytest.raises(TypeError, match="function tools only"):
        guard.tool(WebSearchTool())  # type: ignore[arg-type]
