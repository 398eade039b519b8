"""A suspension record write whose outcome is unknown, reconciled: the retry loop
(`reconciled`) and the verdict on what the key holds afterwards (`judge`). The rules are
the record store's (`hookbus.dispatcher._records`): ours, unchanged (sent again), deleted
since (the caller's ``if_deleted`` says), or another writer's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import msgspec
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

from hookbus._core.deadlines import Deadline, time_left
from hookbus._core.kv import is_transient
from hookbus.schemas import HookbusTimeoutError

__all__ = [
    "DELETED",
    "LINEAGE",
    "WRONG_LAST",
    "Conflict",
    "ReadBehind",
    "Verdict",
    "judge",
    "reconciled",
]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

WRONG_LAST = 10071
"""JetStream's error code of a failed compare-and-set: another write is at the key (a
"wrong last sequence" with no sequence is an unknown outcome instead, `is_transient`)."""

LINEAGE = 8
"""Write ids of replaced versions a record keeps."""

DELETED = "deleted@"
"""Lineage entry of a create over a delete marker: ``deleted@<the marker's revision>``."""

Verdict = Literal["ours", "unchanged", "changed"]
"""What a write's key holds after an unknown outcome: the write itself (or a version that
replaced it), the version the write replaces (send it again), or another writer's."""


class Conflict(Exception):
    """A compare-and-set failed: another write is at the key."""


class ReadBehind(TimeoutError):
    """A probe read a message older than the version the write replaces: the reader was
    behind the stream's leader (a direct get, answered by a replica that lags). Nothing can
    be judged from it; transient (a `TimeoutError`), so the probe is made again."""


async def reconciled(
    key: str,
    attempt: Callable[[], Awaitable[T]],
    probe: Callable[[], Awaitable[Verdict]],
    ours: Callable[[], T],
    *,
    deadline_s: float,
) -> T | None:
    """Run `attempt` (a write of `key`, raising `Conflict` for a lost compare-and-set);
    after an unknown outcome, `probe` decides: ours (return `ours()`), unchanged (send it
    again) or changed (a lost race: None). Every try and probe ends by `deadline_s`
    (seconds) or the caller's deadline (`time_left`), whichever comes first; with no time
    left at all, nothing is sent.

    Raises:
        HookbusTimeoutError: the outcome stayed unknown until the deadline.
    """
    loop = asyncio.get_running_loop()
    budget = time_left(deadline_s)
    if budget <= 0:
        raise HookbusTimeoutError(f"writing suspension {key[:80]}: no time left")
    deadline = Deadline.after(budget, loop.time())
    try:  # the first try goes without the retry machinery (40 us): most need no more
        async with asyncio.timeout(budget):
            return await attempt()
    except Conflict:
        return None
    except Exception as exc:
        if not is_transient(exc):
            raise
        log.info("write to %s: outcome unknown (%r); reconciling", key[:80], exc)
    unknown = True
    backoff = wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.05)

    def wait(state: RetryCallState) -> float:  # never sleep past the deadline
        return deadline.cut(backoff(state), loop.time())

    retrying = AsyncRetrying(
        retry=retry_if_exception(is_transient),
        wait=wait,
        stop=stop_after_delay(deadline.left(loop.time())),
        reraise=True,
    )
    try:
        async for tried in retrying:
            with tried:
                if unknown:
                    async with asyncio.timeout(_at_least_1ms(deadline, loop)):
                        verdict = await probe()
                    if verdict == "ours":
                        return ours()
                    if verdict == "changed":
                        return None
                try:
                    async with asyncio.timeout(_at_least_1ms(deadline, loop)):
                        return await attempt()
                except Conflict:
                    if unknown:
                        async with asyncio.timeout(_at_least_1ms(deadline, loop)):
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


def _at_least_1ms(deadline: Deadline, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds one try or probe may take: what `deadline` leaves, and at least 1 ms."""
    return max(0.001, deadline.left(loop.time()))


class _WriteIds(msgspec.Struct):
    write_id: str = ""
    lineage: list[str] = msgspec.field(default_factory=list)


_write_ids_decoder = msgspec.json.Decoder(_WriteIds)


def judge(
    got: tuple[bytes, int, str | None] | None, write_id: str, last: int
) -> tuple[Literal["ours", "unchanged", "changed", "deleted"], int]:
    """Reconcile a write of `write_id` at revision `last` (0: a key never written) with
    the key's last message `got` (see `RecordStore._raw`): the verdict, and the revision
    to report when it is ours (0: ours, already replaced).

    ``deleted``: the key was deleted after `last` (a newer delete marker, or a record
    created over one): the versions in between are gone, ours maybe among them.

    Raises:
        ReadBehind: `got` is older than revision `last` (its reader lagged the leader: a
            delete marker there says nothing about what happened after `last`).
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
    if revision < last:  # the leader never holds less than the version written over
        raise ReadBehind(f"the key was read at revision {revision}, behind {last}")
    if op is not None or _deleted_since(ids, last):
        return "deleted", 0
    return "changed", 0


def _deleted_since(ids: list[str], last: int) -> bool:
    """Whether a lineage records a create over a delete marker newer than revision `last`."""
    for entry in ids:
        if entry.startswith(DELETED):
            try:
                if int(entry[len(DELETED) :]) > last:
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
