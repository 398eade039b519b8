"""Waiting on suspension records at fleet scale: one shared watch per process, and leases.

- `SharedWatch`: one ordered consumer on the suspensions bucket's stream (deliver new,
  filtered in memory by key) feeds every waiter of the process, so the number of JetStream
  consumers per process stays constant however many hooks wait. It starts with the first
  waiter, is checked every few seconds and re-created after a lost server (a lost
  consumer), and is backed by a periodic read of the waited-on keys, a bounded batch per
  period (round robin), plus a read of every one of them after the watch was re-created.
  One supervised task does the checks and reads: an unexpected error in it is logged and
  it starts again after a backoff (0.1 s doubling to 10 s), so the watch never dies
  silently. It also remembers the last value it saw of the most recent keys (`recent`,
  at most `RECENT_KEYS`), waited on or not: a resolver in the process compare-and-sets on
  that revision instead of reading the key first (a stale one only fails the
  compare-and-set, and the resolver reads then).
- `Leases`: a waiter's record names its process's waiter id (``owner``); the process keeps
  ONE lease key alive in `LEASES_BUCKET` (put every lease/3 seconds) whose max age is the
  lease. Once the key is gone (expired by the server's clock; no host clock is compared) the
  owner is dead, and a new ``hook(label)`` may take its record over. The same heartbeat
  keeps the process's run claims alive (`Leases.claim`: one key per run in progress,
  created atomically, so one process runs a run id at a time); each is rewritten just
  before the lease, so a dead process's claims lapse no later than its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from hookbus._core.buckets import leases_bucket_config
from hookbus._core.kv import (
    is_transient,
    kv_retry,
    open_bucket,
    release_consumer,
    stream_sequence,
    subscribe_keys,
)
from hookbus._core.leader_reads import read_from_replicas
from hookbus._core.tasks import stop_task
from hookbus.schemas import (
    HookbusTimeoutError,
    SuspensionRecord,
    lease_key,
)

from ._records import Entry, RecordStore, is_record_key, parse_record

__all__ = ["RECENT_KEYS", "Leases", "SharedWatch", "Slot"]

log = logging.getLogger("hookbus.dispatcher")

_MARKER_REASON = "Nats-Marker-Reason"

RECENT_KEYS = 4096
"""Keys whose last delivered value a `SharedWatch` keeps (least recently written dropped)."""

RESTART_BACKOFF_S = (0.1, 10.0)
"""Seconds a `SharedWatch` waits before starting again after an unexpected error: the
first wait, doubled after each error in a row, up to the second."""

_HEALTHY_S = 60.0
"""Seconds a watch ran without an error after which the backoff starts over."""


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a shared task's exception retrieved (its waiters may all have left)."""
    if not task.cancelled():
        task.exception()


class Slot:
    """What one waiter sees of its key: the latest entry delivered by the watch or a read
    (None once the record is removed), and an event set at each change."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.latest: Entry | None = None
        self.removed = False
        self.version = 0
        self.armed = False
        self._changed = asyncio.Event()

    def push(self, entry: Entry | None, *, version: int | None = None) -> None:
        """A newer state of the key (None: removed). `version`: the slot version a read
        started at; the read is dropped if anything was delivered since."""
        if version is not None and version != self.version:
            return
        if entry is None:
            if not self.armed or self.removed:
                return
            self.removed = True
        else:
            if self.latest is not None and entry.revision <= self.latest.revision:
                return
            self.latest, self.removed = entry, False
        self.version += 1
        self._changed.set()

    def arm(self, entry: Entry) -> None:
        """The waiter's own write: later deliveries are compared with it."""
        self.push(entry)
        self.armed = True

    async def changed(self, timeout_s: float | None) -> None:
        """Wait for a change (or `timeout_s` seconds); clears the flag."""
        if not self._changed.is_set() and timeout_s is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait()
        elif not self._changed.is_set():
            await self._changed.wait()
        self._changed.clear()


class SharedWatch:
    """The process's one watch on the suspensions bucket (see the module docstring).

    Args:
        records: the record store (its bucket is watched).
        poll_s: seconds between the backing reads.
        poll_batch: keys read per period (each waited-on key is read at least every
            ``ceil(waiters / poll_batch) * poll_s`` seconds).
        check_s: seconds between checks that the watch's consumer still exists
            (independent of `poll_s`).
    """

    def __init__(
        self,
        records: RecordStore,
        *,
        poll_s: float = 1.0,
        poll_batch: int = 256,
        check_s: float = 5.0,
    ) -> None:
        self._records = records
        self._poll_s = poll_s
        self._batch = poll_batch
        self._check_s = check_s
        self._slots: dict[str, set[Slot]] = {}
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._sweep = False
        self._recheck = False
        self._cursor = 0
        self._recent: dict[str, Entry | None] = {}
        self._proofs: dict[str, set[asyncio.Event]] = {}

    def listen_proofs(self, key: str) -> asyncio.Event:
        """An event set each time the watch delivers an answer proof of the record `key`
        (``<key>.<approver>``); `unlisten_proofs` when done. A proof written while the
        watch was down is not signalled: the listener reads the proofs itself too."""
        event = asyncio.Event()
        self._proofs.setdefault(key, set()).add(event)
        return event

    def unlisten_proofs(self, key: str, event: asyncio.Event) -> None:
        events = self._proofs.get(key)
        if events is not None:
            events.discard(event)
            if not events:
                del self._proofs[key]

    @property
    def consumers(self) -> int:
        """JetStream consumers this watch holds (0 or 1)."""
        return 0 if self._sub is None else 1

    @property
    def started(self) -> bool:
        """Whether the watch is subscribed (its deliveries feed `recent`)."""
        return self._sub is not None

    def recent(self, key: str) -> Entry | None:
        """The last value the watch delivered for `key` (parsed when delivered: a resolver
        finds it ready), or None when it saw none, or a delete: a hint for a
        compare-and-set, never an authoritative read."""
        return self._recent.get(key) if self._sub is not None else None

    def register(self, key: str) -> Slot:
        slot = Slot(key)
        self._slots.setdefault(key, set()).add(slot)
        return slot

    def unregister(self, slot: Slot) -> None:
        slots = self._slots.get(slot.key)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self._slots[slot.key]

    async def start(self) -> None:
        """Subscribe (once) and start the supervised checks and backing reads (again, if
        they ever ended). Raises what subscribing raises (the caller retries through an
        outage)."""
        if self._sub is not None and self._running():
            return
        # one start at a time, shared by every waiter arriving meanwhile: a waiter whose
        # own budget ends leaves it running for the others (not restarted once per waiter)
        if self._starting is None or self._starting.done():
            self._starting = asyncio.get_running_loop().create_task(self._start())
            self._starting.add_done_callback(_retrieve)
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        if self._sub is None:
            await self._subscribe()
        if not self._running():
            self._task = asyncio.get_running_loop().create_task(self._supervise())

    def _running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():  # a failed one told its waiters
            await stop_task(starting, "the suspension watch's start")
        task, self._task = self._task, None
        await stop_task(task, "the suspension watch's reads")
        await self._unsubscribe()

    # -- the watch -------------------------------------------------------------------------
    async def _subscribe(self) -> None:
        kv: Any = self._records.kv
        self._prefix = kv._pre
        self._sub = await subscribe_keys(
            kv,
            self._records.keys,
            cb=self._on_msg,
            deliver_policy=DeliverPolicy.NEW,
            inactive_threshold_s=max(30.0, 6 * self._check_s),
        )

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        self._recent.clear()  # what it missed while down is unknown
        if sub is not None:
            await release_consumer(sub)

    async def _on_msg(self, msg: Any) -> None:
        key = msg.subject[len(self._prefix) :]
        if not is_record_key(key):  # a proof (its record's listeners hear of it) or a grant
            if key.count(".") == 2:
                for event in self._proofs.get(key.rpartition(".")[0], ()):
                    event.set()
            return
        headers = msg.headers
        deleted = headers is not None and (
            headers.get(KV_OP) in (KV_DEL, KV_PURGE) or _MARKER_REASON in headers
        )
        revision = stream_sequence(msg)
        slots = self._slots.get(key)
        entry = None
        if not deleted:  # a waiter's record is validated and reported; others only parsed
            entry = self._records.entry(key, msg.data, revision) if slots else None
            if entry is None:
                parsed = parse_record(key, msg.data)
                if isinstance(parsed, SuspensionRecord):
                    entry = Entry(revision, parsed)
        recent = self._recent
        recent.pop(key, None)  # insertion order is write order: the oldest goes first
        recent[key] = entry if entry is not None and entry.record is not None else None
        if len(recent) > RECENT_KEYS:
            del recent[next(iter(recent))]
        if not slots:
            return
        for slot in list(slots):
            slot.push(entry)

    # -- the backing reads -------------------------------------------------------------------
    async def _supervise(self) -> None:
        """Run `_poll_loop` until cancelled: after an unexpected error, log it, wait
        (`RESTART_BACKOFF_S`), and start again with a check of the consumer at once."""
        errors = 0
        while True:
            began = time.monotonic()
            try:
                await self._poll_loop()
            except Exception:
                errors = 1 if time.monotonic() - began > _HEALTHY_S else errors + 1
                first, most = RESTART_BACKOFF_S
                delay = min(most, first * 2 ** (errors - 1))
                log.exception("suspension watch failed; restarting it in %.1f s", delay)
                await asyncio.sleep(delay)
                self._recheck = True

    def _tick_s(self) -> float:
        return max(0.01, min(self._poll_s, self._check_s))

    async def _poll_loop(self) -> None:
        """While anyone waits: check the consumer every `check_s` seconds (every tick while
        it is missing), and read a batch of the waited-on keys every `poll_s` seconds
        (every one of them right after the watch was re-created). Never returns."""
        now = time.monotonic()
        next_check, next_read = now + self._check_s, now + self._poll_s
        while True:
            await asyncio.sleep(self._tick_s())
            if not self._slots:
                continue
            now = time.monotonic()
            if self._sub is None or self._recheck or now >= next_check:
                self._recheck = False
                next_check = now + self._check_s
                await self._check()
            if self._sweep or now >= next_read:
                next_read = now + self._poll_s
                await self._read_batch()

    async def _read_batch(self) -> None:
        """Read the next `poll_batch` waited-on keys (all of them after a re-created watch).
        The waiters may all have left meanwhile (during the check): nothing to read then."""
        keys = list(self._slots)
        if not keys:
            return
        if self._sweep:
            self._sweep = False
            batch = keys
        else:
            start = self._cursor % len(keys)
            batch = list(itertools.islice(itertools.cycle(keys), start, start + self._batch))
            batch = list(dict.fromkeys(batch))
            self._cursor = start + len(batch)
        limit = asyncio.Semaphore(64)
        await asyncio.gather(*(self._read(key, limit) for key in batch))

    async def _check(self) -> None:
        """Re-create the watch if its consumer is gone (a lost or restarted server)."""
        try:
            if self._sub is not None:
                await self._sub.consumer_info()
                return
        except nats.js.errors.NotFoundError:
            log.info("suspension watch lost its consumer; re-creating it")
        except Exception as exc:  # an outage: the reads carry on; re-create when it ends
            log.info("suspension watch check failed (%r); re-creating it", exc)
        await self._unsubscribe()
        try:
            await self._subscribe()
        except Exception as exc:
            log.info("suspension watch could not be re-created yet (%r)", exc)
            return
        self._sweep = True  # what changed while it was down is read back

    async def _read(self, key: str, limit: asyncio.Semaphore) -> None:
        slots = self._slots.get(key)
        if not slots:
            return
        versions = {slot: slot.version for slot in slots}
        async with limit:
            try:
                entry = await self._records.read_key(key, deadline_s=max(self._poll_s, 1.0))
            except Exception as exc:
                log.debug("backing read of %s failed: %r", key[:80], exc)
                return
        for slot, version in versions.items():
            slot.push(entry, version=version)


_CLAIM_TRIES = 10
"""Tries of `Leases.claim` when the key keeps changing under it (released, lapsed)."""


class _Claim:
    """A run claim this process holds: the revision of its last write (None once lost to
    a lapse) and how many run blocks of the process hold it."""

    __slots__ = ("holders", "revision")

    def __init__(self, revision: int) -> None:
        self.revision: int | None = revision
        self.holders = 1


class Leases:
    """This process's waiter lease and run claims (see the module docstring).

    Args:
        kv: the leases bucket (its max age is the lease).
        lease_s: the bucket's max age in seconds; the heartbeat puts every third of it.
        reopen: opens (creating it if absent) the leases bucket again: called when a lease
            write finds no stream (the bucket was lost, e.g. a memory bucket an older
            hookbus made, at a server restart); None: such a write only fails.
    """

    def __init__(
        self,
        kv: KeyValue,
        *,
        lease_s: float,
        reopen: Callable[[], Awaitable[KeyValue]] | None = None,
    ) -> None:
        self.kv = kv
        self.lease_s = lease_s
        self._reopen = reopen
        self.waiter_id = uuid.uuid4().hex
        self._key = lease_key(self.waiter_id)
        self._last_put = -float("inf")
        self._task: asyncio.Task[None] | None = None
        self._claims: dict[str, _Claim] = {}
        self._claims_lock = asyncio.Lock()
        self._put_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()

    @classmethod
    async def open(
        cls, nc: NATS, *, lease_s: float = 15.0, replicas: int = 1, js_domain: str | None = None,
        own_keys: bool = False,
    ) -> Leases:  # fmt: skip
        """Open (or create) `LEASES_BUCKET` (in the JetStream domain `js_domain`; None: the
        one bound to `nc`, else the connection's own); an existing bucket's max age is the
        lease. Leases and claims are read from the stream's leader, or with `own_keys`
        (an identity that may get only its own keys: `own_keys_only`) by direct gets.

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
            JetStreamDomainError: see `open_bucket`.
        """
        config = leases_bucket_config(lease_s=lease_s, replicas=replicas)

        async def opened(deadline_s: float) -> KeyValue:
            kv = await open_bucket(nc, config, js_domain=js_domain, deadline_s=deadline_s)
            return read_from_replicas(kv) if own_keys else kv

        kv = await opened(30.0)
        with contextlib.suppress(Exception):
            status = await kv.status()
            age = status.stream_info.config.max_age
            if age:
                lease_s = float(age)

        async def reopen() -> KeyValue:
            return await opened(lease_s)

        return cls(kv, lease_s=lease_s, reopen=reopen)

    async def ensure(self) -> None:
        """Make sure the lease is alive now and the heartbeat runs.

        Raises:
            HookbusTimeoutError: the lease could not be written within one lease.
        """
        if time.monotonic() - self._last_put > self.lease_s / 2:
            async with self._put_lock:  # waiters arriving at once share one write
                if time.monotonic() - self._last_put > self.lease_s / 2:
                    await kv_retry(
                        self._put, deadline_s=self.lease_s, what="writing the waiter lease"
                    )
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def alive(self, owner: str) -> bool:
        """Whether the process `owner` still holds its lease (an unreadable lease counts
        as alive: a record is never taken from a live waiter by accident)."""
        if not owner:
            return False
        if owner == self.waiter_id:
            return True
        try:
            await kv_retry(
                lambda: self.kv.get(lease_key(owner)), deadline_s=5.0, what="reading a lease"
            )
        except nats.js.errors.KeyNotFoundError:
            return False
        except Exception as exc:
            log.info("lease of %s unreadable (%r); counted alive", owner, exc)
        return True

    # -- run claims -------------------------------------------------------------------------
    async def claim(self, key: str) -> str | None:
        """Claim `key` (a `run_claim_key`) for this process: create it with this waiter id
        (atomically: of two processes one wins) and keep it alive with the lease's
        heartbeat until `release`. A claim this process already holds is held once more
        (each hold needs its `release`).

        Returns:
            None when this process holds the claim now, else the waiter id of the live
            process that holds it (a claim exists only while its owner's heartbeat
            rewrites it: a dead owner's lapses one lease after its last write).
        Raises:
            HookbusTimeoutError: the bucket stayed unavailable for one lease, or the key
                kept changing under the claim.
        """
        await self.ensure()
        task = asyncio.ensure_future(self._claim(key))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # the claim may still land: give it back then
            self._in_background(self._undo_claim(key, task))
            raise

    async def release(self, key: str) -> None:
        """Hold the claim `key` once less; at the last hold, delete it if it is still this
        process's (else it is left to lapse). Runs to its end even if the caller is
        cancelled meanwhile; never raises for a failed delete (the claim then lapses one
        lease later)."""
        await asyncio.shield(self._in_background(self._release(key)))

    def _in_background(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _claim(self, key: str) -> str | None:
        value = self.waiter_id.encode()
        lease_s = self.lease_s
        async with self._claims_lock:
            held = self._claims.get(key)
            if held is not None and held.revision is not None:
                held.holders += 1
                return None
            for _ in range(_CLAIM_TRIES):
                try:
                    revision = await kv_retry(
                        lambda: self.kv.create(key, value),
                        deadline_s=lease_s,
                        what="claiming a run",
                    )
                except nats.js.errors.KeyNotFoundError:
                    # nats-py's create reads the key after the server refused the write as
                    # not new; that read finds nothing if the claim lapsed in between
                    continue  # lapsed meanwhile: create it again
                except nats.js.errors.KeyWrongLastSequenceError:
                    try:
                        entry = await kv_retry(
                            lambda: self.kv.get(key), deadline_s=lease_s, what="reading a run claim"
                        )
                    except nats.js.errors.KeyNotFoundError:
                        continue  # released or lapsed meanwhile: create it again
                    if entry.value != value:
                        return (entry.value or b"").decode(errors="replace") or "unknown"
                    try:  # ours (a create whose ack was lost, or a lost claim): take it
                        revision = await kv_retry(
                            functools.partial(self.kv.update, key, value, last=entry.revision),
                            deadline_s=lease_s,
                            what="taking a run claim back",
                        )
                    except nats.js.errors.KeyWrongLastSequenceError:
                        continue
                if held is not None:  # it had been lost to a lapse: held again
                    held.revision, held.holders = revision, held.holders + 1
                else:
                    self._claims[key] = _Claim(revision)
                # the lease is written after the claim, so the claim lapses no later
                await kv_retry(self._put, deadline_s=self.lease_s, what="writing the waiter lease")
                return None
        raise HookbusTimeoutError(f"claiming {key[:120]}: the key kept changing under it")

    async def _undo_claim(self, key: str, task: asyncio.Task[str | None]) -> None:
        with contextlib.suppress(BaseException):
            if await task is None:
                await self._release(key)

    async def _release(self, key: str) -> None:
        async with self._claims_lock:
            held = self._claims.get(key)
            if held is None:
                return
            held.holders -= 1
            if held.holders > 0:
                return
            del self._claims[key]
            if held.revision is not None:
                await self._delete_claim(key, held.revision)

    async def _delete_claim(self, key: str, revision: int) -> None:
        """Delete the claim `key` if its last write is still `revision` (ours)."""
        try:
            await kv_retry(
                lambda: self.kv.delete(key, last=revision),
                deadline_s=self.lease_s / 3,
                what="releasing a run claim",
            )
        except Exception as exc:  # changed meanwhile (not ours), or unreachable: it lapses
            log.info("run claim %s not deleted (%r); it lapses in one lease", key[:120], exc)

    async def _renew_claims(self) -> None:
        """Rewrite every claim this process holds (compare-and-set on its last write)."""
        if not self._claims:
            return
        value = self.waiter_id.encode()
        async with self._claims_lock:
            for key, held in list(self._claims.items()):
                if held.revision is None:
                    continue
                try:
                    held.revision = await self.kv.update(key, value, last=held.revision)
                    continue
                except nats.js.errors.KeyWrongLastSequenceError as exc:
                    if is_transient(exc):  # the last rewrite still in flight: next beat
                        continue
                try:  # an earlier rewrite landed unseen, or the claim lapsed meanwhile
                    entry = await self.kv.get(key)
                except nats.js.errors.KeyNotFoundError:
                    entry = None
                try:
                    if entry is None:
                        held.revision = await self.kv.create(key, value)
                        continue
                    if entry.value == value:
                        held.revision = await self.kv.update(key, value, last=entry.revision)
                        continue
                except nats.js.errors.KeyWrongLastSequenceError as exc:
                    if is_transient(exc):
                        continue
                held.revision = None
                log.warning(
                    "run claim %s lapsed and another process claimed it: that process may"
                    " run the same run", key[:120],
                )  # fmt: skip

    async def close(self) -> None:
        task, self._task = self._task, None
        claims, self._claims = self._claims, {}
        if task is not None:
            await stop_task(task, "the lease heartbeat")
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    for key, held in claims.items():
                        if held.revision is not None:
                            await self.kv.delete(key, last=held.revision)
                    await self.kv.delete(self._key)

    async def _put(self) -> None:
        try:
            await self.kv.put(self._key, self.waiter_id.encode())
        except nats.js.errors.NoStreamResponseError:
            if self._reopen is None:
                raise
            self.kv = await self._reopen()  # the bucket was lost: made again (file storage)
            await self.kv.put(self._key, self.waiter_id.encode())
        self._last_put = time.monotonic()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:  # the claims first: a claim never outlives the lease
                async with asyncio.timeout(self.lease_s / 6):
                    await self._renew_claims()
            except Exception as exc:  # never let the heartbeat die silently
                log.warning("run claim heartbeat failed: %r", exc)
            try:
                async with asyncio.timeout(self.lease_s / 3):
                    await self._put()
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                log.warning("waiter lease heartbeat failed: %r", exc)
            except Exception as exc:  # never let the heartbeat die silently
                log.warning("waiter lease heartbeat failed: %r", exc)
