"""`HookbusClaudeHooks`: a Claude Agent SDK host's tool calls decided by remote hook workers.

Every turn is the SDK's ``query()`` driving the real Claude Code CLI (npm
``@anthropic-ai/claude-code``, pinned in tests/claude_cli/package.json, `claude_binary()`)
against a fake Anthropic Messages API (`_claude_cli.FakeMessagesApi`: one ``Bash`` tool
call, then "done"; no network). The hook callbacks emit through a `HookDispatcher` on its
own connection; the handlers are `HookWorker`s on other connections of a real nats-server
(a private one per test: `embedded_server`). Whether a command REALLY ran is read from the
files it creates in the project directory, never from what a hook answered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from _claude_cli import MODEL, FakeMessagesApi, claude_env, trust
from _integration_cases import answered, asking, pending_approval
from _integration_kit import Connect, named, private_connect, returning, worker

from hookbus.dispatcher import AnswerNotAppliedError, ApprovalsClient, HookDispatcher
from hookbus.integrations.claude_agent_sdk import HookbusClaudeHooks
from hookbus.integrations.claude_code import ClaudeCodeOptions
from hookbus.schemas import PROMPT_SUBMIT, TOOL_POST, TOOL_PRE, HookResult

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

connect = private_connect
"""Connections to this test's private server (a fixture)."""

DENIED = "rm -rf ./scratch; touch ran"


# -- fixtures and helpers --------------------------------------------------------------------
@dataclass
class Turn:
    project: Path
    tool_results: list[str]
    shown_to_model: str  # every Messages API request body of the turn, as JSON
    messages: list[Any]

    def ran(self, name: str) -> bool:
        return (self.project / name).exists()


async def turn(
    claude: Path, tmp_path: Path, hooks: HookbusClaudeHooks, command: str, **options: Any
) -> Turn:
    """One ``query()`` whose one tool call is Bash `command`, in a fresh project with a
    ``scratch`` directory in it."""
    from claude_agent_sdk import query

    home, project = tmp_path / "home", tmp_path / "project"
    (project / "scratch").mkdir(parents=True)
    home.mkdir()
    trust(home, project)
    messages: list[Any] = []
    with FakeMessagesApi(command=command).serving() as api:
        opts = hooks.options(
            cli_path=str(claude),
            cwd=str(project),
            env=claude_env(home, api.url),
            model=MODEL,
            **options,
        )
        with anyio.fail_after(120):
            async for message in query(prompt="run the command", options=opts):
                messages.append(message)
    assert len(api.tool_results) == 1, (api.tool_results, messages)
    return Turn(project, api.tool_results, json.dumps(api.requests), messages)


# -- deny, modify, inject_context ------------------------------------------------------------
async def test_a_denied_rm_rf_never_runs_and_the_model_reads_why(
    claude: Path, connect: Connect, tmp_path: Path
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        seen.append((event, data))
        if "rm -rf" in data["tool_input"].get("command", ""):
            return HookResult(action="deny", reason="destructive command: rm -rf")
        return HookResult(action="continue")

    async with (
        worker(connect, (TOOL_PRE, named("no_rm_rf", guard), {})),
        HookDispatcher(await connect(), agent_id="coder") as d,
    ):
        out = await turn(claude, tmp_path, HookbusClaudeHooks(d), DENIED, allowed_tools=["Bash"])
    assert (out.project / "scratch").is_dir()  # rm -rf never ran
    assert not out.ran("ran")
    assert "destructive command: rm -rf" in out.tool_results[0], out.tool_results
    # the worker got Claude Code's own hook input, with the call's ids
    ((_event, data),) = seen
    assert data["tool_name"] == "Bash"
    assert data["tool_input"]["command"] == DENIED
    assert data["tool_use_id"].startswith("toolu_")
    assert data["session_id"]


async def rewritten_turn(claude: Path, connect: Connect, tmp_path: Path, **options: Any) -> Turn:
    """A turn asking for ``touch ran`` while a worker's ``rewrite`` handler modifies every
    Bash command to ``touch rewritten`` (`options`: `turn`'s)."""

    async def rewrite(event: str, data: dict[str, Any]) -> HookResult:
        tool_input = {**data["tool_input"], "command": "touch rewritten"}
        return HookResult(action="modify", data={**data, "tool_input": tool_input})

    async with (
        worker(connect, (TOOL_PRE, rewrite, {})),
        HookDispatcher(await connect(), agent_id="coder") as d,
    ):
        return await turn(claude, tmp_path, HookbusClaudeHooks(d), "touch ran", **options)


async def test_a_modify_rewrites_the_command_and_the_rewritten_one_runs(
    claude: Path, connect: Connect, tmp_path: Path
) -> None:
    out = await rewritten_turn(claude, connect, tmp_path, allowed_tools=["Bash"])
    assert out.ran("rewritten")
    assert not out.ran("ran")
    assert "Bash completed with no output" in out.tool_results[0], out.tool_results


async def test_a_rewrite_is_still_subject_to_the_sdk_permission_rules(
    claude: Path, connect: Connect, tmp_path: Path
) -> None:
    """hookbus rewrites, it does not allow: without ``allowed_tools`` the CLI's own rules
    refuse the rewritten command (nobody is there to approve it)."""
    out = await rewritten_turn(claude, connect, tmp_path)
    assert not out.ran("rewritten")
    assert not out.ran("ran")


async def test_injected_context_reaches_the_model_and_every_event_is_emitted(
    claude: Path, connect: Connect, tmp_path: Path
) -> None:
    seen: list[str] = []

    async def record(event: str, data: dict[str, Any]) -> HookResult:
        seen.append(event)
        if event == TOOL_POST:
            return HookResult(action="inject_context", context_injection="prod is frozen")
        return HookResult(action="continue")

    handlers = [
        (e, named(f"record_{e.replace(':', '_')}", record), {})
        for e in (PROMPT_SUBMIT, TOOL_PRE, TOOL_POST)
    ]
    async with (
        worker(connect, *handlers),
        HookDispatcher(await connect(), agent_id="coder") as d,
    ):
        out = await turn(
            claude, tmp_path, HookbusClaudeHooks(d), "touch ran", allowed_tools=["Bash"]
        )
    assert out.ran("ran")
    assert seen == [PROMPT_SUBMIT, TOOL_PRE, TOOL_POST]
    assert "prod is frozen" in out.shown_to_model


# -- approvals and faults ----------------------------------------------------------------------
ASK = asking("Run this command?", 30.0)


def pre_tool_use(session_id: str, command: str, tool_use_id: str) -> dict[str, Any]:
    """Claude Code's ``PreToolUse`` hook input of a Bash call, as the SDK hands it to
    a hook callback."""
    return {
        "session_id": session_id,
        "transcript_path": "",
        "cwd": "/tmp",
        "hook_event_name": "PreToolUse",
        "tool_name": "Bash",
        "tool_input": {"command": command},
        "tool_use_id": tool_use_id,
    }


@pytest.mark.parametrize(("choice", "runs"), [("Allow once", True), ("Deny", False)])
async def test_an_approval_answered_by_another_process_decides_the_tool(
    claude: Path, connect: Connect, tmp_path: Path, choice: str, runs: bool
) -> None:
    async with (
        worker(connect, (TOOL_PRE, returning("bash_approval", ASK), {})),
        ApprovalsClient(await connect()) as approver,
        HookDispatcher(await connect(), agent_id="coder") as d,
    ):
        hooks = HookbusClaudeHooks(d, options=ClaudeCodeOptions(on_modify="rules", timeout_s=60))
        stream = await approver.events()
        done: list[Turn] = []
        try:
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    done.append(await turn(claude, tmp_path, hooks, "touch ran"))

                tg.start_soon(run)
                hook = await pending_approval(stream, within_s=60)
                assert not (tmp_path / "project" / "ran").exists()  # the tool waits
                await approver.answer_approval(
                    hook.label, choice, approver="alice", agent_id=hook.agent_id
                )
        finally:
            await stream.aclose()
    assert hook.metadata["tool_name"] == "Bash"
    # no allowed_tools: an approval answered in hookbus allows the call outright
    assert done[0].ran("ran") is runs
    if not runs:
        assert "alice" in done[0].tool_results[0], done[0].tool_results


async def test_two_sessions_never_share_an_approval(connect: Connect) -> None:
    """The same tool_use_id in two CLI sessions is two calls: each asks its own approval
    (the callbacks are called as the SDK calls them, with Claude Code's hook input)."""

    async with (
        worker(connect, (TOOL_PRE, returning("bash_approval", ASK), {})),
        ApprovalsClient(await connect()) as approver,
        HookDispatcher(await connect(), agent_id="coder") as d,
    ):
        hooks = HookbusClaudeHooks(d)
        stream = await approver.events()
        labels: list[str] = []

        async def decide(session_id: str, choice: str) -> dict[str, Any]:
            def call() -> Awaitable[dict[str, Any]]:
                return hooks.callback(
                    pre_tool_use(session_id, "ls", "toolu_same"), "toolu_same", {"signal": None}
                )

            out, hook = await answered(call, approver, stream, choice)
            labels.append(hook.label)
            return out

        try:
            first = await decide("session-1", "Allow once")
            second = await decide("session-2", "Deny")
        finally:
            await stream.aclose()
    assert first["hookSpecificOutput"]["permissionDecision"] == "allow"
    assert second["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert len(set(labels)) == 2


async def test_an_allow_once_allows_one_resume_of_a_killed_call(connect: Connect) -> None:
    """A host killed while its Bash call waited on an approval; "Allow once" answered while
    it was dead. The call resumed by a new host (the same session and tool_use_id, as a CLI
    replaying the call would send) is allowed once; resumed again, it is asked again, and a
    refusal then stands. (The real CLI gives each reach a new tool_use_id, so it asks
    again anyway; this is the call the SDK could replay.)"""

    hook_input = pre_tool_use("session-resumed", "transfer 100", "toolu_transfer")

    def decision(out: dict[str, Any]) -> str:
        return str(out["hookSpecificOutput"]["permissionDecision"])

    async with (
        worker(connect, (TOOL_PRE, returning("bash_approval", ASK), {})),
        ApprovalsClient(await connect()) as approver,
    ):
        stream = await approver.events()

        async def host() -> HookbusClaudeHooks:
            d = HookDispatcher(await connect(), agent_id="coder")
            await d.start()
            return HookbusClaudeHooks(d, options=ClaudeCodeOptions(timeout_s=60))

        try:
            dead = await host()
            async with anyio.create_task_group() as tg:
                tg.start_soon(dead.callback, dict(hook_input), "toolu_transfer", {"signal": None})
                asked = await pending_approval(stream)
                tg.cancel_scope.cancel()  # the host is killed mid-wait
            await dead.dispatcher.close()
            with pytest.raises(AnswerNotAppliedError):  # nobody waits on it
                await approver.answer_approval(
                    asked.label, "Allow once", approver="alice", agent_id=asked.agent_id,
                    wait_s=0.2,
                )  # fmt: skip
            resumed = await host()
            try:
                first = await resumed.callback(dict(hook_input), "toolu_transfer", {"signal": None})
                assert decision(first) == "allow"
                again: list[dict[str, Any]] = []
                async with anyio.create_task_group() as tg:

                    async def call() -> None:
                        again.append(
                            await resumed.callback(
                                dict(hook_input), "toolu_transfer", {"signal": None}
                            )
                        )

                    tg.start_soon(call)
                    fresh = await pending_approval(stream)
                    assert not again  # not allowed again without asking
                    await approver.answer_approval(
                        fresh.label, "Deny", approver="alice", agent_id=fresh.agent_id
                    )
            finally:
                await resumed.dispatcher.close()
        finally:
            await stream.aclose()
    assert fresh.label != asked.label
    assert decision(again[0]) == "deny"


async def test_an_approval_nobody_answers_ends_within_the_doors_wait(connect: Connect) -> None:
    """The handler's approval waits 30 s; the door waits 3 s. Nobody answering, the
    approval ends with its default deny at the door's wait less a fifth (2.4 s): the
    callback's answer is that deny, and the record is closed, not left pending."""

    hook_input = pre_tool_use("session-wait", "ls", "toolu_wait")
    async with (
        worker(connect, (TOOL_PRE, returning("bash_approval", ASK), {})),
        HookDispatcher(await connect(), agent_id="coder") as d,
    ):
        hooks = HookbusClaudeHooks(d, options=ClaudeCodeOptions(on_modify="rules", timeout_s=3))
        with anyio.fail_after(20):  # far below the handler's 30 s
            out = await hooks.callback(hook_input, "toolu_wait", {"signal": None})
        async with ApprovalsClient(await connect()) as client:
            page = await client.approval_page(status=None)
    assert out["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert out["hookSpecificOutput"]["permissionDecisionReason"] == (
        "timed out after 2.4s; default deny"
    )
    assert [(r.status, r.reason) for r in page.records] == [
        ("cancelled", "timed out after 2.4s; default deny applied")
    ]


async def test_an_ask_user_without_approvals_is_a_deny(
    claude: Path, connect: Connect, tmp_path: Path
) -> None:
    async with (
        worker(connect, (TOOL_PRE, returning("bash_approval", ASK), {})),
        HookDispatcher(await connect(), agent_id="coder", approvals=False) as d,
    ):
        out = await turn(claude, tmp_path, HookbusClaudeHooks(d), "touch ran",
                         allowed_tools=["Bash"])  # fmt: skip
    assert not out.ran("ran")
    assert "cannot be answered" in out.tool_results[0], out.tool_results


async def test_hookbus_unreachable_denies_the_tool(
    claude: Path, connect: Connect, tmp_path: Path
) -> None:
    async def allow(event: str, data: dict[str, Any]) -> None:
        return None

    async with worker(connect, (TOOL_PRE, named("security", allow), {})):
        nc = await connect()
        async with HookDispatcher(nc, agent_id="coder") as d:
            hooks = HookbusClaudeHooks(d)
            await nc.close()  # the host's connection is gone: nobody can decide tool:pre
            out = await turn(claude, tmp_path, hooks, "touch ran", allowed_tools=["Bash"])
    assert not out.ran("ran")
    assert "hookbus unavailable" in out.tool_results[0], out.tool_results


# -- construction --------------------------------------------------------------------------
def test_hooks_and_options() -> None:
    from claude_agent_sdk import HookMatcher

    d = object.__new__(HookDispatcher)
    hooks = HookbusClaudeHooks(d, matcher="Bash")
    made = hooks.hooks()
    assert sorted(made) == ["PostToolUse", "PreToolUse", "UserPromptSubmit"]
    assert made["PreToolUse"][0].on_failure == "block"
    assert made["PreToolUse"][0].matcher == "Bash"
    assert made["UserPromptSubmit"][0].matcher is None

    async def mine(input_data: Any, tool_use_id: Any, context: Any) -> dict[str, Any]:
        return {}

    opts = hooks.options(hooks={"PreToolUse": [HookMatcher(hooks=[mine])]}, max_turns=3)
    assert [m.hooks[0] for m in opts.hooks["PreToolUse"]] == [hooks.callback, mine]
    assert opts.max_turns == 3
    with pytest.raises(TypeError):
        HookbusClaudeHooks(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SessionStart"):
        HookbusClaudeHooks(d, events=["SessionStart"])


def test_import_hookbus_does_not_import_the_sdk() -> None:
    code = (
        "import sys, hookbus, hookbus.dispatcher, hookbus.integrations.claude_code;"
        " assert 'claude_agent_sdk' not in sys.modules, 'imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
