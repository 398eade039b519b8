"""Reply subjects on a long-lived wildcard inbox (pure, no I/O).

A requester subscribes once to ``<prefix>.*`` (``prefix`` from ``nc.new_inbox()``) and
gives each request the reply subject ``<prefix>.<token>``; the token says which request a
reply answers. The dispatcher's remote handler calls and chain requests (`Requester`) and
its emit_and_collect (`Router`) each keep such an inbox. The subject is the request's NATS
reply subject, which a responder answers as given: no wire contract of its own.
"""

from __future__ import annotations

__all__ = ["inbox_reply_subject"]


def inbox_reply_subject(inbox_prefix: str, token: str) -> str:
    """``<inbox_prefix>.<token>``: the reply subject of one request on a long-lived
    wildcard inbox (`token` ``"*"`` gives the inbox's subscription subject)."""
    return f"{inbox_prefix}.{token}"
