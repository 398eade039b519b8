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
caller's own deadline (`hookbus._core.deadlines.caller_deadline`: a ``hook`` with a
timeout). A write cut by it raises `HookbusTimeoutError` with its outcome unknown: it may
still land. Deletes carry no body, so "the key is gone" (absent, or a delete marker)
counts as done.

Every value read from the bucket is validated (size, UTF-8, JSON types, the label matching
its key); a bad one is reported once per revision in the log and skipped, never raised.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import nats.js.errors
from nats.js.kv import KV_DEL, KeyValue

from hookbus._core.kv import is_transient, kv_retry
from hookbus._core.suspension_records import is_record_key, parse_record
from hookbus.schemas import (
    SUSPENSION_MAX_BYTES,
    BadRequestError,
    HookStatus,
    PayloadTooLargeError,
    SuspensionRecord,
    agent_token,
    encode,
    suspension_key,
)

from ._reconcile import (
    DELETED,
    LINEAGE,
    WRONG_LAST,
    Conflict,
    ReadBehind,
    Verdict,
    judge,
    reconciled,
)
from ._record_listing import SuspensionPage, page_of, scan_once

__all__ = [
    "Entry", "IfDeleted", "RecordStore", "SuspensionPage", "is_record_key", "parse_record",
]  # fmt: skip

log = logging.getLogger("hookbus.dispatcher")


IfDeleted = Literal["landed", "lost"]
"""What a write whose outcome is unknown counts as when its key was deleted after the
version it replaces: ``landed`` (success, revision 0) or ``lost`` (None, a lost race)."""


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
        lineage = [f"{DELETED}{last}"] if over is not None and over.deleted else []
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
                if exc.err_code == WRONG_LAST:
                    raise Conflict from exc
                raise
            return True

        async def probe() -> Verdict:
            got = await self._raw(key)
            if got is not None and got[1] < last:
                raise ReadBehind(f"{key[:80]} read at revision {got[1]}, behind {last}")
            if got is None or got[2] is not None:
                return "ours"  # gone (absent, or a delete marker): what the delete was for
            return "unchanged" if got[1] == last else "changed"

        done = await reconciled(key, attempt, probe, lambda: True, deadline_s=self.deadline_s)
        return done is not None

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
                raise Conflict from exc
            except nats.js.errors.KeyNotFoundError as exc:
                # nats-py's `create`, refused, reads the key to see whether it was deleted:
                # gone meanwhile (expired, purged; or a direct get behind), ours did not land
                raise Conflict from exc

        async def probe() -> Verdict:
            got = await self._raw(key)
            verdict, revision = judge(got, record.write_id, last)
            if verdict == "deleted":
                verdict, revision = ("ours", 0) if if_deleted == "landed" else ("changed", 0)
            if verdict == "ours":
                found.append(revision)
            return verdict

        return await reconciled(key, attempt, probe, lambda: found[-1], deadline_s=self.deadline_s)

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
        return await kv_retry(
            lambda: scan_once(self.kv, self.keys, self._parsed, deadline_s=self.deadline_s),
            deadline_s=self.deadline_s,
            what="listing",
        )

    def _parsed(self, key: str, value: bytes | None, revision: int) -> SuspensionRecord | None:
        """The valid record `value` holds at `revision`, None (logged once) when it is
        malformed."""
        return self.entry(key, value, revision).record

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
        return page_of(records, bad, status=status, limit=limit, after=after, prefix=prefix)
