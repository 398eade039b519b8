"""Opening a JetStream KV bucket (and reporting one that exists with another
configuration), and retrying idempotent JetStream calls through a leader election: one
version for the workers and the dispatcher.

During a meta or stream leader election (4-6 s on a 3-node cluster) the JetStream API
answers 503 ("temporarily unavailable"), no responders, or nothing at all (a nats-py
timeout); the same call succeeds once a leader is elected. `kv_retry` retries exactly
those, with jittered exponential backoff, and never past the caller's deadline. It is for
idempotent calls only (reads, bucket creation, unconditional deletes, a flush): a
compare-and-set write whose outcome is unknown must be re-read and reconciled, not retried
blindly. Each caller passes its own logger, so the log keeps naming the side that retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

from hookbus.schemas import BucketConfigError, HookbusTimeoutError, NotPermittedError

from .buckets import config_differences
from .nats_guard import bucket_refusal, harden_connection

__all__ = ["is_transient", "kv_retry", "open_bucket"]

T = TypeVar("T")

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
    log: logging.Logger,
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
        log: where each failed try is logged (INFO): the caller's own logger
            (``hookbus.dispatcher``, ``hookbus.workers``).
        initial_wait_s, max_wait_s: the jittered exponential backoff between tries,
            seconds.
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


async def open_bucket(
    nc: NATS,
    config: KeyValueConfig,
    *,
    log: logging.Logger,
    strict: bool = False,
    deadline_s: float = 30.0,
) -> KeyValue:
    """The bucket `config.bucket`, created with `config` if absent (retried through a
    leader election within `deadline_s` seconds).

    A bucket that exists with another configuration is used as it is (JetStream keeps a
    stream's config), and reported: a WARNING naming each difference (replicas, TTL,
    history, storage, direct get; see `config_differences`) on `log`, or, with `strict`, an
    error.

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
            create, deadline_s=deadline_s, what=f"opening bucket {config.bucket}", log=log
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
