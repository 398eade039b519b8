"""Declaring a worker's handlers in the registry bucket, and showing the worker as live.

Declaring is a compare-and-set per handler key, so two workers racing for one name cannot
both win:

- no declaration (or only a delete marker): create it;
- the same declaration (another replica of this handler): written again at the revision
  read (each replica's start shows as a put in a watch; nothing changes);
- another declaration (an option of `hookbus._core.handler_options.OPTIONS` differs):
  with ``replace=True`` overwritten at the revision read; else the workers' liveness is
  pinged (``$SRV.PING.hookbus-worker``): when no other worker process serves that handler
  now (its workers stopped: a restart with one setting changed), it is taken over with a
  WARNING naming each difference (the failure policy decides fail-open or fail-closed);
  when some do, or the ping cannot tell (this process's own service did not answer it, e.g.
  the identity may not ping), it is refused with `HandlerConflictError` naming each
  difference and how many replicas are live;
- a record that does not validate: overwritten at the revision read (logged).

During a JetStream leader election (4-6 s on a cluster) the bucket API answers 503, no
responders or nothing at all: every step is retried with jittered exponential backoff
(tenacity) until `deadline_s` (30 s by default). A write whose answer was lost is not
retried blindly: the loop re-reads the key and finds its own declaration.

Liveness: every worker process runs a service of the NATS services API (``nats.micro``,
name `WORKER_SERVICE_NAME`) whose ``handlers`` metadata lists the handler keys it serves;
``$SRV.PING.hookbus-worker`` reaches every live replica (see `hookbus handlers`). A worker
starts its service before it declares: two workers racing with different settings then see
each other (the one that lost the compare-and-set finds the winner live and is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.service import Service, ServiceConfig

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.deadlines import Deadline
from hookbus._core.declarations import check_declaration, declaration_differences
from hookbus._core.jetstream import is_transient, kv_retry, open_bucket
from hookbus.schemas import (
    WORKER_SERVICE_NAME,
    BadRequestError,
    HandlerConflictError,
    HandlerDeclaration,
    encode,
    format_served_handlers,
    handler_key,
    parse_served_handlers,
)

__all__ = [
    "LivenessProbe",
    "declare_handlers",
    "flush_subscriptions",
    "is_transient",
    "open_registry",
    "start_liveness",
    "stop_liveness",
]

log = logging.getLogger("hookbus.workers")

T = TypeVar("T")


async def _retrying(op: Callable[[], Awaitable[T]], *, deadline: Deadline, what: str) -> T:
    """`op()` retried on transient errors until `deadline` (`kv_retry`, with one deadline
    shared by several calls).

    Raises:
        HookbusTimeoutError: still failing transiently at the deadline (cause: last error).
    """
    left = deadline.left(asyncio.get_running_loop().time())
    return await kv_retry(op, deadline_s=left, what=what, log=log)


async def flush_subscriptions(nc: NATS, *, deadline_s: float = 30.0) -> None:
    """Flush (the server has every subscription once this returns), retried while the
    client reconnects, e.g. after its server died in a cluster, for up to `deadline_s` s.

    Raises:
        HookbusTimeoutError: the server did not answer the flush within `deadline_s`.
    """
    deadline = Deadline.after(deadline_s, asyncio.get_running_loop().time())
    await _retrying(nc.flush, deadline=deadline, what="flushing the subscriptions")


async def open_registry(
    nc: NATS, *, replicas: int = 1, deadline_s: float = 30.0, js_domain: str | None = None
) -> KeyValue:
    """The handlers bucket, created if absent, retried through a leader election for up to
    `deadline_s` seconds. A bucket that exists with another config is used and reported.

    Raises:
        BucketConfigError: JetStream refused to create the bucket as asked (e.g. 3
            replicas on a single server).
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
        NotPermittedError: the bucket is absent and this identity may not create it, or
            may not read it (one line, at once).
        JetStreamDomainError: the bucket is absent and the answering JetStream is not the
            domain `js_domain` (None: the one bound to `nc`, else none), or none answers.
    """
    config = handlers_bucket_config(replicas=replicas)
    return await open_bucket(nc, config, log=log, deadline_s=deadline_s, js_domain=js_domain)


LIVENESS_PING_S = 1.0
"""How long a worker gathers the answers to its liveness ping before taking over a
declaration with other settings, seconds."""


@dataclass
class LivenessProbe:
    """Which other worker processes serve a handler now: one ``$SRV.PING.hookbus-worker``
    scatter on `nc`, answers gathered for `timeout_s` seconds, this process's own service
    (`own_id`) left out. The answer is trusted only when `own_id` answered too: a refused
    or lost ping (no answer at all) cannot tell "none live"."""

    nc: NATS
    own_id: str
    timeout_s: float = LIVENESS_PING_S

    async def others_serving(self, event: str, name: str) -> int | None:
        """How many other live worker processes serve ``(event, name)``; None when the
        ping cannot tell (this process's own service did not answer it)."""
        answers: list[bytes] = []
        inbox = self.nc.new_inbox()

        async def on_reply(msg: Msg) -> None:
            answers.append(msg.data)

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            await self.nc.publish(f"$SRV.PING.{WORKER_SERVICE_NAME}", b"", reply=inbox)
            await self.nc.flush()
            await asyncio.sleep(self.timeout_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        own, others = False, set()
        for data in list(answers):
            try:
                body = json.loads(data)
                service_id = str(body["id"])
                metadata = body.get("metadata") or {}
                served = parse_served_handlers(metadata.get("handlers"))
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue
            if service_id == self.own_id:
                own = True
            elif (event, name) in served:
                others.add(service_id)
        return len(others) if own else None


async def _declare_one(
    kv: KeyValue, decl: HandlerDeclaration, replace: bool, probe: LivenessProbe | None = None
) -> None:
    key = handler_key(decl.event, decl.name)
    value = encode(decl)
    for _ in range(100):  # each turn lost a race to another writer: bounded
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:  # absent, or a delete marker
            try:
                await kv.create(key, value)
                return
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                if is_transient(exc):  # an earlier try still in flight: retried with backoff
                    raise
                continue  # someone else declared it meanwhile: compare with theirs
            except nats.js.errors.KeyNotFoundError as exc:
                # the stream refused "absent" yet a read finds nothing: the replica read is
                # behind its leader (JetStream without quorum); retried with backoff
                raise TimeoutError(f"the registry's replicas disagree on {key!r}") from exc
        try:
            live: HandlerDeclaration | None = check_declaration(key, entry.value)
        except BadRequestError as exc:
            log.warning("overwriting the bad record at %r: %s", key, exc)
            live = None
        if live is not None:
            differences = declaration_differences(live, decl)
            if differences and not replace:
                serving = None
                if probe is not None:
                    serving = await probe.others_serving(decl.event, decl.name)
                if serving != 0:
                    live_now = f"{serving} replica(s) of it live now"
                    if serving is None and probe is None:
                        live_now = "it may have live replicas"
                    elif serving is None:
                        live_now = "its live replicas unknown (no liveness ping answered)"
                    raise HandlerConflictError(
                        f"handler {decl.name!r} of {decl.event!r} is already declared with"
                        f" other settings ({'; '.join(differences)}), {live_now}; declare it"
                        " with replace=True (hookbus worker --replace) to take the name over"
                    )
                log.warning(
                    "taking over handler %s of %s, declared with other settings and no"
                    " replica of it live: %s",
                    decl.name, decl.event, "; ".join(differences),
                )  # fmt: skip
            elif differences:
                log.warning(
                    "replacing handler %s of %s: %s", decl.name, decl.event, "; ".join(differences)
                )
            # no differences: another replica's declaration (or ours, its ack lost); written
            # again at the revision read, so that every replica's start shows in a watch
        try:
            await kv.update(key, value, last=entry.revision)
            return
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            if is_transient(exc):
                raise
            continue
    raise HandlerConflictError(f"handler {decl.name!r} of {decl.event!r}: too many racing writers")


async def declare_handlers(
    kv: KeyValue,
    declarations: Iterable[tuple[HandlerDeclaration, bool]],
    *,
    deadline_s: float = 30.0,
    probe: LivenessProbe | None = None,
) -> None:
    """Declare each handler (compare-and-set; see the module docstring), each retried
    through a leader election within one overall `deadline_s` seconds.

    Args:
        kv: the handlers bucket (`open_registry`).
        declarations: ``(declaration, replace)`` pairs.
        probe: this process's liveness (its service started): a declaration with other
            settings is taken over when no other process serves its handler. None: always
            refused (unless `replace`).
    Raises:
        HandlerConflictError: a name is declared with other settings, `replace` is false,
            and a replica of it is live (or no probe, or the probe cannot tell).
        HookbusTimeoutError: JetStream stayed unavailable for `deadline_s` seconds.
    """
    deadline = Deadline.after(deadline_s, asyncio.get_running_loop().time())
    for decl, replace in declarations:

        async def once(decl: HandlerDeclaration = decl, replace: bool = replace) -> None:
            await _declare_one(kv, decl, replace, probe)

        await _retrying(once, deadline=deadline, what=f"declaring handler {decl.name}")


def _version() -> str:
    try:
        return importlib.metadata.version("hookbus")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def start_liveness(nc: NATS, handlers: Iterable[tuple[str, str]]) -> Service:
    """Start this process's `WORKER_SERVICE_NAME` service (``nats.micro``: answers
    ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS``) with the ``(event, name)`` pairs it
    serves in its ``handlers`` metadata. Stop it with `stop_liveness` before draining."""
    config = ServiceConfig(
        name=WORKER_SERVICE_NAME,
        version=_version(),
        description="hookbus hook worker",
        metadata={"handlers": format_served_handlers(list(handlers))},
        queue_group=WORKER_SERVICE_NAME,
    )
    return await add_service(nc, config)


async def stop_liveness(service: Service | None) -> None:
    """Stop answering liveness pings (idempotent; a lost connection is ignored)."""
    if service is None:
        return
    with contextlib.suppress(Exception):
        await service.stop()
