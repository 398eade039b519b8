"""`HookWorker`: serve hook handlers on NATS, one queue group per handler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro.service import Service

from hookbus._core.deadlines import Deadline
from hookbus._core.handler_options import (
    DEFAULT_FAILURE_POLICY,
    DEFAULT_PRIORITY,
    DEFAULT_TIMEOUT_S,
    OPTIONS,
    HandlerOptions,
    is_async_handler,
)
from hookbus._core.jetstream import existing_key_value
from hookbus._core.nats_guard import harden_connection
from hookbus._core.serving import ServingLoop
from hookbus.schemas import (
    HANDLERS_BUCKET,
    FailurePolicy,
    HandlerDeclaration,
    HookReply,
    NotConnectedError,
    collect_subject,
    handler_key,
    handler_queue_group,
    handler_subject,
    validate_name,
)

from ._chains import ChainRunner, name_handler_set
from ._handler_call import HandlerCaller
from ._registration import (
    LivenessProbe,
    declare_handlers,
    flush_subscriptions,
    open_registry,
    start_liveness,
    stop_liveness,
)
from ._requests import RequestServer
from ._spec import Handler, HandlerSpec
from ._stalls import LoopStalls

__all__ = ["HookWorker"]

log = logging.getLogger("hookbus.workers")

F = TypeVar("F", bound=Callable[..., Any])


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
        self._specs: dict[tuple[str, str], HandlerSpec] = {}
        self._serving: ServingLoop | None = None
        self._requests = RequestServer(HandlerCaller())
        self._chains: ChainRunner | None = None
        self._stalls = LoopStalls()
        """This loop's stalls: a chain request read during or just after one is dated
        from its start (see `LoopStalls`)."""
        self.handler_set_id = ""
        """The id of this process's handler set once started ("" if it cannot be chained):
        chain requests for its handlers of an event come on
        ``chain_subject(event, handler_set_id)``."""
        self._stopped: asyncio.Event | None = None
        self._state = "new"  # new -> serving -> draining -> stopped

    @property
    def instance(self) -> str:
        """This process's instance id (its liveness service id) once started, else "":
        every reply carries it, and each handler also listens on its instance subject
        (hedges)."""
        return self._requests.instance

    @property
    def handled(self) -> int:
        """Requests answered so far, a chain request counting each handler it ran (for
        tests and stats)."""
        return self._requests.handled

    @property
    def refused(self) -> int:
        """Requests refused with ``busy`` or ``unavailable`` without running (stats)."""
        return self._requests.refused

    def reply_to(self, spec: HandlerSpec, msg: Msg) -> Awaitable[HookReply | None]:
        """The reply this worker gives `msg`, a request for its handler `spec`, as its
        subscription does (decoded, run within the handler's timeout and the caller's
        budget, in its span when telemetry is on); None: nothing to send. For serving
        over a transport of one's own (a test kit's loopback): the reply is the caller's
        to send. Raises what the worker's own request path does not turn into a reply (its
        subscription answers those ``internal``)."""
        return self._requests.handle(spec, msg)

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
        self.handler_set_id = name_handler_set(self._specs)
        requests = self._requests
        requests.nc = nc_
        requests.max_concurrency = self.max_concurrency
        chains: ChainRunner | None = None
        if self.handler_set_id:
            chains = ChainRunner(
                self._specs, self.handler_set_id, requests, self._stalls,
                is_serving=self._is_serving,
            )  # fmt: skip
        self._chains = chains
        serving = self._serving = ServingLoop(nc_, max_concurrency=self.max_concurrency, log=log)
        endpoints = requests.endpoints(self._specs.values())
        if chains is not None:
            endpoints += chains.endpoints()
        for endpoint in endpoints:
            await serving.add(endpoint)
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
            instance = self._liveness.id
            endpoints = requests.instance_endpoints(self._specs.values(), instance)
            if chains is not None:
                endpoints += chains.instance_endpoints(instance)
            for endpoint in endpoints:
                await serving.add(endpoint)
            # the services API ($SRV.*) and the instance subjects: reachable from any
            # connection once start returns
            await flush_subscriptions(nc_, deadline_s=self.registration_timeout_s)
            requests.instance = instance
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

    def _is_serving(self) -> bool:
        """Whether the worker serves (not new, draining or stopped): a chain request
        starts no further step otherwise."""
        return self._state == "serving"

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
        deadline = Deadline.after(max(grace_s, 0.0), asyncio.get_running_loop().time())
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
