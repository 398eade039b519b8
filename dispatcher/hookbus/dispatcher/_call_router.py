"""The router: which handlers an event has, and how one of them is called.

It holds the routing table, the watch that keeps it in step with the registry bucket, the
remote calls (see `_calls`) and the one long-lived inbox `emit_and_collect` answers land
on. `HookDispatcher` folds what the router returns; it never talks to NATS about routing
itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable
from typing import Any, Final

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from hookbus._core import clock
from hookbus._core.buckets import republishes_registry
from hookbus._core.copies import json_copy, walked_copy
from hookbus._core.deadlines import NEVER, Deadline
from hookbus._core.direct_delivery import subscribe_direct, unsubscribe_direct
from hookbus._core.inboxes import inbox_reply_subject
from hookbus._core.nats_guard import harden_connection
from hookbus.schemas import (
    MAX_HANDLER_TIMEOUT_S,
    EventEnvelope,
    HookbusError,
    HookReply,
    HookResult,
    NotConnectedError,
    PayloadTooLargeError,
    collect_subject,
    decode,
    encode,
)

from ._calls import call_local, call_remote
from ._chain_calls import ChainCall, ChainPlan
from ._neighbours import Neighbours
from ._outcomes import Failed, Outcome, ready_outcome
from ._registry_follow import RegistryFollower
from ._registry_watch import RegistryWatch, open_handlers_bucket
from ._requester import Requester
from ._route_table import Route, RoutingTable
from ._telemetry import end_collect_span, start_collect_span, trace_headers
from ._telemetry_core import error

__all__ = ["REMOTE_EMIT_BUDGET_S", "Collect", "EmitContext", "Router"]

log = logging.getLogger("hookbus.dispatcher")

REMOTE_EMIT_BUDGET_S: Final = MAX_HANDLER_TIMEOUT_S
"""Seconds an emit without a caller deadline gives its remote handlers in all, from its
start: each call within its own timeout and this total (so no number of handlers with
long timeouts can hold an emit longer). In-process handlers are not bound by it."""

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

_ID_BATCH = 64
_ids: collections.deque[str] = collections.deque()
"""Emit ids drawn from one `os.urandom` read per `_ID_BATCH` (the read is a system call: a
few microseconds of an emit under load, against a deque pop)."""
os.register_at_fork(after_in_child=_ids.clear)  # a child never reuses its parent's ids


def _new_id() -> str:
    """32 random hex digits (128 bits from `os.urandom`, like ``uuid4().hex``), unique.

    Safe across threads (a deque's popleft is atomic; refills add fresh ids only) and
    across a fork (the child's pool starts empty).
    """
    try:
        return _ids.popleft()
    except IndexError:
        digits = os.urandom(16 * _ID_BATCH).hex()
        _ids.extend(digits[i : i + 32] for i in range(32, len(digits), 32))
        return digits[:32]


class EmitContext:
    """What every handler call of one emit shares: its id, event, start time and deadline.

    Args:
        event: the event name.
        data: the event data (agent and session ids are read from it).
        timeout_s: the emit's overall deadline in seconds from now; None for none.
        call_id: the caller's idempotency key, None for none: sent to the handlers
            (`EventEnvelope.idempotency_key`) and the approvals' call id (`call_id`: a
            retry of the same call finds its approval again). The emit's own `id` is
            always fresh.
    """

    __slots__ = (
        "_copied",
        "_encoded",
        "_id",
        "_remote",
        "agent_id",
        "called",
        "deadline",
        "emitted_at",
        "event",
        "idempotency_key",
        "neighbours",
        "session_id",
        "started",
    )

    def __init__(
        self,
        event: str,
        data: dict[str, Any],
        *,
        timeout_s: float | None = None,
        call_id: str | None = None,
    ) -> None:
        self.event = event
        self._id = ""
        self.idempotency_key = call_id or None
        """The caller's idempotency key; None: it gave none."""
        self.emitted_at = time.time()
        started = self.started = clock.now()
        """When the emit's chain started (`clock.now()`: its decision's duration)."""
        self.deadline = NEVER if timeout_s is None else Deadline(started + timeout_s)
        """When the emit gives up on its handlers (`NEVER`: it has no deadline)."""
        self._remote: Deadline | None = None
        agent, session = data.get("agent_id"), data.get("session_id")
        self.agent_id = agent if isinstance(agent, str) else None
        self.session_id = session if isinstance(session, str) else None
        self.called: list[str] = []
        """Names of the handlers called so far, in the order they were called."""
        self._copied: dict[str, Any] | None = None
        self._encoded = b""
        self.neighbours: Neighbours | None = None
        """The emit's remote calls in flight (made by its first remote call)."""

    @property
    def id(self) -> str:
        """The emit's id, made on first use: an in-process-only emit never needs one."""
        if not self._id:
            self._id = _new_id()
        return self._id

    @property
    def call_id(self) -> str:
        """The call's id for its approvals: the caller's idempotency key, else `id`."""
        return self.idempotency_key or self.id

    def encoded_as(self, data: dict[str, Any], encoded: bytes) -> None:
        """Note that `encoded` is the compact JSON of `data` (which is never changed in
        place): `envelope` and `handler_copy` use these bytes instead of encoding it."""
        self._copied, self._encoded = data, encoded

    def _encoding(self, data: dict[str, Any]) -> bytes | None:
        """The compact JSON of `data`, encoded once per version; None if msgspec cannot
        encode it (`json_copy` converts it, or says why not)."""
        if data is not self._copied:
            try:
                encoded = _encode(data)
            except (TypeError, msgspec.EncodeError, RecursionError):
                return None
            self._copied, self._encoded = data, encoded
        return self._encoded

    def handler_copy(self, data: dict[str, Any]) -> dict[str, Any]:
        """A fresh copy of `data` for one in-process handler, as `json_copy` makes it.

        Why not `json_copy` each time: the data handlers see is the fold's, JSON already
        and never changed in place (a modify replaces it, see `Fold`), so it is encoded
        once per version and each handler's copy is only decoded from those bytes (a
        third of a copy's cost). A value msgspec cannot encode goes to `json_copy`.
        """
        encoded = self._encoding(data)
        if encoded is None:
            return json_copy(data)  # its conversions, or its error
        walked = walked_copy(data, encoded)  # a large event: its strings shared, not decoded
        copy: dict[str, Any] = _decode(encoded) if walked is None else walked
        return copy

    def remaining(self) -> float | None:
        """Seconds left before the emit's deadline (at least 0); None: no deadline."""
        deadline = self.deadline
        return None if deadline.unbounded else deadline.left()

    def remote_deadline(self) -> Deadline:
        """When remote handler calls must end: the emit's deadline, and never past
        `REMOTE_EMIT_BUDGET_S` from its start (one total, not the sum of the handlers'
        timeouts)."""
        remote = self._remote
        if remote is None:  # made by the first remote call
            total = Deadline(self.started + REMOTE_EMIT_BUDGET_S)
            remote = self._remote = self.deadline.earlier(total)
        return remote

    def envelope(self, data: dict[str, Any]) -> EventEnvelope:
        """The request for the handlers, its data as the bytes `encoded_as` / `handler_copy`
        made of this version of `data` (encoded once, whatever the requests sent)."""
        encoded = self._encoding(data)
        return EventEnvelope(
            id=self.id,
            event=self.event,
            data=data if encoded is None else msgspec.Raw(encoded),  # type: ignore[arg-type]
            agent_id=self.agent_id,
            session_id=self.session_id,
            idempotency_key=self.idempotency_key,
            emitted_at=self.emitted_at,
        )


class Collect:
    """One emit_and_collect in flight: which remote handlers are expected, what came."""

    __slots__ = ("asked", "done", "expected", "results", "span", "subject", "token")

    def __init__(self, token: str, expected: set[str]) -> None:
        self.token = token
        self.expected = expected
        self.asked = len(expected)
        """How many remote handlers the one message asked (requests sent)."""
        self.results: dict[str, HookResult] = {}
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done when every expected handler answered, or nobody can (`settle`)."""
        self.span: Any = None
        """The message's ``send`` span (`start_collect_span`), ended by `finish_collect`."""
        self.subject = ""

    def settle(self) -> None:
        """No more answers are waited for (all came, or none will)."""
        if not self.done.done():
            self.done.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Return once `settle` was called, or after `timeout` seconds (None: no limit)."""
        if self.done.done():
            return
        timer = (
            None if timeout is None else asyncio.get_running_loop().call_later(timeout, self.settle)
        )
        try:
            await self.done
        finally:
            if timer is not None:
                timer.cancel()


class Router:
    """Routing table + registry watch + remote calls + the collect inbox.

    Args:
        nc: a connected nats-py client, or None (in-process routes only).
        resync_s: seconds between full re-reads of the registry.
        bucket_replicas: replicas of the handlers bucket if this router creates it.
    """

    def __init__(
        self, nc: NATS | None, *, resync_s: float = 30.0, bucket_replicas: int = 1
    ) -> None:
        self.nc = nc
        self.table = RoutingTable()
        self._resync_s = resync_s
        self._bucket_replicas = bucket_replicas
        self._watch: RegistryFollower | RegistryWatch | None = None
        self._inbox_sub: Subscription | None = None
        self._inbox_prefix = ""
        self._collects: dict[str, Collect] = {}
        self._collect_subjects: dict[str, str] = {}
        self._tokens = itertools.count()
        self._requester = Requester()
        self._chains: dict[tuple[Route, ...], ChainPlan] = {}
        self.started = False

    async def start(self) -> None:
        """Load the registry, start watching it and open the collect inbox."""
        if self.started or self.nc is None:
            return
        harden_connection(self.nc)  # replies come from anyone: none may silence us
        kv = await open_handlers_bucket(self.nc, replicas=self._bucket_replicas)
        self._watch = await follow_registry(kv, self.table, resync_s=self._resync_s)
        self._inbox_prefix = self.nc.new_inbox()
        self._inbox_sub = await subscribe_direct(
            self.nc, inbox_reply_subject(self._inbox_prefix, "*"), self._on_collect_reply
        )
        await self._requester.start(self.nc)
        self.started = True

    async def start_over(self, connection: Any) -> None:
        """Start on `connection` (nats-py's `new_inbox`, `subscribe` and `publish`: a test
        kit's in-process loopback) without the handlers bucket: the inboxes `start` opens;
        the routes are the caller's to put in `table`.

        Raises:
            RuntimeError: the router has a connection of its own or was started.
        """
        if self.started or self.nc is not None:
            raise RuntimeError("a router with a connection of its own routes over it")
        self.nc = connection
        self._inbox_prefix = connection.new_inbox()
        self._inbox_sub = await subscribe_direct(
            connection, inbox_reply_subject(self._inbox_prefix, "*"), self._on_collect_reply
        )
        await self._requester.start(connection)
        self.started = True

    async def close(self) -> None:
        """Stop watching and unsubscribe (idempotent)."""
        if self._watch is not None:
            await self._watch.stop()
            self._watch = None
        if self._inbox_sub is not None:
            with contextlib.suppress(Exception):
                await unsubscribe_direct(self.nc, self._inbox_sub)
            self._inbox_sub = None
        await self._requester.close()
        self.started = False

    async def refresh(self) -> None:
        """Re-read the whole handler registry now."""
        if self._watch is not None:
            await self._watch.resync()

    def routes(self, event: str) -> tuple[Route, ...]:
        return self.table.routes(event)

    @property
    def registry_current(self) -> bool:
        """Whether the routes follow the handler registry with no change known missed
        (always, without a connection or on a consumer watch; see `RegistryFollower`)."""
        watch = self._watch
        return not isinstance(watch, RegistryFollower) or watch.current

    async def wait_registry(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for `registry_current`; returns it."""
        watch = self._watch
        return not isinstance(watch, RegistryFollower) or await watch.wait_current(timeout_s)

    # -- one call ------------------------------------------------------------------------
    def call(self, route: Route, ctx: EmitContext, data: dict[str, Any]) -> Awaitable[Outcome]:
        """Call one handler within its timeout cut to what the emit has left; a handler
        not called because the emit's deadline passed is a ``timeout`` failure. Failures
        are outcomes; only caller errors raise. Returns the call's awaitable: await it at
        once.

        Raises:
            NotConnectedError: a remote route and no started connection.
            PayloadTooLargeError: the envelope exceeds the server's max_payload.
        """
        if route.local is not None:
            # call_local's own awaitable, no coroutine frame of ours around it (a few
            # tenths of a microsecond per in-process handler); it fails a call past the
            # emit's deadline as below
            return call_local(route, ctx.event, ctx.handler_copy(data), ctx.remaining())
        remote, now = ctx.remote_deadline(), clock.now()
        if remote.expired(now):
            return ready_outcome(Failed("timeout", "not called: the emit's deadline had passed"))
        budget_s = remote.left(now)
        neighbours = ctx.neighbours
        if neighbours is None:
            neighbours = ctx.neighbours = Neighbours()
        # call_remote's own coroutine, as for call_local above: one frame less per call
        return call_remote(
            self.nc, self._requester, route, ctx.envelope(data), trace_headers(), budget_s,
            neighbours,
        )  # fmt: skip

    async def call_chain(
        self,
        seg: tuple[Route, ...],
        ctx: EmitContext,
        data: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> ChainCall | Failed:
        """Send the adjacent handlers `seg` of one worker process's handler set as one chain
        request; the `ChainCall` gives each step's outcome as the fold reaches it (see
        `_chain_calls`). A `Failed`: nothing was sent, call each alone.
        `headers`: the chain message's headers, its ``send`` span's context
        (`ChainSpan.headers`); None: the current context's (`trace_headers`). Every step's
        handling in the worker is a child of that one context: one message was sent.

        Raises:
            NotConnectedError: no started connection.
            PayloadTooLargeError: the envelope exceeds the server's max_payload.
        """
        nc = self.nc
        if nc is None or nc.is_closed or not self._requester.started:
            raise NotConnectedError("remote handlers need a NATS connection")
        if not nc.is_connected:
            return Failed("error", "not connected to NATS (reconnecting); not sent")
        plan = self._chains.get(seg)
        if plan is None:
            if len(self._chains) >= 1024:  # stale snapshots: start over
                self._chains.clear()
            plan = self._chains[seg] = ChainPlan.of(seg)
        if headers is None:
            headers = trace_headers()
        chain = ChainCall(
            self._requester, nc, plan, ctx.envelope(data), headers, ctx.remote_deadline()
        )
        failed = await chain.start()
        if failed is not None:
            chain.close()
            return failed
        return chain

    # -- emit_and_collect --------------------------------------------------------------------
    async def publish_collect(
        self, remote: list[Route], event: str, data: dict[str, Any], encoded: bytes | None = None
    ) -> Collect:
        """Publish `event` once on its collect subject; answers gather on the returned
        `Collect` until `finish_collect`. `encoded`: the compact JSON of `data` if known
        (sent as it is), else None.

        Raises:
            NotConnectedError: no started connection, or it is closed.
            PayloadTooLargeError: the event exceeds the server's max_payload.
        """
        nc = self.nc
        if nc is None or nc.is_closed or not self.started:
            raise NotConnectedError("remote handlers need a started dispatcher with a connection")
        ctx = EmitContext(event, data)
        if encoded is not None:
            ctx.encoded_as(data, encoded)
        payload = encode(ctx.envelope(data))
        if len(payload) > nc.max_payload:
            raise PayloadTooLargeError(
                f"event {event!r} is {len(payload)} bytes encoded; the server's"
                f" max_payload is {nc.max_payload} bytes"
            )
        token = f"{next(self._tokens):x}"
        collect = self._collects[token] = Collect(token, {r.name for r in remote})
        subject = self._collect_subjects.get(event)
        if subject is None:
            if len(self._collect_subjects) >= 4096:  # events come and go: start over
                self._collect_subjects.clear()
            subject = self._collect_subjects[event] = collect_subject(event)
        collect.subject = subject
        collect.span, headers = start_collect_span(event)
        try:
            await nc.publish(
                subject,
                payload,
                reply=inbox_reply_subject(self._inbox_prefix, token),
                headers=headers,
            )
        except BaseException as exc:
            del self._collects[token]
            if collect.span is not None:
                error(collect.span, exc)
                end_collect_span(collect.span, subject, collect.asked, 0)
            if isinstance(exc, nats.errors.ConnectionClosedError):
                raise NotConnectedError("the NATS connection is closed") from exc
            if isinstance(exc, nats.errors.Error):  # never a raw nats-py error
                raise NotConnectedError(f"NATS failed: {type(exc).__name__}") from exc
            raise
        return collect

    def finish_collect(self, collect: Collect) -> dict[str, HookResult]:
        """Stop listening for `collect`; the results that came, by handler name."""
        self._collects.pop(collect.token, None)
        if collect.span is not None:
            span, collect.span = collect.span, None
            answered = collect.asked - len(collect.expected)
            end_collect_span(span, collect.subject, collect.asked, answered)
        return collect.results

    def _on_collect_reply(self, msg: Msg) -> None:
        collect = self._collects.get(msg.subject.rpartition(".")[2])
        if collect is None:
            return  # late answer to a finished collect
        if msg.headers and "Status" in msg.headers:
            if not msg.data and msg.headers["Status"] == "503":
                collect.settle()  # no handler has a live replica: nobody will answer
            return
        try:
            reply = decode(msg.data, HookReply)
        except HookbusError as exc:
            log.warning("bad collect reply on %s: %s", msg.subject, exc)
            return
        if reply.handler not in collect.expected:
            return
        if reply.result is not None:
            collect.results[reply.handler] = reply.result
        collect.expected.discard(reply.handler)
        if not collect.expected:
            collect.settle()


async def follow_registry(
    kv: KeyValue, table: RoutingTable, *, resync_s: float
) -> RegistryFollower | RegistryWatch:
    """Start keeping `table` in step with the handlers bucket `kv`: a `RegistryFollower`
    (one core subscription) when the bucket's stream republishes its changes, else (a
    bucket an older hookbus created) a `RegistryWatch` (one JetStream consumer per
    dispatcher), with a warning saying how to upgrade.

    Raises:
        what `RegistryFollower.start` / `RegistryWatch.start` raise.
    """
    config = (await kv.status()).stream_info.config
    if republishes_registry(config):
        follower = RegistryFollower(kv, table, check_s=resync_s)
        await follower.start()
        return follower
    log.warning(
        "the handler registry's stream %s does not republish its changes (made by an older"
        " hookbus): this dispatcher follows it with a JetStream consumer of its own, and a"
        " stream takes about 1,000 of them; `hookbus auth provision` adds the republish",
        kv._stream,
    )
    watch = RegistryWatch(kv, table, resync_s=resync_s)
    await watch.start()
    return watch
