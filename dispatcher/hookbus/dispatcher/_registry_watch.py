"""Keeping the routing table in step with the handler registry bucket.

A KV watch on `HANDLERS_BUCKET` feeds every put and delete into the `RoutingTable`, so an
emit never waits on discovery. A watch can stall for seconds after its server dies, so it
is re-created when it ends or fails, and a full resync runs every `resync_s` seconds as a
backstop.

Every record is validated (`check_declaration`, `check_required`) and bound to its key:
routes are keyed by the (event, name) the *key* encodes and their subjects derived from
it, so a value can neither route elsewhere nor outlive its key. A record that fails is
skipped, logged once and listed in `RegistryWatch.rejected`; it never stops the watch.

The resync is a complete read that sees deletes: one watch of the last value per key
(delete markers included), read up to the stream's last sequence as it was when the read
began. Only a complete read replaces the remote routes, so a declaration deleted while the
watch missed it is gone after the next resync.

On a connection with an identity the watch is a slot consumer (`watch_keys`): ordered like
nats-py's ordered consumer (a message it misses is delivered again from where it was), and
checked every `_CHECK_S` seconds (re-created when its consumer is gone, or when a message
the server delivered never arrived), so a missed declaration is applied within about
twice that, and by the next resync at the latest.

A dispatcher never decides on a registry it does not follow: `RegistryWatch.start` returns
only once the watch is up and has delivered the values present, and raises when it cannot
be (a refusal, such as JetStream's consumer limit of the stream, at once; anything else
once its deadline passed). An empty registry needs no consumer to be read, so without this
a dispatcher whose watch was refused would start with no routes and never see a handler
declared later.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.consumers import watch_keys
from hookbus._core.deadlines import Deadline
from hookbus._core.declarations import check_declaration, check_required
from hookbus._core.kv import is_transient, kv_retry, open_bucket, release_consumer
from hookbus._core.tasks import stop_task
from hookbus.schemas import (
    BadRequestError,
    FailurePolicy,
    HandlerDeclaration,
    HookbusError,
    HookbusTimeoutError,
    RequiredHandler,
    encode,
    parse_registry_key,
    registry_key_kind,
    required_key,
)

from ._route_table import Route, RoutingTable

__all__ = [
    "RegistryRead",
    "RegistryWatch",
    "apply_entry",
    "open_handlers_bucket",
    "read_registry",
    "require_handler",
    "unrequire_handler",
]

log = logging.getLogger("hookbus.dispatcher")

DELETE_OPS = ("DEL", "PURGE")

_CHECK_S = 10.0
"""Seconds between checks of the watch's consumer when it is a slot consumer (re-created
when gone, or when a message the server delivered never arrived)."""


async def open_handlers_bucket(
    nc: NATS, *, replicas: int = 1, deadline_s: float = 30.0
) -> KeyValue:
    """The handlers bucket, created with `handlers_bucket_config` if absent; retried
    through a JetStream leader election for up to `deadline_s` seconds; a bucket with
    another config is used and reported (see `open_bucket`).

    Raises:
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
    """
    return await open_bucket(nc, handlers_bucket_config(replicas=replicas), deadline_s=deadline_s)


async def require_handler(
    nc: NATS,
    event: str,
    name: str,
    *,
    failure_policy: FailurePolicy = "deny",
    priority: int = 0,
    timeout_s: float = 5.0,
    tool_filter: list[str] | None = None,
    bucket_replicas: int = 1,
) -> RequiredHandler:
    """Mark handler `name` as required for `event` (an operator's act): while it has no
    declaration, every emit of `event` calls its derived subject anyway, so its absence is
    judged by `failure_policy` (``deny``: fail closed), never a silent continue.

    Returns:
        The stored `RequiredHandler` (timeout clamped like a declaration's).
    Raises:
        BadRequestError: bad names, timeout, priority or filter (`check_required` bounds).
        HookbusTimeoutError: JetStream stayed unavailable (bucket opening is retried).
    """
    req = RequiredHandler(
        event=event,
        name=name,
        failure_policy=failure_policy,
        priority=priority,
        timeout_s=timeout_s,
        tool_filter=tool_filter,
    )
    key = required_key(event, name)
    req = check_required(key, encode(req))  # the bounds every reader applies
    kv = await open_handlers_bucket(nc, replicas=bucket_replicas)
    await kv.put(key, encode(req))
    return req


async def unrequire_handler(nc: NATS, event: str, name: str) -> bool:
    """Remove the requirement of handler `name` for `event`.

    Returns:
        Whether there was one.
    Raises:
        BadRequestError: bad names.
    """
    key = required_key(event, name)
    kv = await open_handlers_bucket(nc)
    try:
        await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return False
    await kv.delete(key)
    return True


@dataclass
class RegistryRead:
    """One complete (or not) read of the registry bucket."""

    declarations: dict[str, HandlerDeclaration] = field(default_factory=dict)
    """Valid declarations by key."""
    required: dict[str, RequiredHandler] = field(default_factory=dict)
    """Valid required-handler records by key."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Keys of refused records (keys shortened to 200 characters), with the reason."""
    complete: bool = False
    """Whether every key's last value (or delete marker) was seen."""


def _short(key: str) -> str:
    return key if len(key) <= 200 else key[:200] + "..."


def check_record(key: str, value: bytes | None) -> HandlerDeclaration | RequiredHandler:
    """The live record at `key` of the handlers bucket, validated by the check its key's
    kind calls for (`check_declaration`, `check_required`; each parses the key itself).

    Raises:
        BadRequestError: the record is refused.
    """
    if registry_key_kind(key) == "required":
        return check_required(key, value)
    return check_declaration(key, value)


def classify(read: RegistryRead, key: str, value: bytes | None) -> None:
    """Validate one live record into `read` (a bad one goes to `read.rejected`)."""
    try:
        record = check_record(key, value)
    except BadRequestError as exc:
        read.rejected[_short(key)] = str(exc)
        return
    if isinstance(record, RequiredHandler):
        read.required[key] = record
    else:
        read.declarations[key] = record


async def read_registry(kv: KeyValue, *, timeout_s: float = 5.0) -> RegistryRead:
    """Read the last value of every key of the handlers bucket, delete markers included.

    The read is complete when it reached the stream's last sequence as of its start (or,
    failing that, saw as many keys as the stream holds messages: one per key, history 1).

    Raises:
        nats-py errors of the stream info call (the caller retries or keeps its routes).
    """
    read = RegistryRead()
    state = (await kv.status()).stream_info.state
    if state.messages == 0:
        read.complete = True
        return read
    last_seq = state.last_seq
    seen: dict[str, tuple[bytes | None, bool]] = {}
    loop = asyncio.get_running_loop()
    deadline = Deadline.after(timeout_s, loop.time())
    watcher = await watch_keys(kv)
    try:
        while (left := deadline.left(loop.time())) > 0:
            try:
                entry = await watcher.updates(timeout=left)
            except nats.errors.TimeoutError:
                break
            if entry is None:  # nats-py's "initial values done": may come early, not trusted
                continue
            seen[entry.key] = (entry.value, entry.operation in DELETE_OPS)
            if entry.revision >= last_seq:
                read.complete = True
                break
    finally:
        await release_consumer(watcher._sub)
    if not read.complete:  # the last message may have been removed: count the keys instead
        with contextlib.suppress(Exception):
            read.complete = (await kv.status()).stream_info.state.messages == len(seen)
    for key, (value, deleted) in seen.items():
        if not deleted:
            classify(read, key, value)
    return read


class RegistryWatch:
    """Watches the handlers bucket into a routing table. `start` returns once the
    current declarations are loaded; `stop` is idempotent.

    Args:
        kv: the handlers bucket.
        table: the routing table to keep in step.
        resync_s: seconds between complete re-reads.
        read_timeout_s: seconds one complete read may take before it counts as incomplete.
    """

    def __init__(
        self,
        kv: KeyValue,
        table: RoutingTable,
        *,
        resync_s: float = 30.0,
        read_timeout_s: float = 5.0,
    ) -> None:
        self._kv = kv
        self._table = table
        self._resync_s = resync_s
        self._read_timeout_s = read_timeout_s
        self._task: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()
        self._refused: BaseException | None = None
        """Why the first watch failed (set with `_loaded`: the start failed)."""
        self._last_error: BaseException | None = None
        self._stopping = False
        self.rejected: dict[str, str] = {}
        """Keys of the records currently refused, with the reason (reported, not routed)."""
        self.resyncs = 0
        """Complete reads applied so far."""

    async def start(self, *, deadline_s: float = 30.0) -> None:
        """Load the registry (retried through a leader election for `deadline_s` seconds),
        then follow it: returns once the watch is up and delivered the values present.

        Raises:
            HookbusTimeoutError: the registry could not be read, or the watch not started,
                within `deadline_s` (JetStream unavailable).
            HookbusError: JetStream refused the watch (e.g. ``maximum consumers limit
                reached``, the stream's or the server's consumer limit): this dispatcher
                could not follow the registry, so it does not start.
        """
        loop = asyncio.get_running_loop()
        until = Deadline.after(deadline_s, loop.time())
        await kv_retry(self.resync, deadline_s=deadline_s, what="reading the handler registry")
        self._stopping = False
        self._refused = self._last_error = None
        self._loaded.clear()
        self._task = asyncio.create_task(self._run(), name="hookbus-registry-watch")
        try:
            async with asyncio.timeout(until.left(loop.time())):
                await self._loaded.wait()
        except TimeoutError:
            await self.stop()
            raise HookbusTimeoutError(
                f"could not follow the handler registry within {deadline_s:g} s"
                f" ({self._last_error!r}); this dispatcher does not start"
            ) from self._last_error
        if self._refused is not None:
            refused = self._refused
            await self.stop()
            raise HookbusError(
                f"JetStream refused this dispatcher a watch of the handler registry ({refused});"
                " it does not start, since it could not see the handlers declared from now on"
            ) from refused

    async def stop(self) -> None:
        """Stop the watch task. Idempotent; never swallows the caller's own cancellation.

        On Python 3.11 the `asyncio.wait_for` inside nats-py's watcher can swallow a
        cancel, so the task is also told to stop by a flag and cancelled until it ends.
        """
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        await stop_task(task, "registry watch")

    async def resync(self) -> bool:
        """Re-read the whole registry. A complete read replaces every remote route and
        requirement (deletes the watch missed included); an incomplete one only adds.

        Returns:
            Whether the read was complete.
        Raises:
            nats-py errors when the bucket cannot be read at all (routes are kept).
        """
        read = await read_registry(self._kv, timeout_s=self._read_timeout_s)
        self._report(read.rejected)
        if read.complete:
            self._table.replace_remote(read.declarations.values(), read.required.values())
            self.rejected = read.rejected
            self.resyncs += 1
        else:
            log.warning("registry read incomplete; routes only added to until the next resync")
            for decl in read.declarations.values():
                self._table.put_remote(decl)
            for req in read.required.values():
                self._table.put_required(req)
        return read.complete

    def _report(self, rejected: dict[str, str]) -> None:
        for key, reason in rejected.items():
            if self.rejected.get(key) != reason:
                log.warning("ignoring bad record at %r in the handlers bucket: %s", key, reason)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                watcher = await watch_keys(self._kv, check_s=_CHECK_S)
                try:
                    await self._follow(watcher)
                finally:
                    await release_consumer(watcher._sub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # server lost, stream gone: retry, resync meanwhile
                if not self._loaded.is_set():  # never followed yet: `start` decides
                    self._last_error = exc
                    if not is_transient(exc):
                        self._refused = exc
                        self._loaded.set()
                        return
                log.warning("registry watch failed (%s); retrying", exc)
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await self.resync()

    async def _follow(self, watcher: Any) -> None:
        loop = asyncio.get_running_loop()
        next_resync = Deadline.after(self._resync_s, loop.time())
        while not self._stopping:
            try:
                entry = await watcher.updates(timeout=max(0.1, next_resync.left(loop.time())))
            except nats.errors.TimeoutError:
                entry = None
            if next_resync.passed(loop.time()):
                with contextlib.suppress(Exception):
                    await self.resync()
                next_resync = Deadline.after(self._resync_s, loop.time())
            if entry is None:  # end of the initial values, or a quiet period
                self._loaded.set()
                continue
            self.apply(entry.key, entry.value, entry.operation in DELETE_OPS)

    def apply(self, key: str, value: bytes | None, deleted: bool) -> None:
        """Apply one change of the bucket: the route or requirement at `key` follows it.
        A refused value removes what the key had (it is no longer a valid declaration)."""
        apply_entry(self._table, self.rejected, self._report, key, value, deleted)


RECORDS_CACHED: Final = 64
"""Changes whose checked route is kept, by (key, value bytes). A process running many
dispatchers (a multi-session agent server, the fleet benchmark) checks each change of the
registry once instead of once per dispatcher: a record's route is a function of its key and
bytes, and a `Route` is immutable."""


@functools.lru_cache(maxsize=RECORDS_CACHED)
def _parsed_key(key: str) -> tuple[str, str, str]:
    return parse_registry_key(key)


@functools.lru_cache(maxsize=RECORDS_CACHED)
def record_route(key: str, value: bytes) -> Route:
    """The route of a live record of the handlers bucket at `key` (a handler key or a
    required-handler key): the declaration's, or a required handler's stand-in; cached
    (`RECORDS_CACHED`).

    Raises:
        BadRequestError: the record is refused (`check_declaration`, `check_required`).
    """
    record = check_record(key, value)
    if isinstance(record, RequiredHandler):
        return Route.from_required(record)
    return Route.from_declaration(record)


def apply_entry(
    table: RoutingTable,
    rejected: dict[str, str],
    report: Callable[[dict[str, str]], None],
    key: str,
    value: bytes | None,
    deleted: bool,
) -> None:
    """Apply one change of the handlers bucket to `table`: the route or requirement at
    `key` follows it; a refused value removes what the key had (`report`ed and kept in
    `rejected`, by key)."""
    try:
        kind, event, name = _parsed_key(key)
    except BadRequestError:
        log.warning("ignoring foreign key %r in the handlers bucket", _short(key))
        return
    required = kind == "required"
    drop = table.delete_required if required else table.delete_remote
    rejected.pop(_short(key), None)
    if deleted or value is None:
        drop(event, name)
        return
    try:
        route = record_route(key, bytes(value))
    except BadRequestError as exc:
        refused = {_short(key): str(exc)}
        report(refused)
        rejected.update(refused)
        drop(event, name)
        return
    table.put_route(route, required=required)
