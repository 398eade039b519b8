"""JetStream KV plumbing shared by the dispatcher's stores: opening a bucket and retrying
idempotent KV calls through a leader election (`hookbus._core.jetstream`, the one version
the workers use too, logging here on ``hookbus.dispatcher``), creating the dispatcher's
buckets, KV watches and releasing their consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy, KeyValueConfig
from nats.js.kv import KeyValue

from hookbus._core import jetstream
from hookbus._core.buckets import (
    approvals_bucket_config,
    handlers_bucket_config,
    suspensions_bucket_config,
)
from hookbus._core.consumers import SlotConsumer, open_consumer
from hookbus._core.jetstream import is_transient

__all__ = [
    "ensure_buckets",
    "is_transient",
    "kv_retry",
    "open_bucket",
    "read_to_end",
    "release_consumer",
    "stream_sequence",
    "subscribe_keys",
]

T = TypeVar("T")

log = logging.getLogger("hookbus.dispatcher")


async def kv_retry(
    op: Callable[[], Awaitable[T]], *, deadline_s: float, what: str = "KV operation"
) -> T:
    """`hookbus._core.jetstream.kv_retry`, logging on ``hookbus.dispatcher``.

    Raises:
        HookbusTimeoutError: every try failed transiently until `deadline_s` seconds.
    """
    return await jetstream.kv_retry(op, deadline_s=deadline_s, what=what, log=log)


async def release_consumer(sub: Any, *, timeout_s: float = 2.0) -> None:
    """Unsubscribe a JetStream push subscription (a KV watch's ``_sub`` or a
    ``js.subscribe`` result) and delete its ephemeral consumer at once.

    Unsubscribing alone leaves the consumer on the server until its inactive threshold
    (5 minutes for nats-py's KV watches): a process that reads a bucket every few seconds
    then holds hundreds of consumers, and JetStream refuses new ones past its limit
    ("maximum consumers limit reached", err 10026), which stops every KV watch. Best
    effort, bounded by `timeout_s` seconds; never raises.
    """
    stream, name = getattr(sub, "_stream", None), getattr(sub, "_consumer", None)
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
    if isinstance(sub, SlotConsumer):
        return  # its unsubscribe deleted it
    if not stream or not name:
        return
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await sub._js._jsm.delete_consumer(stream, name)


async def read_to_end(
    sub: Any,
    processed: dict[str, int],
    maybe_done: asyncio.Event,
    *,
    deadline_s: float,
    missed: str,
    done: Callable[[], bool] = lambda: True,
) -> None:
    """Wait until the consumer of `sub` (a `subscribe_keys` reading to the end) has
    delivered everything its callback then processed, and `done()` agrees; release it
    either way. The end is when the server has nothing pending for the consumer and every
    message it delivered (its consumer sequence: an ordered consumer that was reset is a
    new consumer) has been processed here: `processed` holds, per consumer name, the
    highest consumer sequence processed; the callback sets `maybe_done` on a message with
    nothing pending after it (only a hint: the server may have pushed more, or answer this
    info, before this process has read them).

    Raises:
        TimeoutError: not read to the end within `deadline_s` seconds, or a message was
            lost (the message `missed`): the caller reads it again.
    """
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                if getattr(sub, "gaps", 0):  # a message was lost: not a complete read
                    raise TimeoutError(missed)
                maybe_done.clear()
                info = await sub.consumer_info()
                delivered = info.delivered.consumer_seq
                if info.num_pending == 0 and delivered <= processed.get(info.name, 0):
                    if done():
                        break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.25):
                        await maybe_done.wait()
    finally:
        await release_consumer(sub)


def stream_sequence(msg: Any) -> int:
    """The stream sequence (a KV entry's revision) of a message a JetStream consumer pushed,
    read from its ``$JS.ACK`` reply subject (v1: 9 tokens, sequence 6th; v2 with domain and
    account: 12 and more, sequence 8th). ``msg.metadata`` gives the same after building a
    datetime and three dataclasses (about 15 us a message, on every delivery of a watch).

    Raises:
        nats.errors.NotJSMessageError: not a JetStream message.
    """
    tokens = (msg.reply or "").split(".")
    if len(tokens) >= 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[5] if len(tokens) == 9 else tokens[7])
    raise nats.errors.NotJSMessageError


async def subscribe_keys(
    kv: KeyValue,
    keys: str,
    *,
    cb: Callable[[Any], Awaitable[None]],
    deliver_policy: DeliverPolicy,
    inactive_threshold_s: float,
    recover: bool = True,
    check_s: float | None = None,
) -> Any:
    """A push subscription on the bucket's keys matching `keys` (``>`` for all of them,
    or e.g. ``"<agent>.>"``), delivering to `cb` (see `open_consumer`).

    On a connection with an identity it is a slot consumer (named, so that a NATS
    permission can allow this identity's names and filters only), kept ordered: a message
    it misses is delivered again (with `recover`; else it is counted in its ``gaps``).
    Without one, the whole bucket is read with nats-py's ordered consumer, a narrower
    filter with a *named* consumer (no acks, no flow control), because only then does the
    create request carry the filter in its subject
    (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``); it is not ordered: a message
    it misses is read back by the caller's periodic reads.

    Raises:
        ConsumerSlotsExhaustedError: every slot of the identity is taken.
    """
    js: Any = kv._js
    config = ConsumerConfig(deliver_policy=deliver_policy)
    return await open_consumer(
        js, kv._stream, f"{kv._pre}{keys}", cb=cb, config=config, ordered=keys == ">",
        recover=recover, check_s=check_s, inactive_threshold_s=inactive_threshold_s,
    )  # fmt: skip


async def open_bucket(
    nc: NATS,
    config: KeyValueConfig,
    *,
    strict: bool = False,
    deadline_s: float = 30.0,
    js_domain: str | None = None,
) -> KeyValue:
    """`hookbus._core.jetstream.open_bucket`, reporting on ``hookbus.dispatcher``.

    Raises:
        BucketConfigError: `strict` and the existing bucket differs from `config`, or
            JetStream refused to create it.
        JetStreamDomainError: the bucket is absent and the answering JetStream is not the
            domain asked for (`js_domain`, else the one bound to `nc`), or none answers.
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
        NotPermittedError: this identity may not create or read the bucket.
    """
    return await jetstream.open_bucket(
        nc, config, log=log, strict=strict, deadline_s=deadline_s, js_domain=js_domain
    )


async def ensure_buckets(
    nc: NATS,
    *,
    replicas: int = 1,
    suspension_ttl_s: float = 7 * 24 * 3600,
    approval_ttl_s: float | None = 7 * 24 * 3600,
    strict: bool = False,
    deadline_s: float = 30.0,
    js_domain: str | None = None,
) -> None:
    """Create the dispatcher's buckets with the configuration asked for, or report those
    that exist with another one (see `open_bucket`), before the stores open them.

    Args:
        replicas: JetStream replicas of each bucket (1 on a single server, 3 on a cluster).
        suspension_ttl_s: max age of a suspension record after its last write, seconds.
        approval_ttl_s: max age of an approval record, answer proof or grant in the
            approvals bucket after its last write, seconds (7 days: the longest approval; a
            grant's own lifetime is its ``expires_at``); None: no approvals bucket
            (approvals off).
        strict: raise instead of warning when a bucket differs.
        js_domain: the JetStream domain holding the buckets (None: the one bound to `nc`,
            else the connection's own JetStream).
    Raises:
        BucketConfigError: `strict` and a bucket differs from what was asked, or
            JetStream refused to create one as asked.
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
        JetStreamDomainError: a bucket is absent and the answering JetStream is not the
            domain asked for, or none answers (see `open_bucket`).
    """
    configs = [
        handlers_bucket_config(replicas=replicas),
        suspensions_bucket_config(ttl_s=suspension_ttl_s, replicas=replicas),
    ]
    if approval_ttl_s is not None:
        configs.append(approvals_bucket_config(ttl_s=approval_ttl_s, replicas=replicas))
    for config in configs:
        await open_bucket(nc, config, strict=strict, deadline_s=deadline_s, js_domain=js_domain)
