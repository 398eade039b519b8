"""How `HookDispatcher` emits: the data an emit's handlers see, its deadline, the fold
(`RouteFolder`), approvals of its ``ask_user`` results, the hand-off of the decision to the
audit trail, and `emit_and_collect`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from datetime import UTC, datetime
from typing import Any, Unpack

import msgspec
import nats.errors

from hookbus._core import clock
from hookbus._core.copies import json_copy, json_safe_encoded
from hookbus.schemas import (
    STANDARD_EVENTS,
    BadRequestError,
    EmitOptions,
    HandlerFailure,
    HookbusError,
    HookResult,
    NotConnectedError,
    SuspensionAbortedError,
    UnknownEventError,
    json_safe,
)

from ._approvals import Approvals, joined_decision
from ._audit import DecisionLog, current_trace_id
from ._call_router import EmitContext, Router
from ._calls import call_local
from ._fold import Fold
from ._folding import RouteFolder
from ._outcomes import Outcome
from ._route_table import Route

__all__ = ["Emitter"]

log = logging.getLogger("hookbus.dispatcher")

_SETTLE_S = 1.0
"""Seconds past an emit's deadline that settling its approval (the store's reads and the
closing write) may take before the call is denied as unknown."""

REGISTRY_WAIT_S = 5.0
"""Seconds an emit waits (at most, and within its own timeout) for a dispatcher that is
behind the handler registry to catch up before it is denied."""

_BEHIND = (
    "the handler registry is not followed: this dispatcher missed a change of it and has"
    " not caught up; denied until it has"
)


class Emitter:
    """Emits events to the routes of a routing table; `HookDispatcher.emit` and
    `HookDispatcher.emit_and_collect` say what each call does.

    Args:
        router: the dispatcher's router (its ``table`` gives the routes).
        folder: calls and folds the routes of one emit.
        strict_events: an event neither standard nor routed is an `UnknownEventError`.
        agent_id: the agent every emit acts as (None: the data's own).
    """

    def __init__(
        self,
        router: Router,
        folder: RouteFolder,
        *,
        strict_events: bool = False,
        agent_id: str | None = None,
    ) -> None:
        self._router = router
        self._table = router.table
        self._folder = folder
        self._strict = strict_events
        self._agent_id = agent_id
        self.defaults: dict[str, Any] = {}
        """The fields merged into every emit's data (explicit data wins)."""
        self.approvals: Approvals | None = None
        """The approvals of ``ask_user`` results (None: they pass through unanswered)."""
        self.decisions: DecisionLog | None = None
        """The decision audit trail every decided emit is appended to (None: off)."""

    async def emit(
        self, event: str, data: dict[str, Any], **options: Unpack[EmitOptions]
    ) -> HookResult:
        """`HookDispatcher.emit`: see there for the semantics and the errors raised."""
        return await self.emit_with(
            event,
            data,
            options.get("idempotency_key"),
            options.get("timeout_s"),
            options.get("approval_timeout_s"),
        )

    async def emit_with(
        self,
        event: str,
        data: dict[str, Any],
        idempotency_key: str | None,
        timeout_s: float | None,
        approval_timeout_s: float | None,
    ) -> HookResult:
        """`emit` with its options as positional arguments (`HookDispatcher.emit`'s path:
        no keyword dict per emit); the same semantics and errors."""
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise BadRequestError(f"timeout_s must be a finite number of seconds >= 0: {timeout_s}")
        if approval_timeout_s is not None and not (
            math.isfinite(approval_timeout_s) and approval_timeout_s > 0
        ):
            raise BadRequestError(
                f"approval_timeout_s must be a finite number of seconds above 0:"
                f" {approval_timeout_s}"
            )
        if not self._router.registry_current and not await self._router.wait_registry(
            REGISTRY_WAIT_S if timeout_s is None else min(timeout_s, REGISTRY_WAIT_S)
        ):
            return self._denied_behind(event, data, timeout_s, idempotency_key)
        routes = self._table.routes(event)
        if not routes:
            if self._strict and event not in STANDARD_EVENTS:
                raise UnknownEventError(f"unknown event {event!r}: no handler is declared")
            safe = json_safe(data or {})
            return HookResult(action="continue", data=safe, chained_data=safe)
        if data is not None and not isinstance(data, dict):
            raise BadRequestError(f"event data must be a dict, not {type(data).__name__}")
        merged = {**self.defaults, **(data or {})}
        if self._agent_id is not None:
            claimed = merged.get("agent_id")
            if claimed is not None and claimed != self._agent_id:
                raise BadRequestError(
                    f"this dispatcher acts as agent {self._agent_id!r}; the data names"
                    f" agent {claimed!r:.200}"
                )
            merged["agent_id"] = self._agent_id
        merged["timestamp"] = _rfc3339_ns()
        # the copy the handlers see, and its JSON: sent as it is (encoded once)
        current, encoded = json_safe_encoded(merged)
        fold = Fold(current, event)
        ctx = EmitContext(event, current, timeout_s=timeout_s, call_id=idempotency_key)
        if encoded is not None:
            ctx.encoded_as(current, encoded)
        try:
            result = await self._folder.fold_routes(routes, ctx, fold)
            if result is None:
                result = fold.result()
                if result.action == "ask_user" and self.approvals is not None:
                    result = await self._approve(event, fold.asks(), ctx, approval_timeout_s)
        except nats.errors.Error as exc:
            raise NotConnectedError(f"NATS failed during the emit: {type(exc).__name__}") from exc
        if self.decisions is not None:  # the decision is final: record it
            self.record(event, data, result, ctx, idempotency_key)
        return result

    def _denied_behind(
        self,
        event: str,
        data: dict[str, Any],
        timeout_s: float | None,
        idempotency_key: str | None,
    ) -> HookResult:
        """The decision of an emit while the dispatcher is behind the registry: deny (a
        handler declared in a change it missed might deny), recorded like any other."""
        safe = json_safe(data if isinstance(data, dict) else {})
        result = HookResult(action="deny", reason=_BEHIND, data=safe, chained_data=safe)
        if self.decisions is not None:
            ctx = EmitContext(event, safe, timeout_s=timeout_s, call_id=idempotency_key)
            self.record(event, safe, result, ctx, idempotency_key)
        return result

    async def _approve(
        self, event: str, asks: list[HookResult], ctx: EmitContext, longest_s: float | None
    ) -> HookResult:
        """Turn the emit's ``ask_user`` results (`Fold.asks`, priority order) into the
        humans' answers, one question after the other within the emit's deadline.

        Every asking handler's question is asked (or allowed by its own "Allow always"
        grant); the first refusal denies and later questions are not asked; the call goes
        on only when every question was allowed. The result is amplifier-core-shaped (the
        first ask's fields; see `joined_decision`). `longest_s`: the emit's
        ``approval_timeout_s`` (each question's timeout is cut to it; None: no cut).
        """
        decisions: list[HookResult] = []
        for ask in asks:
            decided = await self._approve_one(event, ask, ctx, longest_s)
            decisions.append(decided)
            if decided.action != "continue":
                break
        return joined_decision(asks, decisions)

    async def _approve_one(
        self, event: str, result: HookResult, ctx: EmitContext, longest_s: float | None
    ) -> HookResult:
        """Turn one ``ask_user`` result into the human's answer, within the emit's deadline.

        The wait is cut to what the emit has left: when that ends it before the approval's
        own timeout, the call is denied and the approval stays pending for a retry with the
        same idempotency key (the approval's default applies only at its own timeout). The
        store's reads and writes get at most `_SETTLE_S` seconds more. If the suspension
        store cannot be reached in that time (JetStream lost, a leader election longer than
        the deadline), whether a human answered is unknown: the call is denied (fail closed,
        whatever the default) and the failure is recorded on the result.
        """
        assert self.approvals is not None
        left = ctx.remaining()  # at least 0
        try:
            async with asyncio.timeout(None if left is None else left + _SETTLE_S):
                return await self.approvals.decide(
                    event, result, call_id=ctx.call_id, wait_s=left, longest_s=longest_s
                )
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

    async def emit_and_collect(
        self, event: str, data: dict[str, Any], timeout: float = 1.0
    ) -> list[Any]:
        """`HookDispatcher.emit_and_collect`: see there for the semantics and the errors
        raised."""
        _check_collect_timeout(timeout)  # before the routes: bad input fails either way
        if not self._router.registry_current and not await self._router.wait_registry(
            min(timeout, REGISTRY_WAIT_S)
        ):
            raise HookbusError(_BEHIND)
        routes = self._table.routes(event)
        if not routes:
            if self._strict and event not in STANDARD_EVENTS:
                raise UnknownEventError(f"unknown event {event!r}: no handler is declared")
            return []
        data, encoded = json_safe_encoded(data or {})  # sent as it is: encoded once
        outcomes: dict[Route, Outcome] = {}  # by route: in-process names need not be unique
        remote = [r for r in routes if r.remote]
        # caller errors (closed connection, oversize event) raise here, not in a task group
        collect = (
            await self._router.publish_collect(remote, event, data, encoded) if remote else None
        )
        try:
            local = [r for r in routes if not r.remote]
            if not local:  # remote handlers only: one wait, no task scope
                assert collect is not None
                await collect.wait(timeout)
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await asyncio.gather(
                            *(self._collect_local(r, event, data, timeout, outcomes) for r in local)
                        )
                        if collect is not None:
                            await collect.wait(None)
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

    def record(
        self,
        event: str,
        data: dict[str, Any],
        result: HookResult,
        ctx: EmitContext,
        idempotency_key: str | None,
    ) -> None:
        """Append one decided emit to the audit trail, with its duration (milliseconds
        since `ctx.started`); never raises (see `DecisionLog`)."""
        assert self.decisions is not None
        duration_ms = (clock.now() - ctx.started) * 1000.0
        tool = (data or {}).get("tool_name", self.defaults.get("tool_name"))
        self.decisions.append(
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
