"""`SuspensionHooks`: a dispatcher's durable hooks (Vercel AI SDK ``hook``), on `Suspensions`."""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

from ._stores import Stores
from ._suspensions import HookEventStream, PendingHook, RunScope, Suspensions

__all__ = ["SuspensionHooks"]

T = TypeVar("T")


class SuspensionHooks:
    """The suspension face of `HookDispatcher`: suspend until a label is resolved, resolve,
    cancel and abort, addressed to the dispatcher's agent (``agent_id``, else the
    ``agent_id`` default field). The records live in the suspensions bucket (`Suspensions`);
    these methods pick the agent and hand the call on."""

    _stores: Stores
    _agent_id: str | None
    _defaults: dict[str, Any]

    @property
    def suspensions(self) -> Suspensions:
        """The suspension store (raises `NotConnectedError` before `start`)."""
        return self._stores.suspension_store()

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

    async def resolve_hook(
        self,
        label: str,
        value: Any,
        *,
        agent_id: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Resolve `label` of agent `agent_id` (default: this dispatcher's agent) from any
        process, or pre-register the resolution, within `timeout_s` seconds (None: the
        store's deadline); see `Suspensions.resolve_hook` (`ResolutionRejectedError`,
        `AlreadySettledError`, `HookbusTimeoutError`). An approval is answered with
        `ApprovalsClient.answer_approval` instead (approval records are not in this store)."""
        await self._store(agent_id).resolve_hook(label, value, timeout_s=timeout_s)

    async def cancel_hook(
        self,
        label: str,
        *,
        reason: str | None = None,
        agent_id: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Cancel the pending hook `label` of agent `agent_id` (default: this dispatcher's
        agent) within `timeout_s` seconds (None: the store's deadline); see
        `Suspensions.cancel_hook`."""
        await self._store(agent_id).cancel_hook(label, reason=reason, timeout_s=timeout_s)

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
        return self._stores.abort_pending_hook(hook)

    def abort_all(self) -> int:
        """Stop every durable wait of this process, hooks and approvals (each raises
        `SuspensionAbortedError`); the records stay pending for a retry to resume. Returns
        how many waits were stopped (0 without a started connection)."""
        return self._stores.abort_all()

    def run(self, run_id: str | None = None) -> contextlib.AbstractAsyncContextManager[RunScope]:
        """``async with dispatcher.run(run_id):`` scopes the labels a run uses; exit removes
        its live hooks and unused pre-registered resolutions. Same `run_id` = resume."""
        return self._store().run(run_id)

    async def hook_events(self) -> HookEventStream:
        """Subscribe to hook events (pending / resolved / cancelled) as an async iterator."""
        return await self.suspensions.events()
