"""Following the handler registry without a JetStream consumer: one core subscription.

The handlers bucket's stream republishes every message it stores to
``REGISTRY_CHANGES_WILDCARD`` (`handlers_republish`), with the message's stream sequence
(``Nats-Sequence``). The stream holds the bucket's subjects only, so the sequences of what
it stores are contiguous: a follower that applied sequence ``n`` must see ``n + 1`` next.
A bare subscription on ``$KV.<bucket>.>`` would not do: it sees what writers publish,
including writes the stream refused, and carries no sequence.

`RegistryFollower`:

1. subscribes to the republished changes (and learns at once if this identity may not),
2. asks the stream's leader for its last sequence ``L`` (a stream info),
3. reads a snapshot with direct gets (JetStream's ``$JS.API.DIRECT.GET.<stream>``, a
   *batch* from sequence 1 over the bucket's subjects, paged by `SCAN_BATCH` messages;
   served by any replica of the stream, no consumer), up to the stream's last sequence
   ``S`` as of the last page,
4. applies the changes that arrived meanwhile after ``S``, in order, and from then on each
   change as it comes. If that leaves it below ``L``, the replica that answered was behind
   the leader (any replica answers a direct get, and a follower may lag): the snapshot is
   read again (`SnapshotBehindError`), and until one is as new, the follower is behind.

It is **behind** (`current` is False) from the moment it has evidence that it missed a
change until a new snapshot is applied: a sequence that skips one, the connection lost and
re-established (changes republished meanwhile were not delivered to it), a stream whose
last sequence is ahead of (a change lost at the tail) or behind (the stream was re-created)
what was applied, as a periodic check every `check_s` seconds finds. While behind, the
dispatcher fails closed (`HookDispatcher.emit` denies; see `wait_current`), and the
follower takes a new snapshot, retried every second until one succeeds.

A start that cannot follow the registry raises: this identity may not subscribe or read
(`NotPermittedError`), or the snapshot was not read within the deadline
(`HookbusTimeoutError`).

Cost per dispatcher: one subscription, and at start one stream info and one direct get
per `SCAN_BATCH` records (the per-consumer limit of a stream, 1,000 by default in
nats-server, does not apply). See docs/scaling.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import weakref
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from hookbus._core.deadlines import NEVER, Deadline
from hookbus._core.kv import kv_retry
from hookbus._core.nats_guard import harden_connection
from hookbus._core.tasks import stop_task
from hookbus.schemas import (
    REGISTRY_CHANGES_WILDCARD,
    HookbusError,
    HookbusTimeoutError,
    NotPermittedError,
)

from ._registry_watch import DELETE_OPS, RegistryRead, apply_entry, classify
from ._route_table import RoutingTable

__all__ = ["SCAN_BATCH", "RegistryFollower", "SnapshotBehindError", "scan_bucket"]

log = logging.getLogger("hookbus.dispatcher")

SCAN_BATCH = 1024
"""Records asked for per direct get of a snapshot (the server may send fewer: it also
stops at its max pending bytes)."""

_PAGE_TIMEOUT_S = 5.0
"""Seconds one page of a snapshot may take."""

_TICK_S = 1.0
"""Seconds between the follower's looks at the connection (a reconnect makes it behind)."""

_TAIL_GRACE_S = 1.0
"""Seconds a change the stream has stored may take to arrive before its absence counts
as lost (the republished message and the direct get's answer come by different routes)."""


@dataclass
class Snapshot:
    """The bucket as read by `scan_bucket`."""

    entries: dict[str, tuple[bytes | None, bool]]
    """Last (value, deleted) per key."""
    last_seq: int
    """The stream sequence the snapshot is consistent at (0: nothing stored yet)."""


def _direct_get_subject(kv: KeyValue) -> str:
    """The direct get API subject of `kv`'s stream, in the JetStream (domain) `kv` uses."""
    return f"{kv._js._prefix}.DIRECT.GET.{kv._stream}"


def _header(msg: Msg, name: str) -> str | None:
    return (msg.headers or {}).get(name)


async def scan_bucket(kv: KeyValue, *, batch: int = SCAN_BATCH) -> Snapshot:
    """Read the last value (or delete marker) of every key of `kv` with batched direct
    gets, no consumer.

    Returns:
        The keys' last entries and the stream sequence the read is consistent at: the
        last sequence stored when the last page was read; an empty stream reports its
        last sequence from a stream info (a purged stream keeps counting).
    Raises:
        HookbusTimeoutError: a page was not answered within `_PAGE_TIMEOUT_S`.
        NoRespondersError: nothing answered a page while the stream is there with direct
            gets on (a moment: transient).
        HookbusError: the server answered a page with an error status, or the stream is
            gone or has no direct get.
        NotPermittedError: this identity may not make direct gets on the stream.
    """
    nc: NATS = kv._js._nc
    subject = _direct_get_subject(kv)
    entries: dict[str, tuple[bytes | None, bool]] = {}
    last_seq = 0
    start = 1
    while True:
        try:
            page, pending, status = await _page(nc, subject, f"{kv._pre}>", start, batch)
        except _NoDirectGet:
            raise await _why_no_direct_get(kv, subject) from None
        for msg in page:
            seq = int(_header(msg, "Nats-Sequence") or 0)
            key = (_header(msg, "Nats-Subject") or "")[len(kv._pre) :]
            op = _header(msg, "KV-Operation")
            entries[key] = (msg.data, op in DELETE_OPS)
            last_seq = max(last_seq, seq)
        if status == "404" or (not page and pending == 0):
            break
        if pending == 0:
            return Snapshot(entries, last_seq)
        start = last_seq + 1
    if last_seq:
        return Snapshot(entries, last_seq)
    info = await kv._js.stream_info(kv._stream)  # empty: where does the stream count from
    return Snapshot(entries, int(info.state.last_seq or 0))


async def _page(
    nc: NATS, subject: str, keys: str, start: int, batch: int
) -> tuple[list[Msg], int, str]:
    """One batch direct get: the messages, the pending count after them, and the status of
    the end marker (``"204"``: end of batch; ``"404"``: nothing from `start` on)."""
    inbox = nc.new_inbox()
    got: list[Msg] = []
    done: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Msg) -> None:
        status = _header(msg, "Status")
        if status is None:
            got.append(msg)
            return
        if not done.done():
            done.set_result((int(_header(msg, "Nats-Num-Pending") or 0), status))

    sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
    try:
        body = {"seq": start, "next_by_subj": keys, "batch": batch}
        await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
        try:
            async with asyncio.timeout(_PAGE_TIMEOUT_S):
                pending, status = await done
        except TimeoutError:
            raise HookbusTimeoutError(
                f"the registry snapshot ({subject}) was not answered within {_PAGE_TIMEOUT_S:g} s"
            ) from None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if status == "503":
        raise _NoDirectGet(subject)
    if status not in ("204", "404"):
        raise HookbusError(f"the registry snapshot ({subject}) was refused: status {status}")
    return got, pending, status


class SnapshotBehindError(HookbusTimeoutError):
    """A registry snapshot ended below the sequence the stream's leader had stored when it
    was asked: the replica that answered the direct gets (any replica does, followers
    included) had not applied every change yet. Transient: the snapshot is read again."""


class _NoDirectGet(HookbusError):
    """Nothing answered a direct get of the registry's stream (status 503)."""


async def _why_no_direct_get(kv: KeyValue, subject: str) -> BaseException:
    """What a direct get nobody answered means: the stream there, with direct gets on, is a
    moment (a fresh replicated stream's replicas subscribe to the direct get subject just
    after its creation; a leader moves): no responders, transient (`kv_retry` tries again);
    else the stream is gone or has no direct get: a `HookbusError`."""
    with contextlib.suppress(nats.js.errors.NotFoundError):
        info = await kv._js.stream_info(kv._stream)
        if info.config.allow_direct:
            return nats.errors.NoRespondersError()
        return HookbusError(f"the handler registry's stream has no direct get ({subject})")
    return HookbusError(f"nothing answers {subject}: the handler registry's stream is gone")


class _Ticker:
    """One timer per event loop ticking every follower on it (`_TICK_S`): a process running
    many dispatchers keeps one timer, not one per dispatcher. (It holds no reference to
    its loop: `_TICKERS` forgets it with the loop.)"""

    def __init__(self) -> None:
        self._followers: dict[RegistryFollower, None] = {}
        self._timer: asyncio.TimerHandle | None = None

    @staticmethod
    def of(loop: asyncio.AbstractEventLoop) -> _Ticker:
        """The ticker of `loop` (made on first use)."""
        ticker = _TICKERS.get(loop)
        if ticker is None:
            ticker = _TICKERS[loop] = _Ticker()
        return ticker

    def add(self, follower: RegistryFollower) -> None:
        """Tick `follower` from now on (called on the running loop)."""
        self._followers[follower] = None
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(_TICK_S, self._tick)

    def discard(self, follower: RegistryFollower) -> None:
        self._followers.pop(follower, None)
        if not self._followers and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(_TICK_S, self._tick)
        now = loop.time()
        for follower in list(self._followers):
            try:
                follower.tick(now)
            except Exception:  # one follower's fault never stops the others' ticks
                log.exception("handler registry follower tick failed")


_TICKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Ticker] = (
    weakref.WeakKeyDictionary()
)


class RegistryFollower:
    """Keeps a routing table in step with the handler registry through the bucket stream's
    republished changes (see the module docstring). `start` returns once a snapshot is
    applied; `stop` is idempotent.

    Args:
        kv: the handlers bucket (its stream must republish: `republishes_registry`).
        table: the routing table to keep in step.
        check_s: seconds between checks of the stream's last sequence (jittered by
            a fifth either way, so a fleet's checks spread).
    """

    def __init__(self, kv: KeyValue, table: RoutingTable, *, check_s: float = 30.0) -> None:
        self._kv = kv
        self._nc: NATS = kv._js._nc
        self._table = table
        self._check_s = check_s
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self._buffer: list[Msg] | None = None
        """Changes that arrived while a snapshot is read (None: none is being read)."""
        self._reconnects = 0
        self._behind_since: float | None = None
        self._current = asyncio.Event()
        self._wake = asyncio.Event()
        """Set when the follower's task has work: behind, or the periodic check due."""
        self._next_check: Deadline = NEVER
        self._reading = asyncio.Lock()
        """Held while a snapshot is read and applied: one at a time (two would share the
        buffer of changes, and the later could undo changes applied meanwhile)."""
        self.rejected: dict[str, str] = {}
        """Keys of the records currently refused, with the reason (reported, not routed)."""
        self.resyncs = 0
        """Snapshots applied so far."""
        self.gaps = 0
        """Times the follower found itself behind (a skipped sequence, a reconnect, a
        change lost at the tail, a re-created stream)."""

    # -- state -------------------------------------------------------------------------
    @property
    def current(self) -> bool:
        """Whether every change the stream stored up to the last one delivered has been
        applied, with no evidence of a miss (a reconnect since the last snapshot counts)."""
        if self._current.is_set() and self._nc.stats["reconnects"] != self._reconnects:
            self._fall_behind("the connection was re-established")
        return self._current.is_set()

    async def wait_current(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for the follower to be current.

        Returns:
            Whether it is.
        """
        if self.current:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._current.wait()
        return self.current

    def _fall_behind(self, why: str) -> None:
        if self._current.is_set():
            log.warning("handler registry: behind (%s); failing closed until caught up", why)
            self._behind_since = asyncio.get_running_loop().time()
            self.gaps += 1
        self._current.clear()
        self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self, *, deadline_s: float = 30.0) -> None:
        """Subscribe to the changes, apply a snapshot, then follow.

        Raises:
            NotPermittedError: this identity may not subscribe to the changes or read the
                bucket (it could not follow the registry: the dispatcher does not start).
            HookbusTimeoutError: no snapshot could be read within `deadline_s` seconds.
            HookbusError: the stream does not answer direct gets (gone, or no direct get).
        """
        harden_connection(self._nc)  # a refused subscription is said at the flush
        self._sub = await self._nc.subscribe(
            REGISTRY_CHANGES_WILDCARD,
            cb=self._on_change,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )
        try:
            await self._nc.flush()
            await kv_retry(
                self._snapshot, deadline_s=deadline_s, what="reading the handler registry"
            )
        except NotPermittedError as exc:
            await self._unsubscribe()
            raise NotPermittedError(
                f"{exc}: this dispatcher cannot follow the handler registry, so it does not start"
            ) from exc
        except BaseException:
            await self._unsubscribe()
            raise
        self._task = asyncio.create_task(self._run(), name="hookbus-registry-follower")

    async def stop(self) -> None:
        """Stop following (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            await stop_task(task, "registry follower")
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def resync(self) -> bool:
        """Read and apply a new snapshot now.

        Returns:
            True (a snapshot is always complete).
        Raises:
            SnapshotBehindError: the snapshot was older than what the stream's leader had
                stored (the follower is behind until a new one is read).
            HookbusTimeoutError, HookbusError: it could not be read (the routes are kept,
                and the follower stays as current as it was).
        """
        await self._snapshot()
        return True

    # -- the changes -------------------------------------------------------------------
    async def _on_change(self, msg: Msg) -> None:
        if self._buffer is not None:
            self._buffer.append(msg)
            return
        self._follow(msg)

    def _follow(self, msg: Msg) -> None:
        """Apply one republished change if it is the next; else fall behind."""
        try:
            seq = int(_header(msg, "Nats-Sequence") or "")
        except ValueError:
            self._fall_behind("a change without a stream sequence")
            return
        if seq <= self._seq:
            return  # delivered twice (a snapshot already had it)
        if seq != self._seq + 1 or not self._current.is_set():
            self._fall_behind(f"change {seq} after {self._seq}")
            return
        self._apply(msg)
        self._seq = seq

    def _apply(self, msg: Msg) -> None:
        subject = _header(msg, "Nats-Subject") or ""
        if not subject.startswith(self._kv._pre):
            log.warning("ignoring a registry change for %r", subject[:200])
            return
        deleted = _header(msg, "KV-Operation") in DELETE_OPS
        self.apply(subject[len(self._kv._pre) :], msg.data, deleted)

    def apply(self, key: str, value: bytes | None, deleted: bool) -> None:
        """Apply one change of the bucket (the route or requirement at `key` follows it)."""
        apply_entry(self._table, self.rejected, self._report, key, value, deleted)

    async def _snapshot(self) -> None:
        async with self._reading:
            await self._read_snapshot()

    async def _read_snapshot(self) -> None:
        self._buffer = []
        reconnects = self._nc.stats["reconnects"]
        try:
            stored = await self._leader_last_seq()
            snap = await scan_bucket(self._kv)
            read = RegistryRead(complete=True)
            for key, (value, deleted) in snap.entries.items():
                if not deleted:
                    classify(read, key, value)
            self._report(read.rejected)
            self._table.replace_remote(read.declarations.values(), read.required.values())
            self.rejected = read.rejected
            self._seq = snap.last_seq
            self.resyncs += 1
            buffered, self._buffer = self._buffer, None
            self._reconnects = reconnects
            self._current.set()  # the buffered changes decide whether it stays so
            for msg in buffered:
                self._follow(msg)
            if self._current.is_set() and self._seq < stored:
                self._current.clear()
                raise SnapshotBehindError(
                    f"the registry snapshot was answered at sequence {snap.last_seq} by a "
                    f"replica behind the stream's leader, which had stored {stored}"
                )
        finally:
            self._buffer = None
        if self._current.is_set() and self._behind_since is not None:
            behind = asyncio.get_running_loop().time() - self._behind_since
            log.warning("handler registry: caught up after %.2f s behind", behind)
            self._behind_since = None

    async def _leader_last_seq(self) -> int:
        """The last sequence the stream's leader has stored, asked after the changes'
        subscription was made: a stream info, which the leader answers. A replica that
        sees no leader answers it too, from its own store, and names no leader: that
        answer is not taken.

        Raises:
            SnapshotBehindError: the answer names no leader (transient).
            HookbusError: the stream is gone.
        """
        kv = self._kv
        try:
            info = await kv._js.stream_info(kv._stream)
        except nats.js.errors.NotFoundError:
            raise HookbusError(f"the handler registry's stream is gone ({kv._stream})") from None
        if info.cluster is not None and not info.cluster.leader:
            raise SnapshotBehindError(
                "the registry's stream info was answered by a replica that sees no leader"
            )
        return int(info.state.last_seq or 0)

    def _report(self, rejected: dict[str, str]) -> None:
        for key, reason in rejected.items():
            if self.rejected.get(key) != reason:
                log.warning("ignoring bad record at %r in the handlers bucket: %s", key, reason)

    # -- the loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        """Re-read when behind, and check the stream's tail when due. The task sleeps until
        there is work: once a tick the loop's `_Ticker` (a timer callback, no task woken)
        looks at the connection and the check's deadline, and wakes it only for one of them."""
        loop = asyncio.get_running_loop()
        self._next_check = Deadline.after(self._jittered(), loop.time())
        ticker = _Ticker.of(loop)
        ticker.add(self)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not self.current:
                    try:
                        await self._snapshot()
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        log.warning("handler registry snapshot failed (%r); retrying", exc)
                        await asyncio.sleep(_TICK_S)
                        self._wake.set()
                    continue
                if self._next_check.passed(loop.time()):
                    self._next_check = Deadline.after(self._jittered(), loop.time())
                    try:
                        await self._check_tail()
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # no evidence of a miss: the routes stand
                        log.warning("handler registry check failed (%r)", exc)
        finally:
            ticker.discard(self)

    def tick(self, now: float) -> None:
        """Wake the follower's task if a reconnect made it behind (`current`) or the
        periodic check is due at loop time `now`."""
        if not self.current or self._next_check.passed(now):
            self._wake.set()

    def _jittered(self) -> float:
        return self._check_s * random.uniform(0.8, 1.2)

    async def _check_tail(self) -> None:
        """Compare the stream's last sequence with the last one applied (a stream that
        no longer answers: behind, nothing can be known).

        The answer is as old as the question: changes applied while it came (on the
        changes' subscription, or ahead of a replica a moment behind) may pass it. A
        stream went back only if it holds less than was applied when asked, as its
        leader confirms (`stream_info`)."""
        asked_at = self._seq
        try:
            last = await self._stream_last_seq()
        except nats.errors.NoRespondersError:
            self._fall_behind("the registry's stream does not answer (deleted?)")
            return
        if last > self._seq:  # stored, maybe still on its way: give it a moment
            await asyncio.sleep(_TAIL_GRACE_S)
            if last > self._seq:
                self._fall_behind(f"the stream holds {last}, {self._seq} applied")
        elif last < asked_at:
            kv = self._kv
            try:
                info = await kv._js.stream_info(kv._stream)
            except nats.js.errors.NotFoundError:
                self._fall_behind("the registry's stream is gone")
                return
            leader_last = int(info.state.last_seq or 0)
            if leader_last < asked_at:
                self._fall_behind(f"the stream restarted at {leader_last} ({asked_at} applied)")

    async def _stream_last_seq(self) -> int:
        """The stream's last sequence: a direct get of its last message (any replica
        answers), or, when it holds none, a stream info."""
        kv = self._kv
        subject = _direct_get_subject(kv)
        body = json.dumps({"last_by_subj": f"{kv._pre}>"}).encode()
        msg = await self._nc.request(subject, body, timeout=_PAGE_TIMEOUT_S)
        seq = _header(msg, "Nats-Sequence")
        if seq is not None:
            return int(seq)
        if _header(msg, "Status") != "404":
            raise HookbusError(f"{subject} answered status {_header(msg, 'Status')}")
        info = await kv._js.stream_info(kv._stream)
        return int(info.state.last_seq or 0)
