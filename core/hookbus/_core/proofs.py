"""Answer proofs: the keys ``<agent>.<label>.<approver>`` beside a record, which only that
approver's NATS user may write, read back in the order they were written.

Whoever decides from proofs (the dispatcher waiting on an approval, an agent waiting on a
tool approval) takes the FIRST proof in stream order whose value is acceptable: two
deciders reading the same proofs take the same one, whichever of them writes the record.
While a decider waits, `apply_proofs_until_settled` applies them: at once, at each proof
its watch signals, and every few seconds. A record's resolution that names an approver
holds only if that approver's own proof says the same (`read_proof`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from hookbus._core.kv import is_transient, kv_retry, read_to_end, subscribe_keys
from hookbus.schemas import AlreadySettledError, ApprovalAnswer, HookbusError, decode, encode

__all__ = [
    "apply_proofs_until_settled",
    "first_proof",
    "read_proof",
    "read_proofs",
    "write_proof",
]

T = TypeVar("T")

_MARKER_REASON = "Nats-Marker-Reason"


async def write_proof(
    kv: KeyValue, key: str, answer: ApprovalAnswer, *, deadline_s: float
) -> ApprovalAnswer:
    """Create the proof `key` (``approval_answer_key``) holding `answer`, retried through
    a leader election for up to `deadline_s` seconds. A proof of the same approver already
    there with the same choice (a retry) is that answer; with another choice, refused.

    Returns:
        The answer on record.
    Raises:
        AlreadySettledError: this approver already answered otherwise.
        HookbusTimeoutError: JetStream stayed unavailable.
        NotPermittedError: this client's NATS user may not write `key` (another approver's).
    """
    on_record = answer

    async def create() -> None:
        nonlocal on_record
        try:
            await kv.create(key, encode(answer))
        except nats.js.errors.KeyWrongLastSequenceError as exc:  # answered before (or a retry)
            if is_transient(exc):  # an earlier try still in flight: kv_retry tries again
                raise
            earlier = decode((await kv.get(key)).value or b"{}", ApprovalAnswer)
            if earlier.choice != answer.choice:
                raise AlreadySettledError(
                    f"{answer.answered_by} already answered with {earlier.choice!r}"
                ) from None
            on_record = earlier

    await kv_retry(create, deadline_s=deadline_s, what=f"writing {key[:80]}")
    return on_record


async def read_proofs(
    kv: KeyValue, record_key: str, *, deadline_s: float, after: int = 0
) -> list[tuple[str, bytes]]:
    """Every live proof of the record `record_key` stored after stream sequence `after`
    (see `SuspensionRecord.created_over`: older ones answered an earlier hook on the label)
    as ``(key, value)``, in stream order (a deleted proof is left out).

    Raises:
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
    """
    return await kv_retry(
        lambda: _read_once(kv, record_key, deadline_s, after),
        deadline_s=deadline_s,
        what=f"reading the answers of {record_key[:80]}",
    )


async def _read_once(
    kv: KeyValue, record_key: str, deadline_s: float, after: int
) -> list[tuple[str, bytes]]:
    prefix = kv._pre  # type: ignore[attr-defined]
    found: dict[str, tuple[int, bytes]] = {}
    processed: dict[str, int] = {}
    maybe_done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        key = msg.subject[len(prefix) :]
        headers = msg.headers or {}
        meta = msg.metadata
        if headers.get(KV_OP) in (KV_DEL, KV_PURGE) or _MARKER_REASON in headers:
            found.pop(key, None)
        else:
            found[key] = (meta.sequence.stream, msg.data or b"")
        processed[meta.consumer] = max(processed.get(meta.consumer, 0), meta.sequence.consumer)
        if meta.num_pending == 0:
            maybe_done.set()

    sub = await subscribe_keys(
        kv, f"{record_key}.*", cb=on_msg, deliver_policy=DeliverPolicy.ALL,
        inactive_threshold_s=30.0, recover=False,  # a gap: the proofs are read again
    )  # fmt: skip
    await read_to_end(
        sub,
        processed,
        maybe_done,
        deadline_s=deadline_s,
        missed="reading the answers missed a message; reading again",
    )
    kept = sorted((item for item in found.items() if item[1][0] > after), key=lambda i: i[1][0])
    return [(key, value) for key, (_, value) in kept]


async def first_proof(
    kv: KeyValue,
    record_key: str,
    accept: Callable[[str, bytes], T | None],
    *,
    deadline_s: float,
    after: int = 0,
) -> T | None:
    """The first proof of `record_key` stored after stream sequence `after`, in stream
    order, that `accept` turns into a value (`accept(key, value)` returns None for a proof
    it refuses), or None."""
    for key, value in await read_proofs(kv, record_key, deadline_s=deadline_s, after=after):
        got = accept(key, value)
        if got is not None:
            return got
    return None


async def read_proof(kv: KeyValue, key: str, *, deadline_s: float, after: int = 0) -> bytes | None:
    """The value of the one proof `key` (an approver's), or None when there is none stored
    after stream sequence `after` (an older one answered an earlier hook on the label).

    Raises:
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
    """

    async def get() -> bytes | None:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if (entry.revision or 0) <= after:
            return None  # an answer to an earlier hook on the label
        return entry.value or None

    return await kv_retry(get, deadline_s=deadline_s, what=f"reading {key[:80]}")


async def apply_proofs_until_settled(
    apply: Callable[[], Awaitable[bool]],
    signal: asyncio.Event,
    *,
    poll_s: float,
    unread: Callable[[BaseException], None],
) -> None:
    """While a record is waited on: call `apply` (resolve the record from its first valid
    proof; True once it is settled) at once, each time `signal` is set (a proof delivered
    by the decider's watch) and every `poll_s` seconds, until it returns True.

    A read or write that fails (`HookbusError`, a nats-py error) is handed to `unread`
    (to log it) and tried again at the next signal or poll; cancel the task to stop."""
    while True:
        signal.clear()
        try:
            if await apply():
                return
        except (HookbusError, nats.errors.Error) as exc:
            unread(exc)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(poll_s):
                await signal.wait()
