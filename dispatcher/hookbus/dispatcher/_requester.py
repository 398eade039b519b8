"""Remote handler calls over NATS with a reply inbox of our own (`Requester`).

One reply inbox per connection, a future per call. A call has a budget (seconds: the
handler's timeout, cut to what the emit has left), sent in the envelope as ``budget_s``
so the worker never runs past it. Within it:

- an error reply marked ``retryable`` (``busy``, ``unavailable``: the handler did not run)
  is sent again at once, to another replica (see `_replicas`); only when every replica
  known has refused does it wait a moment first (5 ms per refusal so far, within the
  budget);
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

Which replica each request goes to, and when the live ones are looked up: `Replicas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hookbus._core.chain_timing import GRACE_S
from hookbus._core.deadlines import Deadline
from hookbus._core.direct_delivery import subscribe_direct, unsubscribe_direct
from hookbus._core.inboxes import inbox_reply_subject
from hookbus.schemas import (
    WORKER_SERVICE_NAME,
    EventEnvelope,
    NotConnectedError,
    PayloadTooLargeError,
    WireFormatError,
    encode,
)

from ._neighbours import Neighbours
from ._outcomes import Failed, Outcome, nats_failure, read_reply
from ._replicas import DISCOVERY_GATHER_S, Discovery, Replicas
from ._reply_inbox import Deadlines, Inbox
from ._route_table import Route
from ._telemetry_core import note_delivery, otel

__all__ = [
    "HEDGE_FRACTION",
    "HEDGE_MIN_S",
    "MAX_REFUSALS",
    "MAX_RESENDS",
    "NO_RESPONDERS_KEPT_S",
    "NO_RESPONDERS_RECHECK_S",
    "Requester",
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

_CONNECTION_ERRORS = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
)


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
        self._waiting: dict[str, Inbox | Discovery] = {}
        self._deadlines = Deadlines()
        self.replicas = Replicas()
        """The worker instances known per handler: where each request goes."""

    @property
    def started(self) -> bool:
        return self._sub is not None

    async def start(self, nc: NATS) -> None:
        if self._sub is None:
            self._nc = nc
            self._prefix = nc.new_inbox()
            # handed over in the read loop: a reply wakes its call with no task between
            self._sub = await subscribe_direct(
                nc, inbox_reply_subject(self._prefix, "*"), self._on_reply
            )

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await unsubscribe_direct(self._nc, self._sub)
            self._sub = None

    def _on_reply(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        inbox = self._waiting.get(token)
        if inbox is not None:
            inbox.put(token, msg)

    # -- one call ----------------------------------------------------------------------
    async def call(
        self, nc: NATS, route: Route, envelope: EventEnvelope, headers: dict[str, str] | None,
        budget_s: float, *, hedge: bool, within_s: float | None = None,
        neighbours: Neighbours | None = None,
    ) -> Outcome:  # fmt: skip
        """Send `envelope` to `route` with `budget_s` seconds for its handler, and wait for
        an answer: past the budget, while a request is unanswered, `GRACE_S` more plus the
        overlap of `neighbours` (see the module docstring), never past `within_s` seconds
        (the emit's deadline; None: `budget_s`, no wait past it). `hedge`: send it again
        while unanswered (a ``retry_safe`` handler).

        Raises:
            NotConnectedError: the connection is closed.
            PayloadTooLargeError: the envelope exceeds the server's max_payload.
        """
        loop = asyncio.get_running_loop()
        call = _Call(route, Inbox(self._deadlines), loop.time(), budget_s, hedge, within_s,
                     neighbours)  # fmt: skip
        try:
            for attempt in itertools.count(1):
                remaining = call.deadline.left(loop.time())
                if remaining <= 0 or attempt > MAX_RESENDS + 1:
                    break
                envelope.attempt = attempt
                envelope.budget_s = remaining
                token = f"{next(self._tokens):x}"
                if attempt == 1 and not self.replicas.any_suspect:
                    subject = route.subject  # the usual first request: the queue group's
                else:
                    subject = await self._subject(call, attempt, token, remaining)
                # the request (no coroutine of its own: one frame less per call)
                self._waiting[token] = call.inbox
                call.sent.append(token)
                failed = await self._send(nc, subject, envelope, headers, token)
                if failed is None:
                    call.live.add(token)
                elif not call.live:  # NATS refused it and no earlier one is unanswered
                    return failed
                outcome = await self._replies(call, attempt, loop)
                if outcome is not None:
                    return outcome
                if call.deadline.passed(loop.time()):
                    break
        finally:
            self._end(call)
        return await self._unanswered(call)

    async def _subject(self, call: _Call, attempt: int, token: str, remaining: float) -> str:
        """Subject of the call's request `token`: a first one steered away from a suspect
        queue subject (waiting a little for a discovery under way), or a further one to an
        instance not tried yet (with none known, the live ones are looked up)."""
        replicas, route = self.replicas, call.route
        loop = asyncio.get_running_loop()
        if attempt > 1:
            subject, instance = replicas.target(route, call.avoid, loop.time())
            if instance:
                call.targets[token] = instance
            else:  # no instance known to go to: ask who serves
                await self.discover(route.subject)
            return subject
        subject, instance = replicas.first(route, call.avoid, loop.time())
        found = replicas.found
        if not instance and found is not None and not found.done():
            # suspect, and the live replicas are being asked right now: their first
            # answer is worth a short wait (a call sent now would meet the stalled
            # replica again)
            if replicas.suspected(route.subject, loop.time()) is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining * HEDGE_FRACTION):
                        await asyncio.shield(found)
                subject, instance = replicas.first(route, call.avoid, loop.time())
        if instance:
            call.targets[token] = instance
        return subject

    async def _replies(
        self, call: _Call, attempt: int, loop: asyncio.AbstractEventLoop
    ) -> Outcome | None:
        """Take the call's replies until one decides it (its outcome), its next request is
        due (None: a hedge, or a replica that refused or is gone, asked again), or its
        budget is spent (None), waiting on past the budget while a live worker may still
        answer (`_Call.grace_until`). `loop`: the running loop."""
        route, live, replicas = call.route, call.live, self.replicas
        # no hedge: the budget's end (no clock read for a next request never due)
        until = (
            call.deadline.cap(call.next_send(loop.time(), attempt))
            if call.hedge
            else call.deadline.when
        )
        while True:
            try:
                token, msg = await call.inbox.get(loop, until)
            except TimeoutError:
                if call.deadline.passed(until) and live:
                    # the budget is spent and a request is unanswered: its worker times
                    # it, so wait on while a live one may still answer
                    later = call.grace_until()
                    if not later.passed(until) and not later.passed(loop.time()):
                        until = later.when
                        continue
                return None  # hedge (retry_safe) or the budget is spent
            live.discard(token)
            self._waiting.pop(token, None)
            outcome, code, instance = read_reply(msg)
            if code is not None:  # not run: send again, to another replica
                if instance:
                    call.avoid.add(instance)
                call.refused, call.refusals = code, call.refusals + 1
                if live:
                    continue
                if call.refusals >= MAX_REFUSALS:
                    return Failed("error", f"{code}: refused {call.refusals} times")
                if not replicas.another(route, call.avoid, loop.time()):
                    # every replica known refused: give them a moment
                    wait = Deadline.at(until).cut(0.005 * call.refusals, loop.time())
                    await asyncio.sleep(wait)
                return None  # at once to a replica that has not refused
            if outcome is not None:
                if instance:
                    replicas.answered(route.subject, instance, loop.time())
                    call.answered_by = instance
                return outcome
            gone = call.targets.pop(token, None)
            if gone is not None:  # no responders on an instance subject: it is gone
                replicas.forget(route.subject, gone)
                if live:
                    continue
                return None  # send the next request at once
            if not live:  # no replica subscribed: answered at once
                return await self._no_responders(call)

    async def _no_responders(self, call: _Call) -> Failed | None:
        """The call's queue subject has no replica subscribed: None to ask once more,
        shortly (unless a recheck found none within `NO_RESPONDERS_KEPT_S`), else the
        ``no_responders`` failure."""
        route = call.route
        now = asyncio.get_running_loop().time()
        if call.rechecked:
            self.replicas.found_no_replica(route.subject, now)
        elif (
            now - self.replicas.no_replica_at(route.subject) >= NO_RESPONDERS_KEPT_S
            and call.deadline.left(now) > NO_RESPONDERS_RECHECK_S
        ):
            # a replica that subscribed a moment ago may not be visible to this publish
            # yet (seen under load): ask once more, shortly
            call.rechecked = True
            await asyncio.sleep(NO_RESPONDERS_RECHECK_S)
            return None
        return Failed("no_responders", f"no replica of {route.name!r} is subscribed")

    def _end(self, call: _Call) -> None:
        """The call is over: its replies are no longer taken, its neighbours' count
        drops it, and its delivery is noted (telemetry)."""
        for token in call.sent:
            self._waiting.pop(token, None)
        if call.mark is not None and call.neighbours is not None:
            call.neighbours.close(call.key, call.budget_s)
        if otel.tracing:
            note_delivery(len(call.sent), call.answered_by)

    async def _unanswered(self, call: _Call) -> Failed:
        """The failure of a call whose budget ran out undecided: every replica refused it
        (``error``), or nothing came back (``timeout``: the instances that took it are no
        longer targets, its queue subject is suspect, and the live ones are looked up)."""
        route = call.route
        if call.refused is not None and not call.live:
            return Failed(
                "error", f"{call.refused}: every replica refused within {call.budget_s:.3g}s"
            )
        if call.live:  # sent, and nothing at all came back: a stalled replica, or a lost one
            for token in call.live:
                stalled = call.targets.get(token)
                if stalled is not None:  # no longer an instance to send to
                    self.replicas.forget(route.subject, stalled)
            self.replicas.suspect(route.subject, call.started)
            await self.discover(route.subject)
        return Failed("timeout", f"no reply within {call.budget_s:.3g}s")

    # -- what a chain call (`_chain_calls.ChainCall`) uses of the requester ----------------
    def open_inbox(self) -> Inbox:
        """A new inbox for one call's replies (register each request with `add_token`)."""
        return Inbox(self._deadlines)

    def add_token(self, inbox: Inbox) -> str:
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

    # -- the live workers --------------------------------------------------------------
    async def discover(self, subject: str) -> None:
        """Ask the live workers which handlers they serve (``$SRV.PING`` of the worker
        service), at most once per `DISCOVERY_INTERVAL_S`; their answers arrive during
        `DISCOVERY_GATHER_S` and make them hedge targets of handler `subject` (and of every
        handler this requester has had answers from). Never raises and never waits for
        the answers."""
        nc = self._nc
        if nc is None or self._sub is None or not nc.is_connected:
            return
        loop = asyncio.get_running_loop()
        if not self.replicas.discovery_due(subject, loop.time()):
            return
        token = f"{next(self._tokens):x}"
        self._waiting[token] = Discovery(self.replicas)
        found = self.replicas.discovery_sent(loop)
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


class _Call:
    """One `Requester.call` in flight: its time limits (on the loop clock), its requests
    (by reply token) and what their replies said so far."""

    __slots__ = (
        "answered_by",
        "avoid",
        "budget_s",
        "deadline",
        "hedge",
        "inbox",
        "key",
        "live",
        "mark",
        "neighbours",
        "rechecked",
        "refusals",
        "refused",
        "route",
        "sent",
        "started",
        "targets",
        "window",
        "within_s",
    )

    def __init__(
        self, route: Route, inbox: Inbox, started: float, budget_s: float, hedge: bool,
        within_s: float | None, neighbours: Neighbours | None,
    ) -> None:  # fmt: skip
        self.route = route
        self.inbox = inbox
        self.started = started
        """When the call's first request went (loop time)."""
        self.budget_s = budget_s
        self.deadline = Deadline(started + budget_s)
        """When the handler's budget ends."""
        self.within_s = within_s
        """Seconds from `started` to the emit's deadline (None: `budget_s`): no wait goes
        past it (`limit`)."""
        self.key = route.handler_set
        self.neighbours = neighbours
        self.mark = None if neighbours is None else neighbours.open(self.key, budget_s)
        self.hedge = hedge
        self.window = max(HEDGE_MIN_S, budget_s * HEDGE_FRACTION) if hedge else math.inf
        """Seconds from the first request to its hedge."""
        self.sent: list[str] = []
        """Every token of this call, for the cleanup."""
        self.live: set[str] = set()
        """Tokens of the requests sent and not answered yet."""
        self.targets: dict[str, str] = {}
        """Token -> instance of a request sent to one instance."""
        self.avoid: set[str] = set()
        """Instances this call was sent to or refused by."""
        self.refused: str | None = None
        """The code of the last refusal (``busy``, ``unavailable``), if any."""
        self.refusals = 0
        self.rechecked = False
        """Whether a "no responders" was asked once more already."""
        self.answered_by = ""

    def next_send(self, now: float, attempt: int) -> float:
        """When the request after request `attempt`, sent at `now`, is due (a hedge;
        inf: never)."""
        if not self.hedge:
            return math.inf
        return now + (self.window if attempt == 1 else max(HEDGE_MIN_S, self.window / 2))

    def grace_until(self) -> Deadline:
        """How long past its budget the call waits for a live worker: `GRACE_S` plus the
        overlap of its neighbours, never past the emit's deadline."""
        extra = GRACE_S
        if self.mark is not None and self.neighbours is not None:
            extra += self.neighbours.overlap(self.key, self.mark)
        return self.deadline.plus(extra).earlier(self.limit())

    def limit(self) -> Deadline:
        """When the emit's deadline ends: no wait goes past it (made only when a call
        waits past its budget)."""
        within_s = self.within_s
        return Deadline.after(
            self.budget_s if within_s is None else max(within_s, self.budget_s), self.started
        )
