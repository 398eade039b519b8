"""Reading a KV record as the stream's leader has it, not as whichever replica answers.

nats-py's ``KeyValue.get`` on a bucket with direct gets (every bucket hookbus makes has
them) sends ``$JS.API.DIRECT.GET.<stream>``, which any replica of the stream answers,
followers included, and a follower keeps answering while it lags. On a replicated bucket a
get may then return an older revision, or "not found", for a record the leader stored and
acknowledged a moment before: a grant revoked still found, a human's answer not yet seen,
a live waiter's lease read as gone. The writes are not at risk (a compare-and-set is
checked by the leader); the decisions taken on such a read are.

`LeaderKeyValue` reads with ``$JS.API.STREAM.MSG.GET.<stream>`` instead, which only the
stream's leader answers (a replica that sees no leader answers 503, which `kv_retry`
retries), for `get` and for the reads nats-py's ``create`` and ``update`` make. Watches
and listings (consumers) are unchanged.

An identity whose NATS user may only get its own keys (an agent on a server securing each
identity: its direct gets are allowed by key, and a message get names its key in the
request body, so it cannot be allowed by key) may not make that request: its stores read
by direct get from the start (`own_keys_only`, `read_from_replicas`), and those reads may
lag the leader (a limit, in ``docs/decisions-under-faults.md`` with the fact and the
tests). An identity refused a leader read otherwise (one issued before hookbus read from
leaders) falls back to direct gets at the first refusal, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from hookbus.schemas import NotPermittedError

__all__ = ["LeaderKeyValue", "direct_allowed", "own_keys_only", "read_from_replicas"]

log = logging.getLogger("hookbus")


def own_keys_only(nc: Any, *, scoped: bool) -> bool:
    """Whether a store of `nc` (a nats-py client) reads with an identity that may only get
    its own keys: a `scoped` store (an agent's) on a server that requires authentication
    (``hookbus auth init`` gives each agent direct gets of its own keys, and no message
    get). Such a store reads with direct gets (`read_from_replicas`)."""
    info = getattr(nc, "_server_info", None) or {}
    return scoped and bool(info.get("auth_required"))


def read_from_replicas(kv: KeyValue) -> KeyValue:
    """Make `kv`'s gets direct gets, answered by any replica (where its stream has them):
    for an identity that may not ask the leader (`own_keys_only`). Returns `kv`."""
    if isinstance(kv, LeaderKeyValue):
        kv._direct = kv._direct_allowed
    return kv


def direct_allowed(kv: KeyValue) -> bool:
    """Whether `kv`'s stream answers direct gets, as far as `kv` knows."""
    if isinstance(kv, LeaderKeyValue):
        return kv._direct_allowed
    return bool(kv._direct)


class LeaderKeyValue(KeyValue):
    """nats-py's `KeyValue` whose reads ask the stream's leader (see the module).

    Args:
        direct_allowed: the stream answers direct gets (its ``allow_direct``): where this
            identity may not ask the leader, reads fall back to them.
        direct: read with direct gets from the start (an identity known to read its own
            keys only).
    """

    def __init__(
        self, name: str, stream: str, pre: str, js: JetStreamContext, *,
        direct_allowed: bool, direct: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(name=name, stream=stream, pre=pre, js=js, direct=direct)
        self._direct_allowed = direct_allowed

    @classmethod
    def of(cls, kv: KeyValue) -> LeaderKeyValue:
        """`kv` (as nats-py opened it: direct gets where the stream has them) reading from
        the leader."""
        return cls(kv._name, kv._stream, kv._pre, kv._js, direct_allowed=direct_allowed(kv))

    @property
    def reads_from_leader(self) -> bool:
        """Whether reads still go to the leader (False once this identity was refused)."""
        return not self._direct

    async def _get(self, key: str, revision: int | None = None) -> KeyValue.Entry:
        if self._direct:
            return await super()._get(key, revision)
        try:
            return await super()._get(key, revision)
        except NotPermittedError:
            if not self._direct_allowed:
                raise
            self._direct = True
            log.warning(
                "bucket %s: this identity may not read from the stream's leader "
                "($JS.API.STREAM.MSG.GET.%s); its gets are direct from here on, answered by "
                "any replica, and one that lags answers an older revision (identities made "
                "by `hookbus auth` since leader reads may: issue this one again)",
                self._name,
                self._stream,
            )
            return await super()._get(key, revision)
