"""Approvals: a handler's ``ask_user`` result becomes a durable approval suspension.

amplifier-core's `HookResult` carries the question (`approval_prompt`), the choices
(`approval_options`, default ``["Allow", "Deny"]``), how long to wait (`approval_timeout`,
seconds) and what to do then (`approval_default`). hookbus turns that into a suspension
whose metadata carries them; the emit waits for an `ApprovalAnswer` and returns continue or
deny. A choice starting with "allow" (any case) allows; anything else denies. "Allow always"
is remembered in `APPROVALS_BUCKET` for the rest of the session, keyed by session, handler
and tool, so the next identical call does not ask again.

The label is derived from the call (session, handler, event and data without the
timestamp), so an emit retried after a dispatcher restart finds the same suspension and
its resolution instead of asking twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    ApprovalAnswer,
    HookCancelledError,
    HookResult,
    HookTimeoutError,
    always_allow_key,
    approvals_bucket_config,
    encode,
)
from hookbus.schemas import _telemetry_names as tn

from ._suspensions import Suspensions

__all__ = ["APPROVAL_LABEL_PREFIX", "Approvals", "approval_label", "is_allow"]

log = logging.getLogger("hookbus.dispatcher")

APPROVAL_LABEL_PREFIX = "approval:"
"""Every approval suspension's label starts with this (``hookbus approvals`` lists them)."""


def is_allow(choice: str) -> bool:
    """Whether an approval choice allows the call ("Allow", "Allow once", "Allow always")."""
    return choice.strip().lower().startswith("allow")


def approval_label(event: str, data: dict[str, Any], handler: str) -> str:
    """The deterministic label of the approval for one call."""
    session = str(data.get("session_id") or "-")
    stable = {k: v for k, v in data.items() if k != "timestamp"}
    digest = hashlib.sha256(encode([event, handler, stable])).hexdigest()[:20]
    return f"{APPROVAL_LABEL_PREFIX}{session}:{handler}:{digest}"


class Approvals:
    """Turns ``ask_user`` results into answers, through `Suspensions`."""

    def __init__(self, suspensions: Suspensions, always: KeyValue) -> None:
        self._suspensions = suspensions
        self._always = always

    @classmethod
    async def open(cls, nc: NATS, suspensions: Suspensions, *, replicas: int = 1) -> Approvals:
        js = nc.jetstream()
        config = approvals_bucket_config(replicas=replicas)
        try:
            kv = await js.create_key_value(config=config)
        except nats.js.errors.BadRequestError:
            kv = await js.key_value(config.bucket)
        return cls(suspensions, kv)

    async def decide(self, event: str, result: HookResult) -> HookResult:
        """Ask, wait, and fold the answer into `result`: continue or deny.

        The timeout applies `approval_default`; a cancelled approval denies.
        """
        data = result.data or {}
        handler = result.decided_by or "?"
        tool = str(data.get("tool_name") or "-")
        session = str(data.get("session_id") or "-")
        grant = always_allow_key(session, handler, tool)
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            entry = await self._always.get(grant)
            if entry.value:
                return self._answer(
                    result, allow=True, reason=f"allowed always in session {session}"
                )
        options = list(result.approval_options or APPROVAL_DEFAULT_OPTIONS)
        metadata = {
            "kind": "approval",
            "prompt": result.approval_prompt or f"Allow {tool} ({event})?",
            "options": options,
            "timeout_s": result.approval_timeout,
            "default": result.approval_default,
            "handler": handler,
            "event": event,
            "tool_name": tool,
            "session_id": session,
            "agent_id": data.get("agent_id"),
        }
        schema = {
            "type": "object",
            "properties": {"choice": {"enum": options}},
            "required": ["choice"],
        }
        label = approval_label(event, data, handler)
        try:
            answer = await self._suspensions.hook(
                label,
                payload=ApprovalAnswer,
                metadata=metadata,
                timeout_s=result.approval_timeout,
                schema=schema,
                shared=True,  # a retried emit (dispatcher restart) takes over the same approval
                kind="approval",
                span_attributes={
                    tn.HANDLER: handler,
                    tn.GEN_AI_TOOL_NAME: tool,
                    tn.GEN_AI_CONVERSATION_ID: session,
                },
            )
        except HookTimeoutError:
            allow = result.approval_default == "allow"
            with contextlib.suppress(Exception):
                await self._suspensions.cancel_hook(
                    label, reason=f"timed out; default {result.approval_default} applied"
                )
            return self._answer(
                result,
                allow=allow,
                reason=f"approval timed out after {result.approval_timeout}s; "
                f"default {result.approval_default}",
            )
        except HookCancelledError as exc:
            return self._answer(result, allow=False, reason=f"approval cancelled: {exc.reason}")
        allow = is_allow(answer.choice)
        if allow and answer.choice.strip().lower() == "allow always":
            await self._always.put(grant, encode({"choice": answer.choice, "label": label}))
        return self._answer(result, allow=allow, reason=f"user chose {answer.choice!r}")

    @staticmethod
    def _answer(result: HookResult, *, allow: bool, reason: str) -> HookResult:
        return msgspec.structs.replace(
            result, action="continue" if allow else "deny", reason=reason
        )
