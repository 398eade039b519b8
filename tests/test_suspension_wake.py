"""The wake path of a suspension: the resolver's write alone wakes the waiter.

- a resolver whose watch has seen the record writes without reading it first;
- the waiter returns on the watch's delivery, with no read and no write before it returns;
  the "consumed" mark follows in the background;
- while that mark is in flight the resolution is still consumed once: another process's
  ``hook(label)`` is refused, this process's next ``hook(label)`` waits for the mark (and
  counts a delivered resolution whose mark failed as consumed);
- a waiter that refuses a resolution leaves the record detached, for any process to take.

Against a real nats-server. The bus is observed by a spy connection that subscribes to the
record's KV subject (every write) and to its direct-get subject (every read); a few tests
hold the waiter's "consumed" mark back by wrapping its real KV client.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.abc
import nats.errors
import nats.js.errors
import pytest
from _payloads import Budget, Grant
from conftest import Connect
from nats.aio.client import Client as NATS

from hookbus._core.kv import stream_sequence
from hookbus.dispatcher import Suspensions
from hookbus.schemas import (
    SUSPENSIONS_BUCKET,
    DuplicateSuspensionError,
    HookbusError,
    ResolutionRejectedError,
    SuspensionTimeoutError,
    suspension_key,
)

pytestmark = pytest.mark.anyio


class HeldMarks:
    """The waiter's real KV client, except that a write marking a record consumed waits
    for `release` (or fails, with `fail`)."""

    def __init__(self, kv: Any, *, fail: bool = False) -> None:
        self._kv = kv
        self.fail = fail
        self.release = asyncio.Event()
        self.held = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def update(self, key: str, value: bytes, last: int | None = None) -> Any:
        if b'"consumed":true' in value:
            self.held += 1
            if self.fail:
                raise nats.js.errors.APIError(description="refused by the test", err_code=1)
            await self.release.wait()
        return await self._kv.update(key, value, last=last)


def hold_marks(store: Suspensions, *, fail: bool = False) -> HeldMarks:
    held = HeldMarks(store.records.kv, fail=fail)
    store.records.kv = held  # type: ignore[assignment]
    return held


class Spy:
    """Every write (a publish on the key's KV subject) and read (a get of the key: from the
    stream's leader, a message get naming it, or a direct get) of one record, as the server
    routes them."""

    def __init__(self, nc: NATS, key: str) -> None:
        self.nc = nc
        self.key = key
        self.writes: list[bytes] = []
        self.reads = 0

    async def open(self) -> Spy:
        kv_subject = f"$KV.{SUSPENSIONS_BUCKET}.{self.key}"
        self._writes = await self.nc.subscribe(kv_subject)
        self._reads = await self.nc.subscribe(
            f"$JS.API.DIRECT.GET.KV_{SUSPENSIONS_BUCKET}.{kv_subject}"
        )
        self._leader_reads = await self.nc.subscribe(
            f"$JS.API.STREAM.MSG.GET.KV_{SUSPENSIONS_BUCKET}"
        )
        self._kv_subject = kv_subject.encode()
        await self.nc.flush()
        return self

    async def settle(self, *conns: NATS) -> Spy:
        """Take in everything `conns` sent so far (each flushed: the server has routed it;
        then this connection's own round trip: it has arrived)."""
        for conn in conns:
            await conn.flush()
        await self.nc.flush()
        for sub in (self._writes, self._reads, self._leader_reads):
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.05)
                except nats.errors.TimeoutError:
                    break
                if sub is self._writes:
                    self.writes.append(msg.data)
                elif sub is self._reads or self._kv_subject in msg.data:
                    self.reads += 1
        return self


Three = tuple[Suspensions, Suspensions, Suspensions]


@pytest.fixture
async def conns(connect: Connect) -> list[NATS]:
    return [await connect() for _ in range(3)]


@pytest.fixture
async def three(conns: list[NATS]) -> AsyncIterator[Three]:
    """A waiter, a resolver and a third process, each a `Suspensions` on its own connection
    of `conns` (poll reads once a minute: none falls into a measured window by chance)."""
    stores = [await Suspensions.open(nc, poll_s=60.0) for nc in conns]
    try:
        yield stores[0], stores[1], stores[2]
    finally:
        for store in stores:
            await store.close()


@pytest.fixture
def label() -> str:
    return f"wake:{uuid.uuid4().hex[:12]} ✓"


async def until(check: Callable[[], object], timeout_s: float = 10) -> None:
    """Wait (at most `timeout_s` seconds) until `check()` is true."""
    with anyio.fail_after(timeout_s):
        while not check():  # noqa: ASYNC110  (states of other tasks, no event to wait on)
            await anyio.sleep(0.005)


async def watching(store: Suspensions) -> Any:
    """The store's event stream, once its watch runs (a listener keeps one)."""
    events = await store.events()
    await until(lambda: store.watch.started)
    return events


async def pending(events: Any, label: str) -> None:
    with anyio.fail_after(10):
        async for event in events:
            if event.hook.label == label and event.hook.status == "pending":
                return


async def hinted(store: Suspensions, key: str) -> None:
    """Wait until the store's watch has delivered the record of `key`."""
    await until(lambda: store.watch.recent(key) is not None)


async def test_the_resolvers_write_alone_wakes_the_waiter(
    three: Three, conns: list[NATS], connect: Connect, label: str
) -> None:
    waiter, resolver, _ = three
    key = suspension_key(label)
    spy = await Spy(await connect(), key).open()
    events = await watching(resolver)
    held = hold_marks(waiter)
    woke = asyncio.Event()
    got: list[Grant] = []

    async def wait() -> None:
        got.append(await waiter.hook(label, payload=Grant))
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await pending(events, label)
        await hinted(resolver, key)
        await spy.settle(conns[0], conns[1])
        assert len(spy.writes) == 1 and spy.reads >= 1  # the waiter's create (and its look)
        spy.writes.clear()
        spy.reads = 0

        await resolver.resolve_hook(label, Grant(approved=True, by="one write"))
        with anyio.fail_after(10):
            await woke.wait()
        await spy.settle(conns[0], conns[1])
        assert got == [Grant(approved=True, by="one write")]
        assert len(spy.writes) == 1, "the waiter returned after the resolver's write alone"
        assert b'"status":"resolved"' in spy.writes[0]
        assert spy.reads == 0, "no read: not the resolver's, not the waiter's"
        assert held.held == 1  # the "consumed" mark comes after the return

        held.release.set()
    with anyio.fail_after(10):
        while True:
            got_record = await resolver.get(label)
            if got_record is not None and got_record[0].consumed:
                break
            await anyio.sleep(0.01)
    record = got_record[0]
    assert not record.attached and record.owner == ""
    await events.aclose()


async def resolved_while_waiting(
    tg: anyio.abc.TaskGroup,
    waiter: Suspensions,
    resolver: Suspensions,
    events: Any,
    label: str,
    grant: Grant,
) -> list[Grant]:
    """`waiter` waits on `label` in a task of `tg`; once the wait is pending (on `events`),
    `resolver` resolves it with `grant`. The list the wait appends its value to."""
    got: list[Grant] = []

    async def wait() -> None:
        got.append(await waiter.hook(label, payload=Grant))

    tg.start_soon(wait)
    await pending(events, label)
    await resolver.resolve_hook(label, grant)
    return got


async def test_a_resolution_in_flight_is_consumed_once(three: Three, label: str) -> None:
    waiter, resolver, other = three
    held = hold_marks(waiter)
    events = await watching(resolver)
    async with anyio.create_task_group() as tg:
        first = await resolved_while_waiting(
            tg, waiter, resolver, events, label, Grant(approved=True, by="once")
        )
        await until(lambda: first)
        await until(lambda: held.held == 1)  # returned; its mark not stored yet

        # another process: the resolution is its live owner's
        with pytest.raises(DuplicateSuspensionError, match="being handed to it"):
            await other.hook(label, payload=Grant, timeout_s=2)

        # this process: the next hook waits for the mark, then is a new wait
        again: list[BaseException] = []

        async def wait_again() -> None:
            try:
                await waiter.hook(label, payload=Grant, timeout_s=0.5)
            except HookbusError as exc:
                again.append(exc)

        tg.start_soon(wait_again)
        await anyio.sleep(0.2)
        assert not again, "it waits for the mark in flight"
        held.release.set()
    assert [type(e) for e in again] == [SuspensionTimeoutError]
    assert first == [Grant(approved=True, by="once")]
    await events.aclose()


async def test_a_delivered_resolution_whose_mark_fails_is_not_delivered_again_here(
    three: Three, label: str
) -> None:
    waiter, resolver, _ = three
    held = hold_marks(waiter, fail=True)
    events = await watching(resolver)
    async with anyio.create_task_group() as tg:
        first = await resolved_while_waiting(
            tg, waiter, resolver, events, label, Grant(approved=True, by="once only")
        )
    assert first == [Grant(approved=True, by="once only")]
    await until(lambda: held.held >= 1)
    stored = await resolver.get(label)
    assert stored is not None and not stored[0].consumed  # the mark failed
    held.fail = False
    with pytest.raises(SuspensionTimeoutError):  # a new wait, not the same value again
        await waiter.hook(label, payload=Grant, timeout_s=0.5)
    await events.aclose()


async def test_a_refused_resolution_is_left_for_any_process(three: Three, label: str) -> None:
    """The waiter whose payload type refuses the value detaches the record: another
    process takes the replaced value (it is not refused as held by a live waiter)."""
    waiter, resolver, other = three
    events = await watching(resolver)
    errors: list[HookbusError] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            try:
                await waiter.hook(label, payload=Budget, schema={})
            except HookbusError as exc:
                errors.append(exc)

        tg.start_soon(wait)
        await pending(events, label)
        await resolver.resolve_hook(label, {"amount": -1})
    assert [type(e) for e in errors] == [ResolutionRejectedError]
    stored = await resolver.get(label)
    assert stored is not None
    assert stored[0].status == "resolved" and not stored[0].consumed
    assert not stored[0].attached
    await resolver.resolve_hook(label, Budget(amount=3), replace=True)
    assert await other.hook(label, payload=Budget, timeout_s=5) == Budget(amount=3)
    await events.aclose()


async def test_a_run_scope_waits_for_the_mark_before_cleaning_up(three: Three, label: str) -> None:
    waiter, resolver, _ = three
    events = await watching(resolver)
    async with anyio.create_task_group() as tg:

        async def answer() -> None:
            await pending(events, label)
            await resolver.resolve_hook(label, Grant(approved=True))

        tg.start_soon(answer)
        async with waiter.run("run-" + uuid.uuid4().hex):
            assert await waiter.hook(label, payload=Grant) == Grant(approved=True)
    assert await resolver.get(label) is None, "the finished run removed its consumed record"
    await events.aclose()


@pytest.mark.parametrize(
    ("reply", "sequence"),
    [
        ("$JS.ACK.KV_hookbus_suspensions.abc.1.4242.17.1700000000000000000.0", 4242),
        ("$JS.ACK.hub.ACCHASH.KV_hookbus_suspensions.abc.1.77.3.1700000000000000000.0.tok", 77),
        ("$JS.ACK.hub.ACCHASH.KV_hookbus_suspensions.abc.1.78.3.1700000000000000000.0", 78),
    ],
)
def test_the_stream_sequence_is_read_from_the_reply_subject(reply: str, sequence: int) -> None:
    """Both reply forms JetStream uses (without and with domain and account hash)."""
    assert stream_sequence(SimpleNamespace(reply=reply)) == sequence


def test_a_message_that_is_not_from_jetstream_has_no_stream_sequence() -> None:
    with pytest.raises(nats.errors.NotJSMessageError):
        stream_sequence(SimpleNamespace(reply="_INBOX.abc", _metadata=None, metadata=None))
