"""`hookbus suspensions list|show|resolve|cancel` and `hookbus approvals [list] | answer`,
run as a user would: ``python -m hookbus.cli ... --url NATS_URL`` in a subprocess,
while a hook waits in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import TaskGroup
from conftest import Connect

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookbusError, HookPart, HookResult, SuspensionCancelledError

pytestmark = pytest.mark.anyio


class Grant(msgspec.Struct):
    approved: bool
    by: str = ""


CLI_TIMEOUT_S = 30.0
"""A CLI call that has not exited by then fails the test (and is killed), never hangs it."""


async def hookbus(nats_url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI; a wide terminal so rich tables do not wrap labels."""
    with anyio.fail_after(CLI_TIMEOUT_S):
        return await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", *args, "--url", nats_url],
            check=False,
            env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"},
        )


def out(p: subprocess.CompletedProcess[bytes]) -> str:
    return p.stdout.decode()


def err(p: subprocess.CompletedProcess[bytes]) -> str:
    return p.stderr.decode()


class Waiting:
    """A `hook` call running in this process."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: HookbusError | None = None
        self.done = anyio.Event()

    async def wait(self) -> Waiting:
        with anyio.fail_after(20):
            await self.done.wait()
        return self


class Agent:
    def __init__(self, d: HookDispatcher) -> None:
        self.d = d
        self.stream: Any = None

    async def pending(self, label: str) -> HookPart:
        with anyio.fail_after(10):
            async for e in self.stream:
                if e.hook.label == label and e.hook.status == "pending":
                    return e.hook
        raise AssertionError("event stream ended")

    def spawn(self, tg: TaskGroup, label: str, payload: Any = Grant, **kw: Any) -> Waiting:
        w = Waiting()

        async def run() -> None:
            try:
                w.value = await self.d.hook(label, payload, **kw)
            except HookbusError as exc:
                w.error = exc
            finally:
                w.done.set()

        tg.start_soon(run)
        return w


@pytest.fixture
async def agent(connect: Connect) -> AsyncIterator[Agent]:
    d = HookDispatcher(await connect())
    async with d:
        a = Agent(d)
        a.stream = await d.hook_events()
        try:
            yield a
        finally:
            await a.stream.aclose()


@pytest.fixture
def label() -> str:
    return f"cli test {uuid.uuid4().hex[:10]}: déploy"


# -- suspensions -------------------------------------------------------------------------------
async def test_suspensions_list_and_show(agent: Agent, nats_url: str, label: str) -> None:
    async with anyio.create_task_group() as tg:
        w = agent.spawn(tg, label, metadata={"tool_name": "deploy"})
        part = await agent.pending(label)

        p = await hookbus(nats_url, "suspensions", "list", "--json")
        assert p.returncode == 0, err(p)
        (row,) = [r for r in json.loads(out(p)) if r["label"] == label]
        assert row["status"] == "pending" and row["hook_id"] == part.hook_id
        assert row["metadata"] == {"tool_name": "deploy"}

        p = await hookbus(nats_url, "suspensions", "list")
        assert p.returncode == 0, err(p)
        (line,) = [ln for ln in out(p).splitlines() if label in ln]
        assert "pending" in line and "deploy" in line

        p = await hookbus(nats_url, "suspensions", "show", label)
        assert p.returncode == 0, err(p)
        shown = json.loads(out(p))
        assert shown["label"] == label and shown["status"] == "pending"
        assert shown["payload_type"] == "Grant"
        assert shown["payload_schema"] == msgspec.json.schema(Grant)

        await agent.d.resolve_hook(label, Grant(approved=True))
        await w.wait()


async def test_suspensions_show_an_unknown_label_is_a_clear_error(
    nats_url: str, label: str
) -> None:
    p = await hookbus(nats_url, "suspensions", "show", label)
    assert p.returncode == 1
    assert f"no suspension with label {label!r}" in err(p)
    assert "Traceback" not in err(p)


async def test_suspensions_resolve_wakes_the_waiter(
    agent: Agent, nats_url: str, label: str
) -> None:
    async with anyio.create_task_group() as tg:
        w = agent.spawn(tg, label)
        await agent.pending(label)
        p = await hookbus(
            nats_url, "suspensions", "resolve", label, '{"approved": true, "by": "cli"}'
        )
        assert p.returncode == 0, err(p)
        assert f"resolved {label}" in out(p)
        await w.wait()
    assert w.value == Grant(approved=True, by="cli")

    p = await hookbus(nats_url, "suspensions", "resolve", label, '{"approved": false}')
    assert p.returncode == 1 and "already resolved" in err(p)


async def test_suspensions_resolve_refuses_a_value_that_does_not_fit(
    agent: Agent, nats_url: str, label: str
) -> None:
    async with anyio.create_task_group() as tg:
        w = agent.spawn(tg, label)
        await agent.pending(label)
        before = await agent.d.suspensions.get(label)

        p = await hookbus(nats_url, "suspensions", "resolve", label, '{"approved": "yes"}')
        assert p.returncode == 1
        assert "does not fit Grant" in err(p) and "$.approved" in err(p), err(p)
        assert "Traceback" not in err(p)

        p = await hookbus(nats_url, "suspensions", "resolve", label, "{not json")
        assert p.returncode == 2 and "not valid JSON" in err(p), err(p)

        assert await agent.d.suspensions.get(label) == before
        assert not w.done.is_set()
        await agent.d.cancel_hook(label)
        await w.wait()


async def test_suspensions_resolve_an_unknown_label_is_an_error_unless_preregistered(
    agent: Agent, nats_url: str, label: str
) -> None:
    p = await hookbus(nats_url, "suspensions", "resolve", label, '{"approved": true}')
    assert p.returncode == 1 and f"no suspension with label {label!r}" in err(p)
    assert await agent.d.suspensions.get(label) is None

    p = await hookbus(
        nats_url, "suspensions", "resolve", label, '{"approved": true}', "--preregister"
    )
    assert p.returncode == 0, err(p)
    assert await agent.d.hook(label, Grant, timeout_s=5) == Grant(approved=True)


async def test_suspensions_cancel(agent: Agent, nats_url: str, label: str) -> None:
    async with anyio.create_task_group() as tg:
        w = agent.spawn(tg, label)
        await agent.pending(label)
        p = await hookbus(nats_url, "suspensions", "cancel", label, "--reason", "changed my mind")
        assert p.returncode == 0, err(p)
        assert f"cancelled {label}" in out(p)
        await w.wait()
    assert isinstance(w.error, SuspensionCancelledError) and w.error.reason == "changed my mind"

    p = await hookbus(nats_url, "suspensions", "cancel", label)
    assert p.returncode == 1 and "already cancelled" in err(p)
    p = await hookbus(nats_url, "suspensions", "cancel", f"{label} unknown")
    assert p.returncode == 1 and "no suspension with label" in err(p)


async def test_hooks_is_not_a_command() -> None:
    """One name per group: `hookbus suspensions`, its former name `hooks` is gone."""
    with anyio.fail_after(CLI_TIMEOUT_S):
        p = await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", "hooks", "list"], check=False
        )
    assert p.returncode == 2 and "No such command" in err(p)
    with anyio.fail_after(CLI_TIMEOUT_S):
        listed = await anyio.run_process([sys.executable, "-m", "hookbus.cli", "--help"])
    assert "suspensions" in out(listed)


# -- approvals -----------------------------------------------------------------------------
async def test_approvals_list_and_answer(agent: Agent, nats_url: str, event: str) -> None:
    session = f"cli-session-{uuid.uuid4().hex[:8]}"

    async def ask(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user",
            approval_prompt="Deploy to prod?",
            approval_options=["Allow once", "Allow always", "Deny"],
            approval_timeout=30,
        )

    agent.d.register(event, ask, name="deploy_guard")
    agent.d.set_default_fields(session_id=session)
    result: list[HookResult] = []
    emitted = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def emit() -> None:
            result.append(await agent.d.emit(event, {"tool_name": "deploy"}))
            emitted.set()

        tg.start_soon(emit)
        with anyio.fail_after(10):
            async for e in agent.stream:
                if e.hook.status == "pending" and e.hook.metadata.get("session_id") == session:
                    label = e.hook.label
                    break

        for args in (["approvals"], ["approvals", "list"]):
            p = await hookbus(nats_url, *args)
            assert p.returncode == 0, err(p)
            (line,) = [ln for ln in out(p).splitlines() if label in ln]
            assert "Deploy to prod?" in line
            assert "Allow once / Allow always / Deny" in line
            assert "deploy_guard" in line and "deploy" in line

        answer = ("approvals", "answer", "--approver", "ops")
        p = await hookbus(nats_url, *answer, label, "Maybe")
        assert p.returncode == 1
        assert "'Maybe' is not one of the options" in err(p) and "Allow always" in err(p), err(p)
        p = await hookbus(nats_url, *answer, f"{label}x", "Allow once")
        assert p.returncode == 1 and "no pending approval" in err(p)
        p = await hookbus(nats_url, "approvals", "answer", label, "Allow once")
        assert p.returncode == 2 and "--approver" in err(p)  # who answers is never implied
        assert not result

        p = await hookbus(nats_url, *answer, label, "Allow once")
        assert p.returncode == 0, err(p)
        assert f"answered {label}: Allow once (as ops)" in out(p)
        with anyio.fail_after(10):
            await emitted.wait()
    (r,) = result
    assert r.action == "continue" and r.decided_by == "deploy_guard" and r.approved_by == "ops"

    p = await hookbus(nats_url, "approvals", "list")
    assert p.returncode == 0 and label not in out(p)  # answered: no longer pending
