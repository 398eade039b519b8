"""Which names an approver may answer as (pure, no I/O): the console checks the name a
person signs in with, and ``hookbus console --approver`` the one it binds its token to, by
the same rule (`valid_approver`)."""

from __future__ import annotations

from hookbus.schemas import BadRequestError, approval_answer_key

__all__ = ["valid_approver"]


def valid_approver(name: str) -> str | None:
    """Why `name` cannot be an approver's name (None: it can): empty, longer than an
    answer key allows, or with control characters."""
    if not name.strip():
        return "the approver name is empty"
    if name != name.strip() or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "the approver name has surrounding spaces or control characters"
    try:
        approval_answer_key("approval:0", None, name)
    except BadRequestError as exc:
        return f"the approver name is not usable: {exc}"
    return None
