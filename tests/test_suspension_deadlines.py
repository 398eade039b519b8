"""A caller's timeout bounds every store write its call makes, on a 3-node cluster whose
R3 suspensions and approvals buckets lost quorum (2 of 3 servers killed).

- ``hook(label, timeout_s=2)`` raises `HookbusTimeoutError` (the store stayed unavailable)
  by its timeout (plus a margin), not after the store's own retry deadline (15 s); so do
  ``resolve_hook`` and ``cancel_hook`` given ``timeout_s=2``;
- an ``emit(..., timeout_s=2)`` whose handler asks for approval is denied by its deadline,
  the failure recorded: the approval's store calls gave up by themselves at the deadline;
- once quorum is back, nothing the abandoned calls may have written decides anything: the
  abandoned hook's record is at most pending, and the same call emitted again (same
  idempotency key) is asked again, not allowed;
- a record write retried while its own first try is still being replicated (the stream
  leader alive, its followers gone) is refused by the leader as "wrong last sequence"
  without a sequence (JetStream error 10164: it cannot check the expected revision while
  an earlier write to the key is in flight): an unknown outcome, never a lost race.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import anyio
import pytest
from _cluster import Cluster, wait_for

from hookbus.dispatcher import HookDispatcher
from hookbus.dispatcher._records import RecordStore
from hookbus.schemas import (
    HookbusError,
    HookbusTimeoutError,
    HookResult,
    SuspensionAbortedError,
    SuspensionRecord,
    SuspensionTimeoutError,
)

pytestmark = [pytest.mark.anyio, pytest.mark.faults, pytest.mark.timeout(180)]

HANG_S = 4.0
"""Seconds a call with a 2 s timeout may take here: a bound on a hang, not a speed check."""


async def lose_quorum(cluster: Cluster) -> None:
    for node in cluster.nodes[1:]:
        node.kill()


async def regain_quorum(cluster: Cluster) -> None:
    for node in cluster.nodes[1:]:
        node.start()
    await cluster.wait_ready(60)


async def asker(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="ask_user", approval_prompt="go?", approval_timeout=600.0)


async def test_hook_timeout_bounds_its_store_writes_without_quorum(cluster: Cluster) -> None:
    nc = await cluster.connect(servers=[cluster.nodes[0].url])  # the node that stays up
    try:
        async with HookDispatcher(nc, bucket_replicas=3, approvals=False) as d:
            warm = f"warm:{uuid.uuid4().hex[:8]}"
            await d.suspensions.resolve_hook(warm, {"ok": True})
            assert await d.hook(warm, timeout_s=10) == {"ok": True}  # lease, watch: started
            pending = await _pending_record(d)
            await lose_quorum(cluster)

            label = f"cut:{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            with pytest.raises(HookbusError) as raised:  # the store's deadline is 15 s
                await d.hook(label, timeout_s=2)
            took = time.monotonic() - started
            print(f"hook(timeout_s=2) raised in {took:.2f} s: {raised.value!r}")
            assert took < HANG_S, f"hook(timeout_s=2) raised after {took:.1f} s"
            assert isinstance(raised.value, HookbusTimeoutError), repr(raised.value)

            # settling from another process is bounded the same way
            for settle in (
                lambda: d.resolve_hook(f"other:{label}", {"ok": True}, timeout_s=2),
                lambda: d.cancel_hook(pending, timeout_s=2),
            ):
                started = time.monotonic()
                with pytest.raises(HookbusTimeoutError):
                    await settle()
                took = time.monotonic() - started
                print(f"settling with timeout_s=2 raised in {took:.2f} s")
                assert took < HANG_S, f"settling with timeout_s=2 raised after {took:.1f} s"

            await regain_quorum(cluster)
            got = await _read_through_election(d, label)
            assert got is None or got[0].status == "pending", got
            await _nothing_resolves(d, label)
    finally:
        await nc.close()


async def test_a_write_retried_behind_its_own_unreplicated_try_is_not_a_lost_race(
    cluster: Cluster,
) -> None:
    bucket = f"inflight_{uuid.uuid4().hex[:8]}"
    nc = await cluster.connect()
    try:
        await nc.jetstream().create_key_value(bucket=bucket, history=1, replicas=3)
        leader = await cluster.stream_leader(nc, f"KV_{bucket}")
    finally:
        await nc.close()
    nc = await cluster.connect(servers=[cluster.node(leader).url])
    try:
        # a first try whose ack does not come within 1 s: its write stays in flight
        kv = await nc.jetstream(timeout=1.0).key_value(bucket)
        for node in cluster.nodes:
            if node.name != leader:
                node.kill()
        store = RecordStore(kv, deadline_s=5.0)
        record = SuspensionRecord(label="in-flight", status="resolved", resolution={"ok": 1})
        try:
            got: object = await store.create(record)
        except HookbusTimeoutError:
            got = "outcome unknown"
        # None would say another writer created the record first: nobody else wrote
        assert got == "outcome unknown", got
    finally:
        await nc.close()


async def test_emit_deadline_bounds_its_approval_writes_without_quorum(cluster: Cluster) -> None:
    nc = await cluster.connect(servers=[cluster.nodes[0].url])
    try:
        async with HookDispatcher(nc, bucket_replicas=3) as d:
            event = f"deadline:{uuid.uuid4().hex[:8]}"
            d.register(event, asker, name="guard", failure_policy="deny")
            warm = await d.emit(event, {"n": 0}, timeout_s=0.5)  # buckets open, lease written
            assert warm.action == "deny", warm
            await lose_quorum(cluster)

            key = f"call-{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            result = await d.emit(event, {"n": 1}, idempotency_key=key, timeout_s=2)
            took = time.monotonic() - started
            print(f"emit(timeout_s=2) decided in {took:.2f} s: {result.reason!r}")
            assert took < HANG_S, f"emit(timeout_s=2) decided after {took:.1f} s"
            assert result.action == "deny", result
            assert result.decided_by == "guard", result
            assert result.reason.startswith("approval unavailable"), result
            # the approval's store calls gave up by themselves at the deadline (a
            # HookbusTimeoutError), not cancelled past it by the emitter's guard
            [failure] = result.failures
            assert "HookbusTimeoutError" in failure.message, failure

            await regain_quorum(cluster)
            again = await _emit_through_election(d, event, key)
            assert again.action == "deny", again  # asked again (pending), never allowed
    finally:
        await nc.close()


async def _pending_record(d: HookDispatcher) -> str:
    """The label of a pending suspension nobody waits on any more (a wait started, then
    aborted: its record stays pending)."""
    label = f"pending:{uuid.uuid4().hex[:8]}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(_wait_aborted, d, label)
        await wait_for(lambda: _is_pending(d, label), timeout_s=10, interval_s=0.02)
        assert d.suspensions.abort_all() == 1
    return label


async def _is_pending(d: HookDispatcher, label: str) -> bool:
    got = await d.suspensions.get(label)
    return got is not None and got[0].status == "pending"


async def _wait_aborted(d: HookDispatcher, label: str) -> None:
    with contextlib.suppress(SuspensionAbortedError):
        await d.hook(label, timeout_s=60)


async def _read_through_election(d: HookDispatcher, label: str) -> Any:
    for _ in range(30):
        with contextlib.suppress(HookbusError):
            return await d.suspensions.get(label)
    raise AssertionError(f"{label!r} unreadable after quorum came back")


async def _nothing_resolves(d: HookDispatcher, label: str) -> None:
    """A wait on `label` times out with nothing to return (SuspensionTimeoutError), once the
    store answers again: right after quorum returns, the waiter lease's own bucket may
    still be electing (its write then fails by the wait's deadline, HookbusTimeoutError:
    asked again)."""
    for _ in range(20):
        try:
            value = await d.suspensions.for_agent(None).hook(label, timeout_s=1, shared=True)
        except SuspensionTimeoutError:
            return  # waited, and nothing resolved it
        except HookbusTimeoutError:
            continue  # the store, not the wait: still electing
        raise AssertionError(f"{label!r} was resolved meanwhile: {value!r}")
    raise AssertionError(f"the store did not answer a wait on {label!r} after quorum came back")


async def _emit_through_election(d: HookDispatcher, event: str, key: str) -> HookResult:
    result = await d.emit(event, {"n": 1}, idempotency_key=key, timeout_s=2)
    for _ in range(10):  # an election may still deny it as unreachable: ask again
        if "could not be reached" not in (result.reason or "") and "not asked" not in (
            result.reason or ""
        ):
            return result
        result = await d.emit(event, {"n": 1}, idempotency_key=key, timeout_s=2)
    return result


def test_a_peer_offline_at_bucket_creation_is_retried_not_fatal() -> None:
    """A cluster whose meta leader has not yet seen one of its servers (just started, or
    restarting) refuses a 3-replica bucket "no suitable peers for placement, peer offline"
    (err 10005, as a fresh test cluster answered one dispatcher's start): `open_bucket`
    retries that within its deadline. Too few servers for good is not retried."""
    import nats.js.errors

    from hookbus._core.jetstream import is_transient

    def refusal(description: str) -> Exception:
        return nats.js.errors.BadRequestError(code=400, err_code=10005, description=description)

    assert is_transient(refusal("no suitable peers for placement, peer offline"))
    assert not is_transient(refusal("no suitable peers for placement"))
    assert not is_transient(refusal("insufficient resources"))
