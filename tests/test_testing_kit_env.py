"""`hookbus.testing.HookTestEnv`: chains, approvals, suspensions and the virtual clock, the
same test in process and against a real nats-server (``with_real``, one switch).

Every test runs on a loop with a virtual clock (`virtual_clock_loop`): in process, time
skips ahead while everything waits; with a real server the loop keeps real time (its
connection is open), so the real runs use short timeouts. The real runs start the
embedded nats-server the kit starts by default (marked ``processes``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from hookbus.schemas import (
    AlreadySettledError,
    HookResult,
    ResolutionRejectedError,
    SuspensionCancelledError,
    SuspensionTimeoutError,
    UnknownEventError,
)
from hookbus.testing import HookTestEnv, VirtualClockLoop, virtual_clock_loop
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

TOOL_PRE = "tool:pre"
BASH = {"tool_name": "Bash", "tool_input": {"command": "ls"}}
REAL_ONLY_S = 1.0
"""The approval timeout of a real run (seconds of real time)."""


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "asyncio", {"loop_factory": virtual_clock_loop}


@pytest.fixture(
    params=[False, pytest.param(True, marks=pytest.mark.processes)], ids=["memory", "real"]
)
def with_real(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def chain_worker(calls: list[str]) -> HookWorker:
    """Four handlers of one event, one worker process: a chain on NATS."""
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=10)
    async def redact(event: str, data: dict[str, Any]) -> HookResult:
        calls.append("redact")
        command = data["tool_input"]["command"].replace("secret", "***")
        return HookResult(action="modify", data={**data, "tool_input": {"command": command}})

    @w.handler(TOOL_PRE, priority=20)
    def flaky(event: str, data: dict[str, Any]) -> None:  # sync: runs in a thread
        calls.append("flaky")
        raise ValueError("boom")

    @w.handler(TOOL_PRE, priority=30, tool_filter=["read"])
    async def reads_only(event: str, data: dict[str, Any]) -> dict[str, str]:
        calls.append("reads_only")  # a dict is a result too
        return {"action": "deny", "reason": "not reached: Bash is not read"}

    @w.handler(TOOL_PRE, priority=40)
    async def remind(event: str, data: dict[str, Any]) -> HookResult:
        calls.append("remind")
        seen = data["tool_input"]["command"]
        return HookResult(action="inject_context", context_injection=f"ran: {seen}")

    return w


def asking_worker(*, timeout_s: float = 300.0, default: str = "deny") -> HookWorker:
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=10)
    async def gate(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user",
            approval_prompt=f"Run {data['tool_input']['command']}?",
            approval_timeout=timeout_s,
            approval_default=default,  # type: ignore[arg-type]
        )

    return w


# -- chains ------------------------------------------------------------------------------------
async def test_a_chain_folds_modify_failure_filter_and_injection(with_real: bool) -> None:
    calls: list[str] = []
    async with HookTestEnv(chain_worker(calls), with_real=with_real) as env:
        result = await env.emit(
            TOOL_PRE, {"tool_name": "Bash", "tool_input": {"command": "echo secret"}}
        )
    assert calls == ["redact", "flaky", "remind"]  # the tool filter skipped reads_only
    assert result.action == "inject_context"
    assert result.context_injection == "ran: echo ***"  # remind saw the modified data
    assert result.chained_data is not None
    assert result.chained_data["tool_input"] == {"command": "echo ***"}
    assert (result.decided_by, result.modified_by) == ("remind", ["redact"])
    assert [(f.handler, f.kind, f.policy) for f in result.failures] == [
        ("flaky", "error", "ignore")
    ]
    assert result.failures[0].message == "handler_error: ValueError: boom"


async def test_a_deny_ends_the_chain(with_real: bool) -> None:
    calls: list[str] = []
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=1)
    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        calls.append("guard")
        return HookResult(action="deny", reason="no shell")

    @w.handler(TOOL_PRE, priority=2)
    async def later(event: str, data: dict[str, Any]) -> None:
        calls.append("later")

    async with HookTestEnv(w, with_real=with_real) as env:
        result = await env.emit(TOOL_PRE, BASH)
    assert (result.action, result.reason, result.decided_by) == ("deny", "no shell", "guard")
    assert calls == ["guard"]


async def test_a_failure_under_policy_deny_fails_closed(with_real: bool) -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, failure_policy="deny", timeout_s=2.0)
    async def slow(event: str, data: dict[str, Any]) -> None:
        await asyncio.sleep(3600)

    async with HookTestEnv(w, with_real=with_real) as env:
        started = time.monotonic()
        result = await env.emit(TOOL_PRE, BASH)
    assert (result.action, result.decided_by) == ("deny", "slow")
    assert [(f.kind, f.policy) for f in result.failures] == [("timeout", "deny")]
    if not with_real:  # the 2 s timeout on the virtual clock
        assert time.monotonic() - started < 1.0


# -- approvals ---------------------------------------------------------------------------------
async def test_an_approval_allowed_by_the_test(with_real: bool) -> None:
    async with HookTestEnv(asking_worker(), with_real=with_real) as env:
        call = env.emit_soon(TOOL_PRE, BASH)
        approval = await env.next_approval()
        assert approval.label.startswith("approval:")
        assert approval.question.prompt == "Run ls?"
        assert approval.question.options == ["Allow", "Deny"]
        assert (approval.question.handler, approval.question.tool_name) == ("gate", "Bash")
        await env.allow(approval)
        result = await call
    assert (result.action, result.approved_by, result.decided_by) == ("continue", "test", "gate")
    assert result.reason == "test chose 'Allow'"


async def test_an_approval_denied_by_the_test(with_real: bool) -> None:
    async with HookTestEnv(asking_worker(), with_real=with_real, approver="alice") as env:
        call = env.emit_soon(TOOL_PRE, BASH)
        await env.deny(await env.next_approval())
        result = await call
    assert (result.action, result.approved_by, result.reason) == (
        "deny",
        "alice",
        "alice chose 'Deny'",
    )


@pytest.mark.parametrize("default", ["deny", "allow"])
async def test_an_approval_nobody_answers_takes_its_default(with_real: bool, default: str) -> None:
    """In process a 30 s approval timeout passes on the virtual clock in well under a
    second of real time; for real, a 1 s one takes its second."""
    timeout_s = REAL_ONLY_S if with_real else 30.0
    async with HookTestEnv(
        asking_worker(timeout_s=timeout_s, default=default), with_real=with_real
    ) as env:
        started, on_clock = time.monotonic(), env.time()
        result = await env.emit(TOOL_PRE, BASH)
        waited_s, skipped = time.monotonic() - started, env.time() - on_clock
    assert result.action == ("continue" if default == "allow" else "deny")
    assert result.reason == f"timed out after {timeout_s}s; default {default}"
    assert skipped >= timeout_s
    if not with_real:
        assert env.time_skipping
        assert waited_s < 10.0  # 30 s on the clock were skipped, not waited


async def test_the_emits_deadline_ends_an_approval_as_a_deny(with_real: bool) -> None:
    """The caller's deadline is not the human's silence: deny, whatever the default."""
    async with HookTestEnv(asking_worker(default="allow"), with_real=with_real) as env:
        result = await env.emit(TOOL_PRE, BASH, timeout_s=2.0 if with_real else 20.0)
    assert result.action == "deny"
    assert result.reason is not None
    assert result.reason.startswith("the caller's deadline ended the wait before an answer")


async def test_an_answer_not_among_the_options_is_refused() -> None:
    async with HookTestEnv(asking_worker()) as env:
        call = env.emit_soon(TOOL_PRE, BASH)
        approval = await env.next_approval()
        with pytest.raises(ResolutionRejectedError):
            await env.answer(approval, "Maybe")
        await env.answer(approval.label, "Deny")
        assert (await call).action == "deny"


async def test_every_asker_is_asked_in_turn() -> None:
    w = asking_worker()

    @w.handler(TOOL_PRE, priority=20)
    async def second(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_options=["Allow once", "Never"])

    async with HookTestEnv(w) as env:
        call = env.emit_soon(TOOL_PRE, BASH)
        await env.allow(await env.next_approval())
        second_question = await env.next_approval()
        assert second_question.question.handler == "second"
        await env.answer(second_question, "Never")
        result = await call
    assert (result.action, result.decided_by, result.reason) == (
        "deny",
        "second",
        "test chose 'Never'",
    )


# -- suspensions -------------------------------------------------------------------------------
class Transfer(msgspec.Struct):
    approved: bool
    amount: int


async def test_a_suspension_resolved_by_the_test(with_real: bool) -> None:
    async with HookTestEnv(asking_worker(), with_real=with_real) as env:
        waiting = asyncio.create_task(env.hook("transfer-1", Transfer, metadata={"to": "bob"}))
        await env.until_pending("transfer-1")
        with pytest.raises(ResolutionRejectedError):
            await env.resolve_hook("transfer-1", {"approved": "yes"})
        await env.resolve_hook("transfer-1", Transfer(approved=True, amount=10))
        assert await waiting == Transfer(approved=True, amount=10)
        with pytest.raises(AlreadySettledError):
            await env.resolve_hook("transfer-1", {"approved": False, "amount": 0})


async def test_a_pre_registered_resolution_is_taken_at_once(with_real: bool) -> None:
    async with HookTestEnv(asking_worker(), with_real=with_real) as env:
        await env.resolve_hook("transfer-2", {"approved": False, "amount": 5})
        got = await asyncio.wait_for(env.hook("transfer-2", Transfer), 5.0)
    assert got == Transfer(approved=False, amount=5)


async def test_a_cancelled_suspension_raises(with_real: bool) -> None:
    async with HookTestEnv(asking_worker(), with_real=with_real) as env:
        waiting = asyncio.create_task(env.hook("transfer-3"))
        await env.until_pending("transfer-3")
        await env.cancel_hook("transfer-3", reason="changed my mind")
        with pytest.raises(SuspensionCancelledError) as raised:
            await waiting
    assert raised.value.reason == "changed my mind"


async def test_a_suspension_times_out_on_the_virtual_clock() -> None:
    async with HookTestEnv(asking_worker()) as env:
        started, on_clock = time.monotonic(), env.time()
        with pytest.raises(SuspensionTimeoutError):
            await env.hook("transfer-4", timeout_s=3600.0)
        assert env.time() - on_clock >= 3600.0
        assert time.monotonic() - started < 1.0


# -- the environment ---------------------------------------------------------------------------
async def test_a_sync_handler_in_a_thread_is_waited_for_not_skipped() -> None:
    """The clock does not skip while a thread works: a sync handler taking 50 ms of real
    time is not cut by its 1 s timeout."""
    w = HookWorker()

    @w.handler(TOOL_PRE, timeout_s=1.0, failure_policy="deny")
    def blocking(event: str, data: dict[str, Any]) -> HookResult:
        time.sleep(0.05)
        return HookResult(action="continue", reason="took its time")

    async with HookTestEnv(w) as env:
        assert isinstance(asyncio.get_running_loop(), VirtualClockLoop)
        result = await env.emit(TOOL_PRE, BASH)
    assert (result.action, result.failures) == ("continue", [])


async def test_an_unknown_event_is_refused_and_the_worker_stays_untouched() -> None:
    w = asking_worker()
    async with HookTestEnv(w) as env:
        with pytest.raises(UnknownEventError):
            await env.emit("tool:pree", BASH)
        assert (await env.emit("session:start", {})).action == "continue"  # standard: no handler
    with pytest.raises(RuntimeError, match="closed"):
        await env.emit(TOOL_PRE, BASH)
    with pytest.raises(ValueError, match="no handlers"):
        HookTestEnv(HookWorker())
    assert w.instance == ""  # never started
