"""Opening the decision audit trail's stream (`ensure_decisions_stream`): what a
dispatcher's `DecisionLog` does when it starts and what ``hookbus auth provision`` does
for a fleet, so both open, create and check it alike."""

from __future__ import annotations

import logging
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_fixed

from hookbus.schemas import (
    DECISIONS_DEFAULT_MAX_AGE_S,
    DECISIONS_DEFAULT_MAX_BYTES,
    BucketConfigError,
    HookbusTimeoutError,
    decisions_stream_config,
)

from .buckets import bucket_placement, stream_config_differences
from .jetstream import CREATE_DEADLINE_S, is_peer_offline, jetstream_context

__all__ = ["add_stream", "ensure_decisions_stream"]

log = logging.getLogger("hookbus.dispatcher.audit")


async def add_stream(js: Any, config: Any) -> Any:
    """``js.add_stream(config)`` (its `StreamInfo`), asked again every 0.25 s while
    JetStream refuses it because a peer is offline (`is_peer_offline`: a server just
    started or restarting, not yet seen by the meta leader), for up to `CREATE_DEADLINE_S`
    seconds, as a bucket's create is retried (`open_bucket`).

    Raises:
        nats.js.errors.APIError: any other refusal, or a peer still offline at the end.
        TimeoutError: no answer (nats-py's).
    """
    retrying = AsyncRetrying(
        stop=stop_after_delay(CREATE_DEADLINE_S),
        wait=wait_fixed(0.25),
        retry=retry_if_exception(is_peer_offline),
        before_sleep=lambda _: log.info("stream %s: a peer is offline, asking again", config.name),
        reraise=True,
    )
    return await retrying(js.add_stream, config)


async def ensure_decisions_stream(
    nc: NATS,
    *,
    max_age_s: float = DECISIONS_DEFAULT_MAX_AGE_S,
    max_bytes: int = DECISIONS_DEFAULT_MAX_BYTES,
    replicas: int = 1,
    strict: bool = False,
    timeout_s: float = 5.0,
    check_replicas: bool = False,
) -> None:
    """Open the decisions stream with a stream info request; create it only if it is absent
    (`replicas` of them, placed as `hookbus._core.buckets.bucket_placement` says).

    A stream that exists with another config is used as it is and reported (a WARNING, or
    `BucketConfigError` with `strict`); its replica count is compared only with
    `check_replicas` (provisioning decides replicas: a client opening an R3 stream without
    a replicas option accepts it, said once at debug). If the info request gets no answer within
    `timeout_s` (this NATS user may publish records but not read the stream's info), a
    WARNING says so and the records are published anyway (a missing stream then shows as
    dropped records).

    Raises:
        HookbusTimeoutError: the stream is absent and the create request got no answer
            within `timeout_s` seconds (this user may not create streams: an admin, or a
            dispatcher service started with the audit trail on, creates it).
        BucketConfigError: JetStream refused to create it as asked (e.g. 3 replicas on a
            single server, or another stream already holds its subjects), or `strict` and it
            exists with another config.
    """
    config = decisions_stream_config(
        max_age_s=max_age_s, max_bytes=max_bytes, replicas=replicas, placement=bucket_placement()
    )
    name = config.name or ""
    js = jetstream_context(nc, timeout=timeout_s)
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        info = None
    except (TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError) as exc:
        log.warning(
            "decision audit: cannot read stream %s (%s); appending records anyway",
            name,
            getattr(exc, "description", None) or type(exc).__name__,
        )
        return
    if info is None:
        try:
            info = await add_stream(js, config)
            log.info("decision audit: created stream %s", name)
        except TimeoutError as exc:  # a refused request is not answered: it times out
            raise HookbusTimeoutError(
                f"cannot create the decision audit stream {name}: no answer within"
                f" {timeout_s:g} s (this NATS user may not create streams: let an admin, or"
                " `hookbus dispatcher --audit`, create it)"
            ) from exc
        except nats.js.errors.APIError as exc:
            info = await _created_meanwhile(js, name)
            if info is None:  # e.g. R3 on a single server, subjects held by another stream
                raise BucketConfigError(
                    f"cannot create the decision audit stream {name} as asked (replicas"
                    f" {replicas}): {getattr(exc, 'description', None) or exc}"
                ) from exc
    differences = stream_config_differences(config, info.config)
    if not check_replicas:
        kept = [d for d in differences if not d.startswith("replicas:")]
        if len(kept) < len(differences):
            log.debug("stream %s has another replica count, used as it is", name)
        differences = kept
    if differences:
        text = "; ".join(differences)
        if strict:
            raise BucketConfigError(f"stream {name} exists with another config: {text}")
        log.warning("stream %s exists with another config, used as it is: %s", name, text)


async def _created_meanwhile(js: Any, name: str) -> Any:
    """The stream's info if another process created it meanwhile, else None."""
    try:
        return await js.stream_info(name)
    except (TimeoutError, nats.errors.Error):
        return None
