"""`hookbus.integrations.ai`: the Vercel AI SDK for Python's hooks (the ``ai`` package), kept
in hookbus over a real nats-server.

An ``ai`` agent (``ai.testing.FakeModel``: scripted, no network) calls a tool declared
``@ai.tool(require_approval=True)``, so ``ai``'s approval gating suspends on
``approve_<tool call id>``. Other services act on it from their own NATS connection — a
real subprocess (this file run as a script) where the point is another process:

- resolve: the run resumes and the tool runs; a value that does not fit is refused;
- abort, then resume in a new process (new connection, messages restored from JSON);
- cancel: the run ends with the tool not run;
- a pre-registered resolution is consumed exactly once, with no pending event;
- ``ai``'s own functions on the run's registry still work, carried to the record;
- a run id is one live run: claimed for the whole run block (between hooks too), released
  when the block is left, lapsed one lease after its process died.

``ai`` needs Python >= 3.12: under an older interpreter this file is skipped;
`tests/test_integration_ai_runner.py` runs it on a >= 3.12 interpreter.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

ai = pytest.importorskip(
    "ai",
    reason="the ai package (Vercel AI SDK for Python) needs Python >= 3.12; "
    "tests/test_integration_ai_runner.py runs this file on such an interpreter",
)

import nats  # noqa: E402
import pydantic  # noqa: E402
from ai import testing  # noqa: E402

from hookbus.dispatcher import AnswerNotAppliedError  # noqa: E402
from hookbus.integrations import ai as hb_ai  # noqa: E402
from hookbus.integrations.ai import HookbusHooks  # noqa: E402
from hookbus.schemas import (  # noqa: E402
    AlreadySettledError,
    ResolutionRejectedError,
    SuspensionNotFoundError,
)

pytestmark = pytest.mark.anyio

HERE = Path(__file__).resolve()
PROCESS_TIMEOUT_S = 60.0


# -- the agent -----------------------------------------------------------------------------
TRANSFERS: list[int] = []


@ai.tool(require_approval=True)
async def transfer(amount: int) -> str:
    """Transfer `amount` (cents) to the payee."""
    TRANSFERS.append(amount)
    return f"sent {amount}"


class Gate:
    """What `lookup` waits on: ``started`` is set when it runs, it returns once ``opened``."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.opened = asyncio.Event()


LOOKUP = Gate()
LOOKUPS: list[str] = []


@ai.tool
async def lookup(query: str) -> str:
    """Look `query` up (a tool without approval that runs until the test opens its gate)."""
    LOOKUPS.append(query)
    LOOKUP.started.set()
    await LOOKUP.opened.wait()
    return f"found {query}"


def script(call: Any) -> list[Any]:
    return [
        ai.user_message("pay 1200"),
        ai.assistant_message("paying", call),
        ai.assistant_message("done"),
    ]


def transfer_run(hooks: HookbusHooks, call: Any, run_id: str) -> Any:
    """``hooks.run`` of an agent with the `transfer` tool whose model makes `call` (`script`),
    as run `run_id` (an async context manager: the run's stream)."""
    return hooks.run(
        ai.Agent(tools=[transfer]), testing.FakeModel(script(call)),
        [ai.user_message("pay 1200")], run_id=run_id,
    )  # fmt: skip


def resume_script(messages: list[Any]) -> list[Any]:
    """The script a resumed run replays: ai marks the interrupted assistant turn
    ``replay=True`` and sends it again."""
    return [
        messages[0],
        messages[1].model_copy(update={"replay": True}),
        ai.assistant_message("done"),
    ]


def tool_results(messages: list[Any]) -> list[Any]:
    return [
        part.result
        for message in messages
        if message.role == "tool"
        for part in message.parts
        if part.kind == "tool_result"
    ]


async def pending_hooks(run: Any, seen: list[Any] | None = None) -> AsyncIterator[Any]:
    """The hooks the run's event stream `run` shows pending, as they come (every event of
    the run also appended to `seen`)."""
    async for event in run:
        if seen is not None:
            seen.append(event)
        if isinstance(event, ai.events.HookEvent) and event.hook.status == "pending":
            yield event.hook


MESSAGES = pydantic.TypeAdapter(list[ai.messages.Message])


# -- another process: this file as a script --------------------------------------------------
async def _main(argv: list[str]) -> int:
    """``python test_integration_ai.py COMMAND URL AGENT ...`` (its own connection):

    - ``resolve LABEL JSON`` / ``cancel LABEL REASON`` / ``approve LABEL CHOICE APPROVER``:
      print ``ok`` or the error's class;
    - ``resume RUN_ID MESSAGES_FILE [CHOICE]``: run the agent on the saved messages,
      answering a pending tool approval with CHOICE (as approver alice) if one is emitted;
      print a JSON line
      ``{"statuses": [...], "results": [...], "transfers": [...]}``.
    """
    command, url, agent_id, *rest = argv
    nc = await nats.connect(url)
    hooks = await HookbusHooks.open(nc, agent_id=agent_id)
    try:
        if command == "resolve":
            label, value = rest
            try:
                await hb_ai.resolve_hook(label, json.loads(value), hooks=hooks)
            except Exception as exc:
                print(type(exc).__name__)
                return 0
            print("ok")
        elif command == "approve":
            label, choice, approver = rest
            try:
                await hooks.approve(label, choice, approver=approver)
            except Exception as exc:
                print(type(exc).__name__)
                return 0
            print("ok")
        elif command == "cancel":
            label, reason = rest
            await hb_ai.cancel_hook(label, reason=reason, hooks=hooks)
            print("ok")
        elif command == "resume":
            run_id, path, *answer = rest
            messages = MESSAGES.validate_json(await asyncio.to_thread(Path(path).read_text))
            model = testing.FakeModel(resume_script(messages))
            statuses = []
            async with hooks.run(ai.Agent(tools=[transfer]), model, messages, run_id=run_id) as s:
                async for event in s:
                    if isinstance(event, ai.events.HookEvent):
                        statuses.append(event.hook.status)
                        if event.hook.status == "pending" and answer:
                            await hooks.approve(event.hook, answer[0], approver="alice")
            out = {"statuses": statuses, "results": tool_results(s.messages)}
            print(json.dumps({**out, "transfers": TRANSFERS}))
        elif command == "serve":  # run until killed; at pending, save what resumes it
            run_id, amount, path = rest
            call = testing.tool_call(transfer, amount=int(amount))
            async with transfer_run(hooks, call, run_id) as s:
                async for hook in pending_hooks(s):
                    saved = MESSAGES.dump_json(hooks.resumable_messages(s))
                    await asyncio.to_thread(Path(path).write_bytes, saved)
                    print(json.dumps({"label": hook.hook_id}), flush=True)
                    await asyncio.sleep(3600)
        elif command == "run":
            run_id, amount, call_id = rest
            call = testing.tool_call(transfer, amount=int(amount))
            call = call.model_copy(update={"tool_call_id": call_id})
            model = testing.FakeModel(script(call))
            hooks.timeout_s = 10.0
            statuses = []
            try:
                async with hooks.run(
                    ai.Agent(tools=[transfer]), model, [ai.user_message("pay 1200")], run_id=run_id
                ) as s:
                    async for event in s:
                        if isinstance(event, ai.events.HookEvent):
                            statuses.append(event.hook.status)
            except Exception as exc:
                print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
                return 0
            out = {"statuses": statuses, "results": tool_results(s.messages)}
            print(json.dumps({**out, "transfers": TRANSFERS}))
        else:
            raise SystemExit(f"unknown command {command!r}")
        return 0
    finally:
        await hooks.close()
        await nc.close()


async def other_process(*args: str) -> str:
    """Run `_main` in a new Python process; its last output line (it must exit 0)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), PROCESS_TIMEOUT_S)
    assert proc.returncode == 0, f"{args[0]} failed ({proc.returncode}):\n{err.decode()}"
    return out.decode().strip().splitlines()[-1]


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture
def agent_id() -> str:
    return f"ai-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def hooks(nc: Any, agent_id: str) -> AsyncIterator[HookbusHooks]:
    h = await HookbusHooks.open(nc, agent_id=agent_id)
    yield h
    await h.close()


@pytest.fixture
async def observer(connect: Any, agent_id: str) -> AsyncIterator[HookbusHooks]:
    """The same agent's hooks on another connection (another service)."""
    h = await HookbusHooks.open(await connect(), agent_id=agent_id)
    yield h
    await h.close()


@pytest.fixture(autouse=True)
def _clear_transfers() -> None:
    global LOOKUP
    TRANSFERS.clear()
    LOOKUPS.clear()
    LOOKUP = Gate()


async def assert_used(hooks: HookbusHooks, label: str, results: list[Any]) -> None:
    """The tool approval `label` was used by its run, which kept its consumed record (past
    the run's end) with the tool's results, for a retried resume of the run."""
    found = await hooks.suspensions.get(label)
    assert found is not None
    record = found[0]
    assert (record.status, record.consumed) == ("resolved", True)
    extra = record.metadata[hb_ai.AI_METADATA_KEY]
    assert extra["used_in"]
    assert [part["result"] for part in extra["ran"]] == results


def statuses(events: list[Any]) -> list[str]:
    return [e.hook.status for e in events if isinstance(e, ai.events.HookEvent)]


async def run_aborted(hooks: HookbusHooks, call: Any, run_id: str) -> Any:
    """Run an agent whose model makes `call` (to `transfer`) as run `run_id`, aborting the
    approval's wait at its pending event (the run ends blocked); the run's stream."""
    async with transfer_run(hooks, call, run_id) as s:
        async for hook in pending_hooks(s):
            hooks.abort_pending_hook(hook)
    return s


# -- tests ----------------------------------------------------------------------------------
async def test_approval_resolved_by_another_process(
    hooks: HookbusHooks, nats_url: str, agent_id: str
) -> None:
    call = testing.tool_call(transfer, amount=1200)
    model = testing.FakeModel(script(call))
    seen = []
    async with hooks.run(ai.Agent(tools=[transfer]), model, [ai.user_message("pay 1200")]) as s:
        async for hook in pending_hooks(s, seen):
            assert hook.hook_id == f"approve_{call.tool_call_id}"
            assert hook.hook_type == "ToolApproval"
            assert hook.tool_call_id == call.tool_call_id
            assert hook.metadata == {"tool": "transfer", "kwargs": {"amount": 1200}}
            record, _ = await hooks.suspensions.get(hook.hook_id)  # type: ignore[misc]
            assert record.status == "pending"
            assert TRANSFERS == []
            # a choice that is not offered is refused (checked in the other process)
            refused = await other_process(
                "approve", nats_url, agent_id, hook.hook_id, "Maybe", "alice"
            )
            assert refused == "ResolutionRejectedError"
            assert (
                await other_process("approve", nats_url, agent_id, hook.hook_id, "Allow", "alice")
                == "ok"
            )
    assert statuses(seen) == ["pending", "resolved"]
    resolved = [e for e in seen if isinstance(e, ai.events.HookEvent)][-1]
    assert resolved.hook.resolution == {
        "granted": True, "reason": "alice chose 'Allow'", "answered_by": "alice",
    }  # fmt: skip
    assert TRANSFERS == [1200]
    assert tool_results(s.messages) == ["sent 1200"]
    assert model.unused == []
    # the run's exit removed its consumed record
    await assert_used(hooks, f"approve_{call.tool_call_id}", ["sent 1200"])


README_AI_BLOCK = 'hooks = await HookbusHooks.open(nc, agent_id="payments")'
"""The line that finds the README's ``ai`` example (run below as written)."""


async def test_the_readmes_ai_example_runs_as_written(connect: Any, agent_id: str) -> None:
    """README.md's ``ai`` block, run as written (top-level ``await``) with an agent, a
    scripted model, the messages and `other` (the same agent's hooks on another
    connection): the approver's answer decides the tool approval and the tool runs once."""
    from _readme_blocks import blocks

    (found,) = [b for b in blocks() if README_AI_BLOCK in b.text]
    code = found.text.replace('"payments"', repr(agent_id)).replace('"run-42"', repr(agent_id))
    other = await HookbusHooks.open(await connect(), agent_id=agent_id)
    call = testing.tool_call(transfer, amount=1200)
    scope: dict[str, Any] = {
        "nc": await connect(), "agent": ai.Agent(tools=[transfer]),
        "model": testing.FakeModel(script(call)), "messages": [ai.user_message("pay 1200")],
        "other": other,
    }  # fmt: skip
    compiled = compile(code, found.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    try:
        async with asyncio.timeout(PROCESS_TIMEOUT_S):
            ran = eval(compiled, scope)  # the README block, as written
            if ran is not None:
                await ran
    finally:
        await other.close()
        if "hooks" in scope:
            await scope["hooks"].close()
    assert TRANSFERS == [1200]
    assert tool_results(scope["stream"].messages) == ["sent 1200"]


async def test_denied_approval_does_not_run_the_tool(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    call = testing.tool_call(transfer, amount=5)
    model = testing.FakeModel(script(call))
    async with hooks.run(ai.Agent(tools=[transfer]), model, [ai.user_message("pay 1200")]) as s:
        async for hook in pending_hooks(s):
            await observer.approve(hook, "Deny", approver="bob")
    assert TRANSFERS == []
    assert tool_results(s.messages) == ["Rejected: bob chose 'Deny'"]


async def test_abort_then_resume_in_a_new_process(
    hooks: HookbusHooks, observer: HookbusHooks, nats_url: str, agent_id: str, tmp_path: Path
) -> None:
    call = testing.tool_call(transfer, amount=1200)
    label = f"approve_{call.tool_call_id}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    seen = []
    async with transfer_run(hooks, call, run_id) as s:
        async for hook in pending_hooks(s, seen):
            assert hooks.abort_pending_hook(hook) is True
            assert hooks.abort_pending_hook(hook) is False  # already aborting
    # ai's serverless abort: the run ends blocked, the tool call deferred
    assert statuses(seen) == ["pending"]
    assert any(isinstance(e, ai.events.RunBlocked) for e in seen)
    assert TRANSFERS == []
    assert s.messages[-1].role == "tool"
    assert s.messages[-1].parts[0].is_hook_deferred
    # the record outlived the run: pending, detached, with ai's metadata
    record, _ = await observer.suspensions.get(label)  # type: ignore[misc]
    assert (record.status, record.attached, record.run_id) == ("pending", False, run_id)
    assert record.metadata[hb_ai.AI_METADATA_KEY] == {
        "hook_type": "ToolApproval", "tool_call_id": call.tool_call_id,
    }  # fmt: skip
    saved = tmp_path / "messages.json"
    saved.write_bytes(MESSAGES.dump_json(s.messages))
    await hooks.close()

    # an approver answers while no process runs the agent: recorded, applied later ...
    with pytest.raises(AnswerNotAppliedError):
        await observer.approve(label, "Allow", approver="alice", wait_s=0.2)
    # ... and a new process resumes the run from the saved messages
    out = json.loads(await other_process("resume", nats_url, agent_id, run_id, str(saved)))
    assert out["transfers"] == [1200]
    assert out["results"] == ["sent 1200"]
    assert out["statuses"] == []  # the stored resolution returned at once: no pending event
    await assert_used(observer, label, ["sent 1200"])


async def test_resume_before_the_answer_waits_again(
    hooks: HookbusHooks, nats_url: str, agent_id: str, tmp_path: Path
) -> None:
    call = testing.tool_call(transfer, amount=7)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    async with transfer_run(hooks, call, run_id) as s:
        async for hook in pending_hooks(s):
            assert hb_ai.abort_pending_hook(hook) is True  # the current hooks
    saved = tmp_path / "messages.json"
    saved.write_bytes(MESSAGES.dump_json(s.messages))
    # the new process re-attaches, emits pending again, and is answered while it waits
    out = json.loads(await other_process("resume", nats_url, agent_id, run_id, str(saved), "Allow"))
    assert out["statuses"] == ["pending", "resolved"]
    assert out["transfers"] == [7]


async def test_cancel_from_another_process(
    hooks: HookbusHooks, observer: HookbusHooks, nats_url: str, agent_id: str
) -> None:
    call = testing.tool_call(transfer, amount=1200)
    label = f"approve_{call.tool_call_id}"
    model = testing.FakeModel(script(call))
    events = await observer.events()
    seen = []
    async with hooks.run(ai.Agent(tools=[transfer]), model, [ai.user_message("pay 1200")]) as s:
        async for _ in pending_hooks(s, seen):
            assert (
                await other_process("cancel", nats_url, agent_id, label, "client disconnected")
                == "ok"
            )
    # as ai.cancel_hook: the hook raised CancelledError, the run ended, the tool never ran
    assert statuses(seen) == ["pending", "cancelled"]
    assert TRANSFERS == []
    assert tool_results(s.messages) == []
    # every service saw ai's HookEvents: pending, then cancelled
    async with events:
        got = [await asyncio.wait_for(events.__anext__(), 5) for _ in range(2)]
    assert [e.hook.status for e in got] == ["pending", "cancelled"]
    assert all(isinstance(e, ai.events.HookEvent) for e in got)
    assert got[0].hook.hook_id == label
    assert got[0].hook.tool_call_id == call.tool_call_id
    assert hb_ai.AI_METADATA_KEY not in got[0].hook.metadata
    with pytest.raises(SuspensionNotFoundError):  # the run's exit removed the cancelled record
        await observer.cancel_hook(label)


async def test_preregistered_resolution_is_consumed_once(
    hooks: HookbusHooks, nats_url: str, agent_id: str
) -> None:
    call = testing.tool_call(transfer, amount=3)
    label = f"approve_{call.tool_call_id}"
    # approved by another process before the run even started
    assert await other_process("approve", nats_url, agent_id, label, "Allow", "alice") == "ok"
    model = testing.FakeModel(script(call))
    seen = []
    async with hooks.run(ai.Agent(tools=[transfer]), model, [ai.user_message("pay 1200")]) as s:
        async for event in s:
            seen.append(event)
    assert statuses(seen) == []  # returned at once: ai's pre-registered behaviour
    assert TRANSFERS == [3]
    assert model.unused == []
    await assert_used(hooks, label, ["sent 3"])
    # that run used the approval: the same call hooked again is asked anew, never answered
    # by the used approval's proof (nobody answers here: its timeout's default)
    got = await hooks.hook(label, payload=ai.tools.ToolApproval, timeout_s=2)
    assert got == ai.tools.ToolApproval(granted=False, reason="timed out after 2s; default deny")


async def test_ai_functions_on_the_run_registry_reach_the_record(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    """``ai.resolve_hook`` / ``ai.cancel_hook`` from the consumer's block reach the record and
    other services see the outcome; but a tool approval resolved that way (by the agent
    itself, no approver's proof) is refused: the tool does not run."""
    events = await observer.events()
    call = testing.tool_call(transfer, amount=9)
    async with hooks.run(
        ai.Agent(tools=[transfer]), testing.FakeModel(script(call)), [ai.user_message("pay 1200")]
    ) as s:
        async for hook in pending_hooks(s):
            ai.resolve_hook(hook, {"granted": True})
    assert TRANSFERS == []
    assert tool_results(s.messages) == ["Rejected: refused: it names no approver"]
    call2 = testing.tool_call(transfer, amount=10)
    seen = []
    async with hooks.run(
        ai.Agent(tools=[transfer]), testing.FakeModel(script(call2)), [ai.user_message("pay 1200")]
    ) as s:
        async for hook in pending_hooks(s, seen):
            await ai.cancel_hook(hook, reason="user said no")
    assert statuses(seen) == ["pending", "cancelled"]  # ai's own cancelled event, once
    assert TRANSFERS == []
    async with events:
        got = [await asyncio.wait_for(events.__anext__(), 5) for _ in range(4)]
    assert [(e.hook.hook_id, e.hook.status) for e in got] == [
        (f"approve_{call.tool_call_id}", "pending"),
        (f"approve_{call.tool_call_id}", "resolved"),
        (f"approve_{call2.tool_call_id}", "pending"),
        (f"approve_{call2.tool_call_id}", "cancelled"),
    ]


async def test_ai_preregistration_in_the_run_block(hooks: HookbusHooks) -> None:
    """ai's serverless re-entry: ``ai.resolve_hook`` inside the run block, before iterating,
    pre-registers into the run's registry; the hook takes it through the record at once. A
    tool approval pre-registered so (no approver's proof) is refused: the tool does not run."""
    call = testing.tool_call(transfer, amount=11)
    async with hooks.run(
        ai.Agent(tools=[transfer]), testing.FakeModel(script(call)), [ai.user_message("pay 1200")]
    ) as s:
        ai.resolve_hook(f"approve_{call.tool_call_id}", {"granted": True})
        seen = [event async for event in s]
    assert statuses(seen) == []
    assert TRANSFERS == []
    assert tool_results(s.messages) == ["Rejected: refused: it names no approver"]


async def test_a_tool_approval_resolved_without_an_approvers_proof_does_not_run_the_tool(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    """Anyone who may write the agent's records (the agent itself) resolving its tool
    approval, even in an approver's name, decides nothing: no proof holds that answer."""
    call = testing.tool_call(transfer, amount=12)
    forged = {"granted": True, "reason": "alice chose 'Allow'", "choice": "Allow",
              "answered_by": "alice", "answered_at": 1.0}  # fmt: skip
    async with hooks.run(
        ai.Agent(tools=[transfer]), testing.FakeModel(script(call)), [ai.user_message("pay 1200")]
    ) as s:
        async for hook in pending_hooks(s):
            await observer.resolve_hook(hook, forged)
    assert TRANSFERS == []
    assert tool_results(s.messages) == [
        "Rejected: refused: no answer of approver 'alice' is on record"
    ]


async def test_the_first_proof_written_decides_a_tool_approval(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    """Two approvers answer before the run asks: the first answer written decides; the
    other approver is told who decided."""
    call = testing.tool_call(transfer, amount=13)
    label = f"approve_{call.tool_call_id}"
    await observer.approve(label, "Deny", approver="zed")
    await observer.approve(label, "Allow", approver="alice")
    async with hooks.run(
        ai.Agent(tools=[transfer]), testing.FakeModel(script(call)), [ai.user_message("pay 1200")]
    ) as s:
        seen = [event async for event in s]
    assert statuses(seen) == []
    assert TRANSFERS == []
    assert tool_results(s.messages) == ["Rejected: zed chose 'Deny'"]


async def test_hook_outside_an_agent_run(hooks: HookbusHooks, observer: HookbusHooks) -> None:
    """The module functions, for agent loops of one's own: pending until another service
    resolves; a value that does not fit the payload is refused at the resolver."""

    class Choice(pydantic.BaseModel):
        option: str

    with hb_ai.use_hooks(hooks):
        task = asyncio.ensure_future(
            hb_ai.hook("pick", payload=Choice, metadata={"options": ["a", "b"]})
        )
        for _ in range(500):
            found = await observer.suspensions.get("pick")
            if found is not None and found[0].status == "pending":
                break
            await asyncio.sleep(0.01)
        assert found is not None and found[0].metadata["options"] == ["a", "b"]
        with pytest.raises(ResolutionRejectedError):
            await observer.resolve_hook("pick", {"option": 3})
        await observer.resolve_hook("pick", Choice(option="b"))
        with pytest.raises(AlreadySettledError):  # one resolver wins
            await observer.resolve_hook("pick", Choice(option="a"))
        got = await asyncio.wait_for(task, 10)
    assert got == Choice(option="b")
    with pytest.raises(LookupError):
        hb_ai.current_hooks()


async def test_a_second_process_with_the_same_run_id_is_refused_while_the_owner_lives(
    hooks: HookbusHooks, observer: HookbusHooks, nats_url: str, agent_id: str
) -> None:
    """The run id names one live run: another process starting it meanwhile is refused
    with an error that says so, and the owner's run goes on unaffected."""
    call = testing.tool_call(transfer, amount=31)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    seen = []
    async with transfer_run(hooks, call, run_id) as s:
        async for hook in pending_hooks(s, seen):
            out = json.loads(
                await other_process("run", nats_url, agent_id, run_id, "31", call.tool_call_id)
            )
            assert out["error"] == "RunInProgressError", out
            assert run_id in out["message"] and "another process" in out["message"]
            record, _ = await observer.suspensions.get(hook.hook_id)  # type: ignore[misc]
            assert (record.status, record.owner) == ("pending", hooks.suspensions.waiter_id)
            await observer.approve(hook, "Allow", approver="alice")
    assert statuses(seen) == ["pending", "resolved"]
    assert TRANSFERS == [31]
    assert tool_results(s.messages) == ["sent 31"]


async def say_hello(hooks: HookbusHooks, run_id: str) -> list[Any]:
    """Run `run_id` on `hooks` with a model that only answers "hello"; its messages."""
    model = testing.FakeModel([ai.user_message("hi"), ai.assistant_message("hello")])
    async with hooks.run(ai.Agent(), model, [ai.user_message("hi")], run_id=run_id) as s:
        async for _ in s:
            pass
    return list(s.messages)


async def test_a_second_process_is_refused_while_the_owner_is_between_hooks(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    """The run id is claimed for the whole run block, not only while a hook waits: another
    process (its own connection and waiter id) is refused before the model's first turn
    and while a tool runs; the owner's run goes on unaffected; once it has ended the other
    process may run that run id."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    call = testing.tool_call(lookup, query="invoice 7")
    model = testing.FakeModel(
        [ai.user_message("find invoice 7"), ai.assistant_message("looking", call),
         ai.assistant_message("found it")]
    )  # fmt: skip
    assert hooks.suspensions.waiter_id != observer.suspensions.waiter_id
    async with hooks.run(
        ai.Agent(tools=[lookup]), model, [ai.user_message("find invoice 7")], run_id=run_id
    ) as s:
        with pytest.raises(hb_ai.RunInProgressError, match="another process") as refused:
            await say_hello(observer, run_id)  # before any model turn or hook
        assert run_id in str(refused.value)
        consuming = asyncio.ensure_future(_events(s))
        await asyncio.wait_for(LOOKUP.started.wait(), 10)
        with pytest.raises(hb_ai.RunInProgressError):
            await say_hello(observer, run_id)  # while the tool runs
        LOOKUP.opened.set()
        seen = await asyncio.wait_for(consuming, 10)
    assert statuses(seen) == []
    assert LOOKUPS == ["invoice 7"]
    assert tool_results(s.messages) == ["found invoice 7"]
    assert model.unused == []
    # the owner's run has ended: its claim was released, the other process runs it now
    messages = await asyncio.wait_for(say_hello(observer, run_id), 10)
    assert [m.role for m in messages][-1] == "assistant"


async def test_the_run_claim_is_released_when_the_run_block_raises_or_is_cancelled(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    """A run block left by an exception, or cancelled, releases the run id at once."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    model = testing.FakeModel([ai.user_message("hi"), ai.assistant_message("hello")])
    with pytest.raises(RuntimeError, match="consumer failed"):
        async with hooks.run(ai.Agent(), model, [ai.user_message("hi")], run_id=run_id):
            raise RuntimeError("consumer failed")
    await asyncio.wait_for(say_hello(observer, run_id), 10)

    entered = asyncio.Event()

    async def run_until_cancelled() -> None:
        model = testing.FakeModel([ai.user_message("hi"), ai.assistant_message("hello")])
        async with hooks.run(ai.Agent(), model, [ai.user_message("hi")], run_id=run_id):
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(run_until_cancelled())
    await asyncio.wait_for(entered.wait(), 10)
    with pytest.raises(hb_ai.RunInProgressError):
        await say_hello(observer, run_id)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(say_hello(observer, run_id), 10)


async def test_a_dead_processs_run_claim_lapses(embedded_server: Any, agent_id: str) -> None:
    """A claim nobody heartbeats (its process died) refuses the run id until it lapses,
    one lease later (a private server whose leases bucket has a 2 s max age)."""
    from hookbus.dispatcher._waiter import Leases
    from hookbus.schemas._subjects import run_claim_key

    nc = await nats.connect(embedded_server.url)
    try:
        dead = await Leases.open(nc, lease_s=2.0)  # creates the bucket: its max age is 2 s
        hooks = await HookbusHooks.open(nc, agent_id=agent_id)
        async with hooks:
            assert hooks.suspensions.leases.lease_s == 2.0  # type: ignore[union-attr]
            run_id = f"run-{uuid.uuid4().hex[:8]}"
            await dead.kv.put(run_claim_key(agent_id, run_id), dead.waiter_id.encode())
            with pytest.raises(hb_ai.RunInProgressError, match=dead.waiter_id):
                await say_hello(hooks, run_id)
            async with asyncio.timeout(15):
                while True:
                    try:
                        messages = await say_hello(hooks, run_id)
                        break
                    except hb_ai.RunInProgressError:
                        await asyncio.sleep(0.1)
            assert [m.role for m in messages][-1] == "assistant"
            # this process's own claim lives as long as its run, past several leases
            model = testing.FakeModel([ai.user_message("x"), ai.assistant_message("y")])
            other = await HookbusHooks.open(nc, agent_id=agent_id)  # a waiter id of its own
            async with other, hooks.run(ai.Agent(), model, [ai.user_message("x")], run_id=run_id):
                await asyncio.sleep(5.0)
                got = await dead.kv.get(run_claim_key(agent_id, run_id))
                assert got.value == hooks.suspensions.waiter_id.encode()  # type: ignore[union-attr]
                with pytest.raises(hb_ai.RunInProgressError):
                    await say_hello(other, run_id)
    finally:
        await nc.close()


async def _events(stream: Any) -> list[Any]:
    return [event async for event in stream]


async def test_a_killed_process_resumes_from_what_it_saved_at_the_pending_event(
    observer: HookbusHooks, nats_url: str, agent_id: str, tmp_path: Path
) -> None:
    """At the pending event the process saves `resumable_messages` (the assistant turn with
    the tool call it waits on included) and is SIGKILLed; an approver answers meanwhile;
    a new process resumes from the saved messages and the tool runs once."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    saved = tmp_path / "messages.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE), "serve", nats_url, agent_id, run_id, "41", str(saved),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), PROCESS_TIMEOUT_S)  # type: ignore[union-attr]
        assert line, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
        label = json.loads(line)["label"]
    finally:
        proc.kill()
        await proc.wait()
    messages = MESSAGES.validate_json(saved.read_bytes())
    assert [m.role for m in messages] == ["user", "assistant"]
    assert [c.tool_call_id for c in messages[1].tool_calls] == [label.removeprefix("approve_")]
    with pytest.raises(AnswerNotAppliedError):  # nobody waits: applied at the resume
        await observer.approve(label, "Allow", approver="alice", wait_s=0.2)
    # the killed process's hooks are its own until its lease lapses
    record, _ = await observer.suspensions.get(label)  # type: ignore[misc]
    leases = await observer.suspensions.ensure_leases()
    async with asyncio.timeout(40):
        for _ in range(200):  # the lease's max age is 15 s
            if not await leases.alive(record.owner):
                break
            await asyncio.sleep(0.5)
    out = json.loads(await other_process("resume", nats_url, agent_id, run_id, str(saved)))
    assert out["transfers"] == [41]
    assert out["results"] == ["sent 41"]
    assert out["statuses"] == []  # the stored answer returned at once
    await assert_used(observer, label, ["sent 41"])


async def test_a_resumed_run_whose_model_re_asks_with_a_new_tool_call_id_keeps_the_answer(
    hooks: HookbusHooks, observer: HookbusHooks, nats_url: str, agent_id: str
) -> None:
    """Real models give a re-asked turn new tool call ids: the approval of the same tool with
    the same arguments earlier in the run decides it, with the answer given meanwhile."""
    call = testing.tool_call(transfer, amount=51)
    label = f"approve_{call.tool_call_id}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    await run_aborted(hooks, call, run_id)
    # the rule: same run, same tool, same arguments, another tool call id
    same = {"tool": "transfer", "kwargs": {"amount": 51}}
    earlier = hooks._tool_approvals.earlier  # nothing waits here: the run was aborted
    async with hooks.suspensions.run(run_id):
        assert await earlier("approve_b", same, "b", ()) == label
        assert await earlier(
            "approve_b", {"tool": "transfer", "kwargs": {"amount": 52}}, "b", ()
        ) == "approve_b"  # fmt: skip
    async with hooks.suspensions.run("another-run"):
        assert await earlier("approve_b", same, "b", ()) == "approve_b"
    with pytest.raises(AnswerNotAppliedError):
        await observer.approve(label, "Allow", approver="alice", wait_s=0.2)
    # the resume starts over from the user's message; the model asks with a new id
    out = json.loads(await other_process("run", nats_url, agent_id, run_id, "51", "call_new"))
    assert out.get("error") is None, out
    assert out["transfers"] == [51]
    assert out["results"] == ["sent 51"]
    assert out["statuses"] == []  # the stored answer returned at once
    await assert_used(observer, label, ["sent 51"])


async def test_a_retried_resume_does_not_ask_again_for_a_tool_call_that_ran(
    hooks: HookbusHooks, observer: HookbusHooks, nats_url: str, agent_id: str, tmp_path: Path
) -> None:
    """The resume ran the tool but its outcome was lost (its process died before saving
    the messages), so it is retried from the same saved messages: the tool call is neither
    asked again nor run again; it gets the result it had."""
    call = testing.tool_call(transfer, amount=61)
    label = f"approve_{call.tool_call_id}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    s = await run_aborted(hooks, call, run_id)
    saved = tmp_path / "messages.json"
    saved.write_bytes(MESSAGES.dump_json(s.messages))
    with pytest.raises(AnswerNotAppliedError):
        await observer.approve(label, "Allow", approver="alice", wait_s=0.2)
    first = json.loads(await other_process("resume", nats_url, agent_id, run_id, str(saved)))
    assert (first["transfers"], first["results"], first["statuses"]) == ([61], ["sent 61"], [])
    events = await observer.events()
    again = json.loads(await other_process("resume", nats_url, agent_id, run_id, str(saved)))
    assert again["statuses"] == []  # not asked again
    assert again["transfers"] == []  # not run again
    assert again["results"] == ["sent 61"]  # the result it had
    async with events:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(events.__anext__(), 0.5)


@pytest.fixture
def secured(tmp_path: Path) -> Any:
    """A secured server (``hookbus auth init`` with the embedded agent ``payments`` and the
    approver ``alice``), its buckets created by the admin."""
    from test_auth import _secured_server

    yield from _secured_server(tmp_path / "auth")


async def test_an_embedded_agent_on_a_secured_server_opens_with_the_defaults(
    secured: tuple[str, Path],
) -> None:
    """An agent's NATS user may read only its own keys: ``open(nc, agent_id=...)`` scopes the
    store to the agent by itself, and an approver answers from their own connection. The
    agent's user writes and reads its own run claims: another process of the agent is
    refused the run id while the run is in progress, and may run it once it has ended."""
    from test_auth import connect_as, ident

    from hookbus.cli._provision import provision
    from hookbus.schemas._subjects import run_claim_key

    url, out = secured
    admin_nc, _ = await connect_as(url, out, ident(out, "ACME", "admin", "admin"))
    agent_nc, _ = await connect_as(url, out, ident(out, "ACME", "agent", "payments"))
    again_nc, _ = await connect_as(url, out, ident(out, "ACME", "agent", "payments"))
    alice_nc, _ = await connect_as(url, out, ident(out, "ACME", "approver", "alice"))
    try:
        await provision(admin_nc)
        leases = await admin_nc.jetstream().key_value("hookbus_leases")
        claim = run_claim_key("payments", "run-secured")
        hooks = await HookbusHooks.open(agent_nc, agent_id="payments")
        other = await HookbusHooks.open(again_nc, agent_id="payments")  # another process
        approver = await HookbusHooks.open(alice_nc, agent_id="payments")
        call = testing.tool_call(transfer, amount=21)
        # never "JetStream unavailable" (15 s)
        async with asyncio.timeout(10), hooks, other, approver:
            async with transfer_run(hooks, call, "run-secured") as s:
                held = await leases.get(claim)
                assert held.value == hooks.suspensions.waiter_id.encode()  # type: ignore[union-attr]
                with pytest.raises(hb_ai.RunInProgressError, match=held.value.decode()):
                    await say_hello(other, "run-secured")
                async for hook in pending_hooks(s):
                    await approver.approve(hook, "Allow", approver="alice")
            await say_hello(other, "run-secured")  # released: the other process runs it
    finally:
        for conn in (alice_nc, again_nc, agent_nc, admin_nc):
            await conn.close()
    assert TRANSFERS == [21]
    assert tool_results(s.messages) == ["sent 21"]


# -- the workers decide ai's tool calls ------------------------------------------------------
COMMANDS: list[str] = []


@ai.tool
async def bash(command: str) -> str:
    """Run `command` in a shell (here: only recorded)."""
    COMMANDS.append(command)
    return f"ran {command}"


def bash_script(command: str) -> tuple[Any, list[Any]]:
    call = testing.tool_call(bash, command=command)
    return call, [
        ai.user_message("clean up"),
        ai.assistant_message("cleaning", call),
        ai.assistant_message("done"),
    ]


def seen_by_model(model: Any, tool_call_id: str) -> list[Any]:
    """What the model was sent, in its last request, as the result of `tool_call_id`."""
    return [
        part.get_model_input()
        for message in model.calls[-1]
        if message.role == "tool"
        for part in message.tool_results
        if part.tool_call_id == tool_call_id
    ]


@contextlib.asynccontextmanager
async def governed(
    server: Any, agent_id: str, *handlers: tuple[str, Any, dict[str, Any]]
) -> AsyncIterator[HookbusHooks]:
    """`HookbusHooks.open` as `examples/ai_agent.py` wires it, on a private server where a
    `HookWorker` (its own connection, as another process) serves `handlers`
    (``(event, fn, options)``)."""
    from hookbus.workers import HookWorker

    worker_nc = await nats.connect(server.url)
    agent_nc = await nats.connect(server.url)
    worker = HookWorker(worker_nc)
    for event, fn, options in handlers:
        worker.add_handler(event, fn, **options)
    try:
        async with worker:
            hooks = await HookbusHooks.open(agent_nc, agent_id=agent_id)
            async with hooks:
                yield hooks
    finally:
        COMMANDS.clear()
        await agent_nc.close()
        await worker_nc.close()


async def test_a_worker_denying_tool_pre_stops_the_ai_tool_and_the_model_reads_why(
    embedded_server: Any, agent_id: str
) -> None:
    """The defect this guards: an ai agent's bash tool ran ``rm -rf`` while a worker denied
    ``tool:pre`` for it. Now the tool does not run, and the model reads the worker's reason;
    a command the worker allows runs (and ``tool:post`` reaches the worker)."""
    from hookbus.schemas import TOOL_POST, TOOL_PRE, HookResult

    seen: list[tuple[str, dict[str, Any]]] = []

    async def guard(event: str, data: dict[str, Any]) -> HookResult | None:
        seen.append((event, data))
        if event == TOOL_PRE and "rm -rf" in data["tool_input"]["command"]:
            return HookResult(action="deny", reason="rm -rf is not allowed")
        return None

    async with governed(
        embedded_server, agent_id, (TOOL_PRE, guard, {}), (TOOL_POST, guard, {})
    ) as hooks:
        call, script = bash_script("rm -rf /")
        model = testing.FakeModel(script)
        async with hooks.run(ai.Agent(tools=[bash]), model, script[:1], run_id="r1") as s:
            await _events(s)
        assert COMMANDS == []
        assert tool_results(s.messages) == ["Denied by hook: rm -rf is not allowed"]
        assert seen_by_model(model, call.tool_call_id) == ["Denied by hook: rm -rf is not allowed"]
        assert [(e, d["tool_name"], d["tool_call_id"], d["run_id"]) for e, d in seen] == [
            (TOOL_PRE, "bash", call.tool_call_id, "r1")
        ]
        # an allowed command runs, and the worker sees its result after it
        seen.clear()
        call, script = bash_script("ls")
        async with hooks.run(
            ai.Agent(tools=[bash]), testing.FakeModel(script), script[:1], run_id="r2"
        ) as s:
            await _events(s)
        assert COMMANDS == ["ls"]
        assert tool_results(s.messages) == ["ran ls"]
        assert [(e, d["tool_input"]) for e, d in seen] == [
            (TOOL_PRE, {"command": "ls"}), (TOOL_POST, {"command": "ls"}),
        ]  # fmt: skip
        assert seen[1][1]["tool_result"] == "ran ls"


async def test_a_worker_modifying_tool_pre_rewrites_the_ai_tools_arguments(
    embedded_server: Any, agent_id: str
) -> None:
    """A modify replaces the arguments the tool runs with, validated by the tool's own
    parameters: arguments that do not validate deny the call."""
    from hookbus.schemas import TOOL_PRE, HookResult

    async def rewrite(event: str, data: dict[str, Any]) -> HookResult:
        command = data["tool_input"]["command"]
        new = 3 if command == "bad" else command.replace("rm -rf", "rm -ri")
        return HookResult(action="modify", data={**data, "tool_input": {"command": new}})

    async with governed(embedded_server, agent_id, (TOOL_PRE, rewrite, {})) as hooks:
        _, script = bash_script("rm -rf build")
        async with hooks.run(ai.Agent(tools=[bash]), testing.FakeModel(script), script[:1]) as s:
            await _events(s)
        assert COMMANDS == ["rm -ri build"]
        assert tool_results(s.messages) == ["ran rm -ri build"]
        COMMANDS.clear()
        _, script = bash_script("bad")
        async with hooks.run(ai.Agent(tools=[bash]), testing.FakeModel(script), script[:1]) as s:
            await _events(s)
        assert COMMANDS == []
        [result] = tool_results(s.messages)
        assert result.startswith("Denied by hook: rewrite replaced the arguments with invalid")


async def test_a_worker_that_times_out_with_failure_policy_deny_denies_the_ai_tool(
    embedded_server: Any, agent_id: str
) -> None:
    """A handler that does not answer within its timeout is judged by its failure policy:
    ``deny`` stops the tool."""
    from hookbus.schemas import TOOL_PRE

    async def slow(event: str, data: dict[str, Any]) -> None:
        await asyncio.sleep(30)

    options = {"failure_policy": "deny", "timeout_s": 0.5}
    async with governed(embedded_server, agent_id, (TOOL_PRE, slow, options)) as hooks:
        call, script = bash_script("rm -rf /")
        model = testing.FakeModel(script)
        async with hooks.run(ai.Agent(tools=[bash]), model, script[:1]) as s:
            await asyncio.wait_for(_events(s), 20)
    assert COMMANDS == []
    [result] = tool_results(s.messages)
    assert result.startswith("Denied by hook:") and "timeout" in result, result
    assert seen_by_model(model, call.tool_call_id) == [result]


async def test_a_timed_out_tool_approval_ends_denied_and_the_model_is_told(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    """Nobody answers the tool approval within the hooks' timeout: it ends with its default
    (deny), the run goes on, the model reads that it was not approved, and the record is
    closed (not pending: a later "Allow" decides nothing and the tool never runs)."""
    hooks.timeout_s = 1.0
    call = testing.tool_call(transfer, amount=77)
    label = f"approve_{call.tool_call_id}"
    model = testing.FakeModel(script(call))
    async with hooks.run(
        ai.Agent(tools=[transfer]), model, [ai.user_message("pay 1200")], run_id="run-late"
    ) as s:
        seen = await asyncio.wait_for(_events(s), 30)
    assert TRANSFERS == []
    assert tool_results(s.messages) == ["Rejected: timed out after 1s; default deny"]
    assert seen_by_model(model, call.tool_call_id) == tool_results(s.messages)
    assert model.unused == []
    assert statuses(seen) == ["pending", "cancelled"]
    found = await observer.suspensions.get(label)
    assert found is not None and found[0].status == "cancelled", found
    with pytest.raises(AlreadySettledError):
        await observer.approve(label, "Allow", approver="alice")
    assert TRANSFERS == []


async def test_a_tool_approval_that_cannot_be_closed_at_its_timeout_is_denied(
    embedded_server: Any, agent_id: str
) -> None:
    """A tool approval is pending when JetStream goes away; at its timeout its close cannot
    be stored, so a human's answer may be there unseen: the tool is denied, whatever
    ``approval_default`` says, and the model is told why. Before, an ``allow`` default let
    the tool run."""
    nc = await nats.connect(
        embedded_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.05
    )
    hooks = await HookbusHooks.open(nc, agent_id=agent_id, approval_default="allow")
    hooks.timeout_s = 1.0
    hooks.suspensions.records.deadline_s = 2.0  # each try of the store gives up sooner
    call = testing.tool_call(transfer, amount=78)
    try:
        async with transfer_run(hooks, call, f"run-{uuid.uuid4().hex[:8]}") as s:
            async for _ in pending_hooks(s):
                embedded_server.stop()
        assert TRANSFERS == []
        [result] = tool_results(s.messages)
        assert result.startswith("Rejected: timed out after 1s; default allow, but it could"
                                 " not be closed"), result  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            await hooks.close()
        with contextlib.suppress(Exception):
            await nc.close()


async def test_the_same_tool_call_in_another_run_is_asked_anew_not_by_the_old_answer(
    hooks: HookbusHooks, observer: HookbusHooks
) -> None:
    """A tool call approved ("Allow", by alice) and run in one run comes again in another
    run (the same call replayed under a new run id): it is asked anew, and bob's "Deny"
    decides it; the tool runs once. Before, alice's answer proof of the first run, still in
    the bucket, answered the new approval at once ("Allow"), bob's answer was refused as
    decided first by alice, and the tool ran a second time."""
    call = testing.tool_call(transfer, amount=41)
    async with transfer_run(hooks, call, f"run-{uuid.uuid4().hex[:8]}") as s:
        async for hook in pending_hooks(s):
            await observer.approve(hook, "Allow", approver="alice")
    assert TRANSFERS == [41]
    seen: list[Any] = []
    async with transfer_run(hooks, call, f"run-{uuid.uuid4().hex[:8]}") as s:
        async for hook in pending_hooks(s, seen):
            await observer.approve(hook, "Deny", approver="bob")
    assert statuses(seen) == ["pending", "resolved"]
    assert TRANSFERS == [41], "the tool ran again on the first run's answer"
    [result] = tool_results(s.messages)
    assert result == "Rejected: bob chose 'Deny'", result


async def test_public_api() -> None:
    assert set(hb_ai.__all__) == {
        "AI_METADATA_KEY", "APPROVAL_LABEL_PREFIX", "EVENTS", "HookbusHooks",
        "RunInProgressError",
        "abort_pending_hook",
        "ai_hook_part", "cancel_hook", "current_hooks", "defer_hook", "hook",
        "is_tool_approval", "resolve_hook", "use_hooks",
    }  # fmt: skip
    assert issubclass(HookbusHooks, ai.agents._middleware._Middleware)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(_main(sys.argv[1:])))
