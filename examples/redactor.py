"""Redactor worker: removes card numbers and e-mail addresses from tool input.

Tool calls leave the agent for third parties (an SMS gateway, a payment network, a remote
MCP server); this worker rewrites every string in ``tool_input`` before the call is made
(``action="modify"``, the OWASP ``modifiedRequest``):

- card numbers (13 to 19 digits, spaces or dashes allowed, valid Luhn checksum) become
  ``[REDACTED card ending 1111]``;
- e-mail addresses become ``[REDACTED e-mail]``.

It records each change in ``data["redactions"]`` (field path and kind, never the removed
value), so later handlers and the audit trail can tell what changed; the dispatcher names
the handler in ``result.modified_by``. The demo runs this worker with 2 replicas: both
serve the same queue group and share the requests.
"""

from __future__ import annotations

import re
from typing import Any

from hookbus.schemas import TOOL_PRE, HookResult
from hookbus.workers import HookWorker

worker = HookWorker()

HANDLER = "redact_pii"
CARD_NUMBER = re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)")
EMAIL_ADDRESS = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")


def luhn_valid(digits: str) -> bool:
    """Whether a string of digits passes the Luhn checksum (ISO/IEC 7812)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2 == 1:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def redact_text(text: str) -> tuple[str, list[str]]:
    """`text` with card numbers and e-mail addresses replaced, and the kinds replaced."""
    kinds: list[str] = []

    def card(match: re.Match[str]) -> str:
        digits = re.sub(r"\D", "", match.group())
        if not luhn_valid(digits):
            return match.group()
        kinds.append("card_number")
        return f"[REDACTED card ending {digits[-4:]}]"

    def email(match: re.Match[str]) -> str:
        kinds.append("email_address")
        return "[REDACTED e-mail]"

    text = CARD_NUMBER.sub(card, text)
    text = EMAIL_ADDRESS.sub(email, text)
    return text, kinds


def _redact(value: Any, path: str, found: list[dict[str, str]]) -> Any:
    if isinstance(value, str):
        text, kinds = redact_text(value)
        found.extend({"field": path, "kind": kind} for kind in kinds)
        return text
    if isinstance(value, dict):
        return {k: _redact(v, f"{path}.{k}", found) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


@worker.handler(TOOL_PRE, priority=20, name=HANDLER, timeout_s=2.0)
def redact_pii(event: str, data: dict[str, Any]) -> HookResult | None:
    """Modify ``tool_input``: redact card numbers and e-mail addresses; else continue."""
    found: list[dict[str, str]] = []
    redacted = _redact(data.get("tool_input"), "tool_input", found)
    if not found:
        return None
    return HookResult(
        action="modify",
        data={
            **data,
            "tool_input": redacted,
            "redactions": [*data.get("redactions", []), *found],
        },
        reason=f"redacted {len(found)} value(s) from tool_input",
    )
