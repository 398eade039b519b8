"""A run claim (`Leases.claim`) against a claim that lapses while it is being taken: nats-py's
``create`` reads the key back after the server refused the write as not new, and finds
nothing if the old claim lapsed (its max age) in between; the claim is then taken, not an
error."""

from __future__ import annotations

import uuid
from typing import Any

import nats
import nats.js.errors
import pytest

from hookbus.dispatcher import Leases

pytestmark = pytest.mark.anyio


async def test_a_claim_that_lapses_while_it_is_taken_is_taken(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        leases = await Leases.open(nc)
        create = leases.kv.create
        calls: list[str] = []

        async def lapsed_in_between(key: str, value: bytes, **kw: Any) -> int:
            calls.append(key)
            if len(calls) == 1:  # what nats-py raises when the claim lapsed in between
                raise nats.js.errors.KeyNotFoundError
            return await create(key, value, **kw)

        leases.kv.create = lapsed_in_between  # type: ignore[method-assign]
        key = f"r.test.run-{uuid.uuid4().hex[:8]}"
        assert await leases.claim(key) is None  # taken, by this process
        assert len(calls) == 2
        entry = await leases.kv.get(key)
        assert entry.value == leases.waiter_id.encode()
        await leases.release(key)
    finally:
        await nc.close()
