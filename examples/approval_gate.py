"""Approval gate worker: money leaves only with a human's yes.

A payment transfer is the OWASP payments agent's riskiest tool call. This handler answers
``ask_user`` (amplifier-core's approval request): the dispatcher turns it into a durable
approval suspension, a human (or the demo's ``approver.py`` process) answers it through
NATS, and the emit returns continue or deny. "Allow always" is remembered for the session.
"""

from __future__ import annotations

from typing import Any

from hookbus.schemas import TOOL_PRE, HookResult
from hookbus.workers import HookWorker

worker = HookWorker()


@worker.handler(
    TOOL_PRE,
    priority=15,
    name="transfer_approval",
    tool_filter=["payments:create_transfer"],
    failure_policy="deny",
    timeout_s=2.0,
)
async def transfer_approval(event: str, data: dict[str, Any]) -> HookResult:
    tool_input = data.get("tool_input") or {}
    amount = tool_input.get("amount", "?")
    currency = tool_input.get("currency", "")
    payee = tool_input.get("payee", "?")
    return HookResult(
        action="ask_user",
        approval_prompt=f"Transfer {amount} {currency} to {payee}?",
        approval_options=["Allow once", "Allow always", "Deny"],
        approval_timeout=30.0,
        approval_default="deny",
        reason="payment transfers need a human's approval",
    )
