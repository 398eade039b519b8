"""`HookDispatcher`: amplifier-core's `HookRegistry`, with handlers anywhere on NATS."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from nats.aio.client import Client as NATS

from hookbus._core.forwarded import Forwarded
from hookbus._core.jetstream import bind_js_domain
from hookbus.schemas import (
    DECISIONS_DEFAULT_MAX_AGE_S,
    DECISIONS_DEFAULT_MAX_BYTES,
    FailurePolicy,
    HookbusError,
    HookResult,
    NotConnectedError,
    StandardEvents,
    validate_name,
)

from ._approvals import Approvals
from ._approvals_client import ApprovalsClient
from ._audit import DecisionLog
from ._call_router import EmitContext, Router
from ._emitter import Emitter
from ._folding import RouteFolder
from ._local_handlers import LocalHandlers
from ._outcomes import Outcome
from ._route_table import LocalHandler, Route
from ._stores import Stores
from ._suspension_hooks import SuspensionHooks
from ._telemetry import observed_collect, observed_emit, traced_call
from ._telemetry_core import otel

__all__ = ["HookDispatcher"]

T = TypeVar("T")


class HookDispatcher(StandardEvents, SuspensionHooks):
    """Emit events to handlers in-process and on NATS, folded as amplifier-core does.

    Made with no connection, it is amplifier-core's `HookRegistry` (`register`, `on`,
    `set_default_fields`, `emit`, `emit_and_collect`, `list_handlers`, the event constants)
    and code written for it runs unchanged. Given a connection (``HookDispatcher(nc)`` then
    ``await d.start()``, or ``async with HookDispatcher(nc) as d``), it also watches the
    handler registry bucket and calls remote handlers in the same priority order.

    Args:
        nc: a connected nats-py client, or None for in-process only.
        strict_events: raise `UnknownEventError` when emitting an event that is neither a
            standard event nor has any handler (a typo would otherwise pass silently).
        resync_s: seconds between full re-reads of the registry (a backstop to the watch).
        bucket_replicas: replicas of the buckets this dispatcher creates (3 on a cluster).
        approvals: turn ``ask_user`` results into durable approvals and wait for the answer
            (needs a connection; without one, ask_user passes through as amplifier-core does).
        suspension_ttl_s: seconds a suspension record lives after its last write.
        approval_ttl_s: seconds an "Allow always" grant allows after its answer (written
            into the grant as ``expires_at`` and checked when it is read; the approvals
            bucket itself keeps records 7 days, the longest approval).
        max_pending_approvals: pending approvals one agent may have at once (None: no
            limit); a question beyond them is denied with a reason starting ``quota:``.
        answer_wait_s: seconds an answer through this dispatcher's `approvals`
            (`Approvals.answer`, ``ApprovalsClient.over(dispatcher.approvals)``) waits for
            the deciding dispatcher to apply it.
        strict_buckets: raise `BucketConfigError` at `start` when a bucket exists with
            another config (replicas, TTL, history) than asked; else a warning names it.
        agent_id: the agent this dispatcher acts as (its NATS user's identity, see
            docs/security.md). Every emit's ``agent_id`` is set to it (data naming another
            agent is a `BadRequestError`), suspensions are this agent's
            (``<agent>.<label>`` keys) and only its records are watched and listed — what an
            agent's NATS permissions allow. None: the agent id comes from each call's data
            and every agent's records are read (a dispatcher service, an operator).
        audit: append one `DecisionRecord` per decided emit to the decision audit stream
            (``hookbus_decisions``, created at `start` if absent; see `DecisionLog`). Off by
            default; needs a connection. With `agent_id` set, records are only appended (an
            agent's NATS user may neither read nor create the stream: the dispatcher
            service or an admin creates it).
        audit_max_age_s: seconds the stream keeps a record, if this dispatcher creates it.
        audit_max_bytes: size past which the stream drops its oldest records, if this
            dispatcher creates it.
        chains: send a sequence of adjacent remote handlers served by one worker process (the
            same declared handler set) as one chain request, run there in order with the
            same semantics (one round trip instead of one per handler; see `_chain_calls`).
            False: one request per handler. Results and failures are the same either way,
            under faults too: a chain loses at most the step that was running when its
            process died, and the steps it did not run are called on their own.
        js_domain: the JetStream domain holding the fleet's buckets (an agent at a leaf
            site: the hub's, e.g. ``"hub"``); every bucket and stream is then read and
            written there (``$JS.<domain>.API``). None: the connection's own JetStream. A
            bucket absent from a JetStream of another domain (e.g. a leaf's own) is never
            created there: `start` raises `JetStreamDomainError` and nothing is emitted.
    """

    def __init__(
        self,
        nc: NATS | None = None,
        *,
        strict_events: bool = False,
        resync_s: float = 30.0,
        bucket_replicas: int = 1,
        approvals: bool = True,
        suspension_ttl_s: float = 7 * 24 * 3600,
        approval_ttl_s: float = 24 * 3600,
        max_pending_approvals: int | None = 16,
        answer_wait_s: float = 5.0,
        strict_buckets: bool = False,
        agent_id: str | None = None,
        audit: bool = False,
        audit_max_age_s: float = DECISIONS_DEFAULT_MAX_AGE_S,
        audit_max_bytes: int = DECISIONS_DEFAULT_MAX_BYTES,
        chains: bool = True,
        js_domain: str | None = None,
    ) -> None:
        if agent_id is not None:
            validate_name("agent", agent_id)
        self._agent_id = agent_id
        self._nc = nc
        self._js_domain = js_domain
        self._router = Router(nc, resync_s=resync_s, bucket_replicas=bucket_replicas)
        self._table = self._router.table
        self._local = LocalHandlers(self._table)
        self._defaults: dict[str, Any] = {}
        self._started = False
        self._folder = RouteFolder(self._router, self._call, chains=chains)
        self._emitter = Emitter(
            self._router, self._folder, strict_events=strict_events, agent_id=agent_id
        )
        self._stores = Stores(
            self._emitter, agent_id=agent_id, bucket_replicas=bucket_replicas,
            approvals=approvals, suspension_ttl_s=suspension_ttl_s,
            approval_ttl_s=approval_ttl_s, max_pending_approvals=max_pending_approvals,
            answer_wait_s=answer_wait_s, strict_buckets=strict_buckets, audit=audit,
            audit_max_age_s=audit_max_age_s, audit_max_bytes=audit_max_bytes,
            js_domain=js_domain,
        )  # fmt: skip

    audit = Forwarded[bool](
        "_stores",
        """Whether `start` turns the decision audit trail on (set it before `start`).""",
    )

    chains = Forwarded[bool](
        "_folder",
        """Whether a sequence of adjacent remote handlers of one worker process goes as one chain
        request (one round trip) instead of one request per handler.""",
    )

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Load the handler registry and start watching it (no-op without a connection).

        Returns once the current declarations are in the routing table and it follows
        the registry's changes (docs/scaling.md): a dispatcher never decides on a registry
        it does not follow. Later, while it knows it missed a change, every emit is denied
        until it has caught up.

        Raises:
            JetStreamDomainError: a bucket is absent and the answering JetStream is not
                the domain `js_domain` (none given: one that reports a domain, e.g. a leaf
                node's own), or no JetStream answers within 3 s (a leaf node without
                JetStream and no `js_domain`).
            HookbusTimeoutError: JetStream stayed unavailable for 30 s.
            NotPermittedError: this identity may not follow the registry (subscribe to its
                changes, read it by direct get).
            HookbusError: the registry's stream does not answer its direct gets; or, on a
                handlers bucket made by an older hookbus (followed with a consumer), JetStream
                refused the consumer (e.g. ``maximum consumers limit reached``, err 10026).
        """
        if self._started or self._nc is None:
            return
        bind_js_domain(self._nc, self._js_domain)  # every store and watch on it: that domain
        self._router.nc = self._nc
        await self._stores.open(self._nc, self._router)
        await self._nc.flush()
        self._started = True

    async def connect(self, nc: NATS) -> None:
        """Attach a connection to a dispatcher made without one, then `start`."""
        if self._nc is not None and self._nc is not nc:
            raise HookbusError("this dispatcher already has a connection")
        self._nc = nc
        await self.start()

    async def close(self) -> None:
        """Stop watching and unsubscribe (idempotent). The connection stays the caller's."""
        await self._router.close()
        await self._stores.close()
        self._started = False

    async def __aenter__(self) -> HookDispatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def refresh(self) -> None:
        """Re-read the whole handler registry now (normally the watch keeps it current)."""
        await self._router.refresh()

    # -- amplifier-core HookRegistry API -------------------------------------------------
    @overload
    def register(
        self, event: str, handler: LocalHandler, priority: int = 0, name: str | None = None, *,
        timeout_s: float | None = None, failure_policy: FailurePolicy = "ignore",
        tool_filter: list[str] | None = None, parallel: bool = False, pure: bool = False,
    ) -> Callable[[], None]: ...  # fmt: skip
    @overload
    def register(
        self, event: str, handler: None = None, priority: int = 0, name: str | None = None, *,
        timeout_s: float | None = None, failure_policy: FailurePolicy = "ignore",
        tool_filter: list[str] | None = None, parallel: bool = False, pure: bool = False,
    ) -> Callable[[LocalHandler], LocalHandler]: ...  # fmt: skip
    def register(
        self,
        event: str,
        handler: LocalHandler | None = None,
        priority: int = 0,
        name: str | None = None,
        *,
        timeout_s: float | None = None,
        failure_policy: FailurePolicy = "ignore",
        tool_filter: list[str] | None = None,
        parallel: bool = False,
        pure: bool = False,
    ) -> Callable[[], None] | Callable[[LocalHandler], LocalHandler]:
        """Register an in-process handler (amplifier-core `HookRegistry.register`).

        ``async def handler(event: str, data: dict) -> HookResult`` (a sync function, a
        dict or None as result work too). Lower `priority` runs first; `name` defaults to
        the function's name. Returns the unregister function; called without `handler`
        it is a decorator that registers and returns the function unchanged.

        hookbus keyword-only extras, as for remote handlers: `timeout_s` (seconds, finite
        and > 0, clamped to `MAX_HANDLER_TIMEOUT_S`; None for no limit), `failure_policy`
        (``ignore`` | ``deny``), `tool_filter` (globs over ``data["tool_name"]``, whole name,
        ignoring case: `ToolFilter`), `parallel`,
        `pure` (free of side effects: an adjacent run of pure handlers is called at once
        and folded in order; see docs/performance.md). The options are checked as a
        worker's are (`HandlerOptions.local`), when called, also in decorator form.

        A sync handler with a time limit (its `timeout_s`, or the emit's deadline) runs
        as on a worker: in a worker thread, cut at the limit (a ``timeout`` failure judged
        by `failure_policy`). The thread cannot be stopped: it runs until the function
        returns, and its late result is discarded. Without a limit it runs on the event
        loop (amplifier-core's way), blocking it while it runs.

        Raises:
            TypeError: `priority` is not an int (amplifier-core takes a 32-bit int; a bool
                counts as one), or `name` is not a str.
            OverflowError: `priority` does not fit in 32 bits.
            BadRequestError: `event` or `name` is not a valid hookbus name (empty, too
                long, or with characters NATS subjects cannot carry), or `timeout_s`,
                `failure_policy` or `tool_filter` is out of its bounds (also a `ValueError`).
        """
        return self._local.register(
            event, handler, priority, name, timeout_s=timeout_s, failure_policy=failure_policy,
            tool_filter=tool_filter, parallel=parallel, pure=pure,
        )  # fmt: skip

    on = register
    """Alias of `register` (amplifier-core keeps it for backwards compatibility)."""

    def unregister(self, name: str) -> None:
        """Remove the in-process handlers registered under `name` (amplifier-core
        `HookRegistry.unregister`). An unknown name is a no-op. Remote handlers are not
        affected: they leave when their worker withdraws its declaration.

        Where a name was registered more than once, every registration under it goes
        (amplifier-core 2.0.2 removes one of them, in an unspecified event).
        """
        self._table.remove_local_named(name)

    def set_default_fields(self, **defaults: Any) -> None:
        """Set the fields merged into every emit's data; explicit data wins. Replaces
        earlier defaults (amplifier-core `HookRegistry.set_default_fields`)."""
        self._defaults = self._emitter.defaults = defaults

    def list_handlers(self, event: str | None = None) -> dict[str, list[str]]:
        """Handler names per event in call order, in-process and remote alike.

        Shape: ``{"tool:pre": ["security", "redactor"], ...}`` (amplifier-core).
        """
        if event is not None:
            return {event: [r.name for r in self._table.routes(event)]}
        return {e: [r.name for r in self._table.routes(e)] for e in self._table.events()}

    def routes(self, event: str) -> tuple[Route, ...]:
        """The full routes of `event` in call order (priority, policy, filter, ...)."""
        return self._table.routes(event)

    async def emit(
        self,
        event: str,
        data: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        timeout_s: float | None = None,
        approval_timeout_s: float | None = None,
    ) -> HookResult:
        """Emit `event` to its handlers in priority order and fold their results.

        amplifier-core 2.0.2 `HookRegistry.emit` semantics: the data is made JSON-safe
        first (`json_safe`: a `Decimal` becomes ``"1.23"``; the caller's dict is never
        changed) and each handler gets its own copy; with no handlers, ``continue`` with
        that data (no defaults, no timestamp); otherwise default fields are merged
        (explicit data wins), ``timestamp`` is stamped (UTC ISO-8601), and handlers run in
        order with deny short-circuit, modify chaining, inject_context merging, first
        ask_user kept; precedence deny > ask_user > inject_context > continue (a modify
        chain ends as ``continue`` with its data). See `Fold` for every rule.
        Handlers whose tool filter does not match are skipped with no round trip; an
        adjacent sequence of ``parallel`` handlers is called concurrently and folded in order.
        A handler failure (timeout, no responders, error) is judged by its failure policy,
        a result that cannot be read is denied, and both are recorded in
        ``result.failures`` (hookbus's own fields: `HookResult.chained_data`,
        ``decided_by``, ``modified_by``, ``failures``, ``approved_by``). While this
        dispatcher knows it missed a change of the handler registry, the emit waits up to
        5 s (within `timeout_s`) for it to catch up, then is denied (docs/scaling.md).

        Args:
            event: the event name.
            data: the event data.
            idempotency_key: the caller's id for this call: a retry of the same call (after
                a lost reply or a restart) finds its approval and answer; None: a new call.
            timeout_s: overall deadline of the handler chain in seconds; each handler call
                gets its own timeout cut to what is left, and a handler not called because
                it ran out is a ``timeout`` failure judged by its policy. None: the
                handlers' own timeouts, and for the remote ones together at most
                `REMOTE_EMIT_BUDGET_S` (60 s) from the emit's start, however many there are
                (in-process handlers, as in amplifier-core, have no overall limit; an
                approval's wait is its own ``approval_timeout``).
            approval_timeout_s: longest wait of an approval this emit asks, seconds (above
                0): each handler's ``approval_timeout`` is cut to it, so an approval nobody
                answers ends with its ``approval_default`` (closed, no longer pending)
                within a caller's wait that is longer (a door passes its wait less a
                margin); an approval the cut shortened applies deny where its default is
                allow (only the handler's full timeout allows by default). None: the
                handlers' own ``approval_timeout``.

        Returns:
            The folded `HookResult`; ``result.chained_data`` is the final chained data.
        Raises:
            UnknownEventError: `strict_events` is on and the event is unknown.
            BadRequestError: `timeout_s` is negative or not finite, `approval_timeout_s`
                is not a finite number above 0; the data holds NaN,
                a key JSON cannot hold, or refers to itself (see `json_safe`).
            PayloadTooLargeError: the event does not fit the server's max_payload.
            NotConnectedError: a remote handler is routed but the connection is closed,
                or NATS failed under an approval (every nats-py error ends as this).
            SuspensionAbortedError: the approval wait was aborted (`abort_all` in a
                draining service); the approval stays pending and a retry with the same
                `idempotency_key` resumes it.
        An approval whose store cannot be reached within the deadline is not an error: the
        call is denied and the failure recorded. No nats-py error ever propagates.
        """
        if otel.sync():  # the emit span and metrics (telemetry on)
            return await observed_emit(
                self._emitter.emit, self, event, data,
                {"idempotency_key": idempotency_key, "timeout_s": timeout_s,
                 "approval_timeout_s": approval_timeout_s},
            )  # fmt: skip
        return await self._emitter.emit_with(
            event, data, idempotency_key, timeout_s, approval_timeout_s
        )

    async def emit_and_collect(
        self, event: str, data: dict[str, Any], timeout: float = 1.0
    ) -> list[Any]:
        """Emit `event` to every handler at once and collect their answers.

        amplifier-core `HookRegistry.emit_and_collect` semantics: `data` is made JSON-safe
        and each handler gets its own copy (no defaults, no timestamp); returns the
        non-None ``result.data`` of each handler that answered within `timeout` seconds,
        in priority order; failures are logged and skipped. Remote handlers get one
        publish on the event's collect subject; the call returns as soon as every expected
        handler has answered (tool filters do not apply), or at once when no remote handler
        has a live replica (the server says so).

        Raises:
            UnknownEventError: `strict_events` is on and the event is unknown.
            BadRequestError: the data cannot be made JSON-safe (see `json_safe`), or
                `timeout` is not a number of seconds >= 0.
            PayloadTooLargeError: the event does not fit the server's max_payload.
            NotConnectedError: a remote handler is routed but the connection is closed or
                NATS failed (never a raw nats-py error).
        """
        if otel.sync() and otel.tracing:  # the emit_and_collect span
            return await observed_collect(self._emitter.emit_and_collect, event, data, timeout)
        return await self._emitter.emit_and_collect(event, data, timeout)

    # -- approvals -------------------------------------------------------------------------
    @property
    def approvals(self) -> Approvals:
        """The approvals policy (grants: ``approvals.grants``). An approver answers, cancels
        and lists approvals and grants with an `ApprovalsClient` (its own, or
        ``ApprovalsClient.over(dispatcher.approvals)``). Raises `NotConnectedError` before
        `start` or when made with ``approvals=False``."""
        if self._stores.approvals is None:
            raise NotConnectedError("approvals need a started dispatcher with approvals on")
        return self._stores.approvals

    async def _approvals_client(self) -> ApprovalsClient:
        """This dispatcher's `ApprovalsClient` (over its approvals, or the approvals bucket
        opened on first use when approvals are off): its service's expiry sweep ends
        overdue approvals through it."""
        return await self._stores.answers(self._nc)

    # -- internals -----------------------------------------------------------------------
    @traced_call
    def _call(self, route: Route, ctx: EmitContext, data: dict[str, Any]) -> Awaitable[Outcome]:
        # the router's awaitable, not a coroutine of ours awaiting it: one frame less per
        # handler call; every caller awaits it at once
        ctx.called.append(route.name)
        return self._router.call(route, ctx, data)

    @property
    def decision_log(self) -> DecisionLog | None:
        """The decision audit trail's writer while it is on (``audit=True``, started)."""
        return self._stores.decisions
