"""The in-process side of `HookTestEnv` (``with_real=False``): a worker's handlers run as
one chain and folded (`run_chain`), ``ask_user`` answered by the test (`MemoryApprovals`),
suspensions in memory (`MemorySuspensions`); no nats-server, no network."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime
from typing import Any, TypeVar, Unpack

from hookbus._core.deadlines import Deadline
from hookbus.dispatcher import Fold
from hookbus.schemas import (
    BadRequestError,
    EmitOptions,
    HookResult,
    UnknownEventError,
    json_safe,
)
from hookbus.schemas.events import STANDARD_EVENTS
from hookbus.workers import HandlerSpec

from ._approval_desk import Approval, MemoryApprovals
from ._chain import ordered, run_chain
from ._memory_suspensions import MemorySuspensions

__all__ = ["MemoryBus"]

T = TypeVar("T")


class MemoryBus:
    """A worker's handlers, approvals and suspensions, in this process."""

    def __init__(
        self, specs: list[HandlerSpec], *, agent_id: str | None, strict_events: bool
    ) -> None:
        self._specs = specs
        self._agent_id = agent_id
        self._strict = strict_events
        self.approvals = MemoryApprovals()
        self.suspensions = MemorySuspensions()

    async def start(self) -> None:
        """Nothing to start."""

    async def close(self) -> None:
        """Nothing to stop."""

    async def emit(
        self, event: str, data: dict[str, Any], **options: Unpack[EmitOptions]
    ) -> HookResult:
        """As `HookDispatcher.emit` with approvals: the chain folded, then each asker's
        question decided by the test (or its timeout)."""
        timeout_s = options.get("timeout_s")
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise BadRequestError(f"timeout_s must be a finite number of seconds >= 0: {timeout_s}")
        chain = ordered(self._specs, event)
        if not chain:
            if self._strict and event not in STANDARD_EVENTS:
                raise UnknownEventError(f"unknown event {event!r}: no handler is declared")
            safe = json_safe(data or {})
            return HookResult(action="continue", data=safe, chained_data=safe)
        if not isinstance(data, dict):
            raise BadRequestError(f"event data must be a dict, not {type(data).__name__}")
        merged = dict(data)
        if self._agent_id is not None:
            claimed = merged.get("agent_id")
            if claimed is not None and claimed != self._agent_id:
                raise BadRequestError(f"this environment acts as agent {self._agent_id!r}")
            merged["agent_id"] = self._agent_id
        merged["timestamp"] = datetime.now(UTC).isoformat()
        fold = Fold(json_safe(merged), event)
        deadline = Deadline.after(timeout_s)  # on the loop's clock; `NEVER`: none
        result = await run_chain(chain, event, fold, deadline=deadline)
        if result is not None:
            return result
        result = fold.result()
        if result.action != "ask_user":
            return result
        call_id = options.get("idempotency_key") or uuid.uuid4().hex
        return await self.approvals.decide(
            event,
            fold.asks(),
            call_id=call_id,
            longest_s=options.get("approval_timeout_s"),
            deadline=deadline,
        )

    async def next_approval(self, timeout_s: float | None) -> Approval:
        return await self.approvals.next_approval(timeout_s)

    async def answer(self, label: str, choice: str, *, approver: str) -> None:
        self.approvals.answer(label, choice, approver=approver)

    async def hook(self, label: str, payload: type[T] | None, **options: Any) -> T:
        return await self.suspensions.hook(label, payload, options["timeout_s"])

    async def pending(self, label: str) -> bool:
        return self.suspensions.pending(label)

    async def resolve_hook(self, label: str, value: Any) -> None:
        self.suspensions.resolve_hook(label, value)

    async def cancel_hook(self, label: str, reason: str | None) -> None:
        self.suspensions.cancel_hook(label, reason)
