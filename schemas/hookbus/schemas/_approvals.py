"""Wire types of approval grants ("Allow always"), kept in `APPROVALS_BUCKET`.

A grant is stored under `grant_key` (agent, session, event, handler, tool) when a human
answers an approval with "Allow always" for a call that carries a session id. It allows
every later call of that tool, whatever its input, by the same agent in the same session,
when the same handler of the same event asks again; it lasts the bucket's TTL (24 h by
default) or until revoked.
"""

from __future__ import annotations

from ._types import _Wire

__all__ = ["ApprovalGrant"]


class ApprovalGrant(_Wire):
    """One "Allow always" grant. Its key is ``grant_key(agent_id, session_id, event,
    handler, tool)``; a value that does not match its key is refused by the readers."""

    session_id: str
    """The session it is remembered for (never empty: no session, no grant)."""
    event: str
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
