"""JetStream consumers are a limited resource (JetStream refuses new ones past its limit,
and then every KV watch fails): reading a bucket must not leave one behind."""

from __future__ import annotations

import pytest

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import APPROVALS_BUCKET, HANDLERS_BUCKET, SUSPENSIONS_BUCKET

pytestmark = pytest.mark.anyio


async def _consumers(nc) -> int:
    js = nc.jetstream()
    total = 0
    for bucket in (HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET):
        total += (await js.stream_info(f"KV_{bucket}")).state.consumer_count
    return total


async def test_repeated_bucket_reads_leave_no_consumer_behind(nc, connect):
    async with HookDispatcher(await connect()) as d:
        before = await _consumers(nc)
        for _ in range(20):
            await d.refresh()  # a complete read of the registry
            await d.suspensions.list()  # one pass over the suspensions
            await d.approval_grants()  # one pass over the grants
        after = await _consumers(nc)
    assert after <= before, (before, after)
    assert await _consumers(nc) <= before - 1  # closing deleted the registry watch's consumer
