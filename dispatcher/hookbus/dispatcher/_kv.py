"""JetStream KV plumbing shared by the dispatcher's stores: opening a bucket (and reporting
one that exists with another configuration) and retrying idempotent KV calls through a
JetStream leader election.

During a meta or stream leader election (4-6 s on a 3-node cluster) the JetStream API
answers 503 ("temporarily unavailable"), no responders, or nothing at all (a nats-py
timeout); the same call succeeds once a leader is elected. `kv_retry` retries exactly
those, with jittered exponential backoff, and never past the caller's deadline. It is for
idempotent calls only (reads, bucket creation, unconditional deletes): a compare-and-set
write whose outcome is unknown must be re-read and reconciled, not retried blindly.
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
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

from hookbus.schemas import (
    BucketConfigError,
    HookbusTimeoutError,
    NotPermittedError,
    approvals_bucket_config,
    config_differences,
    handlers_bucket_config,
    suspensions_bucket_config,
)
from hookbus.schemas._nats_guard import bucket_refusal, harden_connection

from ._consumers import SlotConsumer, open_consumer

__all__ = [
    "ensure_buckets",
    "is_transient",
    "kv_retry",
    "open_bucket",
    "release_consumer",
    "stream_sequence",
    "subscribe_keys",
]

T = TypeVar("T")

log = logging.getLogger("hookbus.dispatcher")

_TRANSIENT: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError subclasses it; so does our per-try bound
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is what a KV call raises while JetStream elects a leader (or the
    client reconnects): a timeout, no responders, no stream response, or a 503 API error."""
    if isinstance(exc, _TRANSIENT):
        return True
    return isinstance(exc, nats.js.errors.APIError) and getattr(exc, "code", None) == 503


async def kv_retry(
    op: Callable[[], Awaitable[T]],
    *,
    deadline_s: float,
    what: str = "KV operation",
    initial_wait_s: float = 0.05,
    max_wait_s: float = 1.0,
) -> T:
    """Run `op()` and retry it on transient JetStream errors until `deadline_s` seconds
    have passed; each try is also bounded by the time left.

    Only for idempotent operations (see the module docstring). A non-transient error
    (``KeyNotFoundError``, a 400, ...) is raised at once, unchanged.

    Args:
        op: a fresh awaitable per call, e.g. ``lambda: kv.get(key)``.
        deadline_s: seconds from now after which no try starts and the running one is
            cancelled.
        what: names the operation in the log and in the error.
    Returns:
        What `op` returned.
    Raises:
        HookbusTimeoutError: every try failed transiently until the deadline (also a
            stdlib `TimeoutError`); the last error is its ``__cause__``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    backoff = wait_exponential_jitter(
        multiplier=initial_wait_s, max=max_wait_s, jitter=initial_wait_s
    )

    def wait(state: RetryCallState) -> float:
        return max(0.0, min(backoff(state), deadline - loop.time()))

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.info("%s: try %d failed (%r); retrying", what, state.attempt_number, exc)

    retrying = AsyncRetrying(
        stop=stop_after_delay(deadline_s),
        wait=wait,
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        async for attempt in retrying:
            with attempt:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"{what}: no time left")
                async with asyncio.timeout(left):
                    result = await op()
    except Exception as exc:
        if not is_transient(exc):
            raise
        raise HookbusTimeoutError(
            f"{what} did not succeed within {deadline_s:g} s (JetStream unavailable: "
            f"{type(exc).__name__}: {exc})"
        ) from exc
    return result


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
    nc: NATS, config: KeyValueConfig, *, strict: bool = False, deadline_s: float = 30.0
) -> KeyValue:
    """The bucket `config.bucket`, created with `config` if absent (retried through a
    leader election within `deadline_s` seconds).

    A bucket that exists with another configuration is used as it is (JetStream keeps a
    stream's config), and reported: a WARNING naming each difference (replicas, TTL,
    history, storage, direct get; see `config_differences`), or, with `strict`, an error.

    Raises:
        BucketConfigError: `strict` and the existing bucket differs from `config`, or
            JetStream refused to create it (e.g. 3 replicas on a single server).
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
        NotPermittedError: the bucket is absent and this identity may not create it, or
            may not read it (one line, at once).
    """
    harden_connection(nc)  # a refusal fails at once (below: one line), not in 30 s
    js = nc.jetstream()

    async def create() -> tuple[KeyValue, list[str]]:
        # look before creating: a client that may read a bucket but not create it (an
        # agent, an approver) opens an existing one with a stream info request only
        try:
            kv = await js.key_value(config.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            try:
                return await js.create_key_value(config=config), []
            except nats.js.errors.BadRequestError:  # created meanwhile with another config
                kv = await js.key_value(config.bucket)
        status = await kv.status()
        return kv, config_differences(config, status.stream_info.config)

    try:
        kv, differences = await kv_retry(
            create, deadline_s=deadline_s, what=f"opening bucket {config.bucket}"
        )
    except NotPermittedError as exc:
        raise bucket_refusal(config.bucket, exc) from exc
    except HookbusTimeoutError as exc:
        raise HookbusTimeoutError(
            f"{exc} (if the bucket does not exist yet and this client's NATS user may not"
            " create it, start the dispatcher service or run an admin command first)"
        ) from exc.__cause__
    except nats.js.errors.APIError as exc:  # e.g. R3 asked of a server that is not clustered
        raise BucketConfigError(
            f"cannot create bucket {config.bucket} as asked (replicas {config.replicas}, "
            f"ttl {config.ttl or 0:g} s): {getattr(exc, 'description', None) or exc}"
        ) from exc
    if differences:
        text = "; ".join(differences)
        if strict:
            raise BucketConfigError(f"bucket {config.bucket} exists with another config: {text}")
        log.warning("bucket %s exists with another config, used as it is: %s", config.bucket, text)
    return kv


async def ensure_buckets(
    nc: NATS,
    *,
    replicas: int = 1,
    suspension_ttl_s: float = 7 * 24 * 3600,
    approval_ttl_s: float | None = 7 * 24 * 3600,
    strict: bool = False,
    deadline_s: float = 30.0,
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
    Raises:
        BucketConfigError: `strict` and a bucket differs from what was asked, or
            JetStream refused to create one as asked.
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
    """
    configs = [
        handlers_bucket_config(replicas=replicas),
        suspensions_bucket_config(ttl_s=suspension_ttl_s, replicas=replicas),
    ]
    if approval_ttl_s is not None:
        configs.append(approvals_bucket_config(ttl_s=approval_ttl_s, replicas=replicas))
    for config in configs:
        await open_bucket(nc, config, strict=strict, deadline_s=deadline_s)
