"""JetStream consumers are a limited resource (JetStream refuses new ones past its limit,
and then every KV watch fails): reading a bucket must not leave one behind."""

from __future__ import annotations

import asyncio

import pytest

from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.schemas import APPROVALS_BUCKET, HANDLERS_BUCKET, SUSPENSIONS_BUCKET

pytestmark = pytest.mark.anyio


async def _consumers(nc) -> int:
    js = nc.jetstream()
    total = 0
    for bucket in (HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET):
        total += (await js.stream_info(f"KV_{bucket}")).state.consumer_count
    return total


async def test_repeated_bucket_reads_leave_no_consumer_behind(nc, connect):
    js = nc.jetstream()
    handlers = f"KV_{HANDLERS_BUCKET}"
    async with HookDispatcher(await connect()) as d:
        held = (await js.stream_info(handlers)).state.consumer_count
        before = await _consumers(nc)
        for _ in range(20):
            await d.refresh()  # a complete read of the registry
            await d.suspensions.list()  # one pass over the suspensions
            await ApprovalsClient.over(d.approvals).approval_grants()  # one pass over the grants
        after = await _consumers(nc)
    assert after <= before, (before, after)
    # following the registry took no consumer (its changes are republished): none released
    assert (await js.stream_info(handlers)).state.consumer_count == held


async def test_stop_task_ends_a_task_that_swallows_a_cancel() -> None:
    """A task that swallows one cancel (as nats-py's `wait_for` can on Python 3.11) and goes
    on: cancelling it once and awaiting it would never return; `stop_task` ends it."""
    from hookbus._core.tasks import stop_task

    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # swallowed: it goes on waiting
        await asyncio.Event().wait()

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await stop_task(task, "a stubborn task")
    assert swallowed.is_set() and task.cancelled()


async def test_a_watch_never_reports_a_bucket_with_a_value_as_empty(nc) -> None:
    """The registry and grant listings end their first pass at the watch's "initial values
    done" marker. The server may answer the consumer info after delivering the only value
    but before it reaches the client: a marker decided by what the client received came
    first, and the listing was empty (a registered fail-closed handler unseen, a grant not
    revoked) in about 1 of 200 watches here. Many watches, 20 at a time, as a busy
    dispatcher makes them."""
    from hookbus._core.consumers import watch_keys
    from hookbus._core.kv import release_consumer

    kv = await nc.jetstream().create_key_value(bucket=f"watch_{id(nc)}")
    await kv.put("only.key", b"v")
    await kv.put("gone.key", b"v")
    await kv.delete("gone.key")  # the stream's last message: a delete marker

    async def first_pass() -> list[str]:
        watch = await watch_keys(kv, ">", ignore_deletes=True)
        try:
            keys = []
            while (entry := await watch.updates(timeout=5)) is not None:
                keys.append(entry.key)
            return keys
        finally:
            await release_consumer(watch._sub)

    passes = []
    for _ in range(150):
        passes += await asyncio.gather(*(first_pass() for _ in range(20)))
    empty = sum(1 for keys in passes if not keys)
    assert empty == 0 and all(keys == ["only.key"] for keys in passes), f"{empty} of 3000 empty"


async def test_a_stream_takes_at_most_1000_consumers(embedded_server) -> None:
    """The bundled nats-server's limit: a stream takes 1,000 consumers and refuses the next
    (err 10026). An embedded dispatcher holds one on the handlers stream while it runs (its
    registry watch), so one JetStream serves at most about 1,000 embedded agents
    (docs/performance.md); the server's own consumers are not counted here."""
    import nats
    from nats.js.api import ConsumerConfig
    from nats.js.errors import BadRequestError

    nc = await nats.connect(embedded_server.url)
    try:
        js = nc.jetstream()
        await js.create_key_value(bucket="consumer_limit", history=1)
        created = 0
        with pytest.raises(BadRequestError) as refused:
            for _ in range(1001):
                await js.add_consumer("KV_consumer_limit", ConsumerConfig(inactive_threshold=60))
                created += 1
        assert created == 1000, created
        assert refused.value.err_code == 10026, refused.value
    finally:
        await nc.close()
