"""The rules of an approval, without I/O: which answers allow, the labels, the timeout cut,
what an approval record shows, the decided result and how several askers' decisions join.

The approval lifecycle these rules serve is told in `hookbus.dispatcher._approvals`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec

from hookbus._core.deadlines import Deadline
from hookbus.schemas import ApprovalAnswer, HookbusError, HookResult, SuspensionRecord, encode

__all__ = [
    "APPROVAL_DATA_MAX_BYTES",
    "APPROVAL_LABEL_PREFIX",
    "CALLERS_DEADLINE",
    "MAX_APPROVAL_TIMEOUT_S",
    "NOT_ASKED",
    "NO_ALLOWING_OPTION",
    "TIMED_OUT",
    "allowing_options",
    "allows",
    "approval_label",
    "approval_left",
    "approval_metadata",
    "call_data",
    "cancel_reason",
    "cut_timeout",
    "decided",
    "is_allow",
    "is_always",
    "joined_decision",
    "next_approval_label",
    "record_allows",
    "settled_how",
    "text_or_none",
    "uses_up",
]

APPROVAL_LABEL_PREFIX = "approval:"
"""Every approval suspension's label starts with this (``hookbus approvals`` lists them)."""

TIMED_OUT = "timed out after "
"""How the cancel reason of an approval closed by its timeout starts."""

NO_ALLOWING_OPTION = "offer no allowing answer"
"""Words of the reason of a deny decided because none of a question's options allows."""

NOT_ASKED = "approval not asked"
"""How the reason of a deny starts when the approval record could not be written (e.g. an
agent's own dispatcher on a secured server, where approvals are asked through the
dispatcher service)."""

CALLERS_DEADLINE = "the caller's deadline ended the wait before an answer"
"""How the reason of a deny decided by the caller's deadline (not the approval's own
timeout) starts; the approval stays pending."""


def is_allow(choice: str) -> bool:
    """Whether an approval choice allows the call by the default rule: it starts with
    "allow", any case ("Allow", "Allow once", "Allow always"). A handler's
    `HookResult.approval_allow_options` replaces this rule for its question."""
    return choice.strip().lower().startswith("allow")


def allows(choice: str, allow_options: list[str] | None) -> bool:
    """Whether `choice` allows the call: it is one of `allow_options` (exact text), or,
    when those are None, it passes `is_allow`."""
    return is_allow(choice) if allow_options is None else choice in allow_options


def allowing_options(options: list[str], allow_options: list[str] | None) -> list[str]:
    """The offered `options` that allow (see `allows`), in their order; empty when no
    answer could allow."""
    return [o for o in options if allows(o, allow_options)]


def is_always(choice: str) -> bool:
    """Whether `choice` is "Allow always" (any case, surrounding blanks ignored)."""
    return choice.strip().lower() == "allow always"


def uses_up(choice: str, allow_options: list[str] | None) -> bool:
    """Whether `choice` allows one decision only: it allows (see `allows`) and is not
    "Allow always" (any case). The first decision it allows marks its approval used; the
    same call decided again is asked again."""
    return allows(choice, allow_options) and not is_always(choice)


def record_allows(record: SuspensionRecord, choice: str) -> bool:
    """Whether `choice` allows by the approval record's ``allow_options`` (a record
    written without them: the default rule, `is_allow`)."""
    allowing = record.metadata.get("allow_options")
    if isinstance(allowing, list):
        return choice in allowing
    return is_allow(choice)


MAX_APPROVAL_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest approval wait, in seconds (a handler's `approval_timeout` is clamped to it)."""


def _clamp(timeout_s: float | None, longest: float = MAX_APPROVAL_TIMEOUT_S) -> float | None:
    """A handler's `approval_timeout` within [0, `longest`] (NaN: 0; None: `longest` when
    that is below `MAX_APPROVAL_TIMEOUT_S`, else None, no limit)."""
    if timeout_s is None:
        return longest if longest < MAX_APPROVAL_TIMEOUT_S else None
    if not timeout_s >= 0:  # negative or NaN
        return 0.0
    return min(float(timeout_s), longest)


def cut_timeout(result: HookResult, most_s: float, callers_s: float | None) -> HookResult:
    """`result` with its ``approval_timeout`` within `most_s` (`Approvals.max_timeout_s`) and
    the caller's `callers_s` (seconds; None: no cut). When the caller's cut shortens the
    wait, an ``approval_default`` of ``"allow"`` becomes ``"deny"``: a caller that waits less
    than the handler asked for never turns the handler's silence window into an allow."""
    own = _clamp(result.approval_timeout, most_s)
    if callers_s is None:
        return msgspec.structs.replace(result, approval_timeout=own)
    cut = _clamp(own, callers_s)
    shortened = cut is not None and (own is None or cut < own)
    default = "deny" if shortened else result.approval_default
    return msgspec.structs.replace(result, approval_timeout=cut, approval_default=default)


def approval_left(timeout_s: float | None, started: float) -> float | None:
    """Seconds the approval still waits (None: no limit): `timeout_s` from `started` (a
    `time.monotonic` reading), on this process's clock only. A retry that resumes an
    approval another host asked waits its own timeout from the retry: the record's
    ``created_at`` is that host's wall clock, and no decision compares two hosts' clocks
    (one an hour ahead would apply the default at once). The asker, if alive, closes the
    approval at its own timeout, and the retry then gets that outcome."""
    if timeout_s is None:
        return None
    return Deadline.after(timeout_s, started).left(time.monotonic())


def text_or_none(value: Any) -> str | None:
    """`value` when it is a non-empty str, else None."""
    return value if isinstance(value, str) and value else None


def call_data(result: HookResult) -> dict[str, Any]:
    """The data of the call an ``ask_user`` result is about (the chained data of the emit;
    a result made outside an emit has only its own)."""
    return result.chained_data or result.data or {}


def approval_label(event: str, data: dict[str, Any], handler: str, *, call_id: str) -> str:
    """The label of the approval of one call: ``approval:<32 hex digits>``.

    A digest of the event, ``data["agent_id"]``, ``data["session_id"]``, the handler, the
    call's id (`call_id`: the caller's idempotency key, else the emit's own id) and the
    data without ``timestamp``. Same call (a retry) -> same label; another call id or
    other data -> another label.
    """
    stable = {k: v for k, v in data.items() if k != "timestamp"}
    agent, session = text_or_none(data.get("agent_id")), text_or_none(data.get("session_id"))
    digest = hashlib.sha256(encode([event, agent, session, handler, call_id, stable]))
    return f"{APPROVAL_LABEL_PREFIX}{digest.hexdigest()[:32]}"


def next_approval_label(label: str) -> str:
    """The label of the fresh approval asked once approval `label`'s one-time allow was
    used (``approval:<32 hex digits>``): the same call decided again gets it, and the one
    after that ``next_approval_label`` of it, and so on."""
    digest = hashlib.sha256(encode(["again", label]))
    return f"{APPROVAL_LABEL_PREFIX}{digest.hexdigest()[:32]}"


APPROVAL_DATA_MAX_BYTES = 16 * 1024
"""Largest call data an approval record carries whole (its JSON, bytes); larger data is
shown as the start of its JSON text."""


def approval_metadata(
    event: str, result: HookResult, handler: str, options: list[str], allowing: list[str]
) -> dict[str, Any]:
    """The approval record's metadata (an `ApprovalMetadata`, every key written) for the
    question `result` of `handler` (its ``approval_timeout`` already clamped)."""
    data = call_data(result)
    tool = text_or_none(data.get("tool_name"))
    return {
        "kind": "approval",
        "prompt": result.approval_prompt or f"Allow {tool or 'this call'} ({event})?",
        "options": options,
        "allow_options": allowing,
        "timeout_s": result.approval_timeout,
        "default": result.approval_default,
        "handler": handler,
        "event": event,
        "tool_name": tool,
        "session_id": text_or_none(data.get("session_id")),
        "agent_id": text_or_none(data.get("agent_id")),
        **_shown_data(data),
    }


def _shown_data(data: dict[str, Any]) -> dict[str, Any]:
    """What an approval's metadata shows of the call's data (what the handlers saw, after
    any data chaining): ``{"data": data}`` when its JSON is at most
    `APPROVAL_DATA_MAX_BYTES`, else ``{"data": None, "data_preview": <the JSON's first
    APPROVAL_DATA_MAX_BYTES characters>, "data_bytes": <its full size>}``."""
    try:
        text = encode(data)
    except (HookbusError, TypeError):
        return {"data": None}
    if len(text) <= APPROVAL_DATA_MAX_BYTES:
        return {"data": data}
    preview = text[:APPROVAL_DATA_MAX_BYTES].decode("utf-8", "ignore")
    return {"data": None, "data_preview": preview, "data_bytes": len(text)}


def decided(result: HookResult, *, allow: bool, reason: str) -> HookResult:
    """The decided result: an allow goes on with the call's data (``continue`` with
    the chained data, as a plain continue returns it); a deny keeps the asking
    handler's own data, as a deny does."""
    if not allow:
        return msgspec.structs.replace(result, action="deny", reason=reason)
    return msgspec.structs.replace(
        result, action="continue", reason=reason, data=result.chained_data
    )


def cancel_reason(proof: ApprovalAnswer) -> str:
    """The reason an approval closed by the cancel proof `proof` carries: ``"by
    <approver>"``, then ``": <reason>"`` when the cancel gave one."""
    return f"by {proof.answered_by}" + (f": {proof.reason}" if proof.reason else "")


def settled_how(record: SuspensionRecord) -> str:
    """How a settled approval record was settled, for an error message."""
    if record.status == "cancelled" and record.reason:
        return f"cancelled ({record.reason})"
    if record.status == "resolved" and isinstance(record.resolution, dict):
        who, choice = record.resolution.get("answered_by"), record.resolution.get("choice")
        return f"resolved by {who or 'nobody named'}'s answer {choice!r}"
    return record.status


def joined_decision(asks: list[HookResult], decisions: list[HookResult]) -> HookResult:
    """One emit's decision from the decisions of its askers' questions.

    Args:
        asks: every ``ask_user`` of the emit, in priority order (`Fold.asks`).
        decisions: the decisions of the first ``len(decisions)`` of them, asked one after
            the other; the last is a deny or every ask was allowed.
    Returns:
        One asker: its decision. Several: amplifier-core's shape, the first ask's fields
        (as amplifier-core returns the first ``ask_user``). A deny: ``decided_by`` the
        handler whose question was refused, `reason` and ``approved_by`` of that refusal,
        the first ask's own data (a deny keeps it). Every question allowed: continue with
        the chained data, ``decided_by`` the first asker, the reasons as ``"<handler>:
        <reason>"`` joined by ``"; "``, ``approved_by`` every approver who allowed one (in
        order, once each, joined by ``", "``; None when grants allowed them all).
    """
    first, last = decisions[0], decisions[-1]
    if len(asks) == 1 or (len(decisions) == 1 and last.action != "continue"):
        return last
    if last.action != "continue":
        return msgspec.structs.replace(
            first, action="deny", data=asks[0].data, reason=last.reason,
            decided_by=last.decided_by, approved_by=last.approved_by, failures=last.failures,
        )  # fmt: skip
    approvers = list(dict.fromkeys(d.approved_by for d in decisions if d.approved_by))
    return msgspec.structs.replace(
        first,
        reason="; ".join(f"{d.decided_by}: {d.reason}" for d in decisions),
        approved_by=", ".join(approvers) or None,
        failures=last.failures,
    )
