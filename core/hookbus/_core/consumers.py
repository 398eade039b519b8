"""Every JetStream consumer hookbus creates (KV watches and listings, reads of the audit
stream) is made here, so that an identity stays within its consumer slots.

On a connection scoped to an identity (inbox prefix ``_INBOX_<PUBKEY>``, see
`identity_key`) a consumer is a *slot consumer*: a named push consumer (no acks, memory
storage, one replica) whose name is the first of the identity's `slot_names` the server
does not already hold. It is created with the JetStream API's ``create`` action, so a slot
another process holds is refused ("consumer already exists") instead of being taken over,
and the next slot is tried. Its inactive threshold is short (`SLOT_INACTIVE_S`), so a slot
of a process that died is free again within about that long; the consumer is deleted when
the watch ends. With every slot taken, one randomly named consumer is tried: the dispatcher
service's NATS user may create it, any other identity's is refused by the server, and the
caller gets `ConsumerSlotsExhaustedError` ("all 8 consumer slots of this identity are in
use").

A slot consumer is kept ordered the way nats-py's ordered consumer is: every message
carries its consumer sequence, and a jump (a message the server dropped, e.g. for a slow
connection, or lost in a reconnect) re-creates the consumer from the stream sequence after
the last message handed to the callback, so the missed messages are delivered again, in
order. With `check_s`, a periodic consumer info also re-creates it when it is gone (a
restarted server, a disconnection longer than the inactive threshold) or when the server
delivered messages that never arrived (a loss at the tail, with nothing after it).

Without an identity (an open development server) consumers are made as before: nats-py's
ordered consumer for whole streams or buckets, a randomly named consumer for a narrower
filter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from hookbus._core.consumer_slots import CONSUMER_SLOTS, identity_key, slot_names
from hookbus.schemas import HookbusError

__all__ = [
    "SLOT_INACTIVE_S",
    "ConsumerSlotsExhaustedError",
    "KeyWatch",
    "SlotConsumer",
    "open_consumer",
    "watch_keys",
]

log = logging.getLogger("hookbus.dispatcher")

SLOT_INACTIVE_S = 30.0
"""Inactive threshold of a slot consumer, seconds: how long the server keeps a consumer
nobody listens to (its process died or lost its connection) before its slot is free."""

_EXISTS = 10148  # "consumer already exists" (a create action on a taken name)
_NAME_IN_USE = 10013  # "consumer name already in use" (older servers)
_MARKER_REASON = "Nats-Marker-Reason"
_RECOVER_BACKOFF_S = (0.1, 5.0)


class ConsumerSlotsExhaustedError(HookbusError):
    """Every consumer slot of this connection's identity is held (by this process or
    others of the same identity) and the server refused a consumer outside them."""


def _exhausted(stream: str, detail: str) -> ConsumerSlotsExhaustedError:
    detail = " ".join(detail.split())[:300]
    return ConsumerSlotsExhaustedError(
        f"all {CONSUMER_SLOTS} consumer slots of this identity are in use on {stream}"
        f" (stop a watch or a process of this identity; a consumer outside them was"
        f" refused: {detail})"
    )


def _ack_tokens(reply: str) -> tuple[int, int, int] | None:
    """(stream sequence, consumer sequence, pending) of a pushed message's ``$JS.ACK``
    reply subject (v1: 9 tokens; v2, with domain and account hash: 12), None otherwise."""
    tokens = reply.split(".")
    if len(tokens) < 9 or tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    base = 5 if len(tokens) == 9 else 7
    try:
        return int(tokens[base]), int(tokens[base + 1]), int(tokens[base + 3])
    except (ValueError, IndexError):
        return None


class SlotConsumer:
    """A push consumer in one of the identity's slots (or, past them, a randomly named one
    where the server allows it), kept ordered (see the module docstring). Quacks like a
    nats-py push subscription where hookbus uses one: `consumer_info`, `unsubscribe`
    (which also deletes the consumer), ``_js`` / ``_stream`` / ``_consumer``.

    Made by `open_consumer`; not constructed directly.
    """

    def __init__(
        self,
        js: Any,
        stream: str,
        subject: str,
        config: ConsumerConfig,
        cb: Callable[[Msg], Awaitable[None]],
        *,
        public_key: str,
        recover: bool,
        check_s: float | None,
    ) -> None:
        self._js = js
        self._nc = js._nc
        self._stream = stream
        self._subject = subject
        self._config = config
        self._cb = cb
        self._slots = slot_names(public_key)
        self._recover_on_gap = recover
        self._check_s = check_s
        self._consumer = ""
        self._sub: Any = None
        self._deliver = ""
        self._gen = 0
        self._cseq = 0
        self._sseq = 0
        self._closed = False
        self._recovering: asyncio.Task[None] | None = None
        self._checker: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.gaps = 0
        """Consumer sequence jumps seen (each one re-created the consumer when `recover`)."""
        self.recreated = 0
        """Times the consumer was re-created (a gap, a lost consumer, a tail loss)."""
        self.in_slot = True
        """Whether the consumer holds one of the identity's slots (False: the fallback)."""

    @property
    def name(self) -> str:
        """The consumer's current name (a slot name, or the fallback's)."""
        return self._consumer

    @property
    def delivered(self) -> int:
        """Messages handed to the callback since the consumer was last (re-)created."""
        return self._cseq

    # -- creation ----------------------------------------------------------------------
    async def _open(self, *, start_seq: int | None = None) -> None:
        """Subscribe to a fresh inbox and create the consumer delivering to it, in the
        first free slot (or the fallback)."""
        inbox = self._nc.new_inbox()
        self._gen += 1
        gen = self._gen

        async def on_msg(msg: Msg) -> None:
            await self._on_msg(msg, gen)

        sub = await self._nc.subscribe(
            inbox, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        self._deliver, self._sub, self._cseq = inbox, sub, 0
        try:
            info = await self._create(inbox, start_seq)
        except BaseException:
            self._consumer = ""  # not known to be ours: never deleted on this account
            self._deliver = ""
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise
        if start_seq is None and self._config.deliver_policy == DeliverPolicy.NEW:
            delivered = info.get("delivered") or {}
            self._sseq = max(self._sseq, int(delivered.get("stream_seq") or 0))

    def _body(self, name: str, inbox: str, start_seq: int | None) -> bytes:
        config = dataclasses.replace(self._config)
        config.name = name
        config.durable_name = None
        config.deliver_subject = inbox
        config.filter_subject = self._subject
        config.ack_policy = AckPolicy.NONE
        config.max_deliver = 1
        config.mem_storage = True
        config.num_replicas = 1
        config.flow_control = False
        config.idle_heartbeat = None
        config.inactive_threshold = config.inactive_threshold or SLOT_INACTIVE_S
        if start_seq is not None:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start_seq
            config.opt_start_time = None
        body = {"stream_name": self._stream, "config": config.as_dict(), "action": "create"}
        return json.dumps(body).encode()

    def _create_subject(self, name: str) -> str:
        prefix = self._js._jsm._prefix
        return f"{prefix}.CONSUMER.CREATE.{self._stream}.{name}.{self._subject}"

    async def _create(self, inbox: str, start_seq: int | None) -> dict[str, Any]:
        jsm = self._js._jsm
        timeout = self._js._timeout
        slots = self._slots
        if self._consumer in slots:  # re-created: another name first, so that a reader
            i = slots.index(self._consumer)  # counting per consumer name starts over
            slots = slots[i + 1 :] + slots[: i + 1]
        for name in slots:
            # named before the answer: its first deliveries may come before the answer does
            self._consumer, self.in_slot = name, True
            try:
                info: dict[str, Any] = await jsm._api_request(
                    self._create_subject(name), self._body(name, inbox, start_seq), timeout=timeout
                )
            except nats.js.errors.APIError as exc:
                if exc.err_code in (_EXISTS, _NAME_IN_USE):
                    continue  # another watch holds this slot
                raise
            return info
        name = self._nc._nuid.next().decode()
        self._consumer, self.in_slot = name, False
        try:
            info = await jsm._api_request(
                self._create_subject(name), self._body(name, inbox, start_seq), timeout=timeout
            )
        except Exception as exc:
            raise _exhausted(self._stream, f"{type(exc).__name__}: {exc}") from exc
        log.info("all consumer slots on %s are in use; using consumer %s", self._stream, name)
        return info

    # -- delivery ----------------------------------------------------------------------
    async def _on_msg(self, msg: Msg, gen: int) -> None:
        if gen != self._gen or self._closed:
            return  # a consumer since re-created (or given up on), or released
        seqs = _ack_tokens(msg.reply or "")
        if seqs is None:
            return  # not a stream message (no heartbeats or flow control are asked)
        sseq, cseq, _ = seqs
        if cseq != self._cseq + 1:
            self.gaps += 1
            if self._recover_on_gap:
                log.info(
                    "consumer %s on %s skipped from %d to %d; re-creating it from stream"
                    " sequence %d", self._consumer, self._stream, self._cseq, cseq, self._sseq + 1,
                )  # fmt: skip
                self._gen += 1  # ignore the rest of this consumer's deliveries
                self._recover_soon()
                return
        self._cseq, self._sseq = cseq, max(self._sseq, sseq)
        await self._cb(msg)

    def _recover_soon(self) -> None:
        if self._closed or (self._recovering is not None and not self._recovering.done()):
            return
        self._recovering = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        """Delete the consumer and create it again from the stream sequence after the last
        one handed over, in the next free slot after its own (its name changes when another
        is free). Retried with a backoff until it succeeds or the consumer is released."""
        delay, most = _RECOVER_BACKOFF_S
        while not self._closed and not self._nc.is_closed:
            async with self._lock:
                if self._closed:
                    return
                await self._drop()
                self.recreated += 1  # counted first: its deliveries may come before the return
                try:
                    await self._open(start_seq=self._sseq + 1 if self._sseq else None)
                    return
                except Exception as exc:
                    self.recreated -= 1
                    log.info("re-creating consumer on %s failed (%r); retrying", self._stream, exc)
            await asyncio.sleep(delay)
            delay = min(most, delay * 2)

    async def _drop(self) -> None:
        sub, name = self._sub, self._consumer
        self._sub, self._deliver = None, ""
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if name:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._js._jsm.delete_consumer(self._stream, name)

    async def _check_loop(self, every_s: float) -> None:
        """Re-create the consumer when it is gone, or when the server delivered messages
        that did not arrive here and nothing came since (a loss at the tail)."""
        behind_at: int | None = None
        while not self._closed and not self._nc.is_closed:
            await asyncio.sleep(every_s)
            if self._recovering is not None and not self._recovering.done():
                continue
            try:
                info = await self.consumer_info()
            except nats.js.errors.NotFoundError:
                log.info("consumer %s on %s is gone; re-creating it", self._consumer, self._stream)
                self._recover_soon()
                behind_at = None
                continue
            except Exception:
                continue  # an outage: check again later
            delivered = info.delivered.consumer_seq if info.delivered else 0
            if delivered > self._cseq:
                if behind_at == self._cseq:  # no progress over a whole period
                    self.gaps += 1
                    self._gen += 1
                    self._recover_soon()
                    behind_at = None
                else:
                    behind_at = self._cseq
            else:
                behind_at = None

    # -- the subscription interface hookbus uses -----------------------------------------
    async def consumer_info(self) -> Any:
        """The consumer's info (raises nats-py's NotFoundError when it is gone)."""
        return await self._js._jsm.consumer_info(self._stream, self._consumer)

    async def unsubscribe(self) -> None:
        """Stop delivering and delete the consumer (frees the slot). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in (self._recovering, self._checker):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._drop()

    release = unsubscribe


async def open_consumer(
    js: Any,
    stream: str,
    subject: str,
    *,
    cb: Callable[[Msg], Awaitable[None]],
    config: ConsumerConfig | None = None,
    ordered: bool = False,
    recover: bool = True,
    check_s: float | None = None,
    inactive_threshold_s: float | None = None,
) -> Any:
    """A push consumer on `stream` filtered to `subject`, delivering to `cb`; release it
    with ``await sub.unsubscribe()`` then delete it (`release_consumer` does both).

    On a connection with an identity: a `SlotConsumer` (see the module docstring);
    `config` gives the deliver policy, start, ``headers_only``; `recover` re-creates it
    from where it was on a gap (else the gap is only counted in ``gaps``); `check_s`
    checks it that often. Without one: as before, nats-py's ordered consumer when
    `ordered`, else a randomly named consumer.

    Args:
        inactive_threshold_s: seconds the server keeps the consumer with nobody listening
            (5 minutes by default; a slot consumer's is at most `SLOT_INACTIVE_S`).
    Raises:
        ConsumerSlotsExhaustedError: every slot is taken and the server refused another.
        nats-py errors of the create request (a timeout, a refused permission, no stream).
    """
    config = config or ConsumerConfig()
    public_key = identity_key(js._nc)
    if public_key is not None:
        config = dataclasses.replace(config)
        config.inactive_threshold = min(inactive_threshold_s or SLOT_INACTIVE_S, SLOT_INACTIVE_S)
        consumer = SlotConsumer(
            js, stream, subject, config, cb,
            public_key=public_key, recover=recover, check_s=check_s,
        )  # fmt: skip
        await consumer._open()
        if check_s:
            consumer._checker = asyncio.get_running_loop().create_task(
                consumer._check_loop(check_s)
            )
        return consumer
    common: dict[str, Any] = {
        "stream": stream,
        "cb": cb,
        "inactive_threshold": inactive_threshold_s or 300.0,
        "pending_msgs_limit": -1,
        "pending_bytes_limit": -1,
    }
    if ordered:
        return await js.subscribe(subject, ordered_consumer=True, config=config, **common)
    config.name = js._nc._nuid.next().decode()
    config.ack_policy, config.max_deliver = AckPolicy.NONE, 1
    config.mem_storage, config.num_replicas = True, 1
    return await js.subscribe(subject, config=config, manual_ack=True, **common)


class KeyWatch:
    """A watch of a bucket's keys (made by `watch_keys`), read like nats-py's ``KeyWatcher``:
    `updates` returns the next `KeyValue.Entry`, or None once after the values present at
    the start (at once when there are none); ``_sub`` is the consumer."""

    def __init__(self, kv: KeyValue, *, ignore_deletes: bool) -> None:
        self._kv = kv
        self._ignore_deletes = ignore_deletes
        self._updates: asyncio.Queue[KeyValue.Entry | None] = asyncio.Queue()
        self._init_done = False
        self._sub: Any = None

    async def _on_msg(self, msg: Msg) -> None:
        kv: Any = self._kv
        seqs = _ack_tokens(msg.reply or "")
        sseq, pending = (seqs[0], seqs[2]) if seqs else (0, 0)
        headers = msg.headers or {}
        op = headers.get(KV_OP)
        if op is None and _MARKER_REASON in headers:
            op = KV_DEL if headers[_MARKER_REASON] == "Remove" else KV_PURGE
        if not (self._ignore_deletes and op in (KV_DEL, KV_PURGE)):
            entry = KeyValue.Entry(
                bucket=kv._name, key=msg.subject[len(kv._pre) :], value=msg.data,
                revision=sseq, delta=pending, created=None, operation=op,
            )  # fmt: skip
            self._updates.put_nowait(entry)
        if pending == 0 and not self._init_done:
            self._init_done = True
            self._updates.put_nowait(None)

    async def updates(self, timeout: float = 5.0) -> KeyValue.Entry | None:
        """The next entry (None: the initial values are done).

        Raises:
            nats.errors.TimeoutError: nothing within `timeout` seconds.
        """
        try:
            async with asyncio.timeout(timeout):
                return await self._updates.get()
        except TimeoutError:
            raise nats.errors.TimeoutError from None

    async def stop(self) -> None:
        """Release the consumer (idempotent)."""
        if self._sub is not None:
            await self._sub.unsubscribe()


async def watch_keys(
    kv: KeyValue,
    keys: str = ">",
    *,
    include_history: bool = False,
    ignore_deletes: bool = False,
    meta_only: bool = False,
    check_s: float | None = None,
) -> Any:
    """``kv.watch(keys, ...)``: a `KeyWatch` on a slot consumer when the connection has an
    identity, on nats-py's ordered consumer otherwise. It answers ``updates(timeout)`` and
    holds its consumer in ``_sub`` (`release_consumer`).

    The end of the values present at the start (the None) is decided by the server's
    counts, never by what this client has received so far: nats-py's own ``kv.watch``
    reads "nothing received and nothing pending" as an empty bucket, and the server may
    answer the consumer info after delivering the only value but before it arrives here,
    so about 1 listing in 200 of a one-key bucket came back empty.

    Raises:
        ConsumerSlotsExhaustedError: every slot is taken and the server refused another.
    """
    kvx: Any = kv
    watch = KeyWatch(kv, ignore_deletes=ignore_deletes)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL if include_history else DeliverPolicy.LAST_PER_SUBJECT,
        headers_only=meta_only or None,
    )
    watch._sub = await open_consumer(
        kvx._js, kvx._stream, f"{kvx._pre}{keys}", cb=watch._on_msg, config=config,
        ordered=True, check_s=check_s,
    )  # fmt: skip
    try:
        info = await watch._sub.consumer_info()
    except BaseException:
        await watch._sub.unsubscribe()
        raise
    delivered = info.delivered.consumer_seq if info.delivered else 0
    if info.num_pending == 0 and not delivered and not watch._init_done:
        watch._init_done = True  # the server has nothing for it: an empty start
        watch._updates.put_nowait(None)
    return watch
