"""The "Allow always" grants in `APPROVALS_BUCKET`: find, store, list and revoke them.

A grant is stored under `grant_key` (agent, session, event, handler, tool) by the dispatcher
that applied an approver's allowing "Allow always" answer, with its lineage (the approval's
label, the approver, its expiry); the rules of when one allows, and how it is verified
again each time it is used, are `hookbus.dispatcher._approvals`'s. Here: its storage only.
The bucket also holds approval records (two-token keys) and answer proofs (three): a
listing takes the five-token keys only.
"""

from __future__ import annotations

import builtins
import logging

import nats.js.errors
from nats.js.kv import KeyValue

from hookbus._core.consumers import watch_keys
from hookbus._core.kv import kv_retry, release_consumer
from hookbus.schemas import (
    ApprovalGrant,
    HookbusError,
    decode,
    encode,
    grant_key,
    parse_grant_key,
)

__all__ = ["Grants", "is_grant_key"]

log = logging.getLogger("hookbus.dispatcher")


class Grants:
    """The "Allow always" grants in `APPROVALS_BUCKET` (see the module docstring).

    Args:
        kv: the approvals bucket.
    """

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def find(
        self, agent_id: str | None, session_id: str, event: str, handler: str, tool: str | None,
        *, budget_s: float,
    ) -> ApprovalGrant | None:  # fmt: skip
        """The grant for this scope, or None (none, or a value that does not match its key).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
            BadRequestError: the scope cannot be a key (too long).
        """
        key = grant_key(agent_id, session_id, event, handler, tool)

        async def get() -> bytes | None:
            try:
                entry = await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:  # also deleted (revoked)
                return None
            return entry.value or None

        value = await kv_retry(get, deadline_s=budget_s, what=f"reading grant {key}")
        return None if value is None else self._valid(key, value)

    async def put(self, grant: ApprovalGrant, *, budget_s: float) -> None:
        """Store `grant` (idempotent).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
            BadRequestError: no session id, or the scope is too long for a key.
        """
        key = self.key(grant)
        await kv_retry(
            lambda: self._kv.put(key, encode(grant)), deadline_s=budget_s, what=f"storing {key}"
        )

    @staticmethod
    def key(grant: ApprovalGrant) -> str:
        """The `grant_key` of `grant`."""
        return grant_key(grant.agent_id, grant.session_id, grant.event, grant.handler, grant.tool)

    async def list(
        self, *, agent_id: str | None = None, session_id: str | None = None,
        event: str | None = None, handler: str | None = None, tool: str | None = None,
        budget_s: float = 15.0,
    ) -> builtins.list[ApprovalGrant]:  # fmt: skip
        """Every live grant matching the filters (None matches anything), oldest first.

        A value that does not decode or does not match its key is skipped and logged.

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
        """
        wanted = {"agent_id": agent_id, "session_id": session_id, "event": event,
                  "handler": handler, "tool": tool}  # fmt: skip
        grants = [
            g for g in await kv_retry(self._read_all, deadline_s=budget_s, what="listing grants")
            if all(v is None or getattr(g, k) == v for k, v in wanted.items())
        ]  # fmt: skip
        return sorted(grants, key=lambda g: g.granted_at)

    async def revoke(self, grant: ApprovalGrant | str, *, budget_s: float = 15.0) -> None:
        """Revoke one grant (an `ApprovalGrant` or its key); revoking none is no error.

        Raises:
            BadRequestError: `grant` is a string that is not a grant key.
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
        """
        key = grant if isinstance(grant, str) else self.key(grant)
        parse_grant_key(key)  # a foreign key is refused, not deleted
        await kv_retry(lambda: self._kv.delete(key), deadline_s=budget_s, what=f"revoking {key}")

    async def _read_all(self) -> builtins.list[ApprovalGrant]:
        watcher = await watch_keys(self._kv, ">", ignore_deletes=True)
        out: builtins.list[ApprovalGrant] = []
        try:
            while True:
                entry = await watcher.updates(timeout=5)
                if entry is None:
                    return out
                if entry.value and is_grant_key(entry.key):  # not a record or a proof
                    grant = self._valid(entry.key, entry.value)
                    if grant is not None:
                        out.append(grant)
        finally:
            await release_consumer(watcher._sub)

    @classmethod
    def _valid(cls, key: str, value: bytes) -> ApprovalGrant | None:
        try:
            grant = decode(value, ApprovalGrant)
            if cls.key(grant) == key:
                return grant
            problem = "it does not match its key"
        except HookbusError as exc:
            problem = str(exc)
        log.warning("ignoring the grant under %r in the approvals bucket: %s", key[:200], problem)
        return None


def is_grant_key(key: str) -> bool:
    """Whether a key of the approvals bucket is a grant's (five tokens), not an approval
    record's (two) or an answer proof's (three)."""
    return key.count(".") == 4
