"""Calling one handler, in-process or over NATS, and turning what happens into an outcome.

An outcome is either the handler's `HookResult` or a `Failed` (kind + message) for the
failure policy to judge. Only caller errors (an oversize payload, a closed connection)
raise; everything a handler, a replica or the network does is an outcome — a reply of any
bytes at all included.

Remote calls go through a `Requester`: one reply inbox per connection, a future per call.
A call has a budget (seconds: the handler's timeout, cut to what the emit has left), sent in
the envelope as ``budget_s`` so the worker never runs past it. Within it:

- an error reply marked ``retryable`` (``busy``, ``unavailable``: the handler did not run)
  is sent again at once, to another replica (see below); only when every replica known
  has refused does it wait a moment first (5 ms per refusal so far, within the budget);
- a handler declared ``retry_safe`` that is unanswered after a fraction of the budget
  (`HEDGE_FRACTION`, at least `HEDGE_MIN_S`) is sent again (hedged), then once per half
  such window while the budget lasts (at most `MAX_RESENDS` extra requests), and the
  first answer wins. A handler not declared retry_safe is never sent twice unless a
  replica said it did not run it.

The process that runs a handler times it (the worker cuts it at its timeout, counted
from its start, and says so), so past the budget the requester only tells a live worker
from a lost one: with requests still unanswered it waits on, `GRACE_S` (the link's one-way
delay, a reply written late) plus the timeouts of the other remote calls of the same emit
in flight meanwhile to the same worker process's handler set (`Neighbours`: a parallel
neighbour that computes without awaiting holds the worker's event loop, so a request
behind it starts late), never past the emit's deadline. Past that the call fails as
``timeout``. A neighbour that holds the loop past its own timeout by more than the grace,
or a computing handler of another emit, can still make a live worker's answer come too
late: that call fails as ``timeout`` under its policy.

The first request of a call goes to the handler's queue subject (the queue group picks a
replica). Every reply names the worker instance that sent it, and the requester keeps, per
handler, the instances that answered recently (most recent last; at most
`RECENT_INSTANCES`, forgotten after `RECENT_TTL_S`). A further request goes to the instance
subject (`handler_instance_subject`) of the most recently answering instance this call has
not sent to and that has not refused it: a stalled replica stops answering, drops back in
that order, and the hedge reaches a healthy one instead of a coin toss. With no such
instance it goes to the queue subject. An instance subject with no responders (the
instance is gone) is forgotten and the next request is sent at once.

The queue group cannot be steered: NATS gives a request to a replica in the publisher's
own cluster whenever one is subscribed there, stalled or not, so in a supercluster (or
with one replica per site) a hedge to the queue subject meets the same stalled process.
Two things get around it, both learned from the NATS services API (``$SRV.PING`` of the
worker service, whose metadata lists the handlers each instance serves), never on the
emit's path:

- **discovery**: a hedge that finds no instance to go to, and every call that times out
  with no answer at all, asks the workers once (at most every `DISCOVERY_INTERVAL_S`,
  answers gathered for `DISCOVERY_GATHER_S`); each instance that answers is a hedge target
  of the handlers it serves, after the instances that answered calls (a process answers
  the services API even while one of its handlers hangs);
- **suspicion**: a call that times out with no answer at all marks its queue subject
  suspect until `SUSPECT_S` seconds after the last such call; while it is, a call's
  *first* request goes to an instance that answered a call since the first such call was
  sent, else to one a discovery found since (taken in turn), else to the queue subject;
  one made while a discovery is asking waits for its first answer (at most a quarter of
  its budget). An instance sent a request that timed out unanswered is no longer a
  target. Each request is still sent once: a handler not
  declared retry_safe fails by its policy on the calls that met the stall, and the calls
  after them reach a live instance. A suspect chain subject is not used: its steps are
  called one by one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import itertools
import json
import logging
import math
import types
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hookbus._core import clock
from hookbus._core.chain_timing import GRACE_S
from hookbus._core.copies import json_copy
from hookbus._core.handler_options import DEFAULT_TIMEOUT_S, is_async_handler
from hookbus._core.inboxes import inbox_reply_subject
from hookbus._core.results import to_hook_result
from hookbus.schemas import (
    WORKER_SERVICE_NAME,
    BadRequestError,
    ChainStep,
    EventEnvelope,
    FailureKind,
    HookReply,
    HookResult,
    NotConnectedError,
    PayloadTooLargeError,
    WireFormatError,
    chain_instance_subject,
    decode,
    encode,
    handler_instance_subject,
    handler_subject,
    parse_served_handlers,
)

from ._route_table import Route
from ._telemetry_core import note_delivery, otel

__all__ = [
    "DISCOVERY_GATHER_S",
    "DISCOVERY_INTERVAL_S",
    "HEDGE_FRACTION",
    "HEDGE_MIN_S",
    "MAX_REFUSALS",
    "NOT_RUN_CODES",
    "RECENT_INSTANCES",
    "RECENT_TTL_S",
    "SUSPECT_S",
    "ChainPlan",
    "Failed",
    "Neighbours",
    "Outcome",
    "Requester",
    "SyncHandler",
    "call_local",
    "call_remote",
    "coerce_result",
    "nats_failure",
    "ready_outcome",
    "reply_outcome",
]

log = logging.getLogger("hookbus.dispatcher")

HEDGE_FRACTION = 0.25
"""A retry_safe call unanswered after this fraction of its budget is sent again."""
HEDGE_MIN_S = 0.05
"""Seconds: the shortest hedging window."""
MAX_RESENDS = 8
"""At most this many extra requests per call (hedges and retries of refused requests)."""
MAX_REFUSALS = 8
"""A call refused (``busy``/``unavailable``) this many times fails (kind ``error``): the
queue group picks a replica at random, so with one of two replicas refusing a call fails
1 time in 256; with every replica overloaded, more requests would only add load."""

RECENT_INSTANCES = 16
"""Worker instances remembered per handler as hedge targets (the most recent answers)."""
RECENT_TTL_S = 60.0
"""Seconds after its last answer an instance is no longer a hedge target."""

DISCOVERY_INTERVAL_S = 2.0
"""Seconds: the shortest interval between two discoveries of the live worker instances."""
DISCOVERY_GATHER_S = 0.5
"""Seconds a discovery's answers are taken (a scatter has no last answer)."""
SUSPECT_S = 30.0
"""Seconds a queue subject stays suspect after a call on it timed out unanswered."""

NO_RESPONDERS_RECHECK_S = 0.02
"""Seconds before a call answered "no responders" is sent once more (only once) before it
fails as ``no_responders``: a worker's interest reaches the other servers of a cluster a
moment after its declaration can, and a client other than hookbus's may flush before its
subscriptions reach the server."""

NO_RESPONDERS_KEPT_S = 1.0
"""Seconds a subject found without a replica, once rechecked, is not rechecked again: a
declared handler whose replicas are all gone costs each emit one "no responders", not
that and the recheck's wait (the race the recheck covers lasts milliseconds after a
worker subscribes; any answer on the subject ends it at once)."""

_COROUTINE = types.CoroutineType
"""An async handler's result: awaited without the general `inspect.isawaitable` check."""
_STATUS = "Status"
_NO_RESPONDERS = "503"


@dataclass(frozen=True, slots=True)
class Failed:
    """A handler call that gave no usable result."""

    kind: FailureKind
    message: str


Outcome = HookResult | Failed


NOT_RUN_CODES = frozenset(
    {"bad_request", "busy", "unavailable", "deadline_exceeded", "not_ready", "stale_declaration"}
)
"""Worker error codes of a request that ran nothing (sent before any handler started)."""

_ERROR_KINDS: dict[str, FailureKind] = {
    "handler_timeout": "timeout",
    "deadline_exceeded": "timeout",
    "bad_result": "bad_reply",
}
"""Worker error codes that map to a failure kind other than ``error``."""

_CONNECTION_ERRORS = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
)


def coerce_result(raw: Any) -> Outcome:
    """A handler's return value as an outcome: see `hookbus.schemas.to_hook_result`.

    Its data becomes a JSON copy (as amplifier-core turns a handler's result into JSON), so
    later in-place edits by the handler or by the next one change nothing here. A value
    that cannot be read is a ``bad_reply`` (the fold denies it).
    """
    try:
        result = to_hook_result(raw)
        if result.data is not None:
            result = msgspec.structs.replace(result, data=json_copy(result.data))
    except (WireFormatError, BadRequestError) as exc:
        return Failed("bad_reply", str(exc))
    return result


def nats_failure(exc: BaseException) -> Failed:
    """A nats-py error met while sending, as a failure for the policy (never raised)."""
    return Failed("error", f"NATS: {type(exc).__name__}: {exc}".rstrip(": "))


def _cut(timeout_s: float | None, budget_s: float | None) -> float | None:
    if timeout_s is None:
        return budget_s
    if budget_s is None:
        return timeout_s
    return min(timeout_s, budget_s)


class SyncHandler(functools.partial[Any]):
    """An in-process handler that is a plain function (not a coroutine function), as
    registered (`LocalHandlers`): `call_local` runs it in a worker thread when its call
    has a time limit. Calling it calls the function (``func``), at the cost of a C-level
    `functools.partial` call."""

    @staticmethod
    def wrap(handler: Any) -> Any:
        """`handler` as `call_local` takes it: an async handler (`is_async_handler`: a
        coroutine function, or an object whose ``__call__`` is one) as it is, anything
        else in a `SyncHandler`, as a `HookWorker` decides which handlers run in a
        thread."""
        if is_async_handler(handler):
            return handler
        return SyncHandler(handler)


async def call_local(
    route: Route, event: str, data: dict[str, Any], budget_s: float | None = None
) -> Outcome:
    """Call an in-process handler (async or sync) within its timeout cut to `budget_s`
    (seconds the emit has left; None: no overall deadline). Past it the call is a
    ``timeout`` failure.

    A call without any time limit runs a sync handler (`SyncHandler`) on the event loop,
    as amplifier-core would. With one, it runs it as a `HookWorker` does: in a worker
    thread (anyio's, at most 40 at once: a call waiting for one waits within its limit),
    the wait for it cut at the limit. A thread cannot be stopped: one cut keeps running
    until the function returns, its result is discarded. An async handler is cancelled
    at the limit, and one that returns after it without having let the loop cut it (it
    computed without awaiting) fails as ``timeout`` too, as on a worker.
    """
    assert route.local is not None
    timeout_s = _cut(route.timeout_s, budget_s)
    if clock.no_time_left(timeout_s):
        return Failed("timeout", "not called: the emit's deadline had passed")
    try:
        if timeout_s is None:  # no cancel scope at all: most of an in-process call's cost
            raw = route.local(event, data)
            if type(raw) is _COROUTINE or inspect.isawaitable(raw):
                raw = await raw
        else:
            local = route.local
            started = clock.now()
            async with asyncio.timeout(timeout_s):
                if type(local) is SyncHandler:  # off the loop, or nothing could cut it
                    raw = await anyio.to_thread.run_sync(
                        local.func, event, data, abandon_on_cancel=True
                    )
                else:
                    raw = local(event, data)
                if inspect.isawaitable(raw):
                    raw = await raw
            if clock.now() - started > timeout_s:  # it held the loop past its limit
                return Failed("timeout", f"returned after its {timeout_s:.3g}s")
    except TimeoutError as exc:
        if timeout_s is None:  # the handler's own TimeoutError, not ours
            return Failed("error", f"TimeoutError: {exc}")
        return Failed("timeout", f"no result within {timeout_s:.3g}s")
    except Exception as exc:
        return Failed("error", f"{type(exc).__name__}: {exc}")
    return coerce_result(raw)


def judge_reply(msg: Msg) -> Outcome | None:
    """One reply message as an outcome; None for a status with no body (no responders).

    Every byte string ends as an outcome: status messages with a body, invalid UTF-8,
    nesting too deep, wrong types and empty bodies are all ``bad_reply``.
    """
    return _read_reply(msg)[0]


def reply_outcome(reply: HookReply) -> Outcome:
    """One handler's `HookReply` (alone or within a chain's) as an outcome."""
    err = reply.error
    if err is not None:
        return Failed(_ERROR_KINDS.get(err.code, "error"), f"{err.code}: {err.message}")
    if reply.result is None:
        return Failed("bad_reply", "reply carries neither result nor error")
    return reply.result


def _read_reply(msg: Msg) -> tuple[Outcome | None, str | None, str]:
    """`judge_reply`, plus the error code of a reply that says "not run, send it again"
    (else None) and the id of the worker instance that answered ("" if unknown)."""
    headers = msg.headers or {}
    status = headers.get(_STATUS)
    if status is not None:
        if not msg.data and status == _NO_RESPONDERS:
            return None, None, ""
        return Failed("bad_reply", f"a status {status!r} message, not a HookReply"), None, ""
    try:
        reply = decode(msg.data, HookReply)
    except WireFormatError as exc:
        return Failed("bad_reply", str(exc)), None, ""
    err = reply.error
    if err is not None:
        failed = Failed(_ERROR_KINDS.get(err.code, "error"), f"{err.code}: {err.message}")
        again = err.code if err.retryable and err.code in ("busy", "unavailable") else None
        return failed, again, reply.instance
    if reply.result is None:
        return Failed("bad_reply", "reply carries neither result nor error"), None, reply.instance
    return reply.result, None, reply.instance


class _HandlerName(msgspec.Struct):
    handler: str


_handler_name = msgspec.json.Decoder(_HandlerName)


def _reply_handler(msg: Msg) -> str | None:
    """The handler a reply names, or None if it cannot be read."""
    try:
        return _handler_name.decode(msg.data).handler
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


class _Deadlines:
    """When the requester's waits time out, at millisecond granularity: one event-loop
    timer per millisecond that has waits ending in it, not one per wait. A loop timer per
    call costs a heap push (of handles compared in Python) and a cancel; here a call costs
    a set add and a discard. A wait ends at its `until` or at most 1 ms later, never
    earlier."""

    __slots__ = ("_buckets",)

    def __init__(self) -> None:
        self._buckets: dict[int, set[asyncio.Future[None]]] = {}

    def add(
        self, loop: asyncio.AbstractEventLoop, until: float, waiter: asyncio.Future[None]
    ) -> int:
        """Fail `waiter` with `TimeoutError` at `until` (loop time) unless it is done by
        then; returns the key `discard` takes."""
        key = math.ceil(until * 1000.0)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = set()
            loop.call_at(key / 1000.0, self._expire, key)
        bucket.add(waiter)
        return key

    def discard(self, key: int, waiter: asyncio.Future[None]) -> None:
        """`waiter` no longer needs its deadline (it is done)."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.discard(waiter)

    def _expire(self, key: int) -> None:
        for waiter in self._buckets.pop(key, ()):
            if not waiter.done():
                waiter.set_exception(TimeoutError())


class _Inbox:
    """The replies of one call, in arrival order: a deque and at most one waiter (cheaper
    than an `asyncio.Queue` under `asyncio.timeout` on this path)."""

    __slots__ = ("deadlines", "items", "waiter")

    def __init__(self, deadlines: _Deadlines) -> None:
        self.items: collections.deque[tuple[str, Msg]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.deadlines = deadlines

    def put(self, token: str, msg: Msg) -> None:
        self.items.append((token, msg))
        self.wake()

    def wake(self) -> None:
        """Wake the waiter (`get` then raises `TimeoutError` if nothing came)."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, loop: asyncio.AbstractEventLoop, until: float) -> tuple[str, Msg]:
        """The next reply; `TimeoutError` if none came by `until` (loop time; at most 1 ms
        later, see `_Deadlines`)."""
        if not self.items:
            if until <= loop.time():
                raise TimeoutError
            waiter = self.waiter = loop.create_future()
            key = self.deadlines.add(loop, until, waiter)
            try:
                await waiter
            finally:
                self.deadlines.discard(key, waiter)
                self.waiter = None
            if not self.items:  # woken for something else
                raise TimeoutError
        return self.items.popleft()


class Neighbours:
    """The remote calls of one emit in flight at once, per worker process's handler set
    (`Route.handler_set`; an unknown set, empty, counts as one): how long another call of
    the same process may wait behind them.

    A call's overlap is the sum of the timeouts (seconds) of the calls of its set that were
    in flight when it opened or opened after it (a neighbour that computes holds the
    process's event loop for up to its timeout, and past it for as long as it computes).
    Counters only: `open` and `overlap` cost the same whatever the number of calls.
    """

    __slots__ = ("_in_flight", "_opened")

    def __init__(self) -> None:
        self._in_flight: dict[frozenset[str], float] = {}
        self._opened: dict[frozenset[str], float] = {}

    def open(self, key: frozenset[str], timeout_s: float) -> tuple[float, float]:
        """Count a call of `key` with `timeout_s` in flight; the mark `overlap` takes."""
        before = self._in_flight.get(key, 0.0)
        opened = self._opened.get(key, 0.0) + timeout_s
        self._in_flight[key] = before + timeout_s
        self._opened[key] = opened
        return before, opened

    def close(self, key: frozenset[str], timeout_s: float) -> None:
        """The call of `key` opened with `timeout_s` is over."""
        self._in_flight[key] = max(self._in_flight.get(key, 0.0) - timeout_s, 0.0)

    def overlap(self, key: frozenset[str], mark: tuple[float, float]) -> float:
        """Seconds: the timeouts of the other calls of `key` in flight with the call that
        `open` gave `mark`, summed."""
        before, opened = mark
        return before + self._opened.get(key, 0.0) - opened


def _note(known: dict[str, dict[str, float]], subject: str, instance: str, now: float) -> None:
    """Record `instance` for handler `subject` at `now` in `known` (most recent last, at
    most `RECENT_INSTANCES` per handler: the least recent one goes)."""
    instances = known.get(subject)
    if instances is None:
        instances = known[subject] = {}
    elif instances.pop(instance, None) is None and len(instances) >= RECENT_INSTANCES:
        del instances[next(iter(instances))]
    instances[instance] = now


def _since(instances: dict[str, float] | None, since: float) -> list[str]:
    """The instances of `instances` recorded at or after `since` (loop time)."""
    return [i for i, seen in instances.items() if seen >= since] if instances else []


class _Discovery:
    """The answers to one ``$SRV.PING`` of the worker service: each instance that answers
    becomes a hedge target of the handlers its metadata lists (those the requester calls)."""

    __slots__ = ("requester",)

    def __init__(self, requester: Requester) -> None:
        self.requester = requester

    def put(self, token: str, msg: Msg) -> None:
        try:
            body = json.loads(msg.data)
            instance = str(body["id"])
            served = parse_served_handlers((body.get("metadata") or {}).get("handlers"))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return  # not a services API answer: nothing learned
        self.requester._discovered(instance, served)


class Requester:
    """Requests with a reply inbox of our own (one subscription per connection).

    nats-py's ``request`` reads any reply with a 503 status as "no responders", whatever
    its body, and cannot take several answers to one call; this can.
    """

    def __init__(self) -> None:
        self._prefix = ""
        self._sub: Subscription | None = None
        self._nc: NATS | None = None
        self._tokens = itertools.count()
        self._waiting: dict[str, _Inbox | _Discovery] = {}
        self._deadlines = _Deadlines()
        self._recent: dict[str, dict[str, float]] = {}
        """Per handler subject: instance id -> loop time of its last answer, oldest first."""
        self._found_live: dict[str, dict[str, float]] = {}
        """Per handler subject: instance id -> loop time a discovery found it serving the
        handler, oldest first. Targets after the instances that answered: a process that
        answers the services API may still have that handler hung."""
        self._suspect: dict[str, tuple[float, float]] = {}
        """Per queue subject: loop times of the first and the last call on it that timed
        out unanswered, while it stays suspect (module docstring)."""
        self._found: asyncio.Future[None] | None = None
        """Done when the discovery in flight learned an instance (or its answers ended)."""
        self._wanted: set[str] = set()
        """Handler subjects a discovery was asked for (recorded even if never answered)."""
        self._discovery_at = -math.inf
        self._turn = itertools.count()
        self._no_replica: dict[str, float] = {}
        """Per handler subject: loop time a rechecked call found no replica subscribed."""

    @property
    def started(self) -> bool:
        return self._sub is not None

    async def start(self, nc: NATS) -> None:
        if self._sub is None:
            self._nc = nc
            self._prefix = nc.new_inbox()
            self._sub = await nc.subscribe(
                inbox_reply_subject(self._prefix, "*"), cb=self._on_reply
            )

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        inbox = self._waiting.get(token)
        if inbox is not None:
            inbox.put(token, msg)

    async def call(
        self, nc: NATS, route: Route, envelope: EventEnvelope, headers: dict[str, str] | None,
        budget_s: float, *, hedge: bool, within_s: float | None = None,
        neighbours: Neighbours | None = None,
    ) -> Outcome:  # fmt: skip
        """Send `envelope` to `route` with `budget_s` seconds for its handler, and wait for
        an answer: past the budget, while a request is unanswered, `GRACE_S` more plus the
        overlap of `neighbours` (see the module docstring), never past `within_s` seconds
        (the emit's deadline; None: `budget_s`, no wait past it).

        Raises:
            NotConnectedError: the connection is closed.
            PayloadTooLargeError: the envelope exceeds the server's max_payload.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + budget_s
        limit = started + (budget_s if within_s is None else max(within_s, budget_s))
        key = route.handler_set
        mark = None if neighbours is None else neighbours.open(key, budget_s)
        window = max(HEDGE_MIN_S, budget_s * HEDGE_FRACTION) if hedge else math.inf
        queue = _Inbox(self._deadlines)
        sent: list[str] = []  # every token of this call, for the cleanup
        live: set[str] = set()
        targets: dict[str, str] = {}  # token -> instance of a request sent to one instance
        avoid: set[str] = set()  # instances this call was sent to or refused by
        refused: str | None = None
        refusals = 0
        rechecked = False
        answered_by = ""
        try:
            for attempt in itertools.count(1):
                remaining = deadline - loop.time()
                if remaining <= 0 or attempt > MAX_RESENDS + 1:
                    break
                envelope.attempt = attempt
                envelope.budget_s = remaining
                token = f"{next(self._tokens):x}"
                if attempt == 1:
                    subject = route.subject
                    if self._suspect:  # some subject is suspect: perhaps steer this call
                        subject = self._first(route, avoid, token, targets, loop.time())
                        found = self._found
                        if token not in targets and found is not None and not found.done():
                            # suspect, and the live replicas are being asked right now:
                            # their first answer is worth a short wait (a call sent now
                            # would meet the stalled replica again)
                            if self.suspected(route.subject, loop.time()) is not None:
                                with contextlib.suppress(TimeoutError):
                                    async with asyncio.timeout(remaining * HEDGE_FRACTION):
                                        await asyncio.shield(found)
                                subject = self._first(route, avoid, token, targets, loop.time())
                else:
                    subject = self._target(route, avoid, token, targets, loop.time())
                    if token not in targets:  # no instance known to go to: ask who serves
                        await self.discover(route.subject)
                self._waiting[token] = queue
                sent.append(token)
                failed = await self._send(nc, subject, envelope, headers, token)
                if failed is not None:
                    if not live:
                        return failed
                else:
                    live.add(token)
                next_send = (
                    loop.time() + (window if attempt == 1 else max(HEDGE_MIN_S, window / 2))
                    if hedge
                    else math.inf
                )
                until = min(next_send, deadline)
                while True:
                    try:
                        token, msg = await queue.get(loop, until)
                    except TimeoutError:
                        if until >= deadline and live:
                            # the budget is spent and a request is unanswered: its worker
                            # times it, so wait on while a live one may still answer
                            extra = GRACE_S
                            if mark is not None and neighbours is not None:
                                extra += neighbours.overlap(key, mark)
                            later = min(limit, deadline + extra)
                            if later > until and later > loop.time():
                                until = later
                                continue
                        break  # hedge (retry_safe) or the budget is spent
                    live.discard(token)
                    self._waiting.pop(token, None)
                    outcome, code, instance = _read_reply(msg)
                    if code is not None:  # not run: send again, to another replica
                        if instance:
                            avoid.add(instance)
                        refused, refusals = code, refusals + 1
                        if live:
                            continue
                        if refusals >= MAX_REFUSALS:
                            return Failed("error", f"{code}: refused {refusals} times")
                        if not self._another(route, avoid, loop.time()):
                            # every replica known refused: give them a moment
                            wait = max(until - loop.time(), 0)
                            await asyncio.sleep(min(0.005 * refusals, wait))
                        break  # at once to a replica that has not refused
                    if outcome is not None:
                        if instance:
                            self.answered(route.subject, instance, loop.time())
                            answered_by = instance
                        return outcome
                    gone = targets.pop(token, None)
                    if gone is not None:  # no responders on an instance subject: it is gone
                        self._forget(route.subject, gone)
                        if live:
                            continue
                        break  # send the next request at once
                    if not live:  # no replica subscribed: answered at once
                        now = loop.time()
                        if rechecked:
                            self._no_replica[route.subject] = now
                        elif (
                            now - self._no_replica.get(route.subject, -math.inf)
                            >= NO_RESPONDERS_KEPT_S
                            and deadline - now > NO_RESPONDERS_RECHECK_S
                        ):
                            # a replica that subscribed a moment ago may not be visible to
                            # this publish yet (seen under load): ask once more, shortly
                            rechecked = True
                            await asyncio.sleep(NO_RESPONDERS_RECHECK_S)
                            break
                        return Failed(
                            "no_responders",
                            f"no replica of {route.name!r} is subscribed",
                        )
                if loop.time() >= deadline:
                    break
        finally:
            for token in sent:
                self._waiting.pop(token, None)
            if mark is not None and neighbours is not None:
                neighbours.close(key, budget_s)
            if otel.tracing:
                note_delivery(len(sent), answered_by)
        if refused is not None and not live:
            return Failed("error", f"{refused}: every replica refused within {budget_s:.3g}s")
        if live:  # sent, and nothing at all came back: a stalled replica, or a lost one
            for token in live:
                stalled = targets.get(token)
                if stalled is not None:  # no longer an instance to send to
                    self._forget(route.subject, stalled)
            self.suspect(route.subject, deadline - budget_s)
            await self.discover(route.subject)
        return Failed("timeout", f"no reply within {budget_s:.3g}s")

    # -- what a chain call (`_chain_calls.ChainCall`) uses of the requester ----------------
    def open_inbox(self) -> _Inbox:
        """A new inbox for one call's replies (register each request with `add_token`)."""
        return _Inbox(self._deadlines)

    def add_token(self, inbox: _Inbox) -> str:
        """A new reply token whose replies go to `inbox` (until `close_inbox`)."""
        token = f"{next(self._tokens):x}"
        self._waiting[token] = inbox
        return token

    def close_inbox(self, token: str) -> None:
        self._waiting.pop(token, None)

    async def send(
        self, nc: NATS, subject: str, envelope: EventEnvelope, headers: dict[str, str] | None,
        token: str,
    ) -> Failed | None:  # fmt: skip
        """Publish `envelope` on `subject`, its replies to `token`; a `Failed` (not run)
        if NATS refused it.

        Raises:
            NotConnectedError: the connection is closed.
            PayloadTooLargeError: the envelope exceeds the server's max_payload.
        """
        return await self._send(nc, subject, envelope, headers, token)

    def target(self, route: Route, avoid: set[str], now: float, *, chain: bool = False) -> str:
        """Subject of a further request: the most recently answering instance of `route`
        not in `avoid` (then added to it), else the queue subject."""
        return self._target(route, avoid, "", {}, now, chain)

    def answered(self, subject: str, instance: str, now: float) -> None:
        """Note that `instance` answered a request on handler `subject` at `now`."""
        _note(self._recent, subject, instance, now)
        self._no_replica.pop(subject, None)

    def suspect(self, subject: str, sent_at: float) -> None:
        """Note that a call on queue subject `subject`, sent at `sent_at` (loop time), timed
        out with no answer at all: until `SUSPECT_S` seconds from now its first requests go
        to instances seen alive since the first such call was sent (the replica that took
        it has answered nothing since)."""
        now = asyncio.get_running_loop().time()
        was = self._suspect.get(subject)
        since = was[0] if was is not None and now - was[1] <= SUSPECT_S else sent_at
        self._suspect[subject] = (since, now)
        if len(self._suspect) > 4096:  # a suspicion is an optimisation: forget the oldest
            del self._suspect[next(iter(self._suspect))]

    def suspected(self, subject: str, now: float) -> float | None:
        """When the suspicion on `subject` began (loop time), or None if it is not suspect."""
        was = self._suspect.get(subject)
        if was is None:
            return None
        if now - was[1] > SUSPECT_S:
            del self._suspect[subject]
            return None
        return was[0]

    async def discover(self, subject: str) -> None:
        """Ask the live workers which handlers they serve (``$SRV.PING`` of the worker
        service), at most once per `DISCOVERY_INTERVAL_S`; their answers arrive during
        `DISCOVERY_GATHER_S` and make them hedge targets of handler `subject` (and of every
        handler this requester has had answers from). Never raises and never waits for
        the answers."""
        nc = self._nc
        if nc is None or self._sub is None or not nc.is_connected:
            return
        if len(self._wanted) >= 4096:
            self._wanted.clear()
        self._wanted.add(subject)
        loop = asyncio.get_running_loop()
        if loop.time() - self._discovery_at < DISCOVERY_INTERVAL_S:
            return
        self._discovery_at = loop.time()
        token = f"{next(self._tokens):x}"
        self._waiting[token] = _Discovery(self)
        found = self._found = loop.create_future()
        loop.call_later(DISCOVERY_GATHER_S, self._discovery_over, token, found)
        try:
            await nc.publish(
                f"$SRV.PING.{WORKER_SERVICE_NAME}",
                b"",
                reply=inbox_reply_subject(self._prefix, token),
            )
        except nats.errors.Error as exc:  # closed, or not allowed: hedges stay as they were
            self._discovery_over(token, found)
            log.debug("worker discovery not sent: %s", exc)

    def _discovery_over(self, token: str, found: asyncio.Future[None]) -> None:
        self._waiting.pop(token, None)
        if not found.done():
            found.set_result(None)

    def _discovered(self, instance: str, served: list[tuple[str, str]]) -> None:
        """A discovery's answer: `instance` is alive and serves the handlers `served`."""
        now = asyncio.get_running_loop().time()
        for event, name in served:
            try:
                subject = handler_subject(event, name)
            except BadRequestError:
                continue
            if subject in self._wanted or subject in self._recent:
                _note(self._found_live, subject, instance, now)
                found = self._found
                if found is not None and not found.done():
                    found.set_result(None)

    def _first(
        self, route: Route, avoid: set[str], token: str, targets: dict[str, str], now: float
    ) -> str:
        """Subject of a call's first request: the queue subject, unless it is suspect and
        an instance was seen alive since (then those instances in turn)."""
        if not self._suspect:
            return route.subject
        since = self.suspected(route.subject, now)
        if since is None:
            return route.subject
        alive = _since(self._recent.get(route.subject), since) or _since(
            self._found_live.get(route.subject), since
        )
        if not alive:
            return route.subject
        instance = alive[next(self._turn) % len(alive)]
        try:
            subject = handler_instance_subject(route.event, route.name, instance)
        except BadRequestError:
            return route.subject
        avoid.add(instance)
        targets[token] = instance
        return subject

    def _forget(self, subject: str, instance: str) -> None:
        for known in (self._recent, self._found_live):
            instances = known.get(subject)
            if instances is not None:
                instances.pop(instance, None)

    def _another(self, route: Route, avoid: set[str], now: float) -> bool:
        """Whether an instance of `route` not in `avoid` is known (`_target` would pick one)."""
        for known in (self._recent, self._found_live):
            instances = known.get(route.subject)
            if instances and any(
                now - seen <= RECENT_TTL_S and instance not in avoid
                for instance, seen in instances.items()
            ):
                return True
        return False

    def _target(
        self, route: Route, avoid: set[str], token: str, targets: dict[str, str], now: float,
        chain: bool = False,
    ) -> str:  # fmt: skip
        """Subject of a further request: the instance subject of the most recently
        answering instance not in `avoid` (then added to it), else of the most recently
        discovered one, else the queue subject."""
        for known in (self._recent, self._found_live):
            instances = known.get(route.subject)
            if not instances:
                continue
            for instance, seen in reversed(instances.items()):
                if now - seen > RECENT_TTL_S:
                    break  # older still from here on
                if instance in avoid:
                    continue
                try:
                    subject = (
                        chain_instance_subject(route.subject, instance)
                        if chain
                        else handler_instance_subject(route.event, route.name, instance)
                    )
                except BadRequestError:  # not an id we can address: never a target
                    continue
                avoid.add(instance)
                targets[token] = instance
                return subject
        return route.subject

    async def _send(
        self, nc: NATS, subject: str, envelope: EventEnvelope, headers: dict[str, str] | None,
        token: str,
    ) -> Failed | None:  # fmt: skip
        try:
            payload = encode(envelope)
        except (WireFormatError, OverflowError, TypeError, ValueError) as exc:
            return Failed("bad_reply", f"the data cannot be encoded: {exc}")
        if len(payload) > nc.max_payload:
            raise PayloadTooLargeError(
                f"event {envelope.event!r} is {len(payload)} bytes encoded; the server's"
                f" max_payload is {nc.max_payload} bytes"
            )
        try:
            await nc.publish(
                subject,
                payload,
                reply=inbox_reply_subject(self._prefix, token),
                headers=headers,
            )
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLargeError(str(exc)) from exc
        except _CONNECTION_ERRORS as exc:
            raise NotConnectedError("the NATS connection is closed") from exc
        except nats.errors.Error as exc:
            return nats_failure(exc)
        return None


def call_remote(
    nc: NATS | None,
    requester: Requester,
    route: Route,
    envelope: EventEnvelope,
    headers: dict[str, str] | None,
    budget_s: float | None = None,
    neighbours: Neighbours | None = None,
) -> Awaitable[Outcome]:
    """Request one remote handler on its subject and judge its `HookReply`; returns the
    call's awaitable (await it at once: a plain function, not a coroutine frame around
    the requester's).

    Gives the handler the route's timeout (`DEFAULT_TIMEOUT_S` if it has none) cut to
    `budget_s` (seconds the emit has left; None: no deadline), and waits past it, while a
    live worker may still answer, at most until `budget_s` (`Requester.call`: the grace,
    and the overlap of the emit's other calls in flight, `neighbours`); hedges only a
    ``retry_safe`` route (see the module docstring).

    Raises:
        NotConnectedError: no connection, or it is closed.
        PayloadTooLargeError: the envelope exceeds the server's max_payload (when awaited).
    """
    if nc is None or nc.is_closed or not requester.started:
        raise NotConnectedError(f"remote handler {route.name!r} needs a NATS connection")
    if not nc.is_connected:  # reconnecting: fail now, not after the handler's timeout
        return ready_outcome(
            Failed("error", "not connected to NATS (reconnecting); the request was not sent")
        )
    timeout_s = _cut(route.timeout_s or DEFAULT_TIMEOUT_S, budget_s)
    assert timeout_s is not None
    if clock.no_time_left(timeout_s):
        return ready_outcome(Failed("timeout", "not called: the emit's deadline had passed"))
    return requester.call(
        nc, route, envelope, headers, timeout_s, hedge=route.retry_safe,
        within_s=math.inf if budget_s is None else budget_s, neighbours=neighbours,
    )  # fmt: skip


async def ready_outcome(outcome: Outcome) -> Outcome:
    """`outcome` as an awaitable (a call decided before anything was sent)."""
    return outcome


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """What every chain request for one sequence of handlers shares (made once per sequence)."""

    target: Route
    """The chain subject as a route (its name, for messages)."""
    steps: list[ChainStep]
    total_s: float
    """The sum of the steps' timeouts, seconds."""
    hedge: bool
    """Every step is retry_safe: a step may be asked again on its own (hedged)."""
    subjects: dict[str, str]
    """Each step's handler subject, by handler name (an instance that answers a step is a
    hedge target of that handler too: it serves it)."""
    rest_s: dict[str, float]
    """By handler name: the timeouts of its step and every later one, summed (seconds)."""

    @classmethod
    def of(cls, seg: tuple[Route, ...]) -> ChainPlan:
        steps = [
            ChainStep(
                handler=r.name,
                failure_policy=r.failure_policy,
                timeout_s=r.timeout_s or DEFAULT_TIMEOUT_S,
                parallel=r.parallel,
                tool_filter=None if r.tool_filter is None else list(r.tool_filter),
            )
            for r in seg
        ]
        head = seg[0]
        target = Route.make(
            event=head.event,
            name=f"chain of {len(seg)} handlers ({head.name!r}, ...)",
            priority=head.priority,
            timeout_s=None,
            failure_policy=head.failure_policy,
            parallel=False,
            tool_filter=None,
            subject=head.chain,
        )
        rest_s: dict[str, float] = {}
        total = 0.0
        for step in reversed(steps):
            total += step.timeout_s
            rest_s[step.handler] = total
        subjects = {r.name: r.subject for r in seg}
        return cls(target, steps, total, all(r.retry_safe for r in seg), subjects, rest_s)
