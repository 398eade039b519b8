"""One loop serving NATS requests, for the hook worker and the dispatcher service.

An `Endpoint` is a subject (and queue group) with a handler coroutine; a `ServingLoop`
subscribes its endpoints and serves every request the same way, as a ``nats.micro``
endpoint would, but with a task per request. A request is taken in the connection's read
loop as it is parsed (a direct subscription, `hookbus._core.direct_delivery`: no queue and
no task of the subscription's between the socket and the request's own task); a step
below that must wait (a refusal's reply, an admission hook that waits) runs in a task of
its own:

1. the request is counted on its endpoint (`EndpointCounters.received`);
2. once the loop drains, it is refused at once (``refuse(msg, "draining", received)``);
3. the endpoint's `admit` hook may answer it itself (a side's own refusals: an agent's
   quota, a chain too wide) or admit it with a weight (the handlers it may run at once)
   and a context for the handler;
4. over the loop's `max_concurrency` (or the endpoint's own `max_in_flight`) it is
   looked at once more on the next turn of the event loop (the handlers ending in the
   turn it was read in give their slots back first), then refused
   (``refuse(msg, "busy", received)``) instead of waiting into the caller's timeout;
5. else its handler runs in a task of its own; the handler answers the request itself.
   On Python 3.12 and later the task starts eagerly (`asyncio.eager_task_factory`): the
   handler runs in the callback's own turn of the event loop up to its first wait, so one
   that never waits has answered before the callback returns (one loop turn less per
   request); on 3.11 the task's first step waits for the next turn.

`ServingLoop.stop_intake` and `ServingLoop.finish` drain: intake stops on every
subscription at once (messages already delivered pass through step 2), requests in flight
get until a deadline, a side's `late` hook may act on the ones still running, then they
are cancelled; the requests whose handler never returned are handed back to be answered.

What differs between the sides stays theirs, as parameters: the refusals' wording and
reply shapes, the admission rules, what a late drain does, how long a cancelled request
may take to answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, Literal

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import EndpointInfo, EndpointStats

from hookbus.schemas import WireError

from .deadlines import Deadline
from .direct_delivery import Deliver, forget_direct, subscribe_direct, unsubscribe_direct
from .tasks import start_task

__all__ = [
    "Admission",
    "Endpoint",
    "EndpointCounters",
    "Refusal",
    "Request",
    "ServingLoop",
    "Ticket",
]

Refusal = Literal["draining", "busy"]
"""Why the loop refuses a request without running it: the loop drains, or it is full."""


class EndpointCounters:
    """What one endpoint did since it started (the ``$SRV.STATS`` figures).

    Args:
        name: the endpoint's name (e.g. ``emit``).
        subject: the subject it listens on (may be a wildcard).
        queue_group: its queue group ("" for none).
        metadata: free-form strings reported by ``$SRV.INFO``.
    """

    __slots__ = (
        "answered",
        "errors",
        "last_error",
        "metadata",
        "name",
        "processing_ns",
        "queue_group",
        "received",
        "subject",
    )

    def __init__(
        self, name: str, subject: str, queue_group: str, metadata: dict[str, str] | None = None
    ) -> None:
        self.name, self.subject, self.queue_group = name, subject, queue_group
        self.metadata = dict(metadata or {})
        self.received = 0
        """Requests received, refused ones included."""
        self.answered = 0
        """Requests answered (a result or an error)."""
        self.errors = 0
        """Requests answered with a `WireError` (``busy`` and ``unavailable`` included)."""
        self.processing_ns = 0
        """Total nanoseconds from receipt to reply, over the requests answered."""
        self.last_error = ""
        """The last error reply, as ``code: message``."""

    def answer(self, started_ns: int, error: WireError | None) -> None:
        """Count one reply sent for a request received at ``time.perf_counter_ns()``
        `started_ns`; `error`: the `WireError` it carried, if any."""
        self.answered += 1
        self.processing_ns += max(0, time.perf_counter_ns() - started_ns)
        if error is not None:
            self.errors += 1
            self.last_error = f"{error.code}: {error.message}"[:500]

    def info(self) -> EndpointInfo:
        return EndpointInfo(
            name=self.name,
            subject=self.subject,
            queue_group=self.queue_group,
            metadata=dict(self.metadata),
        )

    def stats(self, data: dict[str, Any] | None = None) -> EndpointStats:
        """The endpoint's ``$SRV.STATS`` entry; the average is over the requests answered."""
        return EndpointStats(
            name=self.name,
            subject=self.subject,
            queue_group=self.queue_group,
            num_requests=self.received,
            num_errors=self.errors,
            processing_time=self.processing_ns,
            average_processing_time=self.processing_ns // self.answered if self.answered else 0,
            last_error=self.last_error or None,
            data=data,
        )


class Ticket:
    """Something more an admitted request holds while it runs (e.g. an agent's slot):
    `acquire` once it is admitted, `release` once its task ends."""

    __slots__ = ()

    def acquire(self) -> None:
        """The request was admitted."""

    def release(self) -> None:
        """The request's task ended."""


class Admission:
    """An `Endpoint.admit` hook's verdict letting a request in.

    Args:
        weight: slots of `ServingLoop.max_concurrency` it takes (the handlers it may run at
            once); at least 1.
        context: handed to the endpoint's handler as it is.
        ticket: acquired once admitted, released when its task ends; None for none.
    """

    __slots__ = ("context", "ticket", "weight")

    def __init__(self, weight: int = 1, context: Any = None, ticket: Ticket | None = None) -> None:
        self.weight = weight
        self.context = context
        self.ticket = ticket


_ADMIT_ONE: Final = Admission()
"""The admission of a request on an endpoint without an `admit` hook."""

Handler = Callable[[Msg, Any, int], Awaitable[None]]
"""``handler(msg, context, received_ns)``: serve one request and answer it. `context`:
the `Admission`'s; `received_ns`: ``time.perf_counter_ns()`` at receipt. Cancelled when a
drain's grace runs out (it may answer then)."""

Refuse = Callable[[Msg, Refusal, int], Awaitable[None]]
"""``refuse(msg, why, received_ns)``: answer at once that the request was not run."""

Admit = Callable[[Msg, int], Admission | Awaitable[Admission | None]]
"""``admit(msg, received_ns)``: the request's `Admission`, or None once it answered the
request itself (a refusal of its own); as a coroutine, or, when no wait is needed to
decide, the `Admission` itself (no coroutine to make and step per request)."""


class Endpoint:
    """One subject served by a `ServingLoop`.

    Args:
        subject: the subject to subscribe (may be a wildcard).
        handler: serves one admitted request (see `Handler`).
        refuse: answers a request refused by the loop (see `Refuse`).
        queue_group: the queue group ("" for none: every subscriber gets each message).
        admit: admission rules of its own, run before the concurrency bound (see `Admit`);
            None admits every request with weight 1.
        max_in_flight: a bound of its own on the requests it runs at once (within the
            loop's); None for none.
        counters: where its requests are counted; None makes its own.
    """

    __slots__ = (
        "admit",
        "counters",
        "handler",
        "in_flight",
        "max_in_flight",
        "queue_group",
        "refuse",
        "subject",
    )

    def __init__(
        self,
        subject: str,
        handler: Handler,
        refuse: Refuse,
        *,
        queue_group: str = "",
        admit: Admit | None = None,
        max_in_flight: int | None = None,
        counters: EndpointCounters | None = None,
    ) -> None:
        self.subject = subject
        self.handler = handler
        self.refuse = refuse
        self.queue_group = queue_group
        self.admit = admit
        self.max_in_flight = max_in_flight
        self.counters = counters or EndpointCounters(subject, subject, queue_group)
        self.in_flight = 0
        """The weight of its requests running now."""


class Request:
    """A request admitted and not answered yet: its endpoint, message, and receipt time
    (``time.perf_counter_ns()``); what it holds while it runs (`weight`, `ticket`), and
    its task (None until its first step is over)."""

    __slots__ = ("endpoint", "msg", "received", "task", "ticket", "weight")

    def __init__(
        self,
        endpoint: Endpoint,
        msg: Msg,
        received: int,
        weight: int = 1,
        ticket: Ticket | None = None,
    ) -> None:
        self.endpoint, self.msg, self.received = endpoint, msg, received
        self.weight, self.ticket = weight, ticket
        self.task: asyncio.Task[None] | None = None


class ServingLoop:
    """Serves its endpoints' requests on one connection: one task per request, at most
    `max_concurrency` (by weight) at once over all endpoints; see the module docstring.

    Args:
        nc: the connection to subscribe on (it belongs to the caller).
        max_concurrency: the weight of the requests run at once; at least 1.
        log: the logger of the side serving (unexpected errors of a handler).
    """

    def __init__(self, nc: NATS, *, max_concurrency: int, log: logging.Logger) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self._nc = nc
        self.max_concurrency = max_concurrency
        self._log = log
        self.in_flight = 0
        """The weight of the requests running now."""
        self.draining = False
        """Whether requests are refused now (``refuse(msg, "draining", ...)``)."""
        self._subs: list[Subscription] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        """Refusals and admissions that wait, running (see `_spawn`)."""
        self._pending: set[Request] = set()
        """Requests admitted whose handler has not returned (or raised): each holds its
        slots and ticket until then (released by `_serve` as it ends, not by a done
        callback: none to schedule per request)."""

    @property
    def tasks(self) -> int:
        """Requests' tasks not ended yet."""
        return len(self._running())

    def _running(self) -> list[asyncio.Task[None]]:
        """The tasks of the requests admitted that have not ended."""
        return [r.task for r in self._pending if r.task is not None and not r.task.done()]

    async def add(self, endpoint: Endpoint) -> None:
        """Subscribe `endpoint` (not flushed: the caller flushes once for all).

        Raises:
            nats.errors.Error: the subscription failed.
        """
        sub = await subscribe_direct(
            self._nc, endpoint.subject, self._callback(endpoint), queue=endpoint.queue_group
        )
        self._subs.append(sub)

    async def unsubscribe(self) -> None:
        """Drop every subscription at once, delivered messages with them (a start that
        failed: nothing was served)."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await unsubscribe_direct(self._nc, sub)
        self._subs.clear()

    def _callback(self, endpoint: Endpoint) -> Deliver:
        counters = endpoint.counters
        admit = endpoint.admit
        refuse = endpoint.refuse
        start = self._start
        spawn = self._spawn

        def on_message(msg: Msg) -> None:
            # called in the connection's read loop: never wait here (a refusal and an
            # admission that waits get a task of their own)
            received = time.perf_counter_ns()
            counters.received += 1
            if self.draining:
                spawn(refuse(msg, "draining", received))
                return
            if admit is None:
                start(endpoint, msg, received, _ADMIT_ONE)
                return
            verdict = admit(msg, received)
            if isinstance(verdict, Admission):  # decided without a wait
                start(endpoint, msg, received, verdict)
            else:
                spawn(self._admit_later(endpoint, msg, received, verdict))

        return on_message

    async def _admit_later(
        self,
        endpoint: Endpoint,
        msg: Msg,
        received: int,
        verdict: Awaitable[Admission | None],
    ) -> None:
        admission = await verdict
        if admission is not None:  # else answered by the hook
            self._start(endpoint, msg, received, admission)

    def _full(self, endpoint: Endpoint, weight: int) -> bool:
        """Whether `weight` more on `endpoint` would go over a bound."""
        bound = endpoint.max_in_flight
        return self.in_flight + weight > self.max_concurrency or (
            bound is not None and endpoint.in_flight + weight > bound
        )

    def _start(self, endpoint: Endpoint, msg: Msg, received: int, admission: Admission) -> None:
        """Run admitted `msg` in a task of its own; over the bounds, look again on the next
        turn of the loop (`_start_later`)."""
        weight = admission.weight
        if self._full(endpoint, weight):
            # the read loop takes a request before the handlers that end in the same turn
            # have given their slots back: they get that turn first
            work = self._start_later(endpoint, msg, received, admission)
            task = asyncio.get_running_loop().create_task(work)  # never eager: a turn later
            self._side_tasks.add(task)
            task.add_done_callback(self._side_end)
            return
        self.in_flight += weight
        endpoint.in_flight += weight
        ticket = admission.ticket
        if ticket is not None:
            ticket.acquire()
        request = Request(endpoint, msg, received, weight, ticket)
        pending = self._pending
        pending.add(request)
        task = start_task(asyncio.get_running_loop(), self._serve(request, admission.context))
        if request in pending:  # not over in an eager first step: still to end
            request.task = task

    async def _start_later(
        self, endpoint: Endpoint, msg: Msg, received: int, admission: Admission
    ) -> None:
        """`_start` for a request that found the bounds full: started if a slot was given
        back meanwhile, else refused ``busy``."""
        if self._full(endpoint, admission.weight):
            await endpoint.refuse(msg, "busy", received)
        elif self.draining:
            await endpoint.refuse(msg, "draining", received)
        else:
            self._start(endpoint, msg, received, admission)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` (a refusal, an admission that waits) in a task of its own, kept
        until it ends."""
        task = start_task(asyncio.get_running_loop(), work)
        if task.done():  # over in an eager first step
            self._side_end(task)
        else:
            self._side_tasks.add(task)
            task.add_done_callback(self._side_end)

    def _side_end(self, task: asyncio.Task[None]) -> None:
        self._side_tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:  # never let one request take the process down
            self._log.error("unexpected error refusing or admitting a request", exc_info=error)

    async def _serve(self, request: Request, context: Any) -> None:
        try:
            await request.endpoint.handler(request.msg, context, request.received)
        except Exception:  # never let one request take the process down
            self._log.exception("unexpected error answering %s", request.msg.subject)
        finally:
            self._end(request)

    def _end(self, request: Request) -> None:
        """`request`'s handler is over: give back what it held."""
        self._pending.discard(request)
        weight = request.weight
        self.in_flight -= weight
        request.endpoint.in_flight -= weight
        ticket = request.ticket
        if ticket is not None:
            ticket.release()

    # -- draining ----------------------------------------------------------------------
    async def stop_intake(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, and drain every subscription at once: the server stops
        sending, and the messages already delivered pass through the callback (which
        refuses them); then the refusals under way are given the same time to be sent.
        `timeout_s`: the most one subscription's drain may take (None: no bound). A lost
        connection is ignored."""
        self.draining = True
        await asyncio.gather(*(self._drain(sub, timeout_s) for sub in self._subs))
        self._subs.clear()
        if self._side_tasks:
            await asyncio.wait(list(self._side_tasks), timeout=timeout_s)

    async def _drain(self, sub: Subscription, timeout_s: float | None) -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await sub.drain()
        forget_direct(self._nc, sub)

    async def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` seconds for the requests running now to end."""
        running = self._running()
        if running:
            await asyncio.wait(running, timeout=timeout_s)

    async def finish(
        self,
        deadline: Deadline,
        *,
        cancel_wait_s: float,
        late: Callable[[int], Awaitable[None]] | None = None,
    ) -> list[Request]:
        """Let the requests in flight run until `deadline` (on the loop clock); then call
        ``late(n)`` with the number still running (if any), cancel what still runs and
        wait up to `cancel_wait_s` seconds for it to end.

        Returns:
            The requests whose handler never returned (e.g. cancelled before it started),
            for the caller to answer.
        """
        loop = asyncio.get_running_loop()
        while self._running() and (left := deadline.left(loop.time())) > 0:
            await self.wait(left)
        running = self._running()
        if running and late is not None:
            await late(len(running))
        running = self._running()
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=cancel_wait_s)
        left_over = list(self._pending)
        for request in left_over:
            if request.task is not None and request.task.done():
                self._end(request)  # cancelled before it started: `_serve` never ran
        self._pending.clear()
        return left_over
