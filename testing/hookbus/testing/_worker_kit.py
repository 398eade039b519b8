"""Test a `HookWorker`'s handlers in process, with no nats-server: `WorkerTestKit`.

::

    from hookbus.testing import WorkerTestKit

    async with WorkerTestKit(worker) as hooks:
        result = await hooks.emit("tool:pre", {"tool_name": "Bash", "tool_input": {...}})
        assert result.action == "deny"

The kit decides as a dispatcher on NATS decides for the same handlers, because it runs the
same code with only the network taken out (as faststream's ``TestNatsBroker`` does):

- each handler's declaration is read as every dispatcher reads it from the registry
  (`check_declaration`, then `RoutingTable.put_remote`): the same bounds, timeout clamp,
  tool filter (whole name, ignoring case: ``bash`` admits Claude Code's ``Bash``), failure
  policy, and order (priority, then name);
- an in-process `HookDispatcher` folds the outcomes (`Fold`: deny short-circuit, modify
  chaining, context merging, the first ``ask_user``, failure policies), and calls each
  handler through its own remote call path (`call_remote`, `Requester`: the call's budget,
  a timeout on its clock, the reply read byte for byte, hedging of ``retry_safe`` ones);
- the requests reach the worker's own request path (`RequestServer.handle`: the envelope
  decoded, the handler run within its timeout, an exception answered ``handler_error``, a
  result that cannot be read ``bad_result``, which the fold always denies).

What connects the two is `_Loopback`, an in-memory stand-in for the one nats-py client each
side would hold: ``publish`` hands a message to the subscriptions whose subject matches it
(NATS wildcards; a request nobody serves is answered "no responders", as the server does).

Not reproduced: chain requests (the kit calls handlers one request each; a dispatcher on
NATS folds chains to the same results), approvals (an ``ask_user`` result is returned as
the handler made it, as a dispatcher with ``approvals=False`` returns it), the registry
bucket and liveness, the worker's `max_concurrency` refusals and its reply size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Unpack

from nats.aio.msg import Msg

from hookbus.dispatcher import HookDispatcher, route_over
from hookbus.schemas import (
    EmitOptions,
    HookReply,
    HookResult,
    UnknownEventError,
    WireError,
    encode,
)
from hookbus.workers import HandlerSpec, HookWorker

__all__ = ["WorkerTestKit"]

log = logging.getLogger("hookbus.testing")

_Callback = Callable[[Msg], Awaitable[None]]

_MAX_PAYLOAD = 1024 * 1024
"""Bytes: nats-server's default ``max_payload``, the bound a dispatcher checks a request
against (`PayloadTooLargeError`)."""


class WorkerTestKit:
    """A `HookWorker`'s handlers, called in this process as a dispatcher on NATS calls them.

    ``async with WorkerTestKit(worker) as hooks:`` then ``await hooks.emit(event, data)``
    returns the `HookResult` a `HookDispatcher` on NATS would fold for the same handlers
    (see the module docstring for how, and what is left out). The worker is only read: it
    need not be started, it keeps no trace of the kit, and it may be served on NATS later
    (or already be). The handlers it has when the kit starts are the ones called.

    Args:
        worker: the worker whose handlers are called.
        strict_events: raise `UnknownEventError` when an event has no handler (default; a
            test of an event the worker does not handle tests nothing). False: what a
            `HookDispatcher` does, ``continue`` with the data (``[]`` for
            `emit_and_collect`).

    Raises:
        ValueError: the worker has no handlers (as `HookWorker.start` raises).
    """

    def __init__(self, worker: HookWorker, *, strict_events: bool = True) -> None:
        specs = worker.handlers
        if not specs:
            raise ValueError("this worker has no handlers")
        self._worker = worker
        self._specs: list[HandlerSpec] = specs
        self._strict = strict_events
        self._loopback = _Loopback()
        self._dispatcher = HookDispatcher(None, chains=False, approvals=False)
        self._state = "new"  # new -> started -> closed
        self.calls: list[tuple[str, str]] = []
        """``(event, handler name)`` of each request a handler was run for, in the order
        they arrived: `emit` calls and `emit_and_collect` ones (a ``retry_safe`` handler
        slow to answer is sent again, as on NATS, and appears twice)."""

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Route every handler of the worker, in the dispatcher and on the loopback
        (idempotent; `__aenter__` calls it).

        Raises:
            BadRequestError: a declaration every dispatcher would refuse (never for one
                `HookWorker.add_handler` accepted).
            RuntimeError: the kit was closed.
        """
        if self._state == "started":
            return
        if self._state == "closed":
            raise RuntimeError("this WorkerTestKit is closed")
        loopback = self._loopback
        # the dispatcher routes over the loopback, from the declarations the worker would
        # write in the registry (checked as every dispatcher checks them)
        routed = await route_over(
            self._dispatcher, loopback, [spec.declaration for spec in self._specs]
        )
        for spec, decl in zip(self._specs, routed, strict=True):
            serve = self._server(spec)
            await loopback.subscribe(decl.subject, cb=serve)
            await loopback.subscribe(decl.collect_subject, cb=serve)
        self._state = "started"

    async def close(self) -> None:
        """Cancel the handler calls still running (a call the emit stopped waiting for),
        and stop (idempotent)."""
        if self._state == "closed":
            return
        self._state = "closed"
        await self._loopback.close()
        await self._dispatcher.close()

    async def __aenter__(self) -> WorkerTestKit:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- emitting -----------------------------------------------------------------------------
    @property
    def dispatcher(self) -> HookDispatcher:
        """The in-process `HookDispatcher` the kit emits through: `set_default_fields`,
        `list_handlers`, and `register` for in-process handlers of your own folded with
        the worker's (at equal priority they run first, as on NATS)."""
        return self._dispatcher

    async def emit(
        self, event: str, data: dict[str, Any], **options: Unpack[EmitOptions]
    ) -> HookResult:
        """Emit `event` to the worker's handlers and fold their results: `HookDispatcher.emit`,
        every handler called as a remote one.

        Args:
            event: the event name, e.g. ``"tool:pre"``.
            data: the event data (never changed; each handler gets its own copy, with a
                ``timestamp`` stamped in, as over NATS).
            timeout_s: the emit's overall deadline in seconds (None: each handler's own
                ``timeout_s`` only).
            idempotency_key: sent to the handlers in the envelope, as over NATS.
            approval_timeout_s: as `HookDispatcher.emit` (the kit runs no approvals: an
                ``ask_user`` is returned as such); accepted so the kit's emit is an `Emit`.

        Returns:
            The folded `HookResult`: ``action``, ``reason``, ``decided_by``, ``modified_by``,
            ``chained_data`` (the data after every modify), and ``failures``: each handler
            that timed out, raised (kind ``error``, message ``handler_error: <Type>: <text>``)
            or returned what cannot be read as a result (kind ``bad_reply``, always denied),
            with the failure policy applied.
        Raises:
            UnknownEventError: no handler for `event` (with ``strict_events``).
            BadRequestError: `timeout_s` negative or not finite, `approval_timeout_s` not
                finite and above 0, or data that cannot be made JSON (as
                `HookDispatcher.emit`).
            PayloadTooLargeError: the encoded event exceeds nats-server's default
                ``max_payload`` (1 MiB).
            RuntimeError: the kit is not started (use ``async with``) or is closed.
        """
        self._check(event)
        return await self._dispatcher.emit(event, data, **options)

    async def emit_and_collect(
        self, event: str, data: dict[str, Any], timeout: float = 1.0
    ) -> list[Any]:
        """Emit `event` to every handler of it at once and collect their answers:
        `HookDispatcher.emit_and_collect` (tool filters do not apply).

        Returns:
            The non-None ``result.data`` of each handler that answered within `timeout`
            seconds, in priority order (failures are logged and left out).
        Raises:
            UnknownEventError: no handler for `event` (with ``strict_events``).
            BadRequestError: `timeout` is not a number of seconds >= 0, or data that cannot
                be made JSON.
            RuntimeError: the kit is not started (use ``async with``) or is closed.
        """
        self._check(event)
        return await self._dispatcher.emit_and_collect(event, data, timeout)

    def list_handlers(self, event: str | None = None) -> dict[str, list[str]]:
        """Handler names per event in call order: ``{"tool:pre": ["security", ...]}``."""
        return self._dispatcher.list_handlers(event)

    # -- internals ----------------------------------------------------------------------------
    def _check(self, event: str) -> None:
        if self._state != "started":
            raise RuntimeError(
                "the WorkerTestKit is closed" if self._state == "closed"
                else "start the WorkerTestKit first: async with WorkerTestKit(worker) as hooks"
            )  # fmt: skip
        if self._strict and not self._dispatcher.routes(event):
            handled = sorted({spec.declaration.event for spec in self._specs})
            raise UnknownEventError(
                f"unknown event {event!r}: the worker has no handler for it"
                f" (it handles {', '.join(map(repr, handled))})"
            )

    def _server(self, spec: HandlerSpec) -> _Callback:
        """The subscription callback serving `spec`: the worker's own request path, its
        reply published back as the worker publishes it."""
        worker, loopback, decl = self._worker, self._loopback, spec.declaration

        async def serve(msg: Msg) -> None:
            self.calls.append((decl.event, decl.name))
            try:
                reply = await worker.reply_to(spec, msg)
            except Exception as exc:  # as the worker answers an error of its own
                log.exception("unexpected error serving %s", msg.subject)
                error = WireError(code="internal", message=repr(exc))
                reply = HookReply(handler=decl.name, error=error)
            if reply is not None and msg.reply:
                await loopback.publish(msg.reply, encode(reply))

        return serve


class _Loopback:
    """What a dispatcher and a worker use of their nats-py clients, in memory: one
    "connection" both sides share. A published message reaches every subscription whose
    subject matches (``*`` one token, ``>`` the rest), each in a task of its own, as a
    client delivers it to its callback; a message with a reply subject that no
    subscription matches is answered "no responders" (a ``503`` status, no body), as the
    server answers it."""

    is_closed = False
    is_connected = True
    max_payload = _MAX_PAYLOAD

    def __init__(self) -> None:
        self._subs: list[tuple[list[str], _Callback]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._inboxes = itertools.count()

    def new_inbox(self) -> str:
        return f"_INBOX.hookbus_testing.{next(self._inboxes)}"

    async def subscribe(self, subject: str, queue: str = "", cb: _Callback | None = None) -> Any:
        """Deliver the messages on `subject` to `cb` (`queue` changes nothing: a kit
        serves one replica of each handler). Returns the subscription."""
        assert cb is not None
        entry = (subject.split("."), cb)
        self._subs.append(entry)
        return _Subscription(self._subs, entry)

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        tokens = subject.split(".")
        targets = [cb for pattern, cb in self._subs if _matches(pattern, tokens)]
        if not targets:
            if reply:
                await self.publish(reply, b"", headers={"Status": "503"})
            return
        for cb in targets:
            msg = Msg(self, subject, reply, payload, headers)  # type: ignore[arg-type]
            self._spawn(cb(msg))

    async def flush(self, timeout: float = 2.0) -> None:
        """Nothing is buffered: every message is already handed to its task."""

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(_retrieved)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self.is_closed = True
        self.is_connected = False
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._subs.clear()


class _Subscription:
    __slots__ = ("_entry", "_subs")

    def __init__(
        self, subs: list[tuple[list[str], _Callback]], entry: tuple[list[str], _Callback]
    ) -> None:
        self._subs, self._entry = subs, entry

    async def unsubscribe(self) -> None:
        with contextlib.suppress(ValueError):
            self._subs.remove(self._entry)

    drain = unsubscribe


def _matches(pattern: list[str], tokens: list[str]) -> bool:
    """Whether a subscription subject (its tokens) matches a published one, as NATS
    matches them."""
    for i, token in enumerate(pattern):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or (token != "*" and token != tokens[i]):
            return False
    return len(pattern) == len(tokens)


def _retrieved(task: asyncio.Task[None]) -> None:
    """Log an error a delivery ended with (never "exception was never retrieved")."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a message's callback failed", exc_info=exc)
