"""`HookWorker`: serve hook handlers on NATS, one queue group per handler."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable
from types import CoroutineType
from typing import Any, Final, TypeVar

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro.service import Service

from hookbus._core.copies import json_copy
from hookbus._core.fold_rules import StepOutcome, ends_fold, group_end, modifies, widest_group
from hookbus._core.handler_options import (
    DEFAULT_FAILURE_POLICY,
    DEFAULT_PRIORITY,
    DEFAULT_TIMEOUT_S,
    OPTIONS,
    HandlerOptions,
    is_async_handler,
)
from hookbus._core.jetstream import existing_key_value
from hookbus._core.log_limits import RateLimitedWarning
from hookbus._core.nats_guard import harden_connection, reply_now, send_now
from hookbus._core.results import to_hook_result
from hookbus._core.serving import Admission, Endpoint, Refusal, ServingLoop
from hookbus.schemas import (
    HANDLERS_BUCKET,
    MAX_HANDLER_SET,
    MAX_RECORD_BYTES,
    BadRequestError,
    ChainStep,
    EventEnvelope,
    FailurePolicy,
    HandlerDeclaration,
    HookbusError,
    HookReply,
    NotConnectedError,
    WireError,
    WireFormatError,
    chain_instance_subject,
    chain_queue_group,
    chain_subject,
    collect_subject,
    decode,
    encode,
    handler_instance_subject,
    handler_key,
    handler_queue_group,
    handler_set_id,
    handler_subject,
    validate_name,
)

from ._chain_progress import ChainProgress
from ._coroutines import Resumed
from ._registration import (
    LivenessProbe,
    declare_handlers,
    flush_subscriptions,
    open_registry,
    start_liveness,
    stop_liveness,
)
from ._spec import Handler, HandlerSpec
from ._stalls import LoopStalls
from ._telemetry import chain_handling, handling_span, traced_handling
from ._telemetry_core import otel

__all__ = ["HookWorker"]

log = logging.getLogger("hookbus.workers")

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")


class HookWorker:
    """A worker process's hook handlers, served on NATS.

    Each handler gets its own subject and queue group (``hookbus.v1.handler.<event>.<name>``),
    so replicas of the same worker share its load, and its declaration is written to the
    handler registry bucket, where dispatchers pick it up. Each request runs in a task of
    its own, at most `max_concurrency` at a time: a request over that bound is refused at
    once with a retryable ``busy`` error (the dispatcher sends it to another replica)
    instead of waiting into the caller's timeout. A request runs at most its handler's
    `timeout_s` and never longer than the caller still waits (the envelope's ``budget_s``,
    counted from receipt on this host's monotonic clock: wall clocks may disagree). Every
    request gets an answer, never silence: a result or a `WireError`. `shutdown` drains
    within a grace period.

    Use ``async with HookWorker(nc) as w: ...`` or ``await w.run()`` (serves until
    `shutdown` or, with ``handle_signals=True``, SIGTERM / SIGINT). Handlers may be added
    with the `handler` decorator before the worker has a connection (`hookbus worker
    module:attr` gives it one).

    Args:
        nc: a connected nats-py client (or give it to `start` later).
        max_concurrency: requests handled at once by this process (all handlers together).
        bucket_replicas: replicas of the registry bucket if this worker creates it.
        replace: take over handler names already declared with other settings (default:
            `start` raises `HandlerConflictError` while a replica of that handler is live,
            and takes the declaration over with a WARNING when none is); per handler with
            ``replace=`` too.
        registration_timeout_s: seconds `start` keeps retrying the registry through a
            JetStream leader election before it raises `HookbusTimeoutError`.
        js_domain: the JetStream domain holding the handler registry (a worker at a leaf
            site: the hub's, e.g. ``"hub"``); None: the connection's own JetStream. A
            registry absent from a JetStream of another domain is not created there:
            `start` raises `JetStreamDomainError`.
    """

    def __init__(
        self,
        nc: NATS | None = None,
        *,
        max_concurrency: int = 256,
        bucket_replicas: int = 1,
        replace: bool = False,
        registration_timeout_s: float = 30.0,
        js_domain: str | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self._nc = nc
        self.max_concurrency = max_concurrency
        """Requests handled at once by this process; may be changed before `start`."""
        self._bucket_replicas = bucket_replicas
        self._js_domain = js_domain
        self.replace = replace
        """Whether `start` takes over names declared with other settings."""
        self.registration_timeout_s = registration_timeout_s
        self._replace_handlers: dict[tuple[str, str], bool] = {}
        self._liveness: Service | None = None
        self.instance = ""
        """This process's instance id (its liveness service id) once started: every reply
        carries it, and each handler also listens on its instance subject (hedges)."""
        self._specs: dict[tuple[str, str], HandlerSpec] = {}
        self._serving: ServingLoop | None = None
        self._waits: set[tuple[str, str]] = set()
        """Handlers seen to wait on something (suspend) when called: see `_may_wait`."""
        self._returns_at_once: set[tuple[str, str]] = set()
        """Handlers called in a chain that returned without waiting, never seen to wait."""
        self._stalls = LoopStalls()
        """This loop's stalls: a chain request read during or just after one is dated
        from its start (see `LoopStalls`)."""
        self.handler_set_id = ""
        """The id of this process's handler set once started ("" if it cannot be chained):
        chain requests for its handlers of an event come on
        ``chain_subject(event, handler_set_id)``."""
        self._bad_requests = RateLimitedWarning(log)
        self._stopped: asyncio.Event | None = None
        self._state = "new"  # new -> serving -> draining -> stopped
        self.handled = 0
        """Requests answered so far, a chain request counting each handler it ran (for
        tests and stats)."""
        self.refused = 0
        """Requests refused with ``busy`` or ``unavailable`` without running (stats)."""

    # -- declaring handlers ------------------------------------------------------------
    def handler(
        self,
        event: str,
        *,
        priority: int = DEFAULT_PRIORITY,
        name: str | None = None,
        tool_filter: list[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        failure_policy: FailurePolicy = DEFAULT_FAILURE_POLICY,
        parallel: bool = False,
        retry_safe: bool = False,
        pure: bool = False,
        replace: bool | None = None,
    ) -> Callable[[F], F]:
        """Decorator: serve the function as a handler of `event`; returns it unchanged.

        Args:
            event: event name, e.g. ``"tool:pre"``.
            priority: lower runs first (amplifier-core order); ties break by name. An int
                within ±`MAX_PRIORITY` (the registry refuses others).
            name: unique per event; defaults to the function's name.
            tool_filter: globs over ``data["tool_name"]`` (whole name, ignoring case:
                ``bash`` matches ``Bash``; see `ToolFilter`); None matches every call. At
                most `MAX_TOOL_PATTERNS` globs of 1 to `MAX_NAME_LENGTH` characters.
            timeout_s: seconds the dispatcher waits for one call (also enforced here):
                finite and > 0, clamped to `MAX_HANDLER_TIMEOUT_S` (as every dispatcher
                clamps it).
            failure_policy: ``ignore`` (fail open, recorded) or ``deny`` (fail closed).
            parallel: may run concurrently with adjacent parallel handlers; may not modify.
            retry_safe: running it twice for one call is harmless (no side effects, or
                idempotent ones): a dispatcher may then send a slow call to a second
                replica (hedging). Never assumed: without it, a call runs at most once.
            pure: free of side effects (implies `retry_safe`): a dispatcher may call it
                speculatively, at once with the adjacent pure handlers, and fold the
                results in priority order. Never assumed.
            replace: take over this name if it is declared with other settings (None:
                the worker's `replace`).
        Raises:
            BadRequestError: bad event or handler name, or an option out of the bounds
                every dispatcher applies to the declaration (`HandlerOptions.remote`; then
                also a `ValueError`).
            ValueError: a handler of that name is already registered for the event, or the
                worker is already serving.
        """
        options = {o: v for o, v in locals().items() if o in OPTIONS}  # exactly `OPTIONS`

        def decorator(fn: F) -> F:
            self.add_handler(event, fn, name=name, replace=replace, **options)
            return fn

        return decorator

    def add_handler(
        self,
        event: str,
        fn: Handler,
        *,
        priority: int = DEFAULT_PRIORITY,
        name: str | None = None,
        tool_filter: list[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        failure_policy: FailurePolicy = DEFAULT_FAILURE_POLICY,
        parallel: bool = False,
        retry_safe: bool = False,
        pure: bool = False,
        replace: bool | None = None,
    ) -> HandlerSpec:
        """Non-decorator form of `handler`; returns the spec. Raises as `handler` does."""
        given = {o: v for o, v in locals().items() if o in OPTIONS}  # exactly `OPTIONS`
        if self._state != "new":
            raise ValueError("handlers must be added before the worker starts")
        validate_name("event", event)
        name = validate_name("handler", name or getattr(fn, "__name__", ""))
        if (event, name) in self._specs:
            raise ValueError(f"handler {name!r} is already registered for {event!r}")
        options = HandlerOptions.remote(**given)  # the bounds every dispatcher reads it with
        decl = HandlerDeclaration(
            event=event,
            name=name,
            **options.declared(),
            subject=handler_subject(event, name),
            collect_subject=collect_subject(event),
            queue_group=handler_queue_group(name),
        )
        if replace is not None:
            self._replace_handlers[(event, name)] = replace
        spec = self._specs[(event, name)] = HandlerSpec(
            fn=fn,
            declaration=decl,
            is_async=is_async_handler(fn),
            tool_filter=options.tool_filter,
        )
        return spec

    @property
    def handlers(self) -> list[HandlerSpec]:
        return list(self._specs.values())

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self, nc: NATS | None = None) -> None:
        """Subscribe every handler, then declare it in the registry bucket (see
        `_registration`: compare-and-set, retried through a leader election for
        `registration_timeout_s` seconds) and start answering liveness pings.

        Returns once the subscriptions are flushed to the server: a dispatcher may send
        at once. On an error nothing stays subscribed.

        Raises:
            NotConnectedError: no connection.
            HandlerConflictError: a handler name is declared with other settings,
                `replace` is off, and a replica of it is live (or the liveness ping
                cannot tell).
            HookbusTimeoutError: the registry stayed unavailable.
        """
        if self._state != "new":
            return
        self._nc = nc or self._nc
        if self._nc is None:
            raise NotConnectedError("HookWorker.start needs a NATS connection")
        if not self._specs:
            raise ValueError("this worker has no handlers")
        nc_ = self._nc
        harden_connection(nc_)  # before subscribing: the flushes below must follow the SUBs
        self._stopped = asyncio.Event()
        self._stalls.start()
        self._set_handler_set()
        serving = self._serving = ServingLoop(nc_, max_concurrency=self.max_concurrency, log=log)
        for spec in self._specs.values():
            decl = spec.declaration
            await serving.add(self._endpoint(spec, decl.subject, decl.queue_group))
            await serving.add(self._endpoint(spec, decl.collect_subject, decl.queue_group))
        if self.handler_set_id:
            for event in dict.fromkeys(event for event, _ in self._specs):
                chain = chain_subject(event, self.handler_set_id)
                await serving.add(
                    self._chain_endpoint(chain, chain_queue_group(self.handler_set_id))
                )
        try:
            await flush_subscriptions(nc_, deadline_s=self.registration_timeout_s)
            kv = await open_registry(
                nc_, replicas=self._bucket_replicas, deadline_s=self.registration_timeout_s,
                js_domain=self._js_domain,
            )  # fmt: skip
            declarations = [
                (spec.declaration, self._replace_handlers.get(key, self.replace))
                for key, spec in self._specs.items()
            ]
            # liveness first: a racing worker with other settings sees this one live (and
            # this one may take over a declaration whose replicas are all gone)
            self._liveness = await start_liveness(nc_, list(self._specs))
            await declare_handlers(
                kv,
                declarations,
                deadline_s=self.registration_timeout_s,
                probe=LivenessProbe(nc_, self._liveness.id),
            )
            # after the queue subscriptions: a reply names this instance only once its
            # subjects exist (the server handles one connection's SUB before its PUB)
            for spec in self._specs.values():
                decl = spec.declaration
                subject = handler_instance_subject(decl.event, decl.name, self._liveness.id)
                await serving.add(self._endpoint(spec, subject))
            if self.handler_set_id:
                for event in dict.fromkeys(event for event, _ in self._specs):
                    chain = chain_subject(event, self.handler_set_id)
                    subject = chain_instance_subject(chain, self._liveness.id)
                    await serving.add(self._chain_endpoint(subject))
            # the services API ($SRV.*) and the instance subjects: reachable from any
            # connection once start returns
            await flush_subscriptions(nc_, deadline_s=self.registration_timeout_s)
            self.instance = self._liveness.id
        except BaseException:
            self._stalls.stop()
            await stop_liveness(self._liveness)
            self._liveness = None
            await serving.unsubscribe()
            raise
        self._state = "serving"
        log.info(
            "serving %d handler(s): %s", len(self._specs), ", ".join(n for _, n in self._specs)
        )

    async def run(self, nc: NATS | None = None, *, handle_signals: bool = False) -> None:
        """Start (if needed) and serve until `shutdown`; then return, drained.

        With `handle_signals`, SIGTERM and SIGINT start a graceful shutdown.
        """
        await self.start(nc)
        assert self._stopped is not None
        loop = asyncio.get_running_loop()
        installed = []
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))
                    installed.append(sig)
        try:
            await self._stopped.wait()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def shutdown(self, grace_s: float = 20.0) -> None:
        """Stop taking requests, finish what runs within `grace_s` seconds (idempotent).

        Intake stops on every subscription at once (all drained concurrently: the server
        stops sending; messages already buffered are answered ``unavailable``, retryable,
        as is anything arriving meanwhile). Requests in flight get `grace_s` seconds (the
        default stays well below Kubernetes' 30 s termination grace); then they are
        cancelled and answered ``unavailable`` — retryable only for a ``retry_safe``
        handler, since the others may have done part of their work. The connection is
        left open: it belongs to the caller. Declarations stay in the registry (they
        outlive instances); remove one with `unregister` or the CLI.
        """
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            if self._stopped is not None:
                self._stopped.set()
            return
        if self._state == "draining":
            assert self._stopped is not None
            await self._stopped.wait()
            return
        self._state = "draining"
        serving = self._serving
        assert serving is not None
        serving.draining = True
        await stop_liveness(self._liveness)
        deadline = asyncio.get_running_loop().time() + max(grace_s, 0.0)
        await serving.stop_intake()

        async def late(running: int) -> None:
            log.warning("cancelled %d request(s) still running after %ss", running, grace_s)

        # each answers `unavailable` as it ends; one cancelled before it started cannot
        await serving.finish(deadline, cancel_wait_s=5.0, late=late)
        self._stalls.stop()
        self._state = "stopped"
        assert self._stopped is not None
        self._stopped.set()
        log.info("worker drained after %d request(s)", self.handled)

    async def unregister(self) -> None:
        """Delete this worker's declarations from the registry (an explicit act)."""
        if self._nc is None:
            raise NotConnectedError("unregister needs a NATS connection")
        kv = await existing_key_value(self._nc, HANDLERS_BUCKET, js_domain=self._js_domain)
        for event, name in self._specs:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await kv.delete(handler_key(event, name))

    async def __aenter__(self) -> HookWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # -- serving -----------------------------------------------------------------------
    def _endpoint(self, spec: HandlerSpec, subject: str, queue_group: str = "") -> Endpoint:
        """A handler's endpoint on `subject` (its call, collect or instance subject)."""
        harden_connection(self._nc)  # requests come from anyone: none may silence us
        # a partial, not a closure awaiting `_serve`: one coroutine frame less per request
        serve = functools.partial(self._serve, spec)
        return Endpoint(
            subject, serve, self._refusal(spec.declaration.name), queue_group=queue_group
        )

    def _refusal(self, name: str) -> Callable[[Msg, Refusal, int], Awaitable[None]]:
        """The serving loop's refusals of `name`'s requests, answered as `name`."""

        async def refuse(msg: Msg, why: Refusal, received: int) -> None:
            if why == "draining":
                await self._refuse_as(name, msg, "unavailable", "the worker is shutting down")
            else:
                busy = f"over max_concurrency={self.max_concurrency}"
                await self._refuse_as(name, msg, "busy", busy)

        return refuse

    async def _refuse_as(self, name: str, msg: Msg, code: str, message: str) -> None:
        """Answer at once that the request was not run and may be sent again."""
        self.refused += 1
        if msg.reply and self._nc is not None:
            error = WireError(code=code, message=message, retryable=True)
            reply = HookReply(handler=name, error=error, instance=self.instance)
            payload = encode(reply)
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(msg.reply, payload)
                send_now(self._nc)

    async def _serve(self, spec: HandlerSpec, msg: Msg, context: object, received: int) -> None:
        """Serve one request to `spec` (the serving loop's handler; `context` and
        `received` are not used: the budget is counted from here, as `_handle` does)."""
        decl = spec.declaration
        try:
            started = time.monotonic()
            if otel.sync():
                reply = await self._handle(spec, msg)
            else:  # `_handle` without its span's wrapper: one coroutine frame less
                reply = await self._handle_untraced(spec, msg)
            if reply is not None:
                await self._respond(msg, reply)
                if log.isEnabledFor(logging.DEBUG):
                    kind = "collect" if msg.subject == decl.collect_subject else "call"
                    _log_reply(decl, reply, kind, time.monotonic() - started)
        except asyncio.CancelledError:  # shutdown's grace ran out
            error = WireError(
                code="unavailable",
                message="the worker shut down while the handler ran",
                retryable=decl.retry_safe,
            )
            with contextlib.suppress(Exception):
                await self._respond(msg, HookReply(handler=decl.name, error=error))
            raise
        except Exception as exc:  # never let one request take the worker down
            log.exception("unexpected error serving %s", msg.subject)
            if msg.reply and self._nc is not None:  # answer anyway: no wait for a timeout
                error = WireError(code="internal", message=repr(exc))
                with contextlib.suppress(Exception):
                    reply = HookReply(handler=decl.name, error=error, instance=self.instance)
                    await self._nc.publish(msg.reply, encode(reply))
        finally:
            self.handled += 1

    def _handle_untraced(self, spec: HandlerSpec, msg: Msg) -> Awaitable[HookReply | None]:
        """Decode the request and run its handler within its timeout and the caller's
        budget; the reply (None: nothing to send). A plain function returning the
        handler's `_invoke` (one coroutine frame less per request)."""
        received = time.monotonic()
        envelope, refusal = self._read_request(spec.declaration.name, msg)
        if envelope is None:
            return _ready(refusal)
        timeout_s = spec.declaration.timeout_s
        if envelope.budget_s is not None:
            timeout_s = min(timeout_s, envelope.budget_s)  # never more than the caller has left
        timeout_s -= time.monotonic() - received
        return self._invoke(spec, envelope.event, envelope.data, timeout_s, envelope.id)

    _handle = traced_handling(_handle_untraced)
    """`_handle_untraced` in its span and duration point (telemetry on)."""

    def _read_request(
        self, name: str, msg: Msg, decoded: EventEnvelope | None = None
    ) -> tuple[EventEnvelope, None] | tuple[None, HookReply]:
        """The request's envelope, or the error reply that refuses it (`name` answers).
        `decoded`: its envelope if already decoded from ``msg.data`` (None: decode it)."""
        try:
            envelope = decoded if decoded is not None else decode(msg.data, EventEnvelope)
        except WireFormatError as exc:
            self._bad_requests.warn("bad request on %s: %.200s", msg.subject, exc)
            return None, HookReply(
                handler=name, error=WireError(code="bad_request", message=str(exc)[:500])
            )
        budget = envelope.budget_s
        if budget is not None:
            if math.isnan(budget):
                self._bad_requests.warn("bad request on %s: budget_s is NaN", msg.subject)
                return None, HookReply(
                    handler=name,
                    error=WireError(code="bad_request", message="budget_s is not a number"),
                )
            if budget <= 0:  # the caller has given up already: say so, run nothing
                return None, HookReply(
                    handler=name,
                    error=WireError(
                        code="deadline_exceeded",
                        message=f"the caller's budget ({budget}s) was spent on arrival",
                        retryable=True,
                    ),
                )
        return envelope, None

    async def _invoke(
        self,
        spec: HandlerSpec,
        event: str,
        data: dict[str, Any],
        timeout_s: float,
        emit_id: str,
        suspended: Callable[[], None] | None = None,
    ) -> HookReply:
        """Run one handler within `timeout_s` seconds; its result or the error, as a reply.

        The process that runs a handler times it: a handler still running at `timeout_s`
        is cut (``handler_timeout``), and so is one that returns after it without having
        given the loop a chance to cut it (it computed without awaiting): its late result
        is not used, as a dispatcher timing the call would not have used it.
        `suspended()`: called the moment the handler really waits (its coroutine suspends,
        or it runs in a thread), before the loop runs anything else."""
        decl = spec.declaration
        started = time.monotonic()
        try:
            if spec.is_async:
                coro = spec.fn(event, data)
                if type(coro) is not CoroutineType:  # another awaitable: no first step here
                    if suspended is not None:
                        suspended()
                    async with asyncio.timeout(timeout_s):
                        raw = await coro
                else:
                    # The handler's first step runs before any timer is armed: asyncio's
                    # timeout acts only through its timer's callback, which the loop runs
                    # only once the task suspends, so a handler that returns (or raises)
                    # without suspending is never cut by it, and needs no timer at all.
                    # One that suspends gets its timer at the deadline counted from
                    # before its first step, and the rest of it is awaited under it.
                    try:
                        suspended_on = coro.send(None)
                    except StopIteration as done:
                        raw = done.value
                    else:
                        self._waits.add(spec.key)  # it waits: see `_may_wait`
                        if suspended is not None:
                            suspended()
                        loop = asyncio.get_running_loop()
                        deadline = loop.time() + timeout_s - (time.monotonic() - started)
                        async with asyncio.timeout_at(deadline):
                            raw = await Resumed(coro, suspended_on)
            else:
                if suspended is not None:
                    suspended()
                async with asyncio.timeout(timeout_s):  # cheaper than anyio's on this path
                    raw = await anyio.to_thread.run_sync(
                        spec.fn, event, data, abandon_on_cancel=True
                    )
                    if inspect.isawaitable(raw):
                        raw = await raw
            if time.monotonic() - started > timeout_s:
                raise TimeoutError  # it held the loop past its time: nothing could cut it
        except TimeoutError:
            return HookReply(
                handler=decl.name,
                error=WireError(code="handler_timeout", message=f"ran past {timeout_s:.3g}s"),
            )
        except Exception as exc:
            log.warning("handler %s raised on %s: %r", decl.name, emit_id, exc)
            return HookReply(
                handler=decl.name,
                error=WireError(code="handler_error", message=f"{type(exc).__name__}: {exc}"),
            )
        try:
            result = _CONTINUE if raw is None else to_hook_result(raw)
        except HookbusError as exc:
            return HookReply(
                handler=decl.name, error=WireError(code="bad_result", message=str(exc))
            )
        return HookReply(handler=decl.name, result=result)

    # -- chain requests: a sequence of this process's handlers in one request --------------------
    def _set_handler_set(self) -> None:
        """Name this process's handler set in every declaration, if it fits the bounds."""
        names = sorted({name for _, name in self._specs})
        if len(names) > MAX_HANDLER_SET:
            log.info("%d handlers: more than %d, not sent as chains", len(names), MAX_HANDLER_SET)
            return
        declared = {
            key: msgspec.structs.replace(spec.declaration, handler_set=names)
            for key, spec in self._specs.items()
        }
        if any(len(encode(d)) > MAX_RECORD_BYTES for d in declared.values()):
            log.info("handler names too long to declare their set: not sent as chains")
            return
        for key, decl in declared.items():
            self._specs[key] = dataclasses.replace(self._specs[key], declaration=decl)
        self.handler_set_id = handler_set_id(names)

    def _chain_endpoint(self, subject: str, queue_group: str = "") -> Endpoint:
        """The endpoint of this process's chain requests on `subject`."""
        return Endpoint(
            subject,
            self._serve_chain,
            self._refusal(self.handler_set_id),
            queue_group=queue_group,
            admit=self._admit_chain,
        )

    def _admit_chain(self, msg: Msg, received: int) -> Admission | Awaitable[None]:
        # a chain takes one slot of max_concurrency per handler it may run at once (its
        # widest sequence of parallel steps), so the bound still counts running handlers;
        # a plain function: only a refusal needs a coroutine (to answer)
        try:  # decoded once, here: its steps give its width, and the chain runs on it
            envelope: EventEnvelope | None = decode(msg.data, EventEnvelope)
        except WireFormatError:
            envelope = None  # admitted as one step, then answered bad_request by _run_chain
        width = _chain_width(envelope)
        if width > self.max_concurrency:  # never servable here: call them one by one
            error = WireError(
                code="bad_request",
                message=f"{width} parallel steps exceed max_concurrency={self.max_concurrency}",
            )
            return self._refuse_chain(msg, HookReply(handler=self.handler_set_id, error=error))
        return Admission(width, envelope)

    async def _refuse_chain(self, msg: Msg, reply: HookReply) -> None:
        """Answer a chain request the serving loop must not admit (`_admit_chain`)."""
        with contextlib.suppress(Exception):
            await self._respond(msg, reply)

    async def _serve_chain(self, msg: Msg, envelope: EventEnvelope | None, received: int) -> None:
        name = self.handler_set_id
        replies: list[HookReply] = []
        running: list[tuple[ChainStep, HandlerSpec]] = []
        try:
            if otel.sync():
                with chain_handling(msg, envelope):  # one message: one span, steps attributes
                    reply = await self._run_chain(msg, envelope, replies, running)
            else:  # nothing to record: not even the shared do-nothing span's enter and exit
                reply = await self._run_chain(msg, envelope, replies, running)
            await self._respond(msg, reply)
        except asyncio.CancelledError:  # shutdown's grace ran out: what ran, and what was cut
            replies.extend(
                HookReply(
                    handler=step.handler,
                    error=WireError(
                        code="unavailable",
                        message="the worker shut down while the handler ran",
                        retryable=spec.declaration.retry_safe,  # as for a request of its own
                    ),
                )
                for step, spec in running
            )
            with contextlib.suppress(Exception):
                await self._respond(msg, HookReply(handler=name, chain=replies))
            raise
        except Exception as exc:  # never let one request take the worker down
            log.exception("unexpected error serving the chain on %s", msg.subject)
            with contextlib.suppress(Exception):
                error = WireError(code="internal", message=repr(exc))
                await self._respond(msg, HookReply(handler=name, error=error))
        finally:
            self.handled += max(1, len(replies))

    def _chain_refusal(
        self, event: str, steps: list[ChainStep], specs: list[HandlerSpec | None]
    ) -> HookReply | None:
        """The reply refusing a chain this process must not run (nothing run), else None:
        no steps, a step it does not serve, or a step the dispatcher judged by another
        declaration than this process's (its tool filter: the two would skip or run
        different steps, e.g. during a rolling update)."""
        name = self.handler_set_id
        missing = [st.handler for st, sp in zip(steps, specs, strict=True) if sp is None]
        if not steps or missing:
            message = f"not served by this process: {missing}" if missing else "no steps"
            return HookReply(handler=name, error=WireError(code="bad_request", message=message))
        stale = [
            st.handler
            for st, sp in zip(steps, specs, strict=True)
            if sp is not None and st.tool_filter != sp.declaration.tool_filter
        ]
        if stale:
            message = f"this process serves other declarations of {stale} for {event!r}"
            return HookReply(
                handler=name, error=WireError(code="stale_declaration", message=message)
            )
        return None

    async def _run_chain(
        self,
        msg: Msg,
        decoded: EventEnvelope | None,
        replies: list[HookReply],
        running: list[tuple[ChainStep, HandlerSpec]],
    ) -> HookReply:
        """Run the steps of a chain request in order, appending each step's reply to
        `replies` (and naming the steps running now in `running`); stop after a step that
        ends the fold (see `ChainStep`) or timed out, before a step the dispatcher may
        have given up on (see `ChainProgress`), or once the worker drains. `decoded`: the
        request's envelope (None: it could not be decoded). Progress replies go out while
        steps wait."""
        received = self._stalls.dated(time.monotonic())
        name = self.handler_set_id
        envelope, refusal = self._read_request(name, msg, decoded)
        if envelope is None:
            assert refusal is not None
            return refusal
        steps = envelope.chain or []
        event = envelope.event
        get = self._specs.get
        specs: list[HandlerSpec | None] = []
        usual = bool(steps)  # every step served here, by the declaration it was judged by
        for step in steps:
            spec = get((event, step.handler))
            specs.append(spec)
            if spec is None or step.tool_filter != spec.declaration.tool_filter:
                usual = False
        if not usual:
            refusal = self._chain_refusal(event, steps, specs)
            if refusal is not None:
                return refusal
        budget = envelope.budget_s
        deadline = None if budget is None else received + budget
        data = envelope.data
        n = len(steps)
        rest_s = 0.0  # the timeouts of the steps not started yet, summed
        for step in steps:
            rest_s += step.timeout_s
        progress = ChainProgress(name, functools.partial(self._respond, msg), received, rest_s)
        # judged once per chain, as for a request of its own: from the next request on
        observed = otel.sync() or log.isEnabledFor(logging.DEBUG)
        # a chain without parallel steps (the usual one) is a group per step
        parallel = [step.parallel for step in steps] if _any_parallel(steps) else None
        i = 0
        try:
            while i < n:
                j = i + 1 if parallel is None else group_end(parallel, i)
                for step in steps[i:j]:
                    rest_s -= step.timeout_s
                if j == i + 1:
                    spec = specs[i]
                    if spec is None or not spec.matches(data):
                        i = j
                        continue
                    step = steps[i]
                    run = [(step, spec)]
                else:
                    run = [
                        (step, spec)
                        for step, spec in zip(steps[i:j], specs[i:j], strict=True)
                        if spec is not None and spec.matches(data)
                    ]
                    if not run:
                        i = j
                        continue
                i = j
                if progress.settle():  # replies of steps that were reported running
                    await asyncio.sleep(0)  # written before the next step can hold the loop
                now = time.monotonic()
                if progress.late(now) or self._state != "serving":
                    # the dispatcher calls the rest itself: late, or draining (a request of
                    # its own would be refused now too)
                    break
                running[:] = run
                if len(run) == 1:  # no task per step: the common, sequential case
                    step, spec = run[0]  # (a parallel group may have one step left)
                    progress.start([step], now, rest_s)
                    if self._may_wait(run):  # reported before anything the step sends
                        progress.suspended()
                    # the last step may have the request's decoded data itself, as a
                    # request of its own does: nothing reads it after this step (not so
                    # once an earlier step's modify replaced it: that data is in its reply)
                    copy = i < n or data is not envelope.data
                    out = _sendable(
                        await self._step(
                            spec, step, envelope, data, deadline, msg, copy, observed,
                            progress.suspended,
                        )
                    )  # fmt: skip
                    progress.finished(step, out)
                    self._returns_at_once.add(spec.key)  # unless `_waits` says otherwise
                    outs: list[HookReply] = [out]
                else:
                    progress.start([step for step, _ in run], now, rest_s)
                    if self._may_wait(run):
                        progress.suspended()
                    outs = await self._run_group(run, envelope, data, deadline, msg, progress)
                running.clear()
                # every step that ran is reported, those after the one that ends the fold
                # in a parallel group too: the dispatcher would call a missing one again
                replies += outs
                for (step, _), out in zip(run, outs, strict=True):
                    if _stops_chain(step, out):
                        return HookReply(handler=name, chain=replies)
                    result = out.result  # only a sequential step's modify gets here
                    if result is not None and modifies(result):
                        data = result.data  # type: ignore[assignment]  # modifies: not None
        finally:
            progress.close()
        return HookReply(handler=name, chain=replies)

    def _may_wait(self, run: list[tuple[ChainStep, HandlerSpec]]) -> bool:
        """Whether a step of `run` is likely to wait on something (suspend): then the
        replies so far are reported before it starts, ahead of anything it sends itself
        (a process killed just after would otherwise take them along). A handler is taken
        to wait until a call showed it returns at once, and for good once one showed it
        waits; sync handlers run in a thread: they always wait. A step that waits against
        that guess reports the moment it does (`ChainProgress.suspended`)."""
        for _, spec in run:
            key = spec.key
            if not spec.is_async or key in self._waits or key not in self._returns_at_once:
                return True
        return False

    async def _run_group(
        self,
        run: list[tuple[ChainStep, HandlerSpec]],
        envelope: EventEnvelope,
        data: dict[str, Any],
        deadline: float | None,
        msg: Msg,
        progress: ChainProgress,
    ) -> list[HookReply]:
        """Run a parallel group of steps concurrently, on `data` (each handler its own
        copy); each reply is handed to `progress` as its step finishes."""

        async def one(step: ChainStep, spec: HandlerSpec) -> HookReply:
            reply = _sendable(
                await self._step(spec, step, envelope, data, deadline, msg, True, True,
                                 progress.suspended)
            )  # fmt: skip
            progress.finished(step, reply)
            self._returns_at_once.add(spec.key)  # unless `_waits` says otherwise
            return reply

        return list(await asyncio.gather(*(one(st, sp) for st, sp in run)))

    def _step(
        self,
        spec: HandlerSpec,
        step: ChainStep,
        envelope: EventEnvelope,
        data: dict[str, Any],
        deadline: float | None,
        msg: Msg,
        copy: bool = True,
        observed: bool = True,
        suspended: Callable[[], None] | None = None,
    ) -> Awaitable[HookReply]:
        """Run one step of a chain on `data` (`copy`: on a copy of its own, as a request
        of its own would get, so in-place edits stay its own). A plain function returning
        the step's awaitable: unless `observed` (telemetry or debug logging on), the
        handler's `_invoke` itself (one coroutine frame less per step). `suspended`: see
        `_invoke`."""
        timeout_s = min(step.timeout_s, spec.declaration.timeout_s)
        if deadline is not None:
            timeout_s = min(timeout_s, deadline - time.monotonic())
        if timeout_s <= 0:
            error = WireError(code="handler_timeout", message="not run: the chain's budget ran out")
            return _ready(HookReply(handler=step.handler, error=error))
        if observed:
            return self._step_observed(spec, step, envelope, data, timeout_s, msg, copy, suspended)
        own = json_copy(data) if copy else data
        return self._invoke(spec, envelope.event, own, timeout_s, envelope.id, suspended)

    async def _step_observed(
        self,
        spec: HandlerSpec,
        step: ChainStep,
        envelope: EventEnvelope,
        data: dict[str, Any],
        timeout_s: float,
        msg: Msg,
        copy: bool,
        suspended: Callable[[], None] | None,
    ) -> HookReply:
        """`_step` with its handling recorded (telemetry) and logged (debug)."""
        started = time.monotonic()
        headers = {"traceparent": step.traceparent} if step.traceparent else msg.headers
        with handling_span(spec.declaration, envelope, headers, subject=msg.subject) as handling:
            own = json_copy(data) if copy else data
            reply = await self._invoke(spec, envelope.event, own, timeout_s, envelope.id, suspended)
            handling.reply(reply)
        if log.isEnabledFor(logging.DEBUG):
            _log_reply(spec.declaration, reply, "call", time.monotonic() - started)
        return reply

    async def _respond(self, msg: Msg, reply: HookReply) -> None:
        if not msg.reply:
            log.warning("request on %s has no reply subject; answer dropped", msg.subject)
            return
        assert self._nc is not None
        reply.instance = self.instance
        try:
            payload = encode(reply)
        except _UNENCODABLE:  # a result JSON cannot carry: that reply fails, not the others
            if reply.chain is not None:
                reply.chain = [_sendable(r, every_field=True) for r in reply.chain]
            else:
                reply = _sendable(reply, every_field=True)
                reply.instance = self.instance
            payload = encode(reply)
        if len(payload) > self._nc.max_payload:
            log.warning("reply of %s is %d bytes, over max_payload", reply.handler, len(payload))
            payload = encode(
                HookReply(
                    handler=reply.handler,
                    error=WireError(
                        code="payload_too_large",
                        message=f"reply is {len(payload)} bytes; max_payload is"
                        f" {self._nc.max_payload}",
                    ),
                    instance=self.instance,
                )
            )
        # written now, not after whatever the loop runs next (it may compute)
        if not reply_now(self._nc, msg.reply, payload):
            await self._nc.publish(msg.reply, payload)
            send_now(self._nc)


_UNENCODABLE = (TypeError, ValueError, OverflowError, msgspec.EncodeError)
"""What msgspec raises for a value JSON cannot carry."""


def _sendable(reply: HookReply, *, every_field: bool = False) -> HookReply:
    """`reply` as it can be sent: data JSON does not carry natively converted as
    amplifier-core converts a handler's result (`json_copy`: a `Decimal` to a string, any
    other object to its ``str()``, as an in-process handler's is), or, when even that
    fails (data that refers to itself, a result field of the wrong type), a ``bad_result``
    error in its place: that handler fails (the fold denies a result it cannot read), the
    other handlers' replies stand. A chain checks a step's data at once, before the next
    step runs on it; `every_field`: the whole result (after the reply failed to encode).
    """
    result = reply.result
    if result is None or (result.data is None and not every_field):
        return reply
    try:
        encode(result if every_field else result.data)
        return reply
    except _UNENCODABLE:
        pass
    try:
        if result.data is not None:
            result = msgspec.structs.replace(result, data=json_copy(result.data))
        encode(result)
    except (BadRequestError, *_UNENCODABLE) as exc:
        message = f"the result cannot be sent as JSON: {type(exc).__name__}: {exc}"
        return HookReply(
            handler=reply.handler, error=WireError(code="bad_result", message=message[:500])
        )
    return HookReply(handler=reply.handler, result=result)


async def _ready(reply: R) -> R:
    """A reply known at once, as an awaitable (a request or a step that runs nothing)."""
    return reply


def _any_parallel(steps: list[ChainStep]) -> bool:
    """Whether a chain has a parallel step (else each step is a group of its own)."""
    for step in steps:  # a loop, not any() over a generator: cheaper for a few steps
        if step.parallel:
            return True
    return False


def _chain_width(envelope: EventEnvelope | None) -> int:
    """The most handlers a chain request may run at once: its widest sequence of adjacent
    parallel steps (1 for a sequential chain, or a request that cannot be read)."""
    steps = (envelope.chain if envelope is not None else None) or []
    if not _any_parallel(steps):  # the usual chain: no list of flags to build and scan
        return 1
    return widest_group([step.parallel for step in steps])


_CONTINUE: Final = to_hook_result(None)
"""What a handler returning None answers (the one shared result `to_hook_result` gives)."""


def _stops_chain(step: ChainStep, reply: HookReply) -> bool:
    """Whether the chain stops after this step's reply: the dispatcher's fold stops there
    (so later steps must not run: `ends_fold`, the one stop rule, on the step's reply: a
    result's action; an error ``bad_result``, or a reply with neither, is an unreadable
    result; any other error a failure), or the step timed out (the dispatcher calls the
    steps after a timed-out one itself)."""
    outcome: StepOutcome
    result, error = reply.result, reply.error
    if result is not None:
        outcome = result.action
    elif error is None or error.code == "bad_result":
        outcome = "unreadable"
    elif error.code == "handler_timeout":
        return True
    else:
        outcome = "failed"
    return ends_fold(outcome, parallel=step.parallel, failure_policy=step.failure_policy)


def _log_reply(decl: HandlerDeclaration, reply: HookReply, kind: str, took_s: float) -> None:
    """One debug line per handler call answered (a chain's steps included): kind
    (``call`` or ``collect``), handler, outcome, time."""
    if reply.error is not None:
        outcome = f"error {reply.error.code}"
    else:
        outcome = reply.result.action if reply.result is not None else "no result"
    log.debug("%s %s/%s: %s in %.1f ms", kind, decl.event, decl.name, outcome, took_s * 1000)
