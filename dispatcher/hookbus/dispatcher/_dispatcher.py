"""`HookDispatcher`: amplifier-core's `HookRegistry`, with handlers anywhere on NATS."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar, overload

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from hookbus.schemas import (
    DECISIONS_DEFAULT_MAX_AGE_S,
    DECISIONS_DEFAULT_MAX_BYTES,
    STANDARD_EVENTS,
    ApprovalAnswer,
    BadRequestError,
    FailurePolicy,
    HandlerFailure,
    HookbusError,
    HookResult,
    HookStatus,
    NotConnectedError,
    StandardEvents,
    SuspensionAbortedError,
    SuspensionRecord,
    UnknownEventError,
    json_copy,
    json_safe,
    validate_name,
)
from hookbus.schemas._handler_options import HandlerOptions

from ._approvals import (
    APPROVAL_LABEL_PREFIX,
    MAX_APPROVAL_TIMEOUT_S,
    ApprovalGrant,
    Approvals,
    joined_decision,
)
from ._audit import DecisionLog, current_trace_id
from ._calls import Failed, Outcome, call_local
from ._fold import Fold
from ._grants import Grants
from ._kv import ensure_buckets
from ._records import SuspensionPage
from ._router import EmitContext, Router
from ._routes import LocalHandler, Route
from ._suspensions import HookEventStream, PendingHook, RunScope, Suspensions
from ._telemetry import (
    start_call_span,
    traced_call,
    traced_collect,
    traced_emit,
)

__all__ = ["HookDispatcher"]

T = TypeVar("T")

_CallGroup = Callable[[list[Route], EmitContext, dict[str, Any]], Awaitable[list[Outcome]]]
"""How `_fold_each` gets the outcomes of a group of handlers called on the same data."""

log = logging.getLogger("hookbus.dispatcher")

_SETTLE_S = 1.0
"""Seconds past an emit's deadline that settling its approval (the store's reads and the
closing write) may take before the call is denied as unknown."""


class HookDispatcher(StandardEvents):
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
        answer_wait_s: seconds `answer_approval` waits for the deciding dispatcher to apply
            the answer (see `Approvals.answer`).
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
    ) -> None:
        if agent_id is not None:
            validate_name("agent", agent_id)
        self._agent_id = agent_id
        self._nc = nc
        self._strict = strict_events
        self._bucket_replicas = bucket_replicas
        self._router = Router(nc, resync_s=resync_s, bucket_replicas=bucket_replicas)
        self._table = self._router.table
        self._defaults: dict[str, Any] = {}
        self._started = False
        self._approvals_on = approvals
        self._suspension_ttl_s = suspension_ttl_s
        self._approval_ttl_s = approval_ttl_s
        self._max_pending_approvals = max_pending_approvals
        self._answer_wait_s = answer_wait_s
        self._strict_buckets = strict_buckets
        self._suspensions: Suspensions | None = None
        self._approvals: Approvals | None = None
        self._approvals_view: Approvals | None = None  # answering / listing, approvals off
        self.audit = audit
        """Whether `start` turns the decision audit trail on (set it before `start`)."""
        self._audit_retention = (audit_max_age_s, audit_max_bytes)
        self._decisions: DecisionLog | None = None
        self.chains = chains
        self._plans: dict[
            tuple[tuple[Route, ...], bool], tuple[tuple[str, tuple[Route, ...]], ...]
        ] = {}
        """Whether a sequence of adjacent remote handlers of one worker process goes as one chain
        request (one round trip) instead of one request per handler."""

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Load the handler registry and start watching it (no-op without a connection).

        Returns once the current declarations are in the routing table.
        """
        if self._started or self._nc is None:
            return
        self._router.nc = self._nc
        await ensure_buckets(  # created as asked, or reported if they differ
            self._nc,
            replicas=self._bucket_replicas,
            suspension_ttl_s=self._suspension_ttl_s,
            # an agent's own dispatcher may only get its own keys of the approvals bucket:
            # `Approvals.open` binds it (on an open server, opens or creates it)
            approval_ttl_s=(
                MAX_APPROVAL_TIMEOUT_S if self._approvals_on and self._agent_id is None else None
            ),
            strict=self._strict_buckets,
        )
        await self._router.start()
        self._suspensions = await Suspensions.open(
            self._nc,
            ttl_s=self._suspension_ttl_s,
            replicas=self._bucket_replicas,
            agent_id=self._agent_id,
            scoped=self._agent_id is not None,
        )
        if self._approvals_on:
            self._approvals = await self._open_approvals()
        if self.audit and self._decisions is None:
            max_age_s, max_bytes = self._audit_retention
            decisions = DecisionLog(
                self._nc,
                max_age_s=max_age_s,
                max_bytes=max_bytes,
                replicas=self._bucket_replicas,
                strict=self._strict_buckets,
                open_stream=self._agent_id is None,
            )
            await decisions.start()
            self._decisions = decisions
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
        for approvals in (self._approvals, self._approvals_view):
            if approvals is not None:
                await approvals.close()
        self._approvals = self._approvals_view = None
        if self._suspensions is not None:
            await self._suspensions.close()
        if self._decisions is not None:
            await self._decisions.close(timeout_s=2.0)  # queued records get 2 s more
            self._decisions = None
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
        self,
        event: str,
        handler: LocalHandler,
        priority: int = 0,
        name: str | None = None,
        *,
        timeout_s: float | None = None,
        failure_policy: FailurePolicy = "ignore",
        tool_filter: list[str] | None = None,
        parallel: bool = False,
        pure: bool = False,
    ) -> Callable[[], None]: ...
    @overload
    def register(
        self,
        event: str,
        handler: None = None,
        priority: int = 0,
        name: str | None = None,
        *,
        timeout_s: float | None = None,
        failure_policy: FailurePolicy = "ignore",
        tool_filter: list[str] | None = None,
        parallel: bool = False,
        pure: bool = False,
    ) -> Callable[[LocalHandler], LocalHandler]: ...
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

        Raises:
            TypeError: `priority` is not an int (amplifier-core takes a 32-bit int; a bool
                counts as one), or `name` is not a str.
            OverflowError: `priority` does not fit in 32 bits.
            BadRequestError: `event` or `name` is not a valid hookbus name (empty, too
                long, or with characters NATS subjects cannot carry), or `timeout_s`,
                `failure_policy` or `tool_filter` is out of its bounds (also a `ValueError`).
        """
        validate_name("event", event)
        options = HandlerOptions.local(
            priority=priority,
            timeout_s=timeout_s,
            failure_policy=failure_policy,
            tool_filter=tool_filter,
            parallel=parallel,
            pure=pure,
        )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"handler name must be a str, not {type(name).__name__}")
        if handler is None:

            def decorator(fn: LocalHandler) -> LocalHandler:
                self.register(
                    event,
                    fn,
                    priority,
                    name,
                    timeout_s=timeout_s,
                    failure_policy=failure_policy,
                    tool_filter=tool_filter,
                    parallel=parallel,
                    pure=pure,
                )
                return fn

            return decorator
        route = Route.make(
            event=event,
            name=name or str(getattr(handler, "__name__", "handler")),
            priority=options.priority,
            timeout_s=options.timeout_s,
            failure_policy=options.failure_policy,
            parallel=options.parallel,
            tool_filter=options.tool_filter,
            local=handler,
            seq=self._table.next_seq(),
            pure=options.pure,
        )
        return self._table.add_local(route)

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
        self._defaults = defaults

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

    @traced_emit
    async def emit(
        self,
        event: str,
        data: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        timeout_s: float | None = None,
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
        ``decided_by``, ``modified_by``, ``failures``, ``approved_by``).

        Args:
            event: the event name.
            data: the event data.
            idempotency_key: the caller's id for this call: a retry of the same call (after
                a lost reply or a restart) finds its approval and answer; None: a new call.
            timeout_s: overall deadline of the handler chain in seconds; each handler call
                gets its own timeout cut to what is left, and a handler not called because
                it ran out is a ``timeout`` failure judged by its policy. None: only the
                handlers' own timeouts apply.

        Returns:
            The folded `HookResult`; ``result.chained_data`` is the final chained data.
        Raises:
            UnknownEventError: `strict_events` is on and the event is unknown.
            BadRequestError: `timeout_s` is negative or not finite; the data holds NaN,
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
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise BadRequestError(f"timeout_s must be a finite number of seconds >= 0: {timeout_s}")
        routes = self._table.routes(event)
        if not routes:
            if self._strict and event not in STANDARD_EVENTS:
                raise UnknownEventError(f"unknown event {event!r}: no handler is declared")
            safe = json_safe(data or {})
            return HookResult(action="continue", data=safe, chained_data=safe)
        trail: list[EmitContext] | None = [] if self._decisions is not None else None
        try:
            result = await self._emit(event, data, routes, idempotency_key, timeout_s, trail)
        except nats.errors.Error as exc:
            raise NotConnectedError(f"NATS failed during the emit: {type(exc).__name__}") from exc
        if self._decisions is not None and trail:  # the decision is final: record it
            self._record(event, data, result, trail[0], idempotency_key)
        return result

    async def _emit(
        self,
        event: str,
        data: dict[str, Any],
        routes: tuple[Route, ...],
        idempotency_key: str | None,
        timeout_s: float | None,
        trail: list[EmitContext] | None = None,
    ) -> HookResult:
        if data is not None and not isinstance(data, dict):
            raise BadRequestError(f"event data must be a dict, not {type(data).__name__}")
        current = json_safe({**self._defaults, **(data or {})})
        if self._agent_id is not None:
            claimed = current.get("agent_id")
            if claimed not in (None, self._agent_id):
                raise BadRequestError(
                    f"this dispatcher acts as agent {self._agent_id!r}; the data names"
                    f" agent {claimed!r}"
                )
            current["agent_id"] = self._agent_id
        current["timestamp"] = _rfc3339_ns()
        fold = Fold(current, event)
        ctx = EmitContext(event, current, timeout_s=timeout_s, call_id=idempotency_key)
        if trail is not None:  # the caller records the decision with the emit's id and calls
            trail.append(ctx)
        denied = await self._fold_routes(routes, ctx, fold)
        if denied is not None:
            return denied
        result = fold.result()
        if result.action == "ask_user" and self._approvals is not None:
            return await self._approve(event, fold.asks(), ctx)
        return result

    async def _approve(self, event: str, asks: list[HookResult], ctx: EmitContext) -> HookResult:
        """Turn the emit's ``ask_user`` results (`Fold.asks`, priority order) into the
        humans' answers, one question after the other within the emit's deadline.

        Every asking handler's question is asked (or allowed by its own "Allow always"
        grant); the first refusal denies and later questions are not asked; the call goes
        on only when every question was allowed. The result is amplifier-core-shaped (the
        first ask's fields; see `joined_decision`).
        """
        decisions: list[HookResult] = []
        for ask in asks:
            decided = await self._approve_one(event, ask, ctx)
            decisions.append(decided)
            if decided.action != "continue":
                break
        return joined_decision(asks, decisions)

    async def _approve_one(self, event: str, result: HookResult, ctx: EmitContext) -> HookResult:
        """Turn one ``ask_user`` result into the human's answer, within the emit's deadline.

        The wait is cut to what the emit has left: when that ends it before the approval's
        own timeout, the call is denied and the approval stays pending for a retry with the
        same idempotency key (the approval's default applies only at its own timeout). The
        store's reads and writes get at most `_SETTLE_S` seconds more. If the suspension
        store cannot be reached in that time (JetStream lost, a leader election longer than
        the deadline), whether a human answered is unknown: the call is denied (fail closed,
        whatever the default) and the failure is recorded on the result.
        """
        assert self._approvals is not None
        left = ctx.remaining()
        if left is not None:
            left = max(0.0, left)
        try:
            async with asyncio.timeout(None if left is None else left + _SETTLE_S):
                return await self._approvals.decide(event, result, call_id=ctx.call_id, wait_s=left)
        except (SuspensionAbortedError, NotConnectedError):
            raise  # a draining dispatcher (resumable) or a closed connection: the caller's
        except (HookbusError, TimeoutError) as exc:
            log.warning("approval for %r could not be settled (%r); denied", event, exc)
            failure = HandlerFailure(
                handler=result.decided_by or "?",
                kind="error",
                policy="deny",
                message=f"the approval store could not be reached: {exc!r}",
            )
            return msgspec.structs.replace(
                result,
                action="deny",
                reason="approval unavailable: the suspension store could not be reached",
                failures=[*result.failures, failure],
            )

    @traced_collect
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
        _check_collect_timeout(timeout)  # before the routes: bad input fails either way
        routes = self._table.routes(event)
        if not routes:
            if self._strict and event not in STANDARD_EVENTS:
                raise UnknownEventError(f"unknown event {event!r}: no handler is declared")
            return []
        data = json_safe(data or {})
        outcomes: dict[Route, Outcome] = {}  # by route: in-process names need not be unique
        remote = [r for r in routes if r.remote]
        # caller errors (closed connection, oversize event) raise here, not in a task group
        collect = await self._router.publish_collect(remote, event, data) if remote else None
        try:
            local = [r for r in routes if not r.remote]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    if local:
                        await asyncio.gather(
                            *(self._collect_local(r, event, data, timeout, outcomes) for r in local)
                        )
                    if collect is not None:
                        await collect.done.wait()
        finally:
            if collect is not None:
                answers = self._router.finish_collect(collect)
                outcomes.update((r, answers[r.name]) for r in remote if r.name in answers)
        responses = []
        for route in routes:
            outcome = outcomes.get(route)
            if isinstance(outcome, HookResult):
                if outcome.data is not None:
                    responses.append(outcome.data)
            elif outcome is None:
                log.warning(
                    "handler %r gave no answer to %r within %ss", route.name, event, timeout
                )
            else:
                log.warning("handler %r failed on %r: %s", route.name, event, outcome.message)
        return responses

    # -- suspensions (Vercel AI SDK hooks, durable) -----------------------------------------
    @property
    def suspensions(self) -> Suspensions:
        """The suspension store (raises `NotConnectedError` before `start`)."""
        if self._suspensions is None:
            raise NotConnectedError("suspensions need a started dispatcher with a connection")
        return self._suspensions

    async def hook(
        self,
        label: str,
        payload: type[T] | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> T:
        """Suspend until `label` is resolved (Vercel AI SDK ``hook``); see `Suspensions.hook`
        for the semantics and the errors raised. The hook is this dispatcher's agent's
        (``agent_id``, else the ``agent_id`` default field)."""
        return await self._store().hook(
            label, payload=payload, metadata=metadata, timeout_s=timeout_s
        )

    async def resolve_hook(self, label: str, value: Any, *, agent_id: str | None = None) -> None:
        """Resolve `label` of agent `agent_id` (default: this dispatcher's agent) from any
        process, or pre-register the resolution; see `Suspensions.resolve_hook`
        (`ResolutionRejectedError`, `AlreadySettledError`). An approval is answered with
        `answer_approval` instead (approval records are not in this store)."""
        await self._store(agent_id).resolve_hook(label, value)

    async def cancel_hook(
        self, label: str, *, reason: str | None = None, agent_id: str | None = None
    ) -> None:
        """Cancel the pending hook `label` of agent `agent_id` (default: this dispatcher's
        agent); see `Suspensions.cancel_hook`."""
        await self._store(agent_id).cancel_hook(label, reason=reason)

    async def answer_approval(
        self,
        label: str,
        choice: str,
        *,
        approver: str,
        agent_id: str | None = None,
        wait_s: float | None = None,
    ) -> ApprovalAnswer:
        """Answer the pending approval `label` of agent `agent_id` (default: this
        dispatcher's agent) as `approver`: write the answer proof and wait up to `wait_s`
        seconds (default: the dispatcher's `answer_wait_s`) for the deciding dispatcher to
        apply it; see `Approvals.answer` for the errors raised. Needs an approver's NATS
        permissions on a secured server."""
        approvals = await self._approvals_store()
        return await approvals.answer(
            label, choice, agent_id=self._agent(agent_id), approver=approver, wait_s=wait_s
        )

    def _agent(self, agent_id: str | None = None) -> str | None:
        """The agent a suspension call addresses: the one asked, else this dispatcher's."""
        if agent_id is not None:
            return agent_id
        if self._agent_id is not None:
            return self._agent_id
        default = self._defaults.get("agent_id")
        return default if isinstance(default, str) and default else None

    def _store(self, agent_id: str | None = None) -> Suspensions:
        return self.suspensions.for_agent(self._agent(agent_id))

    def abort_pending_hook(self, hook: PendingHook | Any) -> bool:
        """Stop waiting on a hook (or an approval) here (by `HookPart`, `PendingHook` or hook
        id); the record stays pending for a later run. Returns False if nothing here waits
        on it."""
        if self.suspensions.abort_pending_hook(hook):
            return True
        return self._approvals is not None and self._approvals.records.abort_pending_hook(hook)

    def abort_all(self) -> int:
        """Stop every durable wait of this process, hooks and approvals (each raises
        `SuspensionAbortedError`); the records stay pending for a retry to resume. Returns
        how many waits were stopped (0 without a started connection)."""
        if self._suspensions is None:
            return 0
        aborted = self._suspensions.abort_all()
        if self._approvals is not None:
            aborted += self._approvals.records.abort_all()
        return aborted

    def run(self, run_id: str | None = None) -> contextlib.AbstractAsyncContextManager[RunScope]:
        """``async with dispatcher.run(run_id):`` scopes the labels a run uses; exit removes
        its live hooks and unused pre-registered resolutions. Same `run_id` = resume."""
        return self._store().run(run_id)

    async def hook_events(self) -> HookEventStream:
        """Subscribe to hook events (pending / resolved / cancelled) as an async iterator."""
        return await self.suspensions.events()

    # -- approval grants ("Allow always") -----------------------------------------------------
    @property
    def approvals(self) -> Approvals:
        """The approvals policy (grants: ``approvals.grants``). Raises `NotConnectedError`
        before `start` or when made with ``approvals=False``."""
        if self._approvals is None:
            raise NotConnectedError("approvals need a started dispatcher with approvals on")
        return self._approvals

    async def approval_grants(
        self,
        *,
        agent_id: str | None = None,
        session_id: str | None = None,
        event: str | None = None,
        handler: str | None = None,
        tool: str | None = None,
    ) -> list[ApprovalGrant]:
        """Live "Allow always" grants, oldest first, matching the filters (None: any).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable (see `Grants.list`).
        """
        grants = await self._grants()
        return await grants.list(
            agent_id=agent_id, session_id=session_id, event=event, handler=handler, tool=tool
        )

    async def revoke_grant(self, grant: ApprovalGrant | str) -> None:
        """Revoke one grant (an `ApprovalGrant` or its key); see `Grants.revoke`."""
        await (await self._grants()).revoke(grant)

    async def approval_page(
        self, *, status: HookStatus | None = "pending", prefix: str | None = APPROVAL_LABEL_PREFIX
    ) -> SuspensionPage:
        """Approval records in the approvals bucket (pending ones by default), oldest
        first; also with approvals off (an approver's or operator's dispatcher). A record
        written elsewhere (e.g. an ``approval:`` label in the suspensions bucket) is not an
        approval and is not listed.

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        approvals = await self._approvals_store()
        return await approvals.records.page(status=status, prefix=prefix)

    async def cancel_approval(
        self, label: str, *, reason: str | None = None, agent_id: str | None = None
    ) -> None:
        """Cancel the pending approval `label` of agent `agent_id` (default: this
        dispatcher's agent): its waiter denies with the reason. Writes the approval record:
        on a secured server, a dispatcher's or admin's NATS user only (an approver answers
        instead). Raises as `Suspensions.cancel_hook`."""
        approvals = await self._approvals_store()
        await approvals.records.for_agent(self._agent(agent_id)).cancel_hook(label, reason=reason)

    async def get_approval(
        self, label: str, *, agent_id: str | None = None
    ) -> tuple[SuspensionRecord, int] | None:
        """The approval record `label` of agent `agent_id` (default: this dispatcher's
        agent) in the approvals bucket and its revision, or None; see `Suspensions.get`."""
        approvals = await self._approvals_store()
        return await approvals.records.for_agent(self._agent(agent_id)).get(label)

    async def _grants(self) -> Grants:
        """The grants store, also with approvals off (an operator's dispatcher)."""
        return (await self._approvals_store()).grants

    async def _approvals_store(self) -> Approvals:
        """The approvals (records, proofs, grants), also with approvals off."""
        if self._approvals is not None:
            return self._approvals
        if self._approvals_view is None:
            self._approvals_view = await self._open_approvals()
        return self._approvals_view

    async def _open_approvals(self) -> Approvals:
        if self._nc is None:
            raise NotConnectedError("approvals need a started dispatcher with a connection")
        return await Approvals.open(
            self._nc, self.suspensions, replicas=self._bucket_replicas,
            grant_ttl_s=self._approval_ttl_s, answer_wait_s=self._answer_wait_s,
            max_pending=self._max_pending_approvals,
        )  # fmt: skip

    # -- internals -----------------------------------------------------------------------
    @traced_call
    def _call(self, route: Route, ctx: EmitContext, data: dict[str, Any]) -> Awaitable[Outcome]:
        # the router's awaitable, not a coroutine of ours awaiting it: one frame less per
        # handler call; every caller awaits it at once
        ctx.called.append(route.name)
        return self._router.call(route, ctx, data)

    async def _call_group(
        self, group: list[Route], ctx: EmitContext, data: dict[str, Any]
    ) -> list[Outcome]:
        """Call a group of handlers on the same data: one handler, or a parallel group,
        each on its own subject (a reply is bound to the handler whose subject it
        answers)."""
        if len(group) == 1:
            return [await self._call(group[0], ctx, data)]
        return await self._call_each(group, ctx, data)

    async def _call_each(
        self, group: list[Route], ctx: EmitContext, data: dict[str, Any]
    ) -> list[Outcome]:
        # asyncio.gather: a third of an anyio task group's cost here; `_call` returns
        # failures as outcomes, so only caller errors (closed connection) propagate.
        return list(await asyncio.gather(*(self._call(r, ctx, data) for r in group)))

    async def _fold_routes(
        self, routes: tuple[Route, ...], ctx: EmitContext, fold: Fold
    ) -> HookResult | None:
        """Call and fold `routes` in order; the final result if one ended the fold.

        Three ways to call, all folding the same outcomes in the same order:
        a sequence of adjacent remote handlers of one worker process's handler set goes as one
        chain request (`_fold_chain`); a sequence of adjacent pure handlers is called at once,
        speculatively (`_fold_speculative`); the rest one by one, an adjacent sequence of
        parallel handlers concurrently (`_fold_each`).
        """
        for kind, seg in self._plan(routes):
            if kind == "one":
                route = seg[0]
                if not route.matches(fold.data):
                    continue
                denied = self._fold_one(fold, route, await self._call(route, ctx, fold.data))
            elif kind == "chain":
                denied = await self._fold_chain(seg, ctx, fold)
            elif kind == "pure":
                denied = await self._fold_speculative(seg, ctx, fold)
            else:  # a sequence of parallel handlers
                denied = await self._fold_each(seg, ctx, fold, self._call_group)
            if denied is not None:
                return denied
        return None

    def _plan(self, routes: tuple[Route, ...]) -> tuple[tuple[str, tuple[Route, ...]], ...]:
        """How `_fold_routes` calls `routes`: segments ``("one" | "chain" | "pure" |
        "parallel", routes)`` in call order. Made once per routing snapshot (the table
        hands out the same tuple until the routes change)."""
        key = (routes, self.chains)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        segments: list[tuple[str, tuple[Route, ...]]] = []
        i, n = 0, len(routes)
        while i < n:
            route = routes[i]
            j = i + 1
            if self.chains and route.chain:
                # one chain: the same process's handlers, all retry_safe or none (a chain
                # is hedged only when every step may run twice)
                while (
                    j < n
                    and routes[j].chain == route.chain
                    and routes[j].retry_safe == route.retry_safe
                    and routes[j].name in route.handler_set
                ):
                    j += 1
                j = _whole_parallel_runs(routes, i, j)
                if j - i > 1:
                    segments.append(("chain", routes[i:j]))
                    i = j
                    continue
                j = i + 1
            if route.parallel:  # called together anyway: no speculation needed
                while j < n and routes[j].parallel:
                    j += 1
                segments.append(("parallel", routes[i:j]))
            elif route.pure:
                while j < n and routes[j].pure and not routes[j].parallel:
                    j += 1
                segments.append(("pure" if j - i > 1 else "one", routes[i:j]))
            else:
                segments.append(("one", routes[i:j]))
            i = j
        if len(self._plans) >= 1024:  # stale snapshots: start over
            self._plans.clear()
        plan = self._plans[key] = tuple(segments)
        return plan

    async def _fold_each(
        self, routes: Sequence[Route], ctx: EmitContext, fold: Fold, call: _CallGroup
    ) -> HookResult | None:
        """Call and fold `routes` in amplifier-core's order (see `_groups`); `call` gives
        the outcomes of a group called on the same data."""
        for group in _groups(routes, fold):
            for route, outcome in zip(group, await call(group, ctx, fold.data), strict=True):
                denied = self._fold_one(fold, route, outcome)
                if denied is not None:
                    return denied
        return None

    async def _fold_chain(
        self, seg: tuple[Route, ...], ctx: EmitContext, fold: Fold
    ) -> HookResult | None:
        """Fold `seg` from one chain request to its worker process: the same outcomes, in
        the same order, as one request per handler would give, whatever happens to the
        process (see `_chain_calls`). Steps the chain did not run are called alone within
        what is left of the emit's deadline; if nothing matches the data, nothing is sent.
        """
        seg = _from_first_match(seg, fold.data)
        if len(seg) < 2:
            return await self._fold_each(seg, ctx, fold, self._call_group)
        calls = {r: start_call_span(r) for r in seg}  # each handler's span, as if called alone
        headers = [c.headers for c in calls.values()]
        chain = await self._router.call_chain(seg, ctx, fold.data, headers)
        if isinstance(chain, Failed):  # nothing ran: no span, each call makes its own
            return await self._fold_each(seg, ctx, fold, self._call_group)
        try:
            for group in _groups(seg, fold):
                data = fold.data
                outcomes = await chain.outcomes(
                    group,
                    lambda r: self._router.call(r, ctx, data),  # noqa: B023 (awaited here)
                )
                alone = [r for r, o in zip(group, outcomes, strict=True) if o is None]
                called: dict[Route, Outcome] = {}
                if alone:  # not run by the chain: called on its own
                    outs = await self._call_group(alone, ctx, fold.data)
                    called = dict(zip(alone, outs, strict=True))
                for route, outcome in zip(group, outcomes, strict=True):
                    if outcome is None:
                        outcome = called[route]
                    else:
                        ctx.called.append(route.name)
                        calls[route].end(outcome)
                    denied = self._fold_one(fold, route, outcome)
                    if denied is not None:
                        return denied
        finally:
            chain.close()
        return None

    async def _fold_speculative(
        self, run: Sequence[Route], ctx: EmitContext, fold: Fold
    ) -> HookResult | None:
        """Call a sequence of pure handlers at once on the current data and fold their
        results in priority order as each arrives; the decision is the one calling them
        one by one gives (the reference).

        A deny (or a failure that ends the fold) returns at once. A modify replaces the
        data: every later handler's call, made on the stale data, is dropped (cancelled;
        an in-process handler gets the cancellation) and the rest of the run is called
        again at once on the new data. Each result is judged as if its call had started
        when the one before it ended (`_as_if_sequential`): a call the emit's deadline
        would have cut, called one by one, is a ``timeout`` here too.
        """
        clock = time.monotonic()  # when the next handler would start, called one by one
        k = 0
        while k < len(run):
            data = fold.data
            launched = time.monotonic()
            calls = {
                r: asyncio.ensure_future(self._timed_call(r, ctx, data))
                for r in run[k:]
                if r.matches(data)
            }
            try:
                for idx in range(k, len(run)):
                    route = run[idx]
                    call = calls.get(route)
                    if call is None:  # its tool filter does not admit this data
                        continue
                    outcome, ended = await call
                    outcome, clock = _as_if_sequential(
                        outcome, clock, ended - launched, ctx.deadline
                    )
                    denied = self._fold_one(fold, route, outcome)
                    if denied is not None:
                        return denied
                    if fold.data is not data:  # modified: the later calls saw stale data
                        k = idx + 1
                        break
                else:
                    return None
            finally:
                _drop(calls.values())
        return None

    async def _timed_call(
        self, route: Route, ctx: EmitContext, data: dict[str, Any]
    ) -> tuple[Outcome, float]:
        """`_call`'s outcome and when it came (`time.monotonic()` seconds)."""
        outcome = await self._call(route, ctx, data)
        return outcome, time.monotonic()

    @property
    def decision_log(self) -> DecisionLog | None:
        """The decision audit trail's writer while it is on (``audit=True``, started)."""
        return self._decisions

    def _record(
        self,
        event: str,
        data: dict[str, Any],
        result: HookResult,
        ctx: EmitContext,
        idempotency_key: str | None,
    ) -> None:
        """Append one decided emit to the audit trail, with its duration (milliseconds
        since `ctx.started`); never raises (see `DecisionLog`)."""
        assert self._decisions is not None
        duration_ms = (time.monotonic() - ctx.started) * 1000.0
        tool = (data or {}).get("tool_name", self._defaults.get("tool_name"))
        self._decisions.append(
            event,
            result,
            emit_id=ctx.id,
            idempotency_key=idempotency_key,
            agent_id=ctx.agent_id,
            session_id=ctx.session_id,
            tool_name=tool if isinstance(tool, str) else None,
            handlers=ctx.called,
            trace_id=current_trace_id(),  # the emit span's
            duration_ms=duration_ms,
        )

    @staticmethod
    def _fold_one(fold: Fold, route: Route, outcome: Outcome) -> HookResult | None:
        if isinstance(outcome, Failed):
            log.warning(
                "handler %r failed (%s, policy %s): %s",
                route.name,
                outcome.kind,
                "deny" if outcome.kind == "bad_reply" else route.failure_policy,
                outcome.message,
            )
            return fold.fail(route.name, outcome.kind, route.failure_policy, outcome.message)
        if route.parallel and outcome.action == "modify":
            return fold.fail(
                route.name, "bad_reply", route.failure_policy, "a parallel handler may not modify"
            )
        return fold.apply(route.name, outcome)

    async def _collect_local(
        self,
        route: Route,
        event: str,
        data: dict[str, Any],
        timeout: float,
        outcomes: dict[Route, Outcome],
    ) -> None:
        limited = route if route.timeout_s is not None else _with_timeout(route, timeout)
        outcomes[route] = await call_local(limited, event, json_copy(data))


def _groups(routes: Sequence[Route], fold: Fold) -> Iterator[list[Route]]:
    """amplifier-core's order, as groups to call on the same data: each handler whose
    tool filter matches the data it would see, alone; an adjacent sequence of parallel handlers
    together (those matching the data at the run's start). Lazy: each group is formed
    after the previous one was folded, on the data it left."""
    i, n = 0, len(routes)
    while i < n:
        if routes[i].parallel:
            group = []
            while i < n and routes[i].parallel:
                if routes[i].matches(fold.data):
                    group.append(routes[i])
                i += 1
        else:
            group = [routes[i]] if routes[i].matches(fold.data) else []
            i += 1
        if group:
            yield group


def _whole_parallel_runs(routes: Sequence[Route], i: int, j: int) -> int:
    """The end of a chain ``routes[i:j]`` cut so that it never ends inside a run of adjacent
    parallel handlers that goes on past it (the run is called together, on the same data
    and deadline: a chain holding part of it would be waited for before the rest is
    called). Returns the new end (``i + 1`` or less: no chain)."""
    if j >= len(routes) or not (routes[j].parallel and routes[j - 1].parallel):
        return j
    k = j - 1
    while k > i and routes[k - 1].parallel:
        k -= 1
    return k


def _from_first_match(seg: tuple[Route, ...], data: dict[str, Any]) -> tuple[Route, ...]:
    """`seg` from its first handler whose tool filter admits `data` on: the handlers
    before it never run (only a handler that runs can change the data), and with none
    left, nothing is sent at all."""
    for i, route in enumerate(seg):
        if route.matches(data):
            return seg[i:]
    return ()


def _as_if_sequential(
    outcome: Outcome, start: float, took: float, deadline: float | None
) -> tuple[Outcome, float]:
    """A speculative call's `outcome` as the same call, started at `start` (monotonic
    seconds: when the handler before it would have ended, called one by one) and taking
    `took` seconds, gives it: a ``timeout`` if it would have ended past the emit's
    `deadline` (None: no deadline), since called one by one it would have been cut (or not
    called at all). Also returns when the next handler would start. A speculative call
    starts no later, so its own cut is never earlier than that one."""
    end = start + took
    if deadline is None or end <= deadline:
        return outcome, end
    if not (isinstance(outcome, Failed) and outcome.kind == "timeout"):
        outcome = Failed("timeout", "called one by one, it would have run past the deadline")
    return outcome, deadline


def _drop(calls: Iterable[asyncio.Future[tuple[Outcome, float]]]) -> None:
    """Cancel the speculative calls still running (their results are stale or not needed)
    and retrieve the errors of those that ended, so none is logged as never retrieved."""
    for call in calls:
        if not call.done():
            call.cancel()
        elif not call.cancelled():
            call.exception()


def _check_collect_timeout(timeout: object) -> None:
    """`emit_and_collect`'s `timeout`: a number of seconds >= 0 (NaN and bools refused).

    Raises:
        BadRequestError: anything else.
    """
    if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and timeout >= 0):
        raise BadRequestError(f"timeout must be a number of seconds >= 0: {timeout!r}")


_stamp_cache: tuple[int, str] = (-1, "")


def _rfc3339_ns() -> str:
    """Now in UTC as RFC 3339 with nanoseconds, as amplifier-core stamps ``timestamp``
    (e.g. ``2026-01-02T03:04:05.123456789+00:00``; `datetime.fromisoformat` reads it).
    The formatted whole second is kept: formatting it is most of the cost."""
    global _stamp_cache
    ns = time.time_ns()
    second, fraction = divmod(ns, 1_000_000_000)
    cached, whole = _stamp_cache
    if cached != second:
        whole = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _stamp_cache = (second, whole)
    return f"{whole}.{fraction:09d}+00:00"


def _with_timeout(route: Route, timeout_s: float) -> Route:
    return dataclasses.replace(route, timeout_s=timeout_s)
