"""The Claude Code door (`hookbus claude-code`, `hookbus.integrations.claude_code`).

Every hook input of tests/fixtures/claude_code/ (one per event, written from the Claude Code
hooks reference) goes through the command door as a real subprocess (the ``hookbus``
console script, stdin in, stdout and exit code checked exactly) against a private
nats-server, a ``hookbus dispatcher`` process and a ``hookbus worker`` process serving
tests/fixtures/claude_code/policy.py. The server is private to this module: the door emits
standard events (``tool:pre``, ...) whose declarations must not leak into other tests.
`answer` itself is also tested with an in-process `HookDispatcher` and local handlers.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from _claude_bus import ENV, FIXTURES, HOOKBUS, policy_bus
from _ports import free_port
from click.testing import CliRunner

from hookbus._core.nats_guard import order_flushes
from hookbus.cli import EmbeddedNatsServer
from hookbus.cli._claude_code_cmd import claude_code
from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.integrations.claude_code import (
    EVENT_MAP,
    EVENTS,
    ClaudeCodeAnswer,
    ClaudeCodeOptions,
    answer,
    fallback_answer,
    http_reply,
)
from hookbus.schemas import DISPATCHER_QUEUE_GROUP, EMIT_SERVICE_WILDCARD, HookResult


def hook_input(name: str, **changes: Any) -> dict[str, Any]:
    """The fixture of event `name` with `changes`, under a fresh session id."""
    body: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    body["session_id"] = f"sess-{uuid.uuid4().hex[:12]}"
    body.update(changes)
    return body


def with_command(name: str, command: str) -> dict[str, Any]:
    body = hook_input(name)
    body["tool_input"] = {**body["tool_input"], "command": command}
    return body


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def out(self) -> Any:
        return json.loads(self.stdout) if self.stdout.strip() else None


def run_hook(body: Any, *args: str, url: str | None = None, timeout: float = 40, **env: str) -> Ran:
    """``hookbus claude-code [--url URL] ARGS`` with `body` on stdin (a dict as JSON)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    argv = [HOOKBUS, "claude-code", *(["--url", url] if url else []), *args]
    start = time.monotonic()
    p = subprocess.run(argv, input=data, capture_output=True, timeout=timeout, env={**ENV, **env})
    return Ran(p.returncode, p.stdout.decode(), p.stderr.decode(), time.monotonic() - start)


@dataclass
class Bus:
    url: str
    seen: Path

    def seen_by(self, session_id: str) -> list[dict[str, Any]]:
        """What the policy handlers received for `session_id`, in order."""
        lines = self.seen.read_text().splitlines() if self.seen.exists() else []
        records = [json.loads(line) for line in lines]
        return [r for r in records if r["data"].get("session_id") == session_id]


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    """A private server, a dispatcher service and the policy worker, for the module."""
    with policy_bus(tmp_path_factory.mktemp("claude-code")) as served:
        url = served.url
        # the first and the last handler the worker declares both answer
        served.wait_until(
            lambda: (
                run_hook(with_command("PreToolUse", "rm -rf /"), url=url).out
                == deny_pre("destructive command")
            ),
            "tool:pre routed to the policy worker",
        )
        served.wait_until(
            lambda: (
                (run_hook(hook_input("Notification"), url=url).out or {}).get("systemMessage")
                == "forwarded to the on-call channel"
            ),
            "user:notification routed to the policy worker",
        )
        yield Bus(url, served.seen)


def deny_pre(reason: str) -> dict[str, Any]:
    return {
        "hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": reason,
        }
    }


def specific(name: str, **fields: Any) -> dict[str, Any]:
    return {"hookSpecificOutput": {"hookEventName": name, **fields}}


def redacted_pre(decision: str) -> dict[str, Any]:
    """The PreToolUse answer once the guard redacted ``cat SECRET.txt``: `decision`, with
    the modified input for Claude Code to run."""
    return specific(
        "PreToolUse",
        permissionDecision=decision,
        permissionDecisionReason="tool input modified by guard",
        updatedInput={"command": "cat [redacted].txt", "description": "Run the test suite"},
    )


# -- every event through the command door ----------------------------------------------------
CASES: list[tuple[str, str, dict[str, Any], tuple[str, ...], Any]] = [
    ("pre-continue", "PreToolUse", {}, (), None),
    (
        "pre-continue-allow",
        "PreToolUse",
        {},
        ("--on-continue", "allow"),
        specific("PreToolUse", permissionDecision="allow"),
    ),
    (
        "pre-deny",
        "PreToolUse",
        {"command": "rm -rf /tmp/build"},
        (),
        deny_pre("destructive command"),
    ),
    ("pre-modify", "PreToolUse", {"command": "cat SECRET.txt"}, (), redacted_pre("ask")),
    (
        "pre-modify-allow",
        "PreToolUse",
        {"command": "cat SECRET.txt"},
        ("--on-continue", "allow"),
        redacted_pre("allow"),
    ),
    (
        "pre-inject",
        "PreToolUse",
        {"command": "git push origin main"},
        (),
        specific("PreToolUse", additionalContext="main is protected"),
    ),
    (
        "permission-deny",
        "PermissionRequest",
        {},
        (),
        specific(
            "PermissionRequest",
            decision={"behavior": "deny", "message": "no rm in this repository"},
        ),
    ),
    ("permission-continue", "PermissionRequest", {"command": "ls"}, (), None),
    (
        "permission-allow",
        "PermissionRequest",
        {"command": "ls"},
        ("--on-continue", "allow"),
        specific("PermissionRequest", decision={"behavior": "allow"}),
    ),
    (
        "post-modify",
        "PostToolUse",
        {},
        (),
        specific(
            "PostToolUse",
            updatedToolOutput={
                "stdout": "[redacted]\n",
                "stderr": "",
                "interrupted": False,
                "isImage": False,
            },
        ),
    ),
    (
        "failure-inject",
        "PostToolUseFailure",
        {},
        (),
        specific("PostToolUseFailure", additionalContext="rerun with --verbose"),
    ),
    ("prompt-continue", "UserPromptSubmit", {}, (), None),
    (
        "prompt-deny",
        "UserPromptSubmit",
        {"prompt": "my password is hunter2"},
        (),
        {"decision": "block", "reason": "prompt holds a password"},
    ),
    (
        "prompt-inject",
        "UserPromptSubmit",
        {"prompt": "what is the weather like?"},
        (),
        specific("UserPromptSubmit", additionalContext="the user is in Paris"),
    ),
    (
        "session-start-inject",
        "SessionStart",
        {},
        (),
        specific("SessionStart", additionalContext="run make test before commits"),
    ),
    ("session-end", "SessionEnd", {}, (), None),
    ("stop-deny", "Stop", {}, (), {"decision": "block", "reason": "finish the TODO items first"}),
    ("stop-active", "Stop", {"stop_hook_active": True}, (), None),
    ("subagent-stop", "SubagentStop", {}, (), None),
    (
        "compact-deny",
        "PreCompact",
        {},
        (),
        {"decision": "block", "reason": "no automatic compaction during a release"},
    ),
    ("compact-manual", "PreCompact", {"trigger": "manual"}, (), None),
    (
        "notification-message",
        "Notification",
        {},
        (),
        {"systemMessage": "forwarded to the on-call channel"},
    ),
]


@pytest.mark.parametrize(
    ("name", "changes", "args", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_every_event_through_the_command_door(
    bus: Bus, name: str, changes: dict[str, Any], args: tuple[str, ...], expected: Any
) -> None:
    command = changes.pop("command", None) if "command" in changes else None
    body = with_command(name, command) if command else hook_input(name, **changes)
    ran = run_hook(body, *args, url=bus.url)
    assert (ran.code, ran.out, ran.stderr) == (0, expected, "")
    assert ran.stdout.count("\n") == (1 if expected else 0)  # one JSON line or nothing
    # the handler of the mapped event got the hook input, field for field
    (record,) = bus.seen_by(body["session_id"])
    assert record["event"] == EVENT_MAP[name]
    assert {k: record["data"].get(k) for k in body} == body
    assert record["data"]["timestamp"]  # stamped by the dispatcher


def test_the_cases_cover_every_event() -> None:
    assert {case[1] for case in CASES} == set(EVENTS) == set(EVENT_MAP)
    assert {p.stem for p in FIXTURES.glob("*.json")} == set(EVENTS)


# -- approvals -------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (
            "Allow",
            specific(
                "PreToolUse",
                permissionDecision="allow",
                permissionDecisionReason="approved in hookbus: alice chose 'Allow'",
            ),
        ),
        ("Deny", deny_pre("alice chose 'Deny'")),
    ],
)
async def test_ask_user_is_answered_by_a_hookbus_approver(
    bus: Bus, choice: str, expected: Any
) -> None:
    """The dispatcher service turns the handler's ask_user into an approval; an approver in
    another process answers it while the hook waits."""
    nc = await nats.connect(bus.url)
    approver = ApprovalsClient(nc)
    await approver.start()
    stream = await approver.events()
    body = with_command("PreToolUse", "deploy web")
    try:
        async with await anyio.open_process(
            [HOOKBUS, "claude-code", "--url", bus.url], env=ENV
        ) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            await proc.stdin.send(json.dumps(body).encode())
            await proc.stdin.aclose()
            with anyio.fail_after(20):
                async for event in stream:
                    part = event.hook
                    meta = part.metadata
                    if part.status == "pending" and meta.get("session_id") == body["session_id"]:
                        break
            assert meta["prompt"] == "Run 'deploy web' on production?"
            assert meta["tool_name"] == "Bash" and meta["event"] == "tool:pre"
            await approver.answer_approval(
                part.label, choice, approver="alice", agent_id=part.agent_id
            )
            with anyio.fail_after(20):
                stdout = b"".join([chunk async for chunk in proc.stdout])
                code = await proc.wait()
    finally:
        await stream.aclose()
        await approver.close()
        await nc.close()
    assert code == 0
    assert json.loads(stdout) == expected


def approval_records(url: str, session_id: str) -> list[tuple[str, str | None]]:
    """(status, reason) of every approval record of `session_id`."""

    async def records() -> list[tuple[str, str | None]]:
        nc = await nats.connect(url)
        try:
            async with ApprovalsClient(nc) as client:
                page = await client.approval_page(status=None)
        finally:
            await nc.close()
        return [(r.status, r.reason) for r in page.records
                if r.metadata.get("session_id") == session_id]  # fmt: skip

    return anyio.run(records)


@pytest.mark.parametrize("path", ["service", "embedded"])
def test_an_approval_nobody_answers_ends_within_the_doors_wait(bus: Bus, path: str) -> None:
    """The handler's approval waits 20 s; the door waits 3 s. Through the dispatcher service
    (the door's wait travels as ``EmitRequest.approval_timeout_s``) or an embedded
    dispatcher, the approval's timeout is cut to the door's wait less a fifth
    (`ClaudeCodeOptions.approval_timeout_s`: 2.4 s): nobody answering ends it with its
    default deny before the door gives up, and none is left pending behind it."""
    body = with_command("PreToolUse", "deploy cache")
    args = ("--embedded", "--on-ask-user", "approval") if path == "embedded" else ()
    ran = run_hook(body, *args, "--timeout", "3", url=bus.url)
    assert (ran.code, ran.stderr) == (0, "")  # hookbus answered, not the door's fallback
    decision = ran.out["hookSpecificOutput"]
    assert decision["permissionDecision"] == "deny"
    assert decision["permissionDecisionReason"] == "timed out after 2.4s; default deny"
    assert "systemMessage" not in ran.out
    assert ran.seconds < 15  # the process's start included; the handler's own wait is 20 s
    assert approval_records(bus.url, body["session_id"]) == [
        ("cancelled", "timed out after 2.4s; default deny applied")
    ]


def test_embedded_dispatcher_asks_claude_code(bus: Bus) -> None:
    """--embedded with --on-ask-user ask: no hookbus approval, Claude Code asks the user."""
    ran = run_hook(with_command("PreToolUse", "deploy web"), "--embedded", url=bus.url)
    assert (ran.code, ran.stderr) == (0, "")
    assert ran.out == specific(
        "PreToolUse",
        permissionDecision="ask",
        permissionDecisionReason="Run 'deploy web' on production?",
    )
    ran = run_hook(with_command("PreToolUse", "rm -rf /"), "--embedded", url=bus.url)
    assert ran.out == deny_pre("destructive command")


# -- when hookbus cannot answer ----------------------------------------------------------------
def unavailable(name: str, why: str, action: str) -> str:
    return f"hookbus unavailable ({why}); {name} answered by the fallback: {action}"


def test_nats_unreachable_denies_a_tool_call_at_once() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    why = f"cannot connect to NATS at {url}: connection refused"
    ran = run_hook(hook_input("PreToolUse"), url=url)
    assert ran.code == 0
    assert ran.out == {
        **deny_pre(f"hookbus unavailable ({why}): denied"),
        "systemMessage": unavailable("PreToolUse", why, "deny"),
    }
    assert ran.stderr == unavailable("PreToolUse", why, "deny") + "\n"
    assert ran.seconds < 3


def test_nats_unreachable_other_events_and_configured_fallbacks() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    why = f"cannot connect to NATS at {url}: connection refused"
    ran = run_hook(hook_input("UserPromptSubmit"), url=url)
    assert ran.out == {"systemMessage": unavailable("UserPromptSubmit", why, "none")}
    ran = run_hook(hook_input("PreToolUse"), "--fallback", "PreToolUse=allow", url=url)
    assert ran.out == {
        **specific("PreToolUse", permissionDecision="allow"),
        "systemMessage": unavailable("PreToolUse", why, "allow"),
    }
    ran = run_hook(hook_input("UserPromptSubmit"), "--fallback", "deny", url=url)
    assert ran.out == {
        "decision": "block",
        "reason": f"hookbus unavailable ({why}): denied",
        "systemMessage": unavailable("UserPromptSubmit", why, "deny"),
    }


def test_a_server_that_never_answers_is_cut_by_the_connect_timeout() -> None:
    with socket.socket() as listener:  # accepts TCP, never speaks NATS
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"nats://127.0.0.1:{listener.getsockname()[1]}"
        ran = run_hook(hook_input("PreToolUse"), "--connect-timeout", "0.5", url=url)
    assert ran.code == 0
    assert ran.out["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert ran.seconds < 4


def test_no_dispatcher_service_denies_a_tool_call() -> None:
    with EmbeddedNatsServer() as server:
        ran = run_hook(hook_input("PreToolUse"), url=server.url)
    why = (
        "no hookbus dispatcher service answers on hookbus.v1.emit.=.tool=3Apre"
        " (run `hookbus dispatcher`)"
    )
    assert ran.out == {
        **deny_pre(f"hookbus unavailable ({why}): denied"),
        "systemMessage": unavailable("PreToolUse", why, "deny"),
    }


@pytest.mark.anyio
async def test_a_dispatcher_that_never_replies_is_cut_by_the_hook_timeout() -> None:
    """A subscriber on the service's subjects that never answers: the emit's request
    times out after --timeout + 1.5 s and the fallback answers."""
    with EmbeddedNatsServer() as server:
        nc = await nats.connect(server.url)
        order_flushes(nc)  # the flush below means "subscribed on the server"
        try:
            await nc.subscribe(EMIT_SERVICE_WILDCARD, queue=DISPATCHER_QUEUE_GROUP)
            await nc.flush()
            start = time.monotonic()
            done = await anyio.run_process(
                [HOOKBUS, "claude-code", "--url", server.url, "--timeout", "1"],
                input=json.dumps(hook_input("PreToolUse")).encode(),
                env=ENV,
                check=False,
            )
            seconds = time.monotonic() - start
        finally:
            await nc.close()
    why = "the dispatcher service did not answer within 2.5s"
    assert done.returncode == 0
    assert json.loads(done.stdout) == {
        **deny_pre(f"hookbus unavailable ({why}): denied"),
        "systemMessage": unavailable("PreToolUse", why, "deny"),
    }
    assert 2.5 <= seconds < 6


def test_a_misconfigured_command_answers_by_the_default_fallback() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    for args, problem in [
        (("--no-such-option",), "No such option '--no-such-option'"),
        (("--fallback", "PreToolUse=maybe"), "the action must be deny, allow or none"),
        (("--timeout", "0"), "timeout_s must be a finite number of seconds above 0"),
    ]:
        ran = run_hook(hook_input("PreToolUse"), *args, url=url)
        assert ran.code == 0, ran.stderr
        assert ran.out["hookSpecificOutput"]["permissionDecision"] == "deny"
        assert "the hook command is misconfigured" in ran.stderr and problem in ran.stderr
        assert "Traceback" not in ran.stderr


# -- bad input: Claude Code's non-blocking error ---------------------------------------------
@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "the hook input is not JSON (Expecting value: line 1 column 1 (char 0))"),
        (b"[1, 2]", "the hook input is a JSON array, not an object"),
        (b'{"session_id": "s"}', "the hook input has no hook_event_name (a string)"),
        (
            b'{"hook_event_name": "TeammateIdle", "session_id": "s"}',
            f"unsupported Claude Code hook event 'TeammateIdle' (supported: {', '.join(EVENTS)})",
        ),
        (
            b'{"hook_event_name": "PreToolUse", "session_id": "s", "tool_input": {}}',
            "the PreToolUse input has no 'tool_name' (a string; missing)",
        ),
        (
            b'{"hook_event_name": "PreToolUse", "session_id": "s", "tool_name": "Bash",'
            b' "tool_input": "ls"}',
            "the PreToolUse input has no 'tool_input' (an object; a JSON string)",
        ),
        (
            b'{"hook_event_name": "SessionEnd"}',
            "the SessionEnd input has no 'session_id' (a string; missing)",
        ),
        (b"\xff\xfe", "the hook input is not UTF-8 text (invalid start byte)"),
    ],
)
def test_bad_input_is_a_non_blocking_error(body: bytes, error: str) -> None:
    ran = run_hook(body, url=f"nats://127.0.0.1:{free_port()}")
    assert (ran.code, ran.stdout, ran.stderr) == (1, "", f"hookbus claude-code: {error}\n")


# -- answer() with an in-process dispatcher ---------------------------------------------------
def local(*handlers: tuple[str, Any], strict: bool = False) -> HookDispatcher:
    d = HookDispatcher(strict_events=strict)
    for event, result in handlers:

        async def handler(event: str, data: dict[str, Any], result: Any = result) -> HookResult:
            return result(data) if callable(result) else result

        d.register(event, handler, name=f"h_{event.replace(':', '_')}")
    return d


async def ask(
    d: HookDispatcher, name: str, options: ClaudeCodeOptions | None = None, **changes: Any
) -> ClaudeCodeAnswer:
    return await answer(json.dumps(hook_input(name, **changes)), d.emit, options)


@pytest.mark.anyio
async def test_answer_maps_ask_user_per_event() -> None:
    asking = HookResult(action="ask_user", approval_prompt="sure?")
    d = local(
        ("tool:pre", asking),
        ("claude_code:permission_request", asking),
        ("prompt:submit", asking),
        ("session:end", asking),
    )
    a = await ask(d, "PreToolUse")
    assert json.loads(a.stdout) == specific(
        "PreToolUse", permissionDecision="ask", permissionDecisionReason="sure?"
    )
    a = await ask(d, "PermissionRequest")  # no decision: Claude Code's dialog asks
    assert json.loads(a.stdout) == {"systemMessage": "sure?"}
    a = await ask(d, "UserPromptSubmit")  # nobody to ask here: denied
    assert json.loads(a.stdout) == {"decision": "block", "reason": "approval required: sure?"}
    a = await ask(d, "SessionEnd")  # cannot block: the user is told
    assert json.loads(a.stdout) == {
        "systemMessage": "hookbus denied SessionEnd: approval required: sure?"
    }


@pytest.mark.anyio
async def test_answer_ask_user_with_a_modified_input_shows_it() -> None:
    d = HookDispatcher()

    @d.register("tool:pre", priority=1)
    async def rewrite(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "tool_input": {"command": "ls -l"}})

    @d.register("tool:pre", priority=2)
    async def confirm(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", reason="check the rewrite")

    a = await ask(d, "PreToolUse")
    assert json.loads(a.stdout) == specific(
        "PreToolUse",
        permissionDecision="ask",
        permissionDecisionReason="check the rewrite",
        updatedInput={"command": "ls -l"},
    )


@pytest.mark.anyio
async def test_answer_deny_messages_and_dropped_context() -> None:
    d = local(
        ("session:start", HookResult(action="deny", user_message="read-only repository")),
        ("tool:error", HookResult(action="deny", reason="flaky")),
        (
            "claude_code:permission_request",
            HookResult(action="inject_context", context_injection="x", suppress_output=True),
        ),
        (
            "claude_code:subagent_stop",
            HookResult(action="inject_context", context_injection="summarise first"),
        ),
    )
    a = await ask(d, "SessionStart")
    assert json.loads(a.stdout) == {
        "systemMessage": "hookbus denied SessionStart: denied by hookbus handler "
        "h_session_start\nread-only repository"
    }
    a = await ask(d, "PostToolUseFailure")
    assert json.loads(a.stdout) == {"systemMessage": "hookbus denied PostToolUseFailure: flaky"}
    a = await ask(d, "PermissionRequest")  # no additionalContext for this event
    assert json.loads(a.stdout) == {"suppressOutput": True}
    a = await ask(d, "SubagentStop")
    assert json.loads(a.stdout) == specific("SubagentStop", additionalContext="summarise first")


@pytest.mark.anyio
async def test_answer_with_no_handler_declared_is_no_opinion() -> None:
    d = local(strict=True)  # a strict dispatcher: claude_code:stop is not a standard event
    a = await ask(d, "Stop")
    assert a == ClaudeCodeAnswer(hook_event_name="Stop")
    a = await ask(d, "PreToolUse")
    assert a == ClaudeCodeAnswer(hook_event_name="PreToolUse")


@pytest.mark.anyio
async def test_answer_falls_back_when_the_emit_fails_or_is_late() -> None:
    d = local(("tool:pre", HookResult(action="continue")))
    # NaN is JSON to Python's parser but not to hookbus: the emit raises BadRequestError
    body = json.dumps(hook_input("PreToolUse", extra=math.nan))
    a = await answer(body, d.emit)
    assert json.loads(a.stdout)["hookSpecificOutput"]["permissionDecision"] == "deny"
    # Python's json module words the reason (3.13 adds the value: "...compliant: nan")
    assert a.fallback.startswith(
        "event data is not JSON: Out of range float values are not JSON compliant"
    ), a.fallback

    slow = HookDispatcher()

    @slow.register("prompt:submit")
    async def stuck(event: str, data: dict[str, Any]) -> HookResult:
        await anyio.sleep(30)
        return HookResult(action="continue")

    options = ClaudeCodeOptions(timeout_s=0.2, fallback={"UserPromptSubmit": "deny"})
    with anyio.fail_after(10):  # the deadline reaches the dispatcher: the handler is cut
        a = await ask(slow, "UserPromptSubmit", options)
    assert a == ClaudeCodeAnswer(hook_event_name="UserPromptSubmit")  # fail open: its policy


@pytest.mark.anyio
async def test_answer_refuses_an_event_the_hook_is_not_for() -> None:
    a = await answer(json.dumps(hook_input("Stop")), local().emit, hook_event_name="PreToolUse")
    assert a == ClaudeCodeAnswer(
        exit_code=1,
        stderr="hookbus claude-code: the hook input is a Stop event, but this hook answers "
        "'PreToolUse'",
    )


def test_fallback_answer_and_options() -> None:
    a = fallback_answer(json.dumps(hook_input("PermissionRequest")), "down")
    assert json.loads(a.stdout) == {
        **specific(
            "PermissionRequest",
            decision={"behavior": "deny", "message": "hookbus unavailable (down): denied"},
        ),
        "systemMessage": unavailable("PermissionRequest", "down", "deny"),
    }
    options = ClaudeCodeOptions(fallback={"*": "allow", "Stop": "none"})
    assert options.fallback_for("PreToolUse") == "allow"
    assert options.fallback_for("Stop") == "none"
    assert ClaudeCodeOptions().fallback_for("SessionEnd") == "none"
    for bad in (
        {"on_continue": "yes"},
        {"on_ask_user": "maybe"},
        {"fallback": {"Teammate": "deny"}},
        {"fallback": {"Stop": "block"}},
        {"timeout_s": math.inf},
        {"timeout_s": -1},
    ):
        with pytest.raises(ValueError):
            ClaudeCodeOptions(**bad)


def test_http_reply() -> None:
    decided = ClaudeCodeAnswer(stdout='{"decision":"block","reason":"no"}')
    assert http_reply(decided) == (200, b'{"decision":"block","reason":"no"}', "application/json")
    assert http_reply(ClaudeCodeAnswer()) == (200, b"", "text/plain; charset=utf-8")
    bad = ClaudeCodeAnswer(exit_code=1, stderr="hookbus claude-code: not JSON")
    assert http_reply(bad) == (400, b"hookbus claude-code: not JSON\n", "text/plain; charset=utf-8")


# -- settings --------------------------------------------------------------------------------
def settings(*args: str) -> Any:
    result = CliRunner().invoke(claude_code, ["settings", *args], env={"NATS_CONTEXT": ""})
    return result


def test_settings_command_door() -> None:
    result = settings("--", "--url", "nats://10.0.0.5:4222", "--timeout", "50")
    assert result.exit_code == 0, result.output
    hooks = json.loads(result.stdout)["hooks"]
    assert list(hooks) == list(EVENTS)
    command = f"{HOOKBUS} claude-code --url nats://10.0.0.5:4222 --timeout 50"
    handler = {"type": "command", "command": command, "timeout": 55}
    # the events the hook denies when hookbus cannot answer are blocked by Claude Code
    # too when the hook itself cannot run (executable missing, a timeout): onFailure
    closed = {**handler, "onFailure": "block"}
    assert hooks["PreToolUse"] == [{"matcher": "*", "hooks": [closed]}]
    assert hooks["PermissionRequest"] == [{"matcher": "*", "hooks": [closed]}]
    assert hooks["Stop"] == [{"hooks": [handler]}]  # a broken install never blocks a Stop
    assert hooks["SessionStart"] == [{"hooks": [handler]}]
    assert [e for e, g in hooks.items() if "onFailure" in g[0]["hooks"][0]] == [
        "PreToolUse", "PermissionRequest"
    ]  # fmt: skip


def test_settings_makes_key_files_absolute_and_warns_without_an_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claude Code runs the hook in the session's folder: a key file given relative to where
    `settings` ran must still be found there. Without --agent a secured server refuses every
    emit (each PreToolUse denied by the fallback): said on stderr."""
    monkeypatch.chdir(tmp_path)
    result = settings("--", "--nkey", "keys/agent.nk", "--tls-ca=keys/ca.pem")
    assert result.exit_code == 0, result.output
    command = json.loads(result.stdout)["hooks"]["PreToolUse"][0]["hooks"][0]["command"]
    keys = tmp_path / "keys"
    assert command.endswith(f"claude-code --nkey {keys / 'agent.nk'} --tls-ca={keys / 'ca.pem'}")
    assert "no --agent" in result.stderr
    named = settings("--", "--agent", "laptop", "--nkey", str(tmp_path / "a.nk"))
    assert named.exit_code == 0 and "no --agent" not in named.stderr


def test_settings_fail_closed_follows_the_hooks_fallback() -> None:
    """An event the hook's own --fallback denies is blocked on a hook failure too; one it
    lets through is not."""
    result = settings("--", "--fallback", "UserPromptSubmit=deny", "--fallback",
                      "PermissionRequest=none")  # fmt: skip
    assert result.exit_code == 0, result.output
    hooks = json.loads(result.stdout)["hooks"]
    blocked = {e for e, g in hooks.items() if g[0]["hooks"][0].get("onFailure") == "block"}
    assert blocked == {"PreToolUse", "UserPromptSubmit"}


def test_settings_http_door() -> None:
    url = "http://127.0.0.1:8787/claude-code"
    result = settings("--door", "http", "--url", url, "--token-env", "HOOKBUS_TOKEN",
                      "--events", "PreToolUse,Stop", "--matcher", "Bash|Write")  # fmt: skip
    assert result.exit_code == 0, result.output

    def handler(event: str) -> dict[str, Any]:
        out = {
            "type": "http",
            "url": f"{url}/{event}",  # one URL per event: refusals know the event
            "timeout": 30,
            "headers": {"Authorization": "Bearer $HOOKBUS_TOKEN"},
            "allowedEnvVars": ["HOOKBUS_TOKEN"],
        }
        if event == "PreToolUse":  # the gateway down blocks the tool call
            out["onFailure"] = "block"
        return out

    assert json.loads(result.stdout) == {
        "hooks": {
            "PreToolUse": [{"matcher": "Bash|Write", "hooks": [handler("PreToolUse")]}],
            "Stop": [{"hooks": [handler("Stop")]}],
        }
    }
    everything = json.loads(settings("--door", "http", "--url", url).stdout)["hooks"]
    assert set(everything) == set(EVENTS) - {"SessionStart"}  # command hooks only


def test_settings_http_merge_replaces_a_one_url_hook(tmp_path: Path) -> None:
    url = "http://127.0.0.1:8080/claude-code"
    path = tmp_path / "settings.json"
    old = {"type": "http", "url": url, "timeout": 30}
    other = {"type": "http", "url": "http://audit.internal/hook"}
    path.write_text(json.dumps({"hooks": {"PreToolUse": [{"hooks": [old, other]}]}}))
    result = settings(
        "--door", "http", "--url", url, "--events", "PreToolUse", "--merge", str(path)
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    groups = json.loads(result.stdout)["hooks"]["PreToolUse"]
    urls = [h["url"] for g in groups for h in g["hooks"]]
    assert sorted(urls) == ["http://127.0.0.1:8080/claude-code/PreToolUse", other["url"]]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--door", "http", "--url", "h", "--events", "SessionStart"), "not an http(s) URL"),
        (("--door", "http", "--url", "http://x/cc", "--events", "SessionStart"), "commands only"),
        (("--door", "http"), "--door http needs --url"),
        (("--events", "PreToolUse,Nope"), "unknown event 'Nope'"),
        (("--", "--bogus"), "No such option '--bogus'"),
        (("--write",), "--write needs --merge FILE"),
    ],
)
def test_settings_refuses_bad_options(args: tuple[str, ...], error: str) -> None:
    result = settings(*args)
    assert result.exit_code == 2
    assert error in result.output
    assert "Traceback" not in result.output


def test_settings_merge_keeps_everything_else(tmp_path: Path) -> None:
    path = tmp_path / ".claude" / "settings.json"
    path.parent.mkdir()
    own = {"type": "command", "command": "~/bin/lint.sh"}
    existing = {
        "model": "opus",
        "permissions": {"allow": ["Bash(npm test)"]},
        "hooks": {
            "PreToolUse": [{"matcher": "Bash", "hooks": [own]}],
            "PostToolUse": [{"matcher": "Write", "hooks": [own]}],
        },
    }
    path.write_text(json.dumps(existing))
    first = settings("--events", "PreToolUse,Stop", "--merge", str(path), "--write")
    assert first.exit_code == 0, first.output
    merged = json.loads(path.read_text())
    ours = {"type": "command", "command": f"{HOOKBUS} claude-code", "timeout": 30}
    assert merged == {
        "model": "opus",
        "permissions": {"allow": ["Bash(npm test)"]},
        "hooks": {
            "PreToolUse": [
                {"matcher": "Bash", "hooks": [own]},
                {"matcher": "*", "hooks": [{**ours, "onFailure": "block"}]},
            ],
            "PostToolUse": [{"matcher": "Write", "hooks": [own]}],
            "Stop": [{"hooks": [ours]}],
        },
    }
    again = settings("--events", "PreToolUse,Stop", "--merge", str(path))  # printed, idempotent
    assert json.loads(again.stdout) == merged
    path.write_text("[]")
    assert "holds a JSON list, not an object" in settings("--merge", str(path)).output


def test_settings_through_the_console_script() -> None:
    p = subprocess.run([HOOKBUS, "claude-code", "settings", "--managed", "--events", "PreToolUse"],
                       capture_output=True, timeout=30, env=ENV)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["hooks"]["PreToolUse"][0]["hooks"][0]["command"].endswith(
        "hookbus claude-code"
    )
    assert b"/etc/claude-code/managed-settings.json" in p.stderr
    help_text = subprocess.run([HOOKBUS, "--help"], capture_output=True, timeout=30, env=ENV)
    assert b"claude-code" in help_text.stdout


# -- the hook path stays lean ------------------------------------------------------------------
def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=ENV, check=True)
    return set(p.stdout.decode().split())


def test_the_hook_path_imports_only_what_it_needs() -> None:
    """`hookbus claude-code` (through `hookbus.cli._console_script`) loads click, msgspec,
    nats-py and the OpenTelemetry API (the caller's TRACEPARENT) of the third-party packages,
    and neither the OpenTelemetry SDK, the dispatcher, the workers nor the full CLI."""
    loaded = loaded_after("import hookbus.cli._claude_code_cmd")
    third_party = {n.split(".")[0] for n in loaded if not n.startswith("_")}
    third_party -= set(sys.stdlib_module_names) | {"hookbus"}
    assert third_party <= {"click", "msgspec", "nats", "typing_extensions", "opentelemetry"}
    assert not [n for n in loaded if n.startswith("opentelemetry.sdk")]
    for heavy in ("hookbus.dispatcher", "hookbus.workers", "hookbus.cli._command_tree", "anyio"):
        assert heavy not in loaded
    door = loaded_after("import hookbus.integrations.claude_code")
    assert not {"hookbus.dispatcher", "hookbus.cli", "click"} & door


def test_the_hook_keeps_the_callers_trace(bus: Bus) -> None:
    """A caller's TRACEPARENT goes on with the emit: the request to the dispatcher service
    carries it, and so does every handler call of an --embedded hook (one trace, not one
    root per handler)."""
    import asyncio

    import nats

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller = f"00-{trace_id}-00f067aa0ba902b7-01"

    async def heard(subject: str, *args: str) -> list[str]:
        nc = await nats.connect(bus.url)
        got: list[str] = []

        async def on(msg: Any) -> None:
            got.append((msg.headers or {}).get("traceparent", ""))

        await nc.subscribe(subject, cb=on)
        await nc.flush()
        ran = await asyncio.to_thread(
            run_hook, with_command("PreToolUse", "rm -rf /"), *args, url=bus.url,
            TRACEPARENT=caller,
        )  # fmt: skip
        assert ran.out == deny_pre("destructive command"), ran
        await nc.flush()
        await nc.close()
        return got

    service = asyncio.run(heard("hookbus.v1.emit.>"))
    assert service and all(t.startswith(f"00-{trace_id}-") for t in service), service
    handlers = asyncio.run(heard("hookbus.v1.>", "--embedded"))
    calls = [t for t in handlers if t]
    assert calls and all(t.startswith(f"00-{trace_id}-") for t in calls), handlers
