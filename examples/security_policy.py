"""Security policy worker: denies dangerous or leaking actions, and fails closed.

Both handlers are declared with ``failure_policy="deny"``: if one raises (for example on a
tool call whose input is not an object), times out, or has no live replica, the
dispatcher denies instead of letting the action through unchecked.

Rules, after the OWASP AOS hook examples (``steps/toolCallRequest``, ``steps/memoryStore``,
``steps/message`` with role agent):

- ``tool:pre``: no shell or OS tools; text messages only to the user's verified numbers;
  no full bank account numbers written to agent memory. Tool names are matched ignoring
  case (`ToolFilter`, hookbus's rule for ``tool_filter``), so Claude Code's ``Bash`` is
  denied like ``bash``.
- ``prompt:complete``: a response to the user may not reveal a full bank account number.

Run one replica with ``hookbus worker examples/security_policy.py:worker``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from hookbus.schemas import PROMPT_COMPLETE, TOOL_PRE, HookResult, ToolFilter
from hookbus.workers import HookWorker

worker = HookWorker()

SHELL_TOOLS = ToolFilter.of(["bash", "sh", "shell", "exec", "run_command", "os:*", "terminal:*"])
"""Tool names that run commands on a host, matched as hookbus matches a ``tool_filter``
(whole name, ignoring case): Claude Code's ``Bash`` is ``bash`` here."""

MESSAGING_TOOLS = ToolFilter.of(["send_sms"])
MEMORY_STORE = ToolFilter.of(["memory:store"])
VERIFIED_NUMBERS = frozenset({"+337-665-99-06"})
"""Phone numbers the user has verified (the OWASP e-mail assistant texts this one)."""

FULL_ACCOUNT_NUMBER = re.compile(r"(?<![\d-])\d{10,17}(?![\d-])")
"""A bare run of 10 to 17 digits: a full bank account number (000123456789)."""


class ToolCall(msgspec.Struct):
    """The part of ``tool:pre`` data this policy reads; anything else is refused."""

    tool_name: str
    tool_input: dict[str, Any]


def _deny(reason: str) -> HookResult:
    return HookResult(action="deny", reason=reason)


@worker.handler(TOOL_PRE, priority=10, failure_policy="deny", timeout_s=2.0)
def security_policy(event: str, data: dict[str, Any]) -> HookResult | None:
    """Deny shell tools, texts to unverified numbers, account numbers stored in memory.

    Raises `msgspec.ValidationError` on malformed tool calls (the dispatcher then denies).
    """
    call = msgspec.convert(data, ToolCall)
    tool = call.tool_name
    if SHELL_TOOLS.matches_name(tool):
        return _deny(f"{tool}: shell and OS tools are not allowed for fleet agents")
    if MESSAGING_TOOLS.matches_name(tool):
        number = call.tool_input.get("phone_number")
        if number not in VERIFIED_NUMBERS:
            return _deny(f"{tool}: {number!r} is not one of the user's verified numbers")
    if MEMORY_STORE.matches_name(tool) and FULL_ACCOUNT_NUMBER.search(str(call.tool_input)):
        return _deny(f"{tool}: full bank account numbers may not be written to agent memory")
    return None


@worker.handler(PROMPT_COMPLETE, priority=10, failure_policy="deny", timeout_s=2.0)
def response_dlp(event: str, data: dict[str, Any]) -> HookResult | None:
    """Deny a response to the user that reveals a full bank account number."""
    response = data["response"]
    if not isinstance(response, str):
        raise TypeError(f"response must be text, got {type(response).__name__}")
    if FULL_ACCOUNT_NUMBER.search(response):
        return _deny("the response reveals a full bank account number; give the last 4 digits only")
    return None
