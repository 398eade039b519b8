"""Listing suspension records: every key's last value in one pass (`scan_once`), and one
page of them, oldest first (`page_of`, `SuspensionPage`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from hookbus._core.kv import read_to_end, subscribe_keys
from hookbus._core.suspension_records import is_record_key
from hookbus.schemas import (
    BadRequestError,
    HookStatus,
    SuspensionRecord,
    label_from_key,
)

__all__ = ["SuspensionPage", "page_of", "scan_once"]

_MARKER_REASON = "Nats-Marker-Reason"


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


async def scan_once(
    kv: Any,
    keys: str,
    parse: Callable[[str, bytes | None, int], SuspensionRecord | None],
    *,
    deadline_s: float,
) -> tuple[list[SuspensionRecord], list[str]]:
    """One read of every key's last value in the suspensions bucket `kv` under the key
    filter `keys` (``>``: the whole bucket): the valid records, and the keys of the
    malformed ones (`parse` judges a value at its revision: the record, or None). An
    ordered consumer delivers them (no round trip per record).

    Raises:
        TimeoutError: not read whole within `deadline_s` seconds, or a message was lost
            (the caller reads it again).
    """
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
            record = parse(key, msg.data, meta.sequence.stream)
            if record is not None:
                records[key] = record
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
    if keys == ">":
        state = (await kv._js.stream_info(kv._stream)).state
        last = state.last_seq if state.messages else 0
    sub = await subscribe_keys(
        kv,
        keys,
        cb=on_msg,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold_s=60.0,
        recover=False,  # a slot consumer's gap: the listing is read again
    )
    await read_to_end(
        sub,
        processed,
        maybe_done,
        deadline_s=deadline_s,
        missed="the listing missed a message; reading it again",
        done=lambda: seen >= last,
    )
    return list(records.values()), list(bad)


def page_of(
    records: list[SuspensionRecord],
    bad: list[str],
    *,
    status: HookStatus | None = None,
    limit: int | None = None,
    after: str | None = None,
    prefix: str | None = None,
) -> SuspensionPage:
    """A page of `records` (a scan's valid records; `bad`: the keys of its malformed ones),
    oldest first, filtered by `status` and label `prefix`.

    Args:
        limit: page size (None: everything; at least 1, which the caller checks).
        after: the ``next`` cursor of the previous page.
    Raises:
        BadRequestError: `after` is not a cursor from this listing.
    """
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
