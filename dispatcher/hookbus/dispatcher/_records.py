"""The suspension record store: validated reads, create / compare-and-set / delete that
stay exactly-once when a write's outcome is unknown, and a listing in one pass.

A JetStream publish that times out (nats-py ``TimeoutError``, ``NoStreamResponseError``, a
stream leader moving) may have been stored: retrying it blindly with the same expected
revision then fails against our own write, and the writer wrongly concludes it lost a race.
Instead every record written carries a fresh ``write_id``; after an unknown outcome the key
is read again and reconciled:

- our ``write_id`` is there, or in the ``lineage`` of a version that replaced it: the
  write succeeded;
- the key is unchanged (still at the revision the write replaces: a record, a delete
  marker, or absent for a key never written): the same write is sent again (same bytes,
  same ``write_id``), as a compare-and-set on that revision;
- the key was deleted after that revision (a delete marker newer than it, or a record
  created over one): with a history of one the deleted versions are gone, so whether ours
  landed (and was consumed and removed) is unknown. It is never sent again: the caller
  says what it counts as (``if_deleted``: landed, or lost);
- anything else: another writer really won.

A create over a delete marker is a compare-and-set on the marker's revision (`latest`
reads it), and records that revision in its lineage (``deleted@<revision>``): a writer
that reads the new record back finds out that its own base was deleted meanwhile.

Retries go through tenacity and stop at a deadline (seconds per write), or earlier at the
caller's own deadline (`hookbus._core.jetstream.caller_deadline`: a ``hook`` with a
timeout). A write cut by it raises `HookbusTimeoutError` with its outcome unknown: it may
still land. Deletes carry no body, so "the key is gone" (absent, or a delete marker)
counts as done.

Every value read from the bucket is validated (size, UTF-8, JSON types, the label matching
its key); a bad one is reported once per revision in the log and skipped, never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
import nats.js.errors
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

from hookbus._core.jetstream import time_left
from hookbus._core.kv import is_transient, kv_retry, release_consumer, subscribe_keys
from hookbus.schemas import (
    SUSPENSION_MAX_BYTES,
    BadRequestError,
    HookbusError,
    HookbusTimeoutError,
    HookStatus,
    PayloadTooLargeError,
    SuspensionRecord,
    agent_token,
    decode,
    encode,
    label_from_key,
    suspension_key,
)

__all__ = [
    "Entry", "IfDeleted", "RecordStore", "SuspensionPage", "is_record_key", "parse_record",
]  # fmt: skip

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

_WRONG_LAST = 10071
"""JetStream's error code of a failed compare-and-set: another write is at the key (a
"wrong last sequence" with no sequence is an unknown outcome instead, `is_transient`)."""

_MARKER_REASON = "Nats-Marker-Reason"

LINEAGE = 8
"""Write ids of replaced versions a record keeps."""

_DELETED = "deleted@"
"""Lineage entry of a create over a delete marker: ``deleted@<the marker's revision>``."""

IfDeleted = Literal["landed", "lost"]
"""What a write whose outcome is unknown counts as when its key was deleted after the
version it replaces: ``landed`` (success, revision 0) or ``lost`` (None, a lost race)."""

Verdict = Literal["ours", "unchanged", "changed"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One key's latest value: a valid `record`, or None with the `problem` that made it
    unusable (a malformed value still has a `revision`, so a writer can replace it), or,
    from `RecordStore.latest` only, a delete marker (`deleted`, no record): a create
    compare-and-sets on its revision."""

    revision: int
    record: SuspensionRecord | None
    problem: str | None = None
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class SuspensionPage:
    """One page of a listing, oldest first (by ``created_at``, then label).

    Attributes:
        records: at most the page size.
        next: cursor for the next page (pass as ``after``), or None on the last page.
        skipped: malformed records skipped (each is logged), within `prefix` if one is given.
        total: records matching the filter in the whole bucket.
    """

    records: list[SuspensionRecord]
    next: str | None = None
    skipped: int = 0
    total: int = 0
    skipped_keys: list[str] = field(default_factory=list)


def is_record_key(key: str) -> bool:
    """Whether a bucket key is a record's (``<agent>.<label>``, two tokens), not an
    approver's answer proof (``<agent>.<label>.<approver>``) or an "Allow always" grant
    (five tokens, in the approvals bucket), which the record store ignores."""
    return key.count(".") == 1


def parse_record(key: str, value: bytes | None) -> SuspensionRecord | str:
    """Validate a stored value: the record, or the reason it is unusable.

    Checks the size (`SUSPENSION_MAX_BYTES`), JSON and UTF-8, every field's type, a finite
    ``created_at``, and that the record's agent and label are the ones its key encodes.
    """
    if not value:
        return "empty value"
    if len(value) > SUSPENSION_MAX_BYTES:
        return f"{len(value)} bytes, more than {SUSPENSION_MAX_BYTES}"
    try:
        record = decode(value, SuspensionRecord)
    except HookbusError as exc:
        return str(exc)
    if not math.isfinite(record.created_at):
        return "created_at is not a finite number"
    try:
        if suspension_key(record.label, record.agent_id) != key:
            return f"its agent and label {record.label[:80]!r} do not match its key"
    except BadRequestError as exc:
        return str(exc)
    return record


class _Conflict(Exception):
    """A compare-and-set failed (internal)."""


class RecordStore:
    """Suspension records in one KV bucket.

    Records are addressed by label within one agent's key space (``<agent>.<label>``,
    see `suspension_key`); `for_agent` gives the same store for another agent.

    Args:
        kv: the suspensions bucket (anything with nats-py's ``KeyValue`` methods).
        deadline_s: seconds one read or write may keep retrying through an outage.
        agent_id: the agent whose records are read and written by label (None: the
            records of calls without an agent id).
        scoped: listings and watches read this agent's keys only (what an agent's NATS
            user is allowed to read); False reads every agent's (a dispatcher service,
            an approver, an admin).
    """

    def __init__(
        self,
        kv: KeyValue,
        *,
        deadline_s: float = 15.0,
        agent_id: str | None = None,
        scoped: bool = False,
    ) -> None:
        self.kv = kv
        self.deadline_s = deadline_s
        self.agent_id = agent_id
        self.scoped = scoped
        self._reported: set[tuple[str, int]] = set()

    def for_agent(self, agent_id: str | None) -> RecordStore:
        """The same bucket and settings, addressing `agent_id`'s records."""
        if agent_id == self.agent_id:
            return self
        other = RecordStore(
            self.kv, deadline_s=self.deadline_s, agent_id=agent_id, scoped=self.scoped
        )
        other._reported = self._reported
        return other

    @property
    def keys(self) -> str:
        """The key filter of listings and watches: ``<agent>.>`` when scoped, else ``>``."""
        return f"{agent_token(self.agent_id)}.>" if self.scoped else ">"

    def key(self, label: str) -> str:
        """The key of `label`'s record in this agent's key space."""
        return suspension_key(label, self.agent_id)

    # -- reading ----------------------------------------------------------------------------
    async def read(self, label: str) -> Entry | None:
        """The latest value of `label` (None: absent or deleted).

        Raises:
            BadRequestError: the label cannot be a key (empty or too long).
            HookbusTimeoutError: JetStream stayed unavailable for `deadline_s`.
        """
        return await self.read_key(self.key(label))

    async def read_key(self, key: str, *, deadline_s: float | None = None) -> Entry | None:
        """As `read`, by key."""

        async def get() -> Any:
            try:
                return await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None

        got = await kv_retry(
            get, deadline_s=deadline_s or self.deadline_s, what=f"reading suspension {key[:80]}"
        )
        if got is None or got.revision is None:
            return None
        return self.entry(key, got.value, got.revision)

    async def latest(self, label: str) -> Entry | None:
        """As `read`, except that a delete marker is an `Entry` too (``deleted``, no
        record, its revision): what a create over it compare-and-sets on. None: the key
        was never written (or expired).

        Raises:
            BadRequestError: the label cannot be a key (empty or too long).
            HookbusTimeoutError: JetStream stayed unavailable for `deadline_s`.
        """
        key = self.key(label)
        got = await kv_retry(
            lambda: self._raw(key), deadline_s=self.deadline_s, what=f"reading {key[:80]}"
        )
        if got is None:
            return None
        value, revision, op = got
        if op is not None:
            return Entry(revision, None, deleted=True)
        return self.entry(key, value, revision)

    def entry(self, key: str, value: bytes | None, revision: int) -> Entry:
        """Validate `value` stored at `revision` (a malformed one is logged once)."""
        parsed = parse_record(key, value)
        if isinstance(parsed, SuspensionRecord):
            return Entry(revision, parsed)
        self.report(key, revision, parsed)
        return Entry(revision, None, parsed)

    def report(self, key: str, revision: int, problem: str) -> None:
        if (key, revision) in self._reported:
            return
        if len(self._reported) > 10_000:
            self._reported.clear()
        self._reported.add((key, revision))
        log.warning("skipping malformed suspension record %s (revision %d): %s",
                    key[:120], revision, problem)  # fmt: skip

    # -- writing ----------------------------------------------------------------------------
    async def create(
        self,
        record: SuspensionRecord,
        *,
        over: Entry | None = None,
        if_deleted: IfDeleted = "landed",
    ) -> int | None:
        """Create `record` where there is none: over nothing (`over` None: the key was
        never written), or over `over`, a delete marker or a malformed value (a
        compare-and-set on its revision; pass what `latest` returned).
        Returns the new revision (0 when it was stored but already replaced by another
        writer before it could be read back), or None when another writer got there first.

        Args:
            if_deleted: what an unknown outcome counts as when the key was deleted after
                `over` (see the module docstring): ``landed`` (0) for a write that must
                never be stored twice (a resolution), ``lost`` (None) for one whose success
                must never be counted twice.

        Raises:
            PayloadTooLargeError: the record encodes to more than `SUSPENSION_MAX_BYTES`.
            HookbusTimeoutError: the outcome stayed unknown until the deadline.
        """
        last = over.revision if over is not None else 0
        lineage = [f"{_DELETED}{last}"] if over is not None and over.deleted else []
        prior = msgspec.structs.replace(record, write_id="", lineage=lineage)
        return await self._write(record, last, prior, if_deleted)

    async def swap(
        self,
        record: SuspensionRecord,
        *,
        last: int,
        prior: SuspensionRecord | None = None,
        if_deleted: IfDeleted = "landed",
    ) -> int | None:
        """Compare-and-set: write `record` if the key is still at revision `last`.
        Returns the new revision (0 as for `create`), or None when another writer changed
        it first.

        Args:
            prior: the version `record` replaces, when `record` was not derived from it
                (its write id goes into `record`'s lineage).
            if_deleted: as for `create`.

        Raises:
            PayloadTooLargeError: the record encodes to more than `SUSPENSION_MAX_BYTES`.
            HookbusTimeoutError: the outcome stayed unknown until the deadline.
        """
        return await self._write(record, last, record if prior is None else prior, if_deleted)

    async def delete(self, label: str, *, last: int) -> bool:
        """Delete `label` if it is still at revision `last`; True once it is gone (by this
        call, or already), False when another writer changed it first.

        Raises:
            HookbusTimeoutError: the outcome stayed unknown until the deadline.
        """
        key = self.key(label)

        async def attempt() -> bool:
            try:
                await self.kv.delete(key, last=last)
            except nats.js.errors.APIError as exc:
                if exc.err_code == _WRONG_LAST:
                    raise _Conflict from exc
                raise
            return True

        async def probe() -> Verdict:
            got = await self._raw(key)
            if got is None or got[2] is not None:
                return "ours"  # gone (absent, or a delete marker): what the delete was for
            return "unchanged" if got[1] == last else "changed"

        return await self._reconciled(key, attempt, probe, lambda: True) is not None

    async def _write(
        self, record: SuspensionRecord, last: int, prior: SuspensionRecord, if_deleted: IfDeleted
    ) -> int | None:
        """Store `record` at revision `last` (0: a key never written), reconciled after an
        unknown outcome; `prior` gives the lineage. The new revision, 0 or None (`create`)."""
        lineage = ([prior.write_id] if prior.write_id else []) + prior.lineage
        record = msgspec.structs.replace(
            record, agent_id=self.agent_id, write_id=uuid.uuid4().hex, lineage=lineage[:LINEAGE]
        )
        key = self.key(record.label)
        data = encode(record)
        if len(data) > SUSPENSION_MAX_BYTES:
            raise PayloadTooLargeError(
                f"suspension record of {record.label[:80]!r} is {len(data)} bytes,"
                f" more than {SUSPENSION_MAX_BYTES}"
            )
        found: list[int] = []
        sent = 0

        async def attempt() -> int:
            nonlocal sent
            sent += 1
            try:
                if last == 0 and sent == 1:
                    return await self.kv.create(key, data)
                # a resend is a compare-and-set on exactly the state judged unchanged (never
                # `create`, which writes over whatever delete marker is there by then)
                return await self.kv.update(key, data, last=last)
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                if is_transient(exc):  # an earlier try still in flight: outcome unknown
                    raise
                raise _Conflict from exc

        async def probe() -> Verdict:
            got = await self._raw(key)
            verdict, revision = _judge(got, record.write_id, last)
            if verdict == "deleted":
                verdict, revision = ("ours", 0) if if_deleted == "landed" else ("changed", 0)
            if verdict == "ours":
                found.append(revision)
            return verdict

        return await self._reconciled(key, attempt, probe, lambda: found[-1])

    async def _reconciled(
        self,
        key: str,
        attempt: Callable[[], Awaitable[T]],
        probe: Callable[[], Awaitable[Verdict]],
        ours: Callable[[], T],
    ) -> T | None:
        """Run `attempt`; after an unknown outcome, `probe` decides: ours (return
        `ours()`), unchanged (send it again) or changed (a lost race: None). Every try
        and probe ends by the store's deadline or the caller's (`time_left`), whichever
        comes first; with no time left at all, nothing is sent."""
        loop = asyncio.get_running_loop()
        budget = time_left(self.deadline_s)
        if budget <= 0:
            raise HookbusTimeoutError(f"writing suspension {key[:80]}: no time left")
        deadline = loop.time() + budget
        try:  # the first try goes without the retry machinery (40 us): most need no more
            async with asyncio.timeout(budget):
                return await attempt()
        except _Conflict:
            return None
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.info("write to %s: outcome unknown (%r); reconciling", key[:80], exc)
        unknown = True
        backoff = wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.05)

        def wait(state: RetryCallState) -> float:  # never sleep past the deadline
            return max(0.0, min(backoff(state), deadline - loop.time()))

        retrying = AsyncRetrying(
            retry=retry_if_exception(is_transient),
            wait=wait,
            stop=stop_after_delay(max(0.0, deadline - loop.time())),
            reraise=True,
        )
        try:
            async for tried in retrying:
                with tried:
                    if unknown:
                        async with asyncio.timeout(max(0.001, deadline - loop.time())):
                            verdict = await probe()
                        if verdict == "ours":
                            return ours()
                        if verdict == "changed":
                            return None
                    try:
                        async with asyncio.timeout(max(0.001, deadline - loop.time())):
                            return await attempt()
                    except _Conflict:
                        if unknown:
                            async with asyncio.timeout(max(0.001, deadline - loop.time())):
                                verdict = await probe()
                            if verdict == "ours":
                                return ours()  # our earlier try landed after all
                        return None
                    except BaseException as exc:
                        if is_transient(exc):
                            unknown = True
                            log.info("write to %s: outcome unknown (%r); reconciling",
                                     key[:80], exc)  # fmt: skip
                        raise
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise HookbusTimeoutError(
                f"writing suspension {key[:80]} did not complete within {budget:g} s"
                f" ({type(exc).__name__}: {exc})"
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _raw(self, key: str) -> tuple[bytes, int, str | None] | None:
        """(value, revision, delete op or None) of the key's last message; None if absent."""
        try:
            got = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError as exc:
            entry = getattr(exc, "entry", None)
            if entry is not None and entry.revision is not None:
                return b"", entry.revision, str(getattr(exc, "op", None) or KV_DEL)
            return None
        return got.value or b"", got.revision or 0, None

    # -- listing ----------------------------------------------------------------------------
    async def scan(self) -> tuple[list[SuspensionRecord], list[str]]:
        """Every valid record, and the keys of the malformed ones, in one pass: an ordered
        consumer delivers the last value of every key (no round trip per record).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable for `deadline_s`.
        """
        return await kv_retry(self._scan_once, deadline_s=self.deadline_s, what="listing")

    async def _scan_once(self) -> tuple[list[SuspensionRecord], list[str]]:
        kv: Any = self.kv
        prefix = kv._pre
        records: dict[str, SuspensionRecord] = {}
        bad: dict[str, None] = {}
        seen = 0  # the highest stream sequence processed
        processed: dict[str, int] = {}  # per consumer, the highest consumer sequence processed
        maybe_done = asyncio.Event()

        async def on_msg(msg: Any) -> None:
            nonlocal seen
            key = msg.subject[len(prefix) :]
            meta = msg.metadata
            headers = msg.headers or {}
            if not is_record_key(key):
                pass  # an approver's answer proof, or a grant (approvals bucket): not a record
            elif headers.get(KV_OP) in (KV_DEL, KV_PURGE) or _MARKER_REASON in headers:
                records.pop(key, None)
                bad.pop(key, None)
            else:
                entry = self.entry(key, msg.data, meta.sequence.stream)
                if entry.record is not None:
                    records[key] = entry.record
                    bad.pop(key, None)
                else:
                    records.pop(key, None)
                    bad[key] = None
            seen = max(seen, meta.sequence.stream)
            processed[meta.consumer] = max(processed.get(meta.consumer, 0), meta.sequence.consumer)
            if meta.num_pending == 0:
                maybe_done.set()

        # Whole bucket: its last message at the start is the last of its key, so the scan
        # has not ended before it has been read (later writes only come after it). A bucket
        # with no message left (all expired, or purged) keeps its last sequence: nothing to
        # wait for then.
        last = 0
        if self.keys == ">":
            state = (await kv._js.stream_info(kv._stream)).state
            last = state.last_seq if state.messages else 0
        sub = await subscribe_keys(
            kv,
            self.keys,
            cb=on_msg,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            inactive_threshold_s=60.0,
            recover=False,  # a slot consumer's gap: the listing is read again
        )
        try:
            async with asyncio.timeout(self.deadline_s):
                while True:
                    if getattr(sub, "gaps", 0):  # a message was lost: not a complete list
                        raise TimeoutError("the listing missed a message; reading it again")
                    # The end is when the server has nothing pending for the consumer and
                    # every message it delivered (its consumer sequence: an ordered consumer
                    # that was reset is a new consumer) has been processed here. A message's own
                    # "nothing pending" is only a hint: the server may have pushed more
                    # (or answer this info) before this process has read them.
                    maybe_done.clear()
                    info = await sub.consumer_info()
                    delivered = info.delivered.consumer_seq
                    if info.num_pending == 0 and delivered <= processed.get(info.name, 0):
                        if seen >= last:
                            break
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.25):
                            await maybe_done.wait()
        finally:
            await release_consumer(sub)
        return list(records.values()), list(bad)

    async def page(
        self,
        *,
        status: HookStatus | None = None,
        limit: int | None = None,
        after: str | None = None,
        prefix: str | None = None,
    ) -> SuspensionPage:
        """A page of records, oldest first, filtered by `status` and label `prefix`.

        Args:
            limit: page size (None: everything).
            after: the ``next`` cursor of the previous page.
        Raises:
            BadRequestError: `after` is not a cursor from this listing, or `limit` < 1.
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        if limit is not None and limit < 1:
            raise BadRequestError(f"page size must be at least 1, not {limit}")
        records, bad = await self.scan()
        chosen = sorted(
            (
                r
                for r in records
                if (status is None or r.status == status)
                and (prefix is None or r.label.startswith(prefix))
            ),
            key=_order,
        )
        start = 0
        if after is not None:
            mark = _cursor_position(after)
            start = next((i for i, r in enumerate(chosen) if _order(r) > mark), len(chosen))
        shown_bad = [
            label for label in map(label_or_key, bad) if prefix is None or label.startswith(prefix)
        ]
        end = len(chosen) if limit is None else min(len(chosen), start + limit)
        more = end < len(chosen)
        return SuspensionPage(
            records=chosen[start:end],
            next=json.dumps(list(_order(chosen[end - 1]))) if more and end > start else None,
            skipped=len(shown_bad),
            total=len(chosen),
            skipped_keys=shown_bad,
        )


def label_or_key(key: str) -> str:
    """A key's label for display, or the raw key when it is not a hookbus key."""
    try:
        return label_from_key(key)
    except BadRequestError:
        return key


def _order(r: SuspensionRecord) -> tuple[float, str]:
    return (r.created_at, r.label)


def _cursor_position(after: str) -> tuple[float, str]:
    try:
        created, label = json.loads(after)
        return float(created), str(label)
    except (ValueError, TypeError) as exc:
        raise BadRequestError(f"not a listing cursor: {after[:80]!r}") from exc


class _WriteIds(msgspec.Struct):
    write_id: str = ""
    lineage: list[str] = msgspec.field(default_factory=list)


_write_ids_decoder = msgspec.json.Decoder(_WriteIds)


def _judge(
    got: tuple[bytes, int, str | None] | None, write_id: str, last: int
) -> tuple[Literal["ours", "unchanged", "changed", "deleted"], int]:
    """Reconcile a write of `write_id` at revision `last` (0: a key never written) with
    the key's last message `got` (see `RecordStore._raw`): the verdict, and the revision
    to report when it is ours (0: ours, already replaced).

    ``deleted``: the key was deleted after `last` (a newer delete marker, or a record
    created over one): the versions in between are gone, ours maybe among them.
    """
    if got is None:  # never written (or expired)
        return ("unchanged" if last == 0 else "changed"), 0
    value, revision, op = got
    ids = _write_ids(value) if op is None and value else []
    if ids and ids[0] == write_id:
        return "ours", revision
    if write_id in ids:  # stored, then replaced by a writer that read it
        return "ours", 0
    if revision == last:
        return "unchanged", 0
    if op is not None or _deleted_since(ids, last):
        return "deleted", 0
    return "changed", 0


def _deleted_since(ids: list[str], last: int) -> bool:
    """Whether a lineage records a create over a delete marker newer than revision `last`."""
    for entry in ids:
        if entry.startswith(_DELETED):
            try:
                if int(entry[len(_DELETED) :]) > last:
                    return True
            except ValueError:
                continue
    return False


def _write_ids(value: bytes) -> list[str]:
    """The write id of a stored value, then its lineage ([] if unreadable)."""
    try:
        got = _write_ids_decoder.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return []
    return [got.write_id, *got.lineage]
