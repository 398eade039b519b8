"""A handler's registry record written straight into the bucket, as a worker would write it
(`declaration`), for the registry tests that play a careless writer or a lost change."""

from __future__ import annotations

from typing import Any

from hookbus.schemas import (
    HandlerDeclaration,
    collect_subject,
    encode_token,
    handler_subject,
)

__all__ = ["declaration"]


def declaration(event: str, name: str, **options: Any) -> HandlerDeclaration:
    """A declaration of handler `name` on `event` as a worker writes it (its subjects and
    queue group filled in); `options`: the declaration's other fields."""
    return HandlerDeclaration(
        event=event,
        name=name,
        subject=handler_subject(event, name),
        collect_subject=collect_subject(event),
        queue_group=encode_token(name),
        **options,
    )
