"""A pydantic-ai agent governed by the demo's hook workers, through `HookbusCapability`.

The payments agent of the demo, as a pydantic-ai `Agent`: its model is a `FunctionModel`
that replays one scripted turn (no network, no API key), and its tool calls, prompt and
answer are decided by the example workers running as processes of their own:

- ``bash`` → denied by ``security_policy`` (shell tools; the model reads the reason);
- ``send_sms`` to an unverified number → denied by ``security_policy``;
- ``send_sms`` to the verified number → runs, its e-mail address redacted by ``redact_pii``;
- ``payments:create_transfer`` → the memo's card number redacted by ``redact_pii``, then
  ``transfer_approval`` asks a human: the approver process answers "Allow once" (without
  one, the approval times out after 30 s and the transfer is denied);
- the prompt asks for bank details → ``payments_guidance`` injects the confidentiality rule
  into the first model request; ``audit`` sees every event.

Run it against a server and the demo's workers (from the repository root)::

    .venv/bin/hookbus server &                          # nats-server on 127.0.0.1:4222
    for w in security_policy approval_gate redactor context_injector audit; do
        .venv/bin/hookbus worker examples/$w.py:worker --url nats://127.0.0.1:4222 &
    done
    .venv/bin/python examples/approver.py nats://127.0.0.1:4222 &
    .venv/bin/python examples/pydantic_ai_agent.py --url nats://127.0.0.1:4222

It prints, per tool call, whether the tool ran, with which arguments, and what the model
read as its result; then the answer. Exit status 0, or 1 if a decision is not the expected
one (a worker missing: a fail-closed ``security_policy`` that is declared but not running
denies every call).

``hookbus demo --agents pydantic-ai`` runs the same agent (`run_agent`) in the demo's
process, against the workers and approver the demo started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from typing import Any

import nats
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from hookbus.dispatcher import HookDispatcher
from hookbus.integrations import pydantic_ai as hookbus_pydantic_ai
from hookbus.integrations.pydantic_ai import HookbusCapability

# where a hook's injection lands in the history: hookbus's own part kind on a pydantic-ai
# with capability parts, a system or user prompt part before them
INJECTED_PARTS: tuple[type, ...] = (SystemPromptPart, UserPromptPart)
if hookbus_pydantic_ai.CAPABILITY_PARTS:
    INJECTED_PARTS += (hookbus_pydantic_ai.HookInjectionPart,)

PROMPT = "What is the bank account of Acme Corp? Text me when invoice 7 is paid, then pay it."

TOOL_CALLS = [
    ToolCallPart("bash", {"command": "cat ~/.aws/credentials"}, tool_call_id="c1"),
    ToolCallPart("send_sms", {"phone_number": "+1-202-555-0147", "message": "code 4411"}, "c2"),
    ToolCallPart(
        "send_sms",
        {"phone_number": "+337-665-99-06", "message": "Paying Acme; receipts to bob@example.com"},
        "c3",
    ),
    ToolCallPart(
        "payments:create_transfer",
        {
            "amount": "1200.00",
            "currency": "EUR",
            "payee": "Acme Corp",
            "memo": "invoice 7, card 4111 1111 1111 1111",
        },
        "c4",
    ),
]

EXPECTED = {
    "c1": (False, "Denied by hook: bash: shell and OS tools are not allowed"),
    "c2": (False, "Denied by hook: send_sms: '+1-202-555-0147' is not one of the user's"),
    "c3": (True, "texted +337-665-99-06: Paying Acme; receipts to [REDACTED e-mail]"),
    "c4": (True, "transfer of 1200.00 EUR to Acme Corp queued"),
}
"""Per tool call: whether the tool runs, and how what the model reads starts."""


def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The scripted model: the tool calls first, then an answer from their results."""
    if not any(isinstance(m, ModelResponse) for m in messages):
        return ModelResponse(parts=list(TOOL_CALLS))
    return ModelResponse(parts=[TextPart("Acme Corp's account ends in 6789; invoice 7 is paid.")])


Ran = dict[str, dict[str, Any]]
"""Tool call id -> the arguments the tool ran with."""


def build_agent(dispatcher: HookDispatcher, ran: Ran) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(
        FunctionModel(model),
        capabilities=[HookbusCapability(dispatcher, session_id="payments-session-1")],
    )

    @agent.tool
    def bash(ctx: RunContext[None], command: str) -> str:
        """Run a shell command."""
        ran[ctx.tool_call_id or "?"] = {"command": command}
        return "(shell output)"

    @agent.tool
    def send_sms(ctx: RunContext[None], phone_number: str, message: str) -> str:
        """Text the user."""
        ran[ctx.tool_call_id or "?"] = {"phone_number": phone_number, "message": message}
        return f"texted {phone_number}: {message}"

    @agent.tool(name="payments:create_transfer")
    def create_transfer(
        ctx: RunContext[None], amount: str, currency: str, payee: str, memo: str
    ) -> str:
        """Pay a payee."""
        ran[ctx.tool_call_id or "?"] = {"amount": amount, "payee": payee, "memo": memo}
        return f"transfer of {amount} {currency} to {payee} queued (memo: {memo})"

    return agent


@dataclass
class CallOutcome:
    """One scripted tool call and what came of it."""

    tool_name: str
    tool_call_id: str
    ran: dict[str, Any] | None
    """The arguments the tool ran with (after any modify), or None: it never ran."""
    model_read: str
    """What the model read as the call's result (a denial's text if it did not run)."""
    ok: bool
    """Whether it ran or not as `EXPECTED` says, and the model read the expected text."""


@dataclass
class AgentRun:
    """What `run_agent` returns: each tool call's outcome, in the model's order, the texts
    the hooks injected into the model's requests, and the agent's answer."""

    calls: list[CallOutcome]
    injected: list[str]
    answer: str

    @property
    def ok(self) -> bool:
        return all(call.ok for call in self.calls)


def outcomes(messages: list[ModelMessage], ran: Ran) -> tuple[list[CallOutcome], list[str]]:
    """Each scripted call's outcome, and the injected texts, from a run's messages."""
    returns = {
        p.tool_call_id: p.content
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    }
    injected = [
        str(p.content)
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, INJECTED_PARTS) and p.content != PROMPT
    ]
    calls = []
    for call in TOOL_CALLS:
        seen = str(returns.get(call.tool_call_id))
        want_run, want_text = EXPECTED[call.tool_call_id]
        args = ran.get(call.tool_call_id)
        ok = (args is not None) == want_run and seen.startswith(want_text)
        calls.append(CallOutcome(call.tool_name, call.tool_call_id, args, seen, ok))
    return calls, injected


async def run_agent(dispatcher: HookDispatcher) -> AgentRun:
    """Run the scripted agent once, its hooks emitted through `dispatcher` (a started
    `HookDispatcher`; its ``agent_id`` names the agent, e.g. ``payments-agent``).

    Raises:
        HookbusError: an emit failed (e.g. the connection closed); see `HookbusCapability`.
    """
    ran: Ran = {}
    result = await build_agent(dispatcher, ran).run(PROMPT)
    calls, injected = outcomes(result.all_messages(), ran)
    return AgentRun(calls, injected, result.output)


def report(run: AgentRun) -> bool:
    """Print each call's outcome; True if every one is the expected one."""
    for call in run.calls:
        mark = "ok " if call.ok else "BAD"
        did_run = call.ran is not None
        print(f"{mark} {call.tool_name:26} ran={did_run!s:5} model read: {call.model_read[:90]}")
        if call.ran is not None:
            print(f"    ran with {call.ran}")
    for text in run.injected:
        print(f"    injected: {text[:100]}")
    return run.ok


async def main(url: str) -> int:
    nc = await nats.connect(url, name="pydantic-ai-agent")
    try:
        async with HookDispatcher(nc, agent_id="payments-agent") as dispatcher:
            run = await run_agent(dispatcher)
            ok = report(run)
            print(f"answer: {run.answer}")
    finally:
        await nc.drain()
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    sys.exit(asyncio.run(main(parser.parse_args().url)))
