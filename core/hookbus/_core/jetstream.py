"""Opening a JetStream KV bucket (and reporting one that exists with another
configuration), and retrying idempotent JetStream calls through a leader election: one
version for the workers and the dispatcher.

During a meta or stream leader election (4-6 s on a 3-node cluster) the JetStream API
answers 503 ("temporarily unavailable"), no responders, or nothing at all (a nats-py
timeout); the same call succeeds once a leader is elected. `kv_retry` retries exactly
those, with jittered exponential backoff, and never past the caller's deadline
(`hookbus._core.deadlines.caller_deadline`). It is for
idempotent calls only (reads, bucket creation, unconditional deletes, a flush): a
compare-and-set write whose outcome is unknown must be re-read and reconciled, not retried
blindly. Each caller passes its own logger, so the log keeps naming the side that retried.

**JetStream domains** (a hub with leaf sites): `jetstream_context` is the one place a
JetStream context is made, with the domain given or the one bound to the connection
(`bind_js_domain`); a bucket opened in a domain is a `DomainKeyValue`, whose writes go to
``$JS.<domain>.API.$KV.<bucket>.<key>`` (nats-py publishes them on ``$KV.<bucket>.<key>``,
which a hub does not answer across a leaf link). `open_bucket` refuses to create a bucket in
a JetStream that is not the one asked for (`JetStreamDomainError`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.api import KeyValueConfig
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, MSG_ROLLUP_SUBJECT, KeyValue, _is_key_valid
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

from hookbus.schemas import (
    BucketConfigError,
    HookbusError,
    HookbusTimeoutError,
    JetStreamDomainError,
    NotPermittedError,
    is_js_domain_name,
)

from .buckets import config_differences, placement_text
from .deadlines import Deadline, time_left
from .leader_reads import LeaderKeyValue, direct_allowed
from .nats_guard import bucket_refusal, harden_connection

__all__ = [
    "CREATE_DEADLINE_S",
    "DomainKeyValue",
    "LeaderKeyValue",
    "bind_js_domain",
    "bind_key_value",
    "existing_key_value",
    "is_transient",
    "jetstream_context",
    "js_domain_of",
    "kv_put_prefix",
    "kv_retry",
    "open_bucket",
]

T = TypeVar("T")

_TRANSIENT: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError subclasses it; so does our per-try bound
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


NO_JETSTREAM_S = 3.0
"""How long JetStream may answer "no responders" before `open_bucket` says none answers
here (a leaf node without JetStream, or a JetStream domain not reachable), seconds."""

_DOMAIN_MARK = "_hookbus_js_domain"


def bind_js_domain(nc: Any, js_domain: str | None) -> None:
    """Record that every hookbus JetStream call on `nc` goes to the JetStream domain
    `js_domain` (None: nothing recorded; the connection keeps what it had).

    Raises:
        HookbusError: `nc` is already bound to another domain (one connection reaches one
            domain's buckets), or `js_domain` is empty or has ``.``, ``*``, ``>`` or a space.
    """
    if js_domain is None:
        return
    if not is_js_domain_name(js_domain):
        raise HookbusError(f"{js_domain!r} is not a JetStream domain name")
    bound = getattr(nc, _DOMAIN_MARK, None)
    if bound is not None and bound != js_domain:
        raise HookbusError(
            f"this connection already uses JetStream domain {bound!r}, not {js_domain!r}"
        )
    setattr(nc, _DOMAIN_MARK, js_domain)


def js_domain_of(nc: Any, js_domain: str | None = None) -> str | None:
    """The JetStream domain hookbus uses on `nc`: `js_domain` if given (then bound to `nc`,
    see `bind_js_domain`), else the one bound to `nc`, else None (the connection's own
    ``$JS.API``).

    Raises:
        HookbusError: `js_domain` conflicts with the domain bound to `nc`.
    """
    bind_js_domain(nc, js_domain)
    return getattr(nc, _DOMAIN_MARK, None)


def jetstream_context(nc: NATS, js_domain: str | None = None, **options: Any) -> JetStreamContext:
    """``nc.jetstream(domain=...)`` with the domain of `js_domain_of`; `options` are
    nats-py's (``timeout=`` seconds, ...).

    Raises:
        HookbusError: `js_domain` conflicts with the domain bound to `nc`.
    """
    domain = js_domain_of(nc, js_domain)
    if domain is None:
        return nc.jetstream(**options)
    return nc.jetstream(domain=domain, **options)


def kv_put_prefix(bucket: str, js_domain: str | None) -> str:
    """The subject prefix a write to `bucket`'s keys is published on: ``$KV.<bucket>.``
    without a domain, ``$JS.<domain>.API.$KV.<bucket>.`` in one (reads and watches keep
    ``$KV.<bucket>.``: that is the subject the stream stores)."""
    if js_domain is None:
        return f"$KV.{bucket}."
    return f"$JS.{js_domain}.API.$KV.{bucket}."


class DomainKeyValue(LeaderKeyValue):
    """nats-py's `KeyValue` for a bucket in another JetStream domain: `put`, `create`,
    `update`, `delete` and `purge` publish to ``$JS.<domain>.API.$KV.<bucket>.<key>`` (with
    the headers nats-py's KeyValue sends: ``Nats-Expected-Last-Subject-Sequence`` for
    create and update, ``KV-Operation`` for delete and purge) and return what it returns
    (the revision; True); reads and watches are nats-py's, on ``$KV.<bucket>.<key>``.

    Raises (writes): nats-py's, e.g. ``KeyWrongLastSequenceError``,
    ``NoStreamResponseError`` (nothing answered the domain's API), ``APIError``.
    """

    def __init__(
        self, name: str, stream: str, pre: str, js: JetStreamContext, *,
        domain: str, direct_allowed: bool, direct: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(name, stream, pre, js, direct_allowed=direct_allowed, direct=direct)
        self.js_domain = domain
        self._put_pre = kv_put_prefix(name, domain)

    @classmethod
    def of(cls, kv: KeyValue, domain: str) -> DomainKeyValue:  # type: ignore[override]
        """`kv` (opened on a context of `domain`) with its writes sent to the domain, and
        its reads as `kv` makes them (nats-py's: from the leader, see `LeaderKeyValue`)."""
        return cls(
            kv._name, kv._stream, kv._pre, kv._js, domain=domain,
            direct_allowed=direct_allowed(kv), direct=isinstance(kv, LeaderKeyValue) and kv._direct,
        )  # fmt: skip

    async def put(self, key: str, value: bytes, validate_keys: bool = True) -> int:
        if validate_keys and not _is_key_valid(key):
            raise nats.js.errors.InvalidKeyError(key)
        pa = await self._js.publish(f"{self._put_pre}{key}", value)
        return pa.seq

    async def _update(
        self,
        key: str,
        value: bytes,
        last: int | None = None,
        validate_keys: bool = True,
        msg_ttl: float | None = None,
    ) -> int:
        if validate_keys and not _is_key_valid(key):
            raise nats.js.errors.InvalidKeyError(key)
        hdrs = {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last or 0)}
        try:
            pa = await self._js.publish(
                f"{self._put_pre}{key}", value, headers=hdrs, msg_ttl=msg_ttl
            )
        except nats.js.errors.APIError as err:
            if err.err_code in (10071, 10164):  # wrong last sequence
                raise nats.js.errors.KeyWrongLastSequenceError(description=err.description) from err
            raise
        return pa.seq

    async def delete(
        self,
        key: str,
        last: int | None = None,
        validate_keys: bool = True,
        msg_ttl: float | None = None,
    ) -> bool:
        if validate_keys and not _is_key_valid(key):
            raise nats.js.errors.InvalidKeyError(key)
        hdrs = {KV_OP: KV_DEL}
        if last and last > 0:
            hdrs[api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(last)
        await self._js.publish(f"{self._put_pre}{key}", headers=hdrs)
        return True

    async def purge(self, key: str, msg_ttl: float | None = None) -> bool:
        hdrs = {KV_OP: KV_PURGE, api.Header.ROLLUP: MSG_ROLLUP_SUBJECT}
        await self._js.publish(f"{self._put_pre}{key}", headers=hdrs, msg_ttl=msg_ttl)
        return True


def _in_domain(kv: KeyValue, domain: str | None) -> LeaderKeyValue:
    """`kv` reading from its stream's leader (`LeaderKeyValue`), and in a domain a
    `DomainKeyValue`."""
    if domain is None:
        return kv if isinstance(kv, LeaderKeyValue) else LeaderKeyValue.of(kv)
    return kv if isinstance(kv, DomainKeyValue) else DomainKeyValue.of(kv, domain)


def bind_key_value(
    nc: NATS, bucket: str, *, js_domain: str | None = None, direct: bool = False
) -> KeyValue:
    """A `KeyValue` on `bucket` made without a request (no stream info: for an identity
    that may only read its own keys), in the domain of `js_domain_of`; `direct`: its gets
    are direct gets, answered by any replica (else by the stream's leader, see
    `LeaderKeyValue`).

    Raises:
        HookbusError: `js_domain` conflicts with the domain bound to `nc`.
    """
    harden_connection(nc)  # a refused read fails at once
    domain = js_domain_of(nc, js_domain)
    kv = LeaderKeyValue(
        bucket, f"KV_{bucket}", f"$KV.{bucket}.", jetstream_context(nc, domain),
        direct_allowed=direct, direct=direct,
    )  # fmt: skip
    return _in_domain(kv, domain)


async def existing_key_value(
    nc: NATS, bucket: str, *, js_domain: str | None = None
) -> LeaderKeyValue:
    """The existing bucket `bucket` (one stream info request, never a create) in the
    domain of `js_domain_of`, reading from its stream's leader (`LeaderKeyValue`); a
    `DomainKeyValue` in a domain.

    Raises:
        nats.js.errors.BucketNotFoundError: no such bucket there.
        HookbusError: `js_domain` conflicts with the domain bound to `nc`.
    """
    harden_connection(nc)  # a refused read fails at once (see `LeaderKeyValue`)
    domain = js_domain_of(nc, js_domain)
    return _in_domain(await jetstream_context(nc, domain).key_value(bucket), domain)


WRITE_IN_FLIGHT = 10164
"""JetStream's "wrong last sequence" with no sequence (``JSStreamWrongLastSequenceConstantErr``):
a clustered stream's leader could not check a write's expected revision because an earlier
write to the same key is still being replicated. That write may be this writer's own try
whose ack was lost, so the outcome is unknown until it settles: not a lost race (error
10071, "wrong last sequence: <n>", is one). Shown by
``pytest tests/test_suspension_deadlines.py -k unreplicated``."""


def is_write_in_flight(exc: BaseException) -> bool:
    """Whether `exc` is `WRITE_IN_FLIGHT`, raw (an ``APIError``, as nats-py's ``delete``
    raises it) or as nats-py's ``create`` / ``update`` raise it (a
    ``KeyWrongLastSequenceError`` keeping only the description)."""
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return (exc.description or "").strip() == "wrong last sequence"
    code = getattr(exc, "err_code", None)
    return isinstance(exc, nats.js.errors.APIError) and code == WRITE_IN_FLIGHT


CREATE_DEADLINE_S = 30.0
"""Seconds a bucket's or stream's create is retried through transient refusals (a leader
election, a peer offline) before it fails (`open_bucket`'s default)."""

NO_PEERS = 10005
"""JetStream's "no suitable peers for placement" (a stream create asking more replicas
than the servers it may use). With the reason "peer offline" the servers exist and one is
not yet back (a node restarting, or just restarted and not yet seen by the meta leader):
transient, retried within the deadline; any other reason is not."""


def is_peer_offline(exc: BaseException) -> bool:
    """Whether `exc` is `NO_PEERS` because a peer is offline (see there)."""
    return (
        isinstance(exc, nats.js.errors.APIError)
        and getattr(exc, "err_code", None) == NO_PEERS
        and "peer offline" in (getattr(exc, "description", None) or "")
    )


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is what a KV call raises while JetStream elects a leader (or the
    client reconnects, or an earlier write to the key is still being replicated, or a
    restarted peer is not yet back): a timeout, no responders, no stream response, a 503
    API error, `WRITE_IN_FLIGHT`, or `NO_PEERS` with a peer offline."""
    if isinstance(exc, _TRANSIENT) or is_write_in_flight(exc) or is_peer_offline(exc):
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
    have passed, or the caller's deadline (`caller_deadline`) if that comes first; each
    try is also bounded by the time left.

    Only for idempotent operations (see the module docstring). A non-transient error
    (``KeyNotFoundError``, a 400, ...) is raised at once, unchanged.

    Args:
        op: a fresh awaitable per call, e.g. ``lambda: kv.get(key)``.
        deadline_s: seconds from now after which no try starts and the running one is
            cancelled (cut to the caller's deadline, see `time_left`).
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
    asked_s, deadline_s = deadline_s, time_left(deadline_s)
    deadline = Deadline.after(deadline_s, loop.time())
    backoff = wait_exponential_jitter(
        multiplier=initial_wait_s, max=max_wait_s, jitter=initial_wait_s
    )

    def wait(state: RetryCallState) -> float:
        return deadline.cut(backoff(state), loop.time())

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
                if deadline.passed(loop.time()):
                    raise TimeoutError(f"{what}: no time left")
                async with deadline.timeout():
                    result = await op()
    except Exception as exc:
        if not is_transient(exc):
            raise
        within = f"{deadline_s:g} s" + (" (the caller's deadline)" if deadline_s < asked_s else "")
        raise HookbusTimeoutError(
            f"{what} did not succeed within {within} (JetStream unavailable: "
            f"{type(exc).__name__}: {exc})"
        ) from exc
    return result


def _no_responders(exc: BaseException) -> bool:
    """Whether `exc` says nothing subscribes to the JetStream API (nats-py raises a bare
    503 `ServiceUnavailableError` from a "no responders" status; JetStream's own 503
    during an election carries an error code)."""
    if isinstance(exc, nats.errors.NoRespondersError):
        return True
    return isinstance(exc, nats.js.errors.ServiceUnavailableError) and isinstance(
        exc.__context__, nats.errors.NoRespondersError
    )


def _no_jetstream(domain: str | None) -> JetStreamDomainError:
    if domain is None:
        return JetStreamDomainError(
            "no JetStream answers here ($JS.API: no responders): at a leaf node, give "
            "js_domain (--js-domain) naming the hub's domain; else the server runs without "
            "JetStream, or this identity may not use it"
        )
    return JetStreamDomainError(
        f"no JetStream answers for domain {domain!r} ($JS.{domain}.API: no responders): the "
        "link to the site holding it is down, or no server has that domain"
    )


async def _check_domain(js: JetStreamContext, domain: str | None, bucket: str) -> None:
    """Refuse (`JetStreamDomainError`) to create `bucket` in a JetStream whose domain is not
    `domain`; an identity that may not read the account info is not checked."""
    try:
        info = await js.account_info()
    except NotPermittedError:
        return
    found = info.domain or None
    if found == domain:
        return
    if domain is None:
        raise JetStreamDomainError(
            f"this JetStream is domain {found!r} and has no bucket {bucket}: the fleet's "
            f"buckets are not here; give js_domain (--js-domain) naming the domain that holds "
            f"the handler registry (not creating {bucket} in {found!r})"
        )
    raise JetStreamDomainError(
        f"js_domain {domain!r} was asked but the JetStream answering is domain "
        f"{found or '(none)'!r}: the fleet's buckets are not there (not creating {bucket})"
    )


async def open_bucket(
    nc: NATS,
    config: KeyValueConfig,
    *,
    log: logging.Logger,
    strict: bool = False,
    deadline_s: float = CREATE_DEADLINE_S,
    js_domain: str | None = None,
    check_replicas: bool = False,
    differences_out: list[str] | None = None,
) -> KeyValue:
    """The bucket `config.bucket`, created with `config` if absent (retried through a
    leader election within `deadline_s` seconds), in the JetStream domain of `js_domain_of`
    (`js_domain`, else the one bound to `nc`, else the connection's own JetStream); in a
    domain it is a `DomainKeyValue`.

    A bucket that exists with another configuration is used as it is (JetStream keeps a
    stream's config), and reported: a WARNING naming each difference (TTL, history,
    storage, direct get, placement when `config` has one; see `config_differences`) on
    `log`, or, with `strict`, an error. Its replica count is compared only with
    `check_replicas` (provisioning, which decides it): any other client takes the
    bucket's replicas as they are (a DEBUG line, once per bucket and process).

    Args:
        check_replicas: report a replica count other than ``config.replicas``.
        differences_out: if given, the differences are appended to it instead of logged
            (with `strict` they are still raised).

    Fails closed on a JetStream that is not the fleet's: a bucket is created only where
    the answering JetStream's domain (``$JS.API.INFO``) is the one asked for (none asked:
    it must report none).

    Raises:
        BucketConfigError: `strict` and the existing bucket differs from `config`, or
            JetStream refused to create it (e.g. 3 replicas on a single server).
        JetStreamDomainError: the bucket is absent and the JetStream answering reports
            another domain than `js_domain` (or one while none was given); or no JetStream
            answered for `NO_JETSTREAM_S` seconds (a leaf node without JetStream).
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
        NotPermittedError: the bucket is absent and this identity may not create it, or
            may not read it (one line, at once).
        HookbusError: `js_domain` conflicts with the domain bound to `nc`.
    """
    harden_connection(nc)  # a refusal fails at once (below: one line), not in 30 s
    domain = js_domain_of(nc, js_domain)
    js = jetstream_context(nc, domain)
    loop = asyncio.get_running_loop()
    silent_since: float | None = None

    async def create() -> tuple[KeyValue, list[str]]:
        # look before creating: a client that may read a bucket but not create it (an
        # agent, an approver) opens an existing one with a stream info request only
        try:
            kv = await js.key_value(config.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            await _check_domain(js, domain, config.bucket)
            try:
                return await _create_key_value(js, config), []
            except nats.js.errors.BadRequestError as refused:
                try:  # created meanwhile with another config?
                    kv = await js.key_value(config.bucket)
                except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
                    raise refused from None  # no: the server's own reason (e.g. storage)
        status = await kv.status()
        actual = status.stream_info.config
        if not check_replicas and (actual.num_replicas or 1) != (config.replicas or 1):
            _replicas_taken(log, config.bucket, config.replicas or 1, actual.num_replicas or 1)
        return kv, config_differences(config, actual, replicas=check_replicas)

    async def attempt() -> tuple[KeyValue, list[str]]:
        nonlocal silent_since
        try:
            result = await create()
        except Exception as exc:
            if not _no_responders(exc):
                silent_since = None
                raise
            now = loop.time()
            silent_since = now if silent_since is None else silent_since
            if now - silent_since >= NO_JETSTREAM_S:
                raise _no_jetstream(domain) from None
            raise
        return result

    try:
        kv, differences = await kv_retry(
            attempt, deadline_s=deadline_s, what=f"opening bucket {config.bucket}", log=log
        )
    except NotPermittedError as exc:
        raise bucket_refusal(config.bucket, exc) from exc
    except HookbusTimeoutError as exc:
        raise HookbusTimeoutError(
            f"{exc} (if the bucket does not exist yet and this client's NATS user may not"
            " create it, start the dispatcher service or run an admin command first; at a"
            " leaf node, give js_domain (--js-domain) naming the hub's JetStream domain)"
        ) from exc.__cause__
    except nats.js.errors.APIError as exc:  # e.g. R3 asked of a server that is not clustered
        raise BucketConfigError(
            f"cannot create bucket {config.bucket} as asked (replicas {config.replicas}, "
            f"ttl {config.ttl or 0:g} s{_placement_part(config)}): "
            f"{getattr(exc, 'description', None) or exc}"
        ) from exc
    if differences:
        text = "; ".join(differences)
        if strict:
            raise BucketConfigError(f"bucket {config.bucket} exists with another config: {text}")
        if differences_out is not None:
            differences_out.extend(differences)
            return _in_domain(kv, domain)
        log.warning("bucket %s exists with another config, used as it is: %s", config.bucket, text)
    return _in_domain(kv, domain)


def _placement_part(config: KeyValueConfig) -> str:
    return "" if config.placement is None else f", placement {placement_text(config.placement)}"


_REPLICAS_TAKEN: set[str] = set()


def _replicas_taken(log: logging.Logger, bucket: str, asked: int, actual: int) -> None:
    """Log once per bucket and process (DEBUG) that an existing bucket's replicas are used."""
    if bucket in _REPLICAS_TAKEN:
        return
    _REPLICAS_TAKEN.add(bucket)
    log.debug(
        "bucket %s has %d replicas (this process would create %d): used", bucket, actual, asked
    )


async def _create_key_value(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """``js.create_key_value(config)``, with `config`'s placement given to the stream (nats-py
    leaves a KV config's placement out of the stream it creates)."""
    if config.placement is None:
        return await js.create_key_value(config=config)
    add_stream = js.add_stream

    async def add_placed(stream: api.StreamConfig | None = None, **params: Any) -> Any:
        if stream is not None:
            stream = dataclasses.replace(stream, placement=config.placement)
        return await add_stream(stream, **params)

    js.add_stream = add_placed  # type: ignore[method-assign]
    try:
        return await js.create_key_value(config=config)
    finally:
        del js.add_stream
