"""The example approval gate (examples/approval_gate.py), alone and with the example
policies, tested with `hookbus.testing.HookTestEnv`: the test answers the gate's
questions, or lets its 30 s pass on a virtual clock (in process, no nats-server: the fast
tier)."""

from __future__ import annotations

from typing import Any

import pytest
from test_example_policies import call, example

from hookbus.schemas import TOOL_PRE
from hookbus.testing import HookTestEnv, virtual_clock_loop

pytestmark = pytest.mark.anyio


def transfer(amount: int, memo: str = "") -> dict[str, Any]:
    return call("payments:create_transfer", amount=amount, currency="EUR", payee="Acme", memo=memo)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """A loop with a virtual clock: the gate's 30 s approval timeout passes at once."""
    return "asyncio", {"loop_factory": virtual_clock_loop}


@pytest.mark.parametrize(("choice", "action"), [("Allow once", "continue"), ("Deny", "deny")])
async def test_the_approval_gate_asks_a_human_before_a_transfer(choice: str, action: str) -> None:
    async with HookTestEnv(example("approval_gate").worker, approver="alice") as env:
        call_ = env.emit_soon(TOOL_PRE, transfer(120))
        approval = await env.next_approval()
        assert approval.question.prompt == "Transfer 120 EUR to Acme?"
        assert approval.question.options == ["Allow once", "Allow always", "Deny"]
        await env.answer(approval, choice)
        result = await call_
    assert (result.action, result.decided_by, result.approved_by) == (
        action, "transfer_approval", "alice",
    )  # fmt: skip


async def test_an_unanswered_transfer_is_denied_after_30_s_of_virtual_time() -> None:
    async with HookTestEnv(example("approval_gate").worker) as env:
        started = env.time()
        result = await env.emit(TOOL_PRE, transfer(120))
        assert env.time() - started >= 30.0
    assert (result.action, result.reason) == ("deny", "timed out after 30.0s; default deny")


async def test_the_example_workers_together_redact_then_ask() -> None:
    """The security policy, the redactor and the approval gate folded as one fleet: the
    human is asked once the whole chain ran, and the call goes on redacted; a shell call
    is denied without asking anyone."""
    workers = [example(n).worker for n in ("security_policy", "redactor", "approval_gate")]
    async with HookTestEnv(*workers) as env:
        call_ = env.emit_soon(TOOL_PRE, transfer(80, memo="card 4111 1111 1111 1111"))
        approval = await env.next_approval()
        assert approval.question.tool_name == "payments:create_transfer"
        await env.allow(approval)
        result = await call_
        denied = await env.emit(TOOL_PRE, call("bash", command="ls"))
    assert (result.action, result.modified_by) == ("continue", ["redact_pii"])
    assert result.data["tool_input"]["memo"] == "card [REDACTED card ending 1111]"
    assert (denied.action, denied.decided_by) == ("deny", "security_policy")
