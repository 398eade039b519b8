"""Audit observer worker: records every lifecycle event and never changes a decision.

Declared ``parallel=True`` at priority 100 (last): the dispatcher calls it in the same
round trip as the other parallel handlers, and it always continues. It sees the data as
the earlier handlers left it (after redaction) and logs metadata only (agent, session,
event, tool, field names), never content, so the audit trail holds no personal data.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from hookbus.schemas import (
    PROMPT_COMPLETE,
    PROMPT_SUBMIT,
    SESSION_END,
    SESSION_START,
    TOOL_POST,
    TOOL_PRE,
)
from hookbus.workers import HookWorker

log = logging.getLogger("hookbus.examples.audit")

worker = HookWorker()

AUDITED_EVENTS = (SESSION_START, PROMPT_SUBMIT, TOOL_PRE, TOOL_POST, PROMPT_COMPLETE, SESSION_END)


def audit(event: str, data: dict[str, Any]) -> None:
    """Log one audit record (JSON, metadata only); continue."""
    record = {
        "event": event,
        "agent_id": data.get("agent_id"),
        "session_id": data.get("session_id"),
        "tool": data.get("tool_name"),
        "fields": sorted(data),
        "redactions": len(data.get("redactions", [])),
        "timestamp": data.get("timestamp"),
    }
    log.info("audit %s", json.dumps(record, sort_keys=True))


for _event in AUDITED_EVENTS:
    worker.add_handler(_event, audit, priority=100, parallel=True, timeout_s=2.0)
