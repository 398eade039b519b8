"""Suspension records under faults that reach past one write: a write whose ack was lost
while its record went on to be consumed and removed, and the shared watch that must
outlive its own errors, a lost consumer and a nats-server restart.

- Lost acks: the resolver's real KV client stores a write, then, before the call returns,
  the test lets other processes act on the record (consume it, clean it up, start a new
  hook on the label), and only then raises nats-py's ``TimeoutError``: what a lost
  JetStream ack looks like to the writer, with the world moving on before it looks again.
  The resolution must never be stored a second time.
- The shared watch: a last waiter that leaves while the watch checks its consumer (the
  check's request held back by a TCP proxy, `tests/_proxy.py`), an unexpected error in the
  watch, its consumer deleted on the server, and a nats-server process killed and restarted
  on the same port and data: each time a waiter resolved afterwards still wakes promptly.

Against real nats-servers (the session's, or a private one where it is restarted).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest
from _payloads import Grant
from _proxy import NatsProxy
from conftest import Connect, reconnecting
from nats.aio.client import Client as NATS

from hookbus._core.kv import is_transient
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import Suspensions
from hookbus.dispatcher._reconcile import ReadBehind, judge
from hookbus.schemas import SUSPENSIONS_BUCKET, SuspensionRecord, SuspensionTimeoutError, encode

pytestmark = pytest.mark.anyio

Act = Callable[[], Awaitable[None]]
STREAM = f"KV_{SUSPENSIONS_BUCKET}"


@pytest.fixture
def label() -> str:
    return f"records:{uuid.uuid4().hex[:12]} ✓"


@pytest.fixture
async def pair(connect: Connect) -> AsyncIterator[tuple[Suspensions, Suspensions]]:
    """A waiter process and a resolver process, each a `Suspensions` on its own connection."""
    stores = [await Suspensions.open(await connect()) for _ in range(2)]
    try:
        yield stores[0], stores[1]
    finally:
        for store in stores:
            await store.close()


async def until(check: Callable[[], object], timeout_s: float = 10) -> None:
    with anyio.fail_after(timeout_s):
        while not check():  # noqa: ASYNC110  (states of other tasks, no event to wait on)
            await anyio.sleep(0.005)


async def pending(store: Suspensions, label: str) -> None:
    """Wait until `label`'s record is pending."""
    with anyio.fail_after(10):
        while (got := await store.get(label)) is None or got[0].status != "pending":  # noqa: ASYNC110
            await anyio.sleep(0.01)


# -- a lost ack, then the record moves on --------------------------------------------------
class LateAck:
    """The resolver's real KV client, except that its next write (``create`` or
    ``update``) is stored, then `meanwhile` runs (other processes act on the record), and
    then the call raises ``nats.errors.TimeoutError``: its ack was lost. With ``store``
    False the write never reaches the server (a lost request) and nothing runs meanwhile."""

    def __init__(self, kv: Any, meanwhile: Act | None = None, *, store: bool = True) -> None:
        self._kv = kv
        self._meanwhile = meanwhile
        self._store = store
        self.lost: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def _late(self, op: str, *args: Any, **kwargs: Any) -> Any:
        if self.lost:
            return await getattr(self._kv, op)(*args, **kwargs)
        self.lost.append(op)
        if self._store:
            await getattr(self._kv, op)(*args, **kwargs)  # really stored
        if self._meanwhile is not None:
            await self._meanwhile()
        raise nats.errors.TimeoutError

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        return await self._late("create", *args, **kwargs)

    async def update(self, *args: Any, **kwargs: Any) -> Any:
        return await self._late("update", *args, **kwargs)


def late_ack(store: Suspensions, meanwhile: Act | None = None, *, stored: bool = True) -> LateAck:
    wrapped = LateAck(store.records.kv, meanwhile, store=stored)
    store.records.kv = wrapped  # type: ignore[assignment]
    return wrapped


async def consumed_in_a_run(waiter: Suspensions, label: str) -> Grant:
    """A run of `waiter` takes `label`'s resolution; its exit removes the consumed record."""
    async with waiter.run(f"run-{uuid.uuid4().hex}"):
        got = await waiter.hook(label, payload=Grant, timeout_s=10)
    assert await waiter.get(label) is None, "the run's exit removed the consumed record"
    return got


async def nobody_answers(waiter: Suspensions, label: str) -> None:
    """A later run's hook on `label` waits: no resolution is stored for it."""
    async with waiter.run(f"run-{uuid.uuid4().hex}"):
        with pytest.raises(SuspensionTimeoutError):
            await waiter.hook(label, payload=Grant, timeout_s=1.5)


async def used_before(waiter: Suspensions, resolver: Suspensions, label: str) -> None:
    """Leave a delete marker on `label`: an earlier run resolved and cleaned it up."""
    await resolver.resolve_hook(label, Grant(approved=False, by="an earlier run"))
    assert await consumed_in_a_run(waiter, label) == Grant(approved=False, by="an earlier run")


@pytest.mark.parametrize("reused", [False, True], ids=["fresh-label", "reused-label"])
async def test_a_preregistered_resolution_consumed_and_removed_before_its_ack_is_not_stored_again(
    pair: tuple[Suspensions, Suspensions], label: str, reused: bool
) -> None:
    waiter, resolver = pair
    if reused:
        await used_before(waiter, resolver, label)
    taken: list[Grant] = []

    async def meanwhile() -> None:
        taken.append(await consumed_in_a_run(waiter, label))

    lossy = late_ack(resolver, meanwhile)
    await resolver.resolve_hook(label, Grant(approved=True, by="once"))  # it was stored
    assert lossy.lost and taken == [Grant(approved=True, by="once")]
    assert await resolver.get(label) is None, "the consumed resolution was written again"
    await nobody_answers(waiter, label)


async def test_a_lost_ack_does_not_resolve_the_next_runs_hook_on_the_label(
    pair: tuple[Suspensions, Suspensions], label: str
) -> None:
    """The resolution was consumed and removed, and a new run already waits on the label
    when the resolver looks again: that new hook is not the one it answered."""
    waiter, resolver = pair
    later: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def next_run() -> None:
            async with waiter.run(f"run-{uuid.uuid4().hex}"):
                try:
                    later.append(await waiter.hook(label, payload=Grant, timeout_s=2))
                except SuspensionTimeoutError as exc:
                    later.append(exc)

        async def meanwhile() -> None:
            await consumed_in_a_run(waiter, label)
            tg.start_soon(next_run)
            await pending(resolver, label)

        late_ack(resolver, meanwhile)
        await resolver.resolve_hook(label, Grant(approved=True, by="the first run only"))
    assert [type(x) for x in later] == [SuspensionTimeoutError]


async def test_a_lost_ack_on_resolve_then_consumed_and_removed_is_not_preregistered(
    pair: tuple[Suspensions, Suspensions], label: str
) -> None:
    """The same for a resolution of a waiting hook (a compare-and-set, not a create)."""
    waiter, resolver = pair
    events = await resolver.events()
    taken: list[Grant] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            taken.append(await consumed_in_a_run(waiter, label))

        tg.start_soon(run)
        with anyio.fail_after(10):
            async for event in events:
                if event.hook.label == label and event.hook.status == "pending":
                    break

        async def meanwhile() -> None:
            await until(lambda: taken)

        late_ack(resolver, meanwhile)
        await resolver.resolve_hook(label, Grant(approved=True, by="the waiting run"))
    await events.aclose()
    assert taken == [Grant(approved=True, by="the waiting run")]
    assert await resolver.get(label) is None, "the answer was stored again, pre-registered"
    await nobody_answers(waiter, label)


@pytest.mark.parametrize("reused", [False, True], ids=["fresh-label", "reused-label"])
async def test_a_lost_request_is_still_sent_again_and_stored_once(
    pair: tuple[Suspensions, Suspensions], label: str, reused: bool
) -> None:
    """The other side: a write that never reached the server is sent again (not taken
    for one that landed and was removed)."""
    waiter, resolver = pair
    if reused:
        await used_before(waiter, resolver, label)
    lossy = late_ack(resolver, stored=False)
    await resolver.resolve_hook(label, Grant(approved=True, by="sent twice, stored once"))
    assert lossy.lost
    got = await resolver.get(label)
    assert got is not None and got[0].preregistered and not got[0].consumed
    assert await consumed_in_a_run(waiter, label) == Grant(
        approved=True, by="sent twice, stored once"
    )
    await nobody_answers(waiter, label)


# -- the shared watch ----------------------------------------------------------------------
CONSUMER_INFO = b"PUB $JS.API.CONSUMER.INFO."


def watch_consumer(store: Suspensions) -> str | None:
    """The name of the JetStream consumer of `store`'s shared watch (None: unsubscribed)."""
    sub = store.watch._sub
    return None if sub is None else sub._consumer


async def lose_the_watch_consumer(store: Suspensions, js_nc: NATS) -> str:
    """Delete the shared watch's consumer on the server (what a lost server does to it);
    returns its name."""
    name = watch_consumer(store)
    assert name, "the watch is subscribed"
    await js_nc.jetstream().delete_consumer(STREAM, name)
    return name


async def resolved_and_woken(
    waiter: Suspensions,
    resolver: Suspensions,
    label: str,
    *,
    within_s: float,
    meanwhile: Act | None = None,
) -> float:
    """Start a hook on `label` in `waiter`; once it is pending run `meanwhile` (a fault),
    resolve it from `resolver`, and return the seconds from the resolve to the hook's
    return (failing past `within_s`)."""
    got: list[Grant] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            got.append(await waiter.hook(label, payload=Grant, timeout_s=within_s + 30))

        tg.start_soon(wait)
        await pending(resolver, label)
        if meanwhile is not None:
            await meanwhile()
        await resolver.resolve_hook(label, Grant(approved=True, by="wakes"))
        start = time.monotonic()
        await until(lambda: got, timeout_s=within_s)
        took = time.monotonic() - start
    assert got == [Grant(approved=True, by="wakes")]
    return took


async def test_the_watch_survives_its_last_waiter_leaving_during_its_consumer_check(
    nats_url: str, connect: Connect, label: str
) -> None:
    """The watch checks its consumer; a proxy holds that request back while the only
    waiter leaves (its run cancelled from outside: nothing to write on the way out). The
    watch must go on: a later waiter whose resolution the watch's lost consumer misses is
    still woken."""
    async with NatsProxy(nats_url) as proxy:
        direct, proxied = await connect(), await nats.connect(proxy.url)
        waiter = await Suspensions.open(proxied, poll_s=0.05)
        resolver = await Suspensions.open(direct)
        waiter.watch._check_s = 0.2
        try:
            leaving = anyio.CancelScope()
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    with leaving:
                        async with waiter.run(f"run-{uuid.uuid4().hex}"):
                            await waiter.hook(label, payload=Grant)

                tg.start_soon(run)
                await pending(resolver, label)
                seen = len(proxy.client_ops)
                proxy.hold_next_client_op(CONSUMER_INFO, 1.0)
                await until(
                    lambda: any(op.startswith(CONSUMER_INFO) for op in proxy.client_ops[seen:])
                )
                leaving.cancel()  # the check is in flight: its answer comes 1 s late
                await until(lambda: not waiter.watch._slots)
            await anyio.sleep(0.3)  # the held check has returned, the loop went on

            async def lose() -> None:
                await lose_the_watch_consumer(waiter, direct)

            await resolved_and_woken(waiter, resolver, label + " next", within_s=5, meanwhile=lose)
        finally:
            await waiter.close()
            await resolver.close()
            await proxied.close()


async def test_an_unexpected_error_in_the_watch_is_logged_and_the_watch_restarts(
    connect: Connect, label: str, caplog: pytest.LogCaptureFixture
) -> None:
    direct = await connect()
    waiter = await Suspensions.open(await connect(), poll_s=0.05)
    resolver = await Suspensions.open(direct)
    waiter.watch._check_s = 0.05
    real_check = waiter.watch._check
    failed = asyncio.Event()

    async def check_once_broken() -> None:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("a bug in the watch")
        await real_check()

    waiter.watch._check = check_once_broken  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.INFO, logger="hookbus.dispatcher"):

            async def broken_then_lost() -> None:
                with anyio.fail_after(5):
                    await failed.wait()
                await lose_the_watch_consumer(waiter, direct)

            await resolved_and_woken(
                waiter, resolver, label, within_s=5, meanwhile=broken_then_lost
            )
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("a bug in the watch" in str(r.exc_info and r.exc_info[1]) for r in errors)
        assert any("restart" in r.getMessage() for r in errors)
    finally:
        await waiter.close()
        await resolver.close()


async def test_a_lost_watch_consumer_is_recreated(connect: Connect, label: str) -> None:
    """The backing reads are a minute apart: only the watch, re-created after its consumer
    was deleted on the server (and its sweep), can wake the waiter in time."""
    direct = await connect()
    waiter = await Suspensions.open(await connect(), poll_s=60.0)
    resolver = await Suspensions.open(direct)
    waiter.watch._check_s = 0.2
    lost: list[str] = []
    try:

        async def lose() -> None:
            lost.append(await lose_the_watch_consumer(waiter, direct))

        await resolved_and_woken(waiter, resolver, label, within_s=5, meanwhile=lose)
        assert watch_consumer(waiter) not in (None, *lost)
        await direct.jetstream().consumer_info(STREAM, watch_consumer(waiter))
    finally:
        await waiter.close()
        await resolver.close()


@pytest.mark.faults
async def test_a_waiter_resolved_after_a_nats_server_restart_wakes_promptly(
    embedded_server: EmbeddedNatsServer, label: str
) -> None:
    """The server is killed and restarted (same port and data): the watch's consumer is
    gone. The backing reads are a minute apart, so the waiter wakes in time only through
    the watch, re-created once the server is back."""
    port = int(embedded_server.url.rpartition(":")[2])

    nc = await reconnecting(embedded_server.url)
    restarted: EmbeddedNatsServer | None = None
    waiter = await Suspensions.open(nc, poll_s=60.0)
    waiter.watch._check_s = 0.5
    try:

        async def restart() -> None:
            nonlocal restarted
            embedded_server.kill()  # keeps its data folder
            restarted = EmbeddedNatsServer(embedded_server.data_dir, port=port)
            restarted.start()

        got: list[Grant] = []
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                got.append(await waiter.hook(label, payload=Grant, timeout_s=40))

            tg.start_soon(wait)
            await pending(waiter, label)
            await restart()
            assert restarted is not None
            nc2 = await nats.connect(restarted.url)
            resolver = await Suspensions.open(nc2)
            try:
                await resolver.resolve_hook(label, Grant(approved=True, by="after restart"))
                await until(lambda: got, timeout_s=8)
            finally:
                await resolver.close()
                await nc2.close()
        assert got == [Grant(approved=True, by="after restart")]
    finally:
        await waiter.close()
        await nc.close()
        if restarted is not None:
            restarted.stop()


def test_a_probe_that_reads_the_key_older_than_the_write_judges_nothing() -> None:
    """After a write's unknown outcome, the probe reads the key. A message older than the
    version the write replaced can only come from a reader behind the stream's leader (a
    direct get an agent makes on a secured server, answered by a replica that lags): it says
    nothing of what happened since, so the probe is made again (a transient error). Before, a
    delete marker there was taken for a delete after the write's revision, and a resolve or
    cancel that never landed was reported stored."""
    with pytest.raises(ReadBehind) as behind:
        judge((b"", 3, "DEL"), "w1", last=5)
    assert is_transient(behind.value)
    with pytest.raises(ReadBehind):
        judge((b'{"write_id": "w0"}', 4, None), "w1", last=5)
    assert judge((b"", 7, "DEL"), "w1", last=5) == ("deleted", 0)
    assert judge((b'{"write_id": "w0"}', 5, None), "w1", last=5) == ("unchanged", 0)
    assert judge((b'{"write_id": "w1"}', 6, None), "w1", last=5) == ("ours", 6)


async def test_a_create_whose_key_is_gone_when_it_looks_again_lost_a_race(
    pair: tuple[Suspensions, Suspensions], label: str
) -> None:
    """nats-py's `create`, refused because the key holds a record, reads the key again to
    see whether it was only a delete marker; here the key's messages are purged from the
    stream in between (what a bucket's max age does to an old record). The create lost a
    race: the store says so (None), as for any lost compare-and-set. Before, nats-py's own
    `KeyNotFoundError` came out of the store raw."""
    store, _ = pair
    records = store.records
    key = records.key(label)
    subject = f"$KV.{SUSPENSIONS_BUCKET}.{key}"
    kv = records.kv
    await kv.put(key, encode(SuspensionRecord(label=label, status="pending")))

    class PurgedBeforeItLooks(type(kv)):  # type: ignore[misc]
        async def _get(self, key: str, revision: int | None = None) -> Any:
            await self._js.purge_stream(STREAM, subject=subject)
            return await super()._get(key, revision)

    kv.__class__ = PurgedBeforeItLooks
    try:
        assert await records.create(SuspensionRecord(label=label, status="pending")) is None
    finally:
        kv.__class__ = PurgedBeforeItLooks.__mro__[1]


class BehindOnce(LateAck):
    """`LateAck` (the next write's request is lost), whose first read after the loss is
    answered as a replica behind the leader would: with `older`, the answer the key got
    when it was read earlier (the bucket keeps one message per key, so the leader no
    longer has it; a replica that lags still does)."""

    def __init__(self, kv: Any, older: BaseException) -> None:
        super().__init__(kv, store=False)
        self._older = older
        self.stale_reads = 0

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if self.lost and not self.stale_reads:
            self.stale_reads += 1
            raise self._older
        return await self._kv.get(key, *args, **kwargs)

    async def delete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._late("delete", *args, **kwargs)


async def test_a_resolve_whose_probe_reads_an_older_delete_marker_is_sent_again(
    pair: tuple[Suspensions, Suspensions], label: str
) -> None:
    """A label used by an earlier run (a delete marker), now pending again; the resolve's
    request is lost, and the probe that follows reads the key as a replica behind the leader
    has it: the old delete marker. That says nothing about the resolve (the key was written
    after the marker): the probe is made again, finds the pending record unchanged, and
    sends the resolve again, which wakes the waiter. Before, the old marker counted as a
    delete after the resolve, the resolve as landed, and the waiter was never woken."""
    waiter, resolver = pair
    await used_before(waiter, resolver, label)
    key = resolver.records.key(label)
    with pytest.raises(nats.js.errors.KeyNotFoundError) as marker:
        await resolver.records.kv.get(key)
    assert marker.value.entry is not None  # type: ignore[attr-defined]
    got: list[Grant] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            async with waiter.run(f"run-{uuid.uuid4().hex}"):
                got.append(await waiter.hook(label, payload=Grant, timeout_s=10))

        tg.start_soon(wait)
        await pending(resolver, label)
        behind = BehindOnce(resolver.records.kv, marker.value)
        resolver.records.kv = behind  # type: ignore[assignment]
        await resolver.resolve_hook(label, Grant(approved=True, by="sent again"))
        assert behind.lost and behind.stale_reads == 1
    assert got == [Grant(approved=True, by="sent again")]


async def test_a_delete_whose_probe_reads_an_older_delete_marker_is_sent_again(
    pair: tuple[Suspensions, Suspensions], label: str
) -> None:
    """The same for a delete (a run's cleanup of its record): its request lost, its probe
    reading the old delete marker of an earlier run, it is sent again and the record is
    gone. Before, the old marker counted as the delete done, and the record stayed."""
    waiter, resolver = pair
    await used_before(waiter, resolver, label)
    records = resolver.records
    key = records.key(label)
    with pytest.raises(nats.js.errors.KeyNotFoundError) as marker:
        await records.kv.get(key)
    await resolver.resolve_hook(label, Grant(approved=True, by="left for a later run"))
    entry = await records.latest(label)
    assert entry is not None
    behind = BehindOnce(records.kv, marker.value)
    records.kv = behind  # type: ignore[assignment]
    assert await records.delete(label, last=entry.revision)
    assert behind.lost and behind.stale_reads == 1
    records.kv = behind._kv
    assert await resolver.get(label) is None, "the record is gone"
