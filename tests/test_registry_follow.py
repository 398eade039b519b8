"""Following the handler registry with no JetStream consumer per dispatcher, against a real
nats-server: a fleet is not bounded by a stream's consumer limit, and a dispatcher that
missed a change of the registry never decides with it before it has caught up.

Changes are lost for real: a TCP proxy between the dispatcher and its server drops the
republished change (what a server does to a slow client, or a cut connection loses).
The registry's records are written straight into the bucket; a declared handler nobody
serves fails its emit by its failure policy, so ``failure_policy="deny"`` makes a
declaration that denies every emit of its event.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import nats
import pytest
from _declarations import declaration
from _proxy import Delivered, NatsProxy
from nats.js.api import DiscardPolicy, StreamConfig
from nats.js.kv import KeyValue

from hookbus._core.buckets import handlers_bucket_config, handlers_republish
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HANDLERS_BUCKET,
    REGISTRY_CHANGES_WILDCARD,
    HandlerDeclaration,
    encode,
    handler_key,
)

pytestmark = pytest.mark.anyio

STREAM = f"KV_{HANDLERS_BUCKET}"


def guard(event: str, name: str) -> HandlerDeclaration:
    """A declaration nobody serves, failing closed: every emit of `event` is denied."""
    return declaration(event, name, failure_policy="deny", timeout_s=0.5)


async def declare(kv: KeyValue, event: str, name: str = "guard") -> None:
    await kv.put(handler_key(event, name), encode(guard(event, name)))


def registry_change(msg: Delivered) -> bool:
    return msg.subject.startswith(REGISTRY_CHANGES_WILDCARD[:-1])


async def lose_declaration(proxy: NatsProxy, kv: KeyValue, event: str) -> None:
    """Declare a guard for `event` whose republished change the proxy drops."""
    proxy.drop_next(1, registry_change)
    await declare(kv, event)
    with anyio.fail_after(10):
        while not proxy.dropped:  # noqa: ASYNC110  (the proxy has no drop event)
            await anyio.sleep(0.02)


async def decides(d: HookDispatcher, event: str, action: str, within_s: float) -> float:
    """Emit `event` until it is decided `action`; returns the seconds it took."""
    start = anyio.current_time()
    with anyio.fail_after(within_s):
        while True:
            result = await d.emit(event, {"command": "rm -rf /"}, timeout_s=2.0)
            if result.action == action:
                break
            await anyio.sleep(0.05)  # the routing table has no change event to wait on
    return anyio.current_time() - start


@pytest.fixture
async def server(embedded_server: Any) -> Any:
    """A private server whose handlers bucket republishes its changes (as hookbus makes it)."""
    admin = await nats.connect(embedded_server.url)
    try:
        kv = await admin.jetstream().create_key_value(config=handlers_bucket_config())
        yield embedded_server.url, admin, kv
    finally:
        await admin.close()


async def test_a_fleet_is_not_bounded_by_the_streams_consumer_limit(embedded_server: Any) -> None:
    """The handlers stream takes one consumer (a server at its consumer limit). Twelve
    dispatchers start, none holds a consumer, and each denies as the registry says once a
    guard is declared after they started."""
    kv_config = handlers_bucket_config()
    admin = await nats.connect(embedded_server.url)
    conns = [admin]
    try:
        await admin.jetstream().add_stream(
            StreamConfig(
                name=STREAM, subjects=[f"$KV.{HANDLERS_BUCKET}.>"],
                max_msgs_per_subject=kv_config.history, discard=DiscardPolicy.NEW,
                allow_rollup_hdrs=True, deny_delete=True, allow_direct=True, max_consumers=1,
                republish=handlers_republish(),
            )
        )  # fmt: skip
        kv = await admin.jetstream().key_value(HANDLERS_BUCKET)
        event = f"test:{uuid.uuid4().hex[:10]}"
        dispatchers = []
        for _ in range(12):
            conns.append(await nats.connect(embedded_server.url))
            d = HookDispatcher(conns[-1])
            await d.start()
            dispatchers.append(d)
        info = await admin.jetstream().stream_info(STREAM)
        assert info.state.consumer_count == 0
        await declare(kv, event)
        for d in dispatchers:
            await decides(d, event, "deny", within_s=10)
        for d in dispatchers:
            await d.close()
    finally:
        for conn in conns:
            await conn.close()


async def test_a_lost_change_is_found_by_the_next_one(server: Any) -> None:
    """The change declaring a guard never reaches the dispatcher; the next change (another
    event's) reveals the gap, and the dispatcher re-reads the registry: it denies."""
    url, _, kv = server
    event, other = (f"test:{uuid.uuid4().hex[:10]}" for _ in range(2))
    async with NatsProxy(url) as proxy:
        nc = await nats.connect(proxy.url)
        d = HookDispatcher(nc)  # the periodic check is 30 s away: only the gap can tell
        try:
            await d.start()
            await lose_declaration(proxy, kv, event)
            assert (await d.emit(event, {})).action == "continue"  # it cannot know yet
            await declare(kv, other)
            await decides(d, event, "deny", within_s=10)
            assert d._router._watch.gaps >= 1  # type: ignore[union-attr]
        finally:
            await d.close()
            await nc.close()


@pytest.mark.parametrize("others", [0, 2], ids=["alone", "beside-stopped-dispatchers"])
async def test_a_change_lost_at_the_tail_is_found_by_the_check(server: Any, others: int) -> None:
    """The last change is lost and nothing follows it: the periodic check of the stream's
    last sequence finds it. The followers of one event loop share one timer: `others`
    dispatchers started before and after this one and stopped leave its check ticking."""
    url, _, kv = server
    event = f"test:{uuid.uuid4().hex[:10]}"
    async with NatsProxy(url) as proxy:
        conns = [await nats.connect(url) for _ in range(others)]
        around = [HookDispatcher(conn, resync_s=600.0) for conn in conns]
        nc = await nats.connect(proxy.url)
        d = HookDispatcher(nc, resync_s=1.0)
        try:
            for other in around[:1]:
                await other.start()
            await d.start()
            for other in around[1:]:
                await other.start()
            for other in around:
                await other.close()
            proxy.drop_next(1, registry_change)
            await declare(kv, event)
            await decides(d, event, "deny", within_s=15)
            assert proxy.dropped
        finally:
            await d.close()
            for conn in [*conns, nc]:
                await conn.close()


async def test_a_change_made_while_disconnected_is_applied_on_reconnect(server: Any) -> None:
    """The change is lost and the connection cut (as a server lost and found again): the
    reconnect alone makes the dispatcher re-read, long before its periodic check."""
    url, _, kv = server
    event = f"test:{uuid.uuid4().hex[:10]}"
    async with NatsProxy(url) as proxy:
        nc = await nats.connect(proxy.url, reconnect_time_wait=0.2)
        d = HookDispatcher(nc, resync_s=600.0)
        try:
            await d.start()
            await lose_declaration(proxy, kv, event)
            proxy.cut()
            await decides(d, event, "deny", within_s=15)
        finally:
            await d.close()
            await nc.close()


async def test_a_dispatcher_that_lost_the_registrys_stream_fails_closed(server: Any) -> None:
    """The registry's stream is deleted: the dispatcher cannot know what is declared, so
    it denies every emit (an event with no handler too) until the stream is back, then
    decides as the new registry says."""
    url, admin, kv = server
    event, bare = (f"test:{uuid.uuid4().hex[:10]}" for _ in range(2))
    nc = await nats.connect(url)
    d = HookDispatcher(nc, resync_s=1.0)
    try:
        await d.start()
        assert (await d.emit(bare, {})).action == "continue"
        await admin.jetstream().delete_stream(STREAM)
        await decides(d, bare, "deny", within_s=15)
        result = await d.emit(event, {}, timeout_s=0.5)
        assert result.action == "deny" and "registry is not followed" in (result.reason or "")
        kv = await admin.jetstream().create_key_value(config=handlers_bucket_config())
        await decides(d, bare, "continue", within_s=15)
        await declare(kv, event)
        await decides(d, event, "deny", within_s=10)
    finally:
        await d.close()
        await nc.close()


async def test_a_start_that_may_not_follow_the_registry_raises(server: Any) -> None:
    """A dispatcher whose snapshot cannot be read does not start: here the stream is gone
    (nothing answers its direct gets)."""
    from hookbus.schemas import HookbusError

    url, admin, _ = server
    conn = await nats.connect(url)
    try:
        from hookbus.dispatcher._registry_follow import RegistryFollower
        from hookbus.dispatcher._route_table import RoutingTable

        kv = await conn.jetstream().key_value(HANDLERS_BUCKET)
        await admin.jetstream().delete_stream(STREAM)
        follower = RegistryFollower(kv, RoutingTable())
        with pytest.raises(HookbusError):
            await follower.start(deadline_s=2.0)
        assert follower._sub is None
    finally:
        await conn.close()


async def test_refreshes_racing_changes_lose_none(server: Any) -> None:
    """Re-reads of the registry asked for while changes arrive (a caller's `refresh` beside
    the follower's own) never undo a change applied meanwhile."""
    url, _, kv = server
    events = [f"test:{uuid.uuid4().hex[:10]}" for _ in range(60)]
    nc = await nats.connect(url)
    d = HookDispatcher(nc, resync_s=600.0)
    try:
        await d.start()

        async def refreshes() -> None:
            for _ in range(30):
                await d.refresh()

        async def changes() -> None:
            for event in events:
                await declare(kv, event)

        async with anyio.create_task_group() as tg:
            tg.start_soon(refreshes)
            tg.start_soon(refreshes)
            tg.start_soon(changes)
        with anyio.fail_after(10):
            while missing := [e for e in events if not d.routes(e)]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert not missing
    finally:
        await d.close()
        await nc.close()


async def test_a_direct_get_nobody_answers_while_the_stream_is_there_is_retried(
    server: Any,
) -> None:
    """Nothing answering a direct get of a stream that is there with direct gets on is a
    moment (a fresh replicated stream's replicas subscribe to the direct get subject just
    after it is created: a dispatcher started then was refused once on a 3-node cluster):
    no responders, which `kv_retry` tries again. A stream without direct gets, or one gone,
    is an error at once."""
    import nats.errors

    from hookbus._core.jetstream import is_transient
    from hookbus.dispatcher._registry_follow import _why_no_direct_get
    from hookbus.schemas import HookbusError

    _, admin, kv = server
    why = await _why_no_direct_get(kv, "$JS.API.DIRECT.GET.x")
    assert isinstance(why, nats.errors.NoRespondersError) and is_transient(why)
    js = admin.jetstream()
    info = await js.stream_info(STREAM)
    info.config.allow_direct = False
    await js.update_stream(info.config)
    why = await _why_no_direct_get(kv, "$JS.API.DIRECT.GET.x")
    assert isinstance(why, HookbusError) and "no direct get" in str(why)
    await js.delete_stream(STREAM)
    why = await _why_no_direct_get(kv, "$JS.API.DIRECT.GET.x")
    assert isinstance(why, HookbusError) and "gone" in str(why)


async def test_a_change_applied_while_the_tail_check_is_answered_is_not_a_restart(
    server: Any,
) -> None:
    """The periodic check asks the stream's last sequence; a change is stored and applied
    before the answer is read (it comes on another subscription, or from a replica a
    moment behind). The answer is one below what is applied by then: that is not a stream
    that went back, and the dispatcher keeps deciding (seen on a fleet: an agent denied
    every emit for 0.7 s after such a check)."""
    url, _, kv = server
    bare, event = (f"test:{uuid.uuid4().hex[:10]}" for _ in range(2))
    nc = await nats.connect(url)
    d = HookDispatcher(nc, resync_s=600.0)
    try:
        await d.start()
        follower = d._router._watch  # type: ignore[union-attr]
        asked = follower._stream_last_seq

        async def answered_late() -> int:
            last = await asked()  # the stream's answer, then a change overtakes it
            await declare(kv, event)
            with anyio.fail_after(10):
                while not d.routes(event):  # noqa: ASYNC110  (no change event to wait on)
                    await anyio.sleep(0.02)
            return last

        follower._stream_last_seq = answered_late
        await follower._check_tail()
        assert follower.current
        assert (await d.emit(bare, {})).action == "continue"
        assert (await d.emit(event, {}, timeout_s=2.0)).action == "deny"
    finally:
        await d.close()
        await nc.close()
