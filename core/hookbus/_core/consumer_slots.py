"""Consumer slots: the fixed set of JetStream consumer names one identity may create (data
only, no I/O).

NATS cannot limit how many consumers one user creates, and every KV watch or listing
creates one; an identity free to create unnamed consumers could exhaust a stream's (or the
account's) consumer limit and stop every other process's watches ("maximum consumers limit
reached"). A *named* consumer's create request carries its name (and filter) in its
subject, ``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``, so a NATS permission can
allow exactly a few names. Each identity other than the dispatcher service gets
`CONSUMER_SLOTS` names per stream, its *slots* (`slot_names`): it may create, inspect and
delete consumers with those names only, so it holds at most `CONSUMER_SLOTS` consumers on
each stream it may read, and cannot touch another identity's consumers.

A client learns its slots from its connection: hookbus connects every nkey user with the
inbox prefix ``_INBOX_<PUBKEY>`` (see `inbox_prefix`), which `identity_key` reads back. A
connection without that shape (an open development server, a custom inbox prefix) has no
slots and creates consumers as nats-py does.

Slots are taken first come, first served among the processes sharing an identity: a watch
takes the first slot whose name the server does not already hold and releases it (deletes
the consumer) when it ends; a process that dies frees its slots when the server removes
its idle consumers (their inactive threshold, about 30 s). When all are taken, only an
identity allowed unnamed consumers (the dispatcher service) can watch more.
"""

from __future__ import annotations

import re
from typing import Any, Final

__all__ = ["CONSUMER_SLOTS", "identity_key", "slot_names"]

CONSUMER_SLOTS: Final = 8
"""Consumers one identity may hold on each stream it reads. A process holds one per
long-lived watch (the registry, its suspensions) plus one per listing in progress, so a
few processes of one identity fit; the dispatcher service falls back to unnamed consumers
past them."""

_IDENTITY_INBOX: Final = re.compile(r"_INBOX_(U[A-Z2-7]{55})")
"""``_INBOX_<PUBKEY>``: an nkey user's public key is 56 base32 characters starting with U."""

_NAME_OK: Final = re.compile(r"[A-Za-z0-9_-]{1,200}")


def slot_names(public_key: str) -> tuple[str, ...]:
    """The `CONSUMER_SLOTS` consumer names of the identity with nkey `public_key`:
    ``<public_key>_0`` .. ``<public_key>_7``, in the order a client tries them. Valid NATS
    consumer names (no ``.``, ``*``, ``>`` or whitespace), distinct across identities, and
    usable as permission subject tokens
    (``$JS.API.CONSUMER.CREATE.<stream>.<slot>.<filter>``).

    Raises:
        ValueError: `public_key` is empty or has characters a consumer name may not hold.
    """
    if not _NAME_OK.fullmatch(public_key):
        raise ValueError(f"not a usable public key for consumer names: {public_key[:80]!r}")
    return tuple(f"{public_key}_{i}" for i in range(CONSUMER_SLOTS))


def identity_key(nc: Any) -> str | None:
    """The nkey public key connection `nc` is scoped to, or None.

    Read from its inbox prefix (nats-py keeps it in ``nc._inbox_prefix``, bytes or
    bytearray; a str is accepted too) when it has hookbus's identity shape
    ``_INBOX_<PUBKEY>`` (a user public key: ``U`` and 55 base32 characters). Any other
    prefix (nats-py's default ``_INBOX``, a custom one, none at all) gives None: that
    connection has no consumer slots. Never raises.
    """
    prefix = getattr(nc, "_inbox_prefix", None)
    if isinstance(prefix, bytes | bytearray):
        try:
            prefix = bytes(prefix).decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(prefix, str):
        return None
    match = _IDENTITY_INBOX.fullmatch(prefix)
    return match.group(1) if match else None
