"""The console's live feed: what changes in the approvals bucket, and new audit trail
records, fanned out to every open page (server-sent events).

One process holds one feed, whatever the number of pages:

- a KV watch of ``hookbus_approvals`` (an ordered consumer delivering new writes only):
  every write of an approval record (``<agent>.<label>``) becomes an ``approval`` event
  with the record as the page shows it (`approval_item`), so a new pending approval
  reaches the page as soon as JetStream delivers it; a deleted record becomes
  ``approval_removed``; a stored or revoked grant (five tokens) becomes ``grant`` /
  ``grant_removed``; answer proofs (three tokens) are not shown. An ``approval:`` record
  in the suspensions bucket is not an approval and is never shown;
- a subscription to ``hookbus.v1.decisions.*``: each new audit record becomes ``decision``
  (only when the audit trail is on, and this NATS user may hear it).

Each watch's consumer is checked every `check_s` seconds and re-created if it is gone (a
restarted or lost server); every page is then told to reload (``resync``), as is a page
too slow to take its events. A record or grant that does not validate is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from hookbus._core.kv import release_consumer, subscribe_keys
from hookbus._core.nats_guard import harden_connection
from hookbus._core.suspension_records import parse_record
from hookbus.dispatcher import APPROVAL_LABEL_PREFIX
from hookbus.schemas import (
    APPROVALS_BUCKET,
    DECISIONS_WILDCARD,
    ApprovalGrant,
    DecisionRecord,
    HookbusError,
    NotPermittedError,
    SuspensionRecord,
    decode,
    is_answer_key,
    label_from_key,
)

from ._views import approval_item, decision_item, grant_item

__all__ = ["Event", "Feed", "Listener"]

log = logging.getLogger("hookbus.integrations.console")

Event = tuple[str, dict[str, Any]]
"""``(kind, data)``: one server-sent event."""

_MARKER_REASON = "Nats-Marker-Reason"
_RESYNC: Event = ("resync", {})


class Listener:
    """One page's queue of events (bounded: a page that falls behind gets ``resync``)."""

    def __init__(self, size: int) -> None:
        self._queue: asyncio.Queue[Event] = asyncio.Queue(size)

    def put(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(_RESYNC)

    async def get(self, timeout_s: float) -> Event | None:
        """The next event, or None after `timeout_s` seconds without one."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._queue.get()
        except TimeoutError:
            return None


class _Watch:
    """One bucket's watch: new writes to `on_msg`, re-created when its consumer is gone."""

    def __init__(self, nc: NATS, bucket: str, on_msg: Callable[[Msg], Awaitable[None]]) -> None:
        self.nc, self.bucket, self.on_msg = nc, bucket, on_msg
        self.kv: KeyValue | None = None
        self.sub: Any = None

    async def open(self) -> None:
        self.kv = await self.nc.jetstream().key_value(self.bucket)
        self.sub = await subscribe_keys(
            self.kv, ">", cb=self.on_msg, deliver_policy=DeliverPolicy.NEW,
            inactive_threshold_s=60.0,
        )  # fmt: skip

    def key(self, msg: Msg) -> str:
        assert self.kv is not None
        prefix: str = self.kv._pre
        return msg.subject[len(prefix) :]

    async def healthy(self) -> bool:
        """Whether the consumer still exists; if not, try to re-create it."""
        try:
            if self.sub is not None:
                await self.sub.consumer_info()
                return True
        except Exception as exc:
            log.info("the console's watch of %s is gone (%r); re-creating it", self.bucket, exc)
        await self.close()
        with contextlib.suppress(Exception):
            await self.open()
        return False

    async def close(self) -> None:
        sub, self.sub = self.sub, None
        if sub is not None:
            await release_consumer(sub)


def _deleted(msg: Msg) -> bool:
    headers = msg.headers or {}
    return headers.get(KV_OP) in (KV_DEL, KV_PURGE) or _MARKER_REASON in headers


class Feed:
    """The live feed of one console process (see the module docstring).

    Args:
        nc: a connected client that may read both buckets.
        check_s: seconds between checks that the watches' consumers still exist.
        queue_size: events a page may fall behind before it is told to reload.
    """

    def __init__(self, nc: NATS, *, check_s: float = 5.0, queue_size: int = 1000) -> None:
        self._nc = nc
        self._check_s = check_s
        self._queue_size = queue_size
        self._listeners: set[Listener] = set()
        self._approvals = _Watch(nc, APPROVALS_BUCKET, self._on_approvals)
        self._decisions: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the watches and the audit subscription.

        Raises:
            nats.js.errors.Error: a bucket is missing or may not be read (start the
                dispatcher, which creates them, first).
        """
        harden_connection(self._nc)  # the flush below must follow the subscription
        await self._approvals.open()
        self._decisions = await self._nc.subscribe(DECISIONS_WILDCARD, cb=self._on_decision)
        try:
            await self._nc.flush()
        except NotPermittedError as exc:  # this NATS user may not hear the audit trail
            log.info("the console shows no live decisions: %s", exc)
            sub, self._decisions = self._decisions, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._task = asyncio.get_running_loop().create_task(self._check_loop())

    async def close(self) -> None:
        """Stop watching (idempotent); open pages are told to reload."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._approvals.close()
        sub, self._decisions = self._decisions, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def listen(self) -> Listener:
        """A new page's listener (pass it to `unlisten` when the page goes)."""
        listener = Listener(self._queue_size)
        self._listeners.add(listener)
        return listener

    def unlisten(self, listener: Listener) -> None:
        self._listeners.discard(listener)

    @property
    def listeners(self) -> int:
        """Pages listening now."""
        return len(self._listeners)

    def publish(self, event: Event) -> None:
        """Send `event` to every page."""
        for listener in list(self._listeners):
            listener.put(event)

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self._check_s)
            if not await self._approvals.healthy():
                self.publish(_RESYNC)

    async def _on_approvals(self, msg: Msg) -> None:
        key = self._approvals.key(msg)
        if key.count(".") == 4:
            await self._on_grant(key, msg)
            return
        if is_answer_key(key):
            return  # an approver's answer proof
        try:
            label = label_from_key(key)
        except HookbusError:
            return
        if not label.startswith(APPROVAL_LABEL_PREFIX):
            return
        if _deleted(msg):
            self.publish(("approval_removed", {"label": label, "key": key}))
            return
        record = parse_record(key, msg.data)
        if isinstance(record, SuspensionRecord) and record.metadata.get("kind") == "approval":
            self.publish(("approval", approval_item(record)))

    async def _on_grant(self, key: str, msg: Msg) -> None:
        if _deleted(msg):
            self.publish(("grant_removed", {"key": key}))
            return
        try:
            grant = decode(msg.data, ApprovalGrant)
        except HookbusError:
            return
        try:
            item = grant_item(grant)
        except HookbusError:  # a scope too long to be a key
            return
        if item["key"] == key:  # a value that does not match its key is not a grant
            self.publish(("grant", item))

    async def _on_decision(self, msg: Msg) -> None:
        try:
            record = decode(msg.data, DecisionRecord)
        except HookbusError:
            return
        self.publish(("decision", decision_item(record)))
