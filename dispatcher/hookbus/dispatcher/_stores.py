"""The durable stores of a `HookDispatcher`: what its `start` opens and its `close` closes
(the buckets, the suspension store, the deciding approvals, the decision audit trail), and
the `ApprovalsClient` its approval calls go through."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as NATS

from hookbus._core.kv import ensure_buckets
from hookbus.schemas import NotConnectedError

from ._approval_rules import MAX_APPROVAL_TIMEOUT_S
from ._approvals import Approvals
from ._approvals_client import ApprovalsClient
from ._audit import DecisionLog
from ._call_router import Router
from ._emitter import Emitter
from ._suspensions import PendingHook, Suspensions

__all__ = ["Stores"]


class Stores:
    """A dispatcher's stores; the arguments are `HookDispatcher`'s of the same names
    (`approvals`: whether ``ask_user`` results become approvals). The emitter gets the
    deciding approvals and the audit trail while they are open."""

    def __init__(
        self,
        emitter: Emitter,
        *,
        agent_id: str | None,
        bucket_replicas: int,
        approvals: bool,
        suspension_ttl_s: float,
        approval_ttl_s: float,
        max_pending_approvals: int | None,
        answer_wait_s: float,
        strict_buckets: bool,
        audit: bool,
        audit_max_age_s: float,
        audit_max_bytes: int,
        js_domain: str | None = None,
    ) -> None:
        self._emitter = emitter
        self._agent_id = agent_id
        self._replicas = bucket_replicas
        self._approvals_on = approvals
        self._suspension_ttl_s = suspension_ttl_s
        self._approval_ttl_s = approval_ttl_s
        self._max_pending = max_pending_approvals
        self._answer_wait_s = answer_wait_s
        self._strict = strict_buckets
        self._js_domain = js_domain
        self.audit = audit
        """Whether `open` turns the decision audit trail on."""
        self._audit_retention = (audit_max_age_s, audit_max_bytes)
        self.suspensions: Suspensions | None = None
        self.approvals: Approvals | None = None
        """The deciding approvals (None: approvals off, or not open)."""
        self.decisions: DecisionLog | None = None
        self._client: ApprovalsClient | None = None

    async def open(self, nc: NATS, router: Router) -> None:
        """Create or check the buckets, start `router` (the registry watch), open the
        suspension store, the approvals (if on) and the audit trail (if `audit`)."""
        await ensure_buckets(  # created as asked, or reported if they differ
            nc,
            replicas=self._replicas,
            suspension_ttl_s=self._suspension_ttl_s,
            # an agent's own dispatcher may only get its own keys of the approvals bucket:
            # `Approvals.open` binds it (on an open server, opens or creates it)
            approval_ttl_s=(
                MAX_APPROVAL_TIMEOUT_S if self._approvals_on and self._agent_id is None else None
            ),
            strict=self._strict,
            js_domain=self._js_domain,
        )
        await router.start()
        self.suspensions = await Suspensions.open(
            nc,
            ttl_s=self._suspension_ttl_s,
            replicas=self._replicas,
            agent_id=self._agent_id,
            scoped=self._agent_id is not None,
            js_domain=self._js_domain,
        )
        if self._approvals_on:
            self.approvals = self._emitter.approvals = await self._open_approvals(nc)
        if self.audit and self.decisions is None:
            max_age_s, max_bytes = self._audit_retention
            decisions = DecisionLog(
                nc,
                max_age_s=max_age_s,
                max_bytes=max_bytes,
                replicas=self._replicas,
                strict=self._strict,
                open_stream=self._agent_id is None,
            )
            await decisions.start()
            self.decisions = self._emitter.decisions = decisions

    async def close(self) -> None:
        """Close what `open` and `answers` opened (idempotent)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()  # a bucket opened for answering (approvals off)
        if self.approvals is not None:
            await self.approvals.close()
        self.approvals = self._emitter.approvals = None
        if self.suspensions is not None:
            await self.suspensions.close()
        if self.decisions is not None:
            await self.decisions.close(timeout_s=2.0)  # queued records get 2 s more
            self.decisions = self._emitter.decisions = None

    def suspension_store(self) -> Suspensions:
        """The suspension store (raises `NotConnectedError` before `open`)."""
        if self.suspensions is None:
            raise NotConnectedError("suspensions need a started dispatcher with a connection")
        return self.suspensions

    async def answers(self, nc: NATS | None) -> ApprovalsClient:
        """The approvals client: over the deciding approvals when they are on, else over the
        approvals bucket opened on first use (on `nc`) and kept until `close`."""
        if self._client is None:
            if self.approvals is not None:
                self._client = ApprovalsClient.over(self.approvals)
            else:
                self._client = ApprovalsClient.over(await self._open_approvals(nc), owned=True)
        return self._client

    async def _open_approvals(self, nc: NATS | None) -> Approvals:
        if nc is None:
            raise NotConnectedError("approvals need a started dispatcher with a connection")
        return await Approvals.open(
            nc, self.suspension_store(), replicas=self._replicas,
            grant_ttl_s=self._approval_ttl_s, answer_wait_s=self._answer_wait_s,
            max_pending=self._max_pending, js_domain=self._js_domain,
        )  # fmt: skip

    def abort_pending_hook(self, hook: PendingHook | Any) -> bool:
        """See `HookDispatcher.abort_pending_hook`."""
        if self.suspension_store().abort_pending_hook(hook):
            return True
        return self.approvals is not None and self.approvals.records.abort_pending_hook(hook)

    def abort_all(self) -> int:
        """See `HookDispatcher.abort_all`."""
        if self.suspensions is None:
            return 0
        aborted = self.suspensions.abort_all()
        if self.approvals is not None:
            aborted += self.approvals.records.abort_all()
        return aborted
