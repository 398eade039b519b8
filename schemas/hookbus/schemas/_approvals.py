"""Wire types of approvals: the metadata of an approval suspension, and the grants ("Allow
always") kept in `APPROVALS_BUCKET`.

A grant is stored under `grant_key` (agent, session, event, handler, tool) by the
dispatcher that decided an approval, when an approver answered it with an allowing "Allow
always" for a call that carries a session id. It allows every later call of that tool,
whatever its input, by the same agent in the same session, when the same handler of the
same event asks again, until its `ApprovalGrant.expires_at` (24 h after the answer by
default) or until revoked; each use checks it against the approval and the approver's
proof it names.
"""

from __future__ import annotations

from typing import Literal

from ._types import _Wire

__all__ = ["ApprovalGrant", "ApprovalMetadata"]


class ApprovalGrant(_Wire):
    """One "Allow always" grant. Its key is ``grant_key(agent_id, session_id, event,
    handler, tool)``; a value that does not match its key is refused by the readers."""

    session_id: str
    """The session it is remembered for (never empty: no session, no grant)."""
    event: str
    """The event whose handler asked."""
    handler: str
    """The handler that asked (with `event`, the handler's identity)."""
    agent_id: str | None = None
    """The agent whose calls it allows (None: calls that carry no agent id)."""
    tool: str | None = None
    """The tool it allows, for every input (None: calls that name no tool)."""
    choice: str = ""
    """The option the human chose (e.g. ``"Allow always"``)."""
    label: str = ""
    """The label of the approval that granted it."""
    granted_at: float = 0.0
    """Seconds since the Unix epoch."""
    approved_by: str = ""
    """The approver whose answer proof (``<agent>.<label>.<approved_by>`` in the approvals
    bucket) granted it."""
    expires_at: float | None = None
    """Seconds since the Unix epoch after which it allows nothing (a grant without it
    allows nothing either)."""


class ApprovalMetadata(_Wire, omit_defaults=False):
    """The `SuspensionRecord.metadata` of an approval (a record whose label starts with
    ``approval:``): what a dispatcher asks when a handler answers ``ask_user``. The
    dispatcher writes every key (``null`` included); an approver shows `prompt` and
    `options` and answers with an `ApprovalAnswer`.

    Source of the fields: amplifier-core's `HookResult` ``approval_prompt``,
    ``approval_options``, ``approval_timeout`` and ``approval_default``.
    """

    kind: Literal["approval"]
    """Always ``"approval"`` (other suspensions carry the metadata their waiter chose)."""
    prompt: str
    """The question (`HookResult.approval_prompt`, else ``"Allow <tool> (<event>)?"``)."""
    options: list[str]
    """The choices offered (`HookResult.approval_options`, default ``["Allow", "Deny"]``):
    the answer's `ApprovalAnswer.choice` must be one of them."""
    allow_options: list[str]
    """The options that allow the call (`HookResult.approval_allow_options` among
    `options`, else the options starting with "allow", any case); every other option
    denies. Never empty: options of which none allows are denied without asking."""
    timeout_s: float | None
    """Seconds the approval waits from its creation before `default` applies (clamped to
    7 days); None: no limit."""
    default: Literal["allow", "deny"]
    """The decision when `timeout_s` runs out unanswered (`HookResult.approval_default`)."""
    handler: str
    """The handler that asked."""
    event: str
    """The emitted event."""
    tool_name: str | None
    """``data["tool_name"]`` of the call; None when it named no tool."""
    session_id: str | None
    """The call's session; None when it had none (then "Allow always" allows this call only)."""
    agent_id: str | None
    """The agent the call was made for; None when it had none."""
